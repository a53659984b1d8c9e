"""Starting and joining Ray for mxload: the embedded default, detached heads, noise control.

The embedded default (SPEC §4 "Cluster") is a local Ray head bound to loopback that
declares one virtual accelerator resource (``NPU`` by default) per rank, so the real
placement path (placement group, one bundle per rank, Ray setting
``ASCEND_RT_VISIBLE_DEVICES``) runs on a machine without NPUs.

Why the care: on this kind of machine Ray otherwise binds the interface address, sends
usage statistics, starts a dashboard, attaches to a stale cluster left in its default
temp folder, and logs a traceback from its probe for Ascend libraries (``import acl``).
Every start here therefore passes ``address="local"`` (or an explicit address), a
private short temp dir (Ray's socket paths must stay under 107 bytes), 127.0.0.1, no
dashboard, no usage stats, and silences the accelerator probe's logger.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import SessionError

NAMESPACE = "mxload"
LOOPBACK = "127.0.0.1"

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Seen with Ray 2.60: without this, _node_ip_address alone still bound the
    # interface address on this kind of machine.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_DEDUP_LOGS": "0",
}


def prepare_environment() -> None:
    """Process-wide settings every Ray start here needs (idempotent)."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    quiet_ray_logging()


def quiet_ray_logging() -> None:
    """Ray's probe for Ascend libraries logs a traceback when ``acl`` is missing; it is
    noise for a user (SPEC §5), so its logger is silenced, and Ray's own INFO chatter too."""
    for name in ("ray._private.accelerators", "ray._private.accelerators.npu"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("ray").setLevel(logging.ERROR)


def mxload_home() -> Path:
    """Where detached sessions record their heads: $MXLOAD_HOME or ~/.mxload."""
    return Path(os.environ.get("MXLOAD_HOME") or Path.home() / ".mxload")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def short_temp_dir(prefix: str = "mxray-") -> str:
    """A private temp dir with a short path (Ray's unix sockets live under it)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def start_embedded(
    num_devices: int,
    *,
    resource: str = "NPU",
    num_cpus: int | None = None,
    temp_dir: str | None = None,
) -> str:
    """Start an in-process local Ray head with ``num_devices`` units of ``resource``.
    Returns the temp dir (remove it after ``ray.shutdown()``)."""
    import ray

    prepare_environment()
    temp_dir = temp_dir or short_temp_dir()
    ray.init(
        address="local",
        num_cpus=num_cpus if num_cpus is not None else min(os.cpu_count() or 1, 2),
        resources={resource: num_devices},
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address=LOOPBACK,
        namespace=NAMESPACE,
        logging_level=logging.ERROR,
        log_to_driver=False,
        configure_logging=True,
    )
    quiet_ray_logging()
    return temp_dir


def connect(address: str) -> None:
    """Join an existing Ray cluster (``--address``) in mxload's namespace."""
    import ray

    prepare_environment()
    ray.init(
        address=address,
        namespace=NAMESPACE,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    quiet_ray_logging()


@dataclass(frozen=True)
class HeadRecord:
    """Where a background head started by ``load --detach`` lives."""

    address: str
    temp_dir: str
    resource: str
    num_devices: int
    started_at: float


def _record_path(home: Path) -> Path:
    return home / "head.json"


def start_detached_head(
    num_devices: int, *, resource: str = "NPU", num_cpus: int | None = None
) -> HeadRecord:
    """Start a local Ray head as its own background process (``ray start --head``), bound
    to loopback, and record where it is under $MXLOAD_HOME so other processes find it."""
    prepare_environment()
    home = mxload_home()
    home.mkdir(parents=True, exist_ok=True)
    existing = read_head_record()
    if existing is not None and head_alive(existing):
        return existing
    temp_dir = short_temp_dir("mxhead-")
    port = free_port()
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        raise SessionError("cannot find the `ray` command next to this Python to start a head")
    cmd = [
        ray_bin,
        "start",
        "--head",
        f"--node-ip-address={LOOPBACK}",
        f"--port={port}",
        f"--num-cpus={num_cpus if num_cpus is not None else min(os.cpu_count() or 1, 2)}",
        f"--resources={json.dumps({resource: num_devices})}",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    env = dict(os.environ, **RAY_ENV)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise SessionError(
            "could not start a background Ray head: " + (proc.stderr or proc.stdout)[-2000:]
        )
    record = HeadRecord(
        address=f"{LOOPBACK}:{port}",
        temp_dir=temp_dir,
        resource=resource,
        num_devices=num_devices,
        started_at=time.time(),
    )
    _record_path(home).write_text(json.dumps(asdict(record), indent=2))
    return record


def read_head_record() -> HeadRecord | None:
    path = _record_path(mxload_home())
    if not path.exists():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return HeadRecord(**data)
    except (ValueError, TypeError):
        return None


def head_alive(record: HeadRecord) -> bool:
    host, _, port = record.address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def stop_detached_head(record: HeadRecord | None = None) -> bool:
    """Stop the background head this machine's $MXLOAD_HOME records (only its processes:
    those whose command line names its temp dir). Returns whether one was stopped."""
    record = record or read_head_record()
    if record is None:
        return False
    import psutil

    victims = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if record.temp_dir in cmdline and proc.pid != os.getpid():
            victims.append(proc)
    for proc in victims:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=10)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _record_path(mxload_home()).unlink(missing_ok=True)
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    return bool(victims)
