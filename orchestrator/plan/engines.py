"""Engine profiles: how an inference engine holds each buffer, as data. Pure.

A captured ACL/CUDA graph points at the *engine's* parameters, so a hot reload is only
worth anything if mxload writes exactly those tensors, laid out exactly as the engine
holds them after its own post-load step. An :class:`EngineProfile` says, for one engine
version, everything that differs from mxload's own layout (the ``mxload`` profile, the
default):

* parameter names (``moe_infix``: vLLM main registers the routed experts of a FusedMoE
  under ``mlp.experts.routed_experts.``);
* for each buffer kind (:data:`BUFFER_KINDS`), the view the engine holds and the order of
  its storage (:class:`BufferView`), which gives shape, stride and storage offset;
* which layouts the engine cannot hold (an odd K-group count in MX MoE) and what the
  planner must refuse because the engine would silently do something else
  (``round_robin`` expert placement, weight-format casts that reallocate);
* which modules stay in the model dtype (``mxload convert`` lists them in the
  quantization config's ``ignore`` so the engine does not quantize them);
* which pipeline-placed tensors the engine builds on every stage;
* how it runs its MoE layers (:class:`MoEMode`: its all2all backend, whether that backend
  runs sequence-parallel MoE, and what puts the shared experts whole on every TP rank);
* which quantized linears it holds in the model dtype (``dense_linears``);
* which tensors the engine derives from loaded parameters in its post-load and reads
  instead (``derived``: vllm-ascend's MLA ``W_UK_T``/``W_UV``), which mxload holds and
  recomputes in place after every write of their source (docs/contract.md §2.4).

A new engine version is a new table in :data:`ENGINES`, never a new branch in the planner
or the loader. Each table names the source lines it was read from. Which release uses
which profile, what it serves and which settings it is refused under:
:mod:`mxload.orchestrator.plan.releases` (``--engine`` takes a release name too).

Buffer kinds and their canonical (mxload) dimension order, which the planner's units use:

==================  ==========================  ===============================
kind                canonical shape             what
==================  ==========================  ===============================
``mx_linear``       ``[K, N]``                  MX linear weight
``mx_linear_scale`` ``[ceil(g/2), N, 2]``       its paired E8M0 scales
``mx_moe``          ``[E, K, N]``               MX fused-MoE weight (w13 / w2)
``mx_moe_scale``    ``[E, ceil(g/2), N, 2]``    its paired scales
``dense_moe``       ``[E, N, K]``               fallback fused-MoE weight
==================  ==========================  ===============================

Everything else (dense linears ``[N, K]``, norms, embeddings, the router) is plain
row-major in every profile read so far.

Limits: profiles describe ND (plain strided) tensors only. A weight-format cast that
reallocates (Ascend FRACTAL_NZ via ``npu_format_cast``) cannot be described as a view and
is refused instead (the release's refusals). Expert placement is judged per profile, not per
engine backend: where the engine's effective placement depends on something mxload
cannot see (its all2all backend), the profile refuses rather than guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import LayoutError, UsageError
from .formats import LAYOUT_DENSE, MX_GROUP
from .releases import RELEASES, SourceRef

if TYPE_CHECKING:
    from .types import ParallelLayout, RankPlan

BUFFER_KINDS = ("mx_linear", "mx_linear_scale", "mx_moe", "mx_moe_scale", "dense_moe")
"""Buffer kinds a profile may lay out differently (canonical shapes in the module doc)."""


@dataclass(frozen=True)
class BufferView:
    """How an engine holds one buffer kind, relative to mxload's canonical dimensions.

    ``view[i]`` is the canonical dimension that the engine's dimension ``i`` is (the engine
    tensor is ``canonical.permute(view)``); ``storage`` lists the engine's dimensions from
    the outermost in memory to the innermost (row-major storage of the view is
    ``tuple(range(ndim))``). The stride follows from the two and the shape."""

    view: tuple[int, ...]
    storage: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.view)
        if sorted(self.view) != list(range(n)) or sorted(self.storage) != list(range(n)):
            raise ValueError(f"BufferView {self}: view and storage must be permutations")


@dataclass(frozen=True)
class MoEMode:
    """How an engine runs its MoE layers, as far as it decides what a rank holds.

    vLLM runs *sequence-parallel MoE* (``ParallelConfig.use_sequence_parallel_moe``) when
    its all2all backend is one of ``sequence_parallel_backends``, expert parallelism is on,
    tp > 1 and dp > 1; its models then build the shared experts with ``disable_tp`` (whole
    on every TP rank). An engine may decouple the shared experts from that
    (``sp_replicates_shared`` False) and have a switch of its own that holds them whole
    (``shared_dp_setting``)."""

    all2all_backend: str
    """The backend the engine runs with unless told otherwise (vLLM's ``--all2all-backend``
    default, or what the platform sets in its place)."""
    sequence_parallel_backends: tuple[str, ...]
    """Backends under which vLLM runs sequence-parallel MoE."""
    sp_replicates_shared: bool
    """Sequence-parallel MoE holds the shared experts whole on every TP rank."""
    shared_dp_setting: str = ""
    """The engine's own setting that holds the shared experts whole on every TP rank
    whatever the backend (``ParallelLayout.shared_expert_dp``); empty: it has none."""


VLLM_SP_BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_one_sided",
    "passthrough",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
)
"""vLLM 0.33's ``use_sequence_parallel_moe`` backends (0.23 and 0.30 list a subset: each
name they accept has the same answer there)."""

ALL2ALL_BACKENDS = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "moonep",
    "nixl_ep",
    "allgather_reducescatter",
    "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
    "passthrough",
)
"""vLLM 0.33's ``All2AllBackend`` values (config/parallel.py:45-60)."""

_REMOVED_ALL2ALL = {"naive": "allgather_reducescatter", "pplx": "allgather_reducescatter"}
"""Backends vLLM has removed and replaces at config time (0.23 config/parallel.py:433-439,
0.33 :537)."""

VLLM_DEFAULT_ALL2ALL = "allgather_reducescatter"
"""``ParallelConfig.all2all_backend``'s default in vLLM 0.23, 0.30 and 0.33."""


@dataclass(frozen=True)
class ResolvedMoE:
    """The MoE mode a plan assumed: the engine's mode applied to one layout."""

    engine: str
    all2all_backend: str
    sequence_parallel: bool
    shared_experts_whole: bool
    why: str
    """What holds the shared experts whole (or split), in the engine's words."""

    def to_json(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "all2all_backend": self.all2all_backend,
            "sequence_parallel_moe": self.sequence_parallel,
            "shared_experts": "whole" if self.shared_experts_whole else "tp-split",
            "why": self.why,
        }


@dataclass(frozen=True)
class DerivedRule:
    """A tensor the engine computes from a loaded parameter in its post-load and reads
    instead of it (docs/contract.md §2.4). mxload holds it as a buffer of the plan and
    recomputes it in place after every write of the source's unit, so the engine's
    tensor keeps its address; ``op`` names the computation in the rank's table
    (``mxload.workers.rank.derived``), whose math is read from the engine (``sources``)."""

    source: str
    """Device module name of the table row it is computed from (``self_attn.kv_b_proj``)."""
    name: str
    """Device name under the source's layer prefix (where the engine keeps it)."""
    op: str
    split: tuple[str, ...]
    """Config keys of the per-head row groups of the source, in order."""
    part: int
    """Which group of ``split`` the op reads."""


@dataclass(frozen=True)
class EngineProfile:
    """Everything one engine version does differently from mxload's layout."""

    name: str
    description: str
    moe_infix: str = ""
    """Inserted after the MoE rule's module name: ``mlp.experts`` + infix + ``.w13_weight``."""
    views: Mapping[str, BufferView] = field(default_factory=dict)
    """Per buffer kind (BUFFER_KINDS); a kind not listed is held row-major, canonical."""
    moe_odd_groups: str = ""
    """Non-empty: the engine cannot hold an MX MoE buffer with an odd K-group count (K/32);
    the text says why. mxload pads such a group (the kernel's ceil(K/64) contract) and
    plans it under profiles that can hold it."""
    round_robin: str = ""
    """Non-empty: ``--expert-placement round_robin`` is refused, with this reason."""
    every_stage: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per architecture: module names of stage-0 / last-stage rows that the engine builds
    (and loads) on every pipeline stage."""
    mx_k_unaligned: str = ""
    """Non-empty: writing into the live engine is refused for a quantized linear whose
    local K is not a multiple of 32 (mxload plans it in the model dtype), with this
    reason: the engine holds it quantized. Plans and standalone loads are not refused."""
    drafter_own: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per architecture: MTP drafter rows (``TensorRule.shared_with_target``) the engine
    keeps its own copy of instead of the target model's tensor."""
    model_dtype_modules: tuple[str, ...] = ("lm_head",)
    """Module patterns (ModelOpt ``ignore`` wildcards) the engine must keep in the model
    dtype because mxload holds them so: without them in ``ignore`` the engine quantizes
    ``lm_head`` (a ModelOpt config quantizes ParallelLMHead unless excluded)."""
    moe: MoEMode = MoEMode(VLLM_DEFAULT_ALL2ALL, VLLM_SP_BACKENDS, True)
    """How the engine runs its MoE layers (the shared experts' sharding follows)."""
    scale_alg_models: tuple[str, ...] = ()
    """Architecture name prefixes the engine MX-quantizes with ``scale_alg=1`` (the E8M0
    scale from ``amax / 448``, rounded up; docs/contract.md §2.2); every other model: 0."""
    dense_linears: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per architecture: layer-rule names of linears the engine holds in the model dtype
    even from a quantized checkpoint (vllm-ascend's MLA: ``self_attn.kv_b_proj``)."""
    derived: Mapping[str, tuple[DerivedRule, ...]] = field(default_factory=dict)
    """Per architecture: tensors the engine derives from loaded parameters after loading."""
    sources: tuple[SourceRef, ...] = ()

    def view_of(self, kind: str) -> BufferView | None:
        return self.views.get(kind)


def _identity(n: int) -> BufferView:
    return BufferView(tuple(range(n)), tuple(range(n)))


# --- the tables ------------------------------------------------------------------------------

# vLLM runs sequence-parallel MoE under its default backend (tp > 1, dp > 1, EP) and its
# models then build the shared experts with disable_tp: whole on every TP rank.
_VLLM_MOE_SOURCES = (
    SourceRef(
        "all2all_backend default allgather_reducescatter; use_sequence_parallel_moe: an SP "
        "backend, enable_expert_parallel, tp > 1 and dp > 1",
        "vllm 0.23.0 config/parallel.py:177,626-640; 0.30.0 :197,715-730; 0.33.0 :220,768-784",
    ),
    SourceRef(
        "shared experts built with disable_tp=is_sequence_parallel (DeepseekV2MLP, "
        "Qwen2MoeMLP as Qwen3NextMLP); routed experts unchanged (FusedMoEParallelConfig)",
        "vllm 0.23.0 models/deepseek_v2.py:207-230,266,314-323, qwen2_moe.py:78-104, "
        "qwen3_next.py:102,147-155, layers/fused_moe/config.py:1085-1210; 0.33.0 "
        "deepseek_v2.py:252-275,312,364-370, qwen2_moe.py:86-105, qwen3_next.py:150-219",
    ),
)

MXLOAD = EngineProfile(
    name="mxload",
    description=(
        "mxload's own layout: every buffer row-major in the kernel layout, sharded and "
        "quantized as plain vLLM holds it"
    ),
    sources=(
        *_VLLM_MOE_SOURCES,
        SourceRef(
            "kv_b_proj a ColumnParallelLinear with the model's quant_config; MLA dequantizes "
            "a copy (get_and_maybe_dequant_weights)",
            "vllm 0.23.0 models/deepseek_v2.py:479-485, layers/attention/mla_attention.py:839; "
            "0.33.0 deepseek_v2.py:526-532, mla_attention.py:408-417",
        ),
    ),
)

# vllm-ascend's MXFP8 fused-MoE post-load does not copy: it re-views the [E, N, K]
# parameters that the weight loaders filled (w8a8_mxfp8.py, process_weights_after_loading):
# weight [E, N, K] -> transpose(1, 2) = [E, K, N] with stride [N*K, 1, K]; scale
# [E, N, g] -> reshape [E, N, g/2, 2] -> transpose(1, 2) = [E, g/2, N, 2] with stride
# [N*g, 2, g, 1]. The views are what its kernels (and graphs) read.
_ASCEND_MX_MOE = BufferView(view=(0, 1, 2), storage=(0, 2, 1))
_ASCEND_MX_MOE_SCALE = BufferView(view=(0, 1, 2, 3), storage=(0, 2, 1, 3))
# The unquantized fused MoE makes new contiguous parameters in post-load:
# w13 [E, 2I, H] -> [E, H, 2I], w2 [E, H, I] -> [E, I, H] (transpose(1, 2).contiguous()).
_ASCEND_DENSE_MOE = BufferView(view=(0, 2, 1), storage=(0, 1, 2))

_ASCEND_ODD_GROUPS = (
    "vllm-ascend's MXFP8 MoE post-load reshapes the scales to [E, N, g//2, 2], which "
    "raises for an odd group count g = K/32 (and it allocates MoE scales with K//32, "
    "dropping a partial group); mxload would pad the last pair as the kernel's ceil(K/64) "
    "contract asks, but the engine has no such buffer to write"
)
_ASCEND_ROUND_ROBIN = (
    "vllm-ascend builds every MoE layer's expert map itself (init_eplb_config calls vLLM's "
    "determine_expert_map without a placement, so linear), whatever the engine's "
    "expert_placement_strategy and whatever the model, DeepSeek-V3's expert groups "
    "included; writing round_robin experts into its buffers would put the wrong experts "
    "there: use --expert-placement linear (what the engine does)"
)
_ASCEND_K_UNALIGNED = (
    "vllm-ascend quantizes it anyway (0.23-0.27 with a partial last scale group, 0.28+ "
    "padding a row-parallel shard to the group boundary before and after), so the engine's "
    "parameter is MXFP8 where mxload would hold the model dtype; change tp so every "
    "row-parallel K shard is a multiple of 32, or use --engine mxload"
)
# vLLM's Qwen3-MoE builds embed_tokens, the final norm and lm_head unconditionally, so
# every pipeline stage holds (and loads) them.
_QWEN3_MOE_EVERY_STAGE = {
    "Qwen3MoeForCausalLM": ("model.embed_tokens", "model.norm", "lm_head"),
    # vLLM 0.23 model_executor/models/qwen3_5.py: Qwen3_5Model builds embed_tokens with no
    # pipeline check (norm and lm_head only on the last stage).
    "Qwen3_5ForConditionalGeneration": ("language_model.model.embed_tokens",),
    "Qwen3_5MoeForConditionalGeneration": ("language_model.model.embed_tokens",),
}

# vllm-ascend's proposer shares the target's lm_head only for eagle/dflash (and MLA MTP):
# a Qwen3.5 MTP drafter keeps the ParallelLMHead it loaded from ``lm_head``.
_ASCEND_DRAFTER_OWN = {
    "Qwen3_5ForConditionalGeneration": ("drafter.lm_head",),
    "Qwen3_5MoeForConditionalGeneration": ("drafter.lm_head",),
}

# vllm-ascend 0.23: the platform sets flashinfer_all2allv (no sequence-parallel MoE)
# unless compilation_config.pass_config.enable_sp; its linears honour disable_tp, and its
# shared-expert DP switch (enable_shared_expert_dp, flashcomm1, SP by pass) holds the
# shared experts whole whatever the layout.
_ASCEND_0_23_MOE = MoEMode(
    "flashinfer_all2allv",
    VLLM_SP_BACKENDS,
    sp_replicates_shared=True,
    shared_dp_setting=(
        "additional_config enable_shared_expert_dp (with EP and tp > 1), enable_flashcomm1 "
        "(or VLLM_ASCEND_ENABLE_FLASHCOMM1=1), or compilation_config.pass_config.enable_sp "
        "without enforce_eager"
    ),
)
# vllm-ascend 0.27+: the shared experts' sharding is decoupled from sequence parallelism;
# only enable_shared_expert_dp holds them whole.
_ASCEND_MAIN_MOE = MoEMode(
    "flashinfer_all2allv",
    VLLM_SP_BACKENDS,
    sp_replicates_shared=False,
    shared_dp_setting="additional_config enable_shared_expert_dp (with EP and tp > 1)",
)
# vllm-ascend's MLA post-load asserts an unquantized kv_b_proj (it absorbs it into W_UK_T
# and W_UV from real values); plain vLLM quantizes it like every other linear and
# dequantizes a copy for its own absorption.
_ASCEND_DENSE_LINEARS = {"DeepseekV3ForCausalLM": ("self_attn.kv_b_proj",)}
# vllm-ascend's MLA post-load (AscendMLAImpl.process_weights_after_loading, which its
# AscendMultiHeadLatentAttention calls for the MLAAttention it holds as
# self_attn.mla_attn.mla_attn) reads kv_b_proj's weight [heads * (P + V), L] (model
# dtype: the engine asserts it unquantized) as [L, heads, P + V], splits P | V per head
# and keeps two new contiguous tensors on its impl in the same dtype:
# W_UK_T = W_UK.permute(1, 2, 0) [heads, P, L] and W_UV = W_UV.transpose(0, 1)
# [heads, L, V]. Its kernels read those, never kv_b_proj, on the decode path.
_MLA_IMPL = "self_attn.mla_attn.mla_attn.impl"
_MLA_SPLIT = ("qk_nope_head_dim", "v_head_dim")
_ASCEND_DERIVED = {
    "DeepseekV3ForCausalLM": (
        DerivedRule("self_attn.kv_b_proj", f"{_MLA_IMPL}.W_UK_T", "mla_uk_t", _MLA_SPLIT, 0),
        DerivedRule("self_attn.kv_b_proj", f"{_MLA_IMPL}.W_UV", "mla_uv", _MLA_SPLIT, 1),
    ),
}

VLLM_ASCEND_0_23 = EngineProfile(
    name="vllm-ascend-0.23",
    description="vllm-ascend 0.23.0.post1 on vLLM 0.23.0: W8A8_MXFP8 post-load parameters",
    views={
        "mx_moe": _ASCEND_MX_MOE,
        "mx_moe_scale": _ASCEND_MX_MOE_SCALE,
        "dense_moe": _ASCEND_DENSE_MOE,
    },
    moe_odd_groups=_ASCEND_ODD_GROUPS,
    round_robin=_ASCEND_ROUND_ROBIN,
    every_stage=_QWEN3_MOE_EVERY_STAGE,
    mx_k_unaligned=_ASCEND_K_UNALIGNED,
    drafter_own=_ASCEND_DRAFTER_OWN,
    moe=_ASCEND_0_23_MOE,
    dense_linears=_ASCEND_DENSE_LINEARS,
    derived=_ASCEND_DERIVED,
    sources=(
        SourceRef(
            "pinned vLLM", "vllm-ascend 0.23.0.post1 docs/source/conf.py:78,86 (vLLM 0.23.0)"
        ),
        SourceRef(
            "MoE mode: flashinfer_all2allv unless pass_config.enable_sp; shared experts "
            "whole under disable_tp or shared_expert_dp_enabled() (enable_shared_expert_dp, "
            "enable_sp(): flashcomm1, enable_sp_by_pass)",
            "vllm_ascend/platform.py:659-662, ops/linear_op.py:742-747, utils.py:899-934, "
            "ascend_config.py:84-88,114-122,291-295",
        ),
        SourceRef(
            "MLA: kv_b_proj must be unquantized (UnquantizedLinearMethod asserted)",
            "vllm_ascend/attention/mla_v1.py:923-924, sfa_v1.py:744-745",
        ),
        SourceRef(
            "MLA post-load: W_UK_T [N, P, L] and W_UV [N, L, V] from kv_b_proj, copied "
            "into on a second post-load",
            "vllm_ascend/attention/mla_v1.py:922-956; ops/mla.py:100-137",
        ),
        SourceRef(
            "MTP drafter: embed_tokens shared at pp 1, its own lm_head kept for method mtp "
            "on a non-MLA model (vLLM 0.23 shares both)",
            "vllm_ascend/spec_decode/llm_base_proposer.py:373-375,388-454,456-509; "
            "vllm 0.23.0 v1/spec_decode/llm_base_proposer.py:1275-1276,1293-1430",
        ),
        SourceRef(
            "MoE names mlp.experts.w13_weight (AscendFusedMoE of fused_moe_0_23_0)",
            "vllm_ascend/utils.py:763-766, vllm_ascend/ops/fused_moe/fused_moe.py:291",
        ),
        SourceRef(
            "MX linear: contiguous [K, N] and [ceil(g/2), N, 2] (odd g padded), persistent",
            "vllm_ascend/quantization/methods/w8a8_mxfp8.py:59-67, 109-162",
        ),
        SourceRef(
            "MX MoE: [E, N, K] / [E, N, K//32] created, post-load transposed views",
            "vllm_ascend/quantization/methods/w8a8_mxfp8.py:232-255, 356-395 (reshape/transpose 386-392)",
        ),
        SourceRef(
            "fallback MoE: [E, H, 2I] and [E, I, H] contiguous, new parameters",
            "vllm_ascend/ops/fused_moe/fused_moe.py:112-119",
        ),
        SourceRef(
            "NZ: weight_nz_mode from VLLM_ASCEND_ENABLE_NZ (default 1); updates refuse it",
            "vllm_ascend/envs.py:92, ascend_config.py:249-253, worker/worker.py:295-312",
        ),
        SourceRef(
            "round_robin falls back to linear without expert groups / DeepEP-LL",
            "vllm 0.23.0 model_executor/layers/fused_moe/expert_map_manager.py:116-147",
        ),
        SourceRef(
            "Qwen3-MoE: embed_tokens, norm, lm_head built on every PP stage",
            "vllm 0.23.0 model_executor/models/qwen3_moe.py:459,470,692",
        ),
        SourceRef(
            "ModelOpt config quantizes ParallelLMHead unless excluded",
            "vllm 0.23.0 model_executor/layers/quantization/modelopt.py:139-203",
        ),
    ),
)

VLLM_ASCEND_MAIN = EngineProfile(
    name="vllm-ascend-main",
    description=(
        "vllm-ascend main (read at 182b75ea, 2026-08-22) on vLLM main / 0.33: routed experts "
        "under mlp.experts.routed_experts."
    ),
    moe_infix=".routed_experts",
    views=VLLM_ASCEND_0_23.views,
    moe_odd_groups=_ASCEND_ODD_GROUPS,
    round_robin=_ASCEND_ROUND_ROBIN,
    every_stage=_QWEN3_MOE_EVERY_STAGE,
    mx_k_unaligned=_ASCEND_K_UNALIGNED,
    drafter_own=_ASCEND_DRAFTER_OWN,
    moe=_ASCEND_MAIN_MOE,
    dense_linears=_ASCEND_DENSE_LINEARS,
    scale_alg_models=("MiniMaxM3",),
    derived=_ASCEND_DERIVED,
    sources=(
        SourceRef(
            "npu_dynamic_mx_quant scale_alg 1 for architectures MiniMaxM3* (or model_type "
            "minimax_m3) where the hardware has it, else 0; 0.23 always 0",
            "vllm-ascend 0.27.1rc1 vllm_ascend/quantization/utils.py:46-; 0.30.0rc2 "
            "quantization/utils.py:47-80, methods/w8a8/w8a8_mxfp8.py:72,96, fp8_block.py:108-120",
        ),
        SourceRef(
            "MoE mode: flashinfer_all2allv unless SP MoE is asked for; shared experts whole "
            "only under enable_shared_expert_dp (sequence parallelism alone does not)",
            "vllm-ascend 0.27.1rc1 vllm_ascend/ops/linear_op.py:321-330, utils.py:827-828, "
            "ascend_config.py:514-518,530-541; 0.30.0rc2 linear_op.py:432-440, "
            "utils.py:1013-1014, ascend_config.py:747-751,766",
        ),
        SourceRef(
            "MLA: kv_b_proj must be unquantized (UnquantizedLinearMethod asserted)",
            "vllm-ascend 0.30.0rc2 vllm_ascend/attention/mla_v1.py:1095-1096, sfa_v1.py:933-938",
        ),
        SourceRef(
            "MLA post-load: W_UK_T and W_UV from kv_b_proj as 0.23, kept at their address "
            "by replace_parameter(prefer_copy=True)",
            "vllm-ascend 0.30.0rc2 vllm_ascend/attention/mla_v1.py:1094-1139",
        ),
        SourceRef(
            "MTP drafter keeps its own lm_head for method mtp on a non-MLA model",
            "vllm-ascend 0.27.1rc1 vllm_ascend/spec_decode/llm_base_proposer.py:525-; "
            "0.30.0rc2 the same file:568-",
        ),
        SourceRef(
            "MoE names mlp.experts.routed_experts.w13_weight (MoERunner -> routed_experts)",
            "vllm 0.33.0 model_executor/layers/fused_moe/layer.py:415-470,480; "
            "vllm-ascend main vllm_ascend/ops/fused_moe/fused_moe.py:39-71, xlite/xlite.py:370",
        ),
        SourceRef(
            "MX linear and MX MoE post-load: as 0.23 (transposed MoE views)",
            "vllm-ascend main vllm_ascend/quantization/methods/w8a8_mxfp8.py:68-77, 122-175, "
            "244-267, 319-358",
        ),
        SourceRef(
            "fallback MoE: [E, H, 2I] and [E, I, H] contiguous, new parameters",
            "vllm-ascend main vllm_ascend/ops/fused_moe/routed_experts.py:75-83",
        ),
        SourceRef(
            "NZ: VLLM_ASCEND_ENABLE_NZ default 1; rl_config.enabled forces 0; updates refuse NZ",
            "vllm-ascend main vllm_ascend/envs.py:80, ascend_config.py:240-244, 583-588, "
            "worker/worker.py:288-306",
        ),
        SourceRef(
            "round_robin falls back to linear without expert groups / DeepEP-LL",
            "vllm 0.33.0 model_executor/layers/fused_moe/expert_map_manager.py:116-147, 411-432",
        ),
        SourceRef(
            "Qwen3-MoE: embed_tokens, norm, lm_head built on every PP stage",
            "vllm 0.33.0 model_executor/models/qwen3_moe.py:468-479,580-585",
        ),
        SourceRef(
            "ModelOpt config quantizes ParallelLMHead unless excluded",
            "vllm 0.33.0 model_executor/layers/quantization/modelopt.py:191-254",
        ),
    ),
)

ENGINES: Mapping[str, EngineProfile] = {
    p.name: p for p in (MXLOAD, VLLM_ASCEND_0_23, VLLM_ASCEND_MAIN)
}
"""Every engine profile, by ``--engine`` name."""

DEFAULT_ENGINE = MXLOAD.name


def known_engines() -> list[str]:
    """What ``--engine`` takes: the profiles, then the release names (each once)."""
    return list(dict.fromkeys([*ENGINES, *RELEASES]))


def engine_profile(name: str | EngineProfile) -> EngineProfile:
    """The profile called ``name``, or the profile of the release called ``name``;
    UsageError naming ``--engine`` and the known ones."""
    if isinstance(name, EngineProfile):
        return name
    found = ENGINES.get(name)
    if found is None and name in RELEASES:
        found = ENGINES[RELEASES[name].profile]
    if found is None:
        raise UsageError(
            f"--engine {name!r} is not a known engine; known: {', '.join(known_engines())}",
            key="--engine",
        )
    return found


def check_mx_k(profile: EngineProfile, plan_rank: RankPlan) -> None:
    """Refuse writing into the engine a quantized linear the planner kept in the model
    dtype because its local K is not a multiple of the MX group, where the engine would
    hold it quantized (LayoutError naming the buffer)."""
    if not profile.mx_k_unaligned:
        return
    for u in plan_rank.units:
        if u.quantized and u.kind == "linear" and u.layout == LAYOUT_DENSE and u.cols % MX_GROUP:
            raise LayoutError(
                f"--engine {profile.name} cannot hold {u.buffer}: its local K = {u.cols} is "
                f"not a multiple of {MX_GROUP}; " + profile.mx_k_unaligned,
                key="--engine",
                tensor=u.buffer,
            )


# --- what the planner asks -----------------------------------------------------------------------

DERIVED_SHAPES = {
    "mla_uk_t": lambda heads, width, k: (heads, width, k),
    "mla_uv": lambda heads, width, k: (heads, k, width),
}
"""Per derived op: its buffer's shape from the source's local heads, the width of the
per-head group it reads and the source's K (``W_UK_T [N, P, L]``, ``W_UV [N, L, V]``)."""


def derived_rules(
    profile: EngineProfile, architecture: str, source: str
) -> tuple[DerivedRule, ...]:
    """The tensors ``profile`` derives from the table row ``source`` of ``architecture``
    (or from that row inside an MTP layer: ``mtp_block.`` + the row)."""
    return tuple(
        d
        for d in profile.derived.get(architecture, ())
        if source == d.source or source.endswith("." + d.source)
    )


@dataclass(frozen=True)
class HeldAs:
    """One buffer as the engine holds it: the view's shape, the storage order, and how the
    view maps back to mxload's canonical dimensions."""

    shape: tuple[int, ...]
    storage_order: tuple[int, ...]
    """Engine dims from the outermost in memory; () means row-major."""
    canonical_of_view: tuple[int, ...]
    """``canonical_of_view[i]`` = canonical dim of engine dim ``i``; () means identity."""


def held_as(profile: EngineProfile, kind: str, canonical: tuple[int, ...]) -> HeldAs:
    """The engine's view of a buffer of ``kind`` whose canonical shape is ``canonical``."""
    bv = profile.view_of(kind)
    if bv is None or bv == _identity(len(canonical)):
        return HeldAs(canonical, (), ())
    if len(bv.view) != len(canonical):
        raise ValueError(f"profile {profile.name}: {kind} view {bv} for shape {canonical}")
    shape = tuple(canonical[d] for d in bv.view)
    storage = () if bv.storage == tuple(range(len(shape))) else bv.storage
    view = () if bv.view == tuple(range(len(shape))) else bv.view
    return HeldAs(shape, storage, view)


def resolve_moe(profile: EngineProfile, layout: ParallelLayout) -> ResolvedMoE:
    """The MoE mode ``profile``'s engine runs ``layout`` in: its all2all backend (the
    layout's, else the engine's), whether that is sequence-parallel MoE, and whether the
    shared experts are whole on every TP rank; UsageError for a shared-expert switch the
    engine does not have."""
    mode = profile.moe
    backend = layout.all2all_backend or mode.all2all_backend
    if backend not in ALL2ALL_BACKENDS:
        raise UsageError(
            f"--all2all-backend {backend!r} is not one of vLLM's: {', '.join(ALL2ALL_BACKENDS)}",
            key="--all2all-backend",
        )
    backend = _REMOVED_ALL2ALL.get(backend, backend)
    sp = (
        backend in mode.sequence_parallel_backends
        and layout.enable_expert_parallel
        and layout.tp > 1
        and layout.dp > 1
    )
    if layout.shared_expert_dp and not mode.shared_dp_setting:
        raise UsageError(
            f"--enable-shared-expert-dp: --engine {profile.name} has no shared-expert data "
            "parallel switch (plain vLLM holds the shared experts whole only under "
            "sequence-parallel MoE: an --all2all-backend such as allgather_reducescatter "
            "with --enable-expert-parallel, tp > 1 and dp > 1)",
            key="--enable-shared-expert-dp",
        )
    if layout.shared_expert_dp:
        whole, why = True, f"the engine's shared-expert DP switch is on ({mode.shared_dp_setting})"
    elif sp and mode.sp_replicates_shared:
        whole, why = True, "sequence-parallel MoE holds them whole on every TP rank"
    elif sp:
        whole, why = False, "this engine splits them under sequence parallelism too"
    else:
        whole, why = (
            False,
            "no sequence-parallel MoE: it needs an SP backend, EP, tp > 1 and dp > 1",
        )
    return ResolvedMoE(profile.name, backend, sp, whole, why)


def scale_alg_for(profile: EngineProfile, architecture: str, asked: int | None = None) -> int:
    """The MX scale rule for ``architecture`` under ``profile``: ``asked`` when given (a
    trainer's own rule, ``--scale-alg``), else the engine's choice for the model."""
    if asked is not None:
        from .formats import SCALE_ALGS

        if asked not in SCALE_ALGS:
            raise UsageError(
                f"--scale-alg {asked!r} is not one of {', '.join(map(str, SCALE_ALGS))}",
                key="--scale-alg",
            )
        return asked
    return 1 if architecture.startswith(profile.scale_alg_models or ("\0",)) else 0


def check_expert_placement(profile: EngineProfile, placement: str, uses_ep: bool) -> None:
    """Refuse an expert placement the engine would not honour (LayoutError with the reason)."""
    if uses_ep and placement == "round_robin" and profile.round_robin:
        raise LayoutError(
            f"--expert-placement round_robin with --engine {profile.name}: " + profile.round_robin,
            key="--expert-placement",
        )


def check_moe_groups(profile: EngineProfile, buffer: str, k: int, group: int) -> None:
    """Refuse an MX MoE buffer with an odd group count where the engine cannot hold one."""
    if profile.moe_odd_groups and (k // group) % 2:
        raise LayoutError(
            f"--engine {profile.name} cannot hold {buffer}: its K = {k} gives {k // group} "
            f"MX groups (odd); " + profile.moe_odd_groups + "; change the layout (tp, EP) so "
            "the local K/32 is even, or use --engine mxload",
            key="--engine",
            tensor=buffer,
        )
