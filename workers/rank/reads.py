"""The read stage of the rank loader: a unit's (or a step's) byte ranges into staging.

A read has two phases. Phase 1 takes the staging pool leases, one per file
(:meth:`Reader.take_leases`); phase 2 fills them (:meth:`Reader.fill`), from storage or,
for a unit another rank read and published, from that rank's bytes. A read-ahead takes
its leases on the converting thread *before* the current unit converts, so the staging
peak is what the schedule predicts however the threads interleave, and fills them later
on either thread. Every lease is released on error.

Reads kept going beside the caller are one :class:`InFlight` with a depth: a load's steps
read ahead of the conversion, and an owner's shared units fetched for its peers.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ...orchestrator.errors import StorageError
from ...orchestrator.plan.message import PeerUnit, SourceInfo
from ...orchestrator.plan.ranges import ByteRange
from ...orchestrator.plan.types import Unit, UnitReads
from .staging import Lease, StagingPool

PartBytes = tuple[torch.Tensor, "torch.Tensor | None"]
"""One part's (weight bytes, scale bytes) as read: flat uint8 views into a lease."""

Leased = list[tuple[str, list[tuple[int, str, ByteRange]], Lease]]
"""A read's pool leases, one per file, with the (part, weight-or-scale, range) items each
lease holds in order."""


@dataclass
class StepRead:
    """How one step's units are read (:meth:`Reader.step_read`): groups of (unit named in
    errors, reads, peer, label), and each member unit's number of parts."""

    groups: list[tuple[Unit, UnitReads, PeerUnit | None, str]]
    counts: list[int]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for _, r, _, _ in self.groups)

    @property
    def from_peer(self) -> bool:
        return any(p is not None for _, _, p, _ in self.groups)


Filled = tuple[list[Lease], list[PartBytes], int]
"""A unit's read: its leases, per-part byte views, and bytes fetched from storage."""
StepFilled = tuple[list[Lease], list[list[PartBytes]], int]
"""A step's read: its leases, each unit's per-part byte views, and bytes fetched."""


Got = tuple[list[Lease], Any, int]
"""What a fill returns: a :data:`Filled` or a :data:`StepFilled`."""

K = TypeVar("K")
T = TypeVar("T")


GATHER_SCRATCH_BYTES = 1 << 20
"""Scratch (outside the staging pool) for cutting whole rows to their columns."""


def keep_columns(rows: torch.Tensor, window: tuple[int, int, int]) -> torch.Tensor:
    """Whole rows (flat uint8) cut in place to ``width`` bytes at ``offset`` of each row
    (``window`` = (row bytes, offset, width)): the columns are packed at the front, row
    after row, and returned as a view. Blocks of rows go through at most
    :data:`GATHER_SCRATCH_BYTES` of scratch; a block's destination ends before the next
    block's rows begin, so nothing is overwritten before it is read."""
    row, offset, width = window
    nrows = rows.numel() // row
    flat = rows.numpy()
    per = max(1, GATHER_SCRATCH_BYTES // max(width, 1))
    for r0 in range(0, nrows, per):
        r1 = min(nrows, r0 + per)
        block = flat[r0 * row : r1 * row].reshape(r1 - r0, row)[:, offset : offset + width].copy()
        flat[r0 * width : r1 * width] = block.reshape(-1)
    return rows[: nrows * width]


def release_all(pool: StagingPool, taken: Sequence[Leased]) -> None:
    for leased in taken:
        for _, _, lease in leased:
            pool.release(lease)


class Reader:
    """Reads for one rank: keeps one storage connection per checkpoint location and
    counts what it fetches through ``count`` (RunStats field deltas)."""

    def __init__(
        self,
        rank: int,
        count: Callable[..., None],
        storage_factory: Callable[..., Any] | None = None,
    ) -> None:
        self.rank = rank
        self._count = count
        self._storage_factory = storage_factory
        self._storages: dict[tuple[str, str], Any] = {}
        self._last: tuple[SourceInfo, Any] | None = None
        self.peer_get: Callable[[Any], Any] | None = None
        """How a shared unit's published bytes are fetched, during a run that has some."""
        self.lost_owners: set[int] = set()
        """Ranks whose published bytes could not be had in this run (their process died,
        and every object it published with it): their other units are read from storage
        at once, without asking Ray for each (about a second apiece)."""
        self.given: Any = None
        """The storage of the running run when its host gave one (a refit's receive area,
        ``mxload.workers.transfer.wire.AreaStorage``); None: made from the source."""

    def storage(self, source: SourceInfo) -> Any:
        """The storage of ``source``'s location (made once per location and options)."""
        if self.given is not None:
            return self.given
        last = self._last
        if last is not None and last[0] is source:  # every unit of a run: no key to build
            return last[1]
        key = (source.root, json.dumps(source.storage_options or {}, sort_keys=True))
        st = self._storages.get(key)
        if st is None:
            if self._storage_factory is not None:
                st = self._storage_factory(source.root, source.storage_options)
            else:
                from ..storage import Storage

                st = Storage(source.root, source.storage_options)
            self._storages[key] = st
        self._last = (source, st)
        return st

    # -- one unit ---------------------------------------------------------------------------

    def take_leases(self, unit: Unit, reads: UnitReads, pool: StagingPool) -> Leased:
        """Phase 1 of a read: the pool leases, one per file."""
        by_file: dict[str, list[tuple[int, str, ByteRange]]] = {}
        # Weights first, scales after: an MX weight's bytes are rows x K with K a multiple
        # of 32, so every payload in a lease starts 8-byte aligned and the conversion
        # kernel reads it in place (a scale between two payloads would force a copy).
        for i, pr in enumerate(reads.parts):
            by_file.setdefault(pr.file, []).append((i, "w", pr.weight))
        for i, pr in enumerate(reads.parts):
            if pr.scale is not None:
                by_file.setdefault(pr.scale_file or pr.file, []).append((i, "s", pr.scale))
        taken: Leased = []
        try:
            for file, items in by_file.items():
                total = sum(r.nbytes for _, _, r in items)
                taken.append((file, items, pool.take(total, tag=f"read {unit.buffer} {file}")))
        except BaseException:
            release_all(pool, [taken])
            raise
        return taken

    def read(self, unit: Unit, reads: UnitReads, source: SourceInfo, pool: StagingPool) -> Filled:
        """Both phases of a unit's read, on this thread."""
        return self.fill(unit, reads, source, pool, self.take_leases(unit, reads, pool))

    def fill(
        self,
        unit: Unit,
        reads: UnitReads,
        source: SourceInfo,
        pool: StagingPool,
        taken: Leased,
        peer: PeerUnit | None = None,
        *,
        label: str = "",
        keep_rows: bool = False,
    ) -> Filled:
        """Phase 2 of a read: fetch the bytes into the leases (releases them on error).
        ``label`` names what is read in errors (default: the unit's buffer).

        A shared unit (``peer``) is copied from the bytes its owner published instead;
        the bytes it returns as fetched are what the owner requested from storage, so
        ``bytes_read`` means the same with and without sharing. A part read as whole rows
        (``PartRead.weight_window``) is cut to its columns in place, unless
        ``keep_rows`` (bytes fetched to be published for other ranks)."""
        try:
            fetched = self._fetch(unit, source, taken, peer, label or unit.buffer)
            views: dict[tuple[int, str], torch.Tensor] = {}
            for _, items, lease in taken:
                # one split for the lease's parts (a slice each costs a torch call apiece)
                pieces = lease.tensor.split_with_sizes([r.nbytes for _, _, r in items])
                for (i, kind, _), piece in zip(items, pieces, strict=True):
                    pr = reads.parts[i]
                    window = pr.weight_window if kind == "w" else pr.scale_window
                    if window[0] and not keep_rows:
                        piece = keep_columns(piece, window)
                    views[(i, kind)] = piece
        except BaseException:
            release_all(pool, [taken])
            raise
        parts = [(views[(i, "w")], views.get((i, "s"))) for i in range(len(reads.parts))]
        return [lease for _, _, lease in taken], parts, fetched

    def _fetch(
        self, unit: Unit, source: SourceInfo, taken: Leased, peer: PeerUnit | None, label: str
    ) -> int:
        """The bytes of ``taken`` from the peer that published them or from storage;
        returns the bytes fetched from storage (by this rank or the peer)."""
        if peer is not None and self._from_peer(peer, taken):
            if peer.owner != self.rank:
                self._count(bytes_from_peers=sum(lease.nbytes for _, _, lease in taken))
            return peer.fetch_bytes
        if peer is not None:
            self._count(peer_fallbacks=1)
        storage = self.storage(source)
        fetched = 0
        for file, items, lease in taken:
            if not lease.nbytes:
                continue
            try:
                ranges = [r for _, _, r in items]
                n = storage.read_ranges_into(file, ranges, lease.tensor.numpy().data)
            except StorageError as err:
                first = items[0][2]
                raise StorageError(
                    f"rank {self.rank}: reading {label} from {file} ({first.describe()}...): {err}",
                    rank=self.rank,
                    tensor=unit.buffer,
                    file=file,
                    byte_range=first.describe(),
                ) from err
            fetched += n
            self._count(bytes_from_storage=n)
        return fetched

    def _from_peer(self, peer: PeerUnit, taken: Leased) -> bool:
        """Copy a shared unit's published bytes into its leases. False (nothing counted)
        when they cannot be had, e.g. their owner's process died: the caller then reads
        storage, which stays the source of truth."""
        if self.peer_get is None or [f for f, _, _ in taken] != [f for f, _ in peer.handles]:
            return False
        if peer.owner in self.lost_owners:
            return False
        try:
            for (_, _, lease), (_, handle) in zip(taken, peer.handles, strict=True):
                if lease.nbytes:
                    lease.tensor.numpy()[...] = self.peer_get(handle)
        except Exception:
            self.lost_owners.add(peer.owner)
            return False
        return True

    # -- one step ---------------------------------------------------------------------------

    @staticmethod
    def step_read(
        members: Sequence[int],
        units: Sequence[Unit],
        reads: Sequence[UnitReads],
        peers: Mapping[int, PeerUnit],
        *,
        merge: bool,
    ) -> StepRead:
        """How the units ``members`` of one step are read: all together (one lease and
        one storage call per file) when ``merge``, or unit by unit: when the storage
        would coalesce across units (remote: the plan predicts requests per unit) or one
        of them comes from a peer (its bytes are published per unit)."""
        counts = [len(reads[i].parts) for i in members]
        if merge and len(members) > 1 and not any(i in peers for i in members):
            merged = UnitReads(parts=tuple(p for i in members for p in reads[i].parts))
            label = f"{units[members[0]].buffer} and {len(members) - 1} more units"
            return StepRead([(units[members[0]], merged, None, label)], counts)
        return StepRead(
            [(units[i], reads[i], peers.get(i), units[i].buffer) for i in members], counts
        )

    def read_step(self, step: StepRead, source: SourceInfo, pool: StagingPool) -> StepFilled:
        """A step's read, both phases on one thread."""
        return self.fill_step(step, source, pool, self.take_step(step, pool))

    def take_step(self, step: StepRead, pool: StagingPool) -> list[Leased]:
        """Phase 1 of a step's read (see :meth:`take_leases`)."""
        taken: list[Leased] = []
        try:
            for unit, reads, _, _ in step.groups:
                taken.append(self.take_leases(unit, reads, pool))
        except BaseException:
            release_all(pool, taken)
            raise
        return taken

    def fill_step(
        self, step: StepRead, source: SourceInfo, pool: StagingPool, taken: list[Leased]
    ) -> StepFilled:
        """Phase 2 of a step's read. Every lease is released on error."""
        leases: list[Lease] = []
        parts: list[PartBytes] = []
        fetched = 0
        done = 0
        try:
            for (unit, reads, peer, label), t in zip(step.groups, taken, strict=True):
                got, views, n = self.fill(unit, reads, source, pool, t, peer, label=label)
                done += 1
                leases += got
                parts += views
                fetched += n
        except BaseException:
            for lease in leases:
                pool.release(lease)
            release_all(pool, taken[done + 1 :])  # the failed group released its own
            raise
        out = []
        at = 0
        for n in step.counts:
            out.append(parts[at : at + n])
            at += n
        return leases, out, fetched


class InFlight(Generic[K]):
    """Reads kept in flight beside the caller: filled on up to ``depth`` reader threads,
    collected in the order they were issued, each under the caller's ``key``.

    A load's steps read ahead of the conversion (depth: the schedule's
    ``ConvertOptions.read_ahead``) and an owner fetching shared units for its peers
    (depth: as many requests as ``Storage`` keeps going) both keep their reads here. The
    caller takes a read's leases on its own thread before issuing it (the staging the
    schedule counts); :meth:`close` waits for every read not collected and releases its
    leases, so nothing is left leased or running after a failure."""

    def __init__(self, pool: StagingPool, depth: int, name: str) -> None:
        self.depth = max(1, depth)
        self._pool = pool
        self._queue: deque[tuple[K, Future[Got]]] = deque()
        self._executor = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix=name)

    def __enter__(self) -> InFlight[K]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def first(self) -> K | None:
        """The key of the read :meth:`collect` returns next (None: none in flight)."""
        return self._queue[0][0] if self._queue else None

    @property
    def last(self) -> K | None:
        """The key of the read issued last (None: none in flight)."""
        return self._queue[-1][0] if self._queue else None

    def issue(self, key: K, fill: Callable[..., Got], *args: Any, inline: bool = False) -> None:
        """Fill a read with ``fill(*args)`` on a reader thread, or now on this thread
        (``inline``: a read too small to be worth the handoff); a failure surfaces when
        it is collected."""
        fut = _done(fill, *args) if inline else self._executor.submit(fill, *args)
        self._queue.append((key, fut))

    def now(self, fill: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """A read needed at once, outside the queue: on a reader thread (waited for) or,
        ``inline``, on this thread."""
        return fill(*args) if inline else self._executor.submit(fill, *args).result()

    def collect(self) -> tuple[K, Got]:
        """The oldest read's key and what its fill returned (or raised: a failed fill
        released its own leases)."""
        key, fut = self._queue.popleft()
        return key, fut.result()

    def close(self) -> None:
        """Wait for the reads not collected, release their leases, stop the threads."""
        try:
            while self._queue:
                _, fut = self._queue.popleft()
                try:
                    leases = fut.result()[0]
                except BaseException:  # it released its own; the caller's error stands
                    continue
                for lease in leases:
                    self._pool.release(lease)
        finally:
            self._executor.shutdown(wait=True)


def _done(fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` run now, on this thread, as a finished future: a failure surfaces
    when it is collected, as it would from a reader thread."""
    fut: Future[T] = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # handed to whoever collects it
        fut.set_exception(exc)
    return fut
