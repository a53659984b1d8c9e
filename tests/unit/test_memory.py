"""The memory model (docs/contract.md §6): schedules, row chunks and the reads of row chunks. No Ray.

Invariants in the spirit of Run:ai's partition tests, checked on the units of real plans
(synthetic checkpoints with partial tiles, merged parts and experts):

* ``chunk_rows`` covers a unit's rows exactly once, in order, and every chunk's staging
  fits the budget;
* ``sub_reads`` of all chunks of a unit cover the unit's weight bytes exactly once, and
  each chunk's scale tiles are the floor of its first and last source row (docs/contract.md §2.1),
  never ``ceil`` of an offset;
* ``sub_unit`` clips parts without losing or repeating a source row;
* ``min_budgets`` is a real minimum: the schedule runs at it and is refused one byte
  below it, with a StagingBudgetError naming ``--staging-budget``.

Expected values are computed here from the unit's geometry, not taken from the module.
"""

from __future__ import annotations

from collections import Counter

import pytest
from mxload.orchestrator.errors import StagingBudgetError
from mxload.orchestrator.plan.memory import (
    BATCH_UNIT_BYTES,
    MIN_CHUNK_ROWS,
    Chunk,
    ConvertOptions,
    batchable,
    chunk_rows,
    min_budgets,
    read_fn_from_reads,
    schedule,
    slice_rows,
    sub_reads,
    sub_unit,
    unit_cost,
)
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.ranges import ByteRange
from mxload.orchestrator.plan.types import ParallelLayout, RankPlan, Unit
from mxload.orchestrator.runtime.catalog import open_checkpoint

CASES = {
    # partial tiles (hidden 160, q rows 96 per rank at tp=2 start mid-tile), odd groups
    "awkward-tp2": ("qwen3-moe-awkward", ParallelLayout(tp=2)),
    "awkward-tp2-dp2-ep": (
        "qwen3-moe-awkward",
        ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
    ),
    "moe-tp2-dp2-ep": ("qwen3-moe-tiny", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)),
    "moe-tp4": ("qwen3-moe-tiny", ParallelLayout(tp=4)),
    "dense-tp2-pp2": ("qwen3-dense-tiny", ParallelLayout(tp=2, pp=2)),
    # An MXFP8 checkpoint (mxload convert): one U8 scale row per weight row.
    "mxfp8-tp2-ep": ("mxfp8:qwen3-moe-tiny", ParallelLayout(tp=2, enable_expert_parallel=True)),
}


@pytest.fixture(scope="module")
def plans(ckpt_factory, tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            preset, layout = CASES[case]
            src = ckpt_factory(preset.removeprefix("mxfp8:"), 3)
            if preset.startswith("mxfp8:"):
                from mxload.orchestrator.tools.convert import convert_checkpoint

                dst = str(tmp_path_factory.mktemp("mxfp8") / "ckpt")
                convert_checkpoint(src, dst)
                src = dst
            meta = open_checkpoint(src)
            cache[case] = (meta, build_plan(meta.config, layout, checkpoint=meta))
        return cache[case]

    return get


def _block_n(meta) -> int:
    """Tile height of the source scales (MXFP8: one scale row per weight row)."""
    q = meta.config.quant
    return q.block_n if q.kind == "block_fp8" else 1


def _opts(meta, fused: bool = True) -> ConvertOptions:
    return ConvertOptions(
        model_dtype=meta.config.model_dtype,
        source_quant=meta.config.quant.kind,
        fused=fused,
        block_n=_block_n(meta),
    )


def _read_fn(meta, rp: RankPlan):
    return read_fn_from_reads(
        rp.units, rp.reads, block_n=_block_n(meta), source_quant=meta.config.quant.kind
    )


def _covered(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of (start, length) segments as sorted, merged [start, end) intervals;
    raises AssertionError when two segments share a byte (read twice)."""
    out: list[tuple[int, int]] = []
    for s, n in sorted(segments):
        if n == 0:
            continue
        if out and s < out[-1][1]:
            raise AssertionError(f"bytes {s}..{min(out[-1][1], s + n)} covered twice")
        if out and s == out[-1][1]:
            out[-1] = (out[-1][0], s + n)
        else:
            out.append((s, s + n))
    return out


def _budgets_between(lo: int, hi: int) -> list[int]:
    return sorted({lo, lo + (hi - lo) // 7, lo + (hi - lo) // 3, (lo + hi) // 2, hi - 1, hi})


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [True, False])
def test_chunks_cover_rows_once_and_fit(plans, case: str, fused: bool) -> None:
    meta, plan = plans(case)
    opts = _opts(meta, fused)
    for rp in plan.ranks[:2]:
        read_fn = _read_fn(meta, rp)
        load_min, reload_min = min_budgets(rp.units, read_fn, opts)
        for unit in rp.units:
            whole = unit_cost(unit, unit.rows, read_fn(unit, 0, unit.rows), opts).pool
            for budget in _budgets_between(load_min, max(reload_min, load_min + 1)):
                chunks = chunk_rows(unit, budget, read_fn, opts)
                assert chunks is not None, (unit.buffer, budget)
                starts = [c.start for c in chunks]
                ends = [c.end for c in chunks]
                assert starts[0] == 0 and ends[-1] == unit.rows, (unit.buffer, chunks)
                assert starts[1:] == ends[:-1], f"{unit.buffer}: gap or overlap {chunks}"
                assert all(c.end > c.start for c in chunks) or unit.rows == 0
                for c in chunks:
                    cost = unit_cost(unit, c.end - c.start, read_fn(unit, c.start, c.end), opts)
                    assert cost.pool <= budget, (unit.buffer, c, cost, budget)
                if whole <= budget:
                    assert len(chunks) == 1, f"{unit.buffer} fits whole but was chunked"
                else:
                    assert len(chunks) > 1
                    assert min(c.end - c.start for c in chunks[:-1]) >= MIN_CHUNK_ROWS


@pytest.mark.parametrize("case", sorted(CASES))
def test_sub_reads_cover_weight_bytes_exactly_once(plans, case: str) -> None:
    meta, plan = plans(case)
    q = meta.config.quant
    mx_scales = q.kind == "mxfp8"
    opts = _opts(meta)
    for rp in plan.ranks:
        read_fn = _read_fn(meta, rp)
        load_min, _ = min_budgets(rp.units, read_fn, opts)
        for unit, reads in zip(rp.units, rp.reads, strict=True):
            chunks = chunk_rows(unit, load_min, read_fn, opts)
            assert chunks is not None
            # Also uneven hand-made chunks, crossing tile and part boundaries.
            odd = [(0, min(37, unit.rows)), (min(37, unit.rows), unit.rows)]
            for cuts in ([(c.start, c.end) for c in chunks], odd):
                got: dict[tuple[str, str], list[tuple[int, int]]] = {}
                for start, end in cuts:
                    if start >= end:
                        continue
                    su = sub_unit(unit, start, end)
                    sr = sub_reads(
                        unit, reads, start, end, block_n=_block_n(meta), source_quant=q.kind
                    )
                    assert len(su.parts) == len(sr.parts)
                    assert su.rows == end - start
                    for p, pr in zip(su.parts, sr.parts, strict=True):
                        row_bytes = pr.weight.nbytes // max(p.nrows, 1)
                        assert pr.weight.nbytes == p.nrows * row_bytes
                        got.setdefault((pr.file, p.tensor_name), []).extend(pr.weight.segments())
                        if mx_scales and pr.scale is not None:
                            key = (pr.scale_file or pr.file, p.tensor_name + "_scale")
                            got.setdefault(key, []).extend(pr.scale.segments())
                want = {
                    (pr.file, p.tensor_name): _covered(list(pr.weight.segments()))
                    for p, pr in zip(unit.parts, reads.parts, strict=True)
                }
                if mx_scales:  # MX scales are per row: row chunks split them exactly too
                    want.update(
                        {
                            (pr.scale_file or pr.file, p.tensor_name + "_scale"): _covered(
                                list(pr.scale.segments())
                            )
                            for p, pr in zip(unit.parts, reads.parts, strict=True)
                            if pr.scale is not None
                        }
                    )
                assert set(got) == set(want), unit.buffer
                for key, segs in got.items():
                    # exactly once: no byte twice (_covered raises) and the same union
                    assert _covered(segs) == want[key], f"{unit.buffer} {key} {cuts}"


@pytest.mark.parametrize("case", ["awkward-tp2", "moe-tp4", "dense-tp2-pp2"])
def test_sub_reads_scale_tiles_are_floor_of_rows(plans, case: str) -> None:
    meta, plan = plans(case)
    q = meta.config.quant
    bn = q.block_n
    checked = 0
    for rp in plan.ranks:
        for unit, reads in zip(rp.units, rp.reads, strict=True):
            if not unit.quantized:
                continue
            for start in range(0, unit.rows, 16):
                for end in (start + 1, start + 16, min(start + 100, unit.rows)):
                    end = min(end, unit.rows)
                    if end <= start:
                        continue
                    sr = sub_reads(unit, reads, start, end, block_n=bn, source_quant=q.kind)
                    su = sub_unit(unit, start, end)
                    for p, pr in zip(su.parts, sr.parts, strict=True):
                        first, last = p.rows[0], p.rows[1] - 1
                        assert pr.tile_rows == (first // bn, last // bn + 1), (unit.buffer, p)
                        ntile_rows = pr.tile_rows[1] - pr.tile_rows[0]
                        ntile_cols = pr.tile_cols[1] - pr.tile_cols[0]
                        assert pr.scale is not None
                        assert pr.scale.nbytes == ntile_rows * ntile_cols * 4
                        checked += 1
    assert checked > 50


def test_sub_reads_scale_bytes_are_the_whole_units_tile_rows(plans) -> None:
    """A chunk's scale bytes are exactly the rows of the unit's scale range it needs."""
    meta, plan = plans("awkward-tp2")
    q = meta.config.quant
    rp = plan.ranks[1]
    n = 0
    for unit, reads in zip(rp.units, rp.reads, strict=True):
        if not unit.quantized:
            continue
        for start, end in ((0, 16), (16, 48), (unit.rows - 5, unit.rows)):
            sr = sub_reads(unit, reads, max(start, 0), end, block_n=q.block_n, source_quant=q.kind)
            su = sub_unit(unit, max(start, 0), end)
            whole_by_tensor = {
                p.tensor_name: pr for p, pr in zip(unit.parts, reads.parts, strict=True)
            }
            for p, pr in zip(su.parts, sr.parts, strict=True):
                wp = whole_by_tensor[p.tensor_name]
                i0 = pr.tile_rows[0] - wp.tile_rows[0]
                i1 = pr.tile_rows[1] - wp.tile_rows[0]
                if wp.scale.count > 1:  # one segment per tile row
                    expect = _covered(list(wp.scale.segments())[i0:i1])
                else:  # whole tile rows in one run
                    row = wp.scale.length // (wp.tile_rows[1] - wp.tile_rows[0])
                    expect = _covered([(wp.scale.start + i0 * row, (i1 - i0) * row)])
                got = _covered(list(pr.scale.segments()))
                assert got == expect, (unit.buffer, p.tensor_name, start, end)
                n += 1
    assert n > 10


def test_sub_unit_parts_keep_every_source_row_once(plans) -> None:
    _, plan = plans("moe-tp2-dp2-ep")
    for unit in plan.ranks[0].units:
        for h in (1, 7, 16, 50):
            rows: Counter = Counter()
            dst: list[int] = []
            for start in range(0, unit.rows, h):
                su = sub_unit(unit, start, min(start + h, unit.rows))
                for p in su.parts:
                    rows.update((p.tensor_name, r) for r in range(*p.rows))
                    assert 0 <= p.dst_row and p.dst_row + p.nrows <= su.rows
                    dst.extend(range(start + p.dst_row, start + p.dst_row + p.nrows))
            want = Counter((p.tensor_name, r) for p in unit.parts for r in range(*p.rows))
            assert rows == want, unit.buffer
            assert sorted(dst) == sorted(
                d for p in unit.parts for d in range(p.dst_row, p.dst_row + p.nrows)
            )


# --- slice_rows --------------------------------------------------------------------------


def test_slice_rows_strided_and_contiguous() -> None:
    strided = ByteRange(start=1000, length=24, stride=100, count=10)
    assert slice_rows(strided, 10, 3, 7) == ByteRange(1300, 24, 100, 4)
    assert slice_rows(strided, 10, 0, 10).nbytes == strided.nbytes
    run = ByteRange(start=64, length=10 * 32, stride=10 * 32, count=1)
    r = slice_rows(run, 10, 2, 5)
    assert (r.start, r.nbytes) == (64 + 2 * 32, 3 * 32) and r.count == 1
    assert slice_rows(run, 10, 4, 4).nbytes == 0
    one = ByteRange(start=8, length=40, stride=40, count=1)
    assert slice_rows(one, 1, 0, 1) == one


@pytest.mark.parametrize(
    "rng,nrows",
    [
        (ByteRange(0, 33, 33, 1), 2),  # 33 bytes cannot be 2 equal rows
        (ByteRange(0, 8, 16, 3), 5),  # 3 segments are not 5 rows
    ],
)
def test_slice_rows_refuses_ranges_that_are_not_rows(rng: ByteRange, nrows: int) -> None:
    with pytest.raises(ValueError):
        slice_rows(rng, nrows, 0, 1)


# --- schedule and minimum budgets ---------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_min_budgets_are_minimums(plans, case: str) -> None:
    meta, plan = plans(case)
    opts = _opts(meta)
    for rp in plan.ranks:
        read_fn = _read_fn(meta, rp)
        load_min, reload_min = min_budgets(rp.units, read_fn, opts)
        assert 0 < load_min <= reload_min
        # The reload minimum is the largest whole unit, counted here from unit_cost.
        largest = max(unit_cost(u, u.rows, read_fn(u, 0, u.rows), opts).pool for u in rp.units)
        assert reload_min == largest
        steps, est = schedule(rp.units, read_fn, opts, reload_min, whole_units=True)
        assert all(len(s.chunks) == 1 for s in steps)
        assert est.staging_bytes <= reload_min
        steps, est = schedule(rp.units, read_fn, opts, load_min, whole_units=False)
        assert est.staging_bytes <= load_min
        with pytest.raises(StagingBudgetError, match="--staging-budget") as err:
            schedule(rp.units, read_fn, opts, reload_min - 1, whole_units=True)
        assert err.value.key == "--staging-budget"
        assert err.value.tensor in {u.buffer for u in rp.units}
        assert err.value.tensor in str(err.value)
        with pytest.raises(StagingBudgetError, match="--staging-budget") as err:
            schedule(rp.units, read_fn, opts, load_min - 1, whole_units=False)
        assert err.value.key == "--staging-budget"
        assert err.value.exit_code == 2


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case", ["awkward-tp2", "moe-tp2-dp2-ep", "mxfp8-tp2-ep"])
def test_schedule_peak_is_the_max_over_steps(plans, case: str, fused: bool) -> None:
    """The estimate recomputed by hand from the units' sizes (:func:`_pool_by_hand`,
    :func:`_read_by_hand`, not the module's cost helpers): each chunk's pool bytes (a
    step of several units: the sum of theirs) plus the next step's reads when the step
    prefetches; never above the budget. Steps cover the units in order, once."""
    meta, plan = plans(case)
    opts = _opts(meta, fused)
    rp = plan.ranks[0]
    read_fn = _read_fn(meta, rp)
    load_min, reload_min = min_budgets(rp.units, read_fn, opts)

    def read(i: int, start: int, end: int) -> int:
        return _read_by_hand(meta, rp.units[i], rp.reads[i], start, end)

    def pool(i: int, start: int, end: int) -> int:
        return _pool_by_hand(meta, rp.units[i], end - start, read(i, start, end), fused)

    batched = 0
    for budget in _budgets_between(load_min, 2 * reload_min):
        steps, est = schedule(rp.units, read_fn, opts, budget, whole_units=False)
        assert [i for s in steps for i in s.units] == list(range(len(rp.units)))
        peak = 0
        for j, step in enumerate(steps):
            ahead = 0
            if step.prefetch_next:
                assert len(step.chunks) == 1 and j + 1 < len(steps)
                ahead = sum(read(i, 0, rp.units[i].rows) for i in steps[j + 1].units)
            if step.count > 1:
                batched += 1
                assert step.chunks == (Chunk(0, rp.units[step.first].rows),)
                # batching kept the read-ahead into the next step where it fits at all
                if j + 1 < len(steps) and len(steps[j + 1].chunks) == 1:
                    assert step.prefetch_next
                for i in step.units:
                    u = rp.units[i]
                    assert pool(i, 0, u.rows) <= BATCH_UNIT_BYTES
                    assert batchable(u, unit_cost(u, u.rows, read_fn(u, 0, u.rows), opts), opts)
                peak = max(peak, sum(pool(i, 0, rp.units[i].rows) for i in step.units) + ahead)
                continue
            for c in step.chunks:
                peak = max(peak, pool(step.first, c.start, c.end) + ahead)
        assert est.staging_bytes == peak
        assert peak <= budget
        assert est.budget_bytes == budget
    # the fused CPU kernel batches the tiny MoE model's expert halves; nothing else batches
    if not fused:
        assert batched == 0
    elif case.startswith("moe"):
        assert batched > 0


ITEMSIZE = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4}
"""Bytes per element of the safetensors dtypes the test checkpoints hold."""


def _read_by_hand(meta, unit: Unit, reads, start: int, end: int) -> int:  # type: ignore[no-untyped-def]
    """Source bytes of rows ``[start, end)`` of ``unit``: each part's weight rows, and
    its scales: the F32 tiles covering those rows (floor of the first and last source
    row, docs/contract.md §2.1) for block-FP8, one U8 per 32 columns per row for MXFP8."""
    q = meta.config.quant
    total = 0
    for p, pr in zip(unit.parts, reads.parts, strict=True):
        lo, hi = max(start, p.dst_row), min(end, p.dst_row + p.nrows)
        if lo >= hi:
            continue
        total += (hi - lo) * p.ncols * ITEMSIZE[pr.weight_dtype]
        if pr.scale is None:
            continue
        if q.kind == "block_fp8":
            r0, r1 = p.rows[0] + lo - p.dst_row, p.rows[0] + hi - p.dst_row
            tile_rows = (r1 - 1) // q.block_n - r0 // q.block_n + 1
            tile_cols = (p.cols[1] - 1) // q.block_k - p.cols[0] // q.block_k + 1
            total += tile_rows * tile_cols * 4
        else:
            total += (hi - lo) * (p.ncols // 32)
    return total


def _pool_by_hand(meta, unit: Unit, rows: int, read: int, fused: bool) -> int:  # type: ignore[no-untyped-def]
    """Staging-pool bytes of ``rows`` rows of ``unit`` (docs/contract.md §6): the reads,
    the kernel-layout output of an MX unit (payload ``K x rows`` bytes, scales ``ceil(g/2)
    x rows x 2`` bytes, g = ceil(K/32); none when an MXFP8 source is only repacked) or
    the model-dtype rows of a resolved unit, and without the fused kernel the resolved
    model-dtype intermediate of a block-FP8 MX unit."""
    k = unit.cols
    msize = {"bf16": 2, "fp16": 2, "fp32": 4}[meta.config.model_dtype]
    out = scratch = 0
    if unit.layout in ("mx_linear", "mx_moe"):
        if not (unit.quantized and meta.config.quant.kind == "mxfp8"):
            g = -(-k // 32)
            out = rows * k + (-(-g // 2)) * rows * 2
            if unit.quantized and not fused:  # block-FP8 resolved, then quantized
                scratch = rows * k * msize
    elif unit.quantized:
        out = rows * k * msize
    return read + out + scratch


def test_batching_takes_every_small_mx_unit_that_fits() -> None:
    """Greedy and maximal: a run of batchable units fills a step while the step, with
    the next unit's reads, fits the budget, and the next step while its reads fit beside
    the step before (read-ahead kept); a unit that is not batchable (dense, or too large)
    is a step of its own and splits the run."""
    from mxload.orchestrator.plan.types import Part

    def unit(layout: str, rows: int, cols: int = 64) -> Unit:
        part = Part(module="m", rows=(0, rows), cols=(0, cols), dst_row=0)
        return Unit("b", "linear", layout, rows, cols, (part,), quantized=True)

    small = unit("mx_linear", 64)  # read 4096 + out 4096 + scales 128
    dense = unit("dense", 64)
    units = [small] * 5 + [dense] + [small] * 2
    reads = [u.rows * u.cols for u in units]
    opts = ConvertOptions(model_dtype="bf16", fused=True)
    one = unit_cost(small, 64, 4096, opts).pool
    steps, _ = schedule(
        units, lambda u, a, b: reads[units.index(u)], opts, 4 * one, whole_units=True
    )
    assert [(s.first, s.count) for s in steps] == [(0, 3), (3, 2), (5, 1), (6, 2)]
    assert all(s.prefetch_next for s in steps[:-1])
    unfused = ConvertOptions(model_dtype="bf16", fused=False)
    steps, _ = schedule(
        units, lambda u, a, b: reads[units.index(u)], unfused, 4 * one, whole_units=True
    )
    assert all(s.count == 1 for s in steps)


def test_too_small_budget_names_the_flag_and_chunk_rows_says_none(plans) -> None:
    meta, plan = plans("moe-tp4")
    opts = _opts(meta)
    rp = plan.ranks[0]
    read_fn = _read_fn(meta, rp)
    unit = max(rp.units, key=lambda u: u.rows * u.cols)
    sixteen = max(
        unit_cost(
            u, min(MIN_CHUNK_ROWS, u.rows), read_fn(u, 0, min(MIN_CHUNK_ROWS, u.rows)), opts
        ).pool
        for u in [unit]
    )
    assert chunk_rows(unit, sixteen // 2, read_fn, opts) is None
    with pytest.raises(StagingBudgetError) as err:
        schedule(rp.units, read_fn, opts, 1, whole_units=False)
    assert "--staging-budget" in str(err.value)


def test_options_for_a_source_align_chunks_to_its_tiles_only_for_block_fp8() -> None:
    # One factory for the planner, sessions and ranks: block-FP8 chunks align to the
    # tile height (a chunk reads whole tile rows), other sources to single rows.
    assert ConvertOptions.for_source("bf16", "block_fp8", 64).block_n == 64
    assert ConvertOptions.for_source("bf16", "mxfp8", 0).block_n == 1
    assert ConvertOptions.for_source("fp16", "none", 0).block_n == 1
    o = ConvertOptions.for_source("fp16", "block_fp8", 128, fused=False, device="npu")
    assert (o.model_dtype, o.source_quant, o.fused, o.device) == ("fp16", "block_fp8", False, "npu")
