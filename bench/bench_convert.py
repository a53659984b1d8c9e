"""Benchmark of CPU conversion: the naive reference vs the fast path vs a plain memcpy.

Purpose: the evidence behind ``workers/numerics/fast.py`` (its tool choice and its
claims), measured in one run on the same bytes: for each workload (a real linear or
expert shape from the packaged configs in orchestrator/configs) and for 1 thread and for all
cores, each path runs several times after a warm-up; the script prints medians, the
spread (min-max) and ratios, and writes ``bench/results/convert.md`` and ``.json``.

Paths (throughput is GB/s of FP8 source bytes, n * k per call):
- ``memcpy``: ``torch`` ``copy_`` of the same FP8 bytes into a preallocated buffer (the
  ceiling: conversion cannot beat reading and writing the bytes once);
- ``naive``: ``reference.resolve_block`` then ``reference.mx_quantize`` (eager torch, op by
  op), and ``naive+pack``: that plus ``repack.write_rows`` into persistent kernel-layout
  buffers, which is what a rank does per unit;
- ``torch-lut``: the best torch rearrangement tried -- resolve by one 256-entry table per
  tile and a gather, then the reference MX steps -- kept here as the evidence that
  rearranged torch ops stay memory-bound;
- ``fast``: ``fast.convert`` (new tensors); ``fast+write_rows``: that plus
  ``repack.write_rows``; ``fast-packed``: ``fast.convert(..., into=...)`` straight
  into the persistent buffers (the loader's path);
- ``naive-mxq`` / ``fast-mxq``: ``mx_quantize`` of the bf16 resolved tensor (a reload
  from a BF16 checkpoint); GB/s there is of bf16 input bytes (2 per element).

Before timing, every fast result is compared byte for byte with the reference (a bench
of a wrong kernel is worthless). Compile time is measured in fresh subprocesses with an
empty ``NUMBA_CACHE_DIR`` (cold: compile and write the cache) and again (warm: load it).

Limits: wall-clock numbers on a shared machine are noisy; the spread column says how
much, and the load average before and after is recorded. No thresholds are asserted
here (tests never time anything).

Usage: ``python bench/bench_convert.py [--quick] [--repeats N] [--no-compile-time]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mxload.workers.numerics import fast, repack  # noqa: E402
from mxload.workers.numerics import reference as ref  # noqa: E402
from mxload.workers.numerics.backend import ConvertPart, PackedOut  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def rel(path: Path) -> str:
    """A path as printed in recorded output: relative to the repository when inside it, so
    committed results name no machine's folders."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


BLOCK = 128

# (name, N, K): real shapes, from the packaged configs in orchestrator/configs.
WORKLOADS_FULL = [
    ("qwen3-30b-a3b expert w13 [2*768, 2048]", 1536, 2048),
    ("deepseek-v3 expert w13 [2*2048, 7168]", 4096, 7168),
    ("qwen3-32b o_proj [5120, 8192]", 5120, 8192),
]
WORKLOADS_QUICK = [
    ("qwen3-30b-a3b expert w13 [2*768, 2048]", 1536, 2048),
    ("qwen3-30b-a3b o_proj [2048, 4096]", 2048, 4096),
]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight as a real checkpoint has it: each 128x128 tile quantized so its
    amax maps near 448, per-tile scales around 1e-3 (Gaussian weights of std ~0.02)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen) * 0.02
    tr, tc = -(-n // BLOCK), -(-k // BLOCK)
    pad = torch.zeros(tr * BLOCK, tc * BLOCK)
    pad[:n, :k] = x
    tiles = pad.view(tr, BLOCK, tc, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448.0).float()
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = q.view(tr * BLOCK, tc * BLOCK)[:n, :k].contiguous()
    return w, scale.contiguous()


def _torch_lut_convert(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch alternative: one 256-entry resolved table per tile, a gather, then the
    reference MX steps (tile-aligned blocks at row0 = col0 = 0 only)."""
    n, k = w.shape
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    tables = (codes[None, :] * scale.reshape(-1, 1)).to(dtype)  # docs/contract.md §2.1 per code
    tile_row = (torch.arange(n, dtype=torch.int32) // BLOCK) * scale.shape[1]
    tile_col = torch.arange(k, dtype=torch.int32) // BLOCK
    idx = (tile_row[:, None] + tile_col[None, :]) * 256 + w.view(torch.uint8).int()
    resolved = tables.view(-1)[idx]
    return ref.mx_quantize(resolved)


def _same_payload(a: torch.Tensor, b: torch.Tensor) -> bool:
    x, y = a.view(torch.uint8).clone(), b.view(torch.uint8).clone()
    x[(x & 0x7F) == 0x7F] = 0x7F
    y[(y & 0x7F) == 0x7F] = 0x7F
    return bool(torch.equal(x, y))


Row = dict[str, Any]
"""One path's measurements: seconds, GB/s, ratios, and ``wall_s``, the per-repeat times."""


def _time_interleaved(
    paths: dict[str, tuple[Callable[[], object], int]], repeats: int
) -> dict[str, Row]:
    """Wall and CPU seconds per call of every path. Paths take turns within each repeat,
    so background load on a shared machine hits all of them alike."""
    for fn, _ in paths.values():
        fn()  # warm-up: allocator, caches, first-call work
    wall: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(repeats):
        for path, (fn, _) in paths.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[path].append(time.perf_counter() - t0)
            cpu[path].append(time.process_time() - c0)
    out: dict[str, Row] = {}
    for path, (_, size) in paths.items():
        med = statistics.median(wall[path])
        out[path] = {
            "median_s": med,
            "min_s": min(wall[path]),
            "max_s": max(wall[path]),
            "cpu_s": statistics.median(cpu[path]),
            "gbps": size / med / 1e9,
            "gbps_min": size / max(wall[path]) / 1e9,
            "gbps_max": size / min(wall[path]) / 1e9,
            # GB per CPU-second: throughput per busy core, insensitive to waiting.
            "gbps_per_cpu_s": size / max(statistics.median(cpu[path]), 1e-9) / 1e9,
            "wall_s": wall[path],
        }
    return out


def _paired(rows: dict[str, Row], path: str, base: str) -> tuple[float, float, float]:
    """Speed of ``path`` over ``base`` per repeat (their calls ran back to back), as
    (median, min, max): the spread of the ratio itself, steadier than either side's
    seconds on a shared machine. Sizes differ only between the mxq rows and the rest,
    which are never paired across."""
    pairs = zip(rows[path]["wall_s"], rows[base]["wall_s"], strict=True)
    ratios = [b / p for p, b in pairs]
    return statistics.median(ratios), min(ratios), max(ratios)


def _compile_times() -> dict[str, float | str]:
    """Seconds for ``fast_available()`` in a fresh process: cold (empty numba cache:
    compile everything and write the cache) and warm (load the cache)."""
    code = (
        "import time; t = time.perf_counter(); from mxload.workers.numerics import fast; "
        "ok = fast.fast_available(); print(time.perf_counter() - t, ok)"
    )
    out: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold_s", "warm_s"):
            proc = subprocess.run(
                [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                text=True, check=True,
            )  # fmt: skip
            seconds, ok = proc.stdout.split()
            if ok != "True":
                raise SystemExit(f"fast path unavailable in a fresh process: {proc.stderr}")
            out[label] = round(float(seconds), 2)
    out["note"] = (
        "fast_available() in a fresh process, including `import mxload.workers.numerics.fast`"
    )
    return out


def _bench_workload(
    name: str, n: int, k: int, threads: list[int], repeats: int
) -> dict[str, object]:
    w, scale = _weights(n, k, seed=n * 7 + k)
    dtype = torch.bfloat16
    kw = dict(row0=0, col0=0, block_n=BLOCK, block_k=BLOCK, dtype=dtype)
    nbytes = n * k
    g = k // 32

    # Correctness first, untimed.
    want_p, want_s = ref.mx_quantize(ref.resolve_block(w, scale, **kw))
    part = [ConvertPart(w, scale)]

    def fast_convert(
        into: list[PackedOut] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return fast.convert(part, block_n=BLOCK, block_k=BLOCK, dtype=dtype, into=into)

    [(got_p, got_s)] = fast_convert()
    lut_p, lut_s = _torch_lut_convert(w, scale, dtype)
    buf_w = torch.empty((k, n), dtype=torch.float8_e4m3fn)
    buf_s = torch.empty(((g + 1) // 2, n, 2), dtype=torch.uint8)
    ref_w, ref_s = buf_w.clone(), buf_s.clone()
    repack.write_rows(ref_w, ref_s, want_p, want_s, 0)
    into = [PackedOut(buf_w, buf_s)]
    fast_convert(into)
    resolved = ref.resolve_block(w, scale, **kw)
    mxq_p, mxq_s = fast.mx_quantize(resolved)
    checks = {
        "fast == reference": _same_payload(got_p, want_p) and torch.equal(got_s, want_s),
        "fast-packed == reference + write_rows": _same_payload(buf_w, ref_w)
        and torch.equal(buf_s, ref_s),
        "fast-mxq == reference": _same_payload(mxq_p, want_p) and torch.equal(mxq_s, want_s),
        "torch-lut == reference": _same_payload(lut_p, want_p) and torch.equal(lut_s, want_s),
    }
    if not all(checks.values()):
        raise SystemExit(f"{name}: results differ from the reference: {checks}")

    dst = torch.empty_like(w)

    def naive_pack() -> None:
        p, s = ref.mx_quantize(ref.resolve_block(w, scale, **kw))
        repack.write_rows(buf_w, buf_s, p, s, 0)

    paths: dict[str, tuple[Callable[[], object], int]] = {
        "memcpy": (lambda: dst.copy_(w), nbytes),
        "naive": (lambda: ref.mx_quantize(ref.resolve_block(w, scale, **kw)), nbytes),
        "naive+pack": (naive_pack, nbytes),
        "torch-lut": (lambda: _torch_lut_convert(w, scale, dtype), nbytes),
        "fast": (lambda: fast_convert(), nbytes),
        "fast+write_rows": (
            lambda: repack.write_rows(buf_w, buf_s, *fast_convert()[0], 0),
            nbytes,
        ),
        "fast-packed": (
            lambda: fast_convert(into),
            nbytes,
        ),
        "naive-mxq": (lambda: ref.mx_quantize(resolved), 2 * nbytes),
        "fast-mxq": (lambda: fast.mx_quantize(resolved), 2 * nbytes),
    }
    per_threads: dict[str, dict[str, Row]] = {}
    for t in threads:
        torch.set_num_threads(t)
        rows = _time_interleaved(paths, repeats)
        for path, r in rows.items():
            base = "naive-mxq" if path.endswith("mxq") else "naive"
            r["x_naive"], r["x_naive_min"], r["x_naive_max"] = _paired(rows, path, base)
            # memcpy moves n*k bytes; the mxq rows read 2*n*k, so scale their ratio.
            per = 2.0 if path.endswith("mxq") else 1.0
            r["x_memcpy"] = _paired(rows, path, "memcpy")[0] * per
        per_threads[str(t)] = rows
        _print_rows(name, t, rows)
    return {"name": name, "shape": [n, k], "fp8_bytes": nbytes, "checks": checks,
            "threads": per_threads}  # fmt: skip


def _print_rows(name: str, threads: int, rows: dict[str, Row]) -> None:
    print(f"\n{name}, {threads} thread(s)")
    head = f"  {'path':<15} {'GB/s':>7} {'min-max':>13} {'x naive':>7} {'min-max':>11}"
    print(head + f" {'x memcpy':>9} {'GB/cpu-s':>9}")
    for path, r in rows.items():
        spread = f"{r['gbps_min']:.3f}-{r['gbps_max']:.3f}"
        xspread = f"{r['x_naive_min']:.1f}-{r['x_naive_max']:.1f}"
        print(
            f"  {path:<15} {r['gbps']:7.3f} {spread:>13} {r['x_naive']:7.2f} {xspread:>11} "
            f"{r['x_memcpy']:9.3f} {r['gbps_per_cpu_s']:9.3f}"
        )


def _markdown(report: dict[str, object]) -> str:
    m = report["machine"]
    assert isinstance(m, dict)
    lines = [
        "# CPU conversion benchmark",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, numba {m['numba']} "
        f"(threading layer {m['threading_layer']}); load average before/after: "
        f"{m['load_before']} / {m['load_after']}.",
        "",
        "GB/s of FP8 source bytes per call (the `*-mxq` rows: of bf16 input bytes), median "
        f"of {report['repeats']} runs after a warm-up; min-max is the spread over those "
        "runs. Paths take turns within each repeat; `x naive` is the median over repeats "
        "of (naive seconds / path seconds) for calls that ran back to back (`naive-mxq` "
        "for the mxq rows), with its min-max; `x memcpy` likewise against a torch copy of "
        "the FP8 bytes; `GB per CPU-s` divides by the CPU time of all threads "
        "(throughput per busy core, insensitive to waiting on a loaded machine). "
        "Every fast result was checked byte for byte against the reference before timing.",
        "",
    ]
    busiest = max(max(m["load_before"]), max(m["load_after"]))
    if busiest > m["cores"]:
        lines += [
            f"Note: the load average reached {busiest} on {m['cores']} cores during this run "
            "(other work on a shared machine), so the multi-thread rows measure contention "
            "as much as the code (torch's OpenMP threads suffer most); the 1-thread rows and "
            "the GB-per-CPU-s column are the steadier evidence.",
            "",
        ]
    comp = report.get("compile")
    if isinstance(comp, dict):
        lines += [
            f"Compile (fresh process, `fast_available()`): cold cache {comp['cold_s']} s, "
            f"warm cache {comp['warm_s']} s.",
            "",
        ]
    workloads = report["workloads"]
    assert isinstance(workloads, list)
    for wl in workloads:
        lines.append(f"## {wl['name']} ({wl['fp8_bytes'] / 1e6:.1f} MB FP8)")
        lines.append("")
        for t, rows in wl["threads"].items():
            lines.append(f"{t} thread(s):")
            lines.append("")
            lines.append("| path | GB/s | min-max | x naive | min-max | x memcpy | GB per CPU-s |")
            lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
            for path, r in rows.items():
                lines.append(
                    f"| {path} | {r['gbps']:.3f} | {r['gbps_min']:.3f}-{r['gbps_max']:.3f} | "
                    f"{r['x_naive']:.2f} | {r['x_naive_min']:.1f}-{r['x_naive_max']:.1f} | "
                    f"{r['x_memcpy']:.3f} | {r['gbps_per_cpu_s']:.3f} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per path")
    parser.add_argument(
        "--no-compile-time", action="store_true", help="skip the fresh-process compile timing"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    if not fast.fast_available():
        print(f"fast path unavailable: {fast.unavailable_reason()}", file=sys.stderr)
        return 1
    import numba

    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    report: dict[str, object] = {
        "command": "python bench/bench_convert.py" + (" --quick" if args.quick else ""),
        "repeats": repeats,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": cores,
            "torch": torch.__version__,
            "numba": numba.__version__,
            "threading_layer": numba.threading_layer(),
            "load_before": [round(x, 2) for x in os.getloadavg()],
        },
    }
    if not args.no_compile_time:
        report["compile"] = _compile_times()
        print(f"compile: {report['compile']}")
    workloads = WORKLOADS_QUICK if args.quick else WORKLOADS_FULL
    report["workloads"] = [_bench_workload(nm, n, k, threads, repeats) for nm, n, k in workloads]
    machine = report["machine"]
    assert isinstance(machine, dict)
    machine["load_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "convert.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "convert.md").write_text(_markdown(report))
    print(f"\nwrote {rel(RESULTS / 'convert.md')} and {rel(RESULTS / 'convert.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
