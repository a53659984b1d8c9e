"""Byte ranges of a file, compact and strided, and how reads of them are coalesced. Pure.

A rank reads row slices of row-major tensors. A slice of ``rows`` rows and a column
window of a ``[N, K]`` tensor is ``rows`` equal segments at a fixed stride: one
:class:`ByteRange` ``(start, length, stride, count)`` describes it, so a 256-rank plan
stays small (docs/contract.md §4 "Streaming").

Coalescing turns the segments a rank needs into the requests it sends. The policy bounds
over-read per merged request, so the whole read plan's amplification is bounded too:
a gap is bridged only while ``gap_bytes_in_request <= (max_overread_ratio - 1) *
needed_bytes_in_request`` and the gap is at most ``max_gap_bytes``.

* local files (``LOCAL_POLICY``): no gap between two ranges is bridged, but a strided
  range whose gaps are under a page (4 KiB) is read as one span, first row to last, and
  its rows gathered from it: the kernel moves whole pages anyway, and one pread of a
  span costs far less than one pread per 96-byte row (a K-split expert slice at tp 8 is
  2048 of them). Wider gaps are read row by row;
* remote stores (``REMOTE_POLICY``): gaps up to 1 MiB are bridged while each request
  reads at most 1.25x what it needs (an HTTP/S3 request costs milliseconds), and a
  K-split slice, however wide the split, is planned as its whole rows (``whole_rows``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteRange:
    """``count`` segments of ``length`` bytes at ``start``, ``start + stride``, ...

    The segments, concatenated in order, are the bytes of one slice in row-major order.
    """

    start: int
    length: int
    stride: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 0 or self.count < 0:
            raise ValueError(f"negative byte range {self}")
        if self.count > 1 and self.stride < self.length:
            raise ValueError(f"overlapping strided range {self}")

    @property
    def nbytes(self) -> int:
        """Bytes the range covers (sum of its segments)."""
        return self.length * self.count

    @property
    def end(self) -> int:
        """One past the last byte of the last segment."""
        if self.count == 0 or self.length == 0:
            return self.start
        return self.start + (self.count - 1) * self.stride + self.length

    def segments(self) -> Iterator[tuple[int, int]]:
        """(start, length) of each segment, in order."""
        if self.length == 0:
            return
        for i in range(self.count):
            yield self.start + i * self.stride, self.length

    def is_contiguous(self) -> bool:
        return self.count <= 1 or self.stride == self.length

    def describe(self) -> str:
        """For error messages: 'bytes 100-199' or '64 x 32 bytes from 100, stride 128'."""
        if self.is_contiguous():
            return f"bytes {self.start}-{self.end - 1}" if self.nbytes else f"bytes {self.start}-"
        return f"{self.count} x {self.length} bytes from {self.start}, stride {self.stride}"


def contiguous(start: int, length: int) -> ByteRange:
    return ByteRange(start, length, length, 1)


@dataclass(frozen=True)
class CoalescePolicy:
    """How far a request may reach past the bytes it needs."""

    max_gap_bytes: int
    """Largest hole between two needed segments that one request may bridge."""
    max_overread_ratio: float
    """Bytes requested / bytes needed, per request, at most."""
    span_gap_bytes: int = 0
    """A strided range whose gaps (``stride - length``) are below this is read as one
    span (its first segment's start to its last segment's end) and gathered; 0: never."""
    whole_rows: bool = False
    """A K-split slice (a column window of every row) is planned as its whole rows
    (``PartRead.weight_window``): a few large requests instead of one per row, fetched
    once per sharing scope and shared by the ranks that hold the other columns, each
    cutting its columns out locally."""

    def __post_init__(self) -> None:
        if self.max_gap_bytes < 0 or self.max_overread_ratio < 1.0 or self.span_gap_bytes < 0:
            raise ValueError(f"invalid coalescing policy {self}")

    def as_read(self, r: ByteRange) -> ByteRange:
        """What storage reads for ``r`` before coalescing: its span when its gaps are under
        ``span_gap_bytes``, else ``r`` itself."""
        if r.count > 1 and r.length > 0 and r.stride - r.length < self.span_gap_bytes:
            return contiguous(r.start, r.end - r.start)
        return r


PAGE_BYTES = 4096
"""A page: the unit the kernel reads a file in, whatever a pread asks for."""

LOCAL_POLICY = CoalescePolicy(max_gap_bytes=0, max_overread_ratio=1.0, span_gap_bytes=PAGE_BYTES)
REMOTE_POLICY = CoalescePolicy(max_gap_bytes=1 << 20, max_overread_ratio=1.25, whole_rows=True)
"""Whole rows at any split width: one request per row costs a store's latency per row
(a 1536-way split of an expert's w2 is 4096 requests of 1 byte each), while whole rows
cost bytes: fetched once per sharing scope, or once per rank with ``--share none`` (the
split width times the slice, still far cheaper than a request per row)."""
ROW_REMOTE_POLICY = CoalescePolicy(max_gap_bytes=1 << 20, max_overread_ratio=1.25)
"""The remote policy without whole rows: every K-split row its own request."""


@dataclass(frozen=True)
class Request:
    """One read sent to storage: ``[start, end)`` of a file."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def coalesce(ranges: Iterable[ByteRange], policy: CoalescePolicy) -> list[Request]:
    """Requests that cover every segment of ``ranges``, merged under ``policy``.

    Segments may come in any order and may overlap (two parts reading the same scale
    tile); the result is sorted and disjoint.
    """
    segs = sorted((s, s + n) for r in ranges for s, n in policy.as_read(r).segments() if n > 0)
    out: list[Request] = []
    if not segs:
        return out
    run_start, run_end = segs[0]
    needed = run_end - run_start
    gaps = 0
    for s, e in segs[1:]:
        if s <= run_end:  # touching or overlapping: no over-read
            if e > run_end:
                needed += e - run_end
                run_end = e
            continue
        gap = s - run_end
        seg = e - s
        if gap <= policy.max_gap_bytes and gaps + gap <= (policy.max_overread_ratio - 1.0) * (
            needed + seg
        ):
            gaps += gap
            needed += seg
            run_end = e
            continue
        out.append(Request(run_start, run_end))
        run_start, run_end, needed, gaps = s, e, seg, 0
    out.append(Request(run_start, run_end))
    return out


def requested_bytes(ranges: Iterable[ByteRange], policy: CoalescePolicy) -> int:
    """Bytes the requests of ``coalesce`` fetch: what a rank's ``bytes_to_read`` counts."""
    return sum(r.nbytes for r in coalesce(ranges, policy))
