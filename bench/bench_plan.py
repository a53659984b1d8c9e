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
    return sum(plan.classes[s.rank_class].units for s in plan.summaries)


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
            }
        ],
        "notes": [
            'docs/contract.md §4 asks for a 256-rank DeepSeek-V3 plan "in seconds"; the in-process '
            "column is that number. The command column adds interpreter start and imports.",
        ],
        "key_ratios": key,
        "data": {"cases": data},
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
