"""The rank loader: one device's share of a load or reload. A plain class.

It runs in any process: inside a Ray actor (``mxload.workers.rank.actor``), in a test, or inside an
inference engine's own worker that hands it the parameters its graphs captured
(``buffers=``, SPEC §4 "adopts buffers its host already owns").

For every unit of its ``RankPlan`` (one merged linear, one expert half, one plain
tensor) it reads the unit's byte ranges through the storage seam into staging, converts
them on its backend (resolve -> MX quantize, or repack, or copy), and copies the finished
unit into its persistent buffer. Buffers are allocated once, before the first unit, with
their final shapes, and are only ever written with in-place ``copy_`` (SPEC §4
"Persistent buffers"); every load and reload ends by checking that no ``data_ptr`` moved.

Schedule and staging follow ``mxload.orchestrator.plan.memory.schedule`` exactly: the staging pool
enforces the planned budget and records the high-water mark reported beside the
prediction. Reads of the next unit are issued before the current unit converts when the
schedule allows it (reads overlap conversion, SPEC §4 "Streaming").
"""

from __future__ import annotations

import hashlib
import os
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from mxload.orchestrator.errors import (
    AddressMoved,
    AdoptionError,
    MxloadError,
    RunError,
    StorageError,
)
from mxload.orchestrator.plan.formats import MX_GROUP, ceil_div
from mxload.orchestrator.plan.memory import (
    ConvertOptions,
    StepPlan,
    read_fn_from_reads,
    schedule,
    sub_reads,
    sub_unit,
)
from mxload.orchestrator.plan.ranges import ByteRange
from mxload.orchestrator.plan.types import BufferSpec, Part, PartRead, RankPlan, Unit, UnitReads
from mxload.workers.numerics.backend import ConvertPart, PackedOut
from mxload.workers.numerics.reference import MODEL_TORCH_DTYPE
from mxload.workers.rank.staging import Lease, StagingPool
from mxload.workers.safetensors_io import SAFETENSORS_TO_TORCH

_Leased = list[tuple[str, list[tuple[int, str, ByteRange]], Lease]]
"""A read's pool leases, one per file, with the (part, weight-or-scale, range) items each
lease holds in order."""

_Member = tuple[Unit, UnitReads, list[tuple[torch.Tensor, "torch.Tensor | None"]], int]
"""One unit of a step as converted: the unit (or a row chunk of it), its reads, its
per-part (weight bytes, scale bytes) views, and the buffer row it starts at."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

CHECKSUM_NAME = "blake2b-128"
"""Checksum of a buffer: BLAKE2b with a 16-byte digest over its bytes in row-major order
(device buffers are copied to the host first), as lowercase hex. Same on every rank."""


def checksum(t: torch.Tensor) -> str:
    """The documented buffer checksum (see CHECKSUM_NAME)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    h = hashlib.blake2b(digest_size=16)
    if flat.numel():
        h.update(memoryview(flat.numpy()))
    return h.hexdigest()


@dataclass(frozen=True)
class SourceInfo:
    """The checkpoint a load or reload reads (SPEC §4: each version plans from its own headers)."""

    root: str
    storage_options: Mapping[str, Any] | None = None
    quant: str = "block_fp8"
    """How this checkpoint stores quantized linears: block_fp8 | mxfp8 | none."""
    block_n: int = 128
    block_k: int = 128
    allow_nonfinite: bool = False
    fingerprint: str = ""
    """Identity of the checkpoint as read (``mxload.orchestrator.runtime.catalog.fingerprint``).
    Every unit records (version, fingerprint) of the run that wrote it; "" (unknown) never
    matches, so a unit is never skipped on the word of a source that cannot say what it is."""


Identity = tuple[int, str]
"""(version number, checkpoint fingerprint): what a unit holds (SPEC §4 "Reload")."""

NOTHING: Identity = (0, "")
"""A unit never written, or one whose write was cut part-way (it holds no one version)."""

INLINE_READ_BYTES = 4 << 20
"""A unit whose bytes come from a local file and total at most this many is read on the
converting thread instead of the reader thread. From the page cache such a read is a
fraction of a millisecond, less than handing it to another thread costs: on a busy host
the handoff and the reader's Python compete with the conversion kernel's threads for the
cores and the GIL (TP-sharded experts at tp = 8, units of 0.2-0.4 MB: 15-20 % less
rank time inline; issue 13 bench). A read-ahead of such a unit runs after the current
unit is converted (its leases are taken before, as the schedule counts), so an
accelerator's queued conversion overlaps it. Larger local reads and every remote or
peer read still go to the reader thread."""


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
    reading itself (small local units, :data:`INLINE_READ_BYTES`)."""
    convert_seconds: float = 0.0
    bytes_from_storage: int = 0
    """Bytes this run fetched from storage for the rank's own units (coalescing included)."""
    bytes_from_peers: int = 0
    """Bytes of the rank's units another rank fetched and published (read once per cluster)."""
    peer_fallbacks: int = 0
    """Shared units whose published bytes could not be had (owner lost): read from storage."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerUnit:
    """Where a shared unit's bytes are (``mxload.orchestrator.plan.sharing``): published by rank
    ``owner`` as one handle per file, in the order the unit's reads group by file."""

    owner: int
    fetch_bytes: int
    """Bytes the owner requested from storage for the unit (what ``bytes_read`` counts)."""
    handles: tuple[tuple[str, Any], ...]
    """(file, handle) per file; ``peer_get(handle)`` gives the bytes (a uint8 buffer)."""


@dataclass
class FetchResult:
    """What :meth:`RankLoader.fetch_for_peers` fetched and published."""

    handles: dict[int, tuple[tuple[str, Any], ...]] = field(default_factory=dict)
    bytes_from_storage: int = 0
    published_bytes: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _StepRead:
    """How one step's units are read (:meth:`RankLoader._step_read`): groups of (unit
    named in errors, reads, peer, label), and each member unit's number of parts."""

    groups: list[tuple[Unit, UnitReads, PeerUnit | None, str]]
    counts: list[int]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for _, r, _, _ in self.groups)

    @property
    def from_peer(self) -> bool:
        return any(p is not None for _, _, p, _ in self.groups)


def _zero_uncovered(unit: Unit, row_base: int, w_buf: torch.Tensor) -> list[Callable[[], None]]:
    """Writes that zero the rows of a plain unit no part covers (vocab padding past V,
    SPEC §3), also in a buffer the host handed in with other contents."""
    covered = sorted((p.dst_row, p.dst_row + p.nrows) for p in unit.parts)
    writes: list[Callable[[], None]] = []
    start = 0
    for lo, hi in [*covered, (unit.rows, unit.rows)]:
        if lo > start:
            a, b = row_base + start, row_base + lo
            writes.append(lambda a=a, b=b: w_buf[a:b].zero_())
        start = max(start, hi)
    return writes


def _typed(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View raw little-endian bytes as ``dtype`` of ``shape``; copies only when the
    offset is not aligned for the dtype (tiny scale tensors, rare)."""
    try:
        return flat.view(dtype).view(shape)
    except RuntimeError:
        return flat.clone().view(dtype).view(shape)


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RankLoader:
    """Holds one rank's persistent buffers and fills them from a checkpoint."""

    def __init__(
        self,
        plan: RankPlan,
        *,
        model_dtype: str,
        backend: Any = None,
        device: str = "cpu",
        buffers: Mapping[str, torch.Tensor] | None = None,
        storage_factory: Callable[..., Any] | None = None,
    ) -> None:
        if backend is None:
            from mxload.workers.numerics.backend import select_backend

            backend = select_backend(device)
        self.plan = plan
        self.rank = plan.rank
        self.backend = backend
        self.model_dtype = model_dtype
        self._storage_factory = storage_factory
        self._specs = {b.name: b for b in plan.buffers}
        self.adopted = buffers is not None
        self.buffers: dict[str, torch.Tensor] = (
            self._adopt(buffers) if buffers is not None else self._allocate()
        )
        # Units write canonical rows (source orientation, SPEC §2.3 kernel layout); an
        # engine profile may hold a buffer as a permuted view of that, so each unit writes
        # through the canonical view of the engine's tensor: same storage, no copy.
        self._canonical = {
            spec.name: _canonical_view(self.buffers[spec.name], spec) for spec in plan.buffers
        }
        self.addresses = {n: t.data_ptr() for n, t in self.buffers.items()}
        self.unit_ids: list[Identity] = [NOTHING] * len(plan.units)
        """Per unit, the identity of the run that last wrote it whole."""
        self.target_id: Identity = NOTHING
        """The identity the latest run (finished or not) was writing."""
        self.last_stats = RunStats()
        self._busy = threading.Lock()
        self._storages: dict[tuple[str, str], Any] = {}
        self._last_storage: tuple[SourceInfo, Any] | None = None
        self._peer_get: Callable[[Any], Any] | None = None
        self._run_stats: RunStats | None = None
        self._stats_lock = threading.Lock()  # the reader thread counts too

    # --- buffers -------------------------------------------------------------------------

    def _allocate(self) -> dict[str, torch.Tensor]:
        """Every buffer as the engine profile holds it: row-major storage of
        ``spec.storage_shape``, then the view of ``spec.shape`` over it (a permutation,
        so ``stride`` and ``storage_offset`` are the planned ones)."""
        out = {}
        for spec in self.plan.buffers:
            storage = (
                torch.zeros(
                    spec.storage_shape, dtype=TORCH_DTYPES[spec.dtype], device=self.backend.device
                )
                if spec.dtype != "float8_e4m3fn"
                else torch.zeros(
                    spec.storage_shape, dtype=torch.uint8, device=self.backend.device
                ).view(torch.float8_e4m3fn)
            )
            out[spec.name] = _view_of_storage(storage, spec)
        return out

    def _adopt(self, given: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        problems = []
        want_device = torch.device(self.backend.device)
        for spec in self.plan.buffers:
            t = given.get(spec.name)
            if t is None:
                problems.append(f"{spec.name}: missing")
                continue
            if tuple(t.shape) != spec.shape:
                problems.append(f"{spec.name}: shape {tuple(t.shape)} != planned {spec.shape}")
            if t.dtype != TORCH_DTYPES[spec.dtype]:
                problems.append(f"{spec.name}: dtype {t.dtype} != planned {spec.dtype}")
            if t.device.type != want_device.type:
                problems.append(f"{spec.name}: device {t.device} != compute device {want_device}")
            problems.extend(_layout_problems(spec, t))
        extra = sorted(set(given) - set(self._specs))
        for name in extra:
            problems.append(f"{name}: not a buffer of rank {self.rank}'s plan")
        if problems:
            raise AdoptionError(
                f"rank {self.rank}: cannot adopt the host's buffers: " + "; ".join(problems),
                rank=self.rank,
            )
        return {spec.name: given[spec.name] for spec in self.plan.buffers}

    def _unit_buffers(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = self._canonical[unit.buffer]
        s = self._canonical.get(unit.buffer + "_scale")
        if unit.expert >= 0:
            w = w[unit.expert]
            s = s[unit.expert] if s is not None else None
        if w.dim() == 1:
            w = w.view(1, -1)
        return w, s

    # --- storage ---------------------------------------------------------------------------

    def _storage(self, source: SourceInfo) -> Any:
        import json

        last = self._last_storage
        if last is not None and last[0] is source:  # every unit of a run: no key to build
            return last[1]
        key = (source.root, json.dumps(source.storage_options or {}, sort_keys=True))
        st = self._storages.get(key)
        if st is None:
            if self._storage_factory is not None:
                st = self._storage_factory(source.root, source.storage_options)
            else:
                from mxload.workers.storage import Storage

                st = Storage(source.root, source.storage_options)
            self._storages[key] = st
        self._last_storage = (source, st)
        return st

    def _read(
        self,
        unit: Unit,
        reads: UnitReads,
        source: SourceInfo,
        pool: StagingPool,
        peer: PeerUnit | None = None,
    ) -> tuple[list[Lease], list[tuple[torch.Tensor, torch.Tensor | None]], int]:
        """Read every part's weight (and scale) bytes into pool leases, one lease per file.
        Returns the leases, per-part (weight bytes, scale bytes) views, and bytes fetched."""
        return self._fill(unit, reads, source, pool, self._take_leases(unit, reads, pool), peer)

    def _take_leases(self, unit: Unit, reads: UnitReads, pool: StagingPool) -> _Leased:
        """Phase 1 of a read: the pool leases, one per file. A read-ahead takes them on the
        converting thread *before* it converts the current unit, so the staging peak is
        what the schedule predicts however the two threads interleave (taken on the reader
        thread, a fast copy unit could release its lease first and the peak come out lower
        than predicted, by up to 2x)."""
        by_file: dict[str, list[tuple[int, str, ByteRange]]] = {}
        # Weights first, scales after: an MX weight's bytes are rows x K with K a multiple
        # of 32, so every payload in a lease starts 8-byte aligned and the conversion
        # kernel reads it in place (a scale between two payloads would force a copy).
        for i, pr in enumerate(reads.parts):
            by_file.setdefault(pr.file, []).append((i, "w", pr.weight))
        for i, pr in enumerate(reads.parts):
            if pr.scale is not None:
                by_file.setdefault(pr.scale_file or pr.file, []).append((i, "s", pr.scale))
        taken: _Leased = []
        try:
            for file, items in by_file.items():
                total = sum(r.nbytes for _, _, r in items)
                taken.append((file, items, pool.take(total, tag=f"read {unit.buffer} {file}")))
        except BaseException:
            for _, _, lease in taken:
                pool.release(lease)
            raise
        return taken

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            if self._run_stats is not None:
                for name, n in deltas.items():
                    setattr(self._run_stats, name, getattr(self._run_stats, name) + n)

    def _from_peer(self, peer: PeerUnit, taken: _Leased) -> bool:
        """Copy a shared unit's published bytes into its leases. False (nothing counted)
        when they cannot be had, e.g. their owner's process died: the caller then reads
        storage, which stays the source of truth."""
        if self._peer_get is None or [f for f, _, _ in taken] != [f for f, _ in peer.handles]:
            return False
        try:
            for (_, _, lease), (_, handle) in zip(taken, peer.handles, strict=True):
                if lease.nbytes:
                    data = self._peer_get(handle)
                    lease.tensor.numpy()[...] = data
        except Exception:
            return False
        return True

    def _fill(
        self,
        unit: Unit,
        reads: UnitReads,
        source: SourceInfo,
        pool: StagingPool,
        taken: _Leased,
        peer: PeerUnit | None = None,
        *,
        label: str = "",
    ) -> tuple[list[Lease], list[tuple[torch.Tensor, torch.Tensor | None]], int]:
        """Phase 2 of a read: fetch the bytes into the leases (releases them on error).
        ``label`` names what is read in errors (default: the unit's buffer).

        A shared unit (``peer``) is copied from the bytes its owner published instead;
        the bytes it returns as fetched are what the owner requested from storage, so
        ``bytes_read`` means the same with and without sharing."""
        storage = self._storage(source)
        views: dict[tuple[int, str], torch.Tensor] = {}
        fetched = 0
        try:
            if peer is not None and self._from_peer(peer, taken):
                if peer.owner != self.rank:
                    self._count(bytes_from_peers=sum(lease.nbytes for _, _, lease in taken))
                fetched = peer.fetch_bytes
                taken_from_storage = False
            else:
                if peer is not None:
                    self._count(peer_fallbacks=1)
                taken_from_storage = True
            for file, items, lease in taken:
                if lease.nbytes and taken_from_storage:
                    try:
                        n = storage.read_ranges_into(
                            file, [r for _, _, r in items], memoryview(lease.tensor.numpy())
                        )
                        fetched += n
                        self._count(bytes_from_storage=n)
                    except StorageError as err:
                        first = items[0][2]
                        raise StorageError(
                            f"rank {self.rank}: reading {label or unit.buffer} from {file} "
                            f"({first.describe()}...): {err}",
                            rank=self.rank,
                            tensor=unit.buffer,
                            file=file,
                            byte_range=first.describe(),
                        ) from err
                # one split for the lease's parts (a slice each cost a torch call apiece)
                pieces = lease.tensor.split_with_sizes([r.nbytes for _, _, r in items])
                for (i, kind, _), piece in zip(items, pieces, strict=True):
                    views[(i, kind)] = piece
        except BaseException:
            for _, _, lease in taken:
                pool.release(lease)
            raise
        parts = [(views[(i, "w")], views.get((i, "s"))) for i in range(len(reads.parts))]
        return [lease for _, _, lease in taken], parts, fetched

    def _step_read(
        self,
        members: Sequence[int],
        units: Sequence[Unit],
        reads: Sequence[UnitReads],
        peers: Mapping[int, PeerUnit],
        *,
        merge: bool,
    ) -> _StepRead:
        """How the units ``members`` of one step are read: all together (one lease and
        one storage call per file) when ``merge``, or unit by unit: when the storage
        would coalesce across units (remote: the plan predicts requests per unit) or one
        of them comes from a peer (its bytes are published per unit)."""
        counts = [len(reads[i].parts) for i in members]
        if merge and len(members) > 1 and not any(i in peers for i in members):
            merged = UnitReads(parts=tuple(p for i in members for p in reads[i].parts))
            label = f"{units[members[0]].buffer} and {len(members) - 1} more units"
            return _StepRead([(units[members[0]], merged, None, label)], counts)
        return _StepRead(
            [(units[i], reads[i], peers.get(i), units[i].buffer) for i in members], counts
        )

    def _read_step(
        self, step: _StepRead, source: SourceInfo, pool: StagingPool
    ) -> tuple[list[Lease], list[list[tuple[torch.Tensor, torch.Tensor | None]]], int]:
        """A step's read, both phases on one thread."""
        return self._fill_step(step, source, pool, self._take_step(step, pool))

    def _take_step(self, step: _StepRead, pool: StagingPool) -> list[_Leased]:
        """Phase 1 of a step's read (see :meth:`_take_leases`)."""
        taken: list[_Leased] = []
        try:
            for unit, reads, _, _ in step.groups:
                taken.append(self._take_leases(unit, reads, pool))
        except BaseException:
            for t in taken:
                for _, _, lease in t:
                    pool.release(lease)
            raise
        return taken

    def _fill_step(
        self, step: _StepRead, source: SourceInfo, pool: StagingPool, taken: list[_Leased]
    ) -> tuple[list[Lease], list[list[tuple[torch.Tensor, torch.Tensor | None]]], int]:
        """Phase 2 of a step's read: the leases, each unit's per-part views, bytes
        fetched. Every lease is released on error."""
        leases: list[Lease] = []
        parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        fetched = 0
        done = 0
        try:
            for (unit, reads, peer, label), t in zip(step.groups, taken, strict=True):
                got, views, n = self._fill(unit, reads, source, pool, t, peer, label=label)
                done += 1
                leases += got
                parts += views
                fetched += n
        except BaseException:
            for lease in leases:
                pool.release(lease)
            for t in taken[done + 1 :]:
                for _, _, lease in t:
                    pool.release(lease)
            raise
        out = []
        at = 0
        for n in step.counts:
            out.append(parts[at : at + n])
            at += n
        return leases, out, fetched

    # --- conversion --------------------------------------------------------------------------

    def _convert(
        self,
        members: Sequence[_Member],
        source: SourceInfo,
        pool: StagingPool,
        opts: ConvertOptions,
    ) -> tuple[list[Lease], list[Callable[[], None]]]:
        """Convert the units (or a unit's row chunk) of one step into staged results.

        Returns the pool reservations that account for the results and the writes that
        copy them into the units' buffers. The writes run only once every unit of the
        step is converted, so a buffer never holds a half-converted unit (SPEC §4
        "Reload"). Units the fused kernel converts into their kernel layout in staging
        go through one backend call together (:meth:`_convert_staged`); any other part
        is converted on its own (:meth:`_convert_part`)."""
        from mxload.orchestrator.plan.memory import unit_cost

        reservations: list[Lease] = []
        writes: list[Callable[[], None]] = []
        staged: list[tuple[Unit, int, list[ConvertPart], torch.Tensor, torch.Tensor]] = []
        try:
            for unit, reads, raw, row_base in members:
                cost = unit_cost(unit, unit.rows, reads.nbytes, opts)
                mx = unit.layout in ("mx_linear", "mx_moe")
                w_buf, s_buf = self._unit_buffers(unit)
                # The packed stage is [K, rows]: right when the buffer's storage is K-major
                # (the mxload layout). An engine holding [N, K]-ordered storage (vllm-ascend's
                # MoE) gets the row-major MX result instead, whose write is then a copy in
                # storage order.
                packed = mx and unit.quantized and source.quant == "block_fp8"
                packed = packed and w_buf.is_contiguous() and s_buf is not None
                if cost.out and not packed:
                    reservations.append(pool.reserve(cost.out, tag=f"out {unit.buffer}"))
                if cost.scratch:
                    reservations.append(pool.reserve(cost.scratch, tag=f"resolve {unit.buffer}"))
                packed_parts: list[ConvertPart] = []
                for part, pr, (wb, sb) in zip(unit.parts, reads.parts, raw, strict=True):
                    w, scale = self._source_part(unit, part, pr, wb, sb, source)
                    if packed:
                        assert scale is not None
                        packed_parts.append(
                            ConvertPart(w, scale, part.rows[0], part.cols[0], part.dst_row)
                        )
                    else:
                        writes.append(
                            self._convert_part(
                                unit, part, w, scale, row_base + part.dst_row, w_buf, s_buf, source
                            )
                        )
                if packed:
                    assert s_buf is not None
                    staged.append((unit, row_base, packed_parts, w_buf, s_buf))
                if not mx:
                    writes.extend(_zero_uncovered(unit, row_base, w_buf))
            if staged:
                lease, staged_writes = self._convert_staged(staged, source, pool)
                reservations.append(lease)
                writes.extend(staged_writes)
        except BaseException:
            for lease in reservations:
                pool.release(lease)
            raise
        return reservations, writes

    def _source_part(
        self,
        unit: Unit,
        part: Part,
        pr: PartRead,
        wb: torch.Tensor,
        sb: torch.Tensor | None,
        source: SourceInfo,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One part's read bytes as its weight ``[rows, cols]`` and scale tensors (block
        scales checked, SPEC §1.1)."""
        from mxload.workers.numerics.reference import check_block_scales

        nr, nc = part.nrows, part.ncols
        w = _typed(wb, SAFETENSORS_TO_TORCH[pr.weight_dtype], (nr, nc))
        if not unit.quantized or sb is None:
            return w, None
        if source.quant != "block_fp8":
            return w, _typed(sb, torch.uint8, (nr, nc // MX_GROUP))
        tr = pr.tile_rows[1] - pr.tile_rows[0]
        tc = pr.tile_cols[1] - pr.tile_cols[0]
        scale = _typed(sb, torch.float32, (tr, tc))
        check_block_scales(
            scale,
            tensor=f"{part.module}.weight_scale_inv",
            file=pr.scale_file or pr.file,
            tile_row0=pr.tile_rows[0],
            tile_col0=pr.tile_cols[0],
            allow_nonfinite=source.allow_nonfinite,
        )
        return w, scale

    def _convert_part(
        self,
        unit: Unit,
        part: Part,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        row: int,
        w_buf: torch.Tensor,
        s_buf: torch.Tensor | None,
        source: SourceInfo,
    ) -> Callable[[], None]:
        """Convert one part on its own; returns the write of its rows at buffer row
        ``row``: MX payload and scales through ``repack.write_rows``, or the resolved
        (or plain) rows in the model dtype."""
        from mxload.workers.numerics.reference import resolve_mx
        from mxload.workers.numerics.repack import write_rows

        be = self.backend
        dtype = MODEL_TORCH_DTYPE[self.model_dtype]
        block = dict(
            row0=part.rows[0],
            col0=part.cols[0],
            block_n=source.block_n,
            block_k=source.block_k,
            dtype=dtype,
        )
        if unit.layout in ("mx_linear", "mx_moe"):
            if unit.quantized and source.quant == "block_fp8":
                assert scale is not None
                [(payload, mx_scale)] = be.convert(
                    [ConvertPart(w, scale, part.rows[0], part.cols[0])],
                    block_n=source.block_n,
                    block_k=source.block_k,
                    dtype=dtype,
                )
            elif unit.quantized:  # already MXFP8: repack only (SPEC §1.2)
                assert scale is not None
                payload, mx_scale = be.to_device(w), be.to_device(scale)
            else:  # a BF16 (RL trainer) checkpoint into MX buffers: quantize directly
                payload, mx_scale = be.mx_quantize(be.to_device(w))
            assert s_buf is not None
            return lambda: write_rows(w_buf, s_buf, payload, mx_scale, row)
        if unit.quantized and source.quant == "block_fp8":
            x = be.resolve_block(
                be.to_device(w),
                be.to_device(scale),
                **block,
            )
        elif unit.quantized:
            x = resolve_mx(be.to_device(w), be.to_device(scale), dtype)
        else:
            x = be.to_device(w)
        n = part.nrows
        return lambda: w_buf[row : row + n].copy_(x)

    def _convert_staged(
        self,
        staged: Sequence[tuple[Unit, int, list[ConvertPart], torch.Tensor, torch.Tensor]],
        source: SourceInfo,
        pool: StagingPool,
    ) -> tuple[Lease, list[Callable[[], None]]]:
        """The units of a step that the fused kernel writes in their kernel layout: every
        one converted into one staging lease by one backend call (one kernel launch on
        cpu-fast), then each copied into its buffer's columns in one go (contiguous when
        the unit is whole). Returns the lease and the writes."""
        lease, stages = self._packed_stages([u for u, *_ in staged], pool)
        try:
            pairs = [
                (part, PackedOut(q, sc))
                for (_, _, parts, _, _), (q, sc) in zip(staged, stages, strict=True)
                for part in parts
            ]
            self.backend.convert(
                [part for part, _ in pairs],
                into=[out for _, out in pairs],
                block_n=source.block_n,
                block_k=source.block_k,
                dtype=MODEL_TORCH_DTYPE[self.model_dtype],
            )
        except BaseException:
            pool.release(lease)
            raise
        writes: list[Callable[[], None]] = []
        for (unit, a, _, w_buf, s_buf), (q, sc) in zip(staged, stages, strict=True):
            b = a + unit.rows

            def write(
                w_buf: torch.Tensor = w_buf,
                s_buf: torch.Tensor = s_buf,
                q: torch.Tensor = q,
                sc: torch.Tensor = sc,
                a: int = a,
                b: int = b,
            ) -> None:
                w_buf.view(torch.uint8)[:, a:b].copy_(q.view(torch.uint8))
                s_buf[:, a:b, :].copy_(sc)

            writes.append(write)
        return lease, writes

    def _packed_stages(
        self, units: Sequence[Unit], pool: StagingPool
    ) -> tuple[Lease, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Staging for MX units in their kernel layout, carved from one pool lease: per
        unit a payload ``[K, rows]`` and paired scales ``[ceil(g/2), rows, 2]``. Payloads
        first (each a multiple of 32 bytes, so every one starts 8-byte aligned for the
        kernel's word writes), then the scales."""
        pairs = [ceil_div(u.cols // MX_GROUP, 2) for u in units]
        q_total = sum(u.cols * u.rows for u in units)
        s_total = sum(g2 * u.rows * 2 for u, g2 in zip(units, pairs, strict=True))
        tag = units[0].buffer if len(units) == 1 else f"{units[0].buffer} +{len(units) - 1}"
        lease = pool.take(q_total + s_total, device=self.backend.device, tag=f"out {tag}")
        out = []
        q_at, s_at = 0, q_total
        for u, g2 in zip(units, pairs, strict=True):
            k, n = u.cols, u.rows
            stage_w = lease.tensor[q_at : q_at + k * n].view(torch.float8_e4m3fn).view(k, n)
            stage_s = lease.tensor[s_at : s_at + g2 * n * 2].view(g2, n, 2)
            if (k // MX_GROUP) % 2:
                stage_s[-1, :, 1].zero_()
            out.append((stage_w, stage_s))
            q_at += k * n
            s_at += g2 * n * 2
        return lease, out

    # --- the run -------------------------------------------------------------------------------

    def load(
        self,
        reads: Sequence[UnitReads],
        source: SourceInfo,
        *,
        version: int,
        staging_budget: int,
        whole_units: bool = False,
        units: Sequence[Unit] | None = None,
        progress: Callable[[int, int, int], None] | None = None,
        fault_hook: Callable[[int], None] | None = None,
        peers: Mapping[int, PeerUnit] | None = None,
        peer_get: Callable[[Any], Any] | None = None,
    ) -> RunStats:
        """Fill every buffer from ``source``; ``whole_units`` for a reload.

        Units already at the target identity, ``(version, source.fingerprint)``, are skipped
        (an interrupted reload run again); a unit at the same version number from another
        checkpoint is rewritten. ``units`` (reload) are the plan's units with the new source's quantized flags;
        they must have the plan's geometry. ``peers``: unit index -> where another rank
        published that unit's bytes (read once per cluster), fetched with ``peer_get``;
        a unit converted in row chunks is read from storage all the same."""
        if not self._busy.acquire(blocking=False):
            raise RunError(
                f"rank {self.rank}: a load is already running on this rank", rank=self.rank
            )
        try:
            # The bytes are about to change: a run that fails part-way must not leave the
            # checksums of the previous bytes cached for status to report (SPEC §4).
            self._checksums = None
            self._peer_get = peer_get
            return self._load(
                reads,
                source,
                version,
                staging_budget,
                whole_units,
                units,
                progress,
                fault_hook,
                peers or {},
            )
        finally:
            self._checksums = None
            self._peer_get = None
            self._run_stats = None
            self._busy.release()

    def _load(
        self,
        reads: Sequence[UnitReads],
        source: SourceInfo,
        version: int,
        staging_budget: int,
        whole_units: bool,
        units: Sequence[Unit] | None,
        progress: Callable[[int, int, int], None] | None,
        fault_hook: Callable[[int], None] | None,
        peers: Mapping[int, PeerUnit],
    ) -> RunStats:
        if units is None:
            units = self.plan.units
        elif len(units) != len(self.plan.units) or any(
            (u.buffer, u.expert, u.row0, u.rows, u.cols)
            != (p.buffer, p.expert, p.row0, p.rows, p.cols)
            for u, p in zip(units, self.plan.units, strict=True)
        ):
            raise RunError(f"rank {self.rank}: reload units differ from the plan", rank=self.rank)
        if len(reads) != len(units):
            raise RunError(
                f"rank {self.rank}: {len(reads)} read plans for {len(units)} units", rank=self.rank
            )
        opts = ConvertOptions.for_source(
            self.model_dtype,
            source.quant,
            source.block_n,
            fused=bool(getattr(self.backend, "fused", False)),
            device=torch.device(self.backend.device).type,
        )
        read_fn = read_fn_from_reads(
            units, reads, block_n=source.block_n, source_quant=source.quant
        )
        steps, estimate = schedule(units, read_fn, opts, staging_budget, whole_units=whole_units)
        pool = StagingPool(staging_budget, rank=self.rank)
        target: Identity = (version, source.fingerprint)
        self.target_id = target
        stats = RunStats(predicted_peak_staging_bytes=estimate.staging_bytes)
        self._run_stats = stats
        stats.bytes_needed = self.plan.bytes_needed
        rss0 = _rss_bytes()
        maxrss0 = _maxrss_bytes()
        self.backend.reset_peak_memory()
        dev_base = self.backend.memory_allocated()
        t0 = time.perf_counter()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mxload-read-{self.rank}")
        pending: Future[Any] | None = None
        rss_samples: list[int] = []
        # Skip only what this very checkpoint already wrote at this version; a source
        # without a fingerprint is never taken to be what a unit holds.
        todo = [not source.fingerprint or self.unit_ids[i] != target for i in range(len(units))]
        try:
            storage = self._storage(source) if any(todo) else None
            local = bool(getattr(storage, "is_local", False))
            # One storage call for a whole step only where that fetches what one call per
            # unit would (Storage.reads_ranges_apart): remote reads coalesce within a
            # call, and the plan predicts their bytes and requests unit by unit.
            merge = bool(getattr(storage, "reads_ranges_apart", False))

            def inline(r: _StepRead) -> bool:  # read on this thread (INLINE_READ_BYTES)
                return local and not r.from_peer and r.nbytes <= INLINE_READ_BYTES

            for s, step in enumerate(steps):
                members = [i for i in step.units if todo[i]]
                if not members:
                    continue
                if fault_hook is not None:
                    for i in members:
                        fault_hook(i)
                if len(step.chunks) == 1:
                    t_r = time.perf_counter()
                    plan = self._step_read(members, units, reads, peers, merge=merge)
                    fut = pending or (
                        _done(self._read_step, plan, source, pool)
                        if inline(plan)
                        else executor.submit(self._read_step, plan, source, pool)
                    )
                    pending = None
                    leases, raw, fetched = fut.result()
                    stats.read_seconds += time.perf_counter() - t_r
                    stats.bytes_read += fetched
                    later: tuple[_StepRead, list[_Leased]] | None = None
                    ahead_members = (
                        [j for j in steps[s + 1].units if todo[j]]
                        if step.prefetch_next and s + 1 < len(steps)
                        else []
                    )
                    if ahead_members:
                        # The next step's leases are taken before this one converts (the
                        # schedule's peak); a small local read fills them on this thread
                        # after it (an accelerator converts meanwhile), any other on the
                        # reader thread now.
                        nxt = self._step_read(ahead_members, units, reads, peers, merge=merge)
                        ahead = self._take_step(nxt, pool)
                        if inline(nxt):
                            later = (nxt, ahead)
                        else:
                            pending = executor.submit(self._fill_step, nxt, source, pool, ahead)
                    try:
                        self._convert_and_write(
                            [
                                (units[i], reads[i], r, units[i].row0)
                                for i, r in zip(members, raw, strict=True)
                            ],
                            leases,
                            source,
                            pool,
                            opts,
                            stats,
                        )
                    except BaseException:
                        for t in later[1] if later else ():
                            for _, _, lease in t:
                                pool.release(lease)
                        raise
                    if later is not None:
                        t_r = time.perf_counter()
                        pending = _done(self._fill_step, later[0], source, pool, later[1])
                        stats.read_seconds += time.perf_counter() - t_r
                else:
                    # Chunks are written one by one: until the last lands the unit holds
                    # no one version.
                    i = step.first
                    unit = units[i]
                    self.unit_ids[i] = NOTHING
                    for chunk in step.chunks:
                        su = sub_unit(unit, chunk.start, chunk.end)
                        sr = sub_reads(
                            unit,
                            reads[i],
                            chunk.start,
                            chunk.end,
                            block_n=source.block_n,
                            source_quant=source.quant,
                        )
                        t_r = time.perf_counter()
                        leases, raw_parts, fetched = self._read(su, sr, source, pool)
                        stats.read_seconds += time.perf_counter() - t_r
                        stats.bytes_read += fetched
                        self._convert_and_write(
                            [(su, sr, raw_parts, unit.row0 + chunk.start)],
                            leases,
                            source,
                            pool,
                            opts,
                            stats,
                        )
                for i in members:
                    self.unit_ids[i] = target
                    stats.units += 1
                rss_samples.append(_rss_bytes())
                if progress is not None:
                    for i in members:
                        progress(i + 1, len(units), stats.bytes_read)
            self.backend.synchronize()
        finally:
            if pending is not None:
                try:
                    leases, _, _ = pending.result()
                    for lease in leases:
                        pool.release(lease)
                except BaseException:  # the run already failed; keep its error
                    pass
            executor.shutdown(wait=True)
        stats.seconds = time.perf_counter() - t0
        stats.measured_peak_staging_bytes = pool.high_water
        # RSS cross-check (SPEC §6): the lifetime peak if it rose during this run (then the
        # new peak happened now), else the highest RSS sampled between units.
        maxrss1 = _maxrss_bytes()
        top = maxrss1 if maxrss1 > maxrss0 else max(rss_samples, default=rss0)
        stats.rss_growth_bytes = max(0, top - rss0)
        peak = self.backend.max_memory_allocated()
        if peak is not None and dev_base is not None:
            stats.device_peak_bytes = peak - dev_base
        stats.extra["staging_estimate"] = estimate
        self.last_stats = stats
        self._checksums: dict[str, str] | None = None
        self.verify_addresses()
        return stats

    def _convert_and_write(
        self,
        members: Sequence[_Member],
        leases: list[Lease],
        source: SourceInfo,
        pool: StagingPool,
        opts: ConvertOptions,
        stats: RunStats,
    ) -> None:
        reservations: list[Lease] = []
        try:
            t_c = time.perf_counter()
            try:
                reservations, writes = self._convert(members, source, pool, opts)
            except MxloadError:
                raise
            except Exception as err:  # a numerics failure names rank and tensor
                names = ", ".join(dict.fromkeys(m[0].buffer for m in members))
                raise RunError(
                    f"rank {self.rank}: converting {names}: {type(err).__name__}: {err}",
                    rank=self.rank,
                    tensor=members[0][0].buffer,
                ) from err
            for write in writes:
                write()
            stats.convert_seconds += time.perf_counter() - t_c
        finally:
            for lease in leases + reservations:
                pool.release(lease)

    def fetch_for_peers(
        self,
        items: Sequence[tuple[int, Unit, UnitReads]],
        source: SourceInfo,
        *,
        staging_budget: int,
        publish: Callable[[Any], Any],
    ) -> FetchResult:
        """Fetch the shared reads this rank owns and publish their bytes for every user.

        ``items``: (key, unit, reads), one per shared read. Each unit's bytes are read
        into pool leases exactly as for a load (one lease per file), handed to
        ``publish`` (which copies them out, e.g. ``ray.put``) and released, one unit at a
        time: the pool peaks at the largest owned unit's reads, which never exceeds the
        rank's predicted staging (shared units run whole, SPEC §6)."""
        pool = StagingPool(staging_budget, rank=self.rank)
        result = FetchResult()
        t0 = time.perf_counter()
        for key, unit, reads in items:
            taken = self._take_leases(unit, reads, pool)
            leases, _, fetched = self._fill(unit, reads, source, pool, taken)
            try:
                result.handles[key] = tuple(
                    (file, publish(lease.tensor.numpy())) for file, _, lease in taken
                )
                result.published_bytes += sum(lease.nbytes for lease in leases)
            finally:
                for lease in leases:
                    pool.release(lease)
            result.bytes_from_storage += fetched
        result.peak_staging_bytes = pool.high_water
        result.seconds = time.perf_counter() - t0
        return result

    def reload(
        self,
        reads: Sequence[UnitReads],
        source: SourceInfo,
        *,
        version: int,
        staging_budget: int,
        units: Sequence[Unit] | None = None,
        progress: Callable[[int, int, int], None] | None = None,
        fault_hook: Callable[[int], None] | None = None,
    ) -> RunStats:
        """In-place reload: whole units only, addresses verified at the end.

        ``units``: the held units with the new source's quantized flags
        (``mxload.orchestrator.runtime.session.reload_inputs``); default: the plan's."""
        return self.load(
            reads,
            source,
            version=version,
            staging_budget=staging_budget,
            whole_units=True,
            units=units,
            progress=progress,
            fault_hook=fault_hook,
        )

    # --- reporting -------------------------------------------------------------------------------

    def verify_addresses(self) -> None:
        moved = [n for n, t in self.buffers.items() if t.data_ptr() != self.addresses[n]]
        if moved:
            raise AddressMoved(
                f"rank {self.rank}: buffers moved: {', '.join(moved)}", rank=self.rank
            )

    @property
    def unit_versions(self) -> list[int]:
        return [v for v, _ in self.unit_ids]

    @property
    def version(self) -> int:
        return min(self.unit_versions) if self.unit_ids else self.target_id[0]

    @property
    def identity(self) -> Identity | None:
        """The one identity every unit holds; None when units differ (or none is loaded)."""
        ids = set(self.unit_ids) or {self.target_id}
        only = next(iter(ids))
        return only if len(ids) == 1 and only != NOTHING else None

    @property
    def consistent(self) -> bool:
        """Every unit holds one identity: same version number *and* same checkpoint."""
        return len(set(self.unit_ids)) <= 1

    def buffer_identities(self) -> dict[str, Identity | None]:
        """Per buffer, the identity all its units hold (None: its units differ)."""
        seen: dict[str, set[Identity]] = {}
        for unit, ident in zip(self.plan.units, self.unit_ids, strict=True):
            seen.setdefault(unit.buffer, set()).add(ident)
            if unit.buffer + "_scale" in self.buffers:
                seen.setdefault(unit.buffer + "_scale", set()).add(ident)
        out: dict[str, Identity | None] = {}
        for name in self.buffers:
            ids = seen.get(name, {self.identity or NOTHING})
            out[name] = next(iter(ids)) if len(ids) == 1 else None
        return out

    def buffer_versions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for unit, v in zip(self.plan.units, self.unit_versions, strict=True):
            out[unit.buffer] = min(out.get(unit.buffer, v), v)
            if unit.buffer + "_scale" in self.buffers:
                out[unit.buffer + "_scale"] = out[unit.buffer]
        for name in self.buffers:
            out.setdefault(name, self.version)
        return out

    def checksums(self) -> dict[str, str]:
        cached = getattr(self, "_checksums", None)
        if cached is None:
            cached = {n: checksum(t) for n, t in self.buffers.items()}
            self._checksums = cached
        return cached

    def tensor_report(self, *, with_checksums: bool = True) -> dict[str, dict[str, Any]]:
        versions = self.buffer_versions()
        idents = self.buffer_identities()
        sums = self.checksums() if with_checksums else {}
        out = {}
        for spec in self.plan.buffers:
            t = self.buffers[spec.name]
            out[spec.name] = {
                "shape": list(spec.shape),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "dtype": spec.dtype,
                "layout": spec.layout,
                "data_ptr": t.data_ptr(),
                "nbytes": spec.nbytes,
                "checksum": sums.get(spec.name, ""),
                "version": versions[spec.name],
                # the checkpoint its units were read from; "mixed" when they differ
                "fingerprint": (idents[spec.name] or (0, "mixed"))[1],
            }
        return out

    def unit_status(self) -> dict[str, Any]:
        """Which units hold which version (SPEC §4: an incomplete reload says so)."""
        by_version: dict[int, int] = {}
        for v in self.unit_versions:
            by_version[v] = by_version.get(v, 0) + 1
        by_identity = Counter(f"{v}:{fp}" for v, fp in self.unit_ids)
        blocks = Counter(u.buffer for u in self.plan.units if u.expert < 0)

        def label(u: Unit) -> str:
            if u.expert >= 0:
                return f"{u.buffer}[{u.expert}]"
            if blocks[u.buffer] > 1:  # a vocab buffer cut into row blocks
                return f"{u.buffer}[rows {u.row0}:{u.row0 + u.rows}]"
            return u.buffer

        # Stale: not at what the latest run was writing (an interrupted reload's leftovers).
        stale = [
            label(u)
            for u, ident in zip(self.plan.units, self.unit_ids, strict=True)
            if ident != self.target_id
        ]
        ident = self.identity
        return {
            "version": self.version,
            "consistent": self.consistent,
            "identity": list(ident) if ident is not None else None,
            "target": list(self.target_id),
            "units_by_version": {str(k): n for k, n in sorted(by_version.items())},
            "units_by_identity": dict(sorted(by_identity.items())),
            "stale_units": stale[:50],
            "stale_count": len(stale),
        }

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """CPU copies of every buffer (for --dump): logical values, what each view reads,
        in its shape (row-major), whatever the storage order."""
        return {n: t.detach().cpu().contiguous() for n, t in self.buffers.items()}


def _done(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` run now, on this thread, as a finished future: a failure surfaces
    when its unit is reached, as it would from the reader thread."""
    fut: Future[Any] = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # handed to the unit that reads it
        fut.set_exception(exc)
    return fut


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv


def _view_of_storage(storage: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
    """The view ``spec`` describes over row-major ``storage`` of ``spec.storage_shape``."""
    if not spec.storage_order:
        return storage
    return storage.permute(_inverse(spec.storage_order))


def _canonical_view(t: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
    """``t`` (the engine's view) seen in mxload's canonical dimension order."""
    if not spec.canonical_of_view:
        return t
    return t.permute(_inverse(spec.canonical_of_view))


def _layout_problems(spec: BufferSpec, t: torch.Tensor) -> list[str]:
    """How a tensor handed in for ``spec`` differs from the planned view: its stride, and
    whether the memory it spans is exactly the planned storage (``numel`` elements, no gap,
    no overlap) inside the tensor's storage. The storage offset is free: a host may carve
    its parameters out of one arena. An engine's own parameters must match the profile
    exactly, or writes would land elsewhere than its kernels read."""
    problems = []
    # A dimension of size 1 has no meaningful stride (torch may report any value).
    significant = [d for d, n in enumerate(spec.shape) if n > 1]
    if [t.stride()[d] for d in significant] != [spec.stride[d] for d in significant]:
        problems.append(
            f"{spec.name}: stride {tuple(t.stride())} != planned {spec.stride} "
            f"(a view of storage {list(spec.storage_shape)}; is --engine right?)"
        )
    elif spec.numel:
        span = spec.numel * t.element_size()
        end = (t.storage_offset() + spec.numel) * t.element_size()
        have = t.untyped_storage().nbytes()
        if end > have:
            problems.append(
                f"{spec.name}: its storage holds {have} bytes, the view needs {span} bytes "
                f"from element {t.storage_offset()}"
            )
    return problems


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


def _rss_bytes() -> int:
    """Resident set size now. Sampled after every unit, so it must be cheap: Linux's
    ``/proc/self/statm``, kept open, is one pread (psutil built a Process object per
    call, about 1 ms, and opening the file each time a tenth of that: a quarter and a
    fortieth of a small expert unit's time at tp = 8; issue 13 bench)."""
    try:
        return int(os.pread(_statm_fd(), 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:
        return _maxrss_bytes()


__all__ = [
    "CHECKSUM_NAME",
    "BufferSpec",
    "PartRead",
    "RankLoader",
    "RunStats",
    "SourceInfo",
    "StepPlan",
    "checksum",
]
