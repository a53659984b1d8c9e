"""Shared fixtures: seeded tiny checkpoints built on demand (never downloaded).

While an xdist run's workers start and collect, the controller compiles the numba
kernels once in a process of its own, and no test starts before that is done: numba's
on-disk cache is written before anything else needs it. Without that, on a fresh clone every process that converts first (both pytest
workers, each Ray rank worker of the first loads, each ``mxload`` subprocess) compiles
the same kernels at the same time: tens of CPU-seconds each on a 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

_COMPILE_KERNELS = "from mxload.workers.numerics import kernels; kernels.available()"
_compiling: list[subprocess.Popen[bytes]] = []


def pytest_configure(config: pytest.Config) -> None:
    """On the xdist controller only (workers carry ``workerinput``): start filling
    numba's cache while the workers start and collect.

    In its own process because importing numba here would start its threading layer in
    the controller; a failure is left to the tests that use the kernels to report."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _compiling.append(subprocess.Popen([sys.executable, "-c", _COMPILE_KERNELS]))
    if hasattr(config.option, "loadscopereorder"):
        # keep the file order of pytest_collection_modifyitems (xdist's default sorts
        # files by their number of tests)
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """xdist hands out the first tests only after every worker collected (after this
    hook): the kernels are compiled before any test runs."""
    while _compiling:
        _compiling.pop().wait(timeout=600)


SLOW_TIMEOUT_S = 300
"""Per-test limit of a test marked ``slow`` (Ray clusters, ``mxload`` subprocesses) that
names no limit of its own; every other test has pyproject's default."""


def _heavy(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in ("slow", "ray"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests get :data:`SLOW_TIMEOUT_S`; files with the most slow or Ray tests run first.

    xdist's loadfile hands whole files to its workers in collection order (its own
    reordering by test count, which put the few-test Ray files last, is turned off in
    pytest_configure): the long files first, the many short ones after them fill in, so
    that the workers finish at about the same time."""
    heavy: dict[object, int] = {}
    for item in items:
        if _heavy(item):
            heavy[item.path] = heavy.get(item.path, 0) + 1
    # stable: files stay whole; the most Ray/slow tests first
    items.sort(key=lambda item: -heavy.get(item.path, 0))
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that does not ask for the shared local Ray never finds it running: it may
    start, join or refuse a Ray of its own (tests/integration/conftest.py)."""
    from tests import shared_ray

    if shared_ray.running() and "local_ray" not in getattr(item, "fixturenames", ()):
        shared_ray.end()


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(preset, seed, **kw) -> path of a synthetic checkpoint (cached per arguments)."""
    from mxload.orchestrator.tools.synth import make_checkpoint

    cache: dict[tuple, str] = {}

    def make(preset: str = "qwen3-moe-tiny", seed: int = 1, **kw) -> str:
        key = (preset, seed, repr(sorted(kw.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{preset}-{seed}")
            make_checkpoint(str(path), preset, seed=seed, **kw)
            cache[key] = str(path)
        return cache[key]

    return make


# Loopback HTTP (Range, fault injection) and moto S3 servers, as fixtures.
from tests.servers import http_server, s3_server  # noqa: E402, F401
