"""The pure core imports no torch, no Ray, no numpy, no fsspec (STYLE.md practice 1).

Each module is imported in a FRESH interpreter (this test process has torch loaded
already), and the interpreter then reports which heavy packages ended up in
``sys.modules``. A planning run from a config is made too, so lazy imports inside the
planner (the memory model) are covered as well.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mxload.orchestrator.runtime.models import model_config_path

PURE_MODULES = (
    "mxload.orchestrator.errors",
    "mxload.orchestrator.plan.formats",
    "mxload.orchestrator.plan.sizes",
    "mxload.orchestrator.plan.config",
    "mxload.orchestrator.plan.ranges",
    "mxload.orchestrator.plan.types",
    "mxload.orchestrator.plan.arch",
    "mxload.orchestrator.plan.engines",
    "mxload.orchestrator.plan.layout",
    "mxload.orchestrator.plan.planner",
    "mxload.orchestrator.plan.readplan",
    "mxload.orchestrator.plan.memory",
    "mxload.orchestrator.plan.safetensors_header",
    "mxload.orchestrator.plan.checkpoint",
    "mxload.orchestrator.plan.sharing",
    "mxload.orchestrator.plan.timemodel",
    "mxload.orchestrator.plan.trainer",
    "mxload.orchestrator.plan.refit",
)
HEAVY = ("torch", "ray", "numpy", "fsspec")
ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
mods = {mods!r}
for m in mods:
    __import__(m)
if {plan!r}:
    from mxload.orchestrator.plan.config import parse_config
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.plan.planner import build_plan, plan_to_json
    cfg = parse_config(json.load(open({config!r})), "config.json")
    plan_to_json(build_plan(cfg, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)))
heavy = sorted(h for h in {heavy!r} if h in sys.modules or any(k.startswith(h + ".") for k in sys.modules))
print(json.dumps(heavy))
"""


def probe(modules: tuple[str, ...], plan: bool = False) -> list[str]:
    code = PROBE.format(
        mods=list(modules),
        plan=plan,
        config=str(model_config_path("qwen3-30b-a3b-fp8")),
        heavy=list(HEAVY),
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_nothing_heavy(module: str) -> None:
    assert probe((module,)) == []


def test_planning_from_a_config_stays_pure() -> None:
    assert probe(PURE_MODULES, plan=True) == []


def test_the_probe_can_see_a_heavy_import() -> None:
    # The check is only worth something if it notices a heavy import when there is one.
    assert probe(("mxload.orchestrator.plan.config", "numpy")) == ["numpy"]
