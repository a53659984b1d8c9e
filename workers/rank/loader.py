"""The rank loader: one device's share of a load or reload. A plain class.

It runs in any process: inside a Ray actor (``mxload.workers.rank.actor``), in a test, or
inside an inference engine's own worker that hands it the parameters its graphs captured
(``buffers=``, docs/contract.md §4 "adopts buffers its host already owns").

For every unit of its ``RankPlan`` (one merged linear, one expert half, one plain
tensor) it reads the unit's byte ranges through the storage seam into staging
(:mod:`.reads`), converts them on its backend (:mod:`.convert`), and copies the finished
unit into its persistent buffer (:mod:`.writes`). Buffers are allocated once, before the
first unit, with their final shapes (:mod:`.buffers`), and are only ever written with
in-place ``copy_``; every load and reload ends by checking that no ``data_ptr`` moved.

Schedule and staging follow ``mxload.orchestrator.plan.memory.schedule`` exactly
(:mod:`.run`): the staging pool enforces the planned budget and records the high-water
mark reported beside the prediction (:mod:`.accounting`). Each unit records the identity
of the run that wrote it (:mod:`.identities`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...orchestrator.errors import AddressMoved, RunError
from ...orchestrator.plan.memory import (
    ConvertOptions,
    StepPlan,
    read_fn_from_reads,
    schedule,
)
from ...orchestrator.plan.message import PeerUnit, RankJob, SourceInfo
from ...orchestrator.plan.types import BufferSpec, PartRead, RankPlan, Unit, UnitReads
from ..storage.urls import is_remote
from . import buffers as rank_buffers
from .accounting import Counts, FetchResult, Meter, RunStats
from .buffers import TORCH_DTYPES
from .convert import Converter
from .identities import (
    CHECKSUM_NAME,
    NOTHING,
    Fence,
    Identity,
    UnitIdentities,
    checksum,
)
from .reads import InFlight, Reader
from .run import RunInputs, StepRunner
from .staging import StagingPool

FETCH_IN_FLIGHT = 16
"""Shared units an owner keeps in flight (:class:`.reads.InFlight`'s depth): as many as
``Storage`` keeps requests going, the time model's ``request_concurrency``."""


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
            from ..numerics.select import select_backend

            backend = select_backend(device)
        if plan.scale_alg and hasattr(backend, "with_scale_alg"):
            # the rank quantizes under its plan's rule (docs/contract.md §2.2)
            backend = backend.with_scale_alg(plan.scale_alg)
        self.plan = plan
        self.rank = plan.rank
        self.backend = backend
        self.model_dtype = model_dtype
        self.adopted = buffers is not None
        self.buffers: dict[str, torch.Tensor] = (
            rank_buffers.adopt(plan, buffers, backend.device)
            if buffers is not None
            else rank_buffers.allocate(plan, backend.device)
        )
        canonical = rank_buffers.canonical_views(plan, self.buffers)
        self.addresses = {n: t.data_ptr() for n, t in self.buffers.items()}
        self._ids = UnitIdentities(plan.units, self.buffers)
        self.last_stats = RunStats()
        self._busy = threading.Lock()
        self.fence = Fence()
        self._counts = Counts()
        self._reader = Reader(self.rank, self._counts, storage_factory)
        self._converter = Converter(
            backend,
            model_dtype,
            lambda unit: rank_buffers.unit_buffers(canonical, unit),
            canonical,
        )
        self._checksums: dict[str, str] | None = None

    @property
    def unit_ids(self) -> list[Identity]:
        """Per unit, the identity of the run that last wrote it whole."""
        return self._ids.ids

    # --- runs ----------------------------------------------------------------------------

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
        peers: Mapping[int, PeerUnit] | None = None,
        peer_get: Callable[[Any], Any] | None = None,
        storage: Any = None,
    ) -> RunStats:
        """:meth:`run` of the job these arguments spell (``RankJob``'s fields), for a
        caller in this process."""
        job = RankJob(
            reads=tuple(reads),
            source=source,
            version=version,
            staging_budget=staging_budget,
            whole_units=whole_units,
            units=None if units is None else tuple(units),
            peers=peers or {},
        )
        return self.run(job, progress=progress, peer_get=peer_get, storage=storage)

    def run(
        self,
        job: RankJob,
        *,
        progress: Callable[[int, int, int], None] | None = None,
        peer_get: Callable[[Any], Any] | None = None,
        storage: Any = None,
    ) -> RunStats:
        """Fill every buffer from ``job.source``; ``job.whole_units`` for a reload.

        Units already at the target identity, ``(job.version, source.fingerprint)``, are
        skipped (an interrupted reload run again); a unit at the same version number from
        another checkpoint is rewritten. ``job.units`` (reload) are the plan's units with
        the new source's quantized flags; they must have the plan's geometry.
        ``job.peers``' published bytes are fetched with ``peer_get``; a unit converted in
        row chunks is read from storage all the same. ``storage``: where the source's bytes
        are read instead of its root (a refit's receive area)."""
        if not self._busy.acquire(blocking=False):
            raise RunError(
                f"rank {self.rank}: a load is already running on this rank", rank=self.rank
            )
        try:
            self.fence.check(job.source.fence, self.rank)
            self.fence.advance(job.source.fence)
            # The bytes are about to change: a run that fails part-way must not leave the
            # checksums of the previous bytes cached for status to report.
            self._checksums = None
            self._reader.peer_get = peer_get
            self._reader.lost_owners.clear()
            self._reader.given = storage
            units = self._check_inputs(job.reads, job.units)
            return self._load(job, units, progress=progress)
        finally:
            self._checksums = None
            self._reader.peer_get = None
            self._reader.given = None
            self._counts.stats = None
            self._busy.release()

    def _check_inputs(
        self, reads: Sequence[UnitReads], units: Sequence[Unit] | None
    ) -> Sequence[Unit]:
        """The units to load: the plan's, or reload units of the plan's geometry, one read
        plan each (RunError otherwise)."""
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
        return units

    def _load(
        self,
        job: RankJob,
        units: Sequence[Unit],
        *,
        progress: Callable[[int, int, int], None] | None,
    ) -> RunStats:
        source, reads = job.source, job.reads
        opts = ConvertOptions.for_source(
            self.model_dtype,
            source.quant,
            source.block_n,
            fused=bool(getattr(self.backend, "fused", False)),
            device=torch.device(self.backend.device).type,
            # a storage the host gave (a refit's receive area) is memory, not a network
            remote=self._reader.given is None and is_remote(source.root),
        )
        read_fn = read_fn_from_reads(
            units, reads, block_n=source.block_n, source_quant=source.quant
        )
        steps, estimate = schedule(
            units, read_fn, opts, job.staging_budget, whole_units=job.whole_units
        )
        pool = StagingPool(job.staging_budget, rank=self.rank)
        target: Identity = (job.version, source.fingerprint)
        self._ids.target = target
        stats = RunStats(
            predicted_peak_staging_bytes=estimate.staging_bytes,
            bytes_needed=self.plan.bytes_needed,
        )
        self._counts.stats = stats
        # Skip only what this very checkpoint already wrote at this version; a source
        # without a fingerprint is never taken to be what a unit holds.
        todo = [not source.fingerprint or self.unit_ids[i] != target for i in range(len(units))]
        meter = Meter(self.backend)
        run = RunInputs(job, units, opts, pool, target, todo)
        # A host's storage that streams (a refit's receive ring) is told which units this
        # run reads and, at the end, waits for the rest of its source (the trailers).
        given = self._reader.given
        streaming = given is not None and hasattr(given, "begin_reads")
        # Units the host's storage writes itself (a refit's copies from another rank of
        # the node): not read here, and holding no step until the copies end.
        copied = tuple(getattr(given, "copied_units", ())) if streaming else ()
        for i in copied:
            todo[i] = False
            self._ids.ids[i] = NOTHING
        try:
            if streaming:
                given.begin_reads(todo)
                token, ids = job.source.fence, self._ids.ids
                given.start_copies(
                    self.buffers,
                    lambda: self.fence.check(token, self.rank),
                    lambda units: all(ids[i] == target for i in units),
                    self.backend.synchronize,
                )
            StepRunner(
                self.rank,
                self._reader,
                self._converter,
                self._ids,
                run,
                stats,
                meter,
                progress=progress,
                fence=self.fence,
            ).run_steps(steps)
            if streaming:
                given.finish()
                given.finish_copies()
                for i in copied:
                    self._ids.ids[i] = target
        except BaseException as err:
            if streaming:
                # Units written from a source that then failed (a sender died, a tensor
                # changed while it was sent) hold no one step: status says so until an
                # update rewrites them.
                for i, t in enumerate(todo):
                    if t and self._ids.ids[i] == target:
                        self._ids.ids[i] = NOTHING
                given.abort(err)
            raise
        self._check_unchanged(source, reads, todo)
        meter.finish(stats)
        stats.measured_peak_staging_bytes = pool.high_water
        if streaming:
            # The receive area is staging too: allocated once, at the size planned.
            area = int(getattr(given, "area_bytes", 0))
            stats.measured_peak_staging_bytes += area
            stats.predicted_peak_staging_bytes += int(getattr(given, "planned_bytes", area))
            stats.extra["receive_area_bytes"] = area
            stats.extra["waited_for_bytes_seconds"] = float(getattr(given, "read_wait_s", 0.0))
        stats.extra["staging_estimate"] = estimate
        self.last_stats = stats
        self._checksums = None
        self.verify_addresses()
        return stats

    def _check_unchanged(
        self, source: SourceInfo, reads: Sequence[UnitReads], todo: Sequence[bool]
    ) -> None:
        """The shards this run read still carry the change tags its fingerprint was made
        from (``SourceInfo.file_tags``): one stat (or HEAD) per shard. A shard rewritten
        meanwhile leaves the units read from it holding no one checkpoint: they are marked
        so, and the run fails naming the file."""
        if not source.file_tags or not any(todo):
            return
        used: dict[str, list[int]] = {}
        for i, r in enumerate(reads):
            if todo[i]:
                for p in r.parts:
                    for f in (p.file, p.scale_file):
                        if f:
                            used.setdefault(f, []).append(i)
        storage = self._reader.storage(source)
        changed = storage.changed({f: source.file_tags.get(f, "") for f in used})
        if changed:
            for f in changed:
                for i in used[f]:
                    self._ids.ids[i] = NOTHING
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            raise RunError(
                f"rank {self.rank}: {storage.url(changed[0])}{more} changed while this run "
                "read it (rewritten in place); the units read from it hold no one "
                "checkpoint: run the reload again once the checkpoint is written",
                rank=self.rank,
                file=changed[0],
            )

    def advance_fence(self, token: int, wait_s: float) -> bool:
        """Fence off every run with a smaller token (``identities.Fence``), then wait up
        to ``wait_s`` for a run still going to stop (it does at its next unit); whether
        this rank is free now."""
        self.fence.advance(token)
        if not self._busy.acquire(timeout=wait_s):
            return False
        self._busy.release()
        return True

    def fetch_for_peers(
        self,
        items: Sequence[tuple[int, Unit, UnitReads]],
        source: SourceInfo,
        *,
        staging_budget: int,
        publish: Callable[[Any], Any],
        window_bytes: int = 0,
        in_flight: int = FETCH_IN_FLIGHT,
    ) -> FetchResult:
        """Fetch the shared reads this rank owns and publish their bytes for every user.

        ``items``: (key, unit, reads), one per shared read, published in this order.
        Each unit's bytes are read into pool leases exactly as for a load (one lease per
        file), handed to ``publish`` on this thread (which copies them out, e.g.
        ``ray.put``) and released. Up to ``in_flight`` units are fetched at once, so an
        owner of many small units keeps the store's link busy instead of waiting a
        request's latency per unit; the units in flight hold at most ``window_bytes``
        of staging together (0: one unit at a time), and a unit larger than that waits
        until it is alone. The driver passes the largest unit read of the rank's run:
        every unit's reads are staged whole at some point of the load (shared units run
        whole, docs/contract.md §6), so the pool's peak stays within the rank's
        predicted staging."""
        pool = StagingPool(staging_budget, rank=self.rank)
        result = FetchResult()
        t0 = time.perf_counter()
        todo = deque(items)
        held = 0

        def fill(unit: Unit, reads: UnitReads, taken: Any) -> Any:
            return self._reader.fill(unit, reads, source, pool, taken, keep_rows=True)

        # (key, bytes, files) of each unit in flight, in publishing order
        flying: InFlight[tuple[int, int, list[str]]]
        flying = InFlight(pool, min(in_flight, len(items)), name="mxload-fetch")
        with flying:
            while todo or flying:
                while todo and len(flying) < flying.depth:
                    key, unit, reads = todo[0]
                    if flying and held + reads.nbytes > window_bytes:
                        break
                    todo.popleft()
                    taken = self._reader.take_leases(unit, reads, pool)
                    held += reads.nbytes
                    files = [file for file, _, _ in taken]
                    flying.issue((key, reads.nbytes, files), fill, unit, reads, taken)
                (key, nbytes, files), (leases, _, fetched) = flying.collect()
                held -= nbytes
                try:
                    result.handles[key] = tuple(
                        (file, publish(lease.tensor.numpy()))
                        for file, lease in zip(files, leases, strict=True)
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
        storage: Any = None,
    ) -> RunStats:
        """In-place reload: whole units only, addresses verified at the end.

        ``units``: the held units with the new source's quantized flags
        (``mxload.orchestrator.runtime.reload.reload_inputs``); default: the plan's.
        ``storage``: as for :meth:`load`."""
        return self.load(
            reads,
            source,
            version=version,
            staging_budget=staging_budget,
            whole_units=True,
            units=units,
            progress=progress,
            storage=storage,
        )

    def begin(self, target: Identity) -> None:
        """Record ``target`` as what this rank is being brought to, before its bytes
        arrive (a refit): until a run writes it, status lists every unit not at it."""
        self._ids.target = target

    def restamp(self, which: Sequence[bool], held: Identity, target: Identity) -> int:
        """Units flagged in ``which`` that hold ``held`` now hold ``target`` without a
        write: a delta refit's unchanged tensors (their bytes are the same). RunError,
        nothing changed, if one of them does not hold ``held``; returns how many."""
        ids = self._ids.ids
        wrong = [i for i, w in enumerate(which) if w and ids[i] != held]
        if wrong:
            u = self.plan.units[wrong[0]]
            raise RunError(
                f"rank {self.rank}: {u.buffer} holds {ids[wrong[0]]}, not {held}: the delta "
                f"cannot re-stamp it ({len(wrong)} unit(s)); send the update in full",
                rank=self.rank,
            )
        n = 0
        for i, w in enumerate(which):
            if w:
                ids[i] = target
                n += 1
        return n

    # --- reporting -----------------------------------------------------------------------

    def verify_addresses(self) -> None:
        moved = [n for n, t in self.buffers.items() if t.data_ptr() != self.addresses[n]]
        if moved:
            raise AddressMoved(
                f"rank {self.rank}: buffers moved: {', '.join(moved)}", rank=self.rank
            )

    @property
    def unit_versions(self) -> list[int]:
        return self._ids.versions

    @property
    def version(self) -> int:
        return self._ids.version

    @property
    def identity(self) -> Identity | None:
        """The one identity every unit holds; None when units differ (or none is loaded)."""
        return self._ids.identity

    @property
    def consistent(self) -> bool:
        """Every unit holds one identity: same version number *and* same checkpoint."""
        return self._ids.consistent

    def buffer_identities(self) -> dict[str, Identity | None]:
        """Per buffer, the identity all its units hold (None: its units differ)."""
        return self._ids.by_buffer()

    def buffer_versions(self) -> dict[str, int]:
        return self._ids.versions_by_buffer()

    def checksums(self) -> dict[str, str]:
        if self._checksums is None:
            self._checksums = {n: checksum(t) for n, t in self.buffers.items()}
        return self._checksums

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
        """Which units hold which version (an incomplete reload says so)."""
        return self._ids.status()

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """CPU copies of every buffer (for --dump): logical values, what each view reads,
        in its shape (row-major), whatever the storage order."""
        return {n: t.detach().cpu().contiguous() for n, t in self.buffers.items()}


__all__ = [
    "CHECKSUM_NAME",
    "NOTHING",
    "TORCH_DTYPES",
    "BufferSpec",
    "FetchResult",
    "Identity",
    "PartRead",
    "PeerUnit",
    "RankJob",
    "RankLoader",
    "RunStats",
    "SourceInfo",
    "StepPlan",
    "checksum",
]
