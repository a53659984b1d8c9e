"""Importing mxload changes nothing global: every production module is imported in a fresh
interpreter, and ``os.environ`` and torch's thread count must be as they were before.

Third-party packages mxload builds on (torch, numpy, numba, ray) are imported before the
snapshot, so what they do on import is not counted against mxload.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "orchestrator": "mxload.orchestrator",
    "workers": "mxload.workers",
    "cluster": "mxload.cluster",
}

SCRIPT = r"""
import importlib, json, os, sys
import numpy, torch, numba, ray  # noqa: F401  (their own import effects are not ours)

env = dict(os.environ)
threads = torch.get_num_threads()
interop = torch.get_num_interop_threads()
imported, failed = [], {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        imported.append(name)
    except ImportError as exc:  # an optional dependency (vLLM, torch_npu) missing here
        failed[name] = f"{type(exc).__name__}: {exc}"
now = dict(os.environ)
print(json.dumps({
    "imported": imported,
    "failed": failed,
    "added": sorted(set(now) - set(env)),
    "removed": sorted(set(env) - set(now)),
    "changed": sorted(k for k in env if k in now and env[k] != now[k]),
    "threads": [threads, torch.get_num_threads()],
    "interop": [interop, torch.get_num_interop_threads()],
}))
"""


def production_modules() -> list[str]:
    """Every module under orchestrator/, workers/ and cluster/, as installed (mxload.*),
    plus the public package itself."""
    names = ["mxload"]
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if rel.parts[0] == "api" or rel.name == "__main__":
                continue  # orchestrator/api is `mxload` itself; __main__ runs the CLI
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join([package, *parts]))
    return names


def test_importing_every_module_leaves_environment_and_threads_alone() -> None:
    modules = production_modules()
    assert "mxload.workers.numerics.kernels" in modules and "mxload.cluster.local" in modules
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(modules)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Only modules whose optional third-party dependency is absent may fail to import.
    for name, why in got["failed"].items():
        assert "mxload" not in why.split(":", 1)[1], f"{name}: {why}"
    assert len(got["imported"]) >= len(modules) - len(got["failed"]) > 40
    assert (got["added"], got["removed"], got["changed"]) == ([], [], []), got
    assert got["threads"][0] == got["threads"][1]
    assert got["interop"][0] == got["interop"][1]
