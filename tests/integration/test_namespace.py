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
from mxload import ParallelLayout, build_plan, open_checkpoint
from mxload.orchestrator.tools.synth import make_checkpoint
import mxload.cluster.local

make_checkpoint("ckpt", "qwen3-moe-tiny", seed=3)
meta = open_checkpoint("ckpt")
plan = build_plan(meta.config, ParallelLayout(tp=2, enable_expert_parallel=True), checkpoint=meta)
print(json.dumps({"world": plan.layout.world, "arch": plan.model["architecture"]}))
"""

PUBLIC = [
    "EngineReloader", "LoadRequest", "MxloadError", "MxloadWorkerExtension", "ParallelLayout", "Plan",
    "RankLoader", "Session", "__version__", "build_plan", "convert_checkpoint", "load",
    "open_checkpoint", "reload_inputs",
]  # fmt: skip
"""The names README.md and docs/adoption.md import from ``mxload``."""

PUBLIC_SCRIPT = """
import importlib, json, sys
import mxload
light = not ({"torch", "ray"} & set(sys.modules))
from mxload import (
    EngineReloader, LoadRequest, MxloadError, MxloadWorkerExtension, ParallelLayout, Plan,
    RankLoader,
    Session, __version__, build_plan, convert_checkpoint, load, open_checkpoint,
    reload_inputs,
)
names = {n: getattr(mxload, n) for n in mxload.__all__ if n != "__version__"}

def resolve(qualname):  # how vLLM resolves worker_extension_cls
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)

print(json.dumps({
    "all": sorted(mxload.__all__),
    "dir": sorted(dir(mxload)),
    "light": light,
    "homes": sorted({v.__module__.split(".")[0] for v in names.values()}),
    "callable": all(callable(v) for v in names.values()),
    "error": issubclass(MxloadError, Exception),
    "version": __version__,
    "extension": resolve("mxload.MxloadWorkerExtension")
    is resolve("mxload.orchestrator.hosts.engine_ext.MxloadWorkerExtension"),
}))
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


def test_public_names_import_from_mxload(crowded: Path) -> None:
    """``from mxload import ...`` gives every documented name (without importing torch or
    Ray until one is used); ``mxload.MxloadWorkerExtension`` resolves, as vLLM resolves
    ``worker_extension_cls``, to the class docs/contract.md names by its module path."""
    done = run([sys.executable, "-c", PUBLIC_SCRIPT], crowded)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["all"] == sorted(PUBLIC) and got["dir"] == sorted(PUBLIC)
    assert got["light"] is True, "import mxload imported torch or Ray"
    assert got["homes"] == ["mxload"] and got["callable"] is True and got["error"] is True
    assert got["extension"] is True
    assert got["version"] == _pyproject_version()


def _pyproject_version() -> str:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    with open(root / "pyproject.toml", "rb") as f:
        version: str = tomllib.load(f)["project"]["version"]
    return version
