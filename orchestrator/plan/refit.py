"""The transfer plan of a refit: which trainer rank sends which slice of which tensor to
which engine rank, in buckets, and what that costs in bytes per link and staging. Pure.

The engine side is the ordinary plan (``planner.build_plan``): every rank's units and
their parts, each part a rectangle ``rows x cols`` of one checkpoint tensor's ``[N, K]``
view. The trainer side is a :class:`~.trainer.TrainerManifest` (docs/contract.md
"Trainer sources"). A part is cut where the trainer's slices cut it; each piece is sent
by the rank holding it to each engine rank that needs it, except that ranks of one node
holding the same
buffer filled from the same pieces (a data-parallel replica, a TP-replicated norm) take
it whole from the first of them once it is written (:class:`NodeCopy`): its pieces cross
to the node once.

Units the engine holds in MXFP8 are converted on the way: on the receiver (BF16 on the
wire, as a BF16 checkpoint's reload converts) or on the sender (E4M3 plus one E8M0 byte
per 32 values along K on the wire, 33/64 of BF16). A sender can only convert groups it
holds whole, so with ``convert_on="sender"`` a piece whose K range does not start and
end on the receiver's 32-column groups is refused at plan time.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import pickle
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, cast

from ..errors import InputError
from .formats import MX_GROUP
from .memory import ConvertOptions, proportional_read_fn, reload_min_budget, schedule
from .planner import no_cycle_collection
from .readplan import matrix_shape
from .trainer import TrainerManifest, TrainerTensor
from .types import Part, Plan, Unit

ConvertOn = Literal["receiver", "sender"]
CONVERT_ON: tuple[ConvertOn, ...] = ("receiver", "sender")

MX_LAYOUTS = ("mx_linear", "mx_moe")
"""Buffer layouts the engine holds in MXFP8: their units are converted on the way."""

DEFAULT_BUCKET_BYTES = 64 << 20
"""Bytes one sender packs into one bucket (on one link: :func:`messages`), the trainer form's
``bucket_bytes`` and ``plan --bucket-size`` unless given."""
MIN_BUCKET_BYTES = 1 << 10
MAX_BUCKET_BYTES = 1 << 34
"""The range the trainer form's ``bucket_bytes`` and ``plan --bucket-size`` take: a bucket
is one message buffer on each side (a shared-memory slot, a pre-faulted object-store
buffer), and more than 16 GiB is a unit mistake, not a bucket."""

POSITION_SCALE = 1 << 20
"""``Bucket.position`` counts a receiver's ring in this many parts."""

DEFAULT_DEVICES_PER_NODE = 16
"""Engine ranks per node when the caller does not say (the CLI's ``--devices-per-node``)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One piece: ``rows x cols`` of ``tensor``'s ``[N, K]`` view (docs/contract.md §6:
    1-D tensors are ``[1, n]``, more dims ``[N, prod(rest)]``), sent by trainer rank
    ``sender`` to engine rank ``receiver``."""

    sender: int
    receiver: int
    tensor: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    shard_origin: tuple[int, int]
    """Where the sender's shard starts in the ``[N, K]`` view: the piece is rows
    ``rows - shard_origin[0]`` and cols ``cols - shard_origin[1]`` of the shard's own
    ``[n, k]`` view."""
    nbytes: int
    """Bytes on the wire."""
    source_bytes: int
    """Bytes of the piece in the trainer's dtype."""
    mx: bool
    """The engine holds it in MXFP8 (converted on the sender or on the receiver)."""
    on_sender: bool
    """Converted on the sender: the wire holds E4M3 then the E8M0 scales, row-major
    ``[rows, cols]`` and ``[rows, cols / 32]``."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """Transfers one sender packs for one receiver (the landing rank), in order, sent as
    :func:`messages`; ``index`` counts the sender's buckets in the order it sends them."""

    sender: int
    receiver: int
    index: int
    transfers: tuple[Transfer, ...]
    unit: int = 0
    """The first of the receiver's units (in its loader's order) that reads a piece of it:
    the bucket can land once the receiver has read its units before this one."""
    position: int = 0
    """How far into its receiver's ring order that unit comes: the ring bytes of the
    units before it, in parts of ``POSITION_SCALE`` of the receiver's whole ring
    bytes (:func:`send_order`)."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@dataclass(frozen=True)
class NodeCopy:
    """Buffers engine rank ``receiver`` takes whole from ``source``, an earlier rank of its
    node that holds the same buffers filled from the same pieces (a data-parallel
    replica, a TP-replicated norm): ``source`` writes them from the trainer's bytes, then
    sends them as they are, once its own update is whole (docs/contract.md §4 "Refit")."""

    source: int
    receiver: int
    buffers: tuple[str, ...]
    """Weight buffers, in the receiver's unit order (each with its ``_scale`` buffer, if
    it has one)."""
    units: tuple[int, ...]
    """The receiver's units that write them (indices into its plan's units)."""
    nbytes: int
    """Bytes of the buffers, as the engine holds them."""


@dataclass(frozen=True)
class Link:
    """Bytes from one trainer node to one engine node (``same_node``: the two are one
    machine, and the bytes move through shared memory or device IPC)."""

    sender_node: int
    receiver_node: int
    nbytes: int

    @property
    def same_node(self) -> bool:
        return self.sender_node == self.receiver_node


@dataclass(frozen=True)
class RefitSummary:
    """What a refit moves, without its per-piece list (:func:`refit_summary`)."""

    convert_on: ConvertOn
    bucket_bytes: int
    manifest_digest: str
    links: tuple[Link, ...]
    needed_bytes: int
    """Bytes the engine ranks take from the trainer in its dtype, each element once per
    rank it lands on (a buffer a rank copies from another of its node is none of them)."""
    wire_bytes: int
    """Bytes over all links (== ``needed_bytes`` with ``convert_on="receiver"``)."""
    mx_needed_bytes: int
    """The part of ``needed_bytes`` held in MXFP8 by the engine."""
    mx_wire_bytes: int
    """What those bytes are on the wire."""
    fanout_bytes: tuple[int, ...]
    """Per engine node, bytes its ranks copy from one another once written
    (:class:`NodeCopy`; on no link)."""
    receiver_nodes: tuple[int, ...]
    """Per engine rank, its node."""
    receiver_bytes: tuple[int, ...]
    """Per engine rank, wire bytes of the pieces landing on it."""
    receiver_staging: tuple[int, ...]
    """Per engine rank, the host bytes its update stages at its peak, as the runtime
    allocates them: the loader's staging (one unit's received bytes and its conversion
    output, plus the next unit's bytes read meanwhile) + the receive ring
    (``receiver_ring``) + the pinned region (``receiver_pinned``) + its links' landing
    buffers (``receiver_scratch``). The trainer's bytes pass through the ring; the rank
    never holds its whole need (``receiver_bytes``)."""
    sender_bytes: tuple[int, ...]
    """Per trainer rank, bytes it sends."""
    sender_staging: tuple[int, ...]
    """Per trainer rank, peak bytes it stages: one buffer of its largest bucket, and
    when it converts, at most half as much again for a conversion's row chunk."""
    sender_buckets: tuple[int, ...]
    """Per trainer rank, how many buckets it sends."""
    sender_convert_bytes: tuple[int, ...]
    """Per trainer rank, bytes (its dtype) it converts to MXFP8 (none on the receiver)."""
    receiver_mx_bytes: tuple[int, ...]
    """Per engine rank, bytes of its MX units as they arrive: what it converts (BF16),
    or repacks (MXFP8, converted on the sender)."""
    transfers: int
    """Pieces sent (after splitting pieces larger than a bucket)."""
    unused_tensors: tuple[str, ...] = ()
    """Manifest tensors no engine rank holds (not sent)."""
    receiver_ring: tuple[int, ...] = ()
    """Per engine rank, bytes of its receive ring (:func:`receive_layout`), which the
    pieces landing on it pass through in its units' order, each released once its unit
    is read: the most of the trainer's bytes the rank holds at a time (allocated once,
    at this size)."""
    receiver_pinned: tuple[int, ...] = ()
    """Per engine rank, bytes of the pieces more than one of its units reads (a tied
    embedding): held beside the ring for the whole update."""
    receiver_scratch: tuple[int, ...] = ()
    """Per engine rank, one buffer per link of that link's largest bucket: where the
    short runs of a bucket's pieces (:func:`messages`) are received before they are
    copied to their places (allocated once)."""
    scale_alg: int = 0
    """The MX scale rule the senders quantize under (``convert_on="sender"``: the
    engine plan's, which the engine only repacks); 0 when the receivers convert, each
    under its own rule."""

    @property
    def wire_ratio(self) -> float:
        return self.wire_bytes / self.needed_bytes if self.needed_bytes else 1.0

    @property
    def receiver_node_bytes(self) -> dict[int, int]:
        """Bytes each engine node takes in, over all links."""
        out: dict[int, int] = {}
        for link in self.links:
            out[link.receiver_node] = out.get(link.receiver_node, 0) + link.nbytes
        return out


@dataclass(frozen=True)
class RefitPlan:
    """The whole transfer plan: the summary and every bucket, by sender then index (or
    one rank's share of it, :meth:`only`)."""

    summary: RefitSummary
    buckets: tuple[Bucket, ...]
    unit_tensors: tuple[tuple[str, ...], ...] = ()
    """The tensors each engine unit reads (each set once, sorted): a delta sends the
    tensors one unit reads all or none (``workers.transfer.exchange.tensor_groups``)."""
    tensors: tuple[str, ...] = ()
    """The trainer tensors the whole plan sends, sorted: the order of a header's
    changed flags."""
    digest: str = ""
    """What both ends of every link check the other planned (:func:`plan_digest` of
    the whole plan)."""
    copies: tuple[NodeCopy, ...] = ()
    """The node fan-out: buffers engine ranks copy from another rank of their node, by
    source then receiver."""

    def only(self, *, sender: int | None = None, receiver: int | None = None) -> RefitPlan:
        """The share of one rank: the buckets trainer rank ``sender`` sends, or those
        landing on engine rank ``receiver``, with the whole plan's summary, tensors and
        digest (an engine rank also keeps the copies it takes or gives). What a rank
        keeps once its side is set up (a large plan's pieces are gigabytes, in every
        trainer and engine process)."""
        pool = self.buckets if receiver is None else self.buckets_to(receiver)
        kept = tuple(b for b in pool if sender is None or b.sender == sender)
        copies = self.copies
        if receiver is not None:
            copies = tuple(c for c in copies if receiver in (c.source, c.receiver))
        elif sender is not None:
            copies = ()
        return replace(self, buckets=kept, copies=copies)

    def transfers_to(self, rank: int) -> tuple[Transfer, ...]:
        """Every piece landing on engine rank ``rank``."""
        return tuple(t for b in self.buckets_to(rank) for t in b.transfers)

    def copies_into(self, rank: int) -> tuple[NodeCopy, ...]:
        """What engine rank ``rank`` copies from others of its node, by source."""
        return tuple(c for c in self.copies if c.receiver == rank)

    def copies_from(self, rank: int) -> tuple[NodeCopy, ...]:
        """What engine rank ``rank`` gives others of its node, by receiver."""
        return tuple(c for c in self.copies if c.source == rank)

    def copied_units(self, rank: int) -> frozenset[int]:
        """The units of engine rank ``rank`` it copies (none of their bytes land on it)."""
        return frozenset(u for c in self.copies_into(rank) for u in c.units)

    def buckets_of(self, sender: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.sender == sender)

    def buckets_to(self, rank: int) -> tuple[Bucket, ...]:
        """The buckets landing on engine rank ``rank``, in plan order."""
        return self._by_receiver.get(rank, ())

    @cached_property
    def _by_receiver(self) -> dict[int, tuple[Bucket, ...]]:
        # indexed once: a trainer rank lays out every engine rank it feeds
        out: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            out.setdefault(b.receiver, []).append(b)
        return {r: tuple(bs) for r, bs in out.items()}


@dataclass(frozen=True)
class Placement:
    """Where a piece lands in one of a rank's units: rows ``rows`` and cols ``cols`` of
    unit ``unit`` (source orientation ``[N, K]``, rows from the unit's first) take rows
    ``piece_rows`` and cols ``piece_cols`` of the piece (counted from its own first)."""

    unit: int
    part: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    piece_rows: tuple[int, int]
    piece_cols: tuple[int, int]


def placements(units: Sequence[Unit], transfer: Transfer) -> tuple[Placement, ...]:
    """Every place among ``units`` (one engine rank's, in plan order) that ``transfer``'s
    piece fills: each part of that tensor whose rectangle meets the piece's."""
    out = []
    for i, unit in enumerate(units):
        for j, part in enumerate(unit.parts):
            if part.tensor_name != transfer.tensor:
                continue
            a = max(part.rows[0], transfer.rows[0])
            b = min(part.rows[1], transfer.rows[1])
            x = max(part.cols[0], transfer.cols[0])
            y = min(part.cols[1], transfer.cols[1])
            if a >= b or x >= y:
                continue
            dst = part.dst_row - part.rows[0]
            out.append(
                Placement(
                    unit=i,
                    part=j,
                    rows=(dst + a, dst + b),
                    cols=(x - part.cols[0], y - part.cols[0]),
                    piece_rows=(a - transfer.rows[0], b - transfer.rows[0]),
                    piece_cols=(x - transfer.cols[0], y - transfer.cols[0]),
                )
            )
    return tuple(out)


@dataclass(frozen=True)
class ReceiveLayout:
    """Where the pieces landing on one engine rank are held while its loader reads them
    (its receive area): a ring of ``capacity`` bytes they pass through in the order of
    the rank's units, and a pinned region for the pieces several of its units read.

    Why it cannot deadlock. A rank's loader reads its units in order and releases a
    unit's ring bytes once it has read them (into its own staging); a link thread
    writes a bucket only into ring bytes already released. Every link brings its
    pieces in unit order (the walk visits the rank's units in order), so when the loader
    waits on unit ``u`` every earlier unit's pieces have landed and been released, and
    the first bucket not yet landed on any link that carries a piece of ``u`` touches
    units ``u..h`` only. The planner closed that bucket before those units' ring bytes
    exceeded the receive window, and the capacity is the widest such span plus the
    largest piece (a piece that would cross the ring's end starts again at its
    beginning, which wastes less than one piece within any span); so that bucket fits
    in what is released, lands, and the loader goes on. Pinned pieces take no ring
    bytes and are never released during the update."""

    rank: int
    capacity: int
    pinned_bytes: int
    transfers: tuple[Transfer, ...]
    """Landing on the rank: sender by sender, each sender's buckets in order."""
    unit: tuple[int, ...]
    """Per transfer, the first of the rank's units that reads it."""
    last_unit: tuple[int, ...]
    """Per transfer, the last of the rank's units that reads it."""
    pinned: tuple[bool, ...]
    """Per transfer, whether it is held in the pinned region (read by several units)."""
    at: tuple[int, ...]
    """Per transfer, its offset in the ring's unbounded sequence (its bytes are at
    ``at % capacity``), or, pinned, in the pinned region."""
    order: tuple[int, ...]
    """The ring's transfers (indices into ``transfers``) in ring order."""
    needed: int
    """What the ring must hold for these buckets (at most ``capacity``)."""


def receive_layout(units: Sequence[Unit], plan: RefitPlan, rank: int) -> ReceiveLayout:
    """The receive area of engine rank ``rank`` (``units``: its units, in the order its
    loader reads them) for the pieces landing on it; its ring has the capacity the walk
    predicted (``RefitSummary.receiver_ring``). InputError when these buckets would
    need more (the walk and this layout disagree: a bug, refused before any byte
    moves). Units the rank copies from another of its node read nothing here."""
    copied = plan.copied_units(rank)
    by_tensor: dict[str, list[tuple[int, Part]]] = {}
    for i, unit in enumerate(units):
        if i in copied:
            continue
        for part in unit.parts:
            by_tensor.setdefault(part.tensor_name, []).append((i, part))
    buckets = plan.buckets_to(rank)
    transfers: list[Transfer] = []
    first: list[int] = []
    last: list[int] = []
    bucket_of: list[int] = []
    for n, b in enumerate(buckets):
        for t in b.transfers:
            readers = [
                i
                for i, p in by_tensor.get(t.tensor, ())
                if max(p.rows[0], t.rows[0]) < min(p.rows[1], t.rows[1])
                and max(p.cols[0], t.cols[0]) < min(p.cols[1], t.cols[1])
            ]
            if not readers:
                raise InputError(
                    f"engine rank {rank}: no unit reads the piece of {t.tensor!r} rows "
                    f"{list(t.rows)} cols {list(t.cols)} trainer rank {t.sender} sends it",
                    tensor=t.tensor,
                    rank=rank,
                )
            transfers.append(t)
            first.append(min(readers))
            last.append(max(readers))
            bucket_of.append(n)
    pinned = [a != b for a, b in zip(first, last, strict=True)]
    ring_bytes = [0] * len(units)
    piece = 0
    for t, u, p in zip(transfers, first, pinned, strict=True):
        if not p:
            ring_bytes[u] += t.nbytes
            piece = max(piece, t.nbytes)
    prefix = [0]
    for nbytes in ring_bytes:
        prefix.append(prefix[-1] + nbytes)
    widest = 0
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for n, u in zip(bucket_of, first, strict=True):
        lo[n] = min(lo.get(n, u), u)
        hi[n] = max(hi.get(n, u), u)
    for n in lo:
        widest = max(widest, prefix[hi[n] + 1] - prefix[lo[n]])
    needed = widest + piece if piece else 0
    summary = plan.summary
    capacity = summary.receiver_ring[rank] if summary.receiver_ring else needed
    if needed > capacity:
        raise InputError(
            f"engine rank {rank}: its buckets need a receive ring of {needed} bytes, the "
            f"transfer plan gives it {capacity}",
            rank=rank,
        )
    at = [0] * len(transfers)
    order = sorted((i for i, p in enumerate(pinned) if not p), key=lambda i: first[i])
    v = 0
    for i in order:
        size = transfers[i].nbytes
        if v % capacity + size > capacity:
            v += capacity - v % capacity
        at[i] = v
        v += size
    pin = 0
    for i, p in enumerate(pinned):
        if p:
            at[i] = pin
            pin += transfers[i].nbytes
    return ReceiveLayout(
        rank=rank,
        capacity=capacity,
        pinned_bytes=pin,
        transfers=tuple(transfers),
        unit=tuple(first),
        last_unit=tuple(last),
        pinned=tuple(pinned),
        at=tuple(at),
        order=tuple(order),
        needed=needed,
    )


def sender_layout(layout: ReceiveLayout, sender: int) -> ReceiveLayout:
    """``layout`` with only trainer rank ``sender``'s pieces (same places, capacity and
    ring): all that rank needs to cut its buckets to the engine rank (:func:`messages`)
    and hash where they land (:func:`link_digest`), without every other sender's."""
    keep = [i for i, t in enumerate(layout.transfers) if t.sender == sender]
    new_index = {i: n for n, i in enumerate(keep)}
    return replace(
        layout,
        transfers=tuple(layout.transfers[i] for i in keep),
        unit=tuple(layout.unit[i] for i in keep),
        last_unit=tuple(layout.last_unit[i] for i in keep),
        pinned=tuple(layout.pinned[i] for i in keep),
        at=tuple(layout.at[i] for i in keep),
        order=tuple(new_index[i] for i in layout.order if i in new_index),
    )


def quiet_receivers(summary: RefitSummary) -> tuple[int, ...]:
    """Engine ranks no piece lands on (they copy all they hold from others of their
    node): each still takes every update's header and trailer from trainer rank 0, which
    say what the update sends and whether the trainer's tensors stayed still."""
    return tuple(r for r, n in enumerate(summary.receiver_bytes) if not n)


def sender_share(plan: RefitPlan, sender: int, units: Mapping[int, Sequence[Unit]]) -> bytes:
    """What trainer rank ``sender`` keeps of the whole ``plan`` (``units``: per engine
    rank, its units in its loader's order): its buckets, and per engine rank it feeds,
    where its pieces land there (:func:`sender_layout`), pickled. Open it
    (:func:`open_share`) once the whole plan is dropped: its objects are then built in
    the memory the plan gave back. Kept as references into the plan, or copied while
    the plan lives, they would sit among the plan's freed objects (the walk builds
    every rank's pieces interleaved) and keep nearly all of its pages resident."""
    share = plan.only(sender=sender)
    fed = {b.receiver for b in share.buckets}
    if sender == 0:
        fed.update(quiet_receivers(plan.summary))
    layouts = {r: sender_layout(receive_layout(units[r], plan, r), sender) for r in sorted(fed)}
    return pickle.dumps((share, layouts), protocol=pickle.HIGHEST_PROTOCOL)


def open_share(blob: bytes) -> tuple[RefitPlan, dict[int, ReceiveLayout]]:
    """:func:`sender_share`'s share and layouts."""
    share, layouts = pickle.loads(blob)
    assert isinstance(share, RefitPlan) and isinstance(layouts, dict)
    return share, layouts


MIN_DIRECT_BYTES = 1 << 20
"""A run of a bucket's pieces lying side by side in the receive area is its own message
(received in place) from this size on; shorter runs are sent together (received into
the link's landing buffer and copied to their places): a message costs a round trip."""


def _adjacent(layout: ReceiveLayout, i: int, j: int) -> bool:
    """Whether transfer ``j`` lies right after transfer ``i`` in the receive area."""
    if layout.pinned[i] != layout.pinned[j]:
        return False
    end = layout.at[i] + layout.transfers[i].nbytes
    if layout.at[j] != end:
        return False
    return layout.pinned[i] or end % layout.capacity != 0


def messages(
    layout: ReceiveLayout, items: Sequence[int], min_direct: int | None = None
) -> tuple[tuple[int, int, bool], ...]:
    """How a bucket whose transfers are ``items`` (indices into ``layout.transfers``, in
    bucket order; a delta's unchanged ones left out) goes over its link: per message,
    ``(first, stop, direct)`` over positions in ``items``. A direct message's pieces lie
    side by side in the receive area, so it can be received in place; the others are
    runs shorter than ``min_direct`` (default :data:`MIN_DIRECT_BYTES`) sent together.
    Both ends compute it from the plan and the engine rank's units alone."""
    limit = MIN_DIRECT_BYTES if min_direct is None else min_direct
    runs: list[tuple[int, int]] = []
    for k, i in enumerate(items):
        if runs and _adjacent(layout, items[k - 1], i):
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    out: list[tuple[int, int, bool]] = []
    first, count, size = 0, 0, 0  # the open message of short runs
    for a, b in runs:
        n = sum(layout.transfers[i].nbytes for i in items[a:b])
        if n >= limit:
            if count:
                out.append((first, a, count == 1))
                count = 0
            out.append((a, b, True))
            continue
        if not count:
            first, size = a, 0
        count += 1
        size += n
        if size >= limit:
            out.append((first, b, count == 1))
            count = 0
    if count:
        out.append((first, len(items), count == 1))
    return tuple(out)


WIRE_FORMAT = 2
"""The version of how a link's bytes go over the wire (2: buckets cut by
:func:`messages`); both ends hash it into :func:`link_digest`."""


def link_digest(layout: ReceiveLayout, sender: int) -> int:
    """What both ends of link ``sender -> layout.rank`` check they agree on before a
    bucket moves: the wire format, the least size of a message of its own, and where the
    link's pieces land (the messages follow from these); 60 bits."""
    h = hashlib.sha256(f"{WIRE_FORMAT}|{MIN_DIRECT_BYTES}|{layout.capacity}".encode())
    for i, t in enumerate(layout.transfers):
        if t.sender == sender:
            h.update(f"|{layout.at[i]},{int(layout.pinned[i])}".encode())
    return int(h.hexdigest()[:15], 16)


def _send_key(b: Bucket) -> tuple[int, int, int, int]:
    return (b.position, b.receiver, b.unit, b.index)


def send_order(plan: RefitPlan, sender: int) -> tuple[Bucket, ...]:
    """Trainer rank ``sender``'s buckets in the order it sends them, one at a time on
    one thread: interleaved across its receivers by how far into each receiver's ring
    order the bucket's first unit comes (``Bucket.position``), so that the engine ranks
    it feeds progress together; each link's buckets stay in link order.

    Why no cycle of waits. A send returns once its receiver took the bucket, and a
    receiver takes a bucket once its ring has room for it (one thread per link, so a
    link waiting for room holds up no other link of that receiver). Every sender sends
    in the order of one key, ``(position, receiver, unit, index)``, the same total order
    of all buckets for every sender; for one receiver it orders buckets by ``unit``
    (``position`` grows with ``unit``), and a link's buckets already come in ``unit``
    order. Take the first bucket ``b`` of that order not yet landed (sender ``s``,
    receiver ``r``, first unit ``u``). Every bucket before it has landed, so ``s`` has
    nothing older left to send and is at ``b``. Every piece a unit of ``r`` before ``u``
    reads is in a bucket whose first unit is before ``u``, so before ``b``, so landed:
    ``r``'s loader reads those units and releases their ring bytes, and then ``b``
    fits (:class:`ReceiveLayout`'s window argument). So ``b`` lands, and by induction
    every bucket does, whatever the number of senders and receivers."""
    return tuple(sorted(plan.buckets_of(sender), key=_send_key))


def refit_plan(
    plan: Plan,
    manifest: TrainerManifest,
    *,
    convert_on: str = "receiver",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE,
    receiver_nodes: Sequence[int] | None = None,
    fanout: bool = True,
    fused: bool = True,
) -> RefitPlan:
    """The transfer plan of refitting ``plan``'s ranks from ``manifest``'s trainer.

    Engine rank ``r`` is on node ``receiver_nodes[r]`` (default ``r // devices_per_node``,
    as the driver packs ranks); trainer rank ``s`` on ``manifest.node_of(s)``: node
    numbers name the same machines on both sides (a colocated trainer shares them).
    InputError, one line naming the tensor and rank: a tensor the engine needs that the
    manifest lacks or shapes otherwise, a slice that is no rectangle of the ``[N, K]``
    view, a cut a sender cannot convert (``convert_on="sender"``). ``fanout``: ranks of
    one node holding the same buffer take it from the first of them once written
    (:class:`NodeCopy`; False: each rank receives all it holds). ``fused``: the
    engine's loaders convert on the fused CPU path (their staging schedule)."""
    walk = _Walk(
        plan, manifest, convert_on, bucket_bytes, devices_per_node, receiver_nodes, fanout, fused
    )
    with no_cycle_collection():
        walk.run(detail=True)
        buckets = walk.buckets()
    together = tuple(
        sorted(
            {
                tuple(sorted({p.tensor_name for p in unit.parts}))
                for rank in range(walk.world)
                for unit in plan.ranks[rank].units
            }
        )
    )
    summary = walk.summary()
    copies = tuple(sorted(walk.copies, key=lambda c: (c.source, c.receiver)))
    return RefitPlan(
        summary=summary,
        buckets=buckets,
        unit_tensors=together,
        tensors=tuple(sorted({t.tensor for b in buckets for t in b.transfers})),
        digest=plan_digest(summary, buckets, together, copies),
        copies=copies,
    )


def plan_digest(
    summary: RefitSummary,
    buckets: Sequence[Bucket],
    unit_tensors: Sequence[Sequence[str]],
    copies: Sequence[NodeCopy] = (),
) -> str:
    """Every bucket, transfer and node copy of a plan, what it was planned under and the
    scale rule a sender converts under, hashed: 60 bits as hex."""
    h = hashlib.sha256()
    s = summary
    h.update(f"{s.manifest_digest}|{s.convert_on}|{s.bucket_bytes}|{s.receiver_ring}".encode())
    if s.scale_alg:  # a sender and an engine under other scale rules hold other bytes
        h.update(f"|scale_alg {s.scale_alg}".encode())
    h.update(repr(tuple(tuple(u) for u in unit_tensors)).encode())
    for b in buckets:
        h.update(f"/{b.sender}>{b.receiver}#{b.index}".encode())
        for t in b.transfers:
            h.update(f"{t.tensor}{t.rows}{t.cols}{int(t.on_sender)};".encode())
    for c in copies:
        h.update(f"/copy {c.source}>{c.receiver}:{','.join(c.buffers)}".encode())
    return h.hexdigest()[:15]


def refit_summary(
    plan: Plan,
    manifest: TrainerManifest,
    *,
    convert_on: str = "receiver",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE,
    receiver_nodes: Sequence[int] | None = None,
    fanout: bool = True,
    fused: bool = True,
) -> RefitSummary:
    """:func:`refit_plan`'s summary alone, without building its pieces (a plan of a large
    model has millions of them): the same walk, the same checks and figures."""
    walk = _Walk(
        plan, manifest, convert_on, bucket_bytes, devices_per_node, receiver_nodes, fanout, fused
    )
    walk.run(detail=False)
    return walk.summary()


def needed_shapes(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Every tensor some rank of ``plan`` holds a part of, with the shape the config
    predicts for it (what a trainer holding the same model holds): the input of
    ``trainer.fsdp_manifest`` / ``megatron_manifest`` for a manifest on paper."""
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in range(len(plan.summaries) or len(plan.ranks)):
        for unit in plan.ranks[rank].units:
            for part in unit.parts:
                if not part.source_shape:
                    raise InputError(
                        f"the plan does not say the shape of tensor {part.tensor_name!r}",
                        tensor=part.tensor_name,
                    )
                shapes.setdefault(part.tensor_name, part.source_shape)
    return shapes


# --- the walk -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Held:
    """One trainer rank's rectangle of a tensor's ``[N, K]`` view."""

    rank: int
    node: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    origin: tuple[int, int] = field(init=False)
    """Where the rectangle starts: one tuple every piece of it shares
    (``Transfer.shard_origin``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "origin", (self.rows[0], self.cols[0]))


@dataclass(frozen=True)
class _Source:
    """A manifest tensor as the walk cuts parts by it."""

    tensor: TrainerTensor
    n: int
    k: int
    split: Literal["rows", "cols", "whole"]
    held: tuple[_Held, ...]
    """Sorted along the split."""
    starts: tuple[int, ...]


def _source(t: TrainerTensor, manifest: TrainerManifest) -> _Source:
    n, k = matrix_shape(t.shape)
    held: list[_Held] = []
    split: Literal["rows", "cols", "whole"] = "whole"
    for s in t.placement:
        if s.dim is None:
            held.append(_Held(s.rank, manifest.node_of(s.rank), (0, n), (0, k)))
        elif s.dim == 0 and len(t.shape) >= 2:
            split = "rows"
            held.append(_Held(s.rank, manifest.node_of(s.rank), (s.start, s.stop), (0, k)))
        elif math.prod(t.shape[1 : s.dim]) == 1:
            # A slice along dim d is a column range of [N, K] when every dim between
            # 0 and d is 1 wide (a 1-D tensor's dim 0, a matrix's dim 1).
            inner = math.prod(t.shape[s.dim + 1 :])
            split = "cols"
            held.append(
                _Held(s.rank, manifest.node_of(s.rank), (0, n), (s.start * inner, s.stop * inner))
            )
        else:
            raise InputError(
                f"trainer manifest: tensor {t.name!r}: rank {s.rank}'s slice along dim "
                f"{s.dim} of {list(t.shape)} is no column range of its [N, K] view; a refit "
                "takes slices along dim 0 or dim 1"
            )
    if split == "rows":
        held.sort(key=lambda h: h.rows)
        starts = tuple(h.rows[0] for h in held)
    elif split == "cols":
        held.sort(key=lambda h: h.cols)
        starts = tuple(h.cols[0] for h in held)
    else:
        starts = ()
    return _Source(t, n, k, split, tuple(held), starts)


class _Streams:
    """The buckets of every (sender, landing receiver) stream, filled greedily in the
    order pieces come: sizes are tracked, not kept (largest, count), which is all the
    senders' staging needs.

    A bucket is also closed before it would touch units spanning more than
    ``window`` bytes of its receiver's ring (``prefix``: the receiver's ring bytes
    before each unit, set while its units are walked); the widest span a bucket
    touches is kept per receiver (its ring's capacity, :func:`receive_layout`)."""

    def __init__(self, senders: int, receivers: int, bucket_bytes: int) -> None:
        n = senders * receivers
        self.receivers = receivers
        self.cap = bucket_bytes
        self.fill = [0] * n
        self.single = [0] * n
        self.count = [0] * n
        self.lo = [0] * n
        """The first unit the open bucket touches."""
        self.span = [0] * n
        """Ring bytes of the units the open bucket touches."""
        self.widest = [0] * receivers
        self.prefix: Sequence[int] = (0,)
        self.window = bucket_bytes

    def add(self, key: int, nbytes: int, unit: int = 0) -> bool:
        """Put ``nbytes`` of ``unit`` into stream ``key``'s open bucket; True when a
        bucket closed first (it would have grown past the cap, or its units past the
        receive window)."""
        f = self.fill[key]
        p = self.prefix
        closed = False
        if f:
            span = p[unit + 1] - p[self.lo[key]]
            if f + nbytes > self.cap or span > self.window:
                self.close(key)
                f = 0
                closed = True
        if not f:
            self.lo[key] = unit
            span = p[unit + 1] - p[unit]
        self.span[key] = span
        self.fill[key] = f + nbytes
        return closed

    def close(self, key: int) -> None:
        f = self.fill[key]
        if not f:
            return
        self.single[key] = max(self.single[key], f)
        self.count[key] += 1
        self.fill[key] = 0
        r = key % self.receivers
        self.widest[r] = max(self.widest[r], self.span[key])

    def per_sender(self, sender: int) -> tuple[int, int]:
        """(buckets, largest bucket) of ``sender``."""
        count = largest = 0
        for r in range(self.receivers):
            key = sender * self.receivers + r
            self.close(key)
            count += self.count[key]
            largest = max(largest, self.single[key])
        return count, largest


MAX_PIECES = 30_000_000
"""Most pieces a refit plan cuts: ten times Qwen3-235B-A22B's from FSDP over 64 to tp 8 x
dp 8 + EP (2.7 million), about a minute of counting here, and gigabytes in every rank
that builds it (Qwen3.8-27B at tp 8 x dp 8 passes from FSDP over 1024 and stops from
2048; FSDP over 65536 ran for many minutes, every row its own slice)."""


class _Walk:
    """Every receiver's parts, node by node, cut by the trainer's slices: pieces counted
    (and kept when ``detail``), bucketed per (sender, landing receiver)."""

    def __init__(
        self,
        plan: Plan,
        manifest: TrainerManifest,
        convert_on: str,
        bucket_bytes: int,
        devices_per_node: int,
        receiver_nodes: Sequence[int] | None,
        fanout: bool = True,
        fused: bool = True,
    ) -> None:
        self.fans_out = fanout
        self.fused = fused
        if convert_on not in CONVERT_ON:
            raise InputError(f"convert_on {convert_on!r} is not one of {', '.join(CONVERT_ON)}")
        if bucket_bytes < 1:
            raise InputError(f"bucket bytes {bucket_bytes} must be at least 1", key="bucket_bytes")
        if devices_per_node < 1:
            raise InputError(f"devices per node {devices_per_node} must be at least 1")
        self.plan = plan
        self.model_dtype = str(plan.model.get("dtype", "bf16"))
        self.manifest = manifest
        self.on_sender = convert_on == "sender"
        self.convert_on: ConvertOn = "sender" if self.on_sender else "receiver"
        self.bucket_bytes = bucket_bytes
        world = len(plan.summaries) or len(plan.ranks)
        if receiver_nodes is None:
            self.rnode = tuple(r // devices_per_node for r in range(world))
        else:
            if len(receiver_nodes) != world:
                raise InputError(
                    f"receiver nodes name {len(receiver_nodes)} ranks, the plan has {world}"
                )
            self.rnode = tuple(receiver_nodes)
        self.world = world
        self.nodes = max(self.rnode, default=-1) + 1
        self.order = sorted(range(world), key=lambda r: (self.rnode[r], r))
        # Tensors sharing a placement (and shape) share its rectangles.
        shared: dict[tuple[int, tuple[int, ...]], _Source] = {}
        self.sources: dict[str, _Source] = {}
        for t in manifest.tensors:
            like = shared.get((id(t.placement), t.shape))
            if like is None:
                like = shared[(id(t.placement), t.shape)] = _source(t, manifest)
            self.sources[t.name] = replace(like, tensor=t)
        self.used: set[str] = set()
        # bytes from each trainer rank to each engine node
        self.to_node = [[0] * self.nodes for _ in range(manifest.world)]
        self.needed = self.wire = self.mx_needed = self.mx_wire = 0
        self.fanout = [0] * self.nodes
        self.copies: list[NodeCopy] = []
        self.copied: list[set[int]] = [set() for _ in range(world)]
        """Per receiver, the units it copies (its loader skips them)."""
        self.receiver_bytes = [0] * world
        self.unit_wires: list[list[int]] = [[] for _ in range(world)]
        """Per receiver, per unit, the wire bytes it reads."""
        self.receiver_pinned = [0] * world
        self.piece_max = [0] * world
        """Per receiver, its largest piece in the ring."""
        self.ring_prefix: list[list[int]] = [[0] for _ in range(world)]
        """Per receiver, its ring bytes before each of its units."""
        self.receiver_mx = [0] * world
        self.sender_convert = [0] * manifest.world
        self.streams = _Streams(manifest.world, world, bucket_bytes)
        self.count = 0
        self.detail = False
        # detail: per stream, its closed buckets' records and the open one's
        self.open: dict[int, list[list[object]]] = {}
        self.done: dict[int, list[list[list[object]]]] = {}

    def run(self, *, detail: bool) -> None:
        self.detail = detail
        # Per node, the buffers landed on one of its ranks: what makes two equal, and
        # the rank.
        landed: dict[int, dict[object, int]] = {}
        for rank in self.order:
            node = self.rnode[rank]
            units = self.plan.ranks[rank].units
            copied = self._copies(rank, landed.setdefault(node, {})) if self.fans_out else set()
            self.copied[rank] = copied
            # Parts already landed on this rank (a tied embedding: two units read them).
            seen: dict[tuple[str, tuple[int, int], tuple[int, int]], None] = {}
            ring, pinned = self._ring_bytes(units, rank, copied)
            prefix = [0]
            for b in ring:
                prefix.append(prefix[-1] + b)
            self.streams.prefix = prefix
            self.ring_prefix[rank] = prefix
            self.streams.window = max(self.bucket_bytes, max(ring, default=0))
            wires = []
            for i, unit in enumerate(units):
                mx = unit.layout in MX_LAYOUTS
                unit_wire = 0
                for part in unit.parts:
                    src = self._check(part, unit, rank)
                    wire = self._wire(part.nrows, part.ncols, src, mx)
                    # what the rank's loader would read: its staging schedule covers
                    # every unit, copied or not
                    unit_wire += wire
                    key = (part.tensor_name, part.rows, part.cols)
                    if i in copied or key in seen:
                        continue
                    if mx:
                        self.receiver_mx[rank] += wire
                    # The slices cover each tensor once (the manifest is checked so):
                    # the pieces of a part add up to it.
                    source = part.nrows * part.ncols * src.tensor.itemsize
                    self.needed += source
                    self.wire += wire
                    if mx:
                        self.mx_needed += source
                        self.mx_wire += wire
                    self.receiver_bytes[rank] += wire
                    seen[key] = None
                    self._cut(part, src, mx, rank, node, i, key in pinned)
                wires.append(unit_wire)
            self.unit_wires[rank] = wires

    def _copies(self, rank: int, landed: dict[object, int]) -> set[int]:
        """The units of ``rank`` whose buffers an earlier rank of its node lands
        (``landed``: per buffer's likeness, that rank; ``rank``'s own buffers are added),
        recorded as :class:`NodeCopy`. Two buffers are alike when their specs and every
        unit writing them are equal: the same pieces, converted under the same rule,
        make the same bytes. A unit that derives other buffers is never copied."""
        rp = self.plan.ranks[rank]
        specs = {b.name: b for b in rp.buffers}
        writers: dict[str, list[int]] = {}
        for i, unit in enumerate(rp.units):
            writers.setdefault(unit.buffer, []).append(i)
        taken: dict[int, list[str]] = {}
        copied: set[int] = set()
        for name, idx in writers.items():
            group = tuple(rp.units[i] for i in idx)
            if any(u.derived for u in group):
                continue
            like = (specs.get(name), specs.get(name + "_scale"), rp.scale_alg, group)
            source = landed.setdefault(like, rank)
            if source != rank:
                taken.setdefault(source, []).append(name)
                copied.update(idx)
        for source, names in taken.items():
            nbytes = sum(
                b.nbytes for n in names for b in (specs.get(n), specs.get(n + "_scale")) if b
            )
            units = tuple(sorted(i for n in names for i in writers[n]))
            self.copies.append(NodeCopy(source, rank, tuple(names), units, nbytes))
            self.fanout[self.rnode[rank]] += nbytes
        return copied

    def _ring_bytes(
        self, units: Sequence[Unit], rank: int, copied: Collection[int]
    ) -> tuple[list[int], set[tuple[str, tuple[int, int], tuple[int, int]]]]:
        """Per unit of ``rank``, the wire bytes of the pieces landing on it that go
        through its ring (read by this unit alone), and the parts more than one of its
        units reads (a tied embedding: held in the pinned region, whose bytes are
        recorded). ``copied``: units whose buffers the rank copies (nothing lands)."""
        first: dict[tuple[str, tuple[int, int], tuple[int, int]], int] = {}
        wire_of: dict[tuple[str, tuple[int, int], tuple[int, int]], int] = {}
        multi: set[tuple[str, tuple[int, int], tuple[int, int]]] = set()
        for i, unit in enumerate(units):
            if i in copied:
                continue
            mx = unit.layout in MX_LAYOUTS
            for part in unit.parts:
                key = (part.tensor_name, part.rows, part.cols)
                j = first.get(key)
                if j is None:
                    first[key] = i
                    src = self._check(part, unit, rank)
                    wire_of[key] = self._wire(part.nrows, part.ncols, src, mx)
                elif j != i:
                    multi.add(key)
        ring = [0] * len(units)
        for key, i in first.items():
            if key not in multi:
                ring[i] += wire_of[key]
        self.receiver_pinned[rank] = sum(wire_of[k] for k in multi)
        return ring, multi

    def _check(self, part: Part, unit: Unit, rank: int) -> _Source:
        name = part.tensor_name
        src = self.sources.get(name)
        if src is None:
            raise InputError(
                f"trainer manifest: tensor {name!r} (for {unit.buffer} on engine rank {rank}) "
                "is not in the manifest",
                tensor=name,
                rank=rank,
            )
        want = tuple(part.source_shape)
        if (want and want != src.tensor.shape) or part.rows[1] > src.n or part.cols[1] > src.k:
            raise InputError(
                f"trainer manifest: tensor {name!r} has shape {list(src.tensor.shape)}, "
                f"engine rank {rank} needs rows {list(part.rows)} x cols {list(part.cols)} of "
                f"{list(part.source_shape) or '?'}",
                tensor=name,
                rank=rank,
            )
        self.used.add(name)
        return src

    def _wire(self, rows: int, cols: int, src: _Source, mx: bool) -> int:
        if mx and self.on_sender:
            return rows * (cols + -(-cols // MX_GROUP))
        return rows * cols * src.tensor.itemsize

    def _cut(
        self, part: Part, src: _Source, mx: bool, rank: int, node: int, unit: int, pinned: bool
    ) -> None:
        """The pieces of a part (of ``rank``'s unit ``unit``, on ``node``): counted on
        their links and in their senders' buckets (and kept, in detail). ``pinned``:
        they land in the rank's pinned region, not its ring."""
        if self.count > MAX_PIECES:
            raise InputError(
                f"the refit cuts more than {MAX_PIECES:,} pieces (trainer slices x engine "
                f"parts; at engine rank {rank}, tensor {part.tensor_name!r}), more than a "
                "rank can plan (each builds the plan): send each tensor from fewer trainer "
                "ranks (FSDP's shard group, as HSDP does) or in larger buckets",
                tensor=part.tensor_name,
                rank=rank,
            )
        (r0, r1), (c0, c1) = part.rows, part.cols
        if src.split == "whole":
            near = [h for h in src.held if h.node == node]
            pool = near or list(src.held)
            held: Sequence[_Held] = [pool[node % len(pool)]]
        else:
            lo, hi = (r0, r1) if src.split == "rows" else (c0, c1)
            first = max(0, bisect.bisect_right(src.starts, lo) - 1)
            last = bisect.bisect_left(src.starts, hi)
            held = src.held[first:last]
        check = mx and self.on_sender
        cap = self.bucket_bytes
        add = self.streams.add
        to_node = self.to_node
        detail = self.detail
        world = self.world
        width = row_wire = 0
        for h in held:
            a, b = h.rows
            x, y = h.cols
            a = r0 if r0 > a else a
            b = r1 if r1 < b else b
            x = c0 if c0 > x else x
            y = c1 if c1 < y else y
            if a >= b or x >= y:
                continue
            if check and ((x - c0) % MX_GROUP or ((y - c0) % MX_GROUP and y != c1)):
                raise InputError(
                    f"trainer manifest: tensor {part.tensor_name!r}: trainer rank {h.rank} "
                    f"holds cols {list(h.cols)}, which cuts an MX group of engine rank "
                    f"{rank}'s cols {list(part.cols)} (K groups of {MX_GROUP} from {c0}): "
                    "a sender cannot convert it; convert on the receiver or cut at a group",
                    tensor=part.tensor_name,
                    rank=rank,
                )
            if y - x != width:
                width = y - x
                row_wire = self._wire(1, width, src, mx)
            wire = (b - a) * row_wire
            to_node[h.rank][node] += wire
            if check:
                self.sender_convert[h.rank] += (b - a) * (y - x) * src.tensor.itemsize
            key = h.rank * world + rank
            if wire <= cap and not detail:
                add(key, wire, unit)
                self.count += 1
                if not pinned and wire > self.piece_max[rank]:
                    self.piece_max[rank] = wire
                continue
            per = cap // row_wire
            if per < 1:
                raise InputError(
                    f"bucket bytes {cap} are below one row of tensor {part.tensor_name!r} "
                    f"on the wire ({row_wire} bytes, for engine rank {rank})",
                    tensor=part.tensor_name,
                    rank=rank,
                    key="bucket_bytes",
                )
            for i in range(a, b, per):
                j = min(b, i + per)
                nbytes = (j - i) * row_wire
                closed = add(key, nbytes, unit)
                self.count += 1
                if not pinned and nbytes > self.piece_max[rank]:
                    self.piece_max[rank] = nbytes
                if detail:
                    if closed:
                        self.done.setdefault(key, []).append(self.open.pop(key))
                    source = (j - i) * (y - x) * src.tensor.itemsize
                    # the part's own tuples where the piece is all of it (millions of
                    # pieces in a large refit, most of them a whole part's rows or cols)
                    rows = part.rows if (i, j) == part.rows else (i, j)
                    cols = part.cols if (x, y) == part.cols else (x, y)
                    rec: list[object] = [
                        h,
                        rank,
                        part.tensor_name,
                        rows,
                        cols,
                        nbytes,
                        source,
                        mx,
                        unit,
                    ]
                    self.open.setdefault(key, []).append(rec)

    def _loader_staging(self) -> list[int]:
        """Per receiver, the peak staging its loader's schedule holds
        (``memory.schedule``, as the rank loader runs it): the rank's units read from
        the wire checkpoint (BF16, or MXFP8 where the sender converted) under the budget
        a refit runs with, the largest whole unit of any rank, a unit's bytes read
        ahead while the one before is written where the budget leaves room. The units a
        rank copies from another of its node are not read: left out."""
        quant = "mxfp8" if self.on_sender else "none"
        opts = ConvertOptions.for_source(self.model_dtype, quant, 1, fused=self.fused)
        # Ranks of one geometry (every EP rank of a MoE, each data-parallel replica) have
        # one schedule: with proportional reads it depends on the units' shapes, layouts
        # and bytes alone, so each is worked out once (64 ranks of Qwen3-235B: 9 shapes).
        classes: dict[tuple[object, ...], tuple[list[Unit], Any]] = {}
        of_rank = []
        for rank in range(self.world):
            q = self.on_sender
            skip = self.copied[rank]
            # plan.ranks builds a rank's plan on each access: once per rank here
            all_units = self.plan.ranks[rank].units
            read = [i for i in range(len(all_units)) if i not in skip]
            wires = [self.unit_wires[rank][i] for i in read]
            key = (
                tuple((u.rows, u.cols, u.layout, q and u.layout in MX_LAYOUTS)
                      for u in (all_units[i] for i in read)),
                tuple(wires),
            )  # fmt: skip
            if key not in classes:
                units = [
                    replace(u, quantized=q and u.layout in MX_LAYOUTS)
                    for u in (all_units[i] for i in read)
                ]
                classes[key] = (units, proportional_read_fn(units, wires))
            of_rank.append(key)
        budget = max((reload_min_budget(u, fn, opts) for u, fn in classes.values()), default=0)
        staging = {
            key: schedule(u, fn, opts, budget, whole_units=True)[1].staging_bytes if u else 0
            for key, (u, fn) in classes.items()
        }
        return [staging[key] for key in of_rank]

    # -- results ------------------------------------------------------------------------

    def summary(self) -> RefitSummary:
        staging = [0] * self.manifest.world
        counts = [0] * self.manifest.world
        for s in range(self.manifest.world):
            counts[s], largest = self.streams.per_sender(s)
            # wire.pack: one buffer; a conversion's row chunks take at most half of it
            staging[s] = largest + (largest // 2 if self.sender_convert[s] else 0)
        # Every bucket is closed now (per_sender): each link's largest is known.
        senders, streams = self.manifest.world, self.streams
        scratch = [
            sum(streams.single[s * self.world + r] for s in range(senders))
            for r in range(self.world)
        ]
        # A ring holds the widest span of units one bucket touches plus one piece of
        # padding where a piece would wrap (receive_layout).
        ring = [
            self.streams.widest[r] + self.piece_max[r] if self.piece_max[r] else 0
            for r in range(self.world)
        ]
        links: dict[tuple[int, int], int] = {}
        for s, row in enumerate(self.to_node):
            for node, nbytes in enumerate(row):
                if nbytes:
                    key = (self.manifest.node_of(s), node)
                    links[key] = links.get(key, 0) + nbytes
        return RefitSummary(
            convert_on=self.convert_on,
            bucket_bytes=self.bucket_bytes,
            manifest_digest=self.manifest.digest(),
            links=tuple(Link(s, r, n) for (s, r), n in sorted(links.items())),
            needed_bytes=self.needed,
            wire_bytes=self.wire,
            mx_needed_bytes=self.mx_needed,
            mx_wire_bytes=self.mx_wire,
            fanout_bytes=tuple(self.fanout),
            receiver_nodes=self.rnode,
            receiver_bytes=tuple(self.receiver_bytes),
            receiver_staging=tuple(
                loader + ring[r] + self.receiver_pinned[r] + scratch[r]
                for r, loader in enumerate(self._loader_staging())
            ),
            sender_bytes=tuple(sum(row) for row in self.to_node),
            sender_staging=tuple(staging),
            sender_buckets=tuple(counts),
            sender_convert_bytes=tuple(self.sender_convert),
            receiver_mx_bytes=tuple(self.receiver_mx),
            transfers=self.count,
            unused_tensors=tuple(sorted(set(self.sources) - self.used)),
            receiver_ring=tuple(ring),
            receiver_pinned=tuple(self.receiver_pinned),
            receiver_scratch=tuple(scratch),
            scale_alg=self.plan.scale_alg if self.convert_on == "sender" else 0,
        )

    def buckets(self) -> tuple[Bucket, ...]:
        """Every bucket, its records turned into transfers and dropped as it goes (a
        large refit has millions: both at once would double the peak)."""
        for key, recs in self.open.items():
            self.done.setdefault(key, []).append(recs)
        self.open = {}
        out: list[Bucket] = []
        on_sender = self.on_sender
        for sender in range(self.manifest.world):
            index = 0
            for rank in self.order:
                prefix = self.ring_prefix[rank]
                total = max(1, prefix[-1])
                for recs in self.done.pop(sender * self.world + rank, []):
                    transfers = tuple(_transfer(cast(list[Any], r), on_sender) for r in recs)
                    unit = min(cast(int, r[8]) for r in recs)
                    position = prefix[unit] * POSITION_SCALE // total
                    out.append(Bucket(sender, rank, index, transfers, unit, position))
                    index += 1
        return tuple(out)


def _transfer(rec: list[Any], on_sender: bool) -> Transfer:
    h, receiver, tensor, rows, cols, wire, source, mx, _unit = rec
    return Transfer(
        sender=h.rank,
        receiver=receiver,
        tensor=tensor,
        rows=rows,
        cols=cols,
        shard_origin=h.origin,
        nbytes=wire,
        source_bytes=source,
        mx=mx,
        on_sender=mx and on_sender,
    )
