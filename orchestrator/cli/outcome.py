"""A command that joins Ray says its outcome even when Ray ends its process.

Ray's core worker ends a driver whose connection to its node's object store breaks (the
node's raylet died): the process exits at once with status 1, before any Python handler
runs, so the command would end without a word. The console script therefore forks a
small watcher before anything starts Ray: it holds only stderr and the read end of a
pipe the command writes one byte to once it has said its outcome. When the pipe closes
without that byte, the watcher says what happened, in one line, naming the recorded head
when it is down (docs/contract.md §5 "Exit status").

The command stays the process its caller started (its pid, its signals, SIGSTOP and
all); the watcher ignores the terminal's signals and ends when the command does.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import sys
from collections.abc import Sequence

RAY_COMMANDS = frozenset({"demo", "load", "reload", "status", "release"})
"""Commands that join or start a Ray cluster."""

_SAID = b"1"


class Outcome:
    """The command's end of the pipe to its watcher."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def said(self) -> None:
        """The command said its outcome (its exit status is its own): the watcher ends
        without a word."""
        try:
            os.write(self._fd, _SAID)
            os.close(self._fd)
        except OSError:
            pass


def watch(argv: Sequence[str]) -> Outcome | None:
    """Fork the watcher when the command in ``argv`` joins Ray (None otherwise, or where
    there is no fork)."""
    command = next((a for a in argv if not a.startswith("-")), "")
    address = next((b for a, b in itertools.pairwise(argv) if a == "--address"), None)
    address = next((a.partition("=")[2] for a in argv if a.startswith("--address=")), address)
    if command not in RAY_COMMANDS or not hasattr(os, "fork"):
        return None
    read, write = os.pipe()
    command_pid = os.getpid()
    if os.fork():
        os.close(read)
        return Outcome(write)
    try:
        os.close(write)
        _watcher(read, command, command_pid, address)
    finally:
        os._exit(0)


def _watcher(read: int, command: str, command_pid: int, address: str | None) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP):
        signal.signal(sig, signal.SIG_IGN)
    # Only stderr stays open: a reader of the command's stdout sees it end with the command.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.closerange(3, read)
    os.closerange(read + 1, 1 << 16)
    got = b""
    # The pipe closes when the command ends, unless a process it forked (not exec'd)
    # holds its end: the command's own end is then told by the watcher's new parent.
    while True:
        ready, _, _ = select.select([read], [], [], 1.0)
        if ready:
            chunk = os.read(read, 16)
            if not chunk:
                break
            got += chunk
        elif os.getppid() != command_pid:
            break
    if got == _SAID:
        return
    sys.stderr.write(f"mxload: error: {_why(command, command_pid, address)}\n")
    sys.stderr.flush()


def _why(command: str, pid: int, address: str | None) -> str:
    """Why the command ended without a word: its head's error when the head it joined is
    the recorded one and is down or stopped, else that it was ended from outside."""
    try:
        from ..errors import MxloadError
        from ..runtime.heads import check_recorded_head, recorded_head

        record = recorded_head(address)
        if record is not None:
            check_recorded_head(record)
    except MxloadError as err:
        return f"{command} ended by Ray: {err}"
    except Exception:  # the files say nothing usable: the plain answer below
        pass
    return (
        f"{command} (pid {pid}) ended without saying its outcome (killed, or ended by Ray); "
        "`mxload status` says what the devices hold"
    )
