"""Benchmark 7: planning time from config alone (docs/contract.md §4: "a DeepSeek-V3-sized plan for 256
ranks in seconds").

Purpose: how long ``mxload.orchestrator.plan.planner.build_plan`` takes for the real configs in
the packaged configs (orchestrator/configs) at production layouts, measured two ways:

* in-process: ``parse_config`` + ``build_plan`` repeated after one warm-up call (imports
  and first-call costs excluded), median and min-max;
* whole command: ``mxload plan --config FILE LAYOUT --json`` as a fresh process (what an
  operator waits for: interpreter start, imports, planning, JSON on stdout).

Baseline in the same run: the interpreter alone (``python -c pass``) and the import of
the planner (``python -c "import mxload.orchestrator.plan.planner"``), so the share of the command
that is planning is visible. Also reported: the size of the plan JSON (``plan_to_json``)
and of the ranks' byte ranges (none: config-only plans have no reads).

Limits: config-only plans (no checkpoint headers, so no byte ranges); DeepSeek-V3 is
planning-only in mxload. Wall-clock on a shared machine: read the spread column.

Usage: ``python bench/bench_plan.py [--quick]`` prints the section as markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxload.orchestrator.runtime.models import model_config_path

from bench.common import (
    Timing,
    fmt_bytes,
    interleave,
    log,
    run_timed,
)

CONFIGS = model_config_path("deepseek-v3").parent  # the packaged configs


def units_of(plan: Any) -> int:
    """Units of every rank, counted from the plan's classes (building every rank's
    units would cost more than the plan)."""
    return sum(plan.classes[s.rank_class].unit_count for s in plan.summaries)


@dataclass(frozen=True)
class PlanCase:
    """One config and layout to plan."""

    label: str
    config: Path
    tp: int
    dp: int
    pp: int = 1
    ep: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def cli_layout(self) -> list[str]:
        out = ["--tp", str(self.tp), "--dp", str(self.dp), "--pp", str(self.pp)]
        return out + (["--enable-expert-parallel"] if self.ep else [])


CASES = (
    PlanCase("DeepSeek-V3, tp 8 x dp 32, EP (256 ranks)", CONFIGS / "deepseek-v3.json", 8, 32),
    PlanCase("Qwen3-30B-A3B, tp 8 x dp 4, EP (32 ranks)", CONFIGS / "qwen3-30b-a3b-fp8.json", 8, 4),
)


def _plan_once(case: PlanCase) -> Any:
    from mxload.orchestrator.plan.config import parse_config
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.types import ParallelLayout

    raw = json.loads(case.config.read_text())
    cfg = parse_config(raw, str(case.config))
    layout = ParallelLayout(tp=case.tp, dp=case.dp, pp=case.pp, enable_expert_parallel=case.ep)
    return build_plan(cfg, layout)


SCALING = (
    # (model, tp, dp values, EP): plan --json of a growing cluster; the first is the baseline
    ("qwen3-235b-a22b-fp8", 4, (2, 8, 32, 128), False),
    ("qwen3-32b-fp8", 8, (1, 8, 64, 512), False),
    ("deepseek-v3", 8, (2, 8, 32), True),
)

_MEASURE = (
    "import io, json, resource, sys, time, contextlib\n"
    "from mxload.orchestrator.cli.commands import main\n"
    "t = time.perf_counter()\n"
    "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
    "    rc = main(sys.argv[1:])\n"
    "wall = time.perf_counter() - t\n"
    "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
    "print(json.dumps({'rc': rc, 'seconds': wall, 'max_rss_bytes': rss, 'json_bytes': len(out.getvalue())}))\n"
)


def plan_scaling(*, quick: bool) -> tuple[list[list[object]], list[dict[str, Any]]]:
    """``mxload plan --model M --tp T --dp N --json`` in a fresh process per layout: its
    planning seconds (imports excluded) and peak RSS, each against the smallest layout of
    the same model in the same run (the ratio should stay near 1 as ranks grow)."""
    import subprocess

    rows: list[list[object]] = []
    data: list[dict[str, Any]] = []
    for model, tp, dps, ep in SCALING:
        base: dict[str, Any] | None = None
        for dp in dps[:3] if quick else dps:
            flags = ["plan", "--model", model, "--tp", str(tp), "--dp", str(dp), "--json"]
            flags += ["--enable-expert-parallel"] if ep else []
            log(f"plan scaling: {model} tp {tp} x dp {dp}")
            done = subprocess.run(
                [sys.executable, "-c", _MEASURE, *flags],
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(done.stdout.strip().splitlines()[-1])
            base = base or got
            rows.append(
                [
                    f"{model}, tp {tp} x dp {dp}{' EP' if ep else ''}",
                    tp * dp,
                    f"{got['seconds']:.2f} s",
                    f"{got['seconds'] / base['seconds']:.2f}",
                    fmt_bytes(got["max_rss_bytes"]),
                    f"{got['max_rss_bytes'] / base['max_rss_bytes']:.2f}",
                    fmt_bytes(got["json_bytes"]),
                ]
            )
            data.append({"model": model, "tp": tp, "dp": dp, "ep": ep, "ranks": tp * dp, **got})
    return rows, data


def bench_plan(*, quick: bool) -> dict[str, Any]:
    """Run benchmark 7; returns a section (see ``bench/run.py``)."""
    from mxload.orchestrator.plan.planner import plan_to_json

    repeats = 3 if quick else 7
    cli_repeats = 2 if quick else 5
    rows: list[list[object]] = []
    data: list[dict[str, Any]] = []
    key: list[dict[str, Any]] = []
    py = sys.executable
    for case in CASES:
        if not case.config.exists():
            rows.append([case.label, "config missing", "-", "-", "-", "-", "-"])
            continue
        log(f"plan: {case.label}")
        plan = _plan_once(case)  # warm-up, and the plan whose size we report
        body = json.dumps(plan_to_json(plan))

        def plan_again(c: PlanCase = case) -> None:
            _plan_once(c)

        inproc = interleave({"plan": plan_again}, repeats=repeats, warmup=0)["plan"]
        cmd = [py, "-m", "mxload.orchestrator.cli", "plan", "--config", str(case.config)]
        cmd += [*case.cli_layout(), "--json"]
        cli: list[float] = []
        interp: list[float] = []
        imports: list[float] = []
        for _ in range(cli_repeats):
            # The three processes take turns, so background load hits them alike.
            interp.append(run_timed([py, "-c", "pass"])[0])
            imports.append(run_timed([py, "-c", "import mxload.orchestrator.plan.planner"])[0])
            wall, out = run_timed(cmd)
            cli.append(wall)
            if json.loads(out).get("parallel", {}).get("world") != case.world:
                raise RuntimeError(
                    f"mxload plan printed a plan of the wrong world for {case.label}"
                )
        t_cli, t_interp, t_imp = Timing(tuple(cli)), Timing(tuple(interp)), Timing(tuple(imports))
        rows.append(
            [
                case.label,
                inproc.text(3),
                t_cli.text(2),
                t_interp.text(2),
                t_imp.text(2),
                fmt_bytes(len(body)),
                f"{len(plan.ranks)} ranks, {units_of(plan)} units",
            ]
        )
        key.append(
            {
                "name": f"plan {case.label}: in-process seconds",
                **inproc.to_json(),
            }
        )
        data.append(
            {
                "case": case.label,
                "config": f"orchestrator/configs/{case.config.name}",
                "layout": {"tp": case.tp, "dp": case.dp, "pp": case.pp, "ep": case.ep},
                "in_process": inproc.to_json(),
                "cli": t_cli.to_json(),
                "python_start": t_interp.to_json(),
                "import_planner": t_imp.to_json(),
                "plan_json_bytes": len(body),
                "ranks": len(plan.ranks),
                "units": units_of(plan),
            }
        )
    scale_rows, scale_data = plan_scaling(quick=quick)
    return {
        "key": "plan",
        "title": "7. Planning time from config alone",
        "what": (
            "`build_plan` from config.json (no weights, no headers). In-process: median of "
            f"{repeats} runs after a warm-up. Command: `python -m orchestrator.cli plan "
            "--config FILE LAYOUT --json` as a fresh process (what `mxload plan` runs), "
            f"{cli_repeats} runs, taking turns with two baselines: the bare interpreter "
            "(`python -c pass`) and importing the planner."
        ),
        "tables": [
            {
                "headers": [
                    "case",
                    "build_plan in-process",
                    "`mxload plan --json` process",
                    "python -c pass",
                    "import mxload.orchestrator.plan.planner",
                    "plan JSON",
                    "plan size",
                ],
                "rows": rows,
            },
            {
                "headers": [
                    "layout (plan --json, config only)",
                    "ranks",
                    "planning",
                    "x smallest",
                    "peak RSS",
                    "x smallest",
                    "JSON",
                ],
                "rows": scale_rows,
            },
        ],
        "notes": [
            'docs/contract.md §4 asks for a 256-rank DeepSeek-V3 plan "in seconds"; the in-process '
            "column is that number. The command column adds interpreter start and imports.",
            "Second table: the planner's cost against rank count. Ranks at the same stage, "
            "TP rank and MoE rank are one class, planned once; the per-rank JSON grows with "
            "ranks, the planning should not.",
        ],
        "key_ratios": key,
        "data": {"cases": data, "scaling": scale_data},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from bench.run import render_section

    print(render_section(bench_plan(quick=args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
