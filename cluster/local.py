"""Starting and joining Ray for mxload: the embedded head, detached heads, noise control.

The embedded default (docs/contract.md §4 "Cluster") is a local Ray head bound to
loopback that declares one virtual accelerator resource (``NPU`` by default) per rank, so
the real placement path (placement group, one bundle per rank, Ray setting
``ASCEND_RT_VISIBLE_DEVICES``) runs on a machine without NPUs.

Left to itself, Ray on such a machine binds the interface address, sends usage
statistics, starts a dashboard, attaches to a stale cluster in its default temp folder,
and logs a traceback from its probe for Ascend libraries. Every start here therefore
passes ``address="local"`` (or an explicit address), a private short temp dir (Ray's
socket paths must stay under 107 bytes), 127.0.0.1 and no dashboard. The environment
the Ray processes need (:data:`RAY_ENV`, the auth token) is set only while ``ray.init``
spawns them and given back afterwards; what the workers need (:data:`WORKER_ENV`) is in
the environment of every Ray daemon mxload starts, whose workers inherit it, and in the
job's ``runtime_env`` only when joining a cluster mxload did not start. Importing this
module changes nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..orchestrator.errors import SessionError
from . import raycompat

log = logging.getLogger(__name__)

NAMESPACE = "mxload"
LOOPBACK = "127.0.0.1"

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Idle workers started ahead of need would make Ray's folders 0777 again and never
    # run mxload's code to set them back (see tighten_own_temp_dir).
    "RAY_prestart_worker_first_driver": "0",
    # Without it, _node_ip_address alone still binds the interface address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_DEDUP_LOGS": "0",
    # Ray starts its workers at nice 15, behind everything else on the node; a rank
    # worker is the load, and on a busy node (an engine, a trainer beside it) nice 15
    # leaves it a few percent of a core.
    "RAY_worker_niceness": "0",
}
"""Environment of the Ray daemons mxload starts (a value the user set wins)."""

WORKER_ENV = {
    # OpenMP threads that spin after each parallel region (the default) burn a core
    # between the many short kernel launches of a load, taking it from the reader threads
    # and from other workers on the node; sleeping ones cost a futex wake per launch.
    # libgomp reads it once, when loaded (by torch, at import), so it must be there
    # when the worker process starts.
    "OMP_WAIT_POLICY": "PASSIVE",
}
"""Environment of mxload's Ray workers (a value set in the driver's environment wins).
Put in the environment of the raylets mxload starts, which pass it to their workers: a
job ``runtime_env`` would start every worker through Ray's runtime-env setup process
first, about 0.4 CPU-s more per worker. Only a cluster mxload did not start gets it as
the job's ``runtime_env``."""


def prepare_environment() -> None:
    """For code that starts Ray by other means (Ray's ``cluster_utils`` in tests and
    benchmarks): put :data:`RAY_ENV` into ``os.environ`` for good, keep loopback
    addresses and quiet Ray's logging. mxload's own starts never call it."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        raycompat.keep_loopback_addresses()
    quiet_ray_logging()


def quiet_ray_logging() -> None:
    """Silence the traceback of Ray's Ascend probe (noise for a user, docs/contract.md
    §5) and Ray's own INFO chatter; once :func:`route_ray_output` was called, send what
    Ray still says (its loggers, the raylet's messages about workers) to the log file.
    Called again after each ``ray.init``, which sets Ray's own handlers back."""
    for name in raycompat.ACCELERATOR_PROBE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    ray_logger = logging.getLogger("ray")
    ray_logger.setLevel(logging.ERROR)
    if _RAY_LOG is not None:
        for handler in list(ray_logger.handlers):
            ray_logger.removeHandler(handler)
        ray_logger.addHandler(_RAY_LOG)
        ray_logger.propagate = False
        if "ray._private.worker" in sys.modules:  # imported by now if Ray runs here
            raycompat.route_driver_messages(_RAY_LOG.write)


class RayLog(logging.Handler):
    """Ray's own messages in ``$MXLOAD_HOME/logs/ray-<time>-<pid>.log`` (0600, in the
    0700 folder error logs use), opened at the first one, so a run Ray says nothing
    about leaves no file. Never writes to the terminal, even when the file cannot be
    written (docs/contract.md §5: Ray's tracebacks and warnings go to the log)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.path: str | None = None
        self._file: Any = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record))
        except Exception:  # a record that cannot be formatted is dropped, not printed
            pass

    def write(self, text: str) -> None:
        try:
            if self._file is None:
                folder = mxload_home() / "logs"
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                name = f"ray-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                self._file = os.fdopen(os.open(folder / name, flags, 0o600), "w")
                self.path = str(folder / name)
            self._file.write(text.rstrip("\n") + "\n")
            self._file.flush()
        except OSError:  # a read-only or full $MXLOAD_HOME: dropped, never printed
            pass


_RAY_LOG: RayLog | None = None
"""Where Ray's own messages go once the command asked (:func:`route_ray_output`)."""


def ray_log_path() -> str | None:
    """The file Ray's messages went to in this process, if it said anything."""
    return _RAY_LOG.path if _RAY_LOG is not None else None


def route_ray_output() -> RayLog:
    """From now on, Ray's messages in this process go to a log file, not the terminal
    (the command calls it unless ``--debug``); the handler, whose ``path`` names the file
    once something was written."""
    global _RAY_LOG
    if _RAY_LOG is None:
        _RAY_LOG = RayLog()
    quiet_ray_logging()
    return _RAY_LOG


@contextmanager
def _start_environment(auth: Mapping[str, str], drop: Iterable[str] = ()) -> Iterator[None]:
    """``os.environ`` as the Ray processes a start spawns need it (they inherit it):
    :data:`RAY_ENV` and :data:`WORKER_ENV` where unset, ``auth`` set and ``drop``
    removed; given back as it was on exit. Ray's token cache is re-read inside, so the
    start uses this token."""
    want = {k: v for k, v in {**RAY_ENV, **WORKER_ENV}.items() if k not in os.environ}
    want.update(auth)
    saved = {k: os.environ.get(k) for k in {*want, *drop}}
    try:
        for key in drop:
            os.environ.pop(key, None)
        os.environ.update(want)
        if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
            raycompat.keep_loopback_addresses()
        if auth:
            raycompat.reset_auth_cache()
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def daemon_env(**extra: str) -> dict[str, str]:
    """The environment of a Ray daemon mxload starts as a process of its own (``ray
    start``): this process's, :data:`RAY_ENV` and :data:`WORKER_ENV` where unset,
    ``extra`` over it."""
    return {**RAY_ENV, **WORKER_ENV, **os.environ, **extra}


def _worker_runtime_env() -> dict[str, Any]:
    return {"env_vars": {k: v for k, v in WORKER_ENV.items() if k not in os.environ}}


def mxload_home() -> Path:
    """Where detached sessions record their heads: $MXLOAD_HOME or ~/.mxload."""
    return Path(os.environ.get("MXLOAD_HOME") or Path.home() / ".mxload")


def check_home_writable() -> Path:
    """$MXLOAD_HOME, made (0700) if missing, when this user can write there and its
    ``head.json`` (if any) is a file; else SessionError (exit 2) naming it. Checked
    before a head is started: one recorded nowhere could not be found again."""
    home = mxload_home()
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=home, prefix=".mxload-probe-")
        os.close(fd)
        os.remove(probe)
        record = _record_path(home)
        if os.path.lexists(record) and not record.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a regular file", str(record))
    except OSError as err:
        raise SessionError(
            f"$MXLOAD_HOME {home}: cannot record a Ray head there "
            f"({err.strerror or type(err).__name__}: {err.filename or home}); nothing was "
            "started. Set MXLOAD_HOME to a folder you can write",
            key="MXLOAD_HOME",
        ) from None
    return home


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def short_temp_dir(prefix: str = "mxray-") -> str:
    """A private (0700) temp dir with a short path (Ray's unix sockets live under it)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def ray_temp_dir(root: str) -> str:
    """The folder Ray is given inside a private ``root``.

    Ray makes the temp dir it is given, and its ``session_*``, ``sockets`` and ``logs``,
    mode 0777, so any local user could replace the raylet's sockets.
    Ray is therefore given a folder *inside* a 0700 one: nobody else can reach anything
    under it from the moment it exists (no window), and :func:`make_private` then sets
    Ray's own folders back to 0700 too."""
    return os.path.join(root, "r")


def tighten_own_temp_dir() -> None:
    """In a Ray process of a head mxload started: set its folders back to 0700.

    Every Ray worker process, as it starts, makes the temp dir, ``session_*``, ``sockets``
    and ``logs`` 0777 again (Ray's ``try_to_create_directory``); mxload's actors call this
    first thing, so the modes return to 0700 as soon as the process that changed them is
    up. The 0700 folder around Ray's (``ray_temp_dir``) keeps everything unreachable to
    other users meanwhile. Only a temp dir of mxload's own shape is touched, never the
    folders of a cluster someone else started."""
    temp = raycompat.worker_temp_dir()
    if temp is None:
        return
    root = os.path.dirname(temp)
    if os.path.basename(temp) == "r" and os.path.basename(root).startswith(OWN_PREFIXES):
        make_private(root)


OWN_PREFIXES = ("mxhead-", "mxray-")
"""Prefixes of the temp dirs mxload makes for the heads it starts."""


def make_private(root: str) -> None:
    """chmod 0700 every folder under ``root`` (Ray's, after it started; see ray_temp_dir)."""
    os.chmod(root, 0o700)
    for here, dirs, _ in os.walk(root):
        for d in dirs:
            path = os.path.join(here, d)
            try:
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
            except OSError:  # a folder Ray removed meanwhile
                pass


def start_embedded(
    num_devices: int,
    *,
    resource: str = "NPU",
    num_cpus: int | None = None,
    temp_dir: str | None = None,
) -> str:
    """Start an in-process local Ray head with ``num_devices`` units of ``resource``.
    Returns the temp dir, private to this user (remove it after ``ray.shutdown()``)."""
    import ray

    temp_dir = temp_dir or short_temp_dir()
    os.chmod(temp_dir, 0o700)
    # A private token for this head (otherwise Ray writes one to ~/.ray/auth_token),
    # unless the environment brings one.
    auth: dict[str, str] = {}
    if not os.environ.get("RAY_AUTH_TOKEN"):
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # The token cache is re-read even with the environment's token: an earlier start in
    # this process would otherwise send another head's token, which the GCS refuses.
    with _start_environment(auth, drop=("RAY_AUTH_TOKEN_PATH",) if auth else ()):
        raycompat.reset_auth_cache()
        ray.init(
            address="local",
            num_cpus=num_cpus if num_cpus is not None else min(os.cpu_count() or 1, 2),
            resources={resource: num_devices},
            include_dashboard=False,
            _temp_dir=ray_temp_dir(temp_dir),
            _node_ip_address=LOOPBACK,
            namespace=NAMESPACE,
            logging_level=logging.ERROR,
            log_to_driver=False,
            configure_logging=True,
        )
    quiet_ray_logging()
    make_private(temp_dir)
    return temp_dir


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What a gRPC client sends first; a gRPC server (Ray's GCS) answers with a SETTINGS frame."""


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse an ``--address`` with no Ray head behind it, in seconds and naming it.

    Why: ``ray.init`` on a dead address retries for a minute or more and prints "Failed to
    connect to GCS" lines all the while. Two probes first: a TCP connect (refused, no
    route, time-out), then the HTTP/2 handshake every gRPC server (Ray's GCS is one)
    answers with a SETTINGS frame, which tells a Ray head from another service on the
    port. Limits: an address that is not HOST:PORT (``auto``, ``ray://``) is left to Ray;
    a gRPC server that is not Ray passes, and Ray's own error follows."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or "://" in address:
        return
    host = host.strip("[]")
    start = time.monotonic()
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout_s) as conn:
            conn.settimeout(max(0.5, timeout_s - (time.monotonic() - start)))
            conn.sendall(HTTP2_PREFACE)
            frame = conn.recv(9)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        if isinstance(err, TimeoutError | socket.timeout):
            reason = f"no answer in {timeout_s:.0f} s"
        raise SessionError(
            f"--address {address}: no Ray head reachable there ({reason}); check the address "
            "(`ray status` on the head prints it) and that this machine can reach that port",
            key="--address",
        ) from None
    # A SETTINGS frame: 3 bytes length, type 0x04.
    if len(frame) < 4 or frame[3] != 0x04:
        raise SessionError(
            f"--address {address}: something answers there, but not a Ray head (no gRPC "
            "handshake); check the port (Ray's default is 6379)",
            key="--address",
        )


def connect(address: str, *, token: str | None = None) -> None:
    """Join an existing Ray cluster (``--address``) in mxload's namespace.

    ``token``: the head's authentication token (Ray enables token auth on new clusters);
    a head started by ``start_detached_head`` records its own. For a cluster of your own,
    Ray's usual ``RAY_AUTH_TOKEN``/``~/.ray/auth_token`` apply."""
    import ray

    auth: dict[str, str] = {}
    drop: tuple[str, ...] = ()
    if token:
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        drop = ("RAY_AUTH_TOKEN_PATH",)
    elif "RAY_AUTH_MODE" not in os.environ and _token_available():
        # With an explicit address Ray does not turn token mode on by itself (it does
        # for address="auto"); a token on this machine means the cluster wants it.
        auth = {"RAY_AUTH_MODE": "token"}
    check_reachable(address)
    # A recorded head (its token given) is mxload's own: its raylets have WORKER_ENV
    # already. Taken before _start_environment puts WORKER_ENV into os.environ.
    runtime_env = None if token else _worker_runtime_env()
    try:
        with _start_environment(auth, drop):
            ray.init(
                address=address,
                namespace=NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,
                runtime_env=runtime_env,
            )
    except ConnectionError as err:
        raise SessionError(
            f"cannot join the Ray cluster at {address}: {err}. Check --address, and that "
            "this machine has the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token) with RAY_AUTH_MODE=token",
            key="--address",
        ) from None
    quiet_ray_logging()


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return os.path.exists(path)
    return (Path.home() / ".ray" / "auth_token").exists()


_refresh_ray_auth = raycompat.reset_auth_cache
"""Kept for tests that start Ray themselves (``cluster_utils``) after changing the token."""


@dataclass(frozen=True)
class HeadRecord:
    """Where a background head started by ``load --detach`` lives."""

    address: str
    temp_dir: str
    resource: str
    num_devices: int
    started_at: float
    token: str = ""
    """The head's Ray auth token (the record file is private to its owner)."""
    processes: tuple[dict[str, Any], ...] = ()
    """The head's own processes as started: ``{"pid", "created", "start_ticks", "role"}``
    each (:func:`process_identity`; role:
    ``gcs_server``, ``raylet``, or the script a helper runs), so a crashed or half-dead
    head is recognised without asking Ray, and ended without guessing by name."""


def process_role(proc: Any) -> str:
    """What a Ray daemon is: its executable's name, or the Python script it runs."""
    try:
        cmd: list[str] = [str(a) for a in proc.cmdline() or [proc.name()]]
    except Exception:
        return "?"
    name = os.path.basename(cmd[0])
    if name in ("gcs_server", "raylet"):
        return name
    scripts = [os.path.basename(a) for a in cmd[1:] if a.endswith(".py")]
    if scripts:
        return scripts[0].removesuffix(".py")
    if "-m" in cmd[:-1]:
        return cmd[cmd.index("-m") + 1]
    return name


def start_ticks(pid: int) -> int | None:
    """Linux: when process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``
    field 22), which no change of the wall clock moves; None elsewhere or when it is gone.

    psutil's ``create_time`` is that plus ``/proc/stat``'s ``btime``, a whole second the
    kernel recomputes from the wall clock: when the clock is adjusted it can step by one,
    and a start time compared to 0.01 s then says a live process died."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
        # the command name may hold spaces and parentheses: fields follow the last ')'
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


CREATED_SLACK_S = 1.5
"""Where start ticks cannot be compared, start times within this are the same process:
btime's one-second steps pass; a pid reused within 1.5 s would need the whole pid space
cycled through in that time."""


def process_identity(proc: Any) -> dict[str, Any]:
    """What tells this very process from a later one with its pid: ``{"pid", "created",
    "start_ticks"}`` (``start_ticks`` None where there is no /proc)."""
    return {"pid": proc.pid, "created": proc.create_time(), "start_ticks": start_ticks(proc.pid)}


def same_process(proc: Any, entry: Mapping[str, Any]) -> bool:
    """Whether running ``proc`` is the process ``entry`` (:func:`process_identity`)
    recorded: same start ticks where both have them, else start times within
    :data:`CREATED_SLACK_S`."""
    recorded = entry.get("start_ticks")
    if recorded is not None:
        now = start_ticks(proc.pid)
        if now is not None:
            return bool(now == int(recorded))
    return abs(float(proc.create_time()) - float(entry["created"])) <= CREATED_SLACK_S


def describe_processes(procs: list[Any]) -> tuple[dict[str, Any], ...]:
    out = []
    for proc in procs:
        try:
            out.append({**process_identity(proc), "role": process_role(proc)})
        except Exception:  # already gone
            pass
    return tuple(sorted(out, key=lambda p: p["pid"]))


def live_process(entry: dict[str, Any]) -> Any | None:
    """The psutil process a record entry names, if that very process is still running
    (same pid *and* start, :func:`same_process`: a reused pid is someone else's)."""
    import psutil  # type: ignore[import-untyped]

    try:
        proc = psutil.Process(int(entry["pid"]))
        if not same_process(proc, entry):
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError, ValueError):
        return None


def head_down(record: HeadRecord) -> list[str]:
    """What of a recorded head has died (empty: it looks alive): its GCS or raylet
    process gone, or nothing listening at its address. Pure local checks, well under a
    second: no Ray call, which would wait a minute for a dead raylet."""
    dead = [
        f"{p['role']} (pid {p['pid']})"
        for p in record.processes
        if p["role"] in ("gcs_server", "raylet") and live_process(p) is None
    ]
    if not head_alive(record):
        dead.append(f"nothing listens at {record.address} (the GCS port)")
    return dead


def head_stopped(record: HeadRecord) -> list[str]:
    """The recorded head's GCS or raylet processes that are alive but stopped (SIGSTOP, a
    debugger): its port still accepts connections (the kernel answers for a stopped
    listener), but a Ray call would wait minutes for an answer. Pure local checks."""
    import psutil

    stopped = []
    for p in record.processes:
        if p["role"] not in ("gcs_server", "raylet"):
            continue
        proc = live_process(p)
        try:
            state = proc.status() if proc is not None else None
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            state = None
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            stopped.append(f"{p['role']} (pid {p['pid']})")
    return stopped


def _record_path(home: Path) -> Path:
    return home / "head.json"


def start_detached_head(
    num_devices: int, *, resource: str = "NPU", num_cpus: int | None = None
) -> HeadRecord:
    """Start a local Ray head as its own background process (``ray start --head``), bound
    to loopback, and record where it is under $MXLOAD_HOME so other processes find it."""
    home = check_home_writable()
    prepare_environment()
    existing = read_head_record()
    if existing is not None and head_alive(existing):
        return existing
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        raise SessionError("cannot find the `ray` command next to this Python to start a head")
    token = secrets.token_hex(32)
    env = daemon_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    # free_port() can lose its port to another process before Ray binds it ("Failed to
    # start the grpc server"); such a start is cleaned up and tried again with new ports.
    for attempt in range(HEAD_START_ATTEMPTS):
        temp_dir = short_temp_dir("mxhead-")  # 0700; Ray runs in ray_temp_dir() inside it
        port = free_port()
        cmd = [
            ray_bin,
            "start",
            "--head",
            f"--node-ip-address={LOOPBACK}",
            f"--port={port}",
            f"--num-cpus={num_cpus if num_cpus is not None else min(os.cpu_count() or 1, 2)}",
            f"--resources={json.dumps({resource: num_devices})}",
            f"--temp-dir={ray_temp_dir(temp_dir)}",
            # free ports, not Ray's defaults (10001, 52365), which another head may hold
            *client_server_port_flags(),
            f"--dashboard-agent-listen-port={free_port()}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        began = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if proc.returncode == 0:
            break
        output = proc.stderr or proc.stdout
        _end_failed_start(temp_dir, f"{LOOPBACK}:{port}", began)
        if "port" not in output.lower() or attempt + 1 == HEAD_START_ATTEMPTS:
            raise SessionError("could not start a background Ray head: " + output[-2000:])
        log.info("ray start --head: a port was taken meanwhile; trying again with new ports")
    make_private(temp_dir)
    ours = started_since(head_processes(temp_dir, f"{LOOPBACK}:{port}"), began)
    record = HeadRecord(
        address=f"{LOOPBACK}:{port}",
        temp_dir=temp_dir,
        resource=resource,
        num_devices=num_devices,
        started_at=time.time(),
        token=token,
        processes=describe_processes(ours),
    )
    try:
        _write_head_record(home, record)
    except OSError as err:
        end_head(record)  # recorded nowhere, it could never be found again
        raise SessionError(
            f"$MXLOAD_HOME {home}: cannot record the Ray head just started "
            f"({err.strerror or type(err).__name__}); it was stopped. Set MXLOAD_HOME to a "
            "folder you can write",
            key="MXLOAD_HOME",
        ) from None
    return record


def _write_head_record(home: Path, record: HeadRecord) -> None:
    """head.json, mode 0600 from its creation (it holds the head's token)."""
    path = _record_path(home)
    tmp = home / f".head.json.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(record), indent=2))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


HEAD_START_ATTEMPTS = 3
"""Tries of ``ray start --head`` when a port it was given was taken meanwhile."""


def _end_failed_start(temp_dir: str, address: str, began: float) -> None:
    """What a failed ``ray start`` left running under ``temp_dir``, and the folder."""

    victims = started_since(head_processes(temp_dir, address), began)
    terminate(victims, 0.0)
    shutil.rmtree(temp_dir, ignore_errors=True)


def client_server_port_flags() -> list[str]:
    """``--ray-client-server-port=<free port>`` where Ray's client extras are installed
    (only then does a head run a client server; minimal Ray refuses the flag)."""
    if not raycompat.ray_client_installed():
        return []
    return [f"--ray-client-server-port={free_port()}"]


HEAD_RECORD_MAX_BYTES = 1 << 20
"""Largest head.json read (one head's address, token and a few processes)."""


def read_head_record() -> HeadRecord | None:
    """The head recorded in $MXLOAD_HOME/head.json, None when there is none. The record
    is an input like any other (docs/contract.md §5 "Files"): one that is no regular
    file (a FIFO would block the read for ever) or not a record mxload wrote is a
    SessionError (exit 2) naming it, never a traceback or a wait."""
    path = _record_path(mxload_home())
    try:
        # Not blocking on a FIFO's open; its kind checked on the open descriptor.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):  # no home folder: no record
        return None
    except OSError as err:
        raise _bad_record(path, err.strerror or type(err).__name__) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _bad_record(path, "not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(HEAD_RECORD_MAX_BYTES + 1)
    except OSError as err:
        raise _bad_record(path, err.strerror or type(err).__name__) from None
    finally:
        os.close(fd)
    try:
        if len(raw) > HEAD_RECORD_MAX_BYTES:
            raise ValueError(f"larger than {HEAD_RECORD_MAX_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        data["processes"] = tuple(data.get("processes") or ())
        record = HeadRecord(**data)
    except (ValueError, TypeError, RecursionError) as err:
        raise _bad_record(path, str(err) or type(err).__name__) from None
    _check_record_types(record, path)
    return record


def _check_record_types(record: HeadRecord, path: Path) -> None:
    texts = (record.address, record.temp_dir, record.resource, record.token)
    numbers = (record.num_devices, record.started_at)
    if (
        not all(isinstance(t, str) for t in texts)
        or not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers)
        or not all(isinstance(p, dict) for p in record.processes)
    ):
        raise _bad_record(path, "a field of the wrong type")


def _bad_record(path: Path, why: str) -> SessionError:
    return SessionError(
        f"{path}: not a record of a Ray head mxload started ({why}); remove it if no head "
        "of yours runs, or set MXLOAD_HOME to another folder",
        file=str(path),
        key="MXLOAD_HOME",
    )


def head_alive(record: HeadRecord) -> bool:
    host, _, port = record.address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def stop_detached_head(record: HeadRecord | None = None) -> bool:
    """Stop the background head this machine's $MXLOAD_HOME records (only its recorded
    processes and their descendants, :func:`end_head`). Returns whether one was stopped."""
    return bool(end_head(record or read_head_record()))


def started_since(procs: list[Any], began: float) -> list[Any]:
    """Those of ``procs`` this user started at or after ``began`` (a ``ray start`` just
    run): what a head's start is recorded from, so no older process (a user's viewer of
    an earlier head's log) is ever taken for one of its own."""
    import psutil

    out = []
    for proc in procs:
        try:
            if proc.uids().real == os.getuid() and proc.create_time() >= began - CREATED_SLACK_S:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def end_head(
    record: HeadRecord | None,
    extra: list[dict[str, Any]] | None = None,
    *,
    grace_s: float = 10.0,
) -> list[str]:
    """End every process of a recorded head, dead or alive or half-dead: the recorded
    ones (pid and start time checked: its daemons and client server as started), their
    descendants (Ray's workers are children of the raylet), and ``extra`` recorded
    processes (a session's workers, orphaned when their raylet died); nothing found by
    its command line (a user's `tail -f` of a Ray log names the temp dir). Then remove its
    record and temp dir. ``grace_s``: how long SIGTERM is given before SIGKILL (a head
    whose GCS or raylet is dead has nothing to shut down cleanly: its workers wait for
    them, so a short grace; the GCS gets at most :data:`GCS_GRACE_S`). Returns what was
    ended, ``"role (pid N)"`` each."""
    if record is None:
        return []
    import psutil

    # Only what mxload started: the recorded processes (pid and start checked) and their
    # descendants (Ray's workers are the raylet's children). Never a command-line match:
    # a user's `tail -f` of a Ray log names the temp dir too.
    found: dict[int, Any] = {}
    for entry in [*record.processes, *(extra or [])]:
        proc = live_process(entry)
        if proc is None:
            continue
        found[proc.pid] = proc
        try:
            found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.Error:
            pass
    found.pop(os.getpid(), None)
    roles = {pid: process_role(p) for pid, p in found.items()}
    ended = [f"{roles[pid]} (pid {pid})" for pid in found]
    # The GCS last, as `ray stop` does (the others report to it while they stop), and
    # with a short grace: this Ray's GCS does not exit on SIGTERM for ten seconds and
    # more, and it holds nothing to keep (the head's record and temp dir go with it).
    gcs = [p for pid, p in found.items() if roles[pid] == "gcs_server"]
    # Ray's autoscaler monitor with no grace: asleep in its update loop, it takes about
    # 0.6 s to act on SIGTERM (then reports its own end as a failure), and it holds
    # nothing a head that is ending needs.
    monitor = [p for pid, p in found.items() if roles[pid] == "monitor"]
    terminate(monitor, 0.0)
    terminate(
        [p for pid, p in found.items() if roles[pid] not in ("gcs_server", "monitor")], grace_s
    )
    terminate(gcs, min(grace_s, GCS_GRACE_S))
    try:
        ours = read_head_record() == record
    except SessionError:  # replaced meanwhile by what mxload did not write: left as it is
        ours = False
    if ours:
        _record_path(mxload_home()).unlink(missing_ok=True)
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    return ended


GCS_GRACE_S = 0.2
"""How long a head's GCS is given after SIGTERM before SIGKILL (:func:`end_head`): it
goes last, once everything that reports to it is gone, and holds nothing to keep."""


def terminate(procs: list[Any], grace_s: float) -> None:
    """SIGTERM, ``grace_s`` to exit, then SIGKILL for what is still alive."""
    import psutil

    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    alive = _wait_ended(procs, grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_ended(alive, 5.0)


def _wait_ended(procs: list[Any], timeout_s: float) -> list[Any]:
    """Wait up to ``timeout_s`` for ``procs`` to end; those still running. A zombie has
    ended: Ray's daemons are orphans, and a container's first process (not an init) may
    reap them only seconds later."""
    import psutil

    def running(proc: Any) -> bool:
        try:
            return bool(proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if running(p)]
    return left


def processes_under(root: str) -> list[Any]:
    """Processes whose command line names the directory ``root`` (Ray's daemons name
    their temp dir), plus their descendants (workers and agents rename themselves
    ``ray::...``); never this process. Returns ``psutil.Process`` objects."""
    import psutil

    found: dict[int, Any] = {}
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if root + os.sep in cmdline or cmdline.endswith(root):
            found[proc.pid] = proc
            try:
                for child in proc.children(recursive=True):
                    found[child.pid] = child
            except psutil.NoSuchProcess:
                pass
    found.pop(me, None)
    return list(found.values())


def head_processes(temp_dir: str, address: str) -> list[Any]:
    """Every process of a head started with ``temp_dir``: those under it, and its Ray
    client server, whose command line names only the GCS address."""
    import psutil

    found = {p.pid: p for p in processes_under(temp_dir)}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "ray.util.client.server" in cmdline and f"--address={address}" in cmdline:
            found[proc.pid] = proc
    found.pop(os.getpid(), None)
    return list(found.values())
