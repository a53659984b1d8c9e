"""Engine profiles: the tables, and what the planner and loader do with them."""

from __future__ import annotations

import pytest
import torch
from mxload.orchestrator.errors import LayoutError, UsageError
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.engines import BUFFER_KINDS, ENGINES, engine_profile
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.tools.synth import preset_config
from mxload.workers.rank.loader import RankLoader

ASCEND = ("vllm-ascend-0.23", "vllm-ascend-main")


def test_tables_are_data_with_sources() -> None:
    assert set(ENGINES) == {"mxload", *ASCEND}
    for p in ENGINES.values():
        assert set(p.views) <= set(BUFFER_KINDS), p.name
        if p.name != "mxload":
            assert p.sources, f"{p.name}: every engine fact names where it was read"
    with pytest.raises(UsageError, match=r"--engine 'nope'.*mxload"):
        engine_profile("nope")


@pytest.mark.parametrize("engine", ASCEND)
def test_plan_bytes_are_the_same_whatever_the_view(engine: str) -> None:
    config = parse_config(preset_config("qwen3-moe-tiny"))
    for layout in (ParallelLayout(tp=2), ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)):
        a, b = build_plan(config, layout), build_plan(config, layout, engine=engine)
        assert [r.persistent_bytes for r in a.ranks] == [r.persistent_bytes for r in b.ranks]
        for ra, rb in zip(a.ranks, b.ranks, strict=True):
            for x, y in zip(ra.buffers, rb.buffers, strict=True):
                assert x.numel == y.numel and x.dtype == y.dtype
                assert sorted(x.shape) == sorted(y.shape)  # a permutation at most


def test_qwen3_moe_holds_embeddings_norm_and_lm_head_on_every_stage() -> None:
    config = parse_config(preset_config("qwen3-moe-tiny"))
    layout = ParallelLayout(pp=2)
    every = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    ours = build_plan(config, layout)
    theirs = build_plan(config, layout, engine="vllm-ascend-0.23")
    assert every <= {b.name for b in theirs.ranks[0].buffers}
    assert every <= {b.name for b in theirs.ranks[1].buffers}
    assert not {"model.norm.weight", "lm_head.weight"} & {b.name for b in ours.ranks[0].buffers}
    assert "model.embed_tokens.weight" not in {b.name for b in ours.ranks[1].buffers}
    # Qwen3 dense is not in the table: the engine's pipeline placement is mxload's there.
    dense = parse_config(preset_config("qwen3-dense-tiny"))
    a, b = build_plan(dense, layout), build_plan(dense, layout, engine="vllm-ascend-0.23")
    assert [r.buffers for r in a.ranks] == [r.buffers for r in b.ranks]


@pytest.mark.parametrize("engine", ASCEND)
def test_refusals_name_the_reason(engine: str) -> None:
    config = parse_config(preset_config("qwen3-moe-tiny"))
    rr = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True, expert_placement="round_robin")
    build_plan(config, rr)  # mxload honours round_robin itself
    with pytest.raises(LayoutError, match="init_eplb_config"):
        build_plan(config, rr, engine=engine)
    # I = 128 over dp*tp = 4 without EP: I_l = 32, one K-group on w2 (odd).
    with pytest.raises(LayoutError, match=r"w2_weight: its K = 32 gives 1 MX groups"):
        build_plan(config, ParallelLayout(tp=2, dp=2), engine=engine)
    build_plan(config, ParallelLayout(tp=2, dp=2))  # mxload pads the pair


def test_fallback_moe_is_held_as_vllm_ascend_holds_it(ckpt_factory) -> None:
    """A BF16 checkpoint: the MoE stays in the model dtype; vllm-ascend's unquantized
    fused MoE holds w13 [E, H, 2I] and w2 [E, I, H], contiguous (mxload: [E, 2I, H],
    [E, H, I]). Same values, transposed."""
    src = ckpt_factory("qwen3-moe-tiny", seed=3, bf16=True)
    meta = open_checkpoint(src)
    held = {}
    for engine in ("mxload", "vllm-ascend-0.23"):
        plan = build_plan(meta.config, ParallelLayout(tp=2), checkpoint=meta, engine=engine)
        rp = plan.ranks[1]
        loader = RankLoader(rp, model_dtype=meta.config.model_dtype)
        budget = plan.extra["staging_budget_bytes"]
        loader.load(list(rp.reads or ()), _source(meta, src), version=1, staging_budget=budget)
        held[engine] = (loader.tensor_report(), loader.host_tensors())
    (rep_m, ours), (rep_a, theirs) = held["mxload"], held["vllm-ascend-0.23"]
    for half in ("w13_weight", "w2_weight"):
        name = f"model.layers.0.mlp.experts.{half}"
        assert rep_m[name]["layout"] == "dense"
        e, n, k = rep_m[name]["shape"]
        assert rep_a[name]["shape"] == [e, k, n] and rep_a[name]["stride"] == [k * n, n, 1]
        assert torch.equal(theirs[name], ours[name].transpose(1, 2))
    for name in ours:
        if "experts" not in name:
            assert torch.equal(theirs[name], ours[name]), name


def _source(meta, src):
    from mxload.orchestrator.runtime.request import source_info

    return source_info(meta, False, src, None)


def test_a_session_keeps_the_engine_it_was_loaded_for() -> None:
    from mxload.orchestrator.errors import SessionError
    from mxload.orchestrator.runtime.detached import _check_engine

    config = parse_config(preset_config("qwen3-moe-tiny"))
    held = build_plan(config, ParallelLayout(tp=2), engine="vllm-ascend-0.23")
    _check_engine("s", held, None)  # default: the session's
    _check_engine("s", held, "vllm-ascend-0.23")
    with pytest.raises(SessionError, match=r"laid out for --engine vllm-ascend-0\.23, not mxload"):
        _check_engine("s", held, "mxload")


def test_every_release_refuses_deepseek_in_place_only_under_mlapo() -> None:
    """W_UK_T / W_UV are recomputed in place (the profiles' derived table); MLAPO's NZ
    copies of the MLA projections are not, so MLAPO on (its default) is refused, naming
    the setting and the fix; other models never hear of it."""
    from mxload.orchestrator.plan.releases import RELEASES, check_architecture

    for r in RELEASES.values():
        (why,) = check_architecture(r, "DeepseekV3ForCausalLM", {})
        assert why.startswith("enable_mlapo='1'") and "'enable_mlapo': False" in why, r.name
        assert check_architecture(r, "DeepseekV3ForCausalLM", {"enable_mlapo": "0"}) == []
        assert check_architecture(r, "Qwen3MoeForCausalLM", {"enable_mlapo": "1"}) == []


def test_a_tensor_derived_from_an_mx_buffer_is_refused_naming_it() -> None:
    """A profile deriving from a row the plan holds MX-quantized (a derived op reads model
    dtype values) is refused at plan time, naming --engine and the source buffer. The
    profile here is made for the test: the released ones derive only from DeepSeek's
    kv_b_proj, which every plan holds in the model dtype."""
    from dataclasses import replace

    deepseek = parse_config(preset_config("deepseek-v3-tiny"))
    mla = engine_profile("vllm-ascend-main").derived["DeepseekV3ForCausalLM"]
    odd = replace(
        engine_profile("vllm-ascend-main"),
        name="test-derive-from-mx",
        derived={"DeepseekV3ForCausalLM": (replace(mla[0], source="self_attn.q_b_proj"),)},
    )
    lay = ParallelLayout(tp=2, enable_expert_parallel=True)
    with pytest.raises(LayoutError) as err:
        build_plan(deepseek, lay, engine=odd)
    assert err.value.key == "--engine" and "\n" not in str(err.value)
    assert "model.layers.0.self_attn.q_b_proj.weight, which this plan holds mx_linear" in str(
        err.value
    )
    assert build_plan(deepseek, lay, engine="vllm-ascend-main").ranks  # the real table plans
