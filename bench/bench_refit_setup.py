"""What a refit process spends before its first step, at a production layout.

Every trainer rank (``MxloadSender``) and every engine rank (``attach_trainer``) builds
the transfer plan in detail (``plan.refit.refit_plan``: every piece of every link), then
its own side: a trainer rank the receive layout and message cuts of each engine rank it
feeds, an engine rank its own (the plan's digest is hashed as it is built). On a node of
16 NPUs with a colocated trainer that is 32 such processes, so their seconds and peak
memory are what an operator sees at init.

Phases, each in a fresh process from config alone (``--child``): ``summary`` (the same
walk counting, no pieces: the baseline, ``mxload plan --from-trainer``'s cost),
``plan`` (the detailed plan), ``sender`` (plan + trainer rank 0's side),
``receiver`` (plan + engine rank 0's side); then the peak and the memory the process
still holds once it keeps only its share (``RefitPlan.only``). Repeats take turns; medians with
min-max; each phase's seconds and peak RSS over the baseline's in the same repeat.

Usage: ``python bench/bench_refit_setup.py [--repeats 3] [--big] [--out bench/results]``
(``--big`` adds Qwen3-235B-A22B, EP: about a minute and 3 GiB a phase).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, log, machine_facts, md_table

PHASES = ("summary", "plan", "sender", "receiver")
CASES = {
    "qwen3.8-27b-fp8": {"tp": 8, "dp": 8},
    "qwen3-235b-a22b-fp8": {"tp": 8, "dp": 8, "enable_expert_parallel": True},
}
TRAINER_RANKS = 64
DEVICES_PER_NODE = 16


def child(phase: str, model: str) -> dict[str, Any]:
    """One phase in this process: seconds (imports excluded) and peak RSS."""
    from mxload.orchestrator.plan.config import parse_config
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.refit import (
        needed_shapes,
        open_share,
        receive_layout,
        refit_plan,
        refit_summary,
        sender_share,
    )
    from mxload.orchestrator.plan.trainer import fsdp_manifest
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.models import model_config_path
    from mxload.workers.transfer.exchange import _Landing, link_buckets

    t0 = time.perf_counter()
    config = parse_config(json.loads(model_config_path(model).read_text()))
    plan = build_plan(config, ParallelLayout(**CASES[model]), device="npu", remote=True)
    manifest = fsdp_manifest(needed_shapes(plan), TRAINER_RANKS, devices_per_node=DEVICES_PER_NODE)
    world = plan.layout.world
    out: dict[str, Any] = {}
    kept: Any = None
    if phase == "summary":
        s = refit_summary(plan, manifest, receiver_nodes=tuple(range(world)))
        out["transfers"] = s.transfers
    else:
        rp = refit_plan(plan, manifest, receiver_nodes=tuple(range(world)))
        out["transfers"] = sum(len(b.transfers) for b in rp.buckets)
        # as exchange.Sender and exchange.Receiver set up rank 0, then keep its share
        if phase == "sender":
            units = {r: ranked.units for r, ranked in enumerate(plan.ranks)}
            blob = sender_share(rp, 0, units)
            del rp  # as MxloadSender does, before the share is opened
            share, layouts = open_share(blob)
            links = {r: bs for (_, r), bs in link_buckets(share).items()}
            kept = (share, [_Landing(layouts[r], bs) for r, bs in links.items()])
        elif phase == "receiver":
            share = rp.only(receiver=0)
            del rp  # as attach_trainer does, before the receiver is built
            kept = (
                share,
                _Landing(
                    receive_layout(plan.ranks[0].units, share, 0),
                    [b.transfers for b in share.buckets],
                ),
            )
        else:
            kept = rp
    out["seconds"] = time.perf_counter() - t0
    gc.collect()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open("/proc/self/statm") as f:
        out["held_rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    del kept
    return out


def run_child(phase: str, model: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", phase, model],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))}, n={len(values)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("PHASE", "MODEL"), help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big", action="store_true", help="add Qwen3-235B-A22B (EP)")
    ap.add_argument("--out", type=Path, default=None, help="write refit-setup.{md,json} here")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    models = list(CASES) if args.big else ["qwen3.8-27b-fp8"]
    before = load_average()
    got: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for i in range(args.repeats):
        for model in models:
            for phase in PHASES:
                log(f"repeat {i + 1}/{args.repeats}: {model} {phase}")
                got.setdefault((model, phase), []).append(run_child(phase, model))
    after = load_average()
    rows = []
    for model in models:
        base = got[(model, "summary")]
        for phase in PHASES:
            runs = got[(model, phase)]
            secs = [r["seconds"] for r in runs]
            rss = [r["peak_rss"] / 2**20 for r in runs]
            x_s = [r["seconds"] / b["seconds"] for r, b in zip(runs, base, strict=True)]
            x_m = [r["peak_rss"] / b["peak_rss"] for r, b in zip(runs, base, strict=True)]
            held = [r["held_rss"] / 2**20 for r in runs]
            rows.append(
                [
                    f"{model}, tp 8 x dp 8{' EP' if 'enable_expert_parallel' in CASES[model] else ''}",
                    phase,
                    f"{runs[0]['transfers']:,}",
                    spread(secs, "{:.1f} s"),
                    spread(x_s, "{:.2f}"),
                    spread(rss, "{:.0f} MiB"),
                    spread(x_m, "{:.2f}"),
                    spread(held, "{:.0f} MiB"),
                ]
            )
    facts = machine_facts()
    text = "\n".join(
        [
            "# Refit setup at scale (from fsdp:64, config alone)",
            "",
            f"`python bench/bench_refit_setup.py{' --big' if args.big else ''}`, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
            f"{facts.get('git_commit', '?')}; load average before {before}, after {after}.",
            "",
            md_table(
                [
                    "layout",
                    "phase",
                    "pieces",
                    "seconds",
                    "x summary",
                    "peak RSS",
                    "x summary",
                    "RSS held after (its share kept)",
                ],
                rows,
            ),
            "",
        ]
    )
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "refit-setup.md").write_text(text)
        raw = {f"{m}/{p}": v for (m, p), v in got.items()}
        (args.out / "refit-setup.json").write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
