"""mxload's KV-cache geometry (orchestrator/plan/kvcache.py) against vLLM 0.23.0's own
KV-cache spec classes, imported on CPU (tests/engine/vllm_model.py's import).

For the packaged models at full size (Qwen3.5's hybrid cache, DeepSeek-V3's MLA, Qwen3's
full attention) and several TP sizes, vLLM's ``FullAttentionSpec`` / ``MLAAttentionSpec``
page sizes, and ``MambaSpec`` of ``MambaStateShapeCalculator.gated_delta_net_state_shape``
with ``MambaStateDtypeCalculator.gated_delta_net_state_dtype``, give the page and state
bytes; each spec's own ``max_memory_usage_bytes`` gives what one request of
``max_model_len`` takes, which must equal mxload's blocks x pages. Nothing is stubbed
here beyond what vllm_model.py names (absent third-party modules, the platform).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.formats import ceil_div
from mxload.orchestrator.plan.kvcache import ServeKnobs, gdn_state_bytes, geometry
from mxload.orchestrator.runtime.models import model_config

from tests.engine.vllm_model import Models, vllm_models

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm() -> Iterator[types.SimpleNamespace]:
    """vLLM 0.23.0's spec classes and mamba state calculators."""
    models: Models
    with vllm_models() as models:  # noqa: F841 (the import is what is wanted)
        from vllm.model_executor.layers.mamba import mamba_utils
        from vllm.v1 import kv_cache_interface as kvi

        yield types.SimpleNamespace(kvi=kvi, mamba=mamba_utils)


def _vllm_config(max_model_len: int, mode: str) -> Any:
    """What the specs' ``max_memory_usage_bytes`` reads of a ``VllmConfig``."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        parallel_config=types.SimpleNamespace(
            decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        cache_config=types.SimpleNamespace(mamba_cache_mode=mode),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8192),
    )


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("device", ["npu", "cuda"])
@pytest.mark.parametrize("num_spec", [0, 2])
def test_hybrid_qwen3_5_as_vllm_sizes_it(
    vllm: types.SimpleNamespace, tp: int, prefix_caching: bool, device: str, num_spec: int
) -> None:
    """``num_spec``: MTP speculative tokens (the GDN layers' ``get_kv_cache_spec`` in
    mamba/abstract.py: conv rows and ``num_speculative_blocks``), with the drafter's one
    full-attention layer in the pool."""
    cfg = parse_config(model_config("qwen3.8-27b-fp8"))
    knobs = ServeKnobs(enable_prefix_caching=prefix_caching, num_speculative_tokens=num_spec)
    draft = 1 if num_spec else 0
    g = geometry(cfg, range(cfg.num_hidden_layers), tp, knobs, device, draft)
    assert g is not None and g.kind == "hybrid"
    shapes = vllm.mamba.MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp,
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel_dim,
        num_spec,
    )
    dtypes = vllm.mamba.MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16, "auto", "auto"
    )
    state = vllm.kvi.MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    assert gdn_state_bytes(cfg, tp, num_spec) == state

    def attn(block: int) -> int:
        return vllm.kvi.FullAttentionSpec(
            block_size=block,
            num_kv_heads=max(1, cfg.num_key_value_heads // tp),
            head_size=cfg.head_dim,
            dtype=torch.bfloat16,
        ).page_size_bytes

    # the block is raised until an attention page holds a state (vLLM's
    # _align_hybrid_block_size, kernel alignment 128 on vllm-ascend, 16 else), no further
    align = 128 if device == "npu" else 16
    assert g.block_size % align == 0
    assert attn(g.block_size) >= state > attn(g.block_size - align)
    assert g.page_bytes == attn(g.block_size)
    mode = "align" if prefix_caching else "none"
    padded = vllm.kvi.MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=g.block_size,
        page_size_padded=g.page_bytes,
        num_speculative_blocks=num_spec,
    )
    length = 262144
    vc = _vllm_config(length, mode)
    # one request: each group's blocks (max_memory_usage_bytes / page, vLLM's
    # _max_memory_usage_bytes_from_groups), all groups drawing on one pool
    attn_blocks = ceil_div(
        vllm.kvi.FullAttentionSpec(
            block_size=g.block_size,
            num_kv_heads=max(1, cfg.num_key_value_heads // tp),
            head_size=cfg.head_dim,
            dtype=torch.bfloat16,
        ).max_memory_usage_bytes(vc),
        g.page_bytes,
    )
    state_blocks = ceil_div(padded.max_memory_usage_bytes(vc), padded.page_size_bytes)
    # 16 (+1 drafter) full : 48 GDN layers, grouped by the smaller count: 1 and 3 groups
    assert g.block_bytes == g.page_bytes * (16 + draft)
    assert g.blocks_for(length) == 1 * attn_blocks + 3 * state_blocks


@pytest.mark.parametrize("tp", [1, 8, 16])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_mla_deepseek_v3_as_vllm_sizes_it(
    vllm: types.SimpleNamespace, tp: int, kv_dtype: str
) -> None:
    cfg = parse_config(model_config("deepseek-v3"))
    g = geometry(cfg, range(cfg.num_hidden_layers), tp, ServeKnobs(kv_cache_dtype=kv_dtype), "npu")
    assert g is not None and g.kind == "mla"
    spec = vllm.kvi.MLAAttentionSpec(
        block_size=128,
        num_kv_heads=1,  # MLA: one latent per token whatever the TP size
        head_size=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        dtype=torch.bfloat16 if kv_dtype == "auto" else torch.uint8,
        cache_dtype_str=kv_dtype,
    )
    assert g.page_bytes == spec.page_size_bytes
    assert g.block_bytes == spec.page_size_bytes * cfg.num_hidden_layers
    vc = _vllm_config(163840, "none")
    assert g.blocks_for(163840) * g.page_bytes == spec.max_memory_usage_bytes(vc)


@pytest.mark.parametrize("tp", [1, 4, 16])
def test_full_attention_qwen3_as_vllm_sizes_it(vllm: types.SimpleNamespace, tp: int) -> None:
    cfg = parse_config(model_config("qwen3-32b-fp8"))
    g = geometry(cfg, range(cfg.num_hidden_layers), tp, ServeKnobs(), "cuda")
    assert g is not None and g.kind == "attention"
    spec = vllm.kvi.FullAttentionSpec(
        block_size=16,
        num_kv_heads=max(1, cfg.num_key_value_heads // tp),
        head_size=cfg.head_dim,
        dtype=torch.bfloat16,
    )
    assert g.page_bytes == spec.page_size_bytes
    vc = _vllm_config(40960, "none")
    assert g.blocks_for(40960) * g.page_bytes == spec.max_memory_usage_bytes(vc)
