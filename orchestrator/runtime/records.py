"""What a detached session is called and what it leaves on this machine: its actors'
names in Ray, and ``$MXLOAD_HOME/sessions/<session>.json`` recording its processes (pid
and start time), so that ``release`` can end them when Ray cannot and a stopped rank is
named before a call to it waits minutes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import MxloadError, RunError, SessionError
from .heads import same_address
from .state import SessionState, caller_options

NAMESPACE = "mxload"


RECORD_MAX_BYTES = 1 << 20
"""Largest session record or options file read (pids, start times, a few options)."""


def read_record(path: Path) -> dict[str, Any] | None:
    """A JSON object mxload keeps under $MXLOAD_HOME/sessions, or None when ``path`` is
    missing, no regular file (a FIFO would block the read for ever), too large, not JSON
    or not an object: these records are inputs too (docs/contract.md §5 "Files")."""
    from ...workers.storage.local import read_whole

    try:
        data = json.loads(read_whole(str(path), RECORD_MAX_BYTES))
    except (OSError, ValueError, RecursionError, MxloadError):
        return None
    return data if isinstance(data, dict) else None


def keeper_name(session: str) -> str:
    return f"{session}/keeper"


def rank_name(session: str, rank: int) -> str:
    return f"{session}/rank-{rank:05d}"


SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a session name may be: it names Ray actors (``<session>/keeper``) and a file
under $MXLOAD_HOME/sessions, so no separators, spaces, control characters or dot-names."""


def check_session_name(name: str) -> str:
    """``name`` if it is a usable session name; SessionError (exit 2) naming --session if not."""
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise SessionError(
            f"--session {name!r}: not a usable session name (1 to 64 letters, digits, '.', "
            "'_' or '-', starting with a letter or digit)",
            key="--session",
        )
    return name


def session_file(session: str) -> Path:
    from ...cluster.local import mxload_home

    return mxload_home() / "sessions" / f"{check_session_name(session)}.json"


def record_session(session: str, address: str, pids: list[int | None]) -> None:
    """$MXLOAD_HOME/sessions/<session>.json: the session's worker and keeper processes on
    this machine (pid and start time), so `release` can end them when Ray cannot."""
    from ...cluster.local import describe_processes

    try:
        import psutil  # type: ignore[import-untyped]

        procs = []
        for pid in pids:
            if pid is None:
                continue
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        path = session_file(session)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = {"session": session, "address": address, "processes": describe_processes(procs)}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:  # a read-only home: release still works through Ray
        pass


def options_file(session: str) -> Path:
    """$MXLOAD_HOME/sessions/<session>.options: the caller's storage options of a
    detached session (docs/contract.md §4 "Credentials"), private to the user."""
    from ...cluster.local import mxload_home

    return mxload_home() / "sessions" / f"{check_session_name(session)}.options"


def keep_options(session: str, created: float, options: Mapping[str, Any] | None) -> bool:
    """Keep the caller's part of ``options`` (credentials) for later commands on this
    load of ``session`` (``created``), in a file only the user can read (0600 in a 0700
    folder), never in the cluster; remove it when there is none. False when the file
    cannot be written (then later commands need --storage-options again)."""
    theirs = caller_options(options)
    path = options_file(session)
    try:
        if theirs is None:
            path.unlink(missing_ok=True)
            return True
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"session": session, "created": created, "options": theirs}, f)
        tmp.replace(path)
        return True
    except (OSError, TypeError, ValueError):
        return False


def kept_options(session: str, created: float) -> dict[str, Any] | None:
    """The caller's storage options kept for this load of ``session`` (``created``:
    a file left by an earlier load of the name is not taken), None if none."""
    data = read_record(options_file(session))
    if data is None or data.get("created") != created:
        return None
    options = data.get("options")
    return options if isinstance(options, dict) else None


def recorded_sessions(address: str) -> dict[str, dict[str, Any]]:
    """Every session file recorded for the head at ``address``: path -> contents."""
    from ...cluster.local import mxload_home

    out = {}
    for path in sorted((mxload_home() / "sessions").glob("*.json")):
        data = read_record(path)
        if data is not None and same_address(str(data.get("address", "")), address):
            out[str(path)] = data
    return out


def check_ranks_running(state: SessionState) -> None:
    """RunError naming every rank whose worker on this machine is stopped (SIGSTOP, a
    debugger), before a call to it waits minutes. Only processes recorded for the
    session here (pid *and* start time: a pid reused elsewhere is not taken for one)."""
    import psutil

    from ...cluster.local import live_process

    try:
        data = read_record(session_file(state.session))
    except SessionError:
        return
    recorded = data.get("processes") if data is not None else None
    if not isinstance(recorded, list):
        return
    rank_of = {pid: r for r, pid in state.pids.items() if pid is not None}
    stopped = []
    for entry in recorded:
        if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int):
            continue
        rank = rank_of.get(entry["pid"])
        proc = live_process(entry) if rank is not None else None
        try:
            if proc is not None and proc.status() in (
                psutil.STATUS_STOPPED,
                psutil.STATUS_TRACING_STOP,
            ):
                stopped.append((rank, proc.pid))
        except psutil.Error:
            pass
    if stopped:
        ranks = ", ".join(f"rank {r} (pid {p})" for r, p in sorted(stopped))
        pids = " ".join(str(p) for _, p in sorted(stopped))
        raise RunError(
            f"session {state.session!r}: {ranks} stopped (SIGSTOP or a debugger), not down; "
            f"a call to it would wait minutes. `kill -CONT {pids}` resumes it",
            rank=stopped[0][0],
        )
