"""mxload's DeepSeek-V3 sharding against vLLM 0.23.0's own DeepSeek loading code, on CPU.

The same method as ``tests/engine/test_vllm_qwen3_5.py`` (whose helpers this reuses; see
there why vLLM's model module cannot be imported whole here): vLLM's
``DeepseekV2Model.load_weights`` (what ``DeepseekV2ForCausalLM``'s AutoWeightsLoader hands
``model.*`` to) (models/deepseek_v2.py: ``q_a_proj`` and
``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj`` shards 0/1, the MTP layers skipped by
``get_spec_layer_idx_from_weight_name``), the weight loaders it reaches (merged with
``disable_tp`` for ``fused_qkv_a_proj`` as ``DeepSeekV2FusedQkvAProjLinear`` builds it,
column ``q_b_proj``/``kv_b_proj``, row ``o_proj``, replicated ``GateLinear``, FusedMoE for
the routed experts, the default loader for the float32 ``e_score_correction_bias``) run
unmodified on the BF16 twin of the ``deepseek-v3-tiny`` preset, and every rank's
parameters must equal mxload's buffers byte for byte, MX units through the independent
reference. Extra stubs: ``rocm_aiter_ops`` (no fused shared experts),
``get_pp_missing_layer_names`` (one stage).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from mxload.orchestrator.plan.types import ParallelLayout

from tests.engine import test_vllm_qwen3_5 as q35
from tests.engine.test_vllm_qwen3_5 import _param, _source, _Vllm
from tests.engine.test_vllm_qwen3_5 import vllm_src as vllm_src  # the module fixture
from tests.engine.vllm_code import _exec

PRESET = "deepseek-v3-tiny"


def deepseek_params(
    v: _Vllm, cfg: dict[str, Any], weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One rank's parameters as vLLM's DeepSeek-V3 layers build them, filled by vLLM's
    own ``load_weights``. Names are the engine's (= mxload's)."""
    tp, dt = v.tp, torch.bfloat16
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qa, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    ns = v.ns
    for name in ("get_spec_layer_idx_from_weight_name", "_try_load_fp8_indexer_wk"):
        _exec(ns, _source(v.src, "deepseek", name), name)
    ns["rocm_aiter_ops"] = types.SimpleNamespace(is_fusion_moe_shared_experts_enabled=lambda: False)
    ns["get_pp_missing_layer_names"] = lambda model: []
    mapping = v.fused_moe.make_expert_params_mapping
    ns["fused_moe_make_expert_params_mapping"] = lambda model, **kw: mapping(
        None,
        model,
        kw["ckpt_gate_proj_name"],
        kw["ckpt_down_proj_name"],
        kw["ckpt_up_proj_name"],
        kw["num_experts"],
        kw["num_redundant_experts"],
    )
    load_weights = _exec(
        ns, _source(v.src, "deepseek", "DeepseekV2Model", "load_weights"), "load_weights"
    )

    def merged(sizes: list[int], k: int, disable_tp: bool = False) -> Any:
        layer = v.layer(v.merged, output_sizes=sizes)
        if disable_tp:  # LinearBase: disable_tp -> tp_rank 0, tp_size 1
            layer.tp_size, layer.tp_rank = 1, 0
        n = sum(sizes) // layer.tp_size
        return _param((n, k), dt, layer.weight_loader, output_dim=0)

    def column(n: int, k: int) -> Any:
        return _param((n // tp, k), dt, v.layer(v.column).weight_loader, output_dim=0)

    def row(k: int) -> Any:
        return _param((h, k // tp), dt, v.layer(v.row).weight_loader, input_dim=1)

    def plain(shape: tuple[int, ...], dtype: torch.dtype = dt) -> Any:
        return _param(shape, dtype, ns["default_weight_loader"])

    params: dict[str, Any] = {}
    e = cfg["n_routed_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        params[f"{p}.input_layernorm.weight"] = plain((h,))
        params[f"{p}.post_attention_layernorm.weight"] = plain((h,))
        params[f"{a}.fused_qkv_a_proj.weight"] = merged([qa, kvl + rope], h, disable_tp=True)
        params[f"{a}.q_a_layernorm.weight"] = plain((qa,))
        params[f"{a}.q_b_proj.weight"] = column(heads * (nope + rope), qa)
        params[f"{a}.kv_a_layernorm.weight"] = plain((kvl,))
        params[f"{a}.kv_b_proj.weight"] = column(heads * (nope + vd), kvl)
        params[f"{a}.o_proj.weight"] = row(heads * vd)
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            params[f"{p}.mlp.gate_up_proj.weight"] = merged([inter, inter], h)
            params[f"{p}.mlp.down_proj.weight"] = row(inter)
            continue
        params[f"{p}.mlp.gate.weight"] = _param((e, h), dt, v.layer(v.replicated).weight_loader)
        params[f"{p}.mlp.gate.e_score_correction_bias"] = plain((e,), torch.float32)
        si = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
        params[f"{p}.mlp.shared_experts.gate_up_proj.weight"] = merged([si, si], h)
        params[f"{p}.mlp.shared_experts.down_proj.weight"] = row(si)
        n_local, expert_map, _ = ns["determine_expert_map"](v.ep, v.ep_rank, e)
        moe = v.layer(
            v.fused_moe,
            tp_size=v.moe_tp,
            tp_rank=v.moe_tp_rank,
            quant_config=None,
            quant_method=type("UnquantizedFusedMoEMethod", (), {})(),
            expert_map_manager=v.layer(v.expert_map, _expert_map=expert_map),
            moe_config=types.SimpleNamespace(
                is_act_and_mul=True,
                moe_parallel_config=types.SimpleNamespace(tp_size=v.moe_tp),
            ),
        )
        mi = cfg["moe_intermediate_size"] // v.moe_tp
        params[f"{p}.mlp.experts.w13_weight"] = _param((n_local, 2 * mi, h), dt, moe.weight_loader)
        params[f"{p}.mlp.experts.w2_weight"] = _param((n_local, h, mi), dt, moe.weight_loader)
    params["model.norm.weight"] = plain((h,))
    vocab = cfg["vocab_size"]
    padded = ns["pad_vocab_size"](vocab)
    indices = v.vocab._get_indices(v.vocab, padded, padded, vocab, vocab, v.rank, tp)
    emb = v.layer(v.vocab, shard_indices=indices, org_vocab_size=vocab)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        params[name] = _param((padded // tp, h), dt, emb.weight_loader, output_dim=0)
    model = types.SimpleNamespace(
        params=params,
        named_parameters=lambda: list(params.items()),
        use_mha=False,
        num_redundant_experts=0,
        config=types.SimpleNamespace(**cfg),
    )
    # AutoWeightsLoader: model.* to DeepseekV2Model (prefix dropped), lm_head to the head
    head = params.pop("lm_head.weight")
    inner = {k[len("model.") :]: p for k, p in params.items()}
    model.params = inner
    model.named_parameters = lambda: list(inner.items())
    to_model = [(n[len("model.") :], w) for n, w in weights.items() if n.startswith("model.")]
    head.weight_loader(head, weights["lm_head.weight"])
    loaded = load_weights(model, to_model)
    assert set(inner) <= loaded, set(inner) - loaded
    params["lm_head.weight"] = head
    return params


LAYOUTS = {
    "tp1": ParallelLayout(tp=1),
    "tp2": ParallelLayout(tp=2),
    "tp4": ParallelLayout(tp=4),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp(PRESET)
    fp8, bf16 = str(root / "fp8"), str(root / "bf16")
    q35.make_checkpoint(fp8, PRESET, seed=3)
    q35.make_checkpoint(bf16, PRESET, seed=3, bf16=True)
    return fp8, bf16


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_rank_equals_vllm_0_23_deepseek_v3_parameters(
    vllm_src: Path,
    checkpoints: tuple[str, str],
    name: str,
) -> None:
    n_mx = q35.check_against_vllm(
        vllm_src, PRESET, checkpoints, LAYOUTS[name], "mxload", params_of=deepseek_params
    )
    assert n_mx > 0
