"""Coalesced read requests, and where their bytes land in the caller's buffer.

The compact, possibly strided :class:`~mxload.orchestrator.plan.ranges.ByteRange` s of a
plan are coalesced under a :class:`~mxload.orchestrator.plan.ranges.CoalescePolicy` into
requests (:class:`Job`); each request knows which stretches of the output its bytes
fill, so a request that maps onto one contiguous stretch is read straight into it and
any other is scattered.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...orchestrator.plan.ranges import ByteRange, CoalescePolicy, coalesce


@dataclass(frozen=True)
class Piece:
    """Bytes ``[file_start, file_start + length)`` go to ``out[out_offset:...]``."""

    file_start: int
    length: int
    out_offset: int


@dataclass(frozen=True)
class Job:
    """One request ``[start, end)`` and where its bytes go."""

    start: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def direct_offset(self) -> int | None:
        """``out`` offset if the request's bytes are one contiguous stretch of ``out``."""
        pos, out = self.start, None
        for p in self.pieces:
            if p.file_start != pos:
                return None
            if out is None:
                out = p.out_offset
            elif p.out_offset != out + (pos - self.start):
                return None
            pos += p.length
        return out if pos == self.end else None

    def scatter(self, src: memoryview, out: memoryview) -> None:
        """Copy this request's bytes ``src`` to their places in ``out``."""
        for p in self.pieces:
            lo = p.file_start - self.start
            out[p.out_offset : p.out_offset + p.length] = src[lo : lo + p.length]


def plan_jobs(
    ranges: Sequence[ByteRange], policy: CoalescePolicy, max_request_bytes: int | None
) -> list[Job]:
    """The requests that read ``ranges`` (concatenated in order into the output) under
    ``policy``, each split to at most ``max_request_bytes`` when given, with the pieces
    of output each fills, clipped to the request."""
    spans: list[tuple[int, int]] = []
    for req in coalesce(ranges, policy):
        if max_request_bytes is None or req.nbytes <= max_request_bytes:
            spans.append((req.start, req.end))
        else:
            step = max_request_bytes
            spans.extend((s, min(s + step, req.end)) for s in range(req.start, req.end, step))
    starts = [s for s, _ in spans]
    buckets: list[list[Piece]] = [[] for _ in spans]
    for p in sorted(_pieces(ranges), key=lambda p: (p.file_start, p.out_offset)):
        p_end = p.file_start + p.length
        i = bisect.bisect_right(starts, p.file_start) - 1
        while i < len(spans) and spans[i][0] < p_end:
            s, e = spans[i]
            lo, hi = max(s, p.file_start), min(e, p_end)
            if hi > lo:
                buckets[i].append(Piece(lo, hi - lo, p.out_offset + (lo - p.file_start)))
            i += 1
    return [Job(s, e, tuple(b)) for (s, e), b in zip(spans, buckets, strict=True)]


def _pieces(ranges: Sequence[ByteRange]) -> list[Piece]:
    """Every segment of ``ranges`` with its place in the concatenated output."""
    pieces: list[Piece] = []
    offset = 0
    for r in ranges:
        for seg_start, seg_len in r.segments():
            pieces.append(Piece(seg_start, seg_len, offset))
            offset += seg_len
    return pieces


def as_byte_view(out: Any) -> memoryview:
    """A writable, flat ``uint8`` memoryview over ``out`` (bytearray, numpy, torch...):
    CPU memory exposing the buffer protocol, or a contiguous CPU torch tensor."""
    if type(out).__module__.startswith("torch"):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("read_ranges_into: a torch output must be a contiguous CPU tensor")
        import torch  # only when given a tensor: storage itself does not need torch

        out = out.detach().reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(out)
    if mv.readonly:
        raise ValueError("read_ranges_into: the output buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("read_ranges_into: the output buffer must be contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
