"""Synthetic block-FP8 checkpoints in the real Hugging Face layout (``mxload make-checkpoint``).

Every test, the demo and the benchmarks need checkpoints, and none may be downloaded. A
synthetic checkpoint has the exact file layout, tensor names, dtypes and shapes of a
Qwen3 / Qwen3-MoE / Qwen3.5 / DeepSeek-V3 FP8 release (docs/contract.md §1.1): ``config.json``,
``model-0000X-of-0000Y.safetensors`` shards and ``model.safetensors.index.json`` (or one
``model.safetensors``), only smaller, seeded.

What is in it:

* quantized linears (``q/k/v/o_proj``, dense ``gate/up/down_proj`` and per-expert
  ``mlp.experts.{e}.{gate,up,down}_proj``): ``F8_E4M3`` ``weight`` ``[N, K]`` plus ``F32``
  ``weight_scale_inv`` ``[ceil(N/B_N), ceil(K/B_K)]``. Weights are normal samples with a
  per-row magnitude drawn over six binades (so MX groups get different exponents,
  subnormal FP8 codes included), saturated to ±448 and rounded to E4M3. Tile scales are
  log-uniform over ``tile_scale_range`` (several binades, finite, positive);
* with ``special_tiles``: one all-zero weight tile (``layers.0.self_attn.q_proj``, tile
  (0, 0)) and one tile whose scale is ``2**-120`` (the first MLP linear of layer 0, tile
  (0, last)), whose resolved values fall below the ``2**-118`` threshold where the MX
  rule of docs/contract.md §2.2 departs from torchao's;
* everything else (``embed_tokens``, ``lm_head`` unless tied, norms, the MoE router
  ``mlp.gate.weight``) in the config's model dtype (BF16 by default);
* with ``bf16=True``: the *same* model as a plain BF16 checkpoint (what an RL trainer
  writes for a reload, docs/contract.md §4): no ``quantization_config``, each linear stored as its
  resolved value ``bf16(f32(W) * S)`` (docs/contract.md §2.1), every other tensor byte-identical.
  Modules listed in ``modules_to_not_convert`` / ``ignored_layers`` are written that way
  in a quantized checkpoint too.

Determinism: each tensor is generated from its own generator seeded by ``(seed, name)``,
so the same seed gives identical bytes whatever the shard count or write order, and the
BF16 twin of a checkpoint resolves the same FP8 tensors.

Sharding is by bytes in Hugging Face's module order, with the cuts nudged so that at
least one decoder layer straddles two shards (real releases do that, and readers must
not assume a layer lives in one file). Files are written with the streaming
:class:`~workers.safetensors_io.SafetensorsWriter`, through fsspec for URLs.

Limits: Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE and DeepSeek-V3 presets; block-FP8
and BF16 outputs only (MXFP8 checkpoints come from ``mxload convert``).
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import itertools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec  # type: ignore[import-untyped]
import torch

from ...workers.safetensors_io import SAFETENSORS_TO_TORCH, SafetensorsWriter
from ...workers.storage.urls import is_remote, local_path
from ..errors import UnsupportedError, UsageError
from ..plan.config import (
    LOADABLE_ARCHITECTURES,
    QWEN3_5_ARCHITECTURES,
    ModelConfig,
    VisionConfig,
    parse_config,
)
from ..plan.formats import (
    BLOCK_SCALE_DTYPE,
    BLOCK_SCALE_DTYPES,
    BLOCK_SCALE_SUFFIX,
    CONFIG_FILE,
    E4M3_MAX,
    INDEX_FILE,
    MODEL_DTYPES,
    QUANT_WEIGHT_DTYPE,
    SAFETENSORS_ITEMSIZE,
    SINGLE_FILE,
    ceil_div,
)

_FP8_BLOCK_QUANT: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

_QWEN3_5_FP8: dict[str, Any] = {
    **_FP8_BLOCK_QUANT,
    # What Qwen's Qwen3.5 FP8 releases leave unquantized: the vision tower, MTP, the
    # embedding and lm_head, the GDN's small projections and state parameters, norms.
    "modules_to_not_convert": [
        "lm_head",
        "model.visual",
        "mtp",
        "model.language_model.embed_tokens",
        "in_proj_a",
        "in_proj_b",
        "conv1d",
        "A_log",
        "dt_bias",
        "norm",
        "input_layernorm",
        "post_attention_layernorm",
        "q_norm",
        "k_norm",
    ],
}

_QWEN3_5_VISION: dict[str, Any] = {
    "model_type": "qwen3_5",
    "depth": 2,
    "hidden_size": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 128,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 256,
    "num_position_embeddings": 64,
}


def _qwen3_5_text(**over: Any) -> dict[str, Any]:
    """A tiny Qwen3.5 text_config: 4 layers (3 linear attention, 1 full), hidden 256;
    GDN 4 key heads and 8 value heads of 32 (key_dim 128, value_dim 256)."""
    cfg: dict[str, Any] = {
        "attention_bias": False,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_value_head_dim": 32,
        "max_position_embeddings": 4096,
        "mtp_num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "vocab_size": 1000,
    }
    cfg.update(over)
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % cfg["full_attention_interval"] == 0 else "linear_attention"
        for i in range(n)
    ]
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B-FP8 in miniature: every layer MoE except layer 2 (mlp_only_layers),
    # so a dense MLP layer exists too. vocab 1000 is not a multiple of 64 (vLLM pads it).
    "qwen3-moe-tiny": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [2],
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 1000,
        "quantization_config": _FP8_BLOCK_QUANT,
    },
    # Qwen3-32B-FP8 in miniature.
    "qwen3-dense-tiny": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 1024,
        "quantization_config": _FP8_BLOCK_QUANT,
    },
    # Edges on purpose: hidden 160 = 1.25 tiles and 5 MX groups (odd); q_proj N = 192 and
    # o_proj K = 192 (1.5 tiles); experts 96 wide (a partial tile, 3 groups: odd; 48 per
    # rank at tp=2, so the MoE falls back); dense MLP 224 (7 groups); MoE only on layers
    # 1 and 3 (decoder_sparse_step 2); 6 experts (uneven over 4 EP ranks); vocab 997
    # (prime); tied embeddings (no lm_head.weight in the files).
    "qwen3-moe-awkward": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 2,
        "head_dim": 48,
        "hidden_act": "silu",
        "hidden_size": 160,
        "intermediate_size": 224,
        "max_position_embeddings": 2048,
        "mlp_only_layers": [],
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 997,
        "quantization_config": _FP8_BLOCK_QUANT,
    },
    # Qwen3.8-27B-FP8 (Qwen3.5 dense) in miniature, in the real layout: the language model
    # under text_config and model.language_model.*, three Gated DeltaNet layers then one
    # gated full-attention layer, a two-block vision tower (model.visual.*, planned unless
    # language-model-only), one MTP layer (mtp.*, planned with MTP speculative decoding),
    # and the FP8 release's
    # modules_to_not_convert. The MLP is
    # 448 wide: 14 MX groups at tp 1, 7 (odd) at tp 2, and not a multiple of 32 at tp 4
    # (held resolved in the model dtype); vocab 1000 is not a multiple of 64.
    "qwen3.5-tiny": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": _qwen3_5_text(
            model_type="qwen3_5_text", intermediate_size=448, num_hidden_layers=4
        ),
        "vision_config": _QWEN3_5_VISION,
        "quantization_config": _QWEN3_5_FP8,
    },
    # Qwen3.5-397B-A17B-FP8 in miniature: every layer a sparse MoE block (8 experts of 128,
    # a shared expert of 128 with its own gate), the same hybrid attention.
    "qwen3.5-moe-tiny": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": _qwen3_5_text(
            model_type="qwen3_5_moe_text",
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
        ),
        "vision_config": _QWEN3_5_VISION,
        "quantization_config": {
            **_QWEN3_5_FP8,
            "modules_to_not_convert": [
                *_QWEN3_5_FP8["modules_to_not_convert"],
                "mlp.gate",
                "shared_expert_gate",
            ],
        },
    },
    # DeepSeek-V3 in miniature: MLA with q LoRA (q_lora_rank 96: q_b_proj's K is 3 MX
    # groups, odd), the first layer dense (first_k_dense_replace 1), then MoE layers with
    # one shared expert, 8 routed experts and the router's F32 correction bias, and one MTP
    # layer (model.layers.3.*) that no plan holds.
    "deepseek-v3-tiny": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "intermediate_size": 512,
        "kv_lora_rank": 128,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 64,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 96,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "rms_norm_eps": 1e-06,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "v_head_dim": 32,
        "vocab_size": 1000,
        "quantization_config": _FP8_BLOCK_QUANT,
    },
}
"""config.json of each preset (``mxload make-checkpoint --preset NAME``)."""

DEFAULT_TILE_SCALE_RANGE: tuple[float, float] = (2.0**-14, 2.0**-4)
"""Tile scales are log-uniform in this range: ten binades, like real FP8 releases' 1e-4..1e-2."""

TINY_SCALE = 2.0**-120
"""The special tile's scale: resolved magnitudes <= 448 * 2**-120 < 2**-111, and small
codes land below 2**-118 (docs/contract.md §2.2's torchao divergence) and in bf16 subnormals."""

_ROW_BINADES = 6.0
_ROW_PEAK = 150.0  # row std before saturation: a few samples per row reach the ±448 clamp


@dataclass(frozen=True)
class _Tensor:
    """One checkpoint tensor to generate."""

    name: str
    dtype: str
    """safetensors dtype string."""
    shape: tuple[int, ...]
    role: str
    """qweight | qscale | resolved (a linear written in the model dtype) | embed | norm | router"""
    module: str = ""
    """For linears: the module (``...q_proj``)."""


def preset_config(preset: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A preset's config.json dict with ``overrides`` applied (shallow; a ``None`` value
    removes the key, e.g. ``{"quantization_config": None}`` for a BF16 model)."""
    if preset not in PRESETS:
        raise UsageError(
            f"--preset: unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}",
            key="--preset",
        )
    cfg = copy.deepcopy(PRESETS[preset])
    for key, value in (overrides or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = copy.deepcopy(value)
    return cfg


def _linear_modules(cfg: ModelConfig, i: int) -> list[tuple[str, int, int]]:
    """(module, N, K) of layer ``i``'s linears, in Hugging Face's module order."""
    p = f"model.layers.{i}"
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = [
        (f"{p}.self_attn.q_proj", q, h),
        (f"{p}.self_attn.k_proj", kv, h),
        (f"{p}.self_attn.v_proj", kv, h),
        (f"{p}.self_attn.o_proj", h, q),
    ]
    if cfg.is_moe_layer(i):
        inter = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            pe = f"{p}.mlp.experts.{e}"
            out += [(f"{pe}.gate_proj", inter, h), (f"{pe}.up_proj", inter, h)]
            out.append((f"{pe}.down_proj", h, inter))
    else:
        inter = cfg.intermediate_size
        out += [(f"{p}.mlp.gate_proj", inter, h), (f"{p}.mlp.up_proj", inter, h)]
        out.append((f"{p}.mlp.down_proj", h, inter))
    return out


def _emit(
    out: list[_Tensor],
    cfg: ModelConfig,
    mods: list[tuple[str, int, int]],
    quantized: bool,
    scale_dtype: str,
) -> None:
    """Linears ``(module, N, K)``: FP8 weight + block scale, or resolved in the model dtype
    (a BF16 checkpoint, or a module the config leaves unquantized)."""
    plain = MODEL_DTYPES[cfg.model_dtype]
    bn, bk = cfg.quant.block_n, cfg.quant.block_k
    for module, n, k in mods:
        if quantized and not cfg.quant.is_excluded(module):
            out.append(_Tensor(f"{module}.weight", QUANT_WEIGHT_DTYPE, (n, k), "qweight", module))
            scale_shape = (ceil_div(n, bn), ceil_div(k, bk))
            out.append(
                _Tensor(
                    f"{module}.{BLOCK_SCALE_SUFFIX}", scale_dtype, scale_shape, "qscale", module
                )
            )
        else:
            out.append(_Tensor(f"{module}.weight", plain, (n, k), "resolved", module))


def _tensors(cfg: ModelConfig, quantized: bool, scale_dtype: str) -> list[_Tensor]:
    """Every tensor of the checkpoint, in Hugging Face's state-dict order."""
    if cfg.architecture in QWEN3_5_ARCHITECTURES:
        return _qwen3_5_tensors(cfg, quantized, scale_dtype)
    if cfg.architecture == "DeepseekV3ForCausalLM":
        return _deepseek_tensors(cfg, quantized, scale_dtype)
    plain = MODEL_DTYPES[cfg.model_dtype]
    h = cfg.hidden_size
    out = [_Tensor("model.embed_tokens.weight", plain, (cfg.vocab_size, h), "embed")]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        linears = _linear_modules(cfg, i)
        attn, mlp = linears[:4], linears[4:]
        _emit(out, cfg, attn, quantized, scale_dtype)
        out.append(_Tensor(f"{p}.self_attn.q_norm.weight", plain, (cfg.head_dim,), "norm"))
        out.append(_Tensor(f"{p}.self_attn.k_norm.weight", plain, (cfg.head_dim,), "norm"))
        if cfg.is_moe_layer(i):
            out.append(_Tensor(f"{p}.mlp.gate.weight", plain, (cfg.num_experts, h), "router"))
        _emit(out, cfg, mlp, quantized, scale_dtype)
        out.append(_Tensor(f"{p}.input_layernorm.weight", plain, (h,), "norm"))
        out.append(_Tensor(f"{p}.post_attention_layernorm.weight", plain, (h,), "norm"))
    out.append(_Tensor("model.norm.weight", plain, (h,), "norm"))
    if not cfg.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", plain, (cfg.vocab_size, h), "embed"))
    return out


def _deepseek_layer(
    out: list[_Tensor], cfg: ModelConfig, i: int, quantized: bool, scale_dtype: str
) -> None:
    """One DeepSeek-V3 decoder layer ``model.layers.{i}`` (an MTP layer's too)."""
    plain = MODEL_DTYPES[cfg.model_dtype]
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    out.append(_Tensor(f"{p}.input_layernorm.weight", plain, (h,), "norm"))
    _emit(out, cfg, [(f"{a}.q_a_proj", cfg.q_lora_rank, h)], quantized, scale_dtype)
    out.append(_Tensor(f"{a}.q_a_layernorm.weight", plain, (cfg.q_lora_rank,), "norm"))
    mods = [
        (f"{a}.q_b_proj", heads * qk, cfg.q_lora_rank),
        (f"{a}.kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
    ]
    _emit(out, cfg, mods, quantized, scale_dtype)
    out.append(_Tensor(f"{a}.kv_a_layernorm.weight", plain, (cfg.kv_lora_rank,), "norm"))
    mods = [
        (f"{a}.kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        (f"{a}.o_proj", h, heads * cfg.v_head_dim),
    ]
    _emit(out, cfg, mods, quantized, scale_dtype)
    out.append(_Tensor(f"{p}.post_attention_layernorm.weight", plain, (h,), "norm"))
    if not cfg.is_moe_layer(i):
        inter = cfg.intermediate_size
        mods = [
            (f"{p}.mlp.gate_proj", inter, h),
            (f"{p}.mlp.up_proj", inter, h),
            (f"{p}.mlp.down_proj", h, inter),
        ]
        _emit(out, cfg, mods, quantized, scale_dtype)
        return
    out.append(_Tensor(f"{p}.mlp.gate.weight", plain, (cfg.num_experts, h), "router"))
    out.append(
        _Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (cfg.num_experts,), "router")
    )
    mi = cfg.moe_intermediate_size
    mods = []
    for e in range(cfg.num_experts):
        pe = f"{p}.mlp.experts.{e}"
        mods += [(f"{pe}.gate_proj", mi, h), (f"{pe}.up_proj", mi, h), (f"{pe}.down_proj", h, mi)]
    si = mi * cfg.n_shared_experts
    mods += [
        (f"{p}.mlp.shared_experts.gate_proj", si, h),
        (f"{p}.mlp.shared_experts.up_proj", si, h),
        (f"{p}.mlp.shared_experts.down_proj", h, si),
    ]
    _emit(out, cfg, mods, quantized, scale_dtype)


def _deepseek_tensors(cfg: ModelConfig, quantized: bool, scale_dtype: str) -> list[_Tensor]:
    """A DeepSeek-V3 release's tensors, its MTP layers ``model.layers.{L..}`` included
    (their own embed/enorm/hnorm/eh_proj/shared_head and a MoE decoder layer)."""
    plain = MODEL_DTYPES[cfg.model_dtype]
    h, v = cfg.hidden_size, cfg.vocab_size
    out = [_Tensor("model.embed_tokens.weight", plain, (v, h), "embed")]
    for i in range(cfg.num_hidden_layers):
        _deepseek_layer(out, cfg, i, quantized, scale_dtype)
    out.append(_Tensor("model.norm.weight", plain, (h,), "norm"))
    out.append(_Tensor("lm_head.weight", plain, (v, h), "embed"))
    for j in range(cfg.mtp_layers):
        i = cfg.num_hidden_layers + j
        p = f"model.layers.{i}"
        out += [
            _Tensor(f"{p}.embed_tokens.weight", plain, (v, h), "embed"),
            _Tensor(f"{p}.enorm.weight", plain, (h,), "norm"),
            _Tensor(f"{p}.hnorm.weight", plain, (h,), "norm"),
        ]
        _emit(out, cfg, [(f"{p}.eh_proj", h, 2 * h)], quantized, scale_dtype)
        _deepseek_layer(out, cfg, i, quantized, scale_dtype)
        out += [
            _Tensor(f"{p}.shared_head.norm.weight", plain, (h,), "norm"),
            _Tensor(f"{p}.shared_head.head.weight", plain, (v, h), "embed"),
        ]
    return out


_QWEN3_5_LAYERS = "model.language_model.layers"


def _qwen3_5_vision_tensors(vc: VisionConfig, plain: str) -> list[_Tensor]:
    """The vision tower of a Qwen3.5 release (``model.visual.*``, unquantized): patch and
    position embeddings, ``depth`` blocks (LayerNorms, fused qkv, proj, MLP, all with
    biases) and the patch merger."""
    vh, m = vc.hidden_size, vc.merger_size
    patch = (vh, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    out = [
        _Tensor("model.visual.patch_embed.proj.weight", plain, patch, "router"),
        _Tensor("model.visual.patch_embed.proj.bias", plain, (vh,), "router"),
        _Tensor("model.visual.pos_embed.weight", plain, (vc.num_position_embeddings, vh), "embed"),
    ]
    linears = [("attn.qkv", 3 * vh, vh), ("attn.proj", vh, vh)]
    linears += [("mlp.linear_fc1", vc.intermediate_size, vh)]
    linears += [("mlp.linear_fc2", vh, vc.intermediate_size)]
    for b in range(vc.depth):
        p = f"model.visual.blocks.{b}"
        for norm in ("norm1", "norm2"):
            out.append(_Tensor(f"{p}.{norm}.weight", plain, (vh,), "norm"))
            out.append(_Tensor(f"{p}.{norm}.bias", plain, (vh,), "router"))
        for name, n, k in linears:
            out.append(_Tensor(f"{p}.{name}.weight", plain, (n, k), "router"))
            out.append(_Tensor(f"{p}.{name}.bias", plain, (n,), "router"))
    out.append(_Tensor("model.visual.merger.norm.weight", plain, (vh,), "norm"))
    out.append(_Tensor("model.visual.merger.norm.bias", plain, (vh,), "router"))
    for name, n in (("linear_fc1", m), ("linear_fc2", vc.out_hidden_size)):
        out.append(_Tensor(f"model.visual.merger.{name}.weight", plain, (n, m), "router"))
        out.append(_Tensor(f"model.visual.merger.{name}.bias", plain, (n,), "router"))
    return out


def _qwen3_5_tensors(cfg: ModelConfig, quantized: bool, scale_dtype: str) -> list[_Tensor]:
    """A Qwen3.5 / Qwen3.5-MoE release's tensors (names as in Qwen's safetensors): the
    language model under ``model.language_model``, ``lm_head``, a small vision tower
    ``model.visual.*`` and the MTP layer ``mtp.*`` (both left unquantized, as released)."""
    plain = MODEL_DTYPES[cfg.model_dtype]
    h, v = cfg.hidden_size, cfg.vocab_size
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    nv = cfg.linear_num_value_heads
    q_rows = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    out = [_Tensor("model.language_model.embed_tokens.weight", plain, (v, h), "embed")]

    def mlp_of(p: str) -> list[tuple[str, int, int]]:
        if not cfg.is_moe:
            inter = cfg.intermediate_size
            return [
                (f"{p}.mlp.gate_proj", inter, h),
                (f"{p}.mlp.up_proj", inter, h),
                (f"{p}.mlp.down_proj", h, inter),
            ]
        mods = []
        for e in range(cfg.num_experts):
            pe, mi = f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size
            mods += [
                (f"{pe}.gate_proj", mi, h),
                (f"{pe}.up_proj", mi, h),
                (f"{pe}.down_proj", h, mi),
            ]
        si = cfg.shared_expert_intermediate_size
        mods += [
            (f"{p}.mlp.shared_expert.gate_proj", si, h),
            (f"{p}.mlp.shared_expert.up_proj", si, h),
            (f"{p}.mlp.shared_expert.down_proj", h, si),
        ]
        return mods

    def full_attention(p: str) -> None:
        a = f"{p}.self_attn"
        mods = [
            (f"{a}.q_proj", q_rows, h),
            (f"{a}.k_proj", kv_rows, h),
            (f"{a}.v_proj", kv_rows, h),
            (f"{a}.o_proj", h, cfg.num_attention_heads * cfg.head_dim),
        ]
        _emit(out, cfg, mods, quantized, scale_dtype)
        out.append(_Tensor(f"{a}.q_norm.weight", plain, (cfg.head_dim,), "norm"))
        out.append(_Tensor(f"{a}.k_norm.weight", plain, (cfg.head_dim,), "norm"))

    def mlp(p: str) -> None:
        if cfg.is_moe:
            out.append(_Tensor(f"{p}.mlp.gate.weight", plain, (cfg.num_experts, h), "router"))
            out.append(_Tensor(f"{p}.mlp.shared_expert_gate.weight", plain, (1, h), "router"))
        _emit(out, cfg, mlp_of(p), quantized, scale_dtype)

    for i in range(cfg.num_hidden_layers):
        p = f"{_QWEN3_5_LAYERS}.{i}"
        out.append(_Tensor(f"{p}.input_layernorm.weight", plain, (h,), "norm"))
        if cfg.is_linear_attention(i):
            a = f"{p}.linear_attn"
            out.append(_Tensor(f"{a}.A_log", "F32", (nv,), "norm"))
            out.append(
                _Tensor(
                    f"{a}.conv1d.weight",
                    plain,
                    (2 * key + value, 1, cfg.linear_conv_kernel_dim),
                    "norm",
                )
            )
            out.append(_Tensor(f"{a}.dt_bias", plain, (nv,), "norm"))
            mods = [
                (f"{a}.in_proj_a", nv, h),
                (f"{a}.in_proj_b", nv, h),
                (f"{a}.in_proj_qkv", 2 * key + value, h),
                (f"{a}.in_proj_z", value, h),
            ]
            _emit(out, cfg, mods, quantized, scale_dtype)
            out.append(_Tensor(f"{a}.norm.weight", plain, (cfg.linear_value_head_dim,), "norm"))
            _emit(out, cfg, [(f"{a}.out_proj", h, value)], quantized, scale_dtype)
        else:
            full_attention(p)
        mlp(p)
        out.append(_Tensor(f"{p}.post_attention_layernorm.weight", plain, (h,), "norm"))
    out.append(_Tensor("model.language_model.norm.weight", plain, (h,), "norm"))
    if not cfg.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", plain, (v, h), "embed"))
    if cfg.vision is not None:
        out += _qwen3_5_vision_tensors(cfg.vision, plain)
    # The MTP module as released (planned only with MTP speculative decoding): fc, its
    # norms, and full-attention decoder layers with the model's MLP; unquantized unless
    # the quantization config leaves out "mtp" from modules_to_not_convert.
    _emit(out, cfg, [("mtp.fc", h, 2 * h)], quantized, scale_dtype)
    for i in range(cfg.mtp_layers):
        p = f"mtp.layers.{i}"
        out.append(_Tensor(f"{p}.input_layernorm.weight", plain, (h,), "norm"))
        full_attention(p)
        mlp(p)
        out.append(_Tensor(f"{p}.post_attention_layernorm.weight", plain, (h,), "norm"))
    for norm in ("mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"):
        out.append(_Tensor(f"{norm}.weight", plain, (h,), "norm"))
    return out


# --- generation ------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@dataclass(frozen=True)
class _Special:
    zero_tile: str
    """Module whose weight tile (0, 0) is all zeros."""
    tiny_scale: str
    """Module whose scale tile (0, last) is TINY_SCALE."""


def _special(cfg: ModelConfig) -> _Special:
    mlp = "mlp.experts.0.gate_proj" if cfg.is_moe_layer(0) else "mlp.gate_proj"
    if cfg.architecture == "DeepseekV3ForCausalLM":
        return _Special("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj")
    if cfg.architecture in QWEN3_5_ARCHITECTURES:
        p = f"{_QWEN3_5_LAYERS}.0"
        return _Special(f"{p}.linear_attn.in_proj_qkv", f"{p}.{mlp}")
    return _Special("model.layers.0.self_attn.q_proj", f"model.layers.0.{mlp}")


class _Generator:
    """Deterministic tensor values for one checkpoint (seed, scale range, specials)."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int,
        scale_range: tuple[float, float],
        special: _Special | None,
        linear_shapes: Mapping[str, tuple[int, ...]],
        bf16_scales: bool = False,
    ) -> None:
        self.cfg = cfg
        self.bf16_scales = bf16_scales
        self.linear_shapes = linear_shapes
        self.seed = seed
        self.log_lo, self.log_hi = math.log2(scale_range[0]), math.log2(scale_range[1])
        self.special = special
        self.bn = cfg.quant.block_n or 128
        self.bk = cfg.quant.block_k or 128

    def weight_fp8(self, module: str, n: int, k: int) -> torch.Tensor:
        g = _generator(self.seed, f"{module}.weight")
        row_mag = torch.exp2(-_ROW_BINADES * torch.rand(n, 1, generator=g)) * _ROW_PEAK
        w = (torch.randn(n, k, generator=g) * row_mag).clamp_(-E4M3_MAX, E4M3_MAX)
        if self.special is not None and module == self.special.zero_tile:
            w[: self.bn, : self.bk] = 0.0
        return w.to(torch.float8_e4m3fn)

    def scale_inv_f32(self, module: str, n: int, k: int) -> torch.Tensor:
        g = _generator(self.seed, f"{module}.{BLOCK_SCALE_SUFFIX}")
        shape = (ceil_div(n, self.bn), ceil_div(k, self.bk))
        u = torch.rand(shape, generator=g, dtype=torch.float64)
        s = torch.exp2(self.log_lo + (self.log_hi - self.log_lo) * u).to(torch.float32)
        if self.special is not None and module == self.special.tiny_scale:
            s[0, -1] = TINY_SCALE
        if self.bf16_scales:
            s = s.to(torch.bfloat16).to(torch.float32)  # exact: what the file holds
        return s

    def resolved(self, module: str, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """docs/contract.md §2.1: ``to_model_dtype(f32(W) * S[r // B_N, c // B_K])``, one rounding."""
        w = self.weight_fp8(module, n, k).to(torch.float32)
        s = self.scale_inv_f32(module, n, k)
        s_full = s.repeat_interleave(self.bn, 0)[:n].repeat_interleave(self.bk, 1)[:, :k]
        return (w * s_full).to(dtype)

    def tensor(self, t: _Tensor) -> torch.Tensor:
        tdtype = SAFETENSORS_TO_TORCH[t.dtype]
        if t.role == "qweight":
            return self.weight_fp8(t.module, *t.shape)
        if t.role == "qscale":
            n, k = self._linear_shape(t.module)
            return self.scale_inv_f32(t.module, n, k).to(tdtype)
        if t.role == "resolved":
            return self.resolved(t.module, t.shape[0], t.shape[1], tdtype)
        g = _generator(self.seed, t.name)
        if t.role == "norm":
            return (1.0 + 0.1 * torch.randn(t.shape, generator=g)).to(tdtype)
        return (0.02 * torch.randn(t.shape, generator=g)).to(tdtype)  # embed, router

    def _linear_shape(self, module: str) -> tuple[int, int]:
        n, k = self.linear_shapes[module]
        return n, k


# --- sharding ---------------------------------------------------------------------------------


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    if len(parts) > 3 and parts[1] == "language_model" and parts[2] == "layers":
        return int(parts[3])
    return None


def _shard(tensors: list[_Tensor], shards: int) -> list[list[_Tensor]]:
    """Contiguous groups of about equal bytes; a cut between two layers moves one tensor
    so that a layer straddles two files, as in real releases."""
    cum = list(
        itertools.accumulate(math.prod(t.shape) * SAFETENSORS_ITEMSIZE[t.dtype] for t in tensors)
    )
    cuts: list[int] = []
    for j in range(1, shards):
        cut = bisect.bisect_left(cum, cum[-1] * j / shards) + 1  # tensors[:cut] reach the target
        if 0 < cut < len(tensors) - 1:
            before, after = _layer_of(tensors[cut - 1].name), _layer_of(tensors[cut].name)
            if before != after and after is not None:
                cut += 1
        cuts.append(cut)
    bounds = [0, *cuts, len(tensors)]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise UsageError(
            f"--shards: cannot split {len(tensors)} tensors into {shards} non-empty shards",
            key="--shards",
        )
    return [tensors[a:b] for a, b in itertools.pairwise(bounds)]


# --- writing ----------------------------------------------------------------------------------


def _join(out: str, name: str) -> str:
    return out.rstrip("/") + "/" + name if is_remote(out) else os.path.join(out, name)


def _write_text(path: str, text: str, storage_options: Mapping[str, Any]) -> None:
    with fsspec.open(path, "w", encoding="utf-8", **storage_options) as f:
        f.write(text)


EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def serving_files(vocab_size: int) -> dict[str, str]:
    """A tiny tokenizer (a word-level ``tokenizer.json`` in the format of Hugging Face's
    ``tokenizers``), its ``tokenizer_config.json`` with a chat template, and a
    ``generation_config.json``: what an engine reads besides the weights to start."""
    words = [EOS, "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    words += [f"w{i}" for i in range(min(vocab_size, 64) - len(words))]
    special = [
        {
            "id": i,
            "content": w,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, w in enumerate(words[:5])
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {w: i for i, w in enumerate(words)},
            "unk_token": "<unk>",
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "unk_token": "<unk>",
        "pad_token": EOS,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"eos_token_id": 0, "pad_token_id": 0, "temperature": 0.6, "top_p": 0.95}
    return {
        "tokenizer.json": json.dumps(tokenizer, indent=1) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }


def make_checkpoint(
    out: str,
    preset: str,
    *,
    seed: int = 0,
    shards: int = 2,
    storage_options: Mapping[str, Any] | None = None,
    bf16: bool = False,
    overrides: Mapping[str, Any] | None = None,
    tile_scale_range: tuple[float, float] = DEFAULT_TILE_SCALE_RANGE,
    special_tiles: bool = True,
    scale_dtype: str = BLOCK_SCALE_DTYPE,
) -> dict[str, Any]:
    """Write a synthetic checkpoint of ``preset`` to ``out`` (a local path or fsspec URL).

    Returns a summary: ``out``, ``preset``, ``seed``, ``quantized``, ``files`` (file names
    relative to ``out``, config and index included), ``shards``, ``tensors`` (count),
    ``bytes`` (tensor bytes, the index's ``total_size``) and ``special_tiles`` (which
    tensors and tiles got the special values). ``scale_dtype``: ``F32`` (the seed's
    releases) or ``BF16`` block scales (third-party Qwen3.5 copies); BF16 tiles are the
    F32 ones rounded to BF16, and the BF16 twin resolves with the rounded values.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise UsageError(f"--shards must be a positive integer, got {shards!r}", key="--shards")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"--seed must be an integer, got {seed!r}", key="--seed")
    lo, hi = tile_scale_range
    if not (0.0 < lo <= hi and math.isfinite(hi)):
        raise UsageError(
            f"tile_scale_range must be 0 < lo <= hi < inf, got {tile_scale_range!r}",
            key="tile_scale_range",
        )
    cfg_dict = preset_config(preset, overrides)
    if bf16:
        cfg_dict.pop("quantization_config", None)
    source = f"preset {preset}"
    cfg = parse_config(cfg_dict, source)
    if cfg.architecture not in LOADABLE_ARCHITECTURES:
        raise UnsupportedError(
            f"{source}: make-checkpoint writes {', '.join(LOADABLE_ARCHITECTURES)} only, "
            f"not {cfg.architecture}",
            key="architectures",
        )
    if cfg.quant.kind == "mxfp8":
        raise UnsupportedError(
            f"{source}: make-checkpoint writes block-FP8 or BF16; MXFP8 comes from mxload convert",
            key="quantization_config",
        )
    if scale_dtype not in BLOCK_SCALE_DTYPES:
        raise UsageError(
            f"--scale-dtype: {scale_dtype!r} is not one of {', '.join(BLOCK_SCALE_DTYPES)}",
            key="--scale-dtype",
        )
    quantized = cfg.quant.kind == "block_fp8"
    tensors = _tensors(cfg, quantized, scale_dtype)

    special = _special(cfg) if special_tiles else None
    shapes = {t.module: t.shape for t in tensors if t.role in ("qweight", "resolved")}
    gen = _Generator(cfg, seed, (lo, hi), special, shapes, scale_dtype == "BF16")
    options = dict(storage_options or {})
    if not is_remote(out):
        os.makedirs(local_path(out), exist_ok=True)

    groups = _shard(tensors, shards)
    names = (
        [SINGLE_FILE]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    meta = {"format": "pt"}
    for fname, group in zip(names, groups, strict=True):
        specs = [(t.name, t.dtype, t.shape) for t in group]
        by_name = {t.name: t for t in group}
        with SafetensorsWriter(_join(out, fname), specs, meta, storage_options=options) as w:
            for name in w.order:  # data order: the stream never buffers a tensor
                w.write(name, gen.tensor(by_name[name]).contiguous())
        for t in group:
            weight_map[t.name] = fname
            total += math.prod(t.shape) * SAFETENSORS_ITEMSIZE[t.dtype]

    files = list(names)
    _write_text(_join(out, CONFIG_FILE), json.dumps(cfg_dict, indent=2) + "\n", options)
    files.insert(0, CONFIG_FILE)
    for name, text in serving_files(cfg.vocab_size).items():
        _write_text(_join(out, name), text, options)
        files.append(name)
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_text(_join(out, INDEX_FILE), json.dumps(index, indent=2) + "\n", options)
        files.insert(1, INDEX_FILE)

    specials: list[dict[str, Any]] = []
    if special is not None:
        present = {t.name: t for t in tensors}
        zero_w = f"{special.zero_tile}.weight"
        if zero_w in present:
            kind = "zero_weights" if present[zero_w].role == "qweight" else "zero_values"
            specials.append({"tensor": zero_w, "tile": [0, 0], "kind": kind})
        tiny = f"{special.tiny_scale}.{BLOCK_SCALE_SUFFIX}"
        if tiny in present:
            cols = present[tiny].shape[1]
            specials.append(
                {"tensor": tiny, "tile": [0, cols - 1], "kind": "tiny_scale", "value": TINY_SCALE}
            )
        elif f"{special.tiny_scale}.weight" in present:
            k = present[f"{special.tiny_scale}.weight"].shape[1]
            specials.append(
                {
                    "tensor": f"{special.tiny_scale}.weight",
                    "tile": [0, ceil_div(k, gen.bk) - 1],
                    "kind": "tiny_values",
                    "value": TINY_SCALE,
                }
            )
    return {
        "out": out,
        "preset": preset,
        "seed": seed,
        "quantized": quantized,
        "files": files,
        "shards": shards,
        "tensors": len(tensors),
        "bytes": total,
        "special_tiles": specials,
    }
