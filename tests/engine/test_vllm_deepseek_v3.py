"""mxload's DeepSeek-V3 sharding against vLLM 0.23.0's own DeepSeek model, on CPU.

The same method as ``tests/engine/test_vllm_qwen3_5.py`` (whose comparison this reuses):
tests/engine/vllm_model.py builds vLLM's ``DeepseekV3ForCausalLM`` (models/deepseek_v2.py)
for every rank of a layout with vLLM's own ``VllmConfig`` and runs its own
``load_weights`` on the BF16 twin of the ``deepseek-v3-tiny`` preset: the parameters
(``fused_qkv_a_proj`` as ``DeepSeekV2FusedQkvAProjLinear`` builds it, replicated; the
column ``q_b_proj``/``kv_b_proj``, row ``o_proj``; the float32
``e_score_correction_bias``; FusedMoE's local experts; ``make_layers``'s stages with
``PPMissingLayer`` for the rest) and their values (the MTP layer skipped by
``get_spec_layer_idx_from_weight_name``) are vLLM's. Every rank's parameters must equal
mxload's buffers byte for byte, MX units through the independent reference. Stubbed for
this model beyond the process groups: the MLA attention backend's choice (vLLM's CPU
platform has no MLA kernel) and FlashAttention's ``flash_attn_varlen_func`` (a compiled
device kernel, never called); see tests/engine/vllm_model.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint

from tests.engine import test_vllm_qwen3_5 as q35
from tests.engine.vllm_model import Models, vllm_models

PRESET = "deepseek-v3-tiny"

LAYOUTS = {
    "tp1": ParallelLayout(tp=1),
    "tp2": ParallelLayout(tp=2),
    "tp4": ParallelLayout(tp=4),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
    # get_pp_indices: layers 0-1 and 2 (embed_tokens first stage only, norm and lm_head
    # last: DeepseekV2Model checks the stage for each)
    "tp2-pp2-ep": ParallelLayout(tp=2, pp=2, enable_expert_parallel=True),
}


@pytest.fixture(scope="module")
def vllm() -> Iterator[Models]:
    with vllm_models() as models:
        yield models


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp(PRESET)
    fp8, bf16 = str(root / "fp8"), str(root / "bf16")
    q35.make_checkpoint(fp8, PRESET, seed=3)
    q35.make_checkpoint(bf16, PRESET, seed=3, bf16=True)
    return fp8, bf16


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_rank_equals_vllm_0_23_deepseek_v3_parameters(
    vllm: Models, checkpoints: tuple[str, str], name: str
) -> None:
    """Plain vLLM (mxload's profile, vLLM's default all2all backend): tp 2 x dp 2 + EP runs
    sequence-parallel MoE, the shared experts whole on every TP rank; kv_b_proj MXFP8."""
    n_mx = q35.check_against_vllm(vllm, checkpoints, LAYOUTS[name], "mxload")
    assert n_mx > 0
    # vLLM builds kv_b_proj with the model's quant_config: MXFP8 on every rank
    meta = open_checkpoint(checkpoints[0])
    plan = build_plan(meta.config, LAYOUTS[name], checkpoint=meta)
    kvb = [
        b for r in plan.ranks for b in r.buffers if b.name.endswith("self_attn.kv_b_proj.weight")
    ]
    assert kvb and {b.layout for b in kvb} == {"mx_linear"}


def test_tp2xdp2_ep_under_vllm_ascend_0_23(vllm: Models, checkpoints: tuple[str, str]) -> None:
    """vllm-ascend 0.23's MoE mode (no sequence-parallel MoE: the shared experts TP-split)
    and its MLA's unquantized kv_b_proj (held in the model dtype from the block-FP8
    checkpoint: the engine's own BF16 value, byte for byte)."""
    layout = LAYOUTS["tp2xdp2-ep"]
    assert q35.check_against_vllm(vllm, checkpoints, layout, "vllm-ascend-0.23") > 0
    # its MLA asserts UnquantizedLinearMethod: no MX kv_b_proj on any rank
    meta = open_checkpoint(checkpoints[0])
    plan = build_plan(meta.config, layout, checkpoint=meta, engine="vllm-ascend-0.23")
    kvb = [b for r in plan.ranks for b in r.buffers if ".self_attn.kv_b_proj." in b.name]
    assert kvb and {(b.layout, b.dtype) for b in kvb} == {("dense", "bfloat16")}
