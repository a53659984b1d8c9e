"""Benchmarks 1-6: conversion, offline convert, load vs read, read amplification, staging,
reload vs cold load. Every headline is a ratio against a baseline timed in the same run.

Purpose: tell the truth about where a load's time goes on the CPU path, on checkpoints
with the real shapes of Qwen3-30B-A3B-FP8 (hidden 2048, 32 q / 4 kv heads of 128,
experts of 768, 128x128 block scales), made by ``mxload.orchestrator.tools.synth.make_checkpoint`` with
fewer layers (and, for the small size, fewer experts) and a smaller vocabulary so the
files are ~2 GB (``--quick``: ~200 MB). What each benchmark measures and against what:

1. ``kernels``: GB/s of FP8 source through ``select_backend("cpu", prefer_fast=...)
   .convert`` (the call the loader makes) on one decoder layer's linears
   (attention + experts: 128 in the full run, 8 with --quick), reference vs fast vs a
   torch memcpy of the same bytes; plus ``bench/bench_convert.py`` (another engineer's
   per-shape benchmark, delegated to, results under ``OUT/suite-convert/``).
2. ``convert``: the ``mxload convert`` command as whole processes on the same
   checkpoint, ``--numerics reference`` (the naive path) vs ``--numerics fast``, against
   ``cat`` of the files (warm and cold page cache) and writing as many bytes (``dd``).
3. ``load``: RankLoader (no Ray), tp=1, against reading the same planned byte ranges
   through the storage seam, against the loader fed from RAM (convert only), and the
   ratios load / max(read, convert) (perfect overlap) and load / (read + convert) (none);
   plus the Ray load (tp 2 x dp 2, EP) taken from benchmark 6's cold loads.
4. ``amplification``: bytes read / bytes needed per rank, predicted by the plan and
   measured by running every rank's loader, at tp 2/4/8, against every rank reading the
   whole checkpoint.
5. ``staging``: predicted vs measured peak staging per rank (the manifest fields) at the
   default budget and at the smallest budget a load accepts (row-chunked conversion).
6. ``reload``: ``Session.reload`` vs ``Session.load`` wall time on the demo-sized
   checkpoint (preset qwen3-moe-tiny) and the large one, embedded Ray with 4 virtual NPUs.

Limits: CPU only (``device="cpu"``); the page cache is warm except where a row says
"cold" (evicted with posix_fadvise); synthetic weights have the value distribution of
``mxload.orchestrator.tools.synth`` (six binades of row magnitude, tile scales over ten binades), which the
fast kernel's speed depends on a little (tables per tile and scale). No timing is
asserted anywhere.

Usage: ``python bench/run.py [--quick] [--only kernels,convert,...]`` (this module has no
command of its own: the sections share checkpoints and a Ray head).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    ROOT,
    Rate,
    Timing,
    cat_files,
    evict_page_cache,
    fmt_bytes,
    gb,
    interleave,
    log,
    memcpy_fn,
    paired_ratio,
    run_timed,
    write_zeros,
)

BLOCK = 128
REAL_DIMS: dict[str, Any] = {
    # Qwen3-30B-A3B-FP8 (orchestrator/configs/qwen3-30b-a3b-fp8.json), all MoE layers.
    "hidden_size": 2048,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
}


@dataclass(frozen=True)
class Size:
    """How a benchmark checkpoint shrinks Qwen3-30B-A3B: layers, experts, vocabulary."""

    layers: int
    experts: int
    vocab: int

    def overrides(self) -> dict[str, Any]:
        return {
            **REAL_DIMS,
            "num_hidden_layers": self.layers,
            "num_experts": self.experts,
            "vocab_size": self.vocab,
        }

    def describe(self) -> str:
        return (
            f"Qwen3-30B-A3B dims, {self.layers} layers x {self.experts} experts, vocab {self.vocab}"
        )


# Full: 128 real experts per layer (EP placement as in production), 3 layers, ~2.0 GB.
# Quick: 12 experts, 2 layers, ~0.19 GB. The vocabulary is cut because embed_tokens and
# lm_head (2 x 622 MB at the real 151936) are copied, not converted, and would dominate.
SIZE_FULL = Size(layers=3, experts=128, vocab=16384)
SIZE_QUICK = Size(layers=2, experts=12, vocab=4096)
DEMO_PRESET = "qwen3-moe-tiny"
"""The demo's checkpoint (``mxload demo``): the "demo-sized" one of benchmark 6."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint the suite wrote."""

    path: str
    label: str
    nbytes: int
    """Tensor bytes (the index's total_size)."""
    files: tuple[str, ...]
    """Absolute paths of its .safetensors shards."""
    make_seconds: float


def _tmpfs_dir(need: int) -> Path | None:
    """A fresh scratch folder on tmpfs (/dev/shm) with ``need`` bytes free, else None."""
    root = Path("/dev/shm")
    try:
        if not root.is_dir() or shutil.disk_usage(root).free < need:
            return None
        return Path(tempfile.mkdtemp(prefix="mxbench-", dir=root))
    except OSError:
        return None


def make_ckpt(path: Path, label: str, *, preset: str, seed: int, size: Size | None) -> Checkpoint:
    from mxload.orchestrator.tools.synth import make_checkpoint

    t0 = time.perf_counter()
    summary = make_checkpoint(
        str(path), preset, seed=seed, shards=2, overrides=size.overrides() if size else None
    )
    secs = time.perf_counter() - t0
    files = tuple(str(path / f) for f in summary["files"] if f.endswith(".safetensors"))
    for f in files:  # written pages reach the disk, so eviction can make reads cold
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return Checkpoint(str(path), label, int(summary["bytes"]), files, secs)


def _same_mx(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Payload and scale bytes equal, NaN payload bytes 0x7F/0xFF counted equal (docs/contract.md §2.2)."""
    x, y = a[0].view(torch.uint8).clone(), b[0].view(torch.uint8).clone()
    x[(x & 0x7F) == 0x7F] = 0x7F
    y[(y & 0x7F) == 0x7F] = 0x7F
    return bool(torch.equal(x, y)) and bool(torch.equal(a[1], b[1]))


def block_fp8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight with ``mxload.orchestrator.tools.synth``'s value distribution: Gaussian rows whose
    magnitudes span six binades, saturated to +-448; tile scales log-uniform in 2^-14..2^-4."""
    g = torch.Generator().manual_seed(seed)
    row = torch.exp2(-6.0 * torch.rand(n, 1, generator=g)) * 150.0
    w = (torch.randn(n, k, generator=g) * row).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    tiles = (-(-n // BLOCK), -(-k // BLOCK))
    s = torch.exp2(-14.0 + 10.0 * torch.rand(tiles, generator=g)).to(torch.float32)
    return w, s


class _MemStorage:
    """The storage seam served from RAM: the loader's reads become memcpys, so a load
    through it times conversion and the loop around it, not I/O."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self._files = {name: memoryview(data) for name, data in files.items()}

    def read_ranges_into(self, relpath: str, ranges: Sequence[Any], out: Any) -> int:
        src = self._files[relpath]
        view = memoryview(out).cast("B")
        off = 0
        for r in ranges:
            for start, length in r.segments():
                view[off : off + length] = src[start : start + length]
                off += length
        return off


def read_planned(storage: Any, reads_list: Sequence[Any]) -> int:
    """Read every unit's planned ranges (grouped per file, as the loader groups them)
    through ``storage`` into one reused buffer; returns bytes fetched. The loader's I/O
    with no conversion, no staging pool and no read-ahead."""
    biggest = max((r.nbytes for r in reads_list), default=0)
    buf = bytearray(max(1, biggest))
    fetched = 0
    for reads in reads_list:
        by_file: dict[str, list[Any]] = {}
        for pr in reads.parts:
            by_file.setdefault(pr.file, []).append(pr.weight)
            if pr.scale is not None:
                by_file.setdefault(pr.scale_file or pr.file, []).append(pr.scale)
        for file, ranges in by_file.items():
            n = sum(r.nbytes for r in ranges)
            if n:
                fetched += storage.read_ranges_into(file, ranges, memoryview(buf)[:n])
    return fetched


def _ratio_row(name: str, r: Rate, note: str = "") -> dict[str, Any]:
    return {"name": name, **r.to_json(), "note": note}


def _gbps(nbytes: int, t: Timing) -> Rate:
    return t.rate(gb(nbytes))


def _section(
    key: str,
    title: str,
    what: str,
    tables: list[dict[str, Any]],
    *,
    notes: list[str] | None = None,
    key_ratios: list[dict[str, Any]] | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "key": key,
        "title": title,
        "what": what,
        "tables": tables,
        "notes": notes or [],
        "key_ratios": key_ratios or [],
        "data": data or {},
    }


@dataclass
class Suite:
    """The load-side benchmarks, sharing checkpoints and measurements between sections."""

    quick: bool
    workdir: Path
    out: Path
    repeats: int = 5
    """Most repeats of a timed comparison; time budgets stop slow ones earlier (at >= 2)."""
    ckpts: dict[str, Checkpoint] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    """Measurements one section makes and another reports (staging uses load, amp, ray)."""

    @property
    def size(self) -> Size:
        return SIZE_QUICK if self.quick else SIZE_FULL

    # --- setup ---------------------------------------------------------------------------

    def make_checkpoints(self, which: Sequence[str] = ("big", "tiny")) -> dict[str, Any]:
        """Write the checkpoints: ``big`` (two versions) and the demo-sized ``tiny`` (two)."""
        facts: dict[str, Any] = {}
        for kind in which:
            for version, seed in (("v1", 1), ("v2", 2)):
                name = f"{kind}_{version}"
                if name in self.ckpts:
                    continue
                path = self.workdir / name
                if kind == "big":
                    label = f"{self.size.describe()} ({version})"
                    ck = make_ckpt(path, label, preset=DEMO_PRESET, seed=seed, size=self.size)
                else:
                    label = f"demo-sized: preset {DEMO_PRESET} ({version})"
                    ck = make_ckpt(path, label, preset=DEMO_PRESET, seed=seed, size=None)
                self.ckpts[name] = ck
                log(f"made {name}: {fmt_bytes(ck.nbytes)} in {ck.make_seconds:.1f} s")
                facts[name] = {
                    "label": ck.label,
                    "bytes": ck.nbytes,
                    "make_seconds": round(ck.make_seconds, 2),
                }
        return facts

    # --- 1. conversion kernels -------------------------------------------------------------

    def kernels(self) -> dict[str, Any]:
        from mxload.workers.numerics.backend import ConvertPart, PackedOut
        from mxload.workers.numerics.select import select_backend

        ref = select_backend("cpu", prefer_fast=False)
        fast = select_backend("cpu", prefer_fast=True)
        experts = 8 if self.quick else 128
        shapes: list[tuple[str, int, int]] = [
            ("q_proj", 4096, 2048),
            ("k_proj", 512, 2048),
            ("v_proj", 512, 2048),
            ("o_proj", 2048, 4096),
        ]
        for e in range(experts):
            shapes += [(f"e{e}.gate", 768, 2048), (f"e{e}.up", 768, 2048)]
            shapes.append((f"e{e}.down", 2048, 768))
        log(f"kernels: generating one layer ({len(shapes)} linears)")
        tensors = [block_fp8(n, k, seed=i) for i, (_, n, k) in enumerate(shapes)]
        nbytes = sum(w.numel() for w, _ in tensors)
        kw: dict[str, Any] = dict(block_n=BLOCK, block_k=BLOCK, dtype=torch.bfloat16)
        notes: list[str] = []
        if fast.name != "cpu-fast":
            notes.append(f"fast path unavailable here: {fast.note}; 'fast' is the reference")
        # Kernel-layout buffers (docs/contract.md §2.3) for the packed path, as the loader stages them.
        outs = [
            (
                torch.zeros((w.shape[1], w.shape[0]), dtype=torch.float8_e4m3fn),
                torch.zeros((-(-w.shape[1] // 64), w.shape[0], 2), dtype=torch.uint8),
            )
            for w, _ in tensors
        ]
        has_packed = True  # Backend.convert(into=...) on every backend
        # Correctness before speed: a benchmark of a wrong kernel is worthless.
        from mxload.workers.numerics.repack import write_rows

        for i in (0, 3, 4, 6):
            w, s = tensors[i]
            [want] = ref.convert([ConvertPart(w, s)], **kw)
            if not _same_mx(want, fast.convert([ConvertPart(w, s)], **kw)[0]):
                raise RuntimeError(f"fast and reference differ on {shapes[i][0]} {tuple(w.shape)}")
            ow, os_ = torch.zeros_like(outs[i][0]), torch.zeros_like(outs[i][1])
            write_rows(ow, os_, want[0], want[1], 0)
            fast.convert([ConvertPart(w, s)], **kw, into=[PackedOut(*outs[i])])
            if not _same_mx((outs[i][0], outs[i][1]), (ow, os_)):
                raise RuntimeError(f"fast packed and reference+repack differ on {shapes[i][0]}")

        def run(backend: Any) -> Callable[[], None]:
            def go() -> None:
                for w, s in tensors:
                    backend.convert([ConvertPart(w, s)], **kw)

            return go

        def run_packed() -> None:
            for (w, s), (ow, os_) in zip(tensors, outs, strict=True):
                fast.convert([ConvertPart(w, s)], **kw, into=[PackedOut(ow, os_)])

        memcpy = memcpy_fn([w for w, _ in tensors])

        # Warm-up on one expert only (a whole reference pass is tens of seconds).
        for be in (ref, fast):
            w, s = tensors[4]
            be.convert([ConvertPart(w, s)], **kw)
        candidates: dict[str, Callable[[], object]] = {
            "memcpy": memcpy,
            "reference": run(ref),
            "fast": run(fast),
        }
        if has_packed:
            candidates["fast packed"] = run_packed
        log(f"kernels: timing {' / '.join(candidates)} over {fmt_bytes(nbytes)}")
        t = interleave(
            candidates,
            repeats=self.repeats,
            warmup=0,
            budget_s=45 if self.quick else 100,
        )
        rates = {k: _gbps(nbytes, v) for k, v in t.items()}
        fast_x_ref = paired_ratio(t["reference"], t["fast"])
        fast_of_memcpy = paired_ratio(t["memcpy"], t["fast"])
        ref_of_memcpy = paired_ratio(t["memcpy"], t["reference"])
        rows = [
            [
                "torch memcpy of the FP8 bytes",
                rates["memcpy"].text(3),
                t["memcpy"].text(3),
                "-",
                "1.000",
            ],
            [
                f"reference ({ref.name})",
                rates["reference"].text(3),
                t["reference"].text(3),
                "1.00x",
                ref_of_memcpy.text(4),
            ],
            [
                f"fast ({fast.name})",
                rates["fast"].text(3),
                t["fast"].text(3),
                fast_x_ref.text(2, "x"),
                fast_of_memcpy.text(4),
            ],
        ]
        if has_packed:
            rows.append(
                [
                    f"fast packed ({fast.name} `convert(..., into=...)` into kernel-layout "
                    "buffers: the loader's call)",
                    rates["fast packed"].text(3),
                    t["fast packed"].text(3),
                    paired_ratio(t["reference"], t["fast packed"]).text(2, "x"),
                    paired_ratio(t["memcpy"], t["fast packed"]).text(4),
                ]
            )
        tables = [
            {
                "caption": (
                    f"One Qwen3-30B-A3B layer: attention + {experts} experts "
                    f"({len(shapes)} linears, {fmt_bytes(nbytes)} FP8), torch threads "
                    f"{torch.get_num_threads()}"
                ),
                "headers": [
                    "path",
                    "GB/s of FP8 source",
                    "seconds per layer",
                    "x reference",
                    "x memcpy",
                ],
                "rows": rows,
            }
        ]
        delegated = self._delegate_bench_convert()
        if delegated.get("table"):
            tables.append(delegated["table"])
        notes += delegated.get("notes", [])
        return _section(
            "kernels",
            "1. Conversion throughput: reference vs fast vs memcpy",
            (
                '`select_backend("cpu", prefer_fast=False/True).convert` (resolve + '
                "MX quantize, docs/contract.md §2.1-2.2; no repack) over every linear of one layer, and the "
                "fast backend's `convert(..., into=...)` (the same plus the kernel layout of "
                "docs/contract.md §2.3, written into preallocated buffers: what the loader calls), the paths "
                "taking turns within each repeat; outputs checked byte for byte against the "
                "reference (and reference + `repack.write_rows`) on four of the tensors first. "
                "`x reference` and `x memcpy` are per-repeat ratios (median, min-max). Then the "
                "per-shape table of `bench/bench_convert.py`."
            ),
            tables,
            notes=notes,
            key_ratios=[
                _ratio_row("kernel: fast / reference throughput (one layer)", fast_x_ref),
                _ratio_row("kernel: fast / memcpy throughput (one layer)", fast_of_memcpy),
                *(
                    [
                        _ratio_row(
                            "kernel: fast packed (loader's call) / reference throughput",
                            paired_ratio(t["reference"], t["fast packed"]),
                        )
                    ]
                    if has_packed
                    else []
                ),
            ],
            data={
                "layer": {
                    "experts": experts,
                    "linears": len(shapes),
                    "fp8_bytes": nbytes,
                    "threads": torch.get_num_threads(),
                    "timings": {k: v.to_json() for k, v in t.items()},
                    "gbps": {k: v.to_json() for k, v in rates.items()},
                    "fast_over_reference": fast_x_ref.to_json(),
                    "fast_over_memcpy": fast_of_memcpy.to_json(),
                },
                "bench_convert": delegated.get("data"),
            },
        )

    def _delegate_bench_convert(self) -> dict[str, Any]:
        """Run ``bench/bench_convert.py``'s ``main`` in-process with its results redirected
        to ``OUT/suite-convert/`` (so the engineer's own full-run results are untouched)."""
        try:
            mod = importlib.import_module("bench.bench_convert")
        except Exception as exc:
            return {"notes": [f"bench/bench_convert.py not run: import failed ({exc!r})"]}
        if not (callable(getattr(mod, "main", None)) and hasattr(mod, "RESULTS")):
            return {"notes": ["bench/bench_convert.py has no main()/RESULTS; not delegated"]}
        target = self.out / "suite-convert"
        argv = ["--no-compile-time"] + (
            ["--quick", "--repeats", "3"] if self.quick else ["--repeats", "3"]
        )
        saved = getattr(mod, "RESULTS")  # noqa: B009 - a module global, redirected on purpose
        setattr(mod, "RESULTS", target)  # noqa: B010
        captured = io.StringIO()
        log(f"kernels: delegating to bench/bench_convert.py {' '.join(argv)}")
        threads = torch.get_num_threads()
        try:
            with contextlib.redirect_stdout(captured):
                rc = mod.main(argv)
        except BaseException as exc:  # its failure is reported, not fatal to the suite
            return {"notes": [f"bench/bench_convert.py failed: {type(exc).__name__}: {exc}"]}
        finally:
            setattr(mod, "RESULTS", saved)  # noqa: B010
            torch.set_num_threads(threads)
        target.mkdir(parents=True, exist_ok=True)
        (target / "stdout.txt").write_text(captured.getvalue())
        report_path = target / "convert.json"
        if rc != 0 or not report_path.exists():
            return {"notes": [f"bench/bench_convert.py exited {rc}; see {target / 'stdout.txt'}"]}
        report = json.loads(report_path.read_text())
        rows: list[list[object]] = []
        for wl in report.get("workloads", []):
            for threads_s, paths in wl.get("threads", {}).items():
                for path in ("naive", "fast", "fast-packed", "memcpy"):
                    r = paths.get(path)
                    if r is None:
                        continue
                    rows.append(
                        [
                            wl["name"],
                            threads_s,
                            path,
                            f"{r['gbps']:.3f} ({r['gbps_min']:.3f}-{r['gbps_max']:.3f})",
                            f"{r.get('x_naive', float('nan')):.2f}x",
                            f"{r.get('x_memcpy', float('nan')):.3f}",
                        ]
                    )
        rel = os.path.relpath(target / "convert.md", self.out)
        return {
            "table": {
                "caption": (
                    f"bench/bench_convert.py {' '.join(argv)} (per shape, 1 and all threads; "
                    f"full table: {rel}). Its ratios are of medians."
                ),
                "headers": ["workload", "threads", "path", "GB/s (min-max)", "x naive", "x memcpy"],
                "rows": rows,
            },
            "data": {"argv": argv, "results": os.path.relpath(target / "convert.json", ROOT)},
        }

    # --- 2. mxload convert, whole process ----------------------------------------------------

    def convert(self) -> dict[str, Any]:
        ck = self.ckpts["big_v1"]
        py = sys.executable
        dsts = {k: self.workdir / f"converted-{k}" for k in ("reference", "fast")}
        # The same two runs with the output on tmpfs (memory): what the converter costs
        # when the destination is not this VM's disk (writing 2 GB here takes 1.5-2.5 s).
        shm = _tmpfs_dir(2 * ck.nbytes + (1 << 30))
        if shm is not None:
            dsts |= {f"{k} (tmpfs)": shm / f"converted-{k}" for k in ("reference", "fast")}
        summaries: dict[str, list[dict[str, Any]]] = {k: [] for k in dsts}

        def command(key: str) -> Callable[[], None]:
            numerics = key.split(" ")[0]

            def go() -> None:
                dst = str(dsts[key])
                cmd = [py, "-m", "mxload.orchestrator.cli", "convert", ck.path, dst, "--json"]
                _, out = run_timed([*cmd, "--numerics", numerics])
                summaries[key].append(json.loads(out))

            return go

        def before(name: str) -> None:
            if name in dsts:
                shutil.rmtree(dsts[name], ignore_errors=True)
            if name == "cat (cold cache)":
                evict_page_cache(ck.files)
            # Untimed: flush what earlier candidates wrote (2 GB each), so no candidate
            # runs while the kernel writes back another's output (on 2 cores that
            # writeback takes CPU from whoever runs next).
            os.sync()

        candidates: dict[str, Callable[[], object]] = {
            "cat (cold cache)": lambda: cat_files(ck.files),
            "cat (warm cache)": lambda: cat_files(ck.files),
            "write (dd)": lambda: write_zeros(self.workdir / "dd-out", ck.nbytes),
            **{k: command(k) for k in dsts},
        }
        log(f"convert: {len(candidates)} candidates on {fmt_bytes(ck.nbytes)}")

        def base_of(k: str) -> str:
            """The reference row a row's speed-up is taken against (same destination)."""
            return "reference (tmpfs)" if k.endswith("(tmpfs)") else "reference"

        # No warm-up run: run.py's start-up check already (re)built the numba cache that
        # every fresh process loads, and the page cache is warm from writing the files.
        t = interleave(
            candidates,
            repeats=self.repeats,
            warmup=0,
            budget_s=30 if self.quick else 150,
            before_each=before,
        )
        (self.workdir / "dd-out").unlink(missing_ok=True)
        same = _same_files(dsts["reference"], dsts["fast"])
        if shm is not None:
            same = same and _same_files(dsts["fast"], dsts["fast (tmpfs)"])
            shutil.rmtree(shm, ignore_errors=True)
        labels = {
            "cat (cold cache)": "`cat` the shards, cold page cache (posix_fadvise DONTNEED)",
            "cat (warm cache)": "`cat` the shards, warm page cache",
            "write (dd)": "write as many bytes to a new file (the output's floor)",
            "reference": "`mxload convert SRC DST --numerics reference` (the naive path)",
            "fast": "`mxload convert SRC DST --numerics fast` (the default where numba works)",
            "reference (tmpfs)": "the same, reference, DST on tmpfs (/dev/shm)",
            "fast (tmpfs)": "the same, fast, DST on tmpfs (/dev/shm)",
        }
        rows = []
        for k, label in labels.items():
            if k not in t:
                continue
            inproc = stages = "-"
            if summaries.get(k):
                inproc = Rate(tuple(x["seconds"] for x in summaries[k])).text(2, " s")
                stages = " / ".join(
                    Rate(tuple(x["stage_seconds"][st] for x in summaries[k])).text(2)
                    for st in ("read", "convert", "write")
                )
            rows.append(
                [
                    label,
                    t[k].text(2),
                    _gbps(ck.nbytes, t[k]).text(3),
                    inproc,
                    stages,
                    paired_ratio(t[base_of(k)], t[k]).text(2, "x")
                    if not k.startswith("reference")
                    else "1.00x",
                    paired_ratio(t[k], t["cat (warm cache)"]).text(1, "x"),
                ]
            )
        fast_x_ref = paired_ratio(t["reference"], t["fast"])
        tmpfs_x = (
            paired_ratio(t["reference (tmpfs)"], t["fast (tmpfs)"]) if shm is not None else None
        )
        # The same runs' own convert_checkpoint seconds: the speed-up without the fixed
        # cost of a process (interpreter, imports, numba cache load).
        inproc_x = paired_ratio(
            Rate(tuple(x["seconds"] for x in summaries["reference"])),
            Rate(tuple(x["seconds"] for x in summaries["fast"])),
        )
        per_core = Rate(
            tuple(ck.nbytes / x["seconds"] / 1e9 / x["threads"] for x in summaries["fast"])
        )
        return _section(
            "convert",
            "2. `mxload convert`, whole process: reference vs fast numerics",
            (
                f"Offline convert of {ck.label}, {fmt_bytes(ck.nbytes)} of tensors in "
                f"{len(ck.files)} shards, to ModelOpt MXFP8 (docs/contract.md §1.2): the command itself, "
                "each run a fresh process (interpreter, imports, numba cache load, read, "
                "convert, write), `--numerics reference` (the naive eager-torch path) vs "
                "`--numerics fast`, the same pipeline otherwise (reader, converter and writer "
                "threads overlapping). All rows take turns within each repeat; `x reference` is "
                "speed-up per repeat (reference wall / row wall), `x cat` is row wall / warm "
                "`cat` wall. Before each run (untimed) `sync` flushes what the previous "
                "candidate wrote, so none runs during another's writeback. The tmpfs rows "
                "write the output to memory (speed-up against the tmpfs reference row): what "
                "conversion costs when the destination is not this VM's slow disk. Stage "
                "seconds are busy time per stage inside the process; they overlap, so they "
                "add up to more than the in-process seconds."
            ),
            [
                {
                    "headers": [
                        "what",
                        "wall",
                        "GB/s of source",
                        "in-process seconds",
                        "read / convert / write stage s",
                        "x reference (speed-up)",
                        "x cat warm (slower by)",
                    ],
                    "rows": rows,
                }
            ],
            notes=[
                "Outputs of the reference and fast runs are byte-identical: "
                + ("yes" if same else "NO (see results.json)"),
                "GB/s are of source tensor bytes; the written MXFP8 files are about as large.",
                "Fast path per core, in-process: "
                + per_core.text(3, " GB/s")
                + " (source bytes / in-process seconds / kernel threads).",
            ],
            key_ratios=[
                _ratio_row("mxload convert process: fast / reference speed-up", fast_x_ref),
                *(
                    [
                        _ratio_row(
                            "mxload convert process, output on tmpfs: fast / reference speed-up",
                            tmpfs_x,
                        )
                    ]
                    if tmpfs_x is not None
                    else []
                ),
                _ratio_row(
                    "mxload convert in-process seconds: fast / reference speed-up", inproc_x
                ),
                _ratio_row(
                    "mxload convert (fast) wall / write the same bytes (dd)",
                    paired_ratio(t["fast"], t["write (dd)"]),
                ),
                _ratio_row(
                    "mxload convert (fast) wall / cat (warm)",
                    paired_ratio(t["fast"], t["cat (warm cache)"]),
                ),
            ],
            data={
                "checkpoint": {"label": ck.label, "bytes": ck.nbytes},
                "timings": {k: v.to_json() for k, v in t.items()},
                "summaries": summaries,
                "outputs_identical": same,
                "in_process_speedup": inproc_x.to_json(),
                "tmpfs_speedup": tmpfs_x.to_json() if tmpfs_x is not None else None,
            },
        )

    # --- 3. load vs read (tp=1, no Ray) --------------------------------------------------------

    def _open(self, name: str) -> tuple[Any, Any]:
        from mxload.orchestrator.runtime.catalog import open_checkpoint
        from mxload.orchestrator.runtime.request import source_info

        meta = open_checkpoint(self.ckpts[name].path)
        return meta, source_info(meta, False, self.ckpts[name].path, None)

    def _plan(self, meta: Any, layout: Any, *, budget: int | None = None) -> Any:
        from mxload.orchestrator.plan.planner import build_plan
        from mxload.workers.numerics.select import select_backend

        fused = select_backend("cpu").fused
        return build_plan(meta.config, layout, checkpoint=meta, staging_budget=budget, fused=fused)

    def _run_rank(
        self,
        plan: Any,
        rank: int,
        meta: Any,
        source: Any,
        *,
        storage_factory: Callable[..., Any] | None = None,
    ) -> tuple[Any, float, float]:
        """One rank's load through RankLoader (no Ray): (stats, alloc seconds, load seconds)."""
        from mxload.orchestrator.runtime.request import staging_budget_of
        from mxload.workers.numerics.select import select_backend
        from mxload.workers.rank.loader import RankLoader

        rp = plan.ranks[rank]
        t0 = time.perf_counter()
        loader = RankLoader(
            rp,
            model_dtype=meta.config.model_dtype,
            backend=select_backend("cpu"),
            storage_factory=storage_factory,
        )
        t1 = time.perf_counter()
        stats = loader.load(
            list(rp.reads or ()), source, version=1, staging_budget=staging_budget_of(plan, rp)
        )
        t2 = time.perf_counter()
        del loader
        gc.collect()
        return stats, t1 - t0, t2 - t1

    def load(self) -> dict[str, Any]:
        from mxload.orchestrator.plan.types import ParallelLayout
        from mxload.workers.storage import Storage

        ck = self.ckpts["big_v1"]
        meta, source = self._open("big_v1")
        plan = self._plan(meta, ParallelLayout())
        rp = plan.ranks[0]
        reads = list(rp.reads or ())
        log(f"load: tp=1 RankLoader vs reads on {fmt_bytes(ck.nbytes)}")
        in_ram = {
            os.path.basename(f): Path(f).read_bytes() for f in ck.files
        }  # for the convert-only load
        runs: dict[str, list[Any]] = {"load": [], "convert_only": []}

        def load_disk() -> None:
            runs["load"].append(self._run_rank(plan, 0, meta, source))

        def load_ram() -> None:
            runs["convert_only"].append(
                self._run_rank(
                    plan, 0, meta, source, storage_factory=lambda *_: _MemStorage(in_ram)
                )
            )

        def read_only() -> None:
            with Storage(ck.path) as st:
                read_planned(st, reads)

        t = interleave(
            {
                "load": load_disk,
                "read": read_only,
                "convert_only": load_ram,
                "cat": lambda: cat_files(ck.files),
            },
            repeats=5,
            warmup=1,
            budget_s=60 if self.quick else 150,
        )
        runs["load"] = runs["load"][1:]  # drop the warm-up's
        runs["convert_only"] = runs["convert_only"][1:]
        in_ram.clear()
        gc.collect()
        log("load: cold page cache (evicted before each)")
        cold = interleave(
            {"load": load_disk, "cat": lambda: cat_files(ck.files), "read": read_only},
            repeats=2 if self.quick else 3,
            warmup=0,
            before_each=lambda _: evict_page_cache(ck.files),
        )
        cold_loads = runs["load"][-cold["load"].n :]
        runs["load"] = runs["load"][: -cold["load"].n]

        load_s = Timing(tuple(r[2] for r in runs["load"]))  # load() only, allocation apart
        alloc_s = Timing(tuple(r[1] for r in runs["load"]))
        conv_s = Timing(tuple(r[2] for r in runs["convert_only"]))
        read_s = t["read"]
        n = min(load_s.n, conv_s.n, read_s.n)
        pairs = list(zip(load_s.samples[:n], read_s.samples[:n], conv_s.samples[:n], strict=True))
        over_max = Rate(tuple(ld / max(r, c) for ld, r, c in pairs))
        over_sum = Rate(tuple(ld / (r + c) for ld, r, c in pairs))
        over_read = Rate(tuple(ld / r for ld, r, _ in pairs))
        over_conv = Rate(tuple(ld / c for ld, _, c in pairs))
        stats = [r[0] for r in runs["load"]]
        st_read = Rate(tuple(s.read_seconds for s in stats))
        st_conv = Rate(tuple(s.convert_seconds for s in stats))
        cold_load = Timing(tuple(r[2] for r in cold_loads))
        bytes_read = stats[-1].bytes_read
        rows = [
            [
                "RankLoader.load, tp=1 (warm cache)",
                load_s.text(3),
                _gbps(ck.nbytes, load_s).text(3),
                "1.00x",
            ],
            [
                "read only: the same planned ranges through the storage seam",
                read_s.text(3),
                _gbps(bytes_read, read_s).text(3),
                Rate(tuple(r / ld for ld, r, _ in pairs)).text(3, "x"),
            ],
            [
                "convert only: RankLoader.load fed from RAM",
                conv_s.text(3),
                _gbps(ck.nbytes, conv_s).text(3),
                Rate(tuple(c / ld for ld, _, c in pairs)).text(3, "x"),
            ],
            ["`cat` the shards (warm)", t["cat"].text(3), _gbps(ck.nbytes, t["cat"]).text(3), "-"],
            [
                "RankLoader.load, tp=1, cold cache",
                cold_load.text(3),
                _gbps(ck.nbytes, cold_load).text(3),
                "-",
            ],
            [
                "read only, cold cache",
                cold["read"].text(3),
                _gbps(bytes_read, cold["read"]).text(3),
                "-",
            ],
            [
                "`cat` the shards, cold cache",
                cold["cat"].text(3),
                _gbps(ck.nbytes, cold["cat"]).text(3),
                "-",
            ],
            ["(RankLoader construction: buffer allocation)", alloc_s.text(3), "-", "-"],
        ]
        overlap_rows = [
            ["load / read", over_read.text(2, "x")],
            ["load / convert-only", over_conv.text(2, "x")],
            ["load / max(read, convert-only)  (1.00 = perfect overlap)", over_max.text(2, "x")],
            ["load / (read + convert-only)  (1.00 = no overlap)", over_sum.text(2, "x")],
            ["RunStats.read_seconds (waiting for reads, inside load)", st_read.text(3, " s")],
            ["RunStats.convert_seconds (convert + write, inside load)", st_conv.text(3, " s")],
        ]
        tables = [
            {
                "caption": f"tp=1, one RankLoader in this process, {ck.label}",
                "headers": ["what", "seconds", "GB/s", "time / load time"],
                "rows": rows,
            },
            {
                "caption": "Where the time goes (per-repeat ratios, warm cache)",
                "headers": ["ratio", "median (min-max, n)"],
                "rows": overlap_rows,
            },
        ]
        return _section(
            "load",
            "3. End-to-end load vs raw read",
            (
                "tp=1: `RankLoader.load` (no Ray, fast backend, the plan's default staging "
                "budget) against reading exactly its planned byte ranges through "
                "`mxload.workers.storage.Storage` with no conversion, against the same load fed from "
                "RAM (a storage whose reads are memcpys: the conversion and the loop around "
                "it), and `cat`. The candidates take turns within each repeat; a cold-cache "
                "pass evicts the shards before each run. The Ray load (tp 2 x dp 2, EP) is in "
                "the table that follows, from benchmark 6's cold loads."
            ),
            tables,
            notes=[
                "Reads come from the page cache unless the row says cold; on this machine a "
                "cold read is a virtual disk, so the cold rows are indicative only.",
            ],
            key_ratios=[
                _ratio_row("load tp=1: load / read-only of the same ranges", over_read),
                _ratio_row("load tp=1: load / max(read, convert)", over_max),
                _ratio_row("load tp=1: load / (read + convert)", over_sum),
            ],
            data={
                "checkpoint": {"label": ck.label, "bytes": ck.nbytes},
                "timings": {k: v.to_json() for k, v in t.items()},
                "load_only": load_s.to_json(),
                "alloc": alloc_s.to_json(),
                "convert_only": conv_s.to_json(),
                "cold": {k: v.to_json() for k, v in cold.items()},
                "cold_load_only": cold_load.to_json(),
                "bytes_read": bytes_read,
                "bytes_needed": stats[-1].bytes_needed,
                "ratios": {
                    "load_over_read": over_read.to_json(),
                    "load_over_convert": over_conv.to_json(),
                    "load_over_max": over_max.to_json(),
                    "load_over_sum": over_sum.to_json(),
                },
                "runstats_read_s": st_read.to_json(),
                "runstats_convert_s": st_conv.to_json(),
            },
        )

    # --- 4. read amplification -------------------------------------------------------------------

    def amplification(self) -> dict[str, Any]:
        from mxload.orchestrator.plan.types import ParallelLayout

        ck = self.ckpts["big_v1"]
        meta, source = self._open("big_v1")
        rows: list[list[object]] = []
        data: list[dict[str, Any]] = []
        staging: list[dict[str, Any]] = []
        key: list[dict[str, Any]] = []
        # tp -> (sum of rank seconds, bytes read, sum of read_seconds, sum of convert_seconds)
        work: dict[int, tuple[float, int, float, float]] = {}
        for tp in (1, 2, 4, 8):
            plan = self._plan(meta, ParallelLayout(tp=tp))
            log(f"amplification: tp={tp}, running {len(plan.ranks)} ranks")
            per_rank = []
            for rp in plan.ranks:
                stats, _, secs = self._run_rank(plan, rp.rank, meta, source)
                per_rank.append(
                    {
                        "rank": rp.rank,
                        "bytes_needed": rp.bytes_needed,
                        "bytes_to_read": rp.bytes_to_read,
                        "bytes_read": stats.bytes_read,
                        "predicted": rp.bytes_to_read / rp.bytes_needed,
                        "measured": stats.bytes_read / stats.bytes_needed,
                        "everything": ck.nbytes / rp.bytes_needed,
                        "seconds": secs,
                        "read_seconds": stats.read_seconds,
                        "convert_seconds": stats.convert_seconds,
                        "predicted_peak_staging_bytes": stats.predicted_peak_staging_bytes,
                        "measured_peak_staging_bytes": stats.measured_peak_staging_bytes,
                        "rss_growth_bytes": stats.rss_growth_bytes,
                    }
                )
            pred = Rate(tuple(r["predicted"] for r in per_rank))
            meas = Rate(tuple(r["measured"] for r in per_rank))
            every = Rate(tuple(r["everything"] for r in per_rank))
            total_read = sum(r["bytes_read"] for r in per_rank)
            work[tp] = (
                sum(r["seconds"] for r in per_rank),
                total_read,
                sum(r["read_seconds"] for r in per_rank),
                sum(r["convert_seconds"] for r in per_rank),
            )
            saving = Rate(tuple(r["everything"] / r["measured"] for r in per_rank))
            data.append({"tp": tp, "ranks": per_rank})
            if tp == 1:
                continue  # the baseline of the work table below
            rows.append(
                [
                    f"tp={tp} (MoE TP-sharded over {tp} ranks)",
                    pred.text(5, "x"),
                    meas.text(5, "x"),
                    every.text(2, "x"),
                    f"{total_read / ck.nbytes:.2f}x",
                    f"{tp:.2f}x",
                    saving.text(2, "x"),
                    fmt_bytes(max(r["bytes_read"] - r["bytes_needed"] for r in per_rank)),
                ]
            )
            key.append(
                _ratio_row(f"read amplification tp={tp}: measured bytes_read / bytes_needed", meas)
            )
            key.append(
                _ratio_row(f"read amplification tp={tp}: every-rank-reads-all / mxload", saving)
            )
            staging.append(
                {
                    "layout": f"tp={tp}",
                    "ranks": per_rank,
                    "plan_budget": plan.extra.get("staging_budget_bytes"),
                }
            )
        self.shared["amp_staging"] = staging
        ray = self.shared.get("ray_big_first_manifest")
        notes = [
            "Ratios over ranks are median (min-max over the ranks, n = ranks). "
            "`bytes_needed` already counts the scale tiles covering a rank's slice (SPEC "
            "§6), so amplification above 1 is only what coalescing reads between wanted "
            "ranges. All ranks together read more than the checkpoint because some tensors "
            "are replicated: norms and routers everywhere, kv heads when tp > 4 kv heads, "
            "and attention over dp.",
        ]
        base_s = work[1][0]
        work_rows = [
            [
                f"tp={tp}",
                tp,
                f"{secs:.2f} s",
                f"{rd:.2f} s",
                f"{cv:.2f} s",
                fmt_bytes(nread),
                f"{gb(nread) / secs:.3f}",
                f"{secs / base_s:.2f}x",
            ]
            for tp, (secs, nread, rd, cv) in work.items()
        ]
        cost8 = Rate((work[8][0] / base_s,))
        key.append(
            _ratio_row(
                "conversion work at tp=8 vs tp=1: sum of rank load seconds (same bytes, one pass)",
                cost8,
            )
        )
        notes.append(
            "Work table: every rank of a layout runs one after another in this process, one "
            "pass each (n=1 per layout, so noisy). Every layout reads about the same bytes, "
            "so a sum of rank seconds above tp=1's is cost per byte that TP sharding of the "
            "experts adds: more, smaller kernel calls (at tp=8 an expert's gate/up are "
            "96-row slices) and row-strided reads (down_proj and o_proj split on K). The "
            "read/convert columns are the loader's own RunStats."
        )
        if ray is not None:
            amp = Rate(tuple(r["bytes_read"] / r["bytes_needed"] for r in ray["ranks"]))
            every = Rate(tuple(ck.nbytes / r["bytes_needed"] for r in ray["ranks"]))
            tot = sum(r["bytes_read"] for r in ray["ranks"]) / ck.nbytes
            rows.append(
                [
                    "tp=2 x dp=2, EP (Ray load, benchmark 6)",
                    "-",
                    amp.text(5, "x"),
                    every.text(2, "x"),
                    f"{tot:.2f}x",
                    "4.00x",
                    paired_ratio(every, amp).text(2, "x"),
                    fmt_bytes(max(r["bytes_read"] - r["bytes_needed"] for r in ray["ranks"])),
                ]
            )
        return _section(
            "amplification",
            "4. Read amplification: mxload vs every rank reading everything",
            (
                f"{ck.label}, {fmt_bytes(ck.nbytes)}. For each layout every rank's loader "
                "runs (RankLoader, one after another); `bytes_read / bytes_needed` is measured "
                "from the run and predicted by the plan (`bytes_to_read / bytes_needed`). The "
                "alternative, every rank reading the whole checkpoint (vLLM's default loader), "
                "reads `checkpoint bytes / bytes_needed` per rank."
            ),
            [
                {
                    "headers": [
                        "layout",
                        "predicted (plan)",
                        "measured",
                        "every rank reads all",
                        "all ranks' reads / checkpoint (mxload)",
                        "same, every rank reads all",
                        "bytes saved: all / mxload per rank",
                        "over-read (max over ranks)",
                    ],
                    "rows": rows,
                },
                {
                    "caption": "Work per layout: every rank's load, summed (RankLoader, fast backend)",
                    "headers": [
                        "layout",
                        "ranks",
                        "sum of rank load seconds",
                        "of which waiting for reads",
                        "of which converting",
                        "bytes read, all ranks",
                        "GB per rank-second",
                        "x tp=1",
                    ],
                    "rows": work_rows,
                },
            ],
            notes=notes,
            key_ratios=key,
            data={"checkpoint_bytes": ck.nbytes, "layouts": data},
        )

    # --- 5. staging predicted vs measured ---------------------------------------------------------

    @staticmethod
    def _expert_unit_staging(plan: Any) -> int:
        """Whole-unit staging of the first expert-w13 unit of ``plan`` (the memory model)."""
        from mxload.orchestrator.plan.memory import ConvertOptions, unit_cost

        rp = plan.ranks[0]
        for u, r in zip(rp.units, rp.reads, strict=True):
            if u.kind == "moe_w13":
                return unit_cost(u, u.rows, r.nbytes, ConvertOptions(fused=True)).pool
        raise ValueError("no expert unit in the plan")

    def staging(self) -> dict[str, Any]:
        from mxload.orchestrator.plan.types import ParallelLayout

        meta, source = self._open("big_v1")
        default_plan = self._plan(meta, ParallelLayout())
        e0 = default_plan.ranks[0].staging
        default_budget = e0.budget_bytes if e0 else default_plan.min_staging_reload
        # "Small": an eighth of the default, which row-chunks every expert. The smallest
        # budget a load accepts chunks down to a few rows and is slow; it runs on one
        # tp=8 rank (an eighth of the bytes) to keep the suite's time bounded.
        small = max(default_plan.min_staging_load, default_budget // 8)
        small_plan = self._plan(meta, ParallelLayout(), budget=small)
        plan8 = self._plan(meta, ParallelLayout(tp=8))
        tiny = plan8.min_staging_load
        tiny_plan = self._plan(meta, ParallelLayout(tp=8), budget=tiny)
        runs: dict[str, list[tuple[Any, float, float]]] = {
            k: [] for k in ("tp1 default", "tp1 small", "tp8 default", "tp8 minimum")
        }
        plans = {
            "tp1 default": default_plan,
            "tp1 small": small_plan,
            "tp8 default": plan8,
            "tp8 minimum": tiny_plan,
        }

        def candidate(key: str) -> Callable[[], None]:
            def go() -> None:
                runs[key].append(self._run_rank(plans[key], 0, meta, source))

            return go

        log(
            f"staging: tp=1 at {fmt_bytes(default_budget)} and {fmt_bytes(small)}, tp=8 rank 0 "
            f"at its default and at the minimum {fmt_bytes(tiny)}"
        )
        interleave(
            {k: candidate(k) for k in runs},
            repeats=2 if self.quick else 3,
            warmup=0,
            budget_s=20 if self.quick else 90,
        )

        def stats_of(key: str) -> tuple[list[int], list[int], list[int], Timing]:
            got = runs[key]
            return (
                [r[0].predicted_peak_staging_bytes for r in got],
                [r[0].measured_peak_staging_bytes for r in got],
                [r[0].rss_growth_bytes for r in got],
                Timing(tuple(r[2] for r in got)),
            )

        rows: list[list[object]] = []
        within: list[float] = []

        def row(
            label: str,
            budget: int | None,
            preds: list[int],
            meas: list[int],
            rss: list[int],
            secs: Timing | None,
            chunk: Any,
        ) -> None:
            ratios = [p / m if m else float("inf") for p, m in zip(preds, meas, strict=True)]
            within.extend(ratios)
            rows.append(
                [
                    label,
                    fmt_bytes(budget),
                    fmt_bytes(max(preds)),
                    fmt_bytes(max(meas)),
                    f"{min(ratios):.3f}-{max(ratios):.3f}",
                    fmt_bytes(max(rss)),
                    chunk,
                    secs.text(2) if secs is not None else "-",
                ]
            )

        labels = {
            "tp1 default": ("tp=1, default budget (reload minimum = largest unit)", default_plan),
            "tp1 small": ("tp=1, small budget (default / 8)", small_plan),
            "tp8 default": ("tp=8 rank 0, default budget", plan8),
            "tp8 minimum": ("tp=8 rank 0, the smallest budget a load accepts", tiny_plan),
        }
        timings: dict[str, Timing] = {}
        for key, (label, plan) in labels.items():
            preds, meas, rss, secs = stats_of(key)
            timings[key] = secs
            est = plan.ranks[0].staging
            row(
                label,
                est.budget_bytes if est else None,
                preds,
                meas,
                rss,
                secs,
                est.chunk_rows if est else "-",
            )
        for entry in self.shared.get("amp_staging", []):
            rk = entry["ranks"]
            row(
                f"{entry['layout']}, default budget, all {len(rk)} ranks",
                entry["plan_budget"],
                [r["predicted_peak_staging_bytes"] for r in rk],
                [r["measured_peak_staging_bytes"] for r in rk],
                [r["rss_growth_bytes"] for r in rk],
                None,
                "-",
            )
        ray = self.shared.get("ray_big_first_manifest")
        if ray is not None:
            rk = ray["ranks"]
            row(
                "tp=2 x dp=2 EP, Ray ranks (manifest fields)",
                None,
                [r["predicted_peak_staging_bytes"] for r in rk],
                [r["measured_peak_staging_bytes"] for r in rk],
                [r["rss_growth_bytes"] or 0 for r in rk],
                None,
                "-",
            )
        slow_small = paired_ratio(timings["tp1 small"], timings["tp1 default"])
        slow_tiny = paired_ratio(timings["tp8 minimum"], timings["tp8 default"])
        ok = all(1.0 <= r <= 1.10 for r in within)
        # "One expert's worth": the staging of one whole expert-w13 unit (the larger half of
        # an expert), from the same memory model, against measured peaks at the default.
        expert = self._expert_unit_staging(default_plan)
        worth = {
            "tp=1 (the largest unit is the merged qkv)": Rate(
                tuple(float(r[0].measured_peak_staging_bytes) / expert for r in runs["tp1 default"])
            )
        }
        if ray is not None:
            worth["tp=2 x dp=2 EP, Ray ranks"] = Rate(
                tuple(float(r["measured_peak_staging_bytes"]) / expert for r in ray["ranks"])
            )
        return _section(
            "staging",
            "5. Peak staging: predicted vs measured",
            (
                "Per rank, the plan's predicted peak staging (docs/contract.md §6) beside the staging "
                "pool's measured high-water mark (the manifest's "
                "`predicted_peak_staging_bytes` / `measured_peak_staging_bytes`), and the "
                "process RSS growth during the load as a cross-check for temporaries outside "
                "the pool. docs/contract.md §6 requires measured <= predicted <= 1.10 x measured, i.e. "
                "the ratio column within 1.000-1.100. Loads by RankLoader in this process "
                "(fast backend) unless the row says Ray."
            ),
            [
                {
                    "headers": [
                        "run",
                        "budget",
                        "predicted peak (max over ranks)",
                        "measured peak (max over ranks)",
                        "predicted / measured (min-max over ranks and runs)",
                        "RSS growth (max)",
                        "chunk rows",
                        "load seconds",
                    ],
                    "rows": rows,
                }
            ],
            notes=[
                "Every predicted/measured ratio within [1.00, 1.10]: " + ("yes" if ok else "NO"),
                f"Cost of a small budget: tp=1 load time at {fmt_bytes(small)} / at "
                f"{fmt_bytes(default_budget)} = {slow_small.text(2, 'x')} (per repeat).",
                f"Cost of the minimum budget: tp=8 rank 0 load time at {fmt_bytes(tiny)} / "
                f"at its default = {slow_tiny.text(2, 'x')} (per repeat).",
                "The four budget runs take turns within each repeat; the rows below them "
                "reuse the runs of benchmarks 4 and 6.",
                "RSS growth above the predicted staging means memory the pool does not "
                "account for (allocator slack, temporaries of the conversion kernels).",
            ],
            key_ratios=[
                _ratio_row(
                    "staging: predicted / measured peak (all runs, all ranks)", Rate(tuple(within))
                ),
                _ratio_row("staging: load time at budget default/8 / default (tp=1)", slow_small),
                _ratio_row(
                    "staging: load time at minimum budget / default (tp=8 rank 0)", slow_tiny
                ),
                *(
                    _ratio_row(f"staging at the default budget / one expert's w13 unit, {k}", v)
                    for k, v in worth.items()
                ),
            ],
            data={
                "expert_w13_unit_staging": expert,
                "default_budget": default_budget,
                "small_budget": small,
                "minimum_budget_tp8": tiny,
                "within_spec": ok,
                "ratios": within,
                "runs": {
                    k: [
                        {
                            "predicted": r[0].predicted_peak_staging_bytes,
                            "measured": r[0].measured_peak_staging_bytes,
                            "rss_growth": r[0].rss_growth_bytes,
                            "seconds": r[2],
                        }
                        for r in v
                    ]
                    for k, v in runs.items()
                },
            },
        )

    # --- 6. reload vs cold load (embedded Ray) + the Ray part of 3 ------------------------------

    def sessions(self) -> list[dict[str, Any]]:
        """Benchmark 6, and the Ray rows of benchmark 3 (returned as a second section)."""
        import ray
        from mxload.cluster.local import start_embedded
        from mxload.orchestrator.plan.types import ParallelLayout
        from mxload.orchestrator.runtime.driver import plan_load
        from mxload.orchestrator.runtime.request import LoadRequest
        from mxload.orchestrator.runtime.session import Session
        from mxload.workers.storage import Storage

        layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
        n_sessions = 2 if self.quick else 3
        n_reloads = 2 if self.quick else 3
        if ray.is_initialized():
            raise RuntimeError(
                "Ray is already initialized in this process; the suite starts its own"
            )
        t0 = time.perf_counter()
        temp = start_embedded(layout.world, resource="NPU", num_cpus=os.cpu_count() or 2)
        ray_start = time.perf_counter() - t0
        log(f"sessions: embedded Ray up in {ray_start:.1f} s")
        results: dict[str, Any] = {}
        try:
            for kind in ("tiny", "big"):
                v1, v2 = self.ckpts[f"{kind}_v1"], self.ckpts[f"{kind}_v2"]
                req = LoadRequest(src=v1.path, layout=layout, device="cpu")

                def plan_once(r: LoadRequest = req) -> None:
                    plan_load(r)

                plan_t = interleave({"plan": plan_once}, repeats=3, warmup=1)["plan"]
                loads: list[dict[str, Any]] = []
                reloads: list[dict[str, Any]] = []
                for s_i in range(n_sessions):
                    log(f"sessions: {kind} cold load {s_i + 1}/{n_sessions}")
                    ts = time.perf_counter()
                    session = Session.load(v1.path, layout, device="cpu")
                    wall = time.perf_counter() - ts
                    try:
                        m = session.manifest
                        reports = ray.get([a.report.remote() for a in session.run.actors])
                        loads.append(
                            {
                                "wall": wall,
                                "driver_seconds": m["seconds"],
                                "rank_seconds": [r["seconds"] for r in m["ranks"]],
                                "read_seconds": [r["read_seconds"] for r in reports],
                                "convert_seconds": [r["convert_seconds"] for r in reports],
                                "manifest": _slim(m),
                            }
                        )
                        for j in range(n_reloads):
                            src = (v2 if j % 2 == 0 else v1).path
                            tr = time.perf_counter()
                            m2 = session.reload(src)
                            rwall = time.perf_counter() - tr
                            if m2.get("addresses_moved"):
                                raise RuntimeError(
                                    f"addresses moved on reload: {m2['addresses_moved'][:5]}"
                                )
                            reloads.append(
                                {
                                    "wall": rwall,
                                    "driver_seconds": m2["seconds"],
                                    "rank_seconds": [r["seconds"] for r in m2["ranks"]],
                                    "version": m2["ranks"][0]["version"],
                                    "addresses_moved": len(m2.get("addresses_moved", [])),
                                }
                            )
                    finally:
                        session.release()
                # Baseline: the bytes all four ranks read, read through the storage seam in
                # this process (one after another), the same number of times.
                plan = loads[-1]["manifest"]
                _, full_plan = plan_load(req)
                all_reads = [u for rp in full_plan.ranks for u in (rp.reads or ())]

                def read_all(path: str = v1.path, reads: list[Any] = all_reads) -> None:
                    with Storage(path) as st:
                        read_planned(st, reads)

                read_t = interleave({"read": read_all}, repeats=3, warmup=1)["read"]
                results[kind] = {
                    "checkpoint": {"label": v1.label, "bytes": v1.nbytes},
                    "plan": plan_t,
                    "loads": loads,
                    "reloads": reloads,
                    "read_all_ranks": read_t,
                    "bytes_read_all_ranks": sum(r["bytes_read"] for r in plan["ranks"]),
                }
                if kind == "big":
                    self.shared["ray_big_first_manifest"] = loads[0]["manifest"]
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
        return [
            self._reload_section(results, ray_start, n_sessions, n_reloads),
            self._ray_load_section(results),
        ]

    def _reload_section(
        self, results: dict[str, Any], ray_start: float, n_sessions: int, n_reloads: int
    ) -> dict[str, Any]:
        rows: list[list[object]] = []
        key: list[dict[str, Any]] = []
        data: dict[str, Any] = {"ray_start_seconds": ray_start}
        for kind, res in results.items():
            cold = Timing(tuple(x["wall"] for x in res["loads"]))
            warm = Timing(tuple(x["wall"] for x in res["reloads"]))
            cold_rank = Timing(tuple(max(x["rank_seconds"]) for x in res["loads"]))
            warm_rank = Timing(tuple(max(x["rank_seconds"]) for x in res["reloads"]))
            ratio = paired_ratio(warm, cold)
            ratio_rank = paired_ratio(warm_rank, cold_rank)
            plan_t: Timing = res["plan"]
            spawn = Rate(tuple(x["driver_seconds"] - max(x["rank_seconds"]) for x in res["loads"]))
            label = res["checkpoint"]["label"]
            size = fmt_bytes(res["checkpoint"]["bytes"])
            rows.append(
                [
                    f"{label}, {size}",
                    "Session.load (cold)",
                    cold.text(2),
                    cold_rank.text(3),
                    "1.00x",
                    "1.00x",
                ]
            )
            rows.append(
                [
                    f"{label}, {size}",
                    "Session.reload (in place)",
                    warm.text(2),
                    warm_rank.text(3),
                    ratio.text(3, "x"),
                    ratio_rank.text(2, "x"),
                ]
            )
            rows.append(
                [
                    f"{label}, {size}",
                    "  of the cold load: planning (driver.plan_load)",
                    plan_t.text(2),
                    "-",
                    "-",
                    "-",
                ]
            )
            rows.append(
                [
                    f"{label}, {size}",
                    "  of the cold load: Ray placement + actor start (driver s - slowest rank s)",
                    spawn.text(2, " s"),
                    "-",
                    "-",
                    "-",
                ]
            )
            key.append(_ratio_row(f"reload / cold load wall, {kind} checkpoint", ratio))
            key.append(
                _ratio_row(f"reload / cold load, slowest rank's own seconds, {kind}", ratio_rank)
            )
            data[kind] = {
                "checkpoint": res["checkpoint"],
                "cold_wall": cold.to_json(),
                "reload_wall": warm.to_json(),
                "cold_rank_max": cold_rank.to_json(),
                "reload_rank_max": warm_rank.to_json(),
                "plan_load": plan_t.to_json(),
                "placement_and_actor_start": spawn.to_json(),
                "reload_over_cold": ratio.to_json(),
                "reload_over_cold_rank": ratio_rank.to_json(),
                "reloads": res["reloads"],
                "addresses_moved": sum(r["addresses_moved"] for r in res["reloads"]),
            }
        moved = sum(data[k]["addresses_moved"] for k in results)
        return _section(
            "reload",
            "6. Reload in place vs cold load",
            (
                "Embedded Ray (`mxload.cluster.local.start_embedded`: loopback, private temp dir, 4 "
                "virtual NPUs, shut down afterwards), layout tp 2 x dp 2 with expert "
                f'parallelism, `device="cpu"`. {n_sessions} sessions per checkpoint: '
                f"`Session.load(v1)` (cold: plan, placement group, 4 actor processes, load), "
                f"then {n_reloads} `Session.reload` alternating v2 and v1 (a different "
                "checkpoint each time, every buffer rewritten in place), then release. Wall "
                "is what the caller waits for; the slowest rank's own seconds is the "
                "loading work alone. Ratios use every cross pair of cold and reload runs."
            ),
            [
                {
                    "headers": [
                        "checkpoint",
                        "what",
                        "wall",
                        "slowest rank's seconds",
                        "wall / cold",
                        "rank s / cold",
                    ],
                    "rows": rows,
                }
            ],
            notes=[
                f"Embedded Ray start: {ray_start:.1f} s (once, not in any row).",
                f"Addresses moved over all reloads: {moved} (every reload checks every data_ptr).",
            ],
            key_ratios=key,
            data=data,
        )

    def _ray_load_section(self, results: dict[str, Any]) -> dict[str, Any]:
        res = results["big"]
        ck = res["checkpoint"]
        loads = res["loads"]
        cold = Timing(tuple(x["wall"] for x in loads))
        rank_max = Timing(tuple(max(x["rank_seconds"]) for x in loads))
        read_t: Timing = res["read_all_ranks"]
        nbytes = res["bytes_read_all_ranks"]
        per_rank = [
            (s, r, c)
            for x in loads
            for s, r, c in zip(
                x["rank_seconds"], x["read_seconds"], x["convert_seconds"], strict=True
            )
        ]
        over_max = Rate(tuple(s / max(r, c) for s, r, c in per_rank if max(r, c) > 0))
        over_sum = Rate(tuple(s / (r + c) for s, r, c in per_rank if r + c > 0))
        vs_read = paired_ratio(rank_max, read_t)
        wall_vs_read = paired_ratio(cold, read_t)
        rows = [
            [
                "Session.load wall (plan + Ray placement + actors + load)",
                cold.text(2),
                _gbps(ck["bytes"], cold).text(3),
                wall_vs_read.text(1, "x"),
            ],
            [
                "slowest rank's load (the ranks run concurrently)",
                rank_max.text(3),
                _gbps(ck["bytes"], rank_max).text(3),
                vs_read.text(1, "x"),
            ],
            [
                f"read only: all 4 ranks' planned ranges ({fmt_bytes(nbytes)}), one process",
                read_t.text(3),
                _gbps(nbytes, read_t).text(3),
                "1.0x",
            ],
        ]
        overlap = [
            ["rank seconds / max(RunStats.read_seconds, convert_seconds)", over_max.text(2, "x")],
            ["rank seconds / (read_seconds + convert_seconds)", over_sum.text(2, "x")],
        ]
        return _section(
            "load_ray",
            "3b. End-to-end Ray load (tp 2 x dp 2, EP) vs raw read",
            (
                f"The cold loads of benchmark 6 on {ck['label']} ({fmt_bytes(ck['bytes'])}): "
                "`Session.load` = `mxload.orchestrator.runtime.driver.load(keep=True)` on the embedded Ray, 4 "
                "actor processes on 2 cores. Baseline: reading every rank's planned byte "
                "ranges through the storage seam in this process. Per-rank read and convert "
                "seconds come from each actor's `RunStats` (`read_seconds` is time spent "
                "waiting for reads, so with read-ahead it can be far below the read time)."
            ),
            [
                {"headers": ["what", "seconds", "GB/s of checkpoint", "x read"], "rows": rows},
                {
                    "caption": "Inside the ranks (every rank of every cold load)",
                    "headers": ["ratio", "median (min-max, n)"],
                    "rows": overlap,
                },
            ],
            key_ratios=[
                _ratio_row(
                    "Ray load tp2xdp2 EP: slowest rank / read-only of all ranks' ranges", vs_read
                ),
                _ratio_row("Ray load tp2xdp2 EP: Session.load wall / read-only", wall_vs_read),
            ],
            data={
                "cold_wall": cold.to_json(),
                "rank_max": rank_max.to_json(),
                "read_all_ranks": read_t.to_json(),
                "bytes_read_all_ranks": nbytes,
                "rank_over_max_read_convert": over_max.to_json(),
                "rank_over_sum_read_convert": over_sum.to_json(),
            },
        )


def _slim(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest without per-tensor entries (results.json stays small)."""
    out = {k: v for k, v in manifest.items() if k != "ranks"}
    out["ranks"] = [{k: v for k, v in r.items() if k != "tensors"} for r in manifest["ranks"]]
    return out


def _same_files(a: Path, b: Path) -> bool:
    """Whether two converted checkpoints hold the same safetensors bytes (hash per file)."""

    def digests(root: Path) -> dict[str, str]:
        out = {}
        for p in sorted(root.glob("*.safetensors")):
            h = hashlib.blake2b(digest_size=16)
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            out[p.name] = h.hexdigest()
        return out

    da, db = digests(a), digests(b)
    return bool(da) and da == db
