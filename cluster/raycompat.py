"""Every use mxload makes of Ray's private internals (``ray._private``, ``ray._raylet``,
``ray._common``), in one module.

Private modules change between Ray releases without notice; pyproject bounds ``ray`` to
the releases this was tested with (2.60). Before raising that bound, check each function
here against the new release. Each function imports what it touches when called, so
importing this module imports no Ray.
"""

from __future__ import annotations

from typing import Any

ACCELERATOR_PROBE_LOGGERS = ("ray._private.accelerators", "ray._private.accelerators.npu")
"""Loggers of Ray's probe for Ascend libraries, which logs a traceback when ``acl`` is
missing."""


def keep_loopback_addresses() -> None:
    """Stop Ray from rewriting 127.0.0.1 to the interface address.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray_constants`` is first
    imported; with it on (the Linux default) ``ray.init(address=...)`` and a local start
    replace 127.0.0.1 with the interface address, where a loopback-bound head does not
    listen. The constant is set off in place, whenever Ray was imported."""
    import ray._private.ray_constants as constants

    constants.ENABLE_RAY_CLUSTER = False


def allow_loopback_worker_node() -> None:
    """In a process about to run ``ray start --address`` for a worker node on loopback:
    pass Ray's multi-node check (which refuses when the constant above is off) and keep
    127.0.0.1 as given (Ray would resolve it to the interface address)."""
    import ray._private.ray_constants as constants
    import ray._private.services as services
    from ray._common.network_utils import is_localhost  # type: ignore[attr-defined]

    constants.ENABLE_RAY_CLUSTER = True
    resolve = services.resolve_ip_for_localhost

    def keep_localhost(host: str) -> str:
        return host if is_localhost(host) else str(resolve(host))

    services.resolve_ip_for_localhost = keep_localhost


def reset_auth_cache() -> None:
    """Make Ray re-read its auth mode and token from the environment: it caches them per
    process, so a second head's start or join would otherwise send the first head's
    token (Ray's own test utilities do the same). A no-op on a Ray without token auth."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass


def worker_temp_dir() -> str | None:
    """The temp dir of the Ray node this process runs in; None outside a Ray process."""
    try:
        import ray

        node = ray._private.worker.global_worker.node
        return str(node.get_temp_dir_path()) if node is not None else None
    except Exception:
        return None


def kill_own_autoscaler_monitor() -> None:
    """In a process that started its Ray head (``ray.init`` of a new local cluster), just
    before ``ray.shutdown()``: SIGKILL the head's autoscaler monitor and reap it.

    Why: ``ray.shutdown()`` ends the raylet and the GCS first, then sends every other
    daemon SIGTERM with a second's grace each, one after another. The monitor, asleep in
    its update loop and then retrying the GCS that is gone, never exits in that second:
    every shutdown waited it out (1.0 s of 1.36 s). It scales nothing on a fixed local
    cluster, and the cluster is ending. A no-op in a process that only joined a cluster."""
    try:
        import ray._private.worker as worker
        from ray._private import ray_constants

        node = worker._global_node
        if node is not None and node.head:
            node._kill_process_type(
                ray_constants.PROCESS_TYPE_MONITOR, check_alive=False, wait=True
            )
    except Exception:  # left to ray.shutdown(), as before
        pass


def ray_client_installed() -> bool:
    """Whether Ray's client extras are installed (only then does a head run a client
    server, and take ``--ray-client-server-port``)."""
    try:
        from ray._private.utils import get_ray_client_dependency_error
    except ImportError:
        return False
    return get_ray_client_dependency_error() is None


KV_NAMESPACE = b"mxload"


def kv_put(key: str, value: bytes) -> None:
    """Store ``value`` under ``key`` in the GCS's key-value store (Ray's internal KV):
    it outlives any actor, and ends with the cluster."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key.encode(), value, overwrite=True, namespace=KV_NAMESPACE)


def kv_get(key: str) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    value = _internal_kv_get(key.encode(), namespace=KV_NAMESPACE)
    return bytes(value) if value is not None else None


def kv_del(key: str, *, by_prefix: bool = False) -> None:
    """Remove ``key`` (``by_prefix``: every key that starts with it)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key.encode(), del_by_prefix=by_prefix, namespace=KV_NAMESPACE)


def route_driver_messages(write: Any) -> None:
    """Send what Ray's driver prints about the cluster (``listen_error_messages``: "A
    worker died or was killed ...", on stdout through ``print_to_stdstream``) to
    ``write(text)`` instead. The thread looks the printer up in its module at each
    message, so replacing it there takes effect at once."""
    import ray._private.worker as worker

    def to_log(data: Any, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", ()):
            write(f"({data.get('pid', 'ray')}) {line}")

    worker.print_to_stdstream = to_log
