"""Timing helpers for the benchmark suite: repeats, medians, spread, paired ratios, baselines.

Purpose: every number the suite publishes is a median of several timed repeats, printed
with its spread, and every headline is a *ratio* against a baseline measured in the same
run (a memcpy, a raw read, the reference path). The machine this runs on is small (2
cores) and shared: absolute seconds move by 2-10x with other people's work, while a
ratio of two things timed back to back moves much less. The helpers here make that the
default way to measure:

* :func:`interleave` runs several candidates in turn inside each repeat (A, B, C, A, B,
  C, ...), so a burst of background load hits all of them alike, and returns one
  :class:`Timing` per candidate;
* :func:`paired_ratio` divides repeat *i* of one candidate by repeat *i* of another and
  reports the median and the min-max of those per-repeat ratios (the spread of the
  ratio itself, not of either side);
* ``budget_s`` bounds a slow candidate: repeats stop once the budget is spent (never
  below ``min_repeats``), and the result says how many repeats it got.

Baselines: :func:`memcpy_fn` (a torch copy of the same tensors: the ceiling of anything that
touches the bytes once), :func:`cat_files` (``cat FILES > /dev/null``: what reading the
files costs with no parsing at all), :func:`evict_page_cache` (``posix_fadvise
DONTNEED``, no root needed, for cold-cache reads of files this suite wrote).

Limits: wall-clock time only (``time.perf_counter``); no CPU pinning; the page cache is
warm unless a benchmark evicts it and says so. Nothing here asserts a timing: tests never
time anything (team rule), and these numbers are evidence, not pass/fail.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (benchmarks run from anywhere; imports resolve against it)."""

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# --- timings and ratios -------------------------------------------------------------------


@dataclass(frozen=True)
class _Samples:
    """Samples of one measured quantity, over repeats (warm-ups excluded)."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"{type(self).__name__} needs at least one sample")

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)


@dataclass(frozen=True)
class Timing(_Samples):
    """Wall-clock seconds of the timed repeats of one candidate (warm-ups excluded)."""

    def quartiles(self) -> tuple[float, float]:
        """(q1, q3); with fewer than 4 samples, (min, max)."""
        if self.n < 4:
            return self.min, self.max
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    def rate(self, amount: float) -> Rate:
        """``amount`` per second (e.g. GB/s), median with min-max spread."""
        return Rate(tuple(amount / s if s > 0 else float("inf") for s in self.samples))

    def text(self, digits: int = 3) -> str:
        """``1.234 s (1.100-1.400, n=5)``."""
        return (
            f"{self.median:.{digits}f} s ({self.min:.{digits}f}-{self.max:.{digits}f}, n={self.n})"
        )

    def to_json(self) -> dict[str, Any]:
        q1, q3 = self.quartiles()
        return {
            "median_s": self.median,
            "min_s": self.min,
            "max_s": self.max,
            "q1_s": q1,
            "q3_s": q3,
            "n": self.n,
            "samples_s": list(self.samples),
        }


@dataclass(frozen=True)
class Rate(_Samples):
    """A per-repeat quantity (a throughput or a ratio): median and min-max over repeats."""

    def text(self, digits: int = 2, unit: str = "") -> str:
        """``3.10x (2.80-3.40, n=5)`` with ``unit="x"``."""
        return (
            f"{self.median:.{digits}f}{unit} ({self.min:.{digits}f}-{self.max:.{digits}f}, "
            f"n={self.n})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "n": self.n,
            "samples": list(self.samples),
        }


def paired_ratio(num: Timing | Rate, den: Timing | Rate) -> Rate:
    """``num / den`` per repeat when both have the same number of samples (taken in the
    same interleaved repeats), else every cross pair (a conservative spread: the extremes
    pair the fastest of one with the slowest of the other)."""
    a, b = num.samples, den.samples
    if len(a) == len(b):
        return Rate(tuple(x / y if y else float("inf") for x, y in zip(a, b, strict=True)))
    return Rate(tuple(x / y if y else float("inf") for x in a for y in b))


def interleave(
    candidates: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    budget_s: float | None = None,
    min_repeats: int = 2,
    before_each: Callable[[str], object] | None = None,
) -> dict[str, Timing]:
    """Time each candidate ``repeats`` times, taking turns within each repeat.

    ``warmup`` untimed rounds come first (allocator, caches, first-call compilation).
    ``budget_s`` stops further repeats once the timed rounds have used that many
    seconds (after at least ``min_repeats``). ``before_each(name)`` runs untimed before
    every timed call (e.g. evicting the page cache)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    started = time.perf_counter()
    for i in range(repeats):
        if budget_s is not None and i >= min_repeats and time.perf_counter() - started > budget_s:
            break
        for name, fn in candidates.items():
            if before_each is not None:
                before_each(name)
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def repeat(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    budget_s: float | None = None,
    min_repeats: int = 2,
) -> Timing:
    """:func:`interleave` with one candidate."""
    return interleave(
        {"_": fn}, repeats=repeats, warmup=warmup, budget_s=budget_s, min_repeats=min_repeats
    )["_"]


# --- baselines ----------------------------------------------------------------------------


def memcpy_fn(tensors: Sequence[Any]) -> Callable[[], None]:
    """A candidate that copies ``tensors`` (torch) into preallocated twins with ``copy_``:
    the memcpy baseline, the ceiling of anything that reads and writes the bytes once."""
    import torch

    dsts = [t.new_empty(t.shape) for t in tensors]
    for d in dsts:  # touch every page now, so no timed copy pays first-touch faults
        d.view(-1).view(torch.uint8).zero_()

    def copy() -> None:
        for src, dst in zip(tensors, dsts, strict=True):
            dst.copy_(src)

    return copy


def cat_files(paths: Sequence[str | Path]) -> None:
    """``cat PATHS > /dev/null`` (raises if cat fails)."""
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)


def write_zeros(path: str | Path, nbytes: int, block: int = 16 << 20) -> None:
    """Write ``nbytes`` to a new file at ``path`` in ``block``-byte writes (the floor under
    any command that writes as many bytes: page-cache copies, block allocation)."""
    buf = bytes(min(block, max(1, nbytes)))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(buf))
            f.write(buf if n == len(buf) else buf[:n])
            left -= n


def evict_page_cache(paths: Iterable[str | Path]) -> None:
    """Ask the kernel to drop these files' clean pages (POSIX_FADV_DONTNEED), so the next
    read comes from the disk. Needs no privileges; a no-op where unsupported."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_timed(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> tuple[float, str]:
    """Run ``cmd``; return (wall seconds, stdout). Raises with stderr on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        list(cmd),
        env=dict(env) if env is not None else None,
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        )
    return wall, proc.stdout


# --- machine facts ------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # a missing optional package is a fact, not an error
        return f"not importable ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "?"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except Exception:
        return "?"


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge the numbers: cores, CPU, memory, versions, commit, load."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "mem_total_gib": _mem_total_gib(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "ray": _version("ray"),
        "numba": _version("numba"),
        "numpy": _version("numpy"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(dirty) if dirty != "?" else None,
        "load_average_start": load_average(),
    }


# --- formatting ---------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    align = []
    for i in range(len(headers)):
        numeric = bool(cells) and all(_looks_numeric(r[i]) for r in cells if i < len(r))
        align.append("---:" if numeric else "---")
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(out)


def _looks_numeric(s: str) -> bool:
    head = s.split(" ", 1)[0].rstrip("x%s")
    try:
        float(head)
    except ValueError:
        return False
    return True


def fmt_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def gb(n: float) -> float:
    """Bytes -> GB (10^9), the unit of every GB/s in the suite."""
    return n / 1e9


def log(msg: str) -> None:
    """Progress on stderr (results go to files)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def render_section(sec: dict[str, Any]) -> str:
    """One section as markdown."""
    out = [f"## {sec['title']}", ""]
    if sec.get("error"):
        out += [f"**FAILED**: `{sec['error']}`", ""]
        return "\n".join(out)
    if sec.get("what"):
        out += [sec["what"], ""]
    if sec.get("load_average"):
        before, after = sec["load_average"]
        out += [
            f"Load average (1/5/15 min) before: {before}, after: {after}; section took "
            f"{sec.get('seconds', '?')} s.",
            "",
        ]
    for table in sec.get("tables", []):
        if table.get("caption"):
            out += [f"*{table['caption']}*", ""]
        out += [md_table(table["headers"], table["rows"]), ""]
    for note in sec.get("notes", []):
        out.append(f"- {note}")
    if sec.get("notes"):
        out.append("")
    return "\n".join(out)
