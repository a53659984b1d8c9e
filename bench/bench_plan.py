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

Usage: ``python bench/bench_plan.py [--quick]`` prints the section as markdown;
``python bench/bench_plan.py --scaling`` runs only the rank-count table (8 to 4,096
ranks, five series over four models) and writes ``bench/results/plan-scale.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
    load_average,
    log,
    machine_facts,
    render_section,
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


@dataclass(frozen=True)
class ScaleCase:
    """One layout of a scaling series: ``mxload plan --model M ... --json``."""

    model: str
    tp: int
    dp: int
    pp: int = 1
    ep: bool = False

    @property
    def ranks(self) -> int:
        return self.tp * self.dp * self.pp

    def flags(self) -> list[str]:
        out = ["plan", "--model", self.model, "--tp", str(self.tp), "--dp", str(self.dp)]
        out += ["--pp", str(self.pp)] if self.pp > 1 else []
        return out + (["--enable-expert-parallel"] if self.ep else []) + ["--json"]

    def label(self) -> str:
        pp = f" x pp {self.pp}" if self.pp > 1 else ""
        return f"{self.model}, tp {self.tp} x dp {self.dp}{pp}{' EP' if self.ep else ''}"


def _series(
    model: str, tp: int, layouts: tuple[tuple[int, int], ...], ep: bool = False
) -> tuple[ScaleCase, ...]:
    return tuple(ScaleCase(model, tp, dp, pp, ep) for dp, pp in layouts)


SCALING = (
    # (dp, pp) from 8 ranks to the largest valid layout up to 4,096; the first of each
    # series is its baseline. Experts TP-sharded over dp x tp (no EP) are the hard case:
    # every MoE rank holds a different slice of every expert.
    _series(
        "qwen3-235b-a22b-fp8", 4, ((2, 1), (8, 1), (32, 1), (128, 1), (384, 1), (384, 2), (128, 8))
    ),
    _series("deepseek-v3", 8, ((1, 1), (4, 1), (16, 1), (64, 1), (256, 1), (256, 2))),
    _series("deepseek-v3", 8, ((1, 1), (4, 1), (32, 1), (32, 8)), ep=True),
    _series("qwen3.5-397b-a17b-fp8", 8, ((1, 1), (16, 1), (128, 1), (128, 4))),
    _series("qwen3-32b-fp8", 8, ((1, 1), (8, 1), (64, 1), (512, 1))),
)

_MEASURE = (
    "import io, json, resource, sys, time, contextlib\n"
    "from mxload.orchestrator.cli.commands import main\n"
    "t = time.perf_counter()\n"
    "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
    "    rc = main(sys.argv[1:])\n"
    "wall = time.perf_counter() - t\n"
    # VmHWM: the peak of this process's own memory (ru_maxrss keeps, across exec, the
    # RSS of the parent that forked it: the bench process's, larger than a plan's).
    "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
    "for line in open('/proc/self/status'):\n"
    "    if line.startswith('VmHWM:'):\n"
    "        rss = int(line.split()[1]) * 1024\n"
    "print(json.dumps({'rc': rc, 'seconds': wall, 'max_rss_bytes': rss, 'json_bytes': len(out.getvalue())}))\n"
)


def _measure(case: ScaleCase) -> dict[str, Any]:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, *case.flags()],
        capture_output=True,
        text=True,
        check=True,
    )
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if got["rc"] != 0:
        raise RuntimeError(f"mxload {' '.join(case.flags())} exited {got['rc']}")
    return got


def plan_scaling(*, quick: bool) -> tuple[list[list[object]], list[dict[str, Any]]]:
    """``mxload plan --model M LAYOUT --json`` in a fresh process per layout: its
    planning seconds (interpreter start and imports excluded; JSON text included) and
    peak RSS (imports included), each against the first layout of its series measured
    in the same run (the ratio should stay near 1 as ranks grow). The layouts of a
    series take turns within each repeat, so background load hits them alike."""
    repeats = 1 if quick else 3
    rows: list[list[object]] = []
    data: list[dict[str, Any]] = []
    for series in SCALING:
        cases = series[:3] if quick else series
        runs: list[list[dict[str, Any]]] = [[] for _ in cases]
        for r in range(repeats):
            for i, case in enumerate(cases):
                log(f"plan scaling ({r + 1}/{repeats}): {case.label()}")
                runs[i].append(_measure(case))
        base_t = Timing(tuple(x["seconds"] for x in runs[0]))
        base_m = max(x["max_rss_bytes"] for x in runs[0])
        for case, got in zip(cases, runs, strict=True):
            t = Timing(tuple(x["seconds"] for x in got))
            rss = max(x["max_rss_bytes"] for x in got)
            rows.append(
                [
                    case.label(),
                    case.ranks,
                    t.text(2),
                    f"{t.median / base_t.median:.2f}",
                    fmt_bytes(rss),
                    f"{rss / base_m:.2f}",
                    fmt_bytes(got[0]["json_bytes"]),
                ]
            )
            data.append(
                {
                    "model": case.model,
                    "tp": case.tp,
                    "dp": case.dp,
                    "pp": case.pp,
                    "ep": case.ep,
                    "ranks": case.ranks,
                    "planning": t.to_json(),
                    "planning_x_first": t.median / base_t.median,
                    "max_rss_bytes": rss,
                    "max_rss_x_first": rss / base_m,
                    "json_bytes": got[0]["json_bytes"],
                }
            )
    return rows, data


SCALING_HEADERS = [
    "layout (plan --json, config only)",
    "ranks",
    "planning",
    "x first",
    "peak RSS",
    "x first",
    "JSON",
]


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
            {"headers": SCALING_HEADERS, "rows": scale_rows},
        ],
        "notes": [
            'docs/contract.md §4 asks for a 256-rank DeepSeek-V3 plan "in seconds"; the in-process '
            "column is that number. The command column adds interpreter start and imports.",
            "Second table: the planner's cost against rank count, each layout against the "
            "first of its series (8 ranks). Ranks of one kind (stage, TP rank, and the shape "
            "of their experts' slices) are planned once (docs/time-model.md, 'How the "
            "planner scales'); what still grows with ranks is the per-rank JSON and the "
            "time model's per-rank arithmetic. The 8-rank layouts without EP do more: "
            "experts split at most 16 ways are read as whole rows their ranks share (the "
            "time model expands them once per layer and set of experts held), and the "
            "request-bound advice plans the EP layout too.",
        ],
        "key_ratios": key,
        "data": {"cases": data, "scaling": scale_data},
    }


def scaling_report(*, quick: bool, command: str) -> tuple[str, dict[str, Any]]:
    """The scaling table alone, as ``bench/results/plan-scale.md`` and ``.json``."""
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_facts(),
        "load_before": load_average(),
    }
    rows, data = plan_scaling(quick=quick)
    res["load_after"] = load_average()
    res["scaling"] = data
    lines = [
        "# Planning cost against rank count",
        "",
        f"`{command}`, {res['date']}; load average {res['load_before']} before, "
        f"{res['load_after']} after; {res['machine'].get('nproc')} cores, "
        f"commit {res['machine'].get('git_commit')}.",
        "",
        "`mxload plan --model M LAYOUT --json` in a fresh process per layout (stdout "
        "captured): planning seconds from `main()` called to the JSON written (imports "
        "excluded), median of the repeats with min-max, layouts of a series taking turns; "
        "peak RSS of the process (imports included). `x first`: against the first (8-rank) "
        "layout of the same series, in the same run. Peak RSS includes the JSON text, "
        "captured in memory.",
        "",
        "The 8-rank layouts without EP are not the cheapest of their series: experts split "
        "at most 16 ways are read from an object store as whole rows their ranks share, "
        "which the time model expands over every expert (once per layer and set of experts "
        "held), and the request-bound advice plans the EP alternative (valid at 8 ranks) "
        "as well.",
        "",
        "| " + " | ".join(SCALING_HEADERS) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]
    return "\n".join(lines), res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="only the rank-count table, written to OUT/plan-scale.{md,json}",
    )
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.scaling:
        command = ("python bench/bench_plan.py " + " ".join(argv or sys.argv[1:])).strip()
        text, res = scaling_report(quick=args.quick, command=command)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan-scale.md").write_text(text + "\n")
        (out / "plan-scale.json").write_text(json.dumps(res, indent=1, default=str))
        print(text)
        return 0

    print(render_section(bench_plan(quick=args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
