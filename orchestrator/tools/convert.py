"""``mxload convert``: offline block-FP8 -> MXFP8 checkpoint (docs/contract.md §1.2), described
for vLLM's ModelOpt MXFP8 method (``--format modelopt``, the default) or for vllm-ascend's
own ``--quantization ascend`` (``--format ascend``: what vllm-ascend 0.23.0.post1 serves).

Unsharded (tp=1) and name-preserving: every tensor keeps its checkpoint name and shard
file; merged projections stay unmerged, one tensor per expert. Per quantized linear X
(``X.weight`` F8_E4M3 ``[N, K]`` + ``X.weight_scale_inv``):

* K % 32 == 0: ``X.weight`` F8_E4M3 ``[N, K]`` (the MX payload, *not* transposed: this
  is the checkpoint format, the kernel layout is the loader's business) and
  ``X.weight_scale`` U8 ``[N, K/32]``;
* otherwise ``X.weight`` resolved in the model dtype, no scale, and X listed as kept.

The tensors are the same in both formats; only the description differs. ``modelopt``:
config.json's ``quantization_config`` (``quant_method`` modelopt, ``quant_algo`` MXFP8)
lists under ``ignore`` every module whose 2-D weight the output keeps in the model dtype
(lm_head, embed_tokens, the MoE router ``mlp.gate``, the resolved linears above), plus the
engine profile's own patterns (``--engine``): a ModelOpt config quantizes every linear
and ``ParallelLMHead`` it does not ignore, so without them vLLM would build an MXFP8
lm_head or router and fail to load the BF16 tensor into it (vLLM reads ``ignore`` in
config.json's flat form; ``exclude_modules`` only nested in ``hf_quant_config.json``).
``ascend``: no ``quantization_config``; ``quant_model_description.json`` names every
tensor ``W8A8_MXFP8`` (a weight with its ``weight_scale``) or ``FLOAT``, with
``group_size`` 32, which vllm-ascend's ``AscendModelSlimConfig`` reads per layer.

Everything else is copied byte for byte. An already-MXFP8 checkpoint is accepted and
copied through (its headers and pairing validated on the way), so ``convert`` can also
re-shard-check or move one between stores.

Nothing a user had is lost (:mod:`mxload.orchestrator.runtime.outputs`)
    Before anything is read: DST equal to SRC, or either inside the other, is refused; a
    DST that exists and is not an empty folder is refused unless ``overwrite``; DST's
    parent must exist and take new files. The checkpoint is validated as ``plan`` and
    ``load`` validate it (config, headers, pairing, and the planner's layout-independent
    checks: :func:`mxload.orchestrator.plan.planner.check_checkpoint`), so ``convert`` never
    writes what they refuse. The output is written into a temporary folder beside DST and
    renamed into place only when every file is complete; ``overwrite`` replaces DST whole
    (never a mix of two runs' shard sets). A failed run removes its temporary folder and
    leaves DST as it was.

How it runs (why it is fast)
    Three stages overlap, each on its own thread, so a conversion takes about the
    longest stage, not their sum: a reader fills numpy buffers through the storage seam
    (:class:`mxload.workers.storage.Storage`, the only place with retries) in output order, the
    calling thread converts one tensor at a time, a writer streams results into each
    shard's :class:`SafetensorsWriter` (headers are known before any data is read). The
    fast numerics are :mod:`mxload.workers.numerics.kernels` on numpy arrays: with them the
    process never imports torch (a large share of a small conversion's time); the
    reference backend (``numerics="reference"``, or where numba is unavailable) imports it.

Memory
    Bytes in flight (read buffers plus results not yet written) stay under
    ``window_bytes`` (default :data:`DEFAULT_WINDOW`), except that one tensor larger
    than the window is always let through alone: a checkpoint larger than RAM converts.
    Written buffers are reused for later tensors of the same size (fresh pages cost a
    fault and a zero-fill each); at most another ``window_bytes`` of them are kept idle.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...workers.numerics import kernels
from ...workers.numerics.scales import check_block_scales
from ...workers.safetensors_io import SafetensorsWriter, data_order
from ...workers.storage import ALLOW_OUTSIDE_LINKS, Storage
from ..errors import MxloadError, RunError, UnsupportedError, UsageError
from ..plan.checkpoint import CheckpointMeta
from ..plan.engines import EngineProfile
from ..plan.formats import (
    ASCEND_DESCRIPTION_FILE,
    ASCEND_MXFP8,
    BLOCK_SCALE_SUFFIX,
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_DTYPES,
    MX_GROUP,
    MX_SCALE_SUFFIX,
    SAFETENSORS_ITEMSIZE,
    SINGLE_FILE,
)
from ..plan.planner import (
    check_checkpoint,
    dense_linear_modules,
    quantization_groups,
)
from ..plan.ranges import contiguous
from ..plan.safetensors_header import TensorInfo
from ..runtime.catalog import open_checkpoint
from ..runtime.outputs import OutputDir, check_disjoint

ConvertProgress = Callable[[int, int, int, int], None]
"""``on_progress(tensors_done, tensors_total, bytes_done, bytes_total)`` after each tensor."""

DEFAULT_WINDOW = 256 << 20
"""Bytes in flight between the reader and the writer, by default (see module doc)."""

NUMERICS = ("auto", "fast", "reference")
"""``numerics=`` choices: ``auto`` is ``fast`` where numba works, else ``reference``."""

Converter = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, ...]]
"""(uint8 payload ``[n, k]``, float32 tile scales) -> output arrays of one job."""

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One source tensor (or linear) -> one or two output tensors of one shard."""

    file: str
    kind: str  # "copy", "mx" (payload + scale) or "resolved"
    outputs: tuple[str, ...]
    sources: tuple[TensorInfo, ...]  # copy: the tensor; mx/resolved: weight, block scale
    out_bytes: int

    @property
    def in_bytes(self) -> int:
        return sum(t.nbytes for t in self.sources)

    @property
    def cost(self) -> int:
        return self.in_bytes + (self.out_bytes if self.kind != "copy" else 0)


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    dst_storage_options: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    allow_nonfinite: bool = False,
    on_progress: ConvertProgress | None = None,
    numerics: str = "auto",
    threads: int | None = None,
    window_bytes: int = DEFAULT_WINDOW,
    engine: str = "mxload",
    scale_alg: int | None = None,
    overwrite: bool = False,
    allow_outside_links: bool = False,
    fmt: str | None = None,
) -> dict[str, Any]:
    """Convert ``src`` into ``dst``; returns a summary (tensors, bytes, seconds, GB/s).

    ``numerics`` picks the conversion path (:data:`NUMERICS`); ``threads`` the fast
    kernels' threads (default: the cores this process may use). ``overwrite`` lets a
    non-empty ``dst`` be replaced whole; ``allow_outside_links`` lets a local checkpoint's
    files resolve outside its folder (see :class:`mxload.workers.storage.Storage`);
    ``on_progress`` is called after each tensor (:data:`ConvertProgress`); ``scale_alg``
    the MX scale rule (docs/contract.md §2.2; default: ``engine``'s choice for the model)."""
    if numerics not in NUMERICS:
        raise UsageError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    from ..plan.engines import engine_profile, scale_alg_for
    from ..plan.releases import FORMATS, engine_release

    release = engine_release(engine)
    if fmt is None:  # ModelOpt, unless the named release cannot serve it
        fmt = release.formats[0] if release and "modelopt" not in release.formats else "modelopt"
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", key="--format")
    if release is not None and fmt not in release.formats:
        raise UsageError(
            f"--format {fmt}: {release.name} does not serve it (it serves "
            f"{', '.join(release.formats)}); give --format {release.formats[0]}",
            key="--format",
        )

    profile = engine_profile(engine)
    t0 = time.perf_counter()
    check_disjoint(src, dst)
    out = OutputDir(dst, "DST", overwrite=overwrite, storage_options=dst_storage_options)
    out.check()
    if allow_outside_links:
        storage_options = {**(storage_options or {}), ALLOW_OUTSIDE_LINKS: True}
    meta = open_checkpoint(src, storage_options=storage_options, dtype=dtype)
    cfg = meta.config
    quant = cfg.quant.kind
    if quant == "none":
        raise UnsupportedError(
            f"{src}: convert reads block-FP8 or MXFP8 checkpoints; this one has no "
            "quantization_config",
            file=f"{src}/{CONFIG_FILE}",
            key="quantization_config",
        )
    check_checkpoint(meta)  # the planner's checks: what plan/load refuse, convert refuses
    storage = Storage(src, storage_options)
    # The ascend format is vllm-ascend's description: its MLA needs the dense linears of an
    # Ascend profile whatever --engine names.
    from ..plan.engines import VLLM_ASCEND_0_23

    dense_engine = VLLM_ASCEND_0_23 if fmt == "ascend" and not profile.dense_linears else profile
    specs, jobs, excluded, weight_map = _plan(meta, dense_engine)
    excluded = [*excluded, *profile.model_dtype_modules]
    n_threads = threads or kernels.cpu_share()
    use_fast = numerics == "fast" or (numerics == "auto" and kernels.available())
    if numerics == "fast":
        kernels.require()
    arena = _Arena(max(1, window_bytes))
    alg = scale_alg_for(profile, cfg.architecture, scale_alg)
    mx, resolved = (
        _fast_converters(
            cfg.model_dtype, cfg.quant.block_n, cfg.quant.block_k, n_threads, arena, alg
        )
        if use_fast
        else _reference_converters(cfg.model_dtype, cfg.quant.block_n, cfg.quant.block_k, alg)
    )

    def convert(job: _Job, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        if job.kind == "copy":
            return arrays
        w_info, s_info = job.sources
        n, k = w_info.shape
        s = _scale_f32(arrays[1], s_info.dtype).reshape(tuple(s_info.shape))
        check_block_scales(
            s,
            tensor=s_info.name,
            file=s_info.file,
            tile_row0=0,
            tile_col0=0,
            allow_nonfinite=allow_nonfinite,
        )
        return (mx if job.kind == "mx" else resolved)(arrays[0].reshape(n, k), s)

    stage_seconds: dict[str, float] = {}
    with out:
        tmp = out.begin()
        source_bytes = _write(
            tmp, meta, storage, specs, jobs, excluded, weight_map, convert, on_progress,
            dst_storage_options=dst_storage_options, window_bytes=window_bytes, arena=arena,
            stage_seconds=stage_seconds, fmt=fmt,
        )  # fmt: skip
        _check_unchanged(storage, meta)
        # What is put in place must pass the validator plan and load run (a guard on
        # this module's own rules: the output is read back, headers only).
        check_checkpoint(open_checkpoint(tmp, storage_options=dst_storage_options))
    files = sorted(specs)
    seconds = time.perf_counter() - t0
    return {
        "tensors": sum(len(s) for s in specs.values()),
        "files": len(files),
        "source_bytes": source_bytes,
        "excluded_modules": sorted(set(excluded)),
        "seconds": round(seconds, 3),
        "source_gb_per_s": round(source_bytes / seconds / 1e9, 4) if seconds else None,
        "backend": "cpu-fast" if use_fast else "cpu-reference",
        "threads": n_threads if use_fast else None,
        "stage_seconds": stage_seconds,
    }


def _check_unchanged(storage: Storage, meta: CheckpointMeta) -> None:
    """The files this run read still carry the tags the checkpoint was opened with, as a
    rank checks after a load (``Storage.changed``): a source rewritten in place while it
    was read gives an output mixing two checkpoints, which is never put in place
    (RunError, exit 1; docs/contract.md §1.2). A store that tags nothing (a plain HTTP
    server) cannot be checked."""
    tags = meta.file_tags
    if not tags or not all(tags.values()):
        return
    changed = storage.changed(tags)
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        raise RunError(
            f"{storage.url(changed[0])}{more} changed while this run read it (rewritten in "
            "place); the output would mix two checkpoints and was not written: run "
            "convert again once the checkpoint is written",
            file=changed[0],
        )


def _write(
    root: str,
    meta: CheckpointMeta,
    storage: Storage,
    specs: Specs,
    jobs: list[_Job],
    excluded: list[str],
    weight_map: dict[str, str],
    convert: Callable[[_Job, tuple[np.ndarray, ...]], tuple[np.ndarray, ...]],
    on_progress: ConvertProgress | None,
    *,
    dst_storage_options: Mapping[str, Any] | None,
    window_bytes: int,
    arena: _Arena,
    stage_seconds: dict[str, float],
    fmt: str = "modelopt",
) -> int:
    """Every shard, config.json and the index into ``root`` (the temporary folder); the
    source bytes read."""
    import fsspec  # type: ignore[import-untyped]

    fs, root_path = fsspec.core.url_to_fs(root, **(dict(dst_storage_options or {})))
    pipe = _Pipeline(
        storage,
        {f: _join(root, f) for f in specs},
        specs,
        dst_storage_options,
        window_bytes=max(1, window_bytes),
        arena=arena,
    )

    counts = [0, 0]
    total_bytes = sum(job.in_bytes for job in jobs)

    def report(job: _Job) -> None:
        counts[0] += 1
        counts[1] += job.in_bytes
        if on_progress is not None:
            on_progress(counts[0], len(jobs), counts[1], total_bytes)

    try:
        pipe.run(jobs, convert, report)
    finally:
        stage_seconds.update(pipe.stage_seconds())

    raw_config = json.loads(storage.read_file(CONFIG_FILE))
    if fmt == "ascend":
        # vllm-ascend's `--quantization ascend` reads the scheme of every tensor from its
        # description file; a quantization_config would make vLLM dispatch elsewhere.
        raw_config.pop("quantization_config", None)
        names = {name for file_specs in specs.values() for name, _, _ in file_specs}
        desc: dict[str, Any] = {"model_quant_type": ASCEND_MXFP8, "group_size": MX_GROUP}
        for name in sorted(names):
            if not name.endswith("_scale"):
                desc[name] = ASCEND_MXFP8 if f"{name}_scale" in names else "FLOAT"
        with fs.open(_join(root_path, ASCEND_DESCRIPTION_FILE), "w") as f:
            json.dump(desc, f, indent=2)
    else:
        # config.json's flat form: vLLM reads the modules kept in the model dtype from
        # "ignore" (it reads "exclude_modules" only inside hf_quant_config.json's nesting).
        # Written for an MXFP8 source too: one in the ascend form has no quantization_config.
        raw_config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "ignore": sorted(set(excluded)),
            "kv_cache_quant_algo": None,
        }
    with fs.open(_join(root_path, CONFIG_FILE), "w") as f:
        json.dump(raw_config, f, indent=2)
    files = sorted(specs)
    if len(files) > 1 or files != [SINGLE_FILE]:
        # total_size of what this checkpoint holds (HF's meaning), not of the source:
        # scales changed dtype and shape, and excluded modules grew to the model dtype.
        total = sum(
            math.prod(shape) * SAFETENSORS_ITEMSIZE[st_dtype]
            for file_specs in specs.values()
            for _, st_dtype, shape in file_specs
        )
        with fs.open(_join(root_path, INDEX_FILE), "w") as f:
            json.dump(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                f,
                indent=2,
            )
    _carry_files(storage, fs, root_path)
    return counts[1]


SERVING_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
"""The files besides the weights that ``LLM(model=DST)`` reads (tokenizer, generation
defaults, chat template, image and video preprocessors), copied as they are."""


SERVING_FILE_MAX_BYTES = 1 << 30
"""Largest serving file copied (a tokenizer of a large vocabulary is tens of MiB)."""


def _carry_files(storage: Storage, fs: Any, root_path: str) -> None:
    """Copy the source's :data:`SERVING_FILES` (those it has) into the output, so that
    the converted folder serves as the source would (docs/contract.md §5, convert). A
    file the store will not say it has (an S3 key without list permission answers 403
    where it is absent) is left out with a warning: the weights do not depend on it."""
    for name in SERVING_FILES:
        try:
            if not storage.exists(name):
                continue
            data = storage.read_file(name, SERVING_FILE_MAX_BYTES)
        except MxloadError as err:
            log.warning("%s not carried into the output: %s", name, err)
            continue
        with fs.open(_join(root_path, name), "wb") as f:
            f.write(data)


# --- what to write ---------------------------------------------------------------------------

Specs = dict[str, list[tuple[str, str, tuple[int, ...]]]]


def _plan(
    meta: CheckpointMeta, engine: EngineProfile
) -> tuple[Specs, list[_Job], list[str], dict[str, str]]:
    """Output tensors per shard, and the jobs that make them in each shard's data order;
    the linears ``engine`` holds in the model dtype are written resolved."""
    cfg = meta.config
    quant = cfg.quant.kind
    model_st = MODEL_DTYPES[cfg.model_dtype]
    specs: Specs = {}
    made_by: dict[str, _Job] = {}
    # A module whose K is not a multiple of 32 falls back to the model dtype; so does every
    # module that must agree with it on being quantized (planner.quantization_groups),
    # or the loader would refuse the output (one MoE block: one layout for w13 and w2).
    fallback: set[str] = set()
    if quant == "block_fp8":
        for name, info in meta.tensors.items():
            if name.endswith(".weight") and info.dtype == "F8_E4M3" and len(info.shape) == 2:
                if info.shape[1] % MX_GROUP:
                    fallback.add(name[: -len(".weight")])
        # Linears the engine needs unquantized (DeepSeek's kv_b_proj: MLA absorbs it; its
        # MTP layer's eh_proj, a plain nn.Linear), also in layers past the decoder's.
        dense = dense_linear_modules(cfg, engine)
        fallback.update(dense)
        kept = {m.split(".", 3)[3] for m in dense if m.startswith("model.layers.")}
        for name in meta.tensors:
            parts = name.split(".", 3)
            if parts[:2] == ["model", "layers"] and parts[2].isdigit() and len(parts) == 4:
                module = parts[3].rsplit(".", 1)[0]
                if int(parts[2]) >= cfg.num_hidden_layers and module in kept:
                    fallback.add(f"model.layers.{parts[2]}.{module}")
        for group in quantization_groups(cfg):
            if fallback.intersection(group):
                fallback.update(group)
    excluded: list[str] = list(cfg.quant.not_converted)
    weight_map: dict[str, str] = {}
    for name in sorted(meta.tensors):
        info = meta.tensors[name]
        out = specs.setdefault(info.file, [])
        if quant == "block_fp8" and name.endswith("." + BLOCK_SCALE_SUFFIX):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else ""
        scale_name = f"{module}.{BLOCK_SCALE_SUFFIX}"
        if quant == "block_fp8" and module and info.dtype == "F8_E4M3" and meta.has(scale_name):
            n, k = info.shape
            sources = (info, meta.tensor(scale_name))
            if module not in fallback:
                mx_scale = f"{module}.{MX_SCALE_SUFFIX}"
                out.append((name, "F8_E4M3", (n, k)))
                out.append((mx_scale, "U8", (n, k // MX_GROUP)))
                job = _Job(info.file, "mx", (name, mx_scale), sources, n * k + n * k // MX_GROUP)
                made_by[name] = made_by[mx_scale] = job
                weight_map[mx_scale] = info.file
            else:
                out.append((name, model_st, (n, k)))
                itemsize = SAFETENSORS_ITEMSIZE[model_st]
                made_by[name] = _Job(info.file, "resolved", (name,), sources, n * k * itemsize)
                excluded.append(module)
        else:
            out.append((name, info.dtype, tuple(info.shape)))
            made_by[name] = _Job(info.file, "copy", (name,), (info,), info.nbytes)
            if module and len(info.shape) == 2 and info.dtype != "F8_E4M3":
                excluded.append(module)  # a 2-D weight kept in the model dtype
        weight_map[name] = info.file
    jobs: list[_Job] = []
    for file in sorted(specs):
        seen: set[int] = set()
        for name in data_order(specs[file]):
            job = made_by[name]
            if id(job) not in seen:
                seen.add(id(job))
                jobs.append(job)
    return specs, jobs, excluded, weight_map


def _fast_converters(
    model_dtype: str, block_n: int, block_k: int, threads: int, arena: _Arena, scale_alg: int = 0
) -> tuple[Converter, Converter]:
    """The fused kernel (scale rule 0); under rule 1 (docs/contract.md §2.2) the resolve
    kernel, then the MX kernel on its bits."""
    mode = kernels.MODE_OF[model_dtype]

    def mx(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, ...]:
        n, k = w.shape
        out = (arena.get(n * k), arena.get(n * (k // MX_GROUP)))
        if scale_alg:
            bits = kernels.resolve(
                w, s, block_n=block_n, block_k=block_k, mode=mode, threads=threads
            )
            if mode == kernels.MODE_FP16:  # the MX kernel reads bf16 or f32 bits
                bits = bits.view(np.float16).astype(np.float32).view(np.uint32)
            q, e = out[0][: n * k], out[1][: n * (k // MX_GROUP)]
            kernels.run_mx(bits.reshape(-1), mode == kernels.MODE_BF16, q, e, threads, scale_alg)
            return q.reshape(n, k), e.reshape(n, k // MX_GROUP)
        return kernels.convert(
            w, s, block_n=block_n, block_k=block_k, mode=mode, threads=threads, out=out
        )

    def resolved(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, ...]:
        bits = kernels.resolve(w, s, block_n=block_n, block_k=block_k, mode=mode, threads=threads)
        return (bits,)

    return mx, resolved


def _reference_converters(
    model_dtype: str, block_n: int, block_k: int, scale_alg: int = 0
) -> tuple[Converter, Converter]:
    """The reference backend (eager torch, ``select_backend("cpu", prefer_fast=False)``)
    on the same arrays."""
    import torch

    from ...workers.numerics.backend import ConvertPart
    from ...workers.numerics.reference import MODEL_TORCH_DTYPE
    from ...workers.numerics.select import select_backend

    backend = select_backend("cpu", prefer_fast=False).with_scale_alg(scale_alg)
    dtype = MODEL_TORCH_DTYPE[model_dtype]

    def part(w: np.ndarray, s: np.ndarray) -> ConvertPart:
        return ConvertPart(torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(s))

    def mx(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, ...]:
        [(q, e)] = backend.convert([part(w, s)], block_n=block_n, block_k=block_k, dtype=dtype)
        return q.view(torch.uint8).numpy(), e.numpy()

    def resolved(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, ...]:
        p = part(w, s)
        r = backend.resolve_block(
            p.w_fp8, p.scale_inv_f32, row0=0, col0=0, block_n=block_n, block_k=block_k, dtype=dtype
        )
        return (r.view(torch.uint8).numpy(),)

    return mx, resolved


# --- the pipeline ----------------------------------------------------------------------------


class _Window:
    """Bytes in flight, bounded; one item larger than the bound may pass alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cv = threading.Condition()
        self.closed = False

    def acquire(self, n: int) -> bool:
        with self._cv:
            while not self.closed and self.used and self.used + n > self.limit:
                self._cv.wait()
            if self.closed:
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


class _Arena:
    """Reusable byte buffers, by exact size (an MoE checkpoint repeats a few shapes many
    times). Fresh memory costs a page fault and a kernel zero-fill per page on first touch:
    about as much CPU as the copy itself. Idle buffers are kept up to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.idle -= nbytes
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def put(self, *arrays: np.ndarray) -> None:
        with self._lock:
            for a in arrays:
                base = a if a.base is None else a.base
                if (
                    isinstance(base, np.ndarray)
                    and base.dtype == np.uint8
                    and base.ndim == 1
                    and self.idle + base.nbytes <= self.limit
                ):
                    self._free.setdefault(base.nbytes, []).append(base)
                    self.idle += base.nbytes


_END = object()


class _Pipeline:
    """Reader thread -> caller (converts) -> writer thread; the first error anywhere stops
    all three, discards every shard being written and is raised in the caller (whose
    temporary output folder is then removed whole)."""

    def __init__(
        self,
        storage: Storage,
        paths: dict[str, str],
        specs: Specs,
        dst_storage_options: Mapping[str, Any] | None,
        *,
        window_bytes: int,
        arena: _Arena,
    ) -> None:
        self.storage = storage
        self.paths = paths
        self.specs = specs
        self.dst_options = dst_storage_options
        self.window = _Window(window_bytes)
        self.arena = arena
        self.read_q: queue.Queue[Any] = queue.Queue()
        self.write_q: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.seconds = {"read": 0.0, "convert": 0.0, "write": 0.0, "wait_read": 0.0}

    def stage_seconds(self) -> dict[str, float]:
        """Busy seconds per stage (read, convert, write) and the caller's wait for reads:
        with perfect overlap the wall time is about the largest."""
        return {k: round(v, 3) for k, v in self.seconds.items()}

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.window.close()

    def _reader(self, jobs: list[_Job]) -> None:
        try:
            for job in jobs:
                if not self.window.acquire(job.cost):
                    return
                t = time.perf_counter()
                arrays = []
                for info in job.sources:
                    buf = self.arena.get(info.nbytes)
                    if info.nbytes:
                        self.storage.read_ranges_into(
                            info.file, [contiguous(info.start, info.nbytes)], buf.data
                        )
                    arrays.append(buf)
                self.seconds["read"] += time.perf_counter() - t
                self.read_q.put((job, tuple(arrays)))
        except BaseException as exc:
            self._fail(exc)
        finally:
            self.read_q.put(_END)

    def _writer(self) -> None:
        writers: dict[str, SafetensorsWriter] = {}
        left = {f: len(s) for f, s in self.specs.items()}
        try:
            for f in [f for f, n in left.items() if n == 0]:
                self._open(f, writers).close()  # a shard with no tensors still exists
                writers.pop(f)
            while True:
                item = self.write_q.get()
                if item is _END:
                    break
                if self.error is not None:
                    continue  # drain: the caller stops producing
                job, arrays, inputs = item
                t = time.perf_counter()
                w = writers.get(job.file) or self._open(job.file, writers)
                for name, arr in zip(job.outputs, arrays, strict=True):
                    w.write(name, arr)
                left[job.file] -= len(job.outputs)
                if left[job.file] == 0:
                    writers.pop(job.file).close()
                self.seconds["write"] += time.perf_counter() - t
                # Written (a local write has consumed the bytes; remote writers copy what
                # they hold back), so the buffers can be handed out again.
                self.arena.put(*{id(a): a for a in (*arrays, *inputs)}.values())
                self.window.release(job.cost)
        except BaseException as exc:
            self._fail(exc)
        finally:
            for w in writers.values():
                w.abort()

    def _open(self, file: str, writers: dict[str, SafetensorsWriter]) -> SafetensorsWriter:
        writers[file] = SafetensorsWriter(
            self.paths[file],
            self.specs[file],
            metadata={"format": "pt"},
            storage_options=self.dst_options,
        )
        return writers[file]

    def run(
        self,
        jobs: list[_Job],
        convert: Callable[[_Job, tuple[np.ndarray, ...]], tuple[np.ndarray, ...]],
        progress: Callable[[_Job], None] | None = None,
    ) -> None:
        """Read, ``convert`` (on this thread) and write every job, in order. Raises the
        first error of any stage once all three have stopped, every open shard discarded."""
        reader = threading.Thread(target=self._reader, args=(jobs,), name="convert-read")
        writer = threading.Thread(target=self._writer, name="convert-write")
        reader.start()
        writer.start()
        try:
            while self.error is None:
                t = time.perf_counter()
                item = self.read_q.get()
                t1 = time.perf_counter()
                self.seconds["wait_read"] += t1 - t
                if item is _END:
                    break
                job, arrays = item
                outputs = convert(job, arrays)
                self.seconds["convert"] += time.perf_counter() - t1
                self.write_q.put((job, outputs, arrays))
                if progress is not None:
                    progress(job)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self.write_q.put(_END)
            writer.join()
            reader.join()  # an error closed the window, so a waiting reader returns
        if self.error is not None:
            raise self.error


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _scale_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Block scales as float32: F32 as stored, BF16 widened exactly (its bits are the
    upper half of the float32's)."""
    if dtype == "BF16":
        out: np.ndarray = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return out
    return raw.view(np.float32)
