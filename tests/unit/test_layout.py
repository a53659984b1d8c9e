"""Parallel layouts (docs/contract.md §3): rank order, pipeline stages, expert placement, refusals.

Every rank of a layout is simulated in one loop (the vLLM ``ep_weight_filter`` test
style): coordinates are distinct and complete, stages partition the layers, expert
placement partitions the experts; cases come from real configs where they exist.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from mxload.orchestrator.errors import LayoutError
from mxload.orchestrator.plan.config import ModelConfig, parse_config
from mxload.orchestrator.plan.layout import (
    experts_for_rank,
    kv_head_rows,
    padded_vocab,
    pipeline_layers,
    rank_coords,
    validate_layout,
)
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import model_config_path

CONFIGS = model_config_path("deepseek-v3").parent  # the packaged configs


def real(name: str) -> ModelConfig:
    return parse_config(json.loads((CONFIGS / f"{name}.json").read_text()), f"{name}.json")


def qwen3(**kw: Any) -> ModelConfig:
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "vocab_size": 1024,
        "torch_dtype": "bfloat16",
    }
    cfg.update(kw)
    return parse_config(cfg, "synthetic/config.json")


# --- rank order -------------------------------------------------------------------------


@pytest.mark.parametrize("tp,dp,pp", [(1, 1, 1), (2, 3, 4), (8, 32, 1), (4, 1, 3), (1, 5, 2)])
def test_rank_coords_are_vllm_order_and_a_bijection(tp: int, dp: int, pp: int) -> None:
    layout = ParallelLayout(tp=tp, dp=dp, pp=pp)
    seen = set()
    for rank in range(layout.world):
        d, p, t = rank_coords(layout, rank)
        assert 0 <= d < dp and 0 <= p < pp and 0 <= t < tp
        # docs/contract.md §3: rank = dp_rank*(pp*tp) + pp_rank*tp + tp_rank
        assert d * (pp * tp) + p * tp + t == rank
        seen.add((d, p, t))
    assert len(seen) == layout.world


def test_rank_coords_hand_cases() -> None:
    layout = ParallelLayout(tp=2, dp=2, pp=3)
    assert rank_coords(layout, 0) == (0, 0, 0)
    assert rank_coords(layout, 1) == (0, 0, 1)
    assert rank_coords(layout, 2) == (0, 1, 0)
    assert rank_coords(layout, 5) == (0, 2, 1)
    assert rank_coords(layout, 6) == (1, 0, 0)
    assert rank_coords(layout, 11) == (1, 2, 1)


@pytest.mark.parametrize("rank", [-1, 12, 100])
def test_rank_outside_world_is_refused(rank: int) -> None:
    with pytest.raises(LayoutError, match="outside the world"):
        rank_coords(ParallelLayout(tp=2, dp=2, pp=3), rank)


# --- pipeline ---------------------------------------------------------------------------


def vllm_partition(num_layers: int, pp: int) -> list[int]:
    """vLLM's get_pp_indices partition sizes, written as vLLM writes them."""
    parts = [num_layers // pp] * pp
    remaining = num_layers % pp
    for i in range(2, remaining + 2):
        parts[-i] += 1
    return parts


def test_pipeline_split_94_layers_over_4_stages() -> None:
    sizes = [len(pipeline_layers(94, 4, s)) for s in range(4)]
    assert sizes == [23, 24, 24, 23]
    assert pipeline_layers(94, 4, 0) == tuple(range(0, 23))
    assert pipeline_layers(94, 4, 1) == tuple(range(23, 47))
    assert pipeline_layers(94, 4, 3) == tuple(range(71, 94))


@pytest.mark.parametrize(
    "layers,pp,sizes",
    [
        (5, 3, [2, 2, 1]),
        (7, 4, [2, 2, 2, 1]),
        (61, 8, [7, 7, 8, 8, 8, 8, 8, 7]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_pipeline_split_hand_cases(layers: int, pp: int, sizes: list[int]) -> None:
    assert [len(pipeline_layers(layers, pp, s)) for s in range(pp)] == sizes


def test_pipeline_stages_partition_the_layers_like_vllm() -> None:
    for layers in range(1, 40):
        for pp in range(1, layers + 1):
            stages = [pipeline_layers(layers, pp, s) for s in range(pp)]
            flat = [i for st in stages for i in st]
            assert flat == list(range(layers)), (layers, pp)
            assert [len(s) for s in stages] == vllm_partition(layers, pp), (layers, pp)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(LayoutError, match="more pipeline stages"):
        pipeline_layers(4, 5, 0)


# --- expert placement ---------------------------------------------------------------------


def spec_placement(e: int, ep: int, r: int, placement: str) -> list[int]:
    """docs/contract.md §3 word for word."""
    base, rem = e // ep, e % ep
    count = base + (1 if r < rem else 0)
    if placement == "linear":
        start = r * base + min(r, rem)
        return list(range(start, start + count))
    return [r + i * ep for i in range(count)]


def test_qwen3_30b_128_experts_on_ep8() -> None:
    for r in range(8):
        assert experts_for_rank(128, 8, r, "linear") == tuple(range(16 * r, 16 * r + 16))
        assert experts_for_rank(128, 8, r, "round_robin") == tuple(range(r, 128, 8))


def test_deepseek_256_experts_on_ep256() -> None:
    for r in range(256):
        assert experts_for_rank(256, 256, r, "linear") == (r,)
        assert experts_for_rank(256, 256, r, "round_robin") == (r,)


def test_uneven_placement_hand_case() -> None:
    # 10 experts on 4 ranks: base 2, rem 2 -> 3, 3, 2, 2.
    assert [experts_for_rank(10, 4, r, "linear") for r in range(4)] == [
        (0, 1, 2),
        (3, 4, 5),
        (6, 7),
        (8, 9),
    ]
    assert [experts_for_rank(10, 4, r, "round_robin") for r in range(4)] == [
        (0, 4, 8),
        (1, 5, 9),
        (2, 6),
        (3, 7),
    ]


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_placement_is_disjoint_complete_and_matches_spec(placement: str) -> None:
    for e in (1, 6, 8, 10, 60, 128, 160, 256, 384):
        for ep in (1, 2, 3, 4, 7, 8, 16, 64):
            if ep > e:
                continue
            held = [experts_for_rank(e, ep, r, placement) for r in range(ep)]
            flat = sorted(x for h in held for x in h)
            assert flat == list(range(e)), (e, ep)
            for r in range(ep):
                assert list(held[r]) == spec_placement(e, ep, r, placement), (e, ep, r)


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(LayoutError, match="expert-placement"):
        experts_for_rank(8, 2, 0, "random")


# --- kv heads and vocab ----------------------------------------------------------------------


def test_kv_heads_split_or_replicated() -> None:
    # 8 kv heads of 128 on tp 4: two heads each.
    assert [kv_head_rows(8, 128, 4, r) for r in range(4)] == [
        (0, 256),
        (256, 512),
        (512, 768),
        (768, 1024),
    ]
    # 4 kv heads on tp 8 (Qwen3-30B-A3B): head r // 2, replicated on 2 ranks.
    assert [kv_head_rows(4, 128, 8, r)[0] // 128 for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_padded_vocab() -> None:
    assert padded_vocab(151936) == 151936
    assert padded_vocab(129280) == 129280
    assert padded_vocab(1000) == 1024
    assert padded_vocab(997) == 1024
    assert padded_vocab(64) == 64


# --- refusals -----------------------------------------------------------------------------------


def refused(config: ModelConfig, layout: ParallelLayout) -> str:
    with pytest.raises(LayoutError) as info:
        validate_layout(config, layout)
    return str(info.value)


def test_heads_not_divisible_by_tp() -> None:
    msg = refused(real("qwen3-32b-fp8"), ParallelLayout(tp=3))
    assert "num_attention_heads (64)" in msg and "--tp (3)" in msg


def test_kv_heads_and_tp_that_do_not_divide_each_other() -> None:
    cfg = qwen3(num_attention_heads=12, num_key_value_heads=6, head_dim=16, hidden_size=192)
    msg = refused(cfg, ParallelLayout(tp=4))
    assert "num_key_value_heads (6)" in msg


def test_intermediate_not_divisible_by_tp() -> None:
    msg = refused(qwen3(intermediate_size=500), ParallelLayout(tp=8))
    assert "intermediate_size (500)" in msg


def test_moe_intermediate_not_divisible_by_dp_tp_without_ep() -> None:
    cfg = real("qwen3-30b-a3b-fp8")  # moe_intermediate_size 768
    msg = refused(cfg, ParallelLayout(tp=8, dp=64))
    assert "moe_intermediate_size (768)" in msg and "dp*tp (512)" in msg
    # The same layout is fine for the attention part; with EP the experts are whole, and
    # then 128 experts are too few for 512 ranks.
    msg = refused(cfg, ParallelLayout(tp=8, dp=64, enable_expert_parallel=True))
    assert "num_experts (128) is fewer than the expert-parallel group dp*tp (512)" in msg


def test_dense_intermediate_unused_by_an_all_moe_model_is_not_checked() -> None:
    cfg = real("qwen3-30b-a3b-fp8")  # every layer is MoE: intermediate_size 6144 unused
    validate_layout(cfg, ParallelLayout(tp=4, dp=2))


def test_more_stages_than_layers() -> None:
    msg = refused(real("qwen3-30b-a3b-fp8"), ParallelLayout(pp=49))
    assert "--pp (49)" in msg and "num_hidden_layers (48)" in msg


def test_padded_vocab_not_divisible_by_tp() -> None:
    cfg = qwen3(vocab_size=1000, num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                hidden_size=192, intermediate_size=384)  # fmt: skip
    msg = refused(cfg, ParallelLayout(tp=3))  # 1024 rows do not split 3 ways
    assert "vocab_size (1000, padded to 1024)" in msg


@pytest.mark.parametrize("field,flag", [("tp", "--tp"), ("dp", "--dp"), ("pp", "--pp")])
def test_degrees_below_one(field: str, flag: str) -> None:
    layout = ParallelLayout(**{field: 0})  # type: ignore[arg-type]
    msg = refused(qwen3(), layout)
    assert flag in msg


def test_bad_expert_placement() -> None:
    layout = ParallelLayout(expert_placement="random")  # type: ignore[arg-type]
    assert "expert-placement" in refused(qwen3(), layout)


def test_deepseek_layouts() -> None:
    ds = real("deepseek-v3")
    validate_layout(ds, ParallelLayout(tp=8, dp=32, enable_expert_parallel=True))
    validate_layout(ds, ParallelLayout(tp=16, pp=4))
    msg = refused(ds, ParallelLayout(tp=3))
    assert "num_attention_heads (128)" in msg


def test_expert_parallel_on_a_dense_model_is_a_no_op() -> None:
    """Accepted on a dense model and changes nothing: every rank plans exactly what the
    layout without EP plans (expert rank 0, no experts, `docs/contract.md` experts list
    ``[]`` for dense models). The same comparison on an MoE model does see the flag."""
    from mxload.orchestrator.plan.planner import build_plan

    dense = real("qwen3-32b-fp8")
    with_ep = ParallelLayout(tp=8, dp=2, enable_expert_parallel=True)
    validate_layout(dense, with_ep)
    on = build_plan(dense, with_ep).ranks
    off = build_plan(dense, ParallelLayout(tp=8, dp=2)).ranks
    assert len(on) == len(off) == 16
    for a, b in zip(on, off, strict=True):
        assert a == b, f"rank {a.rank}: EP changed a dense model's plan"
        assert a.ep_rank == 0 and a.experts == ()
    moe = qwen3(architectures=["Qwen3MoeForCausalLM"], num_experts=8, moe_intermediate_size=256)
    moe_on = build_plan(moe, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)).ranks
    moe_off = build_plan(moe, ParallelLayout(tp=2, dp=2)).ranks
    assert [r.experts for r in moe_on] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [r.ep_rank for r in moe_on] == [0, 1, 2, 3]
    assert all(r.experts == tuple(range(8)) and r.ep_rank == 0 for r in moe_off)


def test_every_reason_is_listed() -> None:
    cfg = qwen3(intermediate_size=520, vocab_size=1000)
    msg = refused(cfg, ParallelLayout(tp=3, pp=5))
    for fragment in (
        "num_attention_heads (8)",
        "intermediate_size (520)",
        "--pp (5)",
        "vocab_size",
    ):
        assert fragment in msg, fragment


def test_error_names_the_flag_and_the_tensors() -> None:
    with pytest.raises(LayoutError) as info:
        validate_layout(real("qwen3-30b-a3b-fp8"), ParallelLayout(pp=49))
    assert info.value.key == "--pp"
    with pytest.raises(LayoutError) as info:
        validate_layout(
            real("qwen3-30b-a3b-fp8"), ParallelLayout(tp=8, dp=32, enable_expert_parallel=True)
        )
    assert info.value.key == "--enable-expert-parallel" and "[mlp.experts]" in str(info.value)
    with pytest.raises(LayoutError) as info:
        validate_layout(real("qwen3-32b-fp8"), ParallelLayout(tp=3))
    assert info.value.key == "--tp"
    assert "[self_attn.qkv_proj, self_attn.o_proj]" in str(info.value)
