"""The pytest worker's shared embedded Ray head (see tests/integration/conftest.py)."""

from __future__ import annotations

import shutil
from typing import Any

_head: dict[str, str] = {}
"""``temp``: the running shared head's temp dir; ``gcs``: its GCS address."""


def get() -> Any:
    """The shared head, started if it is not running in this process."""
    import ray
    from mxload.cluster.local import start_embedded

    if _head and ray.is_initialized() and ray.get_runtime_context().gcs_address == _head["gcs"]:
        return ray
    end()
    if ray.is_initialized():
        ray.shutdown()
    temp = start_embedded(8, resource="NPU", num_cpus=2)
    _head.update(temp=temp, gcs=ray.get_runtime_context().gcs_address)
    return ray


def running() -> bool:
    return bool(_head)


def end() -> None:
    """Shut the shared head down (if this process runs it) and remove its temp dir."""
    if not _head:
        return
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _head["gcs"]:
        from mxload.cluster.raycompat import kill_own_autoscaler_monitor

        kill_own_autoscaler_monitor()
        ray.shutdown()
    shutil.rmtree(_head["temp"], ignore_errors=True)
    _head.clear()
