"""Bytes of a refit on either side of the wire (``mxload.orchestrator.plan.refit``).

A transfer is a rectangle ``rows x cols`` of a tensor's ``[N, K]`` view. On the wire it
is its rows in the trainer's dtype, or, converted on the sender, its E4M3 payload
``[rows, cols]`` then its E8M0 scales ``[rows, cols / 32]``, made by the one conversion
entry point (``Backend.mx_quantize``: rows and 32-column groups are converted
independently, so a rectangle converts to exactly the bytes the whole tensor would).

Receiver: the receive area, a ring allocated once (pre-faulted) that the bytes pass
through while they are converted, and :class:`AreaStorage`, the loader's storage seam
over it: the loader reads the trainer's bytes exactly as it reads a checkpoint's (same
units, conversion and write stages), the checkpoint being the trainer's tensors as the
wire carries them, one file per tensor (and one per MXFP8 scale).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ...orchestrator.errors import InputError, RunError
from ...orchestrator.plan.formats import MX_GROUP
from ...orchestrator.plan.ranges import ByteRange
from ...orchestrator.plan.refit import ReceiveLayout, Transfer

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
        # half the buffer per chunk: the allocator keeps some of what a chunk frees (a
        # backend that cannot write in place makes a chunk's results, a piece cut along
        # K a contiguous copy of its rows)
        step = max(1, budget // 2 // (cols * (piece.element_size() + 1) + groups))
        for i in range(0, rows, step):
            backend.mx_quantize_into(
                piece[i : i + step], payload[i : i + step], scales[i : i + step]
            )
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
    """One engine rank's receive area (``plan.refit.receive_layout``): a ring the pieces
    landing on it pass through in its units' order, and a pinned region for the pieces
    several of its units read, both allocated once (pre-faulted) and reused by every
    update. ``itemsize``: per tensor, its trainer dtype's size; ``row_bytes``: per wire
    file, bytes of one row of its ``[N, K]`` view; ``timeout_s``: how long a wait goes
    without progress on the other side before it names what it waited for.

    During an update, link threads land buckets (:meth:`wait_space`, :meth:`landed`)
    while the loader reads (:meth:`read_into`, which waits for the pieces it covers) and
    releases what it has read (:meth:`units_read`); a failure on either side
    (:meth:`fail`) wakes every wait, which raises it."""

    def __init__(
        self,
        layout: ReceiveLayout,
        itemsize: Mapping[str, int],
        row_bytes: Mapping[str, int],
        timeout_s: float = 60.0,
    ) -> None:
        self.layout = layout
        self.rank = layout.rank
        self.row_bytes = dict(row_bytes)
        self.timeout_s = timeout_s
        self.index: dict[str, list[tuple[int, Landed]]] = {}
        cap = layout.capacity
        for i, t in enumerate(layout.transfers):
            at = layout.at[i] if layout.pinned[i] else layout.at[i] % cap
            for file, rect in landed(t, itemsize[t.tensor], at):
                self.index.setdefault(file, []).append((i, rect))
        # zero_() faults every page in now, not during the first refit.
        self.ring = torch.empty(cap, dtype=torch.uint8).zero_()
        self.pinned = torch.empty(layout.pinned_bytes, dtype=torch.uint8).zero_()
        self._ring_np = self.ring.numpy()
        self._pinned_np = self.pinned.numpy()
        self._cond = threading.Condition()
        n = len(layout.transfers)
        self._landed = [False] * n
        self._dead = [True] * n
        self._sent = [False] * n
        self._todo: list[bool] | None = None
        self._read: set[int] = set()
        self._front = 0
        self._error: BaseException | None = None
        self._moves = 0
        self.held = 0
        self.peak_held = 0
        self.read_wait_s = 0.0
        """Seconds the loader waited for bytes to land, this update."""

    @property
    def nbytes(self) -> int:
        """Bytes the area holds (ring and pinned region)."""
        return self.layout.capacity + self.layout.pinned_bytes

    def view(self, i: int) -> torch.Tensor:
        """Where transfer ``i`` lands."""
        t = self.layout.transfers[i]
        if self.layout.pinned[i]:
            at = self.layout.at[i]
            return self.pinned[at : at + t.nbytes]
        at = self.layout.at[i] % self.layout.capacity
        return self.ring[at : at + t.nbytes]

    # -- one update ---------------------------------------------------------------------

    def reset(self, sent: Sequence[bool]) -> None:
        """A new update, whose links bring the transfers flagged in ``sent``; the ring
        waits for the loader to say which units it reads (:meth:`begin_reads`)."""
        with self._cond:
            n = len(self.layout.transfers)
            self._landed = [False] * n
            self._sent = list(sent)
            self._dead = [True] * n
            self._todo = None
            self._read = set()
            self._front = 0
            self.read_wait_s = 0.0
            self._error = None
            self.held = self.peak_held = 0

    def begin_reads(self, todo: Sequence[bool]) -> None:
        """The loader reads the units flagged in ``todo``: the pieces no unit of them
        reads are not kept (a link receives them into its scratch)."""
        lay = self.layout
        with self._cond:
            self._todo = list(todo)
            self._dead = [
                not self._sent[i]
                or not any(todo[u] for u in range(lay.unit[i], lay.last_unit[i] + 1))
                for i in range(len(lay.transfers))
            ]
            self._advance()
            self._cond.notify_all()

    def units_read(self, units: Sequence[int]) -> None:
        """The loader has read ``units`` (into its own staging): their ring bytes are
        free once every earlier unit's are."""
        with self._cond:
            self._read.update(units)
            self._advance()
            self._cond.notify_all()

    def _advance(self) -> None:
        lay = self.layout
        order = lay.order
        while self._front < len(order):
            i = order[self._front]
            if not self._dead[i]:
                if lay.unit[i] not in self._read:
                    break
                self.held -= lay.transfers[i].nbytes
            self._front += 1
            self._moves += 1

    def _front_at(self) -> float:
        order = self.layout.order
        return self.layout.at[order[self._front]] if self._front < len(order) else math.inf

    @property
    def error(self) -> BaseException | None:
        """The update's first failure (None while it goes on)."""
        return self._error

    def fail(self, err: BaseException) -> None:
        """Every wait, now and later, raises ``err`` (the first failure stands)."""
        with self._cond:
            if self._error is None:
                self._error = err
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str, scale: float = 1.0) -> None:
        """Wait (holding the lock) until ``ready()``, restarting the clock whenever the
        other side moves; RunError naming ``what`` after ``timeout_s`` without."""
        while True:
            if self._error is not None:
                raise self._error
            if ready():
                return
            moves = self._moves

            def moved(moves: int = moves) -> bool:
                return self._error is not None or ready() or self._moves != moves

            self._cond.wait_for(moved, self.timeout_s * scale)
            if self._error is None and not ready() and self._moves == moves:
                raise RunError(what, rank=self.rank)

    def wait_space(self, items: Sequence[int], where: str) -> list[int]:
        """Wait until the ring bytes the transfers ``items`` (a bucket's) land on are
        released; those to keep (the others are not read this update)."""
        lay = self.layout
        cap = lay.capacity
        with self._cond:
            self._wait(lambda: self._todo is not None, f"{where}: the loader never started")
            keep = [i for i in items if not self._dead[i]]
            ring = [i for i in keep if not lay.pinned[i]]
            end = max((lay.at[i] + lay.transfers[i].nbytes for i in ring), default=0)
            self._wait(
                lambda: end - cap <= self._front_at(),
                f"{where}: the loader released no receive ring bytes for {2 * self.timeout_s:g} s",
                # The loader waits on some link itself and names it first.
                scale=2.0,
            )
        return keep

    def landed(self, items: Sequence[int]) -> None:
        lay = self.layout
        with self._cond:
            for i in items:
                self._landed[i] = True
                if not lay.pinned[i]:
                    self.held += lay.transfers[i].nbytes
            self.peak_held = max(self.peak_held, self.held)
            self._moves += 1
            self._cond.notify_all()

    # -- the loader's reads -------------------------------------------------------------

    def read_into(self, file: str, rng: ByteRange, dst: np.ndarray) -> None:
        """The bytes of ``rng`` of wire file ``file`` (as the loader reads them, the
        segments concatenated) into ``dst``, once the pieces it covers have landed."""
        row_bytes = self.row_bytes[file]
        r0, n, c0, w = rectangle(rng, row_bytes)
        view = dst.reshape(n, w)
        covered = 0
        lay = self.layout
        for i, rect in self.index.get(file, ()):
            a, b = max(r0, rect.rows[0]), min(r0 + n, rect.rows[1])
            x, y = max(c0, rect.cols[0]), min(c0 + w, rect.cols[1])
            if a >= b or x >= y:
                continue
            if not self._landed[i]:
                t = lay.transfers[i]
                what = (
                    f"engine rank {self.rank}: waited {self.timeout_s:g} s for trainer rank {t.sender}'s piece of "
                    f"{t.tensor} rows {list(t.rows)} (read by unit {lay.unit[i]})"
                )
                t0 = time.perf_counter()
                with self._cond:
                    self._wait(partial(self._landed.__getitem__, i), what)
                self.read_wait_s += time.perf_counter() - t0
            rows = rect.rows[1] - rect.rows[0]
            region = self._pinned_np if lay.pinned[i] else self._ring_np
            src = region[rect.at : rect.at + rows * rect.width].reshape(rows, rect.width)
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


class AreaStorage:
    """The storage seam of the rank loader (``read_ranges_into``) over a receive area,
    with the hooks a streaming source needs: which units the loader reads
    (``begin_reads``), which it has read (``units_read``), the end of its reads
    (``finish``: every link's trailer checked), the units it writes itself
    (``copied_units``: a refit's copies within a node, started with the reads,
    ``start_copies``, and waited for after them, ``finish_copies``) and its failure
    (``abort``)."""

    is_local = True
    reads_ranges_apart = False

    def __init__(
        self,
        area: ReceiveArea,
        *,
        finish: Callable[[], None] | None = None,
        abort: Callable[[BaseException], None] | None = None,
        planned_bytes: int | None = None,
        held_bytes: int | None = None,
        copied_units: Sequence[int] = (),
        copies: tuple[Callable[..., None], Callable[[], None]] | None = None,
    ) -> None:
        self.area = area
        self._finish = finish
        self._abort = abort
        self.copied_units = tuple(copied_units)
        self._copies = copies
        self.held_bytes = area.nbytes if held_bytes is None else held_bytes
        """What receiving holds beside the loader: the area, and the links' buffers."""
        self.planned_bytes = self.held_bytes if planned_bytes is None else planned_bytes
        """What the transfer plan predicted of it (``receiver_ring`` + ``receiver_pinned``
        + ``receiver_scratch``)."""

    @property
    def area_bytes(self) -> int:
        return self.held_bytes

    @property
    def read_wait_s(self) -> float:
        return self.area.read_wait_s

    def url(self, file: str) -> str:
        return f"trainer://{file}"

    def version_tag(self, file: str) -> str:
        return ""

    def begin_reads(self, todo: Sequence[bool]) -> None:
        self.area.begin_reads(todo)

    def units_read(self, units: Sequence[int]) -> None:
        self.area.units_read(units)

    def finish(self) -> None:
        if self._finish is not None:
            self._finish()

    def start_copies(
        self,
        buffers: Mapping[str, torch.Tensor],
        check: Callable[[], None],
        written: Callable[[Sequence[int]], bool],
        synchronize: Callable[[], None],
    ) -> None:
        """Start writing ``copied_units`` into ``buffers`` (the rank's, by name) as they
        come, ``check`` before each buffer (the fence), and giving the buffers other
        ranks copy from this one once ``written(units)`` says the loader wrote them."""
        if self._copies is not None:
            self._copies[0](buffers, check, written, synchronize)

    def finish_copies(self) -> None:
        """Wait for every copy (this rank's own update being whole)."""
        if self._copies is not None:
            self._copies[1]()

    def abort(self, err: BaseException) -> None:
        self.area.fail(err)
        if self._abort is not None:
            self._abort(err)

    def read_ranges_into(self, file: str, ranges: Sequence[ByteRange], out: Any) -> int:
        dst = np.frombuffer(out, dtype=np.uint8)
        at = 0
        for rng in ranges:
            self.area.read_into(file, rng, dst[at : at + rng.nbytes])
            at += rng.nbytes
        return at
