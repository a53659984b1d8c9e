"""Finding and ending the processes a CLI test started (its Ray heads, workers, keepers).

Why: the CLI tests run `mxload` as real subprocesses that may leave a detached Ray head
behind when a test fails half-way; every such process runs with the test module's folder
as its working directory, so it can be found by that and ended, never by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil


def processes_in(cwd: Path) -> list[int]:
    """Pids of live processes (not this one) whose working directory is ``cwd``."""
    want = str(cwd.resolve())
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.cwd() == want and proc.status() != "zombie":
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def end_processes(pids: list[int]) -> None:
    """SIGTERM, up to 10 s of grace, then SIGKILL for what is still alive (mxload's own
    process ender)."""
    from mxload.cluster.local import terminate

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    terminate(procs, 10.0)
