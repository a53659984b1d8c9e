"""The rank loader used without Ray (docs/contract.md §4 "The per-rank loader is a plain class").

Every rank of a plan is loaded in this process by ``mxload.workers.rank.loader.RankLoader`` and its
buffers are compared byte for byte with ``tests.reference_model.expected_rank``, which
reads the checkpoint with the official safetensors library and converts it with the
independent numpy reference: nothing expected here comes from the code under test.

Covered: several layouts (TP, DP, PP, EP linear and round robin, no-EP MoE sharding,
partial tiles and odd MX groups), the reference and the fast CPU backends; a staging
budget below one unit (row chunks give the whole-unit bytes, and the measured staging
stays within the budget and within 10 % of the prediction, docs/contract.md §6); a reload into the
same buffers; adopting buffers the host owns (and refusing bad ones); non-finite block
scales (docs/contract.md §1.1, §2.2); and a second load while one runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import AdoptionError, InputError, NonFiniteScale, RunError
from mxload.orchestrator.plan.message import SourceInfo
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout, Plan, RankPlan
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import TORCH_DTYPES, RankLoader
from mxload.workers.rank.run import StepRunner

from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank

# --- helpers -------------------------------------------------------------------------------


@functools.cache
@contextlib.contextmanager
def on_each_unit(hook: Callable[[int], None]) -> Iterator[None]:
    """Call ``hook(i)`` before each unit a step writes: a test-only patch of the loader's
    step runner (faults, pauses and a record of what was written)."""
    original = StepRunner._run_step

    def patched(self: StepRunner, steps: Any, s: int, members: list[int]) -> None:
        for i in members:
            hook(i)
        original(self, steps, s, members)

    StepRunner._run_step = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepRunner._run_step = original  # type: ignore[method-assign]


def ref_of(src: str) -> RefCheckpoint:
    """One reference reader per checkpoint path (it caches resolved tensors)."""
    return RefCheckpoint(src)


def ref_layout(layout: ParallelLayout) -> Layout:
    return Layout(
        layout.tp, layout.dp, layout.pp, layout.enable_expert_parallel, layout.expert_placement
    )


def source_of(src: str, meta, *, allow_nonfinite: bool = False) -> SourceInfo:
    q = meta.config.quant
    return SourceInfo(
        root=src,
        quant=q.kind,
        block_n=q.block_n,
        block_k=q.block_k,
        allow_nonfinite=allow_nonfinite,
        fingerprint=meta.fingerprint,
    )


def plan_of(src: str, layout: ParallelLayout, *, fused: bool = False, budget: int | None = None):
    meta = open_checkpoint(src)
    plan = build_plan(meta.config, layout, checkpoint=meta, fused=fused, staging_budget=budget)
    return meta, plan


def backend(fast: bool):
    be = select_backend("cpu", prefer_fast=fast)
    if fast and not be.fused:
        pytest.skip(f"fast CPU path unavailable here: {be.note}")
    return be


def run_rank(
    src: str,
    meta,
    plan: Plan,
    rank: int,
    *,
    fast: bool = False,
    budget: int | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
    allow_nonfinite: bool = False,
):
    rp = plan.ranks[rank]
    loader = RankLoader(
        rp, model_dtype=meta.config.model_dtype, backend=backend(fast), buffers=buffers
    )
    stats = loader.load(
        list(rp.reads),
        source_of(src, meta, allow_nonfinite=allow_nonfinite),
        version=1,
        staging_budget=budget if budget is not None else rp.staging.budget_bytes,
    )
    return loader, stats


def assert_rank_matches(ck: RefCheckpoint, layout: ParallelLayout, rank: int, loader) -> None:
    problems = compare_rank(expected_rank(ck, ref_layout(layout), rank), loader.host_tensors())
    assert problems == [], f"rank {rank}: {problems[:8]}"


# --- several layouts ---------------------------------------------------------------------------

# fast: the fused CPU kernel (schedules without resolve scratch); else the reference path.
# The reference path is the default here: it is the faster of the two on these tiny
# units, and the fast kernel has its own byte-for-byte tests against it.
LAYOUTS = [
    ("qwen3-moe-tiny", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True), False),
    ("qwen3-moe-tiny", ParallelLayout(tp=2, dp=2), False),  # no EP: experts TP over dp*tp
    ("qwen3-moe-tiny", ParallelLayout(tp=4), True),  # gate+up (and q, k, v) in one launch
    ("qwen3-moe-tiny", ParallelLayout(tp=4, pp=2, enable_expert_parallel=True), False),
    ("qwen3-dense-tiny", ParallelLayout(tp=2, pp=2), True),
    ("qwen3-dense-tiny", ParallelLayout(tp=4), False),  # tp > n_kv: kv heads replicated
    (
        "qwen3-moe-awkward",
        ParallelLayout(tp=2, dp=2, enable_expert_parallel=True, expert_placement="round_robin"),
        True,
    ),
    ("qwen3-moe-awkward", ParallelLayout(tp=2, pp=2), False),  # MoE falls back (48-wide)
]


@pytest.mark.parametrize(
    "preset,layout,fast",
    LAYOUTS,
    ids=[
        f"{p}-tp{lay.tp}dp{lay.dp}pp{lay.pp}{'-ep' if lay.enable_expert_parallel else ''}"
        f"{'-rr' if lay.expert_placement == 'round_robin' else ''}-{'fast' if f else 'ref'}"
        for p, lay, f in LAYOUTS
    ],
)
def test_every_rank_matches_the_reference(ckpt_factory, preset, layout, fast) -> None:
    src = ckpt_factory(preset, 1)
    meta, plan = plan_of(src, layout, fused=fast)
    ck = ref_of(src)
    for rp in plan.ranks:
        loader, stats = run_rank(src, meta, plan, rp.rank, fast=fast)
        assert_rank_matches(ck, layout, rp.rank, loader)
        assert loader.version == 1 and loader.consistent
        assert stats.bytes_needed == rp.bytes_needed
        # Local files: what the plan predicts (strided rows under a page apart are read
        # as one span, docs/contract.md §6's amplification counts them).
        assert stats.bytes_read == rp.bytes_to_read >= rp.bytes_needed
        assert stats.units == len(rp.units)
        assert stats.measured_peak_staging_bytes <= rp.staging.budget_bytes
        report = loader.tensor_report()
        assert set(report) == {b.name for b in rp.buffers}
        for spec in rp.buffers:
            entry = report[spec.name]
            assert entry["shape"] == list(spec.shape) and entry["version"] == 1
            assert entry["data_ptr"] == loader.buffers[spec.name].data_ptr()


# --- staging below one unit ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,layout,fast",
    [
        ("qwen3-moe-tiny", ParallelLayout(tp=2), False),
        ("qwen3-moe-awkward", ParallelLayout(tp=2), False),
        ("qwen3-moe-awkward", ParallelLayout(tp=2), True),
    ],
    ids=["moe-tiny-tp2-ref", "awkward-tp2-ref", "awkward-tp2-fast"],
)
def test_row_chunked_load_equals_whole_unit_load(ckpt_factory, preset, layout, fast) -> None:
    src = ckpt_factory(preset, 2)
    meta, whole_plan = plan_of(src, layout, fused=fast)
    budget = whole_plan.min_staging_load
    assert budget < whole_plan.min_staging_reload, "the budget must be below one unit"
    _, small_plan = plan_of(src, layout, fused=fast, budget=budget)
    ck = ref_of(src)
    chunked_somewhere = False
    for rank in range(layout.world):
        whole, _ = run_rank(src, meta, whole_plan, rank, fast=fast)
        small, stats = run_rank(src, meta, small_plan, rank, fast=fast, budget=budget)
        a, b = whole.host_tensors(), small.host_tensors()
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
        assert_rank_matches(ck, layout, rank, small)
        est = stats.extra["staging_estimate"]
        chunked_somewhere |= est.chunk_rows < max(u.rows for u in small_plan.ranks[rank].units)
        measured = stats.measured_peak_staging_bytes
        predicted = stats.predicted_peak_staging_bytes
        assert measured <= budget
        assert measured <= predicted <= 1.10 * measured, (rank, measured, predicted)
        # The plan's own figure (what `mxload plan` reports and capacity is checked with)
        # holds against the pool's measured high-water mark too.
        planned = small_plan.ranks[rank].staging.staging_bytes
        assert measured <= planned <= 1.10 * measured, (rank, measured, planned)
        assert stats.bytes_read >= small_plan.ranks[rank].bytes_needed
    assert chunked_somewhere, "no unit was converted in row chunks"


def test_derived_tensors_follow_a_row_chunked_source(ckpt_factory, monkeypatch) -> None:
    """Under a budget below one kv_b_proj unit its rows are written chunk by chunk, and the
    tensors the engine derives from it (docs/contract.md §2.4) are recomputed after each
    chunk: the last leaves what a whole-unit load leaves, and what the engine's math gives
    from the loaded kv_b_proj (W_UK_T[h] = rows h*(P+V) .. +P, W_UV[h] = the next V rows,
    transposed)."""
    from mxload.workers.rank import writes

    src = ckpt_factory("deepseek-v3-tiny", 1)
    meta = open_checkpoint(src)
    cfg = meta.config
    layout = ParallelLayout(tp=1)
    engine = "vllm-ascend-main"
    whole_plan = build_plan(cfg, layout, checkpoint=meta, engine=engine)
    rp = whole_plan.ranks[0]
    kvb = [u for u in rp.units if u.derived]
    assert len(kvb) == cfg.num_hidden_layers
    budget = 2 * kvb[0].rows * kvb[0].cols  # a quarter of one kv_b_proj's resolved rows
    small_plan = build_plan(cfg, layout, checkpoint=meta, engine=engine, staging_budget=budget)
    calls: dict[str, int] = {}
    real = writes.derived

    def counted(source, dst, d):
        calls[d.buffer] = calls.get(d.buffer, 0) + 1
        return real(source, dst, d)

    monkeypatch.setattr(writes, "derived", counted)
    whole, _ = run_rank(src, meta, whole_plan, 0)
    once = dict(calls)
    calls.clear()
    small, _ = run_rank(src, meta, small_plan, 0, budget=max(budget, small_plan.min_staging_load))
    assert set(once.values()) == {1} and min(calls.values()) > 1, calls  # chunked
    p, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    for u in kvb:
        src_rows = small.buffers[u.buffer].view(-1, p + v, u.cols)
        for d in u.derived:
            got = small.buffers[d.buffer]
            assert torch.equal(got, whole.buffers[d.buffer]), d.buffer
            want = src_rows[:, :p] if d.op == "mla_uk_t" else src_rows[:, p:].transpose(1, 2)
            assert torch.equal(got, want), d.buffer


def test_default_budget_prediction_holds(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-moe-tiny", 2)
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    meta, plan = plan_of(src, layout, fused=False)
    for rank in range(layout.world):
        _, stats = run_rank(src, meta, plan, rank)
        m, p = stats.measured_peak_staging_bytes, stats.predicted_peak_staging_bytes
        assert m <= plan.ranks[rank].staging.budget_bytes
        assert m <= p <= 1.10 * m
        planned = plan.ranks[rank].staging.staging_bytes  # the plan's figure, measured
        assert m <= planned <= 1.10 * m, (rank, m, planned)


# --- reload in place -------------------------------------------------------------------------------


def test_reload_second_version_into_the_same_buffers(ckpt_factory) -> None:
    v1, v2 = ckpt_factory("qwen3-moe-tiny", 1), ckpt_factory("qwen3-moe-tiny", 2)
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    meta1, plan1 = plan_of(v1, layout, fused=False)
    meta2, plan2 = plan_of(v2, layout, fused=False)
    ck2 = ref_of(v2)
    for rank in (0, 3):
        loader, _ = run_rank(v1, meta1, plan1, rank)
        ptrs = {n: t.data_ptr() for n, t in loader.buffers.items()}
        sums1 = loader.checksums()
        rp2 = plan2.ranks[rank]
        stats = loader.reload(
            list(rp2.reads),
            source_of(v2, meta2),
            version=2,
            staging_budget=plan1.min_staging_reload,
        )
        assert {n: t.data_ptr() for n, t in loader.buffers.items()} == ptrs
        assert loader.version == 2 and loader.consistent
        assert all(e["version"] == 2 for e in loader.tensor_report().values())
        assert_rank_matches(ck2, layout, rank, loader)
        sums2 = loader.checksums()
        assert sum(sums1[n] != sums2[n] for n in sums1) > 0.9 * len(sums1)
        assert stats.measured_peak_staging_bytes <= plan1.min_staging_reload
        # A reload keeps units whole: a budget below the largest unit is refused.
        from mxload.orchestrator.errors import StagingBudgetError

        with pytest.raises(StagingBudgetError, match="--staging-budget"):
            loader.reload(
                list(rp2.reads),
                source_of(v2, meta2),
                version=3,
                staging_budget=plan1.min_staging_reload - 1,
            )
        assert loader.version == 2 and loader.checksums() == sums2


# --- adopting host buffers ----------------------------------------------------------------------------


def host_owned(
    rp: RankPlan, garbage: int = 0xA5, *, one_arena: bool = False
) -> dict[str, torch.Tensor]:
    """Buffers as an inference engine would own them, filled with garbage. ``one_arena``:
    every buffer is a view at its own offset into one flat allocation (as engines that
    pool their parameters hold them)."""
    out = {}
    if one_arena:
        sizes = [-(-spec.nbytes // 64) * 64 for spec in rp.buffers]  # 64-byte aligned
        arena = torch.full((sum(sizes),), garbage, dtype=torch.uint8)
        offset = 0
        for spec, size in zip(rp.buffers, sizes, strict=True):
            flat = arena[offset : offset + spec.nbytes]
            out[spec.name] = flat.view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
            offset += size
        return out
    for spec in rp.buffers:
        t = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
        t.view(torch.uint8).fill_(garbage)
        out[spec.name] = t
    return out


def test_adopted_buffers_are_written_in_place(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-moe-tiny", 1)  # vocab 1000 -> 1024 padded, 512 per tp rank
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    meta, plan = plan_of(src, layout, fused=False)
    ck = ref_of(src)
    vocab = ck.config["vocab_size"]
    padded_checked = 0
    for rank in range(layout.world):
        rp = plan.ranks[rank]
        mine = host_owned(rp, one_arena=rank % 2 == 1)
        ptrs = {n: t.data_ptr() for n, t in mine.items()}
        loader, _ = run_rank(src, meta, plan, rank, buffers=mine)
        assert loader.adopted
        for name, t in mine.items():
            assert loader.buffers[name] is t, f"{name}: not the host's tensor"
            assert t.data_ptr() == ptrs[name]
        # The host's own tensors hold the reference bytes (not a copy held elsewhere).
        problems = compare_rank(expected_rank(ck, ref_layout(layout), rank), mine)
        assert problems == [], f"rank {rank}: {problems[:8]}"
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name not in mine:
                continue
            per = mine[name].shape[0]
            first_pad = max(0, vocab - rp.tp_rank * per)  # local row of global row V
            if first_pad < per:  # rows past V: zeros, though the host's bytes were garbage
                pad = mine[name][first_pad:].view(torch.uint8)
                assert int(pad.count_nonzero()) == 0, f"{name}: padding rows not zeroed"
                padded_checked += 1
    assert padded_checked >= 2  # embed_tokens and lm_head of the tp_rank-1 ranks


def test_adopted_buffers_survive_a_reload(ckpt_factory) -> None:
    v1, v2 = ckpt_factory("qwen3-moe-tiny", 1), ckpt_factory("qwen3-moe-tiny", 2)
    layout = ParallelLayout(tp=2)
    meta1, plan1 = plan_of(v1, layout, fused=False)
    meta2, plan2 = plan_of(v2, layout, fused=False)
    rp = plan1.ranks[1]
    mine = host_owned(rp, 0x3C)
    ptrs = {n: t.data_ptr() for n, t in mine.items()}
    loader, _ = run_rank(v1, meta1, plan1, 1, buffers=mine)
    loader.reload(
        list(plan2.ranks[1].reads),
        source_of(v2, meta2),
        version=2,
        staging_budget=plan1.min_staging_reload,
    )
    assert {n: t.data_ptr() for n, t in mine.items()} == ptrs
    problems = compare_rank(expected_rank(ref_of(v2), ref_layout(layout), 1), mine)
    assert problems == []


def _bad_adoptions(rp: RankPlan):
    """(label, buffers, tensor the error must name) for each way to get adoption wrong."""
    mx = next(b for b in rp.buffers if b.dtype == "float8_e4m3fn")
    two_d = next(b for b in rp.buffers if len(b.shape) == 2 and b.shape[0] != b.shape[1])
    norm = next(b for b in rp.buffers if len(b.shape) == 1)

    good = host_owned(rp)
    wrong_shape = dict(good)
    shape = list(mx.shape)
    shape[-1] += 1
    wrong_shape[mx.name] = torch.zeros(shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    yield "wrong shape", wrong_shape, mx.name

    wrong_dtype = dict(good)
    wrong_dtype[mx.name] = torch.zeros(mx.shape, dtype=torch.uint8)  # bytes, not float8
    yield "wrong dtype", wrong_dtype, mx.name

    wrong_dtype2 = dict(good)
    wrong_dtype2[norm.name] = torch.zeros(norm.shape, dtype=torch.float32)
    yield "wrong dtype (norm)", wrong_dtype2, norm.name

    non_contig = dict(good)
    rows, cols = two_d.shape
    non_contig[two_d.name] = torch.zeros(
        (cols, rows), dtype=TORCH_DTYPES[two_d.dtype]
    ).t()  # the right shape, transposed storage
    assert not non_contig[two_d.name].is_contiguous()
    yield "non-contiguous", non_contig, two_d.name

    wrong_device = dict(good)  # "meta" stands in for another device on a CPU-only host
    wrong_device[two_d.name] = torch.empty(
        two_d.shape, dtype=TORCH_DTYPES[two_d.dtype], device="meta"
    )
    yield "wrong device", wrong_device, two_d.name

    missing = dict(good)
    del missing[norm.name]
    yield "missing", missing, norm.name

    extra = dict(good)
    extra["model.layers.99.mlp.bogus.weight"] = torch.zeros(4)
    yield "extra", extra, "model.layers.99.mlp.bogus.weight"


def test_bad_adoptions_are_refused_naming_the_tensor(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-moe-tiny", 1)
    meta, plan = plan_of(src, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True), fused=False)
    rp = plan.ranks[1]
    labels = []
    for label, given, name in _bad_adoptions(rp):
        before = {n: t.clone() for n, t in given.items() if t.device.type == "cpu"}
        with pytest.raises(AdoptionError) as err:
            RankLoader(
                rp, model_dtype=meta.config.model_dtype, backend=backend(False), buffers=given
            )
        assert name in str(err.value), f"{label}: {err.value}"
        assert isinstance(err.value, InputError) and err.value.exit_code == 2
        assert err.value.rank == 1
        # Refused before anything was written.
        for n, t in given.items():
            if n not in before:
                continue
            a, b = t.contiguous().view(torch.uint8), before[n].contiguous().view(torch.uint8)
            assert torch.equal(a, b), (label, n)
        labels.append(label)
    assert len(labels) == 7


def test_several_adoption_problems_are_all_listed(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-dense-tiny", 1)
    meta, plan = plan_of(src, ParallelLayout(tp=2), fused=False)
    rp = plan.ranks[0]
    given = host_owned(rp)
    names = [b.name for b in rp.buffers]
    del given[names[0]]
    given[names[1]] = (
        given[names[1]].float()
        if given[names[1]].dtype != torch.float32
        else (given[names[1]].half())
    )
    with pytest.raises(AdoptionError) as err:
        RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(False), buffers=given)
    assert names[0] in str(err.value) and names[1] in str(err.value)


# --- non-finite block scales ----------------------------------------------------------------------


def patched_copy(src: str, dst: str, tensor: str, tile: tuple[int, int], value: float) -> str:
    """A copy of ``src`` whose F32 ``tensor`` has ``value`` at ``tile``: bytes patched in
    place at the offset its header gives (located with the official library's header)."""
    shutil.copytree(src, dst)
    meta = open_checkpoint(dst)
    info = meta.tensor(tensor)
    cols = info.shape[1]
    path = os.path.join(dst, info.file)
    with open(path, "r+b") as f:
        f.seek(info.start + (tile[0] * cols + tile[1]) * 4)
        f.write(struct.pack("<f", value))
    # Cross-check the patch with the official reader, not with mxload's parser.
    from safetensors.torch import load_file

    got = load_file(path)[tensor][tile].item()
    assert (np.isnan(got) and np.isnan(value)) or got == value
    return dst


SCALE = "model.layers.1.self_attn.q_proj.weight_scale_inv"


@pytest.mark.parametrize(
    "value,passes_with_allow",
    [
        (float("nan"), True),
        (float("inf"), True),
        (0.0, False),
        (-0.5, False),
        (float("-inf"), False),
    ],
    ids=["nan", "inf", "zero", "negative", "minus-inf"],
)
def test_nonfinite_scales(ckpt_factory, tmp_path, value, passes_with_allow) -> None:
    # q_proj has N = 256 (two tile rows); at tp=2 rank 1 holds rows 128..255, so the
    # patched tile (1, 1) is that rank's local tile (0, 1): the error must name (1, 1).
    src = patched_copy(ckpt_factory("qwen3-moe-tiny", 1), str(tmp_path / "c"), SCALE, (1, 1), value)
    layout = ParallelLayout(tp=2)
    meta, plan = plan_of(src, layout, fused=False)
    with pytest.raises(NonFiniteScale) as err:
        run_rank(src, meta, plan, 1)
    msg = str(err.value)
    assert SCALE in msg and "(1, 1)" in msg, msg
    assert err.value.tensor == SCALE and tuple(err.value.tile) == (1, 1)
    assert err.value.exit_code == 2
    # Rank 0 does not read that tile and loads fine.
    loader0, _ = run_rank(src, meta, plan, 0)
    assert_rank_matches(ref_of(src), layout, 0, loader0)

    if passes_with_allow:
        # docs/contract.md §2.2: the NaN/Inf propagates; every MX group it touches is NaN (0xFF scale).
        loader, _ = run_rank(src, meta, plan, 1, allow_nonfinite=True)
        assert_rank_matches(ref_of(src), layout, 1, loader)
        scale = loader.buffers["model.layers.1.self_attn.qkv_proj.weight_scale"]
        # local q rows 0..127, K groups of tile column 1 (cols 128..255 -> groups 4..7)
        groups = torch.cat([scale[j, :128, :] for j in (2, 3)], dim=-1)
        assert bool((groups == 0xFF).all())
    else:
        with pytest.raises(NonFiniteScale):
            run_rank(src, meta, plan, 1, allow_nonfinite=True)


# --- one run at a time ----------------------------------------------------------------------------


def test_a_second_concurrent_load_is_refused(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-dense-tiny", 1)
    layout = ParallelLayout(tp=2)
    meta, plan = plan_of(src, layout, fused=False)
    rp = plan.ranks[0]
    loader = RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(False))
    started, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold(i: int) -> None:
        if i == 1:
            started.set()
            if not release.wait(60):
                raise RuntimeError("test did not release the first load")

    def first() -> None:
        try:
            with on_each_unit(hold):
                outcome["stats"] = loader.load(
                    list(rp.reads),
                    source_of(src, meta),
                    version=1,
                    staging_budget=rp.staging.budget_bytes,
                )
        except BaseException as err:  # reported to the main thread
            outcome["error"] = err

    t = threading.Thread(target=first)
    t.start()
    try:
        assert started.wait(60)
        with pytest.raises(RunError, match="already running") as err:
            loader.load(
                list(rp.reads),
                source_of(src, meta),
                version=1,
                staging_budget=rp.staging.budget_bytes,
            )
        assert err.value.rank == 0
    finally:
        release.set()
        t.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert_rank_matches(ref_of(src), layout, 0, loader)
    # Once the first is done, loading again works.
    loader.load(
        list(rp.reads), source_of(src, meta), version=2, staging_budget=rp.staging.budget_bytes
    )
    assert loader.version == 2


# --- an interrupted reload ----------------------------------------------------------------------


class Interrupted(Exception):
    pass


def test_interrupted_reload_reports_current_bytes_and_completes(ckpt_factory) -> None:
    """A reload that fails part-way leaves finished units at the new version and the
    rest at the old one (consistent: false); the report's checksums are those of the
    bytes held now; running the reload again completes it (docs/contract.md §4 "Reload")."""
    from mxload.workers.rank.loader import checksum

    v1, v2 = ckpt_factory("qwen3-moe-tiny", 1), ckpt_factory("qwen3-moe-tiny", 2)
    layout = ParallelLayout(tp=2)
    meta1, plan1 = plan_of(v1, layout)
    meta2, plan2 = plan_of(v2, layout)
    loader, _ = run_rank(v1, meta1, plan1, 0)
    ptrs = {n: t.data_ptr() for n, t in loader.buffers.items()}
    before = loader.checksums()  # as a status call would, after the load
    rp2 = plan2.ranks[0]
    stop_at = len(rp2.units) // 2

    def fail(i: int) -> None:
        if i == stop_at:
            raise Interrupted(f"unit {i}")

    with pytest.raises(Interrupted):
        with on_each_unit(fail):
            loader.reload(
                list(rp2.reads),
                source_of(v2, meta2),
                version=2,
                staging_budget=plan1.min_staging_reload,
            )
    assert not loader.consistent
    status = loader.unit_status()
    assert status["units_by_version"] == {"1": len(rp2.units) - stop_at, "2": stop_at}
    now = {n: checksum(t) for n, t in loader.buffers.items()}
    assert now != before, "half the units were rewritten"
    assert loader.checksums() == now, "reported checksums must be those of the bytes held"
    report = loader.tensor_report()
    assert {n: e["checksum"] for n, e in report.items()} == now

    loader.reload(
        list(rp2.reads), source_of(v2, meta2), version=2, staging_budget=plan1.min_staging_reload
    )
    assert loader.consistent and loader.version == 2
    assert {n: t.data_ptr() for n, t in loader.buffers.items()} == ptrs
    assert_rank_matches(ref_of(v2), layout, 0, loader)


def test_a_step_of_several_units_is_converted_in_one_launch_and_written_all_or_nothing(
    ckpt_factory, monkeypatch
) -> None:
    """The fused CPU kernel's steps (``memory.schedule``): small expert halves read,
    converted in one backend call and written together. A reload that fails on the
    second unit of such a step leaves the step's first unit at the old version too (no
    unit of the step was written), the units of earlier steps at the new one; running it
    again completes it, byte for byte the reference, at the same addresses."""
    from mxload.orchestrator.plan.memory import ConvertOptions, read_fn_from_reads, schedule
    from mxload.workers.numerics.backend import Backend

    v1, v2 = ckpt_factory("qwen3-moe-tiny", 1), ckpt_factory("qwen3-moe-tiny", 2)
    layout = ParallelLayout(tp=2)
    meta1, plan1 = plan_of(v1, layout, fused=True)
    meta2, plan2 = plan_of(v2, layout, fused=True)
    calls: list[int] = []
    real = Backend.convert

    def spy(self, parts, **kw):  # type: ignore[no-untyped-def]
        calls.append(len({o.weight.data_ptr() for o in kw.get("into") or ()}))  # units
        return real(self, parts, **kw)

    monkeypatch.setattr(Backend, "convert", spy)
    loader, stats = run_rank(v1, meta1, plan1, 0, fast=True)
    assert max(calls) > 1, calls
    assert 0 < stats.measured_peak_staging_bytes <= stats.predicted_peak_staging_bytes
    assert stats.predicted_peak_staging_bytes <= 1.10 * stats.measured_peak_staging_bytes
    assert_rank_matches(ref_of(v1), layout, 0, loader)
    ptrs = {n: t.data_ptr() for n, t in loader.buffers.items()}

    rp2 = plan2.ranks[0]
    budget = plan1.min_staging_reload
    q = meta2.config.quant
    opts = ConvertOptions(
        model_dtype=meta2.config.model_dtype, source_quant=q.kind, fused=True, block_n=q.block_n
    )
    read_fn = read_fn_from_reads(rp2.units, rp2.reads, block_n=q.block_n, source_quant=q.kind)
    steps, _ = schedule(rp2.units, read_fn, opts, budget, whole_units=True)
    step = next(s for s in steps if s.count > 1)
    stop_at = step.first + 1

    def fail(i: int) -> None:
        if i == stop_at:
            raise Interrupted(f"unit {i}")

    with pytest.raises(Interrupted):
        with on_each_unit(fail):
            loader.reload(list(rp2.reads), source_of(v2, meta2), version=2, staging_budget=budget)
    assert loader.unit_versions == [2] * step.first + [1] * (len(rp2.units) - step.first)
    loader.reload(list(rp2.reads), source_of(v2, meta2), version=2, staging_budget=budget)
    assert loader.consistent and loader.version == 2
    assert {n: t.data_ptr() for n, t in loader.buffers.items()} == ptrs
    assert_rank_matches(ref_of(v2), layout, 0, loader)


def test_a_failed_reload_then_another_checkpoint_rewrites_every_unit(ckpt_factory) -> None:
    """A version names a checkpoint (docs/contract.md §4): after a reload from v2 stopped half-way,
    a reload from v3 *at the same version number* must rewrite the units v2 wrote, not
    skip them (skipping by number alone left a mix of v2 and v3 reported consistent)."""
    v1, v2, v3 = (ckpt_factory("qwen3-moe-tiny", seed) for seed in (1, 2, 3))
    layout = ParallelLayout(tp=2)
    meta1, plan1 = plan_of(v1, layout)
    meta2, plan2 = plan_of(v2, layout)
    meta3, plan3 = plan_of(v3, layout)
    assert len({meta1.fingerprint, meta2.fingerprint, meta3.fingerprint}) == 3
    loader, _ = run_rank(v1, meta1, plan1, 1)
    stop_at = len(plan2.ranks[1].units) // 2

    def fail(i: int) -> None:
        if i == stop_at:
            raise Interrupted(f"unit {i}")

    with pytest.raises(Interrupted):
        with on_each_unit(fail):
            loader.reload(
                list(plan2.ranks[1].reads),
                source_of(v2, meta2),
                version=2,
                staging_budget=plan1.min_staging_reload,
            )
    assert not loader.consistent and loader.identity is None
    assert loader.unit_status()["units_by_identity"] == {
        f"1:{meta1.fingerprint}": len(plan1.ranks[1].units) - stop_at,
        f"2:{meta2.fingerprint}": stop_at,
    }
    written: list[int] = []
    with on_each_unit(written.append):
        loader.reload(
            list(plan3.ranks[1].reads),
            source_of(v3, meta3),
            version=2,
            staging_budget=plan1.min_staging_reload,
        )
    assert written == list(range(len(plan3.ranks[1].units))), "every unit rewritten"
    assert loader.consistent and loader.identity == (2, meta3.fingerprint)
    assert {e["fingerprint"] for e in loader.tensor_report().values()} == {meta3.fingerprint}
    assert_rank_matches(ref_of(v3), layout, 1, loader)


def test_a_checkpoint_rewritten_at_the_same_url_is_another_identity(tmp_path) -> None:
    """Same path, new contents (a trainer overwriting step-N): a new fingerprint, so an
    interrupted reload run again rewrites every unit from the new bytes."""
    from mxload.orchestrator.tools.synth import make_checkpoint

    v1, same = str(tmp_path / "v1"), str(tmp_path / "step")
    make_checkpoint(v1, "qwen3-dense-tiny", seed=1)
    make_checkpoint(same, "qwen3-dense-tiny", seed=2)
    layout = ParallelLayout(tp=2)
    meta1, plan1 = plan_of(v1, layout)
    meta_a, plan_a = plan_of(same, layout)
    assert open_checkpoint(same).fingerprint == meta_a.fingerprint, "deterministic"
    loader, _ = run_rank(v1, meta1, plan1, 0)
    n = len(plan_a.ranks[0].units)

    def fail(i: int) -> None:
        if i == n - 1:
            raise Interrupted("last unit")

    with pytest.raises(Interrupted):
        with on_each_unit(fail):
            loader.reload(
                list(plan_a.ranks[0].reads),
                source_of(same, meta_a),
                version=2,
                staging_budget=plan1.min_staging_reload,
            )
    shutil.rmtree(same)
    make_checkpoint(same, "qwen3-dense-tiny", seed=3)
    meta_b, plan_b = plan_of(same, layout)
    assert meta_b.fingerprint != meta_a.fingerprint
    written: list[int] = []
    with on_each_unit(written.append):
        loader.reload(
            list(plan_b.ranks[0].reads),
            source_of(same, meta_b),
            version=2,
            staging_budget=plan1.min_staging_reload,
        )
    assert written == list(range(n))
    assert_rank_matches(RefCheckpoint(same), layout, 0, loader)


def test_a_source_without_fingerprint_is_never_skipped(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-dense-tiny", 1)
    layout = ParallelLayout(tp=2)
    meta, plan = plan_of(src, layout)
    rp = plan.ranks[0]
    loader = RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(False))
    anonymous = SourceInfo(root=src, quant=meta.config.quant.kind)
    for _ in range(2):
        written: list[int] = []
        with on_each_unit(written.append):
            loader.load(
                list(rp.reads),
                anonymous,
                version=1,
                staging_budget=rp.staging.budget_bytes,
            )
        assert written == list(range(len(rp.units)))


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "reader-thread"])
def test_small_local_reads_run_on_the_converting_thread(ckpt_factory, monkeypatch, inline) -> None:
    """Units of at most INLINE_READ_BYTES from a local file are read on the thread that
    converts them; anything else on the reader thread. Same bytes, same staging
    prediction held, either way."""
    import threading

    import mxload.workers.rank.run as run_mod
    from mxload.workers.storage import Storage

    monkeypatch.setattr(run_mod, "INLINE_READ_BYTES", 1 << 40 if inline else 0)
    readers: set[int] = set()
    real = Storage.read_ranges_into

    def spy(self, *args):  # type: ignore[no-untyped-def]
        readers.add(threading.get_ident())
        return real(self, *args)

    monkeypatch.setattr(Storage, "read_ranges_into", spy)
    src = ckpt_factory("qwen3-moe-tiny", 1)
    layout = ParallelLayout(tp=2)
    meta, plan = plan_of(src, layout)
    ck = ref_of(src)
    for rank in range(layout.world):
        loader, stats = run_rank(src, meta, plan, rank)
        assert_rank_matches(ck, layout, rank, loader)
        meas, pred = stats.measured_peak_staging_bytes, stats.predicted_peak_staging_bytes
        assert 0 < meas <= pred <= 1.10 * meas
        assert stats.read_seconds > 0
    me = threading.get_ident()
    assert readers == {me} if inline else (readers and me not in readers)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "reader-thread"])
@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1)], ids=["tp2pp2", "tp1"]
)
def test_staging_peak_does_not_depend_on_reader_timing(
    ckpt_factory, monkeypatch, layout, inline
) -> None:
    """docs/contract.md §6: measured <= predicted <= 1.10 x measured on every run. Consecutive vocab
    row blocks are copy units that read ahead; a reader thread that starts late must not
    let the current block's lease go before the next one's is taken (the peak would come
    out at half the prediction: seen in CI). Every fill is delayed here."""
    import time as _time

    import mxload.workers.rank.run as run_mod
    from mxload.workers.rank.reads import Reader

    monkeypatch.setattr(run_mod, "INLINE_READ_BYTES", 1 << 40 if inline else 0)

    real_fill = Reader.fill

    def late_fill(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _time.sleep(0.01)
        return real_fill(self, *args, **kwargs)

    monkeypatch.setattr(Reader, "fill", late_fill)
    src = ckpt_factory("qwen3-moe-tiny", 1)
    meta, plan = plan_of(src, layout, fused=True)  # what Ray workers run: vocab blocks peak
    for rp in plan.ranks:
        assert sum(u.buffer.endswith("embed_tokens.weight") for u in rp.units) in (0, 2)
        _, stats = run_rank(src, meta, plan, rp.rank, fast=True)
        meas, pred = stats.measured_peak_staging_bytes, stats.predicted_peak_staging_bytes
        assert 0 < meas <= pred <= 1.10 * meas, (rp.rank, meas, pred)


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Restores this process's torch thread count, which a RankWorker sets to its share
    of the node's cores (every later test would otherwise run on that share)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_a_worker_takes_its_startup_objects_out_of_the_cyclic_collector(
    ckpt_factory, torch_threads
) -> None:
    """RankWorker (the Ray actor's body, a plain class) freezes what it loaded at start:
    torch, numba's kernels and its plan are never walked by a full collection, which
    otherwise pauses a load now and then."""
    import gc

    from mxload.workers.rank.actor import RankWorker

    src = ckpt_factory("qwen3-dense-tiny", 1)
    meta, plan = plan_of(src, ParallelLayout(tp=1))
    gc.unfreeze()
    try:
        worker = RankWorker(
            plan.ranks[0],
            model_dtype=meta.config.model_dtype,
            device="cpu",
            resource="NPU",
            threads=1,
        )
        assert gc.get_freeze_count() > 0
        assert worker.loader.rank == 0
    finally:
        gc.unfreeze()


def test_a_worker_keeps_its_thread_share_whatever_the_backend_start_does(
    ckpt_factory, torch_threads, monkeypatch
) -> None:
    """A RankWorker runs on its share of the node's cores even when starting its backend
    (the fast kernels' first compile and self-test) resets torch's thread count."""
    from mxload.workers.numerics import select as select_mod
    from mxload.workers.rank.actor import RankWorker

    original = select_mod.select_backend

    def resetting(*args: Any, **kwargs: Any) -> Any:
        torch.set_num_threads(2)  # what a cold kernel compile in a fresh process does
        return original(*args, **kwargs)

    monkeypatch.setattr(select_mod, "select_backend", resetting)
    src = ckpt_factory("qwen3-dense-tiny", 1)
    meta, plan = plan_of(src, ParallelLayout(tp=1))
    RankWorker(
        plan.ranks[0], model_dtype=meta.config.model_dtype, device="cpu", resource="NPU", threads=1
    )
    assert torch.get_num_threads() == 1


def test_a_run_fenced_off_writes_no_further_unit(ckpt_factory) -> None:
    """A reload suspended past its lease: a later lease's token reaches the rank while it
    runs; it stops before its next unit's writes, and a run with the old token is
    refused before it writes anything."""
    import dataclasses

    from mxload.orchestrator.errors import FencedOff

    src = ckpt_factory("qwen3-dense-tiny", 1)
    meta, plan = plan_of(src, ParallelLayout(tp=2))
    rp = plan.ranks[0]
    loader = RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(False))
    old = dataclasses.replace(source_of(src, meta), fence=4)
    written: list[int] = []

    def unit(i: int) -> None:
        written.append(i)
        if i == 1:  # while unit 1 converts, a later lease fences this run off
            loader.fence.advance(5)

    with on_each_unit(unit), pytest.raises(FencedOff, match="rank 0: this reload was fenced off"):
        loader.load(list(rp.reads), old, version=2, staging_budget=rp.staging.budget_bytes)
    assert loader.unit_ids[0] == (2, meta.fingerprint)
    assert all(v == 0 for v in loader.unit_versions[1:]), loader.unit_versions
    with on_each_unit(written.append), pytest.raises(FencedOff, match="token 4"):
        written.clear()
        loader.load(list(rp.reads), old, version=2, staging_budget=rp.staging.budget_bytes)
    assert written == []
    new = dataclasses.replace(old, fence=5)
    loader.load(list(rp.reads), new, version=3, staging_budget=rp.staging.budget_bytes)
    assert set(loader.unit_ids) == {(3, meta.fingerprint)}


def test_a_shard_rewritten_while_a_run_reads_it_fails_the_run(ckpt_factory, tmp_path) -> None:
    """A trainer rewrites a shard in place (same size, mtime put back) while a rank
    reads it: the rank's run fails naming the file, and the units read from it hold no
    identity, instead of mixed bytes under the checkpoint's fingerprint."""
    import dataclasses
    import shutil

    from mxload.orchestrator.errors import RunError

    src = str(tmp_path / "ck")
    shutil.copytree(ckpt_factory("qwen3-dense-tiny", 1), src)
    meta, plan = plan_of(src, ParallelLayout(tp=2))
    rp = plan.ranks[0]
    loader = RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(False))
    source = dataclasses.replace(source_of(src, meta), file_tags=dict(meta.file_tags))
    shard = os.path.join(src, meta.files[-1])

    def rewrite(i: int) -> None:
        if i == 1:
            st = os.stat(shard)
            with open(shard, "r+b") as f:
                f.seek(st.st_size - 16)
                f.write(bytes(16))
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))

    with on_each_unit(rewrite), pytest.raises(RunError, match="changed while this run read"):
        loader.load(list(rp.reads), source, version=1, staging_budget=rp.staging.budget_bytes)
    assert (0, "") in loader.unit_ids
    # Unchanged since its fingerprint: the same run passes.
    meta2, _ = plan_of(src, ParallelLayout(tp=2))
    again = dataclasses.replace(source_of(src, meta2), file_tags=dict(meta2.file_tags))
    loader.load(list(rp.reads), again, version=2, staging_budget=rp.staging.budget_bytes)
    assert set(loader.unit_ids) == {(2, meta2.fingerprint)}


def test_a_remote_load_keeps_several_steps_reads_in_flight(ckpt_factory, monkeypatch) -> None:
    """From an object store (a loopback HTTP server waiting 5 ms per request) a rank
    keeps up to ``REMOTE_READ_AHEAD`` steps' reads in flight ahead of the converting one,
    as its plan counts them: the dump equals the reference and the staging it measures
    is within the plan's prediction (measured <= predicted <= 1.10 x measured)."""
    from mxload.orchestrator.plan.memory import REMOTE_READ_AHEAD
    from mxload.workers.rank.reads import Reader

    from tests.servers import RangeHTTPServer

    lock = threading.Lock()
    now = [0]
    most = [0]
    real_fill = Reader.fill

    def counted_fill(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return real_fill(self, *args, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    queued = [0]
    real_ahead = StepRunner._read_ahead

    def counted_ahead(self, *args):  # type: ignore[no-untyped-def]
        got = real_ahead(self, *args)
        queued[0] = max(queued[0], len(self._pending))
        return got

    monkeypatch.setattr(Reader, "fill", counted_fill)
    monkeypatch.setattr(StepRunner, "_read_ahead", counted_ahead)
    src = ckpt_factory("qwen3-moe-tiny", 1)
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    with RangeHTTPServer(src, latency=0.005) as server:
        meta = open_checkpoint(server.url)
        plan = build_plan(
            meta.config,
            layout,
            checkpoint=meta,
            remote=True,
            fused=False,
            staging_budget=64 << 20,
        )
        rp = plan.ranks[0]
        assert rp.staging is not None and rp.staging.read_ahead > 1
        loader = RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(False))
        stats = loader.load(
            list(rp.reads), source_of(server.url, meta), version=1, staging_budget=64 << 20
        )
    # Issued: exactly the schedule's depth. In flight at once through HTTP: more than
    # one, at most that depth (how many overlap depends on the conversion's pace).
    assert queued[0] == REMOTE_READ_AHEAD, queued[0]
    assert 2 <= most[0] <= REMOTE_READ_AHEAD, most[0]
    m, p = stats.measured_peak_staging_bytes, stats.predicted_peak_staging_bytes
    assert p == rp.staging.staging_bytes
    assert 0 < m <= p <= 1.10 * m, (m, p)
    assert_rank_matches(ref_of(src), layout, 0, loader)


def test_reads_in_flight_come_back_in_order_and_a_failure_leaves_nothing_leased() -> None:
    """The one reader with a depth (``InFlight``, used by the step read-ahead and by an
    owner's fetch for its peers): reads fill side by side up to its depth and are
    collected in the order issued; after a failed read, closing it waits for the others
    and releases every lease they hold, and its threads are gone."""
    from mxload.workers.rank.reads import InFlight
    from mxload.workers.rank.staging import StagingPool

    pool = StagingPool(4 << 10)
    second_started = threading.Event()

    def fill(key: int, lease: Any) -> tuple[list[Any], int, int]:
        if key == 0:  # finishes only once the second read runs beside it
            assert second_started.wait(10), "the second read did not start beside the first"
        if key == 1:
            second_started.set()
        if key == 2:
            pool.release(lease)  # a failed fill releases its own leases
            raise OSError("store gone")
        return [lease], key, lease.nbytes

    flying: InFlight[int] = InFlight(pool, 2, name="mxload-test-inflight")
    got = []
    with pytest.raises(OSError, match="store gone"), flying:
        for key in range(4):
            flying.issue(key, fill, key, pool.take(1 << 10))
        while flying:
            key, (leases, value, _) = flying.collect()
            got.append((key, value))
            for lease in leases:
                pool.release(lease)
    assert got == [(0, 0), (1, 1)]
    pool.release(pool.take(4 << 10))  # the whole budget again: nothing is left leased
    assert not [t for t in threading.enumerate() if t.name.startswith("mxload-test-inflight")]
