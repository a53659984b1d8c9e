"""The Ray head a detached session lives on: the one recorded under $MXLOAD_HOME (or
named by --address), checked from its recorded processes before and while a command
waits on it, and joined (docs/contract.md §4 "Detached sessions").
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import HeadDown, HeadStopped, MxloadError, SessionError


def recorded_head(address: str | None) -> Any:
    """The head recorded under $MXLOAD_HOME if ``address`` is None or names it."""
    from ...cluster.local import read_head_record

    record = read_head_record()
    if record is None or address is None or same_address(address, record.address):
        return record
    return None


def same_address(a: str, b: str) -> bool:
    """Whether two HOST:PORT strings name one head (localhost is 127.0.0.1)."""

    def norm(x: str) -> tuple[str, str]:
        host, _, port = x.strip().removeprefix("ray://").rpartition(":")
        host = host.strip("[]").lower()
        return ("127.0.0.1" if host in ("localhost", "0.0.0.0", "") else host), port

    return norm(a) == norm(b)


def _head_down_error(record: Any, down: list[str]) -> HeadDown:
    from ...cluster.local import mxload_home

    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started_at))
    return HeadDown(
        f"the Ray head recorded in {mxload_home() / 'head.json'} ({record.address}, started "
        f"{since}) is down: {'; '.join(down)}. Its sessions' workers and buffers are gone "
        "with it; `mxload release` ends what is left of it and removes its files",
        key="--address",
    )


def _head_stopped_error(record: Any, stopped: list[str]) -> HeadStopped:
    from ...cluster.local import mxload_home

    pids = " ".join(s.rsplit("pid ", 1)[-1].rstrip(")") for s in stopped)
    return HeadStopped(
        f"the Ray head recorded in {mxload_home() / 'head.json'} ({record.address}) is "
        f"stopped, not down: {'; '.join(stopped)} (SIGSTOP or a debugger); Ray would wait "
        f"minutes for it. `kill -CONT {pids}` resumes it with its sessions; "
        "`mxload release --force` ends it",
        key="--address",
    )


def check_recorded_head(record: Any) -> None:
    """Before any Ray call to a recorded head, from its recorded processes alone: HeadDown
    when its GCS or raylet died (or nothing listens), HeadStopped when one is stopped."""
    from ...cluster.local import head_down, head_stopped

    down = head_down(record)
    if down:
        raise _head_down_error(record, down)
    stopped = head_stopped(record)
    if stopped:
        raise _head_stopped_error(record, stopped)


@contextmanager
def watching_head(record: Any | None, period_s: float = 1.0) -> Iterator[None]:
    """While the body runs, the recorded head is checked every ``period_s`` from its
    recorded processes (:func:`check_recorded_head`). When it goes down or is stopped,
    the body is interrupted wherever it waits on Ray (which then might wait minutes, or
    for ever) and the head's error is raised instead: it names the head, not a rank.

    The interrupt is a SIGUSR1 to the main thread, handled for the body's duration as a
    KeyboardInterrupt (what Ray's waits give way to): SIGINT may be ignored, as in a
    command started in the background by a script."""
    if record is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    found: list[MxloadError] = []
    done = threading.Event()
    sending = threading.Lock()  # no signal once the body is over and the handler gone

    def watch() -> None:
        while not done.wait(period_s):
            try:
                check_recorded_head(record)
            except MxloadError as err:
                with sending:
                    if not done.is_set() and main is not None:
                        found.append(err)
                        signal.pthread_kill(main, signal.SIGUSR1)
                return

    previous = signal.signal(signal.SIGUSR1, signal.default_int_handler)
    threading.Thread(target=watch, name="mxload-head-watch", daemon=True).start()
    try:
        yield
    except (KeyboardInterrupt, MxloadError, RuntimeError):
        # Ray's own error for a lost raylet may surface before the interrupt does.
        err = found[0] if found else _head_error(record)
        if err is not None:
            raise err from None
        raise
    finally:
        with sending:
            done.set()
        signal.signal(signal.SIGUSR1, previous)


def _head_error(record: Any) -> MxloadError | None:
    """The recorded head's error if it is down or stopped now, else None."""
    try:
        check_recorded_head(record)
    except MxloadError as err:
        return err
    return None


def connect_session(address: str | None) -> tuple[str, bool]:
    """Join the session's Ray: --address, else the head recorded under $MXLOAD_HOME. A
    recorded head (also when --address names it) is checked first from its recorded
    processes (:func:`check_recorded_head`: at once, when its GCS or raylet died or is
    stopped) and joined with its token."""
    import ray

    from ...cluster.local import connect, mxload_home

    if ray.is_initialized():
        return "", False
    record = recorded_head(address)
    if record is None and address is None:
        # The actual folder, not the variable's name: the user may not know it is set.
        raise SessionError(
            f"no detached session here: no running Ray head is recorded in "
            f"{mxload_home()} ($MXLOAD_HOME); start one with `mxload load SRC --detach`, "
            "or join a cluster with --address HOST:PORT",
            key="--address",
        )
    if record is None:
        assert address is not None
        connect(address)
        return address, False
    check_recorded_head(record)
    connect(address or record.address, token=record.token)
    return record.address, True
