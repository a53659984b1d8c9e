"""Architecture tables (docs/contract.md §3): names, merge order, styles, shapes, dtypes.

The expected device names are the docs/contract.md §3 table written out by hand; shapes are the
config formulas of docs/contract.md §3 (Qwen3: q [heads*head_dim, hidden], ...).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from mxload.orchestrator.errors import UnsupportedError
from mxload.orchestrator.plan.arch import ARCHITECTURES, LAYER_KINDS, architecture_for
from mxload.orchestrator.plan.config import SUPPORTED_ARCHITECTURES
from mxload.orchestrator.plan.planner import plan_rank
from mxload.orchestrator.plan.types import ParallelLayout

from tests.unit.test_planner import real, synthetic


def test_every_supported_architecture_has_a_table() -> None:
    assert set(ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)


def test_unknown_architecture_lists_the_supported_ones() -> None:
    cfg = replace(real("qwen3-32b-fp8"), architecture="LlamaForCausalLM")
    with pytest.raises(UnsupportedError) as info:
        architecture_for(cfg)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)
    assert info.value.key == "architectures"


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tables_are_well_formed(name: str) -> None:
    arch = ARCHITECTURES[name]
    for rule in arch.rules:
        assert rule.sources, rule.name
        assert rule.when in LAYER_KINDS
        for src in rule.sources:
            assert all(d in arch.dims for d in src.tensor_dims), (rule.name, src.tensor_dims)
            assert all(d in arch.dims for d in (*src.dims, *src.before)), (rule.name, src.dims)
            # a part of a larger tensor keeps its trailing dims
            assert src.dims[1:] == src.tensor_dims[1:] and len(src.dims) >= 1
        if rule.style == "moe":
            assert len(rule.sources) == 3 and all("{e}" in s.module for s in rule.sources)
            assert rule.linear
        if rule.style == "row":
            assert all(len(s.dims) == 2 for s in rule.sources)
        if rule.style == "column" and any(len(s.dims) == 1 for s in rule.sources):
            # a 1-D column row splits its only dim; merged 1-D parts (a qkv bias) share one
            # width, since the planner lays them out as the rows of [parts, width]
            assert len({s.dims for s in rule.sources}) == 1
        if not rule.linear:
            assert rule.mx  # mx only matters for linears; the default stays untouched


def names(cfg_name: str, layer: int) -> set[str]:
    cfg = real(cfg_name)
    buffers, _ = plan_rank(cfg, ParallelLayout(), 0)
    prefix = f"model.layers.{layer}."
    return {b.name[len(prefix) :] for b in buffers if b.name.startswith(prefix)}


def test_qwen3_dense_names() -> None:
    assert names("qwen3-32b-fp8", 0) == {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.qkv_proj.weight",
        "self_attn.qkv_proj.weight_scale",
        "self_attn.o_proj.weight",
        "self_attn.o_proj.weight_scale",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_up_proj.weight",
        "mlp.gate_up_proj.weight_scale",
        "mlp.down_proj.weight",
        "mlp.down_proj.weight_scale",
    }
    buffers, _ = plan_rank(real("qwen3-32b-fp8"), ParallelLayout(), 0)
    top = {b.name for b in buffers if not b.name.startswith("model.layers.")}
    assert top == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def test_qwen3_moe_names() -> None:
    got = names("qwen3-30b-a3b-fp8", 7)
    assert {
        "mlp.gate.weight",
        "mlp.experts.w13_weight",
        "mlp.experts.w13_weight_scale",
        "mlp.experts.w2_weight",
        "mlp.experts.w2_weight_scale",
    } <= got
    assert not any(n.startswith(("mlp.gate_up_proj", "mlp.down_proj")) for n in got)


def test_deepseek_names() -> None:
    attn = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.fused_qkv_a_proj.weight",
        "self_attn.fused_qkv_a_proj.weight_scale",
        "self_attn.q_a_layernorm.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.q_b_proj.weight_scale",
        "self_attn.kv_b_proj.weight",
        "self_attn.kv_b_proj.weight_scale",  # plain vLLM quantizes it
        "self_attn.o_proj.weight",
        "self_attn.o_proj.weight_scale",
    }
    dense_mlp = {
        "mlp.gate_up_proj.weight",
        "mlp.gate_up_proj.weight_scale",
        "mlp.down_proj.weight",
        "mlp.down_proj.weight_scale",
    }
    moe = {
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_up_proj.weight",
        "mlp.shared_experts.gate_up_proj.weight_scale",
        "mlp.shared_experts.down_proj.weight",
        "mlp.shared_experts.down_proj.weight_scale",
        "mlp.experts.w13_weight",
        "mlp.experts.w13_weight_scale",
        "mlp.experts.w2_weight",
        "mlp.experts.w2_weight_scale",
    }
    cfg = synthetic("deepseek")
    buffers, _ = plan_rank(cfg, ParallelLayout(), 0)
    got = {b.name for b in buffers}
    assert {n[len("model.layers.0.") :] for n in got if n.startswith("model.layers.0.")} == attn | dense_mlp  # fmt: skip
    assert {n[len("model.layers.1.") :] for n in got if n.startswith("model.layers.1.")} == attn | moe  # fmt: skip
    # vllm-ascend's MLA holds kv_b_proj unquantized (no scale) and derives W_UK_T / W_UV
    buffers, _ = plan_rank(cfg, ParallelLayout(), 0, engine="vllm-ascend-main")
    got = {b.name for b in buffers}
    impl = {f"self_attn.mla_attn.mla_attn.impl.{n}" for n in ("W_UK_T", "W_UV")}
    assert {n[len("model.layers.0.") :] for n in got if n.startswith("model.layers.0.")} == (attn | dense_mlp | impl) - {"self_attn.kv_b_proj.weight_scale"}  # fmt: skip


def test_qwen3_source_shapes_follow_the_config() -> None:
    cfg = real("qwen3-30b-a3b-fp8")  # hidden 2048, 32 heads x 128, 4 kv, experts 768 wide
    _, units = plan_rank(cfg, ParallelLayout(), 0)
    shapes = {p.tensor_name: p.source_shape for u in units for p in u.parts}
    p = "model.layers.0."
    assert shapes[p + "self_attn.q_proj.weight"] == (32 * 128, 2048)
    assert shapes[p + "self_attn.k_proj.weight"] == (4 * 128, 2048)
    assert shapes[p + "self_attn.v_proj.weight"] == (4 * 128, 2048)
    assert shapes[p + "self_attn.o_proj.weight"] == (2048, 32 * 128)
    assert shapes[p + "self_attn.q_norm.weight"] == (128,)
    assert shapes[p + "input_layernorm.weight"] == (2048,)
    assert shapes[p + "mlp.gate.weight"] == (128, 2048)
    assert shapes[p + "mlp.experts.5.gate_proj.weight"] == (768, 2048)
    assert shapes[p + "mlp.experts.5.down_proj.weight"] == (2048, 768)
    assert shapes["model.embed_tokens.weight"] == (151936, 2048)
    dense = real("qwen3-32b-fp8")
    _, units = plan_rank(dense, ParallelLayout(), 0)
    shapes = {p.tensor_name: p.source_shape for u in units for p in u.parts}
    assert shapes[p + "mlp.gate_proj.weight"] == (25600, 5120)
    assert shapes[p + "mlp.down_proj.weight"] == (5120, 25600)


def test_merge_order_and_units() -> None:
    _, units = plan_rank(real("qwen3-32b-fp8"), ParallelLayout(tp=2), 1)
    gu = next(u for u in units if u.buffer == "model.layers.3.mlp.gate_up_proj.weight")
    assert [(p.module.rsplit(".", 1)[1], p.rows, p.dst_row) for p in gu.parts] == [
        ("gate_proj", (12800, 25600), 0),
        ("up_proj", (12800, 25600), 12800),
    ]
    assert gu.kind == "linear" and gu.layout == "mx_linear" and gu.quantized
    norm = next(u for u in units if u.buffer == "model.layers.3.input_layernorm.weight")
    assert norm.kind == "copy" and (norm.rows, norm.cols) == (1, 5120) and not norm.quantized
