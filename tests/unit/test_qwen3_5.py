"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) from its packaged config: exact bytes.

The persistent bytes of ``plan --model qwen3.8-27b-fp8`` are counted here by hand from the
config's numbers (the issue's: hidden 5120, 64 layers of which every fourth is full
attention, MLP 17408, vocab 248320, 24 heads / 4 kv heads of 256 with an output gate, GDN
16 key heads and 48 value heads of 128, conv kernel 4), with the sharding vLLM 0.23's
Qwen3.5 code gives (see ``tests/engine/test_vllm_qwen3_5.py`` for that code run for real).
"""

from __future__ import annotations

import pytest
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import plan_rank
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import model_config

H, LAYERS, MLP, V = 5120, 64, 17408, 248320
HEADS, KV, HD = 24, 4, 256
NK, NV, DK, DV, CONV = 16, 48, 128, 128, 4
BF16, F32 = 2, 4


def mx(n: int, k: int) -> int:
    """An MXFP8 linear [N, K]: K*N payload bytes + [ceil(K/64), N, 2] scale bytes."""
    return n * k + -(-k // 64) * n * 2


def hand_count(tp: int) -> int:
    """Every rank's bytes at tp (all ranks are alike), from the numbers above."""
    norms = 2 * H * BF16
    mlp = mx(2 * MLP // tp, H) + mx(H, MLP // tp)
    gdn = (
        mx((2 * NK * DK + 2 * NV * DV) // tp, H)  # in_proj_qkvz: q, k, v, z, each / tp
        + (2 * NV // tp) * H * BF16  # in_proj_ba: in_proj_a/b are in modules_to_not_convert
        + (2 * NK * DK + NV * DV) // tp * CONV * BF16  # conv1d [conv_dim/tp, 1, 4]
        + NV // tp * BF16  # dt_bias
        + NV // tp * F32  # A_log (vLLM's parameter is float32)
        + DV * BF16  # the gated RMSNorm
        + mx(H, NV * DV // tp)  # out_proj
    )
    kv_rows = KV * HD // tp if KV >= tp else HD  # kv heads replicated past tp = 4
    attn = (
        mx((HEADS * 2 * HD) // tp + 2 * kv_rows, H)  # q_proj carries the gate: 2 * head_dim
        + 2 * HD * BF16  # q_norm, k_norm
        + mx(H, HEADS * HD // tp)  # o_proj
    )
    n_full = LAYERS // 4
    layers = (LAYERS - n_full) * gdn + n_full * attn + LAYERS * (norms + mlp)
    vocab = V // tp * H * BF16  # 248320 is a multiple of 64: no padding
    return layers + 2 * vocab + H * BF16  # embed, lm_head, final norm


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_8_27b_persistent_bytes_equal_a_hand_count(tp: int) -> None:
    cfg = parse_config(model_config("qwen3.8-27b-fp8"), "qwen3.8-27b-fp8.json")
    buffers, _ = plan_rank(cfg, ParallelLayout(tp=tp), tp - 1)
    assert sum(b.nbytes for b in buffers) == hand_count(tp)


def test_qwen3_8_27b_config_reads_the_nested_text_config() -> None:
    cfg = parse_config(model_config("qwen3.8-27b-fp8"), "qwen3.8-27b-fp8.json")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (H, LAYERS, V)
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.quant.kind == "block_fp8" and cfg.attn_output_gate
    assert [s.split(" ")[0] for s in cfg.not_planned()] == ["model.visual.*", "mtp.*"]
