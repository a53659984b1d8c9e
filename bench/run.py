"""The benchmark suite, one command: ``python bench/run.py [--quick] [--out bench/results]``.

Purpose: run every benchmark of the suite (see ``bench/README.md``) in one process, in an
order that shares the expensive parts (checkpoints are written once; one embedded Ray
serves every session), and write

* ``OUT/RESULTS.md``: the command, date and machine facts, a table of the key ratios
  (median, min-max, n), then one section per benchmark with its tables and notes;
* ``OUT/results.json``: the same, with every sample;
* ``OUT/ratios.png`` when matplotlib is importable (skipped, and said so, otherwise);
* ``OUT/suite-convert/``: what ``bench/bench_convert.py`` wrote when delegated to.

Why ratios: the machine is small and shared, absolute seconds swing with other people's
work; each headline divides two things timed back to back in this run (see
``bench/common.py``). A benchmark that fails is reported as failed in RESULTS.md (with
its error) and the others still run; the exit status is then 1.

Limits: ``--quick`` (~0.19 GB checkpoint, fewer repeats) took 2 minutes on a quiet 2-core
machine and 6 at a load average of 10; the full run (~2 GB) took 12-15 minutes. Time
budgets cap the slow comparisons (never below 2 repeats), so a loaded machine costs
repeats before it costs much time.
Scratch files go to a private temp dir (``--workdir`` to choose one, ``--keep-workdir``
to keep it); Ray is started embedded on loopback and shut down before the command ends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    ROOT,
    load_average,
    log,
    machine_facts,
    md_table,
    render_section,
    run_timed,
)

SECTIONS = ("kernels", "convert", "load", "amplification", "staging", "reload", "plan")
"""Names accepted by ``--only`` (``reload`` also produces the Ray rows of benchmark 3)."""

ORDER = ("kernels", "convert", "load", "load_ray", "amplification", "staging", "reload", "plan")
"""Order of sections in RESULTS.md (the benchmark numbers of the issue)."""


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# mxload benchmark results",
        "",
        f"Command: `{report['command']}`  ",
        f"Date: {m['date_utc']}; suite wall time {report['seconds']:.0f} s.  ",
        f"Machine: {m['nproc']} cores ({m['cpu']}), {m['mem_total_gib']} GiB RAM; Python "
        f"{m['python']}, torch {m['torch']}, ray {m['ray']}, numba {m['numba']}, numpy "
        f"{m['numpy']}; commit {m['git_commit']}"
        + (" with uncommitted changes" if m.get("git_dirty") else "")
        + ".  ",
        f"Load average (1/5/15 min) at start: {m['load_average_start']}, at end: "
        f"{m.get('load_average_end')}. Numba fast path in a fresh process: "
        f"{report.get('fast_startup', '?')}.",
        "",
        "How to read: the machine is small and shared, so absolute seconds are noisy. Every "
        "headline is a ratio against a baseline measured in the same run, candidates take "
        "turns within each repeat, and every number is a median with its spread "
        "(min-max over repeats, or over ranks where a row says so; n = how many). GB are "
        "10^9 bytes. Reads hit the page cache unless a row says cold.",
        "",
        "## Key ratios",
        "",
    ]
    rows = []
    for key in ORDER:
        sec = report["sections"].get(key)
        if not sec:
            continue
        for r in sec.get("key_ratios", []):
            if "median" in r:
                # Ratios near 1 (read amplification, staging) need more digits to say anything.
                d = 5 if all(abs(r[k] - 1.0) < 0.01 for k in ("median", "min", "max")) else 3
                rows.append(
                    [
                        r["name"],
                        f"{r['median']:.{d}f}",
                        f"{r['min']:.{d}f}-{r['max']:.{d}f}",
                        r["n"],
                    ]
                )
            elif "median_s" in r:
                rows.append(
                    [
                        r["name"],
                        f"{r['median_s']:.3f} s",
                        f"{r['min_s']:.3f}-{r['max_s']:.3f} s",
                        r["n"],
                    ]
                )
    lines += [md_table(["what", "median", "min-max", "n"], rows), ""]
    failed = [k for k, s in report["sections"].items() if s.get("error")]
    if failed:
        lines += [f"**Failed sections**: {', '.join(failed)} (see below).", ""]
    if report.get("plot"):
        lines += [f"![key ratios]({report['plot']})", ""]
    elif report.get("plot_note"):
        lines += [f"({report['plot_note']})", ""]
    if report.get("checkpoints"):
        lines += ["Checkpoints written for this run (workers.synth.make_checkpoint):", ""]
        ck_rows = [
            [name, c["label"], f"{c['bytes'] / 1e9:.3f} GB", f"{c['make_seconds']:.1f} s"]
            for name, c in report["checkpoints"].items()
        ]
        lines += [md_table(["name", "what", "tensor bytes", "time to write"], ck_rows), ""]
    for key in ORDER:
        sec = report["sections"].get(key)
        if sec:
            lines.append(render_section(sec))
    return "\n".join(lines).rstrip() + "\n"


def _plot(report: dict[str, Any], out: Path) -> tuple[str | None, str | None]:
    """A horizontal bar chart of the key ratios with min-max whiskers, if matplotlib is here."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except Exception as exc:
        return None, f"no plot: matplotlib is not importable ({type(exc).__name__})"
    items = [
        r
        for key in ORDER
        for r in (report["sections"].get(key) or {}).get("key_ratios", [])
        if "median" in r and r["median"] > 0
    ]
    if not items:
        return None, "no plot: no ratios"
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(items) + 1))
    ys = range(len(items))
    med = [r["median"] for r in items]
    lo = [r["median"] - r["min"] for r in items]
    hi = [r["max"] - r["median"] for r in items]
    ax.barh(list(ys), med, xerr=[lo, hi], color="#4c72b0", capsize=3)
    ax.set_yticks(list(ys), [r["name"] for r in items], fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (median, min-max whiskers), log scale")
    fig.tight_layout()
    path = out / "ratios.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name, None


def _fast_startup() -> str:
    """Seconds for ``fast_available()`` in a fresh process (numba cache load, or a compile
    after fast.py changed): the fixed cost every convert process and Ray worker pays."""
    code = (
        "import time; t = time.perf_counter(); from mxload.workers.numerics import fast; "
        "ok = fast.fast_available(); print(round(time.perf_counter() - t, 2), ok)"
    )
    try:
        secs, ok = run_timed([sys.executable, "-c", code])[1].split()
    except Exception as exc:
        return f"could not measure ({exc})"
    return (
        f"available={ok}, {secs} s for `fast_available()` (it compiles if the numba cache is stale)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~200 MB checkpoint, fewer repeats")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated subset of: {', '.join(SECTIONS)}"
    )
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the scratch folder")
    args = parser.parse_args(argv)
    only = set(SECTIONS) if not args.only else {s.strip() for s in args.only.split(",")}
    unknown = only - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}; choose from {SECTIONS}")

    from bench.bench_load import Suite
    from bench.bench_plan import bench_plan

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mxbench-", dir="/tmp")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/run.py" + (" --quick" if args.quick else "")
    if args.only:
        cmd += f" --only {args.only}"
    if args.out != str(ROOT / "bench" / "results"):
        cmd += f" --out {args.out}"
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "format": "mxload-bench/1",
        "command": cmd,
        "quick": args.quick,
        "machine": machine_facts(),
        "sections": {},
    }
    log(f"{cmd}: scratch in {workdir}, results to {out}")
    report["fast_startup"] = _fast_startup()
    log(f"fast path start-up: {report['fast_startup']}")
    suite = Suite(quick=args.quick, workdir=workdir, out=out)

    def attempt(key: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        load0 = load_average()
        try:
            got = fn()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            log(f"{key}: FAILED: {type(exc).__name__}: {exc}")
            report["sections"][key] = {
                "key": key,
                "title": key,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
            return
        for sec in got if isinstance(got, list) else [got]:
            sec["seconds"] = round(time.perf_counter() - t0, 1)
            sec["load_average"] = [load0, load_average()]
            report["sections"][sec["key"]] = sec
        log(f"{key}: done in {time.perf_counter() - t0:.0f} s")

    needs_big = only & {"convert", "load", "amplification", "staging", "reload"}
    try:
        if "plan" in only:
            attempt("plan", lambda: bench_plan(quick=args.quick))
        if "kernels" in only:
            attempt("kernels", suite.kernels)
        if needs_big:
            kinds = ["big", "tiny"] if "reload" in only else ["big"]
            try:
                report["checkpoints"] = suite.make_checkpoints(kinds)
            except Exception as exc:
                for key in needs_big:
                    report["sections"][key] = {
                        "key": key,
                        "title": key,
                        "error": f"making checkpoints failed: {type(exc).__name__}: {exc}",
                    }
                needs_big = set()
        if "convert" in needs_big:
            attempt("convert", suite.convert)
            for d in workdir.glob("converted-*"):
                shutil.rmtree(d, ignore_errors=True)
        if "load" in needs_big:
            attempt("load", suite.load)
        # Sessions before amplification and staging: those two also report the Ray
        # ranks' measured fields.
        if "reload" in needs_big:
            attempt("reload", suite.sessions)
        if "amplification" in needs_big:
            attempt("amplification", suite.amplification)
        if "staging" in needs_big:
            attempt("staging", suite.staging)
    finally:
        if own_workdir and not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = time.perf_counter() - t_start
    report["machine"]["load_average_end"] = load_average()
    report["plot"], report["plot_note"] = _plot(report, out)
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "RESULTS.md").write_text(render(report))
    log(f"wrote {out / 'RESULTS.md'} and {out / 'results.json'} in {report['seconds']:.0f} s")
    return 1 if any(s.get("error") for s in report["sections"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
