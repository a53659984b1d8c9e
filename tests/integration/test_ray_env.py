"""The environment of the Ray processes mxload starts: set for them, never left in the
driver's ``os.environ``."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

RAY_OWN = {"PYTHONBREAKPOINT"}
"""What ``ray.init`` itself sets in the driver (its debugger hook)."""


def _ours(env: os._Environ[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RAY_OWN}


def test_embedded_head_is_private_sets_its_workers_env_and_gives_the_driver_its_own_back() -> None:
    """One head for both claims (a head start is seconds): its temp dir, Ray's sockets
    included, is private from the start; its workers get their environment, the driver
    keeps its own."""
    import ray
    from mxload.cluster.local import start_embedded

    if ray.is_initialized():
        ray.shutdown()
    before = _ours(os.environ)
    temp = start_embedded(1, num_cpus=1)
    try:
        dirs = [
            Path(temp),
            *[p for p in Path(temp).rglob("*") if p.is_dir() and not p.is_symlink()],
        ]
        assert any(p.name == "sockets" for p in dirs)
        wrong = [(str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in dirs]
        wrong = [(p, m) for p, m in wrong if m != "0o700"]
        assert wrong == []

        assert _ours(os.environ) == before

        @ray.remote(num_cpus=0)
        def worker_env() -> dict[str, str | None]:
            keys = ("OMP_WAIT_POLICY", "RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE")
            got: dict[str, str | None] = {k: os.environ.get(k) for k in keys}
            got["runtime_env"] = ray.get_runtime_context().get_runtime_env_string()
            got["nice"] = str(os.nice(0))
            return got

        got = ray.get(worker_env.remote(), timeout=180)
        assert got["OMP_WAIT_POLICY"] == before.get("OMP_WAIT_POLICY", "PASSIVE")
        assert got["RAY_USAGE_STATS_ENABLED"] == before.get("RAY_USAGE_STATS_ENABLED", "0")
        assert got["RAY_AUTH_MODE"] == before.get("RAY_AUTH_MODE", "token")
        # inherited from the raylet: no job runtime_env, whose setup process would cost
        # every worker start more CPU
        assert got["runtime_env"] == "{}"
        assert got["nice"] == "0"  # Ray's own default is 15
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert _ours(os.environ) == before
