"""One local Ray per test module (Ray start-up is slow on 2 cores), bound to loopback."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray head with 8 virtual NPUs and 2 CPUs, shared by the module's tests."""
    import ray
    from mxload.cluster.local import start_embedded

    if ray.is_initialized():
        ray.shutdown()
    temp = start_embedded(8, resource="NPU", num_cpus=2)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
