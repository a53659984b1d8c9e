"""mxload works from a folder that holds its own ``workers/``, ``cluster/`` and
``orchestrator/`` packages (a user's project often does): everything mxload imports lives
under ``mxload.``, so the user's packages, each of which raises on import here, are never
reached. Run as a user runs it: the installed ``mxload`` command, ``python -m``, and a
``python -c`` script using the Python API, each with that folder as working directory
(``python -m`` and ``-c`` put it first on ``sys.path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.plan.planner import build_plan, plan_to_json
from mxload.workers.tools.synth import make_checkpoint
import mxload.cluster.local

make_checkpoint("ckpt", "qwen3-moe-tiny", seed=3)
meta = open_checkpoint("ckpt")
plan = plan_to_json(build_plan(meta.config, ParallelLayout(tp=2, enable_expert_parallel=True), checkpoint=meta))
print(json.dumps({"world": plan["parallel"]["world"], "arch": plan["model"]["architecture"]}))
"""


@pytest.fixture
def crowded(tmp_path: Path) -> Path:
    """A folder with decoy packages named like mxload's folders."""
    for name in ("workers", "cluster", "orchestrator"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name} package was imported')\n"
        )
    return tmp_path


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_decoys_do_shadow_a_bare_import(crowded: Path) -> None:
    """The folder is a real trap: a bare ``import workers`` from it fails."""
    done = run([sys.executable, "-c", "import workers"], crowded)
    assert done.returncode != 0 and "own workers package" in done.stderr


@pytest.mark.parametrize("how", ["console-script", "python-m"])
def test_cli_from_a_folder_with_its_own_packages(crowded: Path, how: str) -> None:
    exe = Path(sys.executable).parent / "mxload"
    cmd = (
        [str(exe)] if how == "console-script" else [sys.executable, "-m", "mxload.orchestrator.cli"]
    )
    done = run([*cmd, "plan", "--model", "qwen3-30b-a3b-fp8", "--tp", "4", "--enable-expert-parallel", "--json"], crowded)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["parallel"]["world"] == 4
    made = run([*cmd, "make-checkpoint", "ck", "--preset", "qwen3-dense-tiny", "--json"], crowded)
    assert made.returncode == 0, made.stderr[-2000:]
    looked = run([*cmd, "inspect", "ck", "--json"], crowded)
    assert looked.returncode == 0, looked.stderr[-2000:]
    assert json.loads(looked.stdout)["architecture"] == "Qwen3ForCausalLM"


def test_python_api_from_a_folder_with_its_own_packages(crowded: Path) -> None:
    done = run([sys.executable, "-c", SCRIPT], crowded)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "world": 2,
        "arch": "Qwen3MoeForCausalLM",
    }
