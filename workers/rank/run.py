"""One load or reload of a rank, step by step, as ``memory.schedule`` planned it.

A step is one unit, several small units converted together, or one unit in row chunks.
Each step is read (:mod:`.reads`), converted (:mod:`.convert`) and written
(:mod:`.writes`); the reads of the steps after it that the schedule reads ahead
(``StepPlan.ahead_to``: the next one, or from an object store up to
``ConvertOptions.read_ahead`` of them, kept in flight by one :class:`.reads.InFlight` of
that depth) are issued before the current one converts (reads overlap conversion and
each other, docs/contract.md §4 "Streaming"). A unit records the run's identity once its
step is written whole (:mod:`.identities`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ...orchestrator.errors import MxloadError, RunError
from ...orchestrator.plan.memory import ConvertOptions, StepPlan, sub_reads, sub_unit
from ...orchestrator.plan.message import PeerUnit, RankJob, SourceInfo
from ...orchestrator.plan.types import Unit, UnitReads
from .accounting import Meter, RunStats
from .convert import Converter, Member
from .identities import NOTHING, Fence, Identity, UnitIdentities
from .reads import (
    InFlight,
    Leased,
    Reader,
    StepRead,
    release_all,
)
from .staging import Lease, StagingPool

INLINE_READ_BYTES = 4 << 20
"""A step whose bytes come from a local file and total at most this many is read on the
converting thread instead of the reader thread. From the page cache such a read is a
fraction of a millisecond, less than handing it to another thread costs: on a busy host
the handoff and the reader's Python compete with the conversion kernel's threads for the
cores and the GIL. A read-ahead of such a step runs after the current step is converted
(its leases are taken before, as the schedule counts), so an accelerator's queued
conversion overlaps it. Larger local reads and every remote or peer read still go to the
reader thread."""


@dataclass
class RunInputs:
    """One run: the job it was given, and under which units, budget and identity."""

    job: RankJob
    units: Sequence[Unit]
    """The units it fills (``job.units`` or the plan's)."""
    opts: ConvertOptions
    pool: StagingPool
    target: Identity
    todo: list[bool]
    """Per unit, whether this run writes it (units already at the target are skipped)."""

    @property
    def reads(self) -> Sequence[UnitReads]:
        return self.job.reads

    @property
    def source(self) -> SourceInfo:
        return self.job.source

    @property
    def peers(self) -> Mapping[int, PeerUnit]:
        return self.job.peers


class StepRunner:
    """Runs the steps of one load on this thread, with reader threads beside it (one per
    step read ahead)."""

    def __init__(
        self,
        rank: int,
        reader: Reader,
        converter: Converter,
        ids: UnitIdentities,
        run: RunInputs,
        stats: RunStats,
        meter: Meter,
        *,
        progress: Callable[[int, int, int], None] | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.fence = fence or Fence()
        self.rank = rank
        self.reader = reader
        self.converter = converter
        self.ids = ids
        self.run = run
        self.stats = stats
        self.meter = meter
        self.progress = progress
        self._pending: InFlight[int] = InFlight(
            run.pool, run.opts.read_ahead, name=f"mxload-read-{rank}"
        )
        """Steps read ahead, by index, in step order."""
        self._local = False
        self._merge = False

    def run_steps(self, steps: Sequence[StepPlan]) -> None:
        """Every step with a unit to write, in order; then the backend synchronized.
        Nothing is left leased or running when this returns or raises."""
        with self._pending:
            if any(self.run.todo):
                storage = self.reader.storage(self.run.source)
                self._local = bool(getattr(storage, "is_local", False))
                # One storage call for a whole step only where that fetches what one call
                # per unit would: remote reads coalesce within a call, and the plan
                # predicts their bytes and requests unit by unit.
                self._merge = bool(getattr(storage, "reads_ranges_apart", False))
            for s, step in enumerate(steps):
                members = [i for i in step.units if self.run.todo[i]]
                if members:
                    self._run_step(steps, s, members)
            self.converter.backend.synchronize()

    def _run_step(self, steps: Sequence[StepPlan], s: int, members: list[int]) -> None:
        if len(steps[s].chunks) == 1:
            self._whole_step(steps, s, members)
        else:
            self._chunked_step(steps[s])
        for i in members:
            self.ids.ids[i] = self.run.target
            self.stats.units += 1
        self.meter.sample()
        if self.progress is not None:
            for i in members:
                self.progress(i + 1, len(self.run.units), self.stats.bytes_read)

    def _inline(self, r: StepRead) -> bool:
        """Whether ``r`` is read on this thread (:data:`INLINE_READ_BYTES`)."""
        return self._local and not r.from_peer and r.nbytes <= INLINE_READ_BYTES

    def _step_read(self, members: Sequence[int]) -> StepRead:
        run = self.run
        return self.reader.step_read(members, run.units, run.reads, run.peers, merge=self._merge)

    def _whole_step(self, steps: Sequence[StepPlan], s: int, members: list[int]) -> None:
        """A step of whole units: read (or collect its read-ahead), take the next step's
        leases, convert and write, then fill the next step's leases."""
        run, reader = self.run, self.reader
        t_r = time.perf_counter()
        plan = self._step_read(members)
        if self._pending.first == s:
            leases, raw, fetched = self._pending.collect()[1]
        else:
            leases, raw, fetched = self._pending.now(
                reader.read_step, plan, run.source, run.pool, inline=self._inline(plan)
            )
        self.stats.read_seconds += time.perf_counter() - t_r
        self.stats.bytes_read += fetched
        self._units_read(members)
        later = self._read_ahead(steps, s)
        try:
            self._convert_and_write(
                [
                    (run.units[i], run.reads[i], r, run.units[i].row0)
                    for i, r in zip(members, raw, strict=True)
                ],
                leases,
            )
        except BaseException:
            if later is not None:
                release_all(run.pool, later[2])
            raise
        if later is not None:
            t_r = time.perf_counter()
            t, nxt, taken = later
            self._pending.issue(t, reader.fill_step, nxt, run.source, run.pool, taken, inline=True)
            self.stats.read_seconds += time.perf_counter() - t_r

    def _read_ahead(
        self, steps: Sequence[StepPlan], s: int
    ) -> tuple[int, StepRead, list[Leased]] | None:
        """The leases of the steps read ahead of this one (up to ``ahead_to``) that no
        earlier step took, taken before this one converts (the schedule's peak). A small
        local read (only ever the next step) is returned, to be filled on this thread
        after the conversion (an accelerator converts meanwhile); any other is filled on
        a reader thread now."""
        if not steps[s].prefetch_next:
            return None
        last = self._pending.last
        first = last + 1 if last is not None else s + 1
        for t in range(first, min(steps[s].ahead_to, len(steps) - 1) + 1):
            ahead = [j for j in steps[t].units if self.run.todo[j]]
            if not ahead:
                continue
            nxt = self._step_read(ahead)
            taken = self.reader.take_step(nxt, self.run.pool)
            if self._inline(nxt):
                return t, nxt, taken
            self._pending.issue(
                t, self.reader.fill_step, nxt, self.run.source, self.run.pool, taken
            )
        return None

    def _chunked_step(self, step: StepPlan) -> None:
        """One unit in row chunks, each read, converted and written in turn: until the
        last lands the unit holds no one version."""
        run = self.run
        i = step.first
        unit = run.units[i]
        self.ids.ids[i] = NOTHING
        src = run.source
        for chunk in step.chunks:
            su = sub_unit(unit, chunk.start, chunk.end)
            sr = sub_reads(
                unit,
                run.reads[i],
                chunk.start,
                chunk.end,
                block_n=src.block_n,
                source_quant=src.quant,
            )
            t_r = time.perf_counter()
            leases, raw_parts, fetched = self.reader.read(su, sr, src, run.pool)
            self.stats.read_seconds += time.perf_counter() - t_r
            self.stats.bytes_read += fetched
            if chunk is step.chunks[-1]:
                self._units_read([i])
            self._convert_and_write([(su, sr, raw_parts, unit.row0 + chunk.start)], leases)

    def _units_read(self, members: Sequence[int]) -> None:
        """Tell a storage that streams (a refit's receive ring) that ``members`` are read
        whole, so the bytes they were read from can be reused."""
        given = self.reader.given
        if given is not None and hasattr(given, "units_read"):
            given.units_read(members)

    def _convert_and_write(self, members: Sequence[Member], leases: list[Lease]) -> None:
        """Convert a step, then run its writes; every lease of the step is released."""
        run = self.run
        reservations: list[Lease] = []
        try:
            t_c = time.perf_counter()
            try:
                converted = self.converter.convert(members, run.source, run.pool, run.opts)
            except MxloadError:
                raise
            except Exception as err:  # a numerics failure names rank and tensor
                names = ", ".join(dict.fromkeys(m[0].buffer for m in members))
                raise RunError(
                    f"rank {self.rank}: converting {names}: {type(err).__name__}: {err}",
                    rank=self.rank,
                    tensor=members[0][0].buffer,
                ) from err
            reservations = converted.reservations
            self.fence.check(run.source.fence, self.rank)  # before this unit's first write
            for write in converted.writes:
                write()
            self.stats.convert_seconds += time.perf_counter() - t_c
        finally:
            for lease in leases + reservations:
                run.pool.release(lease)
