"""``mxload convert``: offline block-FP8 -> ModelOpt-style MXFP8 checkpoint (SPEC §1.2).

Unsharded (tp=1) and name-preserving: every tensor keeps its checkpoint name and shard
file; merged projections stay unmerged, one tensor per expert. Per quantized linear X
(``X.weight`` F8_E4M3 ``[N, K]`` + ``X.weight_scale_inv``):

* K % 32 == 0: ``X.weight`` F8_E4M3 ``[N, K]`` (the MX payload, *not* transposed: this
  is the checkpoint format, the kernel layout is the loader's business) and
  ``X.weight_scale`` U8 ``[N, K/32]``;
* otherwise ``X.weight`` resolved in the model dtype, no scale, and X listed in
  ``exclude_modules``.

Everything else is copied byte for byte. An already-MXFP8 checkpoint is accepted and
copied through (its headers and pairing validated on the way), so ``convert`` can also
re-shard-check or move one between stores.

Memory stays bounded by one tensor (plus its result): the output's headers are known
before any data is read, so each shard is streamed (``SafetensorsWriter``), one tensor at
a time, which is how a checkpoint larger than RAM converts.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from orchestrator.catalog import open_checkpoint
from orchestrator.errors import UnsupportedError
from orchestrator.formats import (
    BLOCK_SCALE_SUFFIX,
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_DTYPES,
    MX_GROUP,
    MX_SCALE_SUFFIX,
    SAFETENSORS_ITEMSIZE,
    SINGLE_FILE,
)
from orchestrator.ranges import contiguous
from workers.loader import MODEL_TORCH_DTYPE
from workers.safetensors_io import SafetensorsWriter, tensor_from_bytes
from workers.storage import Storage


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    dst_storage_options: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    allow_nonfinite: bool = False,
    progress: bool = False,
    backend: Any = None,
) -> dict[str, Any]:
    """Convert ``src`` into ``dst``; returns a summary (tensors, bytes, seconds, GB/s)."""
    import fsspec

    from workers.numerics.reference import check_block_scales

    if backend is None:
        from workers.numerics.backend import select_backend

        backend = select_backend("cpu")
    t0 = time.perf_counter()
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
    storage = Storage(src, storage_options)
    model_dtype = MODEL_TORCH_DTYPE[cfg.model_dtype]
    model_st = MODEL_DTYPES[cfg.model_dtype]

    # Output specs per file, and what each output tensor is made from.
    plan: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    recipe: dict[str, tuple[str, str]] = {}  # out name -> (kind, module-or-tensor)
    excluded: list[str] = list(cfg.quant.not_converted)
    weight_map: dict[str, str] = {}
    for name in sorted(meta.tensors):
        info = meta.tensors[name]
        specs = plan.setdefault(info.file, [])
        if quant == "block_fp8" and name.endswith("." + BLOCK_SCALE_SUFFIX):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else ""
        if (
            quant == "block_fp8"
            and module
            and info.dtype == "F8_E4M3"
            and meta.has(f"{module}.{BLOCK_SCALE_SUFFIX}")
        ):
            n, k = info.shape
            if k % MX_GROUP == 0:
                specs.append((name, "F8_E4M3", (n, k)))
                specs.append((f"{module}.{MX_SCALE_SUFFIX}", "U8", (n, k // MX_GROUP)))
                recipe[name] = ("mx", module)
                recipe[f"{module}.{MX_SCALE_SUFFIX}"] = ("mx_scale", module)
                weight_map[f"{module}.{MX_SCALE_SUFFIX}"] = info.file
            else:
                specs.append((name, model_st, (n, k)))
                recipe[name] = ("resolved", module)
                excluded.append(module)
        else:
            specs.append((name, info.dtype, tuple(info.shape)))
            recipe[name] = ("copy", name)
        weight_map[name] = info.file

    fs, root = fsspec.core.url_to_fs(dst, **(dict(dst_storage_options or {})))
    fs.makedirs(root, exist_ok=True)
    cached_scale: dict[str, torch.Tensor] = {}
    source_bytes = 0
    written = 0
    files = sorted(plan)
    for fi, file in enumerate(files):
        writer = SafetensorsWriter(
            _join(dst, file),
            plan[file],
            metadata={"format": "pt"},
            storage_options=dst_storage_options,
        )
        with writer:
            for name in writer.order:
                kind, what = recipe[name]
                if kind == "copy":
                    info = meta.tensor(what)
                    buf = _read(storage, info.file, info.start, info.nbytes)
                    source_bytes += info.nbytes
                    writer.write(name, buf)
                elif kind == "mx_scale":
                    writer.write(name, cached_scale.pop(what))
                else:
                    w_info = meta.tensor(f"{what}.weight")
                    s_info = meta.tensor(f"{what}.{BLOCK_SCALE_SUFFIX}")
                    n, k = w_info.shape
                    w = tensor_from_bytes(
                        _read(storage, w_info.file, w_info.start, w_info.nbytes), "F8_E4M3", (n, k)
                    )
                    s = tensor_from_bytes(
                        _read(storage, s_info.file, s_info.start, s_info.nbytes),
                        "F32",
                        tuple(s_info.shape),
                    )
                    source_bytes += w_info.nbytes + s_info.nbytes
                    check_block_scales(
                        s,
                        tensor=s_info.name,
                        file=s_info.file,
                        tile_row0=0,
                        tile_col0=0,
                        allow_nonfinite=allow_nonfinite,
                    )
                    args = dict(
                        row0=0,
                        col0=0,
                        block_n=cfg.quant.block_n,
                        block_k=cfg.quant.block_k,
                        dtype=model_dtype,
                    )
                    if kind == "mx":
                        payload, scale = backend.convert_block_to_mx(w, s, **args)
                        cached_scale[what] = scale.cpu().contiguous()
                        writer.write(name, payload.cpu().contiguous())
                    else:
                        writer.write(name, backend.resolve_block(w, s, **args).cpu().contiguous())
                written += 1
                if progress:
                    sys.stderr.write(
                        f"\r  file {fi + 1}/{len(files)}  tensors {written}/{len(recipe)}  "
                        f"{source_bytes / 1e6:.1f} MB read   "
                    )
                    sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")

    raw_config = json.loads(storage.read_file(CONFIG_FILE))
    if quant == "block_fp8":
        raw_config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "exclude_modules": sorted(set(excluded)),
            "kv_cache_quant_algo": None,
        }
    with fs.open(_join(root, CONFIG_FILE), "w") as f:
        json.dump(raw_config, f, indent=2)
    if len(files) > 1 or files != [SINGLE_FILE]:
        # total_size of what this checkpoint holds (HF's meaning), not of the source:
        # scales changed dtype and shape, and excluded modules grew to the model dtype.
        total = sum(
            math.prod(shape) * SAFETENSORS_ITEMSIZE[st_dtype]
            for specs in plan.values()
            for _, st_dtype, shape in specs
        )
        with fs.open(_join(root, INDEX_FILE), "w") as f:
            json.dump(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                f,
                indent=2,
            )
    seconds = time.perf_counter() - t0
    return {
        "tensors": len(recipe),
        "files": len(files),
        "source_bytes": source_bytes,
        "excluded_modules": sorted(set(excluded)),
        "seconds": round(seconds, 3),
        "source_gb_per_s": round(source_bytes / seconds / 1e9, 4) if seconds else None,
        "backend": getattr(backend, "name", ""),
    }


def _read(storage: Storage, file: str, start: int, nbytes: int) -> memoryview:
    buf = bytearray(nbytes)
    out = memoryview(buf)
    if nbytes:
        storage.read_ranges_into(file, [contiguous(start, nbytes)], out)
    return out
