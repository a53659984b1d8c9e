"""The KV cache a served rank can hold beside its weights, sized as vLLM sizes it. Pure.

vLLM gives the KV cache what is left of ``--gpu-memory-utilization`` x the device once
the model is in; mxload counts its own peak (weights plus staging, docs/contract.md §6)
there. The cache is a pool of equal blocks (docs/contract.md §5, "KV cache"):

* a full-attention layer's page is ``block_size x kv_heads_per_rank x (head_dim + head_dim)
  x dtype`` (vLLM's ``FullAttentionSpec``; kv heads ``max(1, heads // tp)``);
* an MLA layer's page is ``block_size x (kv_lora_rank + qk_rope_head_dim) x dtype``, one
  latent per token whatever the TP size (``MLAAttentionSpec``);
* a Gated DeltaNet layer holds one state per sequence (``MambaSpec`` of
  ``gated_delta_net_state_shape``): the conv state ``conv_dim / tp x (kernel - 1)`` and the
  temporal state ``v_heads / tp x head_v x head_k``; two per sequence when prefix caching
  is on (vLLM's mamba cache mode ``align``), one when off. A hybrid rank's block size is
  raised until an attention page holds a state, the state padded to the page, and the
  layers are grouped in groups of equal size (``_get_kv_cache_groups_uniform_page_size``):
  one block of the pool is a page in each layer of a group.

A request of ``max_model_len`` takes ``ceil(len / block_size)`` blocks of each attention
group and its states' blocks of each Gated DeltaNet group; vLLM refuses to start when one
such request does not fit beside the null block it holds back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from .config import ModelConfig
from .formats import ceil_div
from .memory import MODEL_DTYPE_SIZE

GPU_MEMORY_UTILIZATION = 0.92
"""vLLM's default ``--gpu-memory-utilization`` (``CacheConfig``)."""
MAX_NUM_SEQS = 128
"""vLLM's default ``--max-num-seqs`` (``SchedulerConfig.DEFAULT_MAX_NUM_SEQS``)."""
NPU_BLOCK_SIZE = 128
"""vllm-ascend's block size (``refresh_block_size``; its attention kernels' only size)."""
BLOCK_SIZE = 16
"""vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE`` (the FlashAttention backend keeps it)."""

KV_CACHE_DTYPES = {
    "auto": 0,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""``--kv-cache-dtype`` values sized here, and their bytes per element (0: the model's)."""


@dataclass(frozen=True)
class ServeKnobs:
    """The engine's memory knobs, with vLLM's names and defaults."""

    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None
    """None: the model's ``max_position_embeddings``, as vLLM derives it."""
    max_num_seqs: int = MAX_NUM_SEQS
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    """None: :data:`NPU_BLOCK_SIZE` on an NPU, :data:`BLOCK_SIZE` elsewhere."""
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0
    """vLLM's ``speculative_config`` (MTP): each Gated DeltaNet state grows by these
    conv rows, and a request keeps this many states more."""


@dataclass(frozen=True)
class KVGeometry:
    """One rank's cache geometry: the pool's block and what one request takes of it."""

    kind: str
    """``attention``, ``mla`` or ``hybrid`` (Gated DeltaNet state + attention KV)."""
    block_size: int
    page_bytes: int
    """One layer's page (a state padded to it, on a hybrid rank)."""
    block_bytes: int
    """One block of the pool: a page in every layer of the largest group."""
    attention_groups: int
    state_groups: int
    states_per_request: int

    def blocks_for(self, tokens: int) -> int:
        """Blocks of the pool one request of ``tokens`` takes."""
        return (
            self.attention_groups * ceil_div(tokens, self.block_size)
            + self.state_groups * self.states_per_request
        )


@dataclass(frozen=True)
class KVRoom:
    """What the KV cache of one rank holds under the knobs (vLLM's own arithmetic)."""

    geometry: KVGeometry
    room_bytes: int
    """``gpu_memory_utilization`` x device memory minus mxload's peak on the rank."""
    max_model_len: int
    bytes_per_sequence: int
    """The cache one request of ``max_model_len`` takes (whole blocks)."""
    blocks: int
    """Blocks the room makes, the null block included."""
    largest_context: int
    """Longest request that fits alone (at most the model's length); 0 when none."""
    largest_batch: int
    """Requests of ``max_model_len`` the cache holds at once, at most ``max_num_seqs``."""

    @property
    def fits(self) -> bool:
        return self.largest_batch >= 1


def geometry(
    config: ModelConfig,
    layers: Sequence[int],
    tp: int,
    knobs: ServeKnobs,
    device: str,
    draft_layers: int = 0,
) -> KVGeometry | None:
    """The cache geometry of a rank holding decoder ``layers`` at ``tp`` and
    ``draft_layers`` attention layers of an MTP drafter (their cache is in the same
    pool); None when it holds no layer (no cache)."""
    dtype = kv_dtype_bytes(config, knobs.kv_cache_dtype)
    npu = device == "npu"
    block = knobs.block_size or (NPU_BLOCK_SIZE if npu else BLOCK_SIZE)
    if not layers:
        return None
    if config.kv_lora_rank:
        per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * dtype
        n = len(layers) + draft_layers
        return KVGeometry("mla", block, block * per_token, block * per_token * n, 1, 0, 0)
    kv_heads = max(1, config.num_key_value_heads // tp)
    per_token = kv_heads * 2 * config.head_dim * dtype
    attn = sum(not config.is_linear_attention(i) for i in layers) + draft_layers
    gdn = len(layers) + draft_layers - attn
    if not gdn:
        n = attn
        return KVGeometry("attention", block, block * per_token, block * per_token * n, 1, 0, 0)
    state = gdn_state_bytes(config, tp, knobs.num_speculative_tokens)
    # The backend's smallest kernel block: 128 on vllm-ascend, 16 for FlashAttention.
    align = max(NPU_BLOCK_SIZE if npu else BLOCK_SIZE, block)
    block = max(block, align * ceil_div(state, align * per_token))
    page = block * per_token
    counts = [c for c in (attn, gdn) if c]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    return KVGeometry(
        "hybrid",
        block,
        page,
        page * size,
        ceil_div(attn, size) if attn else 0,
        ceil_div(gdn, size),
        (2 if knobs.enable_prefix_caching else 1) + knobs.num_speculative_tokens,
    )


def gdn_state_bytes(config: ModelConfig, tp: int, num_spec: int = 0) -> int:
    """One Gated DeltaNet layer's state for one sequence on a rank of ``tp`` (with
    ``num_spec`` speculative tokens): the conv state and the temporal state, each in its
    dtype."""
    conv_dim = (
        config.linear_key_head_dim * config.linear_num_key_heads * 2
        + config.linear_value_head_dim * config.linear_num_value_heads
    )
    conv = conv_dim // tp * (config.linear_conv_kernel_dim - 1 + num_spec)
    temporal = (
        config.linear_num_value_heads
        // tp
        * config.linear_value_head_dim
        * config.linear_key_head_dim
    )
    model = MODEL_DTYPE_SIZE[config.model_dtype]
    ssm = MAMBA_DTYPE_BYTES.get(config.mamba_ssm_dtype, model)
    return conv * model + temporal * ssm


MAMBA_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""A config's ``mamba_ssm_dtype`` (the temporal state's dtype; default the model's)."""


def kv_dtype_bytes(config: ModelConfig, kv_cache_dtype: str) -> int:
    size = KV_CACHE_DTYPES.get(kv_cache_dtype)
    if size is None:
        raise UsageError(
            f"--kv-cache-dtype {kv_cache_dtype}: not one mxload sizes "
            f"({', '.join(KV_CACHE_DTYPES)})",
            key="--kv-cache-dtype",
        )
    return size or MODEL_DTYPE_SIZE[config.model_dtype]


DEFAULT_MAX_MODEL_LEN = 2048
"""vLLM's length for a config that names none (``_get_and_verify_max_len``)."""


def max_model_len(config: ModelConfig, knobs: ServeKnobs) -> int:
    """``--max-model-len``, or the model's own length as vLLM derives it (its
    ``max_position_embeddings``, else :data:`DEFAULT_MAX_MODEL_LEN`). Above the model's
    length it is refused, as vLLM refuses it."""
    derived = config.max_position_embeddings
    if knobs.max_model_len is None:
        return derived or DEFAULT_MAX_MODEL_LEN
    if derived and knobs.max_model_len > derived:
        raise UsageError(
            f"--max-model-len {knobs.max_model_len} is above the model's length "
            f"({config.source}: max_position_embeddings {derived}); vLLM refuses it "
            "(unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, at the model's peril)",
            key="--max-model-len",
        )
    return knobs.max_model_len


def kv_room(geom: KVGeometry, room_bytes: int, length: int, knobs: ServeKnobs, cap: int) -> KVRoom:
    """What ``room_bytes`` of cache holds for requests of ``length`` tokens; the largest
    context is searched up to ``cap`` tokens (vLLM's ``_estimate_max_model_len``)."""
    usable = room_bytes - geom.block_bytes  # the null block the pool holds back
    per_sequence = geom.block_bytes * geom.blocks_for(length)
    blocks = max(0, room_bytes) // geom.block_bytes
    batch = 0
    if per_sequence <= usable:
        batch = min(knobs.max_num_seqs, (blocks - 1) // geom.blocks_for(length))
    lo, hi, best = 1, max(cap, length), 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if geom.block_bytes * geom.blocks_for(mid) <= usable:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return KVRoom(geom, room_bytes, length, per_sequence, blocks, best, batch)


def check_knobs(knobs: ServeKnobs) -> None:
    """The knobs' own bounds, as vLLM checks them (UsageError naming the flag)."""
    if not 0 < knobs.gpu_memory_utilization <= 1:
        raise UsageError(
            f"--gpu-memory-utilization must be in (0, 1], got {knobs.gpu_memory_utilization}",
            key="--gpu-memory-utilization",
        )
    for flag, value in (
        ("--max-model-len", knobs.max_model_len),
        ("--max-num-seqs", knobs.max_num_seqs),
        ("--block-size", knobs.block_size),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}", key=flag)


def rank_rooms(
    config: ModelConfig,
    tp: int,
    ranks: Sequence[tuple[Sequence[int], int, int]],
    device_memory: int,
    knobs: ServeKnobs,
    device: str,
) -> list[KVRoom | None]:
    """Per rank (its decoder layers, its drafter's attention layers, mxload's peak bytes
    on it): its KV room under the knobs, or None for a rank holding no layer."""
    check_knobs(knobs)
    length = max_model_len(config, knobs)
    cap = max(length, config.max_position_embeddings)
    budget = int(knobs.gpu_memory_utilization * device_memory)
    seen: dict[tuple[tuple[int, ...], int, int], KVRoom | None] = {}
    out: list[KVRoom | None] = []
    for layers, draft, peak in ranks:
        key = (tuple(layers), draft, peak)
        if key not in seen:
            geom = geometry(config, layers, tp, knobs, device, draft)
            seen[key] = None if geom is None else kv_room(geom, budget - peak, length, knobs, cap)
        out.append(seen[key])
    return out
