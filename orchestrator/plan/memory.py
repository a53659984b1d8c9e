"""The memory model: staging per rank, chunking, minimum budgets (docs/contract.md §6). Pure.

The rank loader (``mxload.workers.rank``) runs exactly the schedule this module
describes, so its staging high-water mark can be held against the prediction:

* Units are converted one at a time, in plan order. A unit's staging is
  ``read`` (its checkpoint bytes, landed by storage) + ``out`` (the converted MX payload
  and scale bytes, or the resolved model-dtype tensor, in source orientation, copied into
  the persistent buffer once the unit is complete) + ``scratch`` (the resolved
  model-dtype intermediate of the unfused reference path; the fused CPU path has none).
* A unit larger than the budget is converted in row chunks (MX groups run along K, so
  row chunks are exact, docs/contract.md §6). Chunks are as tall as the budget allows, aligned to
  the source tile height where possible so scale tiles are not read twice. Reloads keep
  units whole (a buffer never holds a half-written unit), so chunking is load-only.
* Consecutive small MX units that one launch of the fused CPU kernel converts (TP-sharded
  experts' halves, 0.4-0.8 MB of staging at tp = 8) share a *step*: read together,
  converted in one launch, written unit by unit once all are converted. A step holds the
  sum of its units' staging and grows only while every read-ahead the one-unit schedule
  would make is still made (``_steps``). Every other unit is a step of its own.
* While step ``i`` converts, the reads of step ``i+1`` are issued if
  ``staging(i) + read(i+1)`` fits the budget (prefetch). The decision is taken from
  sizes alone, before any timing, so the peak is a deterministic function of the plan.

``device`` chooses where bytes live: on ``cpu`` everything is host memory; on an
accelerator the read buffers are host (pinned) memory and ``out``/``scratch`` are device
memory, plus the transient float32 temporaries of the unfused resolve (the eager torch
ops allocate them on the device allocator, so ``max_memory_allocated`` sees them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import StagingBudgetError
from .formats import MX_GROUP, ceil_div
from .ranges import ByteRange
from .types import StagingEstimate, Unit, UnitReads

MODEL_DTYPE_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}

MIN_CHUNK_ROWS = 16
"""Shortest row chunk the loader will convert; sets the load minimum budget."""

ReadBytesFn = Callable[[Unit, int, int], int]
"""(unit, row_start, row_end) -> checkpoint bytes the rows need (weight + covering scales)."""


@dataclass(frozen=True)
class UnitCost:
    """Staging of one unit (or chunk), itemised."""

    read: int
    out: int
    scratch: int
    transient: int = 0
    """Device-allocator temporaries outside the pool (unfused resolve on an accelerator)."""

    @property
    def pool(self) -> int:
        """Bytes taken from the staging pool."""
        return self.read + self.out + self.scratch

    @property
    def total(self) -> int:
        return self.pool + self.transient


REMOTE_READ_AHEAD = 8
"""Steps a rank reading an object store keeps in flight ahead of the one converting
(within its staging budget). bench/bench_whole_rows.py measured it."""


@dataclass(frozen=True)
class ConvertOptions:
    """What decides the per-unit cost besides the unit itself."""

    model_dtype: str = "bf16"
    source_quant: str = "block_fp8"
    """block_fp8 | mxfp8 | none: how the checkpoint being read stores quantized linears."""
    fused: bool = True
    """The fused CPU kernel resolves and quantizes in one pass: no resolved intermediate."""
    device: str = "cpu"
    block_n: int = 128
    """Row alignment of chunks: the source's tile height for block-FP8, else 1."""
    read_ahead: int = 1
    """Most steps whose reads are in flight ahead of the converting one. Remote reads
    wait a request latency each, so a rank reading an object store keeps
    :data:`REMOTE_READ_AHEAD` of them going; a local read has no such wait and keeps
    one, read on the converting thread when small."""

    @classmethod
    def for_source(
        cls,
        model_dtype: str,
        source_quant: str,
        source_block_n: int,
        *,
        fused: bool = True,
        device: str = "cpu",
        remote: bool = False,
    ) -> ConvertOptions:
        """The options of a run reading a ``source_quant`` checkpoint whose block-FP8
        tiles are ``source_block_n`` rows high, from an object store when ``remote``.
        The planner, a session and every rank build theirs here, so the plan's estimate
        and the rank's schedule chunk and read ahead alike."""
        return cls(
            model_dtype=model_dtype,
            source_quant=source_quant,
            fused=fused,
            device=device,
            block_n=source_block_n if source_quant == "block_fp8" else 1,
            read_ahead=REMOTE_READ_AHEAD if remote else 1,
        )


def unit_cost(unit: Unit, rows: int, read_bytes: int, opts: ConvertOptions) -> UnitCost:
    """Staging of ``rows`` rows of ``unit`` whose reads total ``read_bytes``."""
    k = unit.cols
    msize = MODEL_DTYPE_SIZE[opts.model_dtype]
    out = 0
    scratch = 0
    transient = 0
    if unit.layout in ("mx_linear", "mx_moe"):
        if unit.quantized and opts.source_quant == "mxfp8":
            out = 0  # already MX: the read buffer is repacked straight into the buffer
        else:
            # payload [K, rows] + paired scales [ceil(g/2), rows, 2] (docs/contract.md §2.3 layout)
            out = rows * k + rows * 2 * ceil_div(ceil_div(k, MX_GROUP), 2)
            if unit.quantized and not opts.fused:
                scratch = rows * k * msize
                if opts.device != "cpu":
                    transient = 2 * rows * k * 4  # f32(W) and the f32 product
    elif unit.quantized:
        out = rows * k * msize  # resolved fallback, model dtype
        if not opts.fused and opts.device != "cpu":
            transient = 2 * rows * k * 4
    return UnitCost(read=read_bytes, out=out, scratch=scratch, transient=transient)


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, end)`` of a unit, converted as one piece."""

    start: int
    end: int


def chunk_rows(
    unit: Unit, budget: int, read_fn: ReadBytesFn, opts: ConvertOptions
) -> tuple[Chunk, ...] | None:
    """Split ``unit`` into row chunks that each fit ``budget``; None if even
    MIN_CHUNK_ROWS rows do not fit. The whole unit is one chunk when it fits."""
    if unit.rows == 0:
        return (Chunk(0, 0),)
    if unit_cost(unit, unit.rows, read_fn(unit, 0, unit.rows), opts).pool <= budget:
        return (Chunk(0, unit.rows),)
    # Largest chunk height h (aligned to the tile height when >= it) whose every chunk fits.
    align = opts.block_n if opts.block_n > 0 else 1
    lo, hi = 1, unit.rows
    best = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        h = mid if mid < align else (mid // align) * align
        h = max(h, 1)
        if all(
            unit_cost(unit, c.end - c.start, read_fn(unit, c.start, c.end), opts).pool <= budget
            for c in _split(unit.rows, h)
        ):
            best = max(best, h)
            lo = mid + 1
        else:
            hi = mid - 1
    if best < min(MIN_CHUNK_ROWS, unit.rows):
        return None
    return _split(unit.rows, best)


def _split(rows: int, h: int) -> tuple[Chunk, ...]:
    return tuple(Chunk(s, min(s + h, rows)) for s in range(0, rows, h))


@dataclass(frozen=True)
class StepPlan:
    """What the loader does in one step: unit ``first`` whole or in row chunks, or
    (``count`` > 1) the units ``first .. first + count - 1``, whole, read and converted
    together; and whether it prefetches the next step's reads."""

    first: int
    count: int
    chunks: tuple[Chunk, ...]
    """Row chunks of unit ``first`` (one whole-unit chunk when it is not chunked)."""
    prefetch_next: bool
    ahead_to: int = -1
    """The last step whose reads are taken (and in flight) while this one converts;
    below the next step's index when none is."""

    @property
    def units(self) -> range:
        return range(self.first, self.first + self.count)


BATCH_UNIT_BYTES = 2 << 20
"""Largest unit staging (read + out) that shares a step with its neighbours. A step has a
fixed cost (its read call, leases, checks, kernel launch and writes) about that of
converting a TP-sharded expert half, so small units share it; a larger unit's fixed
cost is small next to its conversion, and its merged reads would leave the converting
thread (``INLINE_READ_BYTES`` of the rank loader)."""


def batchable(unit: Unit, cost: UnitCost, opts: ConvertOptions) -> bool:
    """Whether ``unit`` (whole staging ``cost``) may share a step with its neighbours: a
    small MX unit that the fused CPU kernel converts from block FP8, where one launch can
    take several units."""
    return (
        cost.pool <= BATCH_UNIT_BYTES
        and unit.layout in ("mx_linear", "mx_moe")
        and unit.quantized
        and opts.source_quant == "block_fp8"
        and opts.fused
        and opts.device == "cpu"
    )


def _sum_costs(costs: Sequence[UnitCost]) -> UnitCost:
    """The staging of a step: the sums over its units."""
    return UnitCost(
        read=sum(c.read for c in costs),
        out=sum(c.out for c in costs),
        scratch=sum(c.scratch for c in costs),
        transient=sum(c.transient for c in costs),
    )


def _steps(
    units: Sequence[Unit], whole: Sequence[UnitCost], opts: ConvertOptions, budget: int
) -> list[tuple[int, int]]:
    """(first, count) of each step. A run of consecutive batchable units is cut into steps
    greedily: a unit joins the step while the step's staging, with the reads of the unit
    after it, fits the budget, and (when the previous step could read this one ahead) the
    step's reads still fit beside the previous step's staging. So every read-ahead of
    the one-unit-a-step schedule is still made: batching never serializes a read."""
    out: list[tuple[int, int]] = []
    prev_pool = 0
    i = 0
    while i < len(units):
        j = i + 1
        pool, read = whole[i].pool, whole[i].read
        if batchable(units[i], whole[i], opts):
            into = prev_pool + read <= budget  # the previous step reads this one ahead
            while j < len(units) and batchable(units[j], whole[j], opts):
                p2, r2 = pool + whole[j].pool, read + whole[j].read
                after = whole[j + 1].read if j + 1 < len(units) else 0
                if p2 + after > budget or (into and prev_pool + r2 > budget):
                    break
                pool, read = p2, r2
                j += 1
        out.append((i, j - i))
        prev_pool = pool
        i = j
    return out


def schedule(
    units: Sequence[Unit],
    read_fn: ReadBytesFn,
    opts: ConvertOptions,
    budget: int,
    *,
    whole_units: bool,
) -> tuple[tuple[StepPlan, ...], StagingEstimate]:
    """The loader's steps for ``units`` under ``budget`` and the staging they peak at.

    A step of several units holds the sum of their staging. ``whole_units`` (reload):
    every unit must fit whole; raises StagingBudgetError if not.
    """
    steps: list[StepPlan] = []
    peak = peak_read = peak_scratch = peak_device = peak_host = 0
    max_chunk_rows = 0
    any_prefetch = False
    whole = [unit_cost(u, u.rows, read_fn(u, 0, u.rows), opts) for u in units]
    spans = _steps(units, whole, opts, budget)
    step_cost = [whole[f] if n == 1 else _sum_costs(whole[f : f + n]) for f, n in spans]
    reads_to = [0]
    for cost_s in step_cost:
        reads_to.append(reads_to[-1] + cost_s.read)
    end = -1  # the last step whose reads are taken so far
    waits = 0.0
    for s, (first, count) in enumerate(spans):
        unit = units[first]
        if step_cost[s].pool <= budget:
            chunks: tuple[Chunk, ...] = (Chunk(0, unit.rows),)
            costs = [step_cost[s]]
        else:
            if whole_units:
                raise StagingBudgetError(
                    f"--staging-budget {budget} bytes is below unit {unit.buffer!r} "
                    f"({whole[first].pool} bytes); a reload keeps units whole",
                    tensor=unit.buffer,
                    key="--staging-budget",
                )
            found = chunk_rows(unit, budget, read_fn, opts)
            if found is None:
                raise StagingBudgetError(
                    f"--staging-budget {budget} bytes cannot hold {MIN_CHUNK_ROWS} rows of "
                    f"{unit.buffer!r}",
                    tensor=unit.buffer,
                    key="--staging-budget",
                )
            chunks = found
            costs = [
                unit_cost(unit, c.end - c.start, read_fn(unit, c.start, c.end), opts)
                for c in chunks
            ]
        if len(chunks) == 1:
            end = _extend_ahead(s, max(end, s), step_cost, reads_to, budget, opts.read_ahead)
        prefetch = end > s
        any_prefetch = any_prefetch or prefetch
        waits += 1.0 / (end - s) if prefetch else 1.0
        ahead = reads_to[end + 1] - reads_to[s + 1] if prefetch else 0
        # While this step's reads land, earlier steps may have read them ahead already;
        # the pool holds this step's chunk (read + out + scratch) plus the reads of the
        # steps read ahead of it.
        rows = max(units[i].rows for i in range(first, first + count))
        for c, cost in zip(chunks, costs, strict=True):
            pool = cost.pool + ahead
            total = pool + cost.transient
            max_chunk_rows = max(max_chunk_rows, c.end - c.start if count == 1 else rows)
            if total > peak:
                peak = total
                peak_read = cost.read + ahead
                peak_scratch = cost.out + cost.scratch + cost.transient
                if opts.device == "cpu":
                    peak_device, peak_host = 0, total
                else:
                    peak_device, peak_host = peak_scratch, peak_read
        steps.append(
            StepPlan(
                first=first,
                count=count,
                chunks=chunks,
                prefetch_next=prefetch,
                ahead_to=end if prefetch else s,
            )
        )
    estimate = StagingEstimate(
        budget_bytes=budget,
        read_bytes=peak_read,
        scratch_bytes=peak_scratch,
        staging_bytes=peak,
        device_bytes=peak_device,
        host_bytes=peak_host,
        chunk_rows=max_chunk_rows,
        prefetch=any_prefetch,
        read_ahead=len(spans) / waits if waits else 1.0,
    )
    return tuple(steps), estimate


def _extend_ahead(
    s: int, end: int, cost: Sequence[UnitCost], reads_to: Sequence[int], budget: int, most: int
) -> int:
    """The last step read ahead while step ``s`` converts: ``end`` (what earlier steps
    already read ahead) extended by whole steps, at most ``most`` past ``s``, while every
    step from ``s`` to the new one holds its own staging plus the reads ahead of it within
    ``budget`` (so a window, once taken, fits each step it spans)."""
    while end + 1 < len(cost) and end + 1 - s <= most and cost[end + 1].pool <= budget:
        j = end + 1
        if any(cost[t].pool + reads_to[j + 1] - reads_to[t + 1] > budget for t in range(s, j)):
            break
        end = j
    return end


def min_budgets(
    units: Sequence[Unit], read_fn: ReadBytesFn, opts: ConvertOptions
) -> tuple[int, int]:
    """(load minimum, reload minimum) staging budgets in bytes (docs/contract.md §6).

    Reload: the largest whole unit (:func:`reload_min_budget`). Load: the largest
    MIN_CHUNK_ROWS-row chunk (row chunks are exact; shorter ones would re-read scale tiles
    many times over)."""
    load_min = 0
    for u in units:
        h = min(MIN_CHUNK_ROWS, u.rows)
        worst = 0
        for c in _split(u.rows, h) if u.rows else ():
            worst = max(worst, unit_cost(u, c.end - c.start, read_fn(u, c.start, c.end), opts).pool)
        load_min = max(load_min, worst)
    return load_min, reload_min_budget(units, read_fn, opts)


def reload_min_budget(units: Sequence[Unit], read_fn: ReadBytesFn, opts: ConvertOptions) -> int:
    """The reload minimum staging budget in bytes: the largest whole unit. Cheap beside
    the load minimum, which slices every unit's reads into row chunks."""
    return max((unit_cost(u, u.rows, read_fn(u, 0, u.rows), opts).pool for u in units), default=0)


# --- row slices of units and of their reads -------------------------------------------------


def sub_unit(unit: Unit, start: int, end: int) -> Unit:
    """The rows ``[start, end)`` of ``unit`` as a unit of their own (parts clipped)."""
    from dataclasses import replace

    parts = []
    for p in unit.parts:
        lo = max(start, p.dst_row)
        hi = min(end, p.dst_row + p.nrows)
        if lo >= hi:
            continue
        r0 = p.rows[0] + (lo - p.dst_row)
        parts.append(replace(p, rows=(r0, r0 + (hi - lo)), dst_row=lo - start))
    return replace(unit, rows=end - start, parts=tuple(parts))


def slice_rows(rng: ByteRange, nrows: int, i: int, j: int) -> ByteRange:
    """Rows ``[i, j)`` of a range holding ``nrows`` equal rows (strided, one segment per
    row, or one contiguous run of whole rows)."""
    if nrows == 0 or i >= j:
        return ByteRange(rng.start, 0, 0, 0)
    if rng.count == nrows and nrows > 1:
        return ByteRange(rng.start + i * rng.stride, rng.length, rng.stride, j - i)
    if rng.count == 1:
        row = rng.length // nrows
        if row * nrows != rng.length:
            raise ValueError(f"range {rng} does not hold {nrows} equal rows")
        return ByteRange(rng.start + i * row, (j - i) * row, (j - i) * row, 1)
    if rng.count == nrows:  # nrows == 1
        return rng
    raise ValueError(f"range {rng} does not hold {nrows} rows")


def proportional_read_fn(units: Sequence[Unit], unit_read_bytes: Sequence[int]) -> ReadBytesFn:
    """Read bytes of a row range as the unit's share of its total (config-only plans,
    where no byte ranges exist). Exact for whole units; rounded up for chunks."""
    totals = {id(u): b for u, b in zip(units, unit_read_bytes, strict=True)}

    def read_fn(unit: Unit, start: int, end: int) -> int:
        total = totals.get(id(unit))
        if total is None:
            raise KeyError(unit.buffer)
        if unit.rows == 0 or (start == 0 and end == unit.rows):
            return total
        return ceil_div(total * (end - start), unit.rows)

    return read_fn


def rank_staging(
    units: Sequence[Unit],
    unit_read_bytes: Sequence[int] | ReadBytesFn,
    opts: ConvertOptions,
    budget: int | None,
    *,
    whole_units: bool = False,
) -> StagingEstimate:
    """Staging of one rank under ``budget`` (default: the reload minimum)."""
    read_fn = (
        unit_read_bytes
        if callable(unit_read_bytes)
        else proportional_read_fn(units, unit_read_bytes)
    )
    if budget is None:
        budget = reload_min_budget(units, read_fn, opts)
    _, estimate = schedule(units, read_fn, opts, budget, whole_units=whole_units)
    return estimate


def sub_reads(
    unit: Unit, reads: UnitReads, start: int, end: int, *, block_n: int, source_quant: str
) -> UnitReads:
    """The reads of rows ``[start, end)`` of ``unit``, part by part (same order as
    ``sub_unit(unit, start, end).parts``): weight rows sliced, and for block-FP8 the tile
    rows covering them (floor of first and last row, docs/contract.md §2.1)."""
    from dataclasses import replace

    out = []
    for p, pr in zip(unit.parts, reads.parts, strict=True):
        lo = max(start, p.dst_row)
        hi = min(end, p.dst_row + p.nrows)
        if lo >= hi:
            continue
        i, j = lo - p.dst_row, hi - p.dst_row
        weight = slice_rows(pr.weight, p.nrows, i, j)
        scale = pr.scale
        tile_rows = pr.tile_rows
        if pr.scale is not None:
            if source_quant == "block_fp8" and block_n > 0:
                t0 = (p.rows[0] + i) // block_n
                t1 = (p.rows[0] + j - 1) // block_n + 1
                ntiles = pr.tile_rows[1] - pr.tile_rows[0]
                scale = slice_rows(pr.scale, ntiles, t0 - pr.tile_rows[0], t1 - pr.tile_rows[0])
                tile_rows = (t0, t1)
            else:  # MXFP8: one scale row per weight row
                scale = slice_rows(pr.scale, p.nrows, i, j)
        out.append(replace(pr, weight=weight, scale=scale, tile_rows=tile_rows))
    return UnitReads(parts=tuple(out))


def read_fn_from_reads(
    units: Sequence[Unit], reads: Sequence[UnitReads], *, block_n: int, source_quant: str
) -> ReadBytesFn:
    """Exact read bytes of any row range, from the rank's planned byte ranges."""
    by_id = {id(u): r for u, r in zip(units, reads, strict=True)}

    def read_fn(unit: Unit, start: int, end: int) -> int:
        r = by_id[id(unit)]
        if start == 0 and end == unit.rows:
            return r.nbytes
        return sub_reads(unit, r, start, end, block_n=block_n, source_quant=source_quant).nbytes

    return read_fn
