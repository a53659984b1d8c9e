"""Shared fixtures: seeded tiny checkpoints built on demand (never downloaded)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(preset, seed, **kw) -> path of a synthetic checkpoint (cached per arguments)."""
    from mxload.workers.tools.synth import make_checkpoint

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
