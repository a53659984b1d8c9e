"""What a rank's load or reload measured: bytes, seconds, staging and memory peaks.

The staging peak is the pool's high-water mark, reported beside the memory model's
prediction; host memory is cross-checked through the resident set size
(docs/contract.md §6), sampled after every unit, so the sampling must be cheap.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunStats:
    """What one load or reload measured on this rank."""

    bytes_read: int = 0
    bytes_needed: int = 0
    units: int = 0
    seconds: float = 0.0
    measured_peak_staging_bytes: int = 0
    predicted_peak_staging_bytes: int = 0
    device_peak_bytes: int | None = None
    rss_growth_bytes: int = 0
    read_seconds: float = 0.0
    """Time the converting thread spent on reads: waiting for the reader thread, or
    reading itself (small local units, ``run.INLINE_READ_BYTES``)."""
    convert_seconds: float = 0.0
    bytes_from_storage: int = 0
    """Bytes this run fetched from storage for the rank's own units (coalescing included)."""
    bytes_from_peers: int = 0
    """Bytes of the rank's units another rank fetched and published (read once per cluster)."""
    peer_fallbacks: int = 0
    """Shared units whose published bytes could not be had (owner lost): read from storage."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class FetchResult:
    """What ``RankLoader.fetch_for_peers`` fetched and published."""

    handles: dict[int, tuple[tuple[str, Any], ...]] = field(default_factory=dict)
    bytes_from_storage: int = 0
    published_bytes: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0


class Counts:
    """Adds to the counters of the run in progress, from any thread (the reader thread
    counts too); nothing when no run is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stats: RunStats | None = None

    def __call__(self, **deltas: int) -> None:
        with self._lock:
            if self.stats is not None:
                for name, n in deltas.items():
                    setattr(self.stats, name, getattr(self.stats, name) + n)


class Meter:
    """Time, host memory and device memory of one run, from its start."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.rss0 = rss_bytes()
        self.maxrss0 = maxrss_bytes()
        backend.reset_peak_memory()
        self.dev_base = backend.memory_allocated()
        self.samples: list[int] = []
        self.t0 = time.perf_counter()

    def sample(self) -> None:
        """The resident set size now (after a unit)."""
        self.samples.append(rss_bytes())

    def finish(self, stats: RunStats) -> None:
        """Seconds, RSS growth and device peak into ``stats``. RSS: the lifetime peak if it
        rose during this run (then the new peak happened now), else the highest RSS
        sampled between units."""
        stats.seconds = time.perf_counter() - self.t0
        maxrss1 = maxrss_bytes()
        top = maxrss1 if maxrss1 > self.maxrss0 else max(self.samples, default=self.rss0)
        stats.rss_growth_bytes = max(0, top - self.rss0)
        peak = self.backend.max_memory_allocated()
        if peak is not None and self.dev_base is not None:
            stats.device_peak_bytes = peak - self.dev_base


def maxrss_bytes() -> int:
    """The process's lifetime peak resident set size."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_STATM: tuple[int, int] | None = None
"""(pid, fd) of this process's open ``/proc/self/statm``: reopened after a fork."""
_STATM_LOCK = threading.Lock()


def _statm_fd() -> int:
    global _STATM
    with _STATM_LOCK:
        pid = os.getpid()
        if _STATM is None or _STATM[0] != pid:
            _STATM = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return _STATM[1]


def rss_bytes() -> int:
    """Resident set size now: Linux's ``/proc/self/statm``, kept open, is one pread
    (psutil builds a Process object per call, and opening the file each time costs
    several times the read); psutil, then the lifetime peak, elsewhere."""
    try:
        return int(os.pread(_statm_fd(), 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:
        return maxrss_bytes()
