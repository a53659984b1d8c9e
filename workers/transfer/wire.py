"""Bytes of a refit on either side of the wire (``mxload.orchestrator.plan.refit``).

A transfer is a rectangle ``rows x cols`` of a tensor's ``[N, K]`` view. On the wire it
is its rows in the trainer's dtype, or, converted on the sender, its E4M3 payload
``[rows, cols]`` then its E8M0 scales ``[rows, cols / 32]``, made by the one conversion
entry point (``Backend.mx_quantize``: rows and 32-column groups are converted
independently, so a rectangle converts to exactly the bytes the whole tensor would).

Receiver: the receive area, allocated once (pre-faulted) and rewritten every refit, and
:class:`AreaStorage`, the loader's storage seam over it: the loader reads the trainer's
bytes exactly as it reads a checkpoint's (same units, conversion and write stages), the
checkpoint being the trainer's tensors as the wire carries them, one file per tensor
(and one per MXFP8 scale).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...orchestrator.errors import InputError, RunError
from ...orchestrator.plan.formats import MX_GROUP
from ...orchestrator.plan.ranges import ByteRange
from ...orchestrator.plan.refit import Transfer

SCALE_SUFFIX = "_scale"
"""The wire file of an MXFP8 tensor's scales: its name + this (``X.weight_scale``)."""


def matrix_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor (or a trainer rank's dim-0 shard of it) as parts address it: ``[N, K]``
    (1-D tensors ``[1, n]``, more dims ``[N, prod(rest)]``)."""
    if t.dim() == 1:
        return t.view(1, -1)
    return t.reshape(t.shape[0], -1)


def pack(
    transfers: Sequence[Transfer],
    local: Callable[[Transfer], torch.Tensor],
    out: torch.Tensor,
    backend: Any,
) -> int:
    """Copy ``transfers`` one after another into the uint8 tensor ``out`` as the wire
    carries them; ``local(t)`` is the sender's rectangle of ``t`` (a view of its shard,
    on the trainer's device or not). Returns the bytes packed.

    Nothing is allocated for a piece sent as it is (one copy from the view into ``out``).
    A piece converted here is quantized in row chunks whose input copy and results stay
    within ``out``'s size, written straight into ``out``: the sender's staging is at most
    twice its bucket buffer (docs/contract.md §4 "Refit")."""
    at = 0
    budget = out.numel()
    for t in transfers:
        piece = local(t)
        rows, cols = piece.shape
        if not t.on_sender:
            n = rows * cols * piece.element_size()
            out[at : at + n].view(rows, -1).copy_(piece.view(torch.uint8))
            at += n
            continue
        groups = -(-cols // MX_GROUP)
        payload = out[at : at + rows * cols].view(rows, cols)
        at += rows * cols
        scales = out[at : at + rows * groups].view(rows, groups)
        at += rows * groups
        # half the buffer per chunk: the allocator keeps some of what a chunk frees
        step = max(1, budget // 2 // (cols * (piece.element_size() + 1) + groups))
        for i in range(0, rows, step):
            q, s = backend.mx_quantize(piece[i : i + step])
            payload[i : i + step].copy_(q.view(torch.uint8))
            scales[i : i + step].copy_(s)
            del q, s  # before the next chunk's are made
    return at


def local_rect(shards: Mapping[str, torch.Tensor], rank: int) -> Callable[[Transfer], torch.Tensor]:
    """The sender's rectangle of a transfer, a view of its local shard (named by the
    checkpoint name the manifest gives it)."""

    def rect(t: Transfer) -> torch.Tensor:
        shard = shards.get(t.tensor)
        if shard is None:
            raise InputError(
                f"trainer rank {rank}: the manifest places {t.tensor!r} here but "
                "send_weights was not given it",
                tensor=t.tensor,
            )
        v = matrix_view(shard.detach())
        r0, c0 = t.shard_origin
        return v[t.rows[0] - r0 : t.rows[1] - r0, t.cols[0] - c0 : t.cols[1] - c0]

    return rect


@dataclass(frozen=True)
class Landed:
    """Where a rectangle of one wire file is in the area: byte rows ``rows`` and byte
    columns ``cols`` of the file's ``[N, row bytes]`` view, row-major from ``at``."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    at: int

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]


def landed(t: Transfer, itemsize: int, at: int) -> list[tuple[str, Landed]]:
    """The wire-file rectangles a transfer brings, placed from area offset ``at``."""
    (a, b), (x, y) = t.rows, t.cols
    if not t.on_sender:
        return [(t.tensor, Landed((a, b), (x * itemsize, y * itemsize), at))]
    payload = Landed((a, b), (x, y), at)
    g0, g1 = x // MX_GROUP, math.ceil(y / MX_GROUP)
    scale = Landed((a, b), (g0, g1), at + (b - a) * (y - x))
    return [(t.tensor, payload), (t.tensor + SCALE_SUFFIX, scale)]


def rectangle(rng: ByteRange, row_bytes: int) -> tuple[int, int, int, int]:
    """``rng`` of a file viewed ``[N, row_bytes]`` as (first row, rows, byte column,
    width)."""
    if rng.count > 1:
        if rng.stride != row_bytes:
            raise InputError(f"range {rng.describe()} is no rectangle of {row_bytes}-byte rows")
        return rng.start // row_bytes, rng.count, rng.start % row_bytes, rng.length
    s, n = rng.start, rng.length
    if s % row_bytes == 0 and n % row_bytes == 0:
        return s // row_bytes, n // row_bytes, 0, row_bytes
    if n and s // row_bytes == (s + n - 1) // row_bytes:
        return s // row_bytes, 1, s % row_bytes, n
    raise InputError(f"range {rng.describe()} is no rectangle of {row_bytes}-byte rows")


class ReceiveArea:
    """One engine rank's receive area: every transfer landing on it, sender by sender,
    each sender's buckets in the order it sends them. ``transfers``: (sender, bucket
    transfers) in that order; ``itemsize``: per tensor, its trainer dtype's size;
    ``row_bytes``: per wire file, bytes of one row of its ``[N, K]`` view."""

    def __init__(
        self,
        rank: int,
        transfers: Sequence[Transfer],
        itemsize: Mapping[str, int],
        row_bytes: Mapping[str, int],
    ) -> None:
        self.rank = rank
        self.row_bytes = dict(row_bytes)
        self.offsets: list[int] = []
        self.index: dict[str, list[Landed]] = {}
        at = 0
        for t in transfers:
            self.offsets.append(at)
            for file, rect in landed(t, itemsize[t.tensor], at):
                self.index.setdefault(file, []).append(rect)
            at += t.nbytes
        # zero_() faults every page in now, not during the first refit.
        self.tensor = torch.empty(at, dtype=torch.uint8).zero_()
        self._np = self.tensor.numpy()

    def read_into(self, file: str, rng: ByteRange, dst: np.ndarray) -> None:
        """The bytes of ``rng`` of wire file ``file`` (as the loader reads them, the
        segments concatenated) into ``dst``."""
        row_bytes = self.row_bytes[file]
        r0, n, c0, w = rectangle(rng, row_bytes)
        view = dst.reshape(n, w)
        covered = 0
        for rect in self.index.get(file, ()):
            a, b = max(r0, rect.rows[0]), min(r0 + n, rect.rows[1])
            x, y = max(c0, rect.cols[0]), min(c0 + w, rect.cols[1])
            if a >= b or x >= y:
                continue
            rows = rect.rows[1] - rect.rows[0]
            src = self._np[rect.at : rect.at + rows * rect.width].reshape(rows, rect.width)
            view[a - r0 : b - r0, x - c0 : y - c0] = src[
                a - rect.rows[0] : b - rect.rows[0], x - rect.cols[0] : y - rect.cols[0]
            ]
            covered += (b - a) * (y - x)
        if covered != n * w:
            raise RunError(
                f"rank {self.rank}: {file} {rng.describe()}: the refit brought {covered} of "
                f"its {n * w} bytes (the transfer plan does not cover this read)",
                rank=self.rank,
                tensor=file,
            )

    def storage(self) -> AreaStorage:
        return AreaStorage(self)


class AreaStorage:
    """The storage seam of the rank loader (``read_ranges_into``) over a receive area."""

    is_local = True
    reads_ranges_apart = False

    def __init__(self, area: ReceiveArea) -> None:
        self.area = area

    def url(self, file: str) -> str:
        return f"trainer://{file}"

    def version_tag(self, file: str) -> str:
        return ""

    def read_ranges_into(self, file: str, ranges: Sequence[ByteRange], out: Any) -> int:
        dst = np.frombuffer(out, dtype=np.uint8)
        at = 0
        for rng in ranges:
            self.area.read_into(file, rng, dst[at : at + rng.nbytes])
            at += rng.nbytes
        return at
