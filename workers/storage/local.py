"""Reads of local files: ``preadv`` straight into the caller's buffer.

Every request goes through a :class:`Runner` (the storage's retry wrapper, bound to the
file), which counts it and retries it when it fails transiently; the functions here count
the extra requests they make within one (one pread per row, one per gathered block).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence

import numpy as np

from ...orchestrator.errors import CheckpointError
from ...orchestrator.plan.ranges import ByteRange, CoalescePolicy
from .faults import ShortRead
from .jobs import Job
from .stats import StorageStats

GATHER_BYTES = 1 << 20
"""Largest block of a spanned strided range read at once (the gather scratch buffer, one
per read call, outside the staging pool like a remote response body)."""

_HAS_PREADV = hasattr(os, "preadv")


Runner = Callable[[tuple[int, int] | None, Callable[[], int]], int]
"""Runs one request of a file (``span`` = (start, length), None for the whole file) and
returns what it returns: the bytes it read."""


def pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; ShortRead if the file ends first."""
    want = buf.nbytes
    done = 0
    while done < want:
        if _HAS_PREADV:
            n = os.preadv(fd, [buf[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv: one extra copy
            chunk = os.pread(fd, want - done, offset + done)
            n = len(chunk)
            buf[done : done + n] = chunk
        if n == 0:
            raise ShortRead(f"short read: got {done} of {want} bytes (file ends early)")
        done += n


def open_regular(path: str, url: str = "") -> int:
    """A read-only descriptor of ``path``, which must be a regular file: a FIFO would
    block every read forever, a device (``/dev/zero``) never ends, a socket is no file.
    Opened without blocking (a FIFO's open waits for a writer) and checked on the open
    descriptor, so a file swapped after an earlier check is seen. CheckpointError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{url or path}: is {file_kind(mode)}, not a regular file; not read",
                file=url or path,
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_kind(mode: int) -> str:
    """What a non-regular file is, as a message says it."""
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_whole(path: str, max_bytes: int, url: str = "") -> bytes:
    """The whole of a small regular file; CheckpointError when it holds more than
    ``max_bytes`` (checked by reading at most one byte more, not by trusting a stat)."""
    fd = open_regular(path, url)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise too_large(url or path, max_bytes)
    return data


def too_large(url: str, max_bytes: int) -> CheckpointError:
    """A metadata file bigger than its cap (docs/contract.md §1.4)."""
    return CheckpointError(
        f"{url}: larger than {max_bytes} bytes, the most mxload reads of this file; not "
        "read (is it the checkpoint's file?)",
        file=url,
    )


def read_at(path: str, start: int, length: int, url: str = "") -> bytes:
    """``length`` bytes of ``path`` at ``start``, exactly."""
    buf = bytearray(length)
    fd = open_regular(path, url)
    try:
        pread_into(fd, memoryview(buf), start)
    finally:
        os.close(fd)
    return bytes(buf)


class _File:
    """One file descriptor, opened on the first request that needs it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            self._fd = open_regular(self.path)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_ranges_apart(
    path: str,
    ranges: Sequence[ByteRange],
    view: memoryview,
    policy: CoalescePolicy,
    run: Runner,
    stats: StorageStats,
) -> int:
    """Read ``ranges`` into ``view`` when no gap between them is bridged: each range
    goes straight into the output, one request (and retry scope) per range. A strided
    range whose gaps ``policy`` spans (under a page) is read as its span and its rows
    gathered out of it (:func:`gather_span`); a wider one is pread row by row in one
    tight loop. No request objects: a row-split slice is thousands of small segments,
    and an object per segment would cost more than the pread itself."""
    file = _File(path)
    scratch: list[np.ndarray] = []  # one gather buffer, made on first use
    fetched = 0
    try:
        offset = 0
        for r in ranges:
            if r.nbytes == 0:
                continue
            dst = view[offset : offset + r.nbytes]
            offset += r.nbytes
            spanned = policy.as_read(r) is not r

            def read(r: ByteRange = r, dst: memoryview = dst, spanned: bool = spanned) -> int:
                got = _read_range(file.fd, r, dst, spanned, scratch, stats)
                stats.add(bytes_fetched=got)
                return got

            fetched += run((r.start, r.end - r.start), read)
    finally:
        file.close()
    return fetched


def _read_range(
    fd: int,
    r: ByteRange,
    dst: memoryview,
    spanned: bool,
    scratch: list[np.ndarray],
    stats: StorageStats,
) -> int:
    """One range of :func:`read_ranges_apart`; returns the bytes read."""
    if r.is_contiguous():
        pread_into(fd, dst, r.start)
        return r.nbytes
    if spanned:
        return gather_span(fd, r, dst, scratch, stats)
    length, stride, start = r.length, r.stride, r.start
    for i in range(r.count):
        lo = i * length
        pread_into(fd, dst[lo : lo + length], start + i * stride)
    stats.add(requests=r.count - 1)  # one pread per segment; the runner counted the first
    return r.nbytes


def gather_span(
    fd: int, r: ByteRange, dst: memoryview, scratch: list[np.ndarray], stats: StorageStats
) -> int:
    """Read the span of strided range ``r`` in blocks of whole strides and gather its
    rows into ``dst`` (one request per block); returns the bytes read (the span: first
    row's start to last row's end, exactly what ``CoalescePolicy.as_read`` predicts).

    The span is copied, not mapped: a fresh mapping's page faults cost what the copy
    does, and a mapping turns a file truncated under the reader into SIGBUS instead of
    a ShortRead."""
    stride, length, count = r.stride, r.length, r.count
    rows_per_block = max(1, GATHER_BYTES // stride)
    if not scratch or scratch[0].nbytes < rows_per_block * stride:
        scratch[:] = [np.empty(rows_per_block * stride, dtype=np.uint8)]
    buf = scratch[0]
    out = np.frombuffer(dst, dtype=np.uint8).reshape(count, length)
    by_row = buf[: rows_per_block * stride].reshape(rows_per_block, stride)
    got = 0
    for a in range(0, count, rows_per_block):
        b = min(count, a + rows_per_block)
        # whole strides, but the last block stops at the last row's end
        nbytes = (b - a) * stride if b < count else (b - a - 1) * stride + length
        pread_into(fd, buf.data[:nbytes], r.start + a * stride)
        got += nbytes
        # the block's rows through a plain 2-D view (as_strided costs far more per call)
        out[a:b] = by_row[: b - a, :length]
    blocks = -(-count // rows_per_block)
    if blocks > 1:
        stats.add(requests=blocks - 1)  # one per block; the runner counted the first
    return got


def read_jobs(
    path: str, jobs: Sequence[Job], view: memoryview, run: Runner, stats: StorageStats
) -> int:
    """Run coalesced requests ``jobs`` one after the other into ``view``."""
    file = _File(path)
    fetched = 0
    try:
        for job in jobs:

            def read(job: Job = job) -> int:
                direct = job.direct_offset()
                if direct is not None:  # straight into the caller's buffer
                    pread_into(file.fd, view[direct : direct + job.nbytes], job.start)
                else:
                    tmp = bytearray(job.nbytes)
                    pread_into(file.fd, memoryview(tmp), job.start)
                    job.scatter(memoryview(tmp), view)
                stats.add(bytes_fetched=job.nbytes)
                return job.nbytes

            fetched += run((job.start, job.nbytes), read)
    finally:
        file.close()
    return fetched
