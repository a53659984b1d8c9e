"""Architectures as tables: which checkpoint tensors make which device tensor, how. Pure.

docs/contract.md §3 asks for architectures described as *tables of name patterns -> parallel style*,
not as code branches; adding an architecture is adding a table here (and its name to
``mxload.orchestrator.plan.config.SUPPORTED_ARCHITECTURES``). The planner (``mxload.orchestrator.plan.planner``)
and the layout checks (``mxload.orchestrator.plan.layout``) read nothing else about a model.

A table row (:class:`TensorRule`) names one device tensor (vLLM/vllm-ascend's parameter
name), the checkpoint modules merged into it in order (q, k, v; gate, up), where it lives
(stage 0, every decoder layer of a kind, the last stage), its parallel style, and whether
the checkpoint may hold it quantized (``linear``) and the device may hold it as MXFP8
(``mx``). Shapes are symbolic: each source names its dimensions (``("Q", "H")``), and the
architecture's :class:`Dim` table turns a name into a size from the config, together with
the config key an error should name when a layout cannot split that dimension.

Parallel styles (docs/contract.md §3):

* ``column`` - output rows N split over tp, part by part (each merged part is split on its
  own, then the local slices are concatenated); a source with ``split="kv_heads"`` follows
  the kv-head rule (split when ``kv % tp == 0``, else each head replicated on ``tp / kv``
  ranks);
* ``row`` - reduction columns K split over tp (o_proj, down_proj);
* ``replicated`` - every rank holds all of it (norms, the MoE router, DeepSeek's
  ``fused_qkv_a_proj``);
* ``vocab`` - vocab-parallel rows: V padded to a multiple of 64, split in tp equal parts;
* ``moe`` - routed experts (sources gate, up, down, with ``{e}`` in the module name):
  ``w13`` = gate then up, ``w2`` = down; TP-sharded over dp*tp, or whole experts under EP.

What stays in which dtype, and why:

* Every ``linear`` row may become MXFP8 (``mx_linear``/``mx_moe``) when its checkpoint
  weight is quantized and its local K is a multiple of 32 (docs/contract.md §2.2); otherwise it is
  held resolved in the model dtype (quantized source) or as the checkpoint stores it.
* Linears an engine holds in the model dtype whatever the checkpoint stores are the engine
  profile's (``EngineProfile.dense_linears``, applied by :meth:`Architecture.for_engine`):
  vllm-ascend's MLA asserts an unquantized DeepSeek ``self_attn.kv_b_proj`` (it absorbs it
  into W_UK_T / W_UV from real values); plain vLLM quantizes it like every other linear.
* Shared experts (``shared_expert=True`` rows) are TP-split unless the engine's MoE mode
  holds them whole on every TP rank (vLLM's sequence-parallel MoE, vllm-ascend's
  shared-expert DP: ``mxload.orchestrator.plan.engines.resolve_moe``).
* Norms, embeddings, lm_head and the router (``mlp.gate.weight``) are not linears the
  checkpoint quantizes: they are copied in their checkpoint dtype (the model dtype when
  planning from the config alone).
* DeepSeek's ``mlp.gate.e_score_correction_bias`` is float32 (``float32=True``): vLLM
  creates that parameter in float32 and DeepSeek-V3 ships it in F32, since the
  bias-corrected top-k routing is sensitive to its small values.

Qwen3.5's vision tower (``model.visual.*``) is planned as vLLM holds it (model dtype,
TP-sharded, on every pipeline stage) unless the layout is language-model-only; with
``mm_encoder_tp_mode="data"`` every TP rank holds it whole (:meth:`Architecture.for_layout`).

Qwen3.5's MTP module (``mtp.*``) is planned when the layout configures vLLM's MTP
speculative decoding (``ParallelLayout.speculative_method == "mtp"``): the drafter's own
rows (``place="mtp"``) and its decoder layer (``place="mtp_layer"``: the model's
full-attention layer and MLP rows under ``mtp.layers.{i}``), on the last pipeline stage,
TP-sharded like the model; device names are the drafter model's parameter names under
``drafter.``. Rows the engine shares with the target model (``shared_with_target``) are
planned only where the engine profile says it keeps its own copy.

DeepSeek-V3's MTP layer (``model.layers.{num_hidden_layers + j}``) is planned the same way,
as vLLM's ``DeepSeekMTP`` holds it: its own rows (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``) and the model's decoder-layer rows under ``mtp_block.``, on the last
stage, under ``drafter.model.layers.{L + j}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from ..errors import UnsupportedError
from .config import ModelConfig

Style = Literal["column", "row", "replicated", "vocab", "moe"]
Place = Literal["first", "layer", "last", "vision", "vision_layer", "mtp", "mtp_layer"]
"""first: pipeline stage 0 only; layer: each decoder layer of the rule's kind; last: the
last pipeline stage only (docs/contract.md §3 "Pipeline"); vision: the vision tower's own
rows, vision_layer: each of its blocks, both on every pipeline stage (vLLM builds the
tower outside the pipeline split) unless the layout is language-model-only; mtp: the MTP
drafter's own rows, mtp_layer: each of its decoder layers, both on the last pipeline stage
(where vLLM builds the drafter) when the layout plans MTP."""
LayerKind = Literal[
    "all",
    "dense_mlp",
    "moe",
    "shared_experts",
    "shared_expert",
    "q_lora",
    "no_q_lora",
    "linear_attention",
    "full_attention",
]
Held = Literal["", "model", "float32"]
"""What dtype a device tensor has whatever the checkpoint stores: ``""`` the checkpoint's
(the model dtype quantized sources resolve to), ``model`` the model dtype, ``float32``."""
Split = Literal["tp", "kv_heads"]

LAYER_PREFIX = "model.layers.{i}"
"""Checkpoint and device prefix of decoder layer ``i`` (``P`` in docs/contract.md §3)."""

EXPERT_PLACEHOLDER = "{e}"
"""Stands for the global expert id inside a ``moe`` source's module name."""

W13_BUFFER = "w13_weight"
W2_BUFFER = "w2_weight"
"""Fused MoE buffer names under the rule's name (``P.mlp.experts.w13_weight``, docs/contract.md §3)."""

DRAFTER_PREFIX = "drafter."
"""Device names of the MTP drafter's rows: this, then the drafter model's own parameter
name (vLLM's ``model_runner.drafter.model``)."""

SCALE_SUFFIX = "_scale"
"""A weight buffer ``X`` of MX layout has its scale buffer ``X + '_scale'`` (docs/contract.md §3)."""


def _one(config: ModelConfig) -> int:
    return 1


@dataclass(frozen=True)
class Dim:
    """A symbolic dimension: ``count(config) * per_unit(config)`` elements.

    A split divides ``count`` (heads, features), never ``per_unit`` (head_dim), so a
    shard boundary never cuts an attention head in two.
    """

    key: str
    """What a refused layout names: the config key (or expression) to blame."""
    count: Callable[[ModelConfig], int]
    per_unit: Callable[[ModelConfig], int] = _one

    def size(self, config: ModelConfig) -> int:
        return self.count(config) * self.per_unit(config)


@dataclass(frozen=True)
class SourceSpec:
    """One checkpoint tensor feeding a device tensor."""

    module: str
    """Module name: relative to ``model.layers.{i}.`` for layer rules, absolute otherwise;
    ``{e}`` stands for the expert id in ``moe`` rules."""
    dims: tuple[str, ...]
    """Dim names of its checkpoint shape: ``(N, K)`` for 2-D, ``(n,)`` for 1-D."""
    tensor: str = "weight"
    """Tensor name under the module (``weight``, ``e_score_correction_bias``)."""
    split: Split = "tp"
    """How a ``column`` rule splits its rows: plainly over tp, or by the kv-head rule."""
    part_of: tuple[str, ...] = ()
    """Non-empty: this source is a row range of a larger checkpoint tensor of these dims
    (Qwen3.5's ``in_proj_qkv`` holds q, k and v, each split over tp on its own)."""
    before: tuple[str, ...] = ()
    """With ``part_of``: the dims whose sizes add up to the range's first row."""

    @property
    def tensor_dims(self) -> tuple[str, ...]:
        """Dims of the whole checkpoint tensor."""
        return self.part_of or self.dims


@dataclass(frozen=True)
class TensorRule:
    """One device tensor: its sources, where it lives, how it is sharded and stored."""

    name: str
    """Device module name (relative to the layer prefix for layer rules). The weight
    buffer is ``name + '.' + sources[0].tensor``; ``moe`` rules hold ``name.w13_weight``
    and ``name.w2_weight``."""
    style: Style
    sources: tuple[SourceSpec, ...]
    place: Place = "layer"
    when: LayerKind = "all"
    """Which decoder layers have it (see ``LAYER_KINDS``)."""
    linear: bool = False
    """A linear weight the checkpoint may quantize (F8_E4M3 + scale)."""
    mx: bool = True
    """The device may hold it MXFP8 when its source is quantized (False: resolved, model dtype)."""
    float32: bool = False
    """Planned as float32 when no checkpoint says its dtype (else the model dtype)."""
    tied_source: str = ""
    """With ``tie_word_embeddings``: the module it is built from instead of its own."""
    held: Held = ""
    """The engine casts it to this dtype on load, whatever the checkpoint stores (vLLM's
    ``A_log`` is a float32 parameter; its norms and ``conv1d`` are model dtype)."""
    shared_expert: bool = False
    """A shared expert's linear: replicated where the engine holds the shared experts whole
    (:meth:`Architecture.for_engine`)."""
    shared_with_target: bool = False
    """An MTP drafter row the engine replaces by the target model's tensor after loading
    (vLLM shares the lm_head); planned only where the engine profile keeps its own copy
    (``EngineProfile.drafter_own``)."""


LAYER_KINDS: Mapping[str, Callable[[ModelConfig, int], bool]] = {
    "all": lambda c, i: True,
    "dense_mlp": lambda c, i: not c.is_moe_layer(i),
    "moe": lambda c, i: c.is_moe_layer(i),
    "shared_experts": lambda c, i: c.is_moe_layer(i) and c.n_shared_experts > 0,
    "shared_expert": lambda c, i: c.is_moe_layer(i) and c.shared_expert_intermediate_size > 0,
    "linear_attention": lambda c, i: c.is_linear_attention(i),
    "full_attention": lambda c, i: not c.is_linear_attention(i),
    "q_lora": lambda c, i: c.q_lora_rank > 0,
    "no_q_lora": lambda c, i: c.q_lora_rank == 0,
}
"""Which decoder layers a rule applies to (docs/contract.md §3 gives the MoE-layer rule per model)."""


@dataclass(frozen=True)
class Architecture:
    """A model family: its dimension table and its tensor table, in plan order."""

    name: str
    dims: Mapping[str, Dim]
    rules: tuple[TensorRule, ...]
    layer_prefix: str = LAYER_PREFIX
    """Checkpoint prefix of decoder layer ``{i}``."""
    device_layer_prefix: str = LAYER_PREFIX
    """Device (engine parameter) prefix of decoder layer ``{i}``."""
    vision_layer_prefix: str = ""
    """Checkpoint prefix of vision block ``{i}`` (``vision_layer`` rules)."""
    vision_device_layer_prefix: str = ""
    """Device prefix of vision block ``{i}``."""
    mtp_layer_prefix: str = ""
    """Checkpoint prefix of MTP decoder layer ``{i}`` (``mtp_layer`` rules)."""
    mtp_device_layer_prefix: str = ""
    """Device prefix of MTP decoder layer ``{i}``."""
    mtp_after_layers: bool = False
    """MTP layer ``j`` is numbered ``num_hidden_layers + j`` (DeepSeek's
    ``model.layers.{L + j}``), and its rows' layer kinds are read at that number; else
    ``j``, with kinds read at layer 0 (Qwen3.5's ``mtp.layers.{j}``)."""

    def size(self, dim: str, config: ModelConfig) -> int:
        return self.dims[dim].size(config)

    def layer_rules(self, config: ModelConfig, layer: int) -> tuple[int, ...]:
        """Indices (into ``rules``) of the layer rules decoder layer ``layer`` has."""
        return tuple(
            i
            for i, r in enumerate(self.rules)
            if r.place == "layer" and LAYER_KINDS[r.when](config, layer)
        )

    def rules_at(self, place: Place) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.rules) if r.place == place)

    def vision_rules(
        self, config: ModelConfig, language_model_only: bool
    ) -> tuple[tuple[int, int], ...]:
        """``(rule index, block)`` of every vision-tower row the engine builds (block -1 for
        the tower's own rows); none for a model without a tower or a language-model-only
        engine."""
        if config.vision is None or language_model_only:
            return ()
        tower = tuple((i, -1) for i in self.rules_at("vision"))
        blocks = tuple(
            (i, b) for b in range(config.vision.depth) for i in self.rules_at("vision_layer")
        )
        return tower + blocks

    def mtp_rules(
        self, config: ModelConfig, planned: bool, own: tuple[str, ...] = ()
    ) -> tuple[tuple[int, int], ...]:
        """``(rule index, MTP layer)`` of every MTP row the engine's drafter holds (layer
        -1 for the drafter's own rows); none unless ``planned`` and the checkpoint has MTP
        layers. ``own``: names of ``shared_with_target`` rows the engine keeps its own
        copy of. A Qwen3.5 MTP layer is a full-attention decoder layer with the MLP every
        Qwen3.5 layer has (dense, or a sparse MoE block for Qwen3.5-MoE), so a layer
        row's kind is read at layer 0 for its MLP; a DeepSeek MTP layer
        (``mtp_after_layers``) is numbered after the model's layers, and its kinds are
        those of that number (a MoE layer past ``first_k_dense_replace``)."""
        if not planned or not config.mtp_layers:
            return ()
        rows = tuple(
            (i, -1)
            for i in self.rules_at("mtp")
            if not self.rules[i].shared_with_target or self.rules[i].name in own
        )
        base = config.num_hidden_layers if self.mtp_after_layers else 0
        return rows + tuple(
            (i, base + j)
            for j in range(config.mtp_layers)
            for i in self.rules_at("mtp_layer")
            if LAYER_KINDS[self.rules[i].when](config, base + j if base else 0)
        )

    def for_layout(self, mm_encoder_tp_mode: str) -> Architecture:
        """This table as the engine builds it under ``mm_encoder_tp_mode``: with ``data``
        (vLLM's ``is_vit_use_data_parallel``: every vision linear ``disable_tp``) each
        vision row is replicated; rule indices are unchanged."""
        if mm_encoder_tp_mode != "data":
            return self
        rules = tuple(
            replace(r, style="replicated") if r.place in ("vision", "vision_layer") else r
            for r in self.rules
        )
        return replace(self, rules=rules)

    def for_engine(
        self, shared_experts_whole: bool, dense_linears: tuple[str, ...]
    ) -> Architecture:
        """This table as an engine holds it: shared-expert rows replicated when its MoE mode
        holds them whole, the linears named in ``dense_linears`` kept in the model dtype
        (``mx=False``); rule indices are unchanged."""
        if not shared_experts_whole and not dense_linears:
            return self
        rules = tuple(
            replace(
                r,
                style="replicated" if shared_experts_whole and r.shared_expert else r.style,
                mx=r.mx and r.name not in dense_linears,
            )
            for r in self.rules
        )
        return replace(self, rules=rules)


def _S(
    module: str,
    *dims: str,
    tensor: str = "weight",
    split: Split = "tp",
    part_of: tuple[str, ...] = (),
    before: tuple[str, ...] = (),
) -> SourceSpec:
    return SourceSpec(
        module=module,
        dims=tuple(dims),
        tensor=tensor,
        split=split,
        part_of=part_of,
        before=before,
    )


# --- shared rows ---------------------------------------------------------------------------

_EMBED = TensorRule(
    "model.embed_tokens", "vocab", (_S("model.embed_tokens", "V", "H"),), place="first"
)
_FINAL_NORM = TensorRule("model.norm", "replicated", (_S("model.norm", "H"),), place="last")
_LM_HEAD = TensorRule(
    "lm_head",
    "vocab",
    (_S("lm_head", "V", "H"),),
    place="last",
    tied_source="model.embed_tokens",
)
_INPUT_NORM = TensorRule("input_layernorm", "replicated", (_S("input_layernorm", "H"),))
_POST_NORM = TensorRule(
    "post_attention_layernorm", "replicated", (_S("post_attention_layernorm", "H"),)
)
_DENSE_MLP = (
    TensorRule(
        "mlp.gate_up_proj",
        "column",
        (_S("mlp.gate_proj", "I", "H"), _S("mlp.up_proj", "I", "H")),
        when="dense_mlp",
        linear=True,
    ),
    TensorRule(
        "mlp.down_proj", "row", (_S("mlp.down_proj", "H", "I"),), when="dense_mlp", linear=True
    ),
)
_ROUTER = TensorRule("mlp.gate", "replicated", (_S("mlp.gate", "E", "H"),), when="moe")
_EXPERTS = TensorRule(
    "mlp.experts",
    "moe",
    (
        _S("mlp.experts.{e}.gate_proj", "MI", "H"),
        _S("mlp.experts.{e}.up_proj", "MI", "H"),
        _S("mlp.experts.{e}.down_proj", "H", "MI"),
    ),
    when="moe",
    linear=True,
)

# --- Qwen3 (dense) and Qwen3-MoE ---------------------------------------------------------------

_QWEN3_DIMS: Mapping[str, Dim] = {
    "H": Dim("hidden_size", lambda c: c.hidden_size),
    "Q": Dim("num_attention_heads", lambda c: c.num_attention_heads, lambda c: c.head_dim),
    "KV": Dim("num_key_value_heads", lambda c: c.num_key_value_heads, lambda c: c.head_dim),
    "D": Dim("head_dim", lambda c: c.head_dim),
    "I": Dim("intermediate_size", lambda c: c.intermediate_size),
    "MI": Dim("moe_intermediate_size", lambda c: c.moe_intermediate_size),
    "E": Dim("num_experts", lambda c: c.num_experts),
    "V": Dim("vocab_size", lambda c: c.vocab_size),
}

_QWEN3_ATTENTION = (
    _INPUT_NORM,
    TensorRule(
        "self_attn.qkv_proj",
        "column",
        (
            _S("self_attn.q_proj", "Q", "H"),
            _S("self_attn.k_proj", "KV", "H", split="kv_heads"),
            _S("self_attn.v_proj", "KV", "H", split="kv_heads"),
        ),
        linear=True,
    ),
    TensorRule("self_attn.q_norm", "replicated", (_S("self_attn.q_norm", "D"),)),
    TensorRule("self_attn.k_norm", "replicated", (_S("self_attn.k_norm", "D"),)),
    TensorRule("self_attn.o_proj", "row", (_S("self_attn.o_proj", "H", "Q"),), linear=True),
    _POST_NORM,
)

QWEN3 = Architecture(
    name="Qwen3ForCausalLM",
    dims=_QWEN3_DIMS,
    rules=(_EMBED, *_QWEN3_ATTENTION, *_DENSE_MLP, _FINAL_NORM, _LM_HEAD),
)

QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM",
    dims=_QWEN3_DIMS,
    rules=(_EMBED, *_QWEN3_ATTENTION, *_DENSE_MLP, _ROUTER, _EXPERTS, _FINAL_NORM, _LM_HEAD),
)

# --- DeepSeek-V3 (MLA + shared experts), planning only --------------------------------------

_DEEPSEEK_DIMS: Mapping[str, Dim] = {
    "H": Dim("hidden_size", lambda c: c.hidden_size),
    "QA": Dim("q_lora_rank", lambda c: c.q_lora_rank),
    "KVA": Dim("kv_lora_rank + qk_rope_head_dim", lambda c: c.kv_lora_rank + c.qk_rope_head_dim),
    "KVL": Dim("kv_lora_rank", lambda c: c.kv_lora_rank),
    "QB": Dim(
        "num_attention_heads",
        lambda c: c.num_attention_heads,
        lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim,
    ),
    "KVB": Dim(
        "num_attention_heads",
        lambda c: c.num_attention_heads,
        lambda c: c.qk_nope_head_dim + c.v_head_dim,
    ),
    "O": Dim("num_attention_heads", lambda c: c.num_attention_heads, lambda c: c.v_head_dim),
    "I": Dim("intermediate_size", lambda c: c.intermediate_size),
    "MI": Dim("moe_intermediate_size", lambda c: c.moe_intermediate_size),
    "SI": Dim(
        "moe_intermediate_size * n_shared_experts",
        lambda c: c.moe_intermediate_size * c.n_shared_experts,
    ),
    "E": Dim("n_routed_experts", lambda c: c.num_experts),
    "V": Dim("vocab_size", lambda c: c.vocab_size),
}

DEEPSEEK_V3 = Architecture(
    name="DeepseekV3ForCausalLM",
    dims=_DEEPSEEK_DIMS,
    rules=(
        _EMBED,
        _INPUT_NORM,
        # vLLM merges q_a_proj and kv_a_proj_with_mqa into one replicated GEMM.
        TensorRule(
            "self_attn.fused_qkv_a_proj",
            "replicated",
            (_S("self_attn.q_a_proj", "QA", "H"), _S("self_attn.kv_a_proj_with_mqa", "KVA", "H")),
            when="q_lora",
            linear=True,
        ),
        TensorRule(
            "self_attn.q_a_layernorm",
            "replicated",
            (_S("self_attn.q_a_layernorm", "QA"),),
            when="q_lora",
        ),
        TensorRule(
            "self_attn.q_b_proj",
            "column",
            (_S("self_attn.q_b_proj", "QB", "QA"),),
            when="q_lora",
            linear=True,
        ),
        # Without q LoRA (V2-Lite style) vLLM has a plain column q_proj and a replicated
        # kv_a_proj_with_mqa.
        TensorRule(
            "self_attn.q_proj",
            "column",
            (_S("self_attn.q_proj", "QB", "H"),),
            when="no_q_lora",
            linear=True,
        ),
        TensorRule(
            "self_attn.kv_a_proj_with_mqa",
            "replicated",
            (_S("self_attn.kv_a_proj_with_mqa", "KVA", "H"),),
            when="no_q_lora",
            linear=True,
        ),
        TensorRule(
            "self_attn.kv_a_layernorm", "replicated", (_S("self_attn.kv_a_layernorm", "KVL"),)
        ),
        # MXFP8 where the engine quantizes it (EngineProfile.dense_linears).
        TensorRule(
            "self_attn.kv_b_proj",
            "column",
            (_S("self_attn.kv_b_proj", "KVB", "KVL"),),
            linear=True,
        ),
        TensorRule("self_attn.o_proj", "row", (_S("self_attn.o_proj", "H", "O"),), linear=True),
        _POST_NORM,
        *_DENSE_MLP,
        _ROUTER,
        TensorRule(
            "mlp.gate",
            "replicated",
            (_S("mlp.gate", "E", tensor="e_score_correction_bias"),),
            when="moe",
            float32=True,
        ),
        TensorRule(
            "mlp.shared_experts.gate_up_proj",
            "column",
            (
                _S("mlp.shared_experts.gate_proj", "SI", "H"),
                _S("mlp.shared_experts.up_proj", "SI", "H"),
            ),
            when="shared_experts",
            linear=True,
            shared_expert=True,
        ),
        TensorRule(
            "mlp.shared_experts.down_proj",
            "row",
            (_S("mlp.shared_experts.down_proj", "H", "SI"),),
            when="shared_experts",
            linear=True,
            shared_expert=True,
        ),
        _EXPERTS,
        _FINAL_NORM,
        _LM_HEAD,
    ),
)

# --- DeepSeek-V3's MTP layer (vLLM's DeepSeekMTP) ------------------------------------------
#
# vLLM 0.23.0 models/deepseek_mtp.py: ``speculative_config={"method": "mtp", ...}`` on a
# deepseek_v3 checkpoint makes the draft config ``DeepSeekMTPModel`` (config/speculative.py
# hf_config_override), built by the proposer under the target's vllm_config on the last
# pipeline stage. Its ``model.layers.{L + j}`` (L = num_hidden_layers, j <
# num_nextn_predict_layers; checkpoint names unchanged) holds:
# * ``enorm``, ``hnorm``, ``shared_head.norm``: RMSNorm, replicated;
# * ``eh_proj``: a plain ``nn.Linear(2H, H)``, no quant_config: whole on every rank, in the
#   model dtype;
# * ``mtp_block``: ``DeepseekV2DecoderLayer`` numbered L + j (so an MoE layer past
#   first_k_dense_replace), sharded and placed as the model's layers; load_weights renames
#   every other tensor of the layer to ``mtp_block.``;
# * ``shared_head.head`` (ParallelLMHead) and the layer's ``embed_tokens``: the proposer
#   replaces both by the target's (v1/spec_decode/llm_base_proposer.py:1293-1430, pp 1),
#   so nothing more is held. vllm-ascend 0.23.0.post1 shares the embedding the same way and
#   shared_head.head where it equals lm_head at start (llm_base_proposer.py:505-508).
# vllm-ascend subclasses it with the same parameters (0.23.0.post1
# patch/worker/patch_deepseek_mtp.py, 0.30.0rc2 models/deepseek_mtp.py; an extra ``rot``
# only for GLM-5's DSA), so every profile plans these rows.

_DEEPSEEK_DRAFTER = f"{DRAFTER_PREFIX}model.layers.{{i}}"
_DEEPSEEK_MTP_ROWS = (
    *(
        TensorRule(norm, "replicated", (_S(norm, "H"),), place="mtp_layer", held="model")
        for norm in ("enorm", "hnorm", "shared_head.norm")
    ),
    TensorRule(
        "eh_proj",
        "replicated",
        (_S("eh_proj", "H", "H2"),),
        place="mtp_layer",
        linear=True,
        mx=False,
    ),
)
DEEPSEEK_V3 = replace(
    DEEPSEEK_V3,
    dims={**DEEPSEEK_V3.dims, "H2": Dim("2 * hidden_size", lambda c: 2 * c.hidden_size)},
    rules=(
        *DEEPSEEK_V3.rules,
        *_DEEPSEEK_MTP_ROWS,
        *(
            replace(r, place="mtp_layer", name=f"mtp_block.{r.name}")
            for r in DEEPSEEK_V3.rules
            if r.place == "layer"
        ),
    ),
    mtp_layer_prefix=LAYER_PREFIX,
    mtp_device_layer_prefix=_DEEPSEEK_DRAFTER,
    mtp_after_layers=True,
)

# --- Qwen3.5 and Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention) --------------------
#
# What vLLM 0.23.0 builds (model_executor/models/qwen3_5.py, qwen3_next.py,
# layers/mamba/gdn/qwen_gdn_linear_attn.py, layers/linear.py):
# * names: the checkpoint's ``model.language_model.*`` are the engine's
#   ``language_model.model.*``, ``lm_head`` is ``language_model.lm_head``
#   (Qwen3VLForConditionalGeneration.hf_to_vllm_mapper);
# * GDN layers: ``in_proj_qkvz`` = MergedColumnParallelLinear with outputs
#   [key_dim, key_dim, value_dim, value_dim]; the checkpoint's ``in_proj_qkv`` is loaded as
#   shards (0, 1, 2), i.e. q, k and v each split over tp on its own, then ``in_proj_z``;
#   ``in_proj_ba`` = [in_proj_b, in_proj_a] ([num_v_heads] * 2, b first); ``conv1d`` a
#   ColumnParallelLinear [conv_dim, 1, kernel] in the model dtype whose loader
#   (mamba_v2_sharded_weight_loader) splits q, k and v over tp the same way; ``A_log``
#   (float32 parameter) and ``dt_bias`` (model dtype) split over tp on dim 0; ``norm`` (the
#   gated RMSNorm, head_v_dim wide) replicated; ``out_proj`` row-parallel;
# * full-attention layers: QKVParallelLinear with 2 * num_heads "heads" when
#   ``attn_output_gate`` (each head's q rows then its gate rows), so q_proj splits whole
#   (q, gate) head pairs; o_proj row-parallel over num_heads * head_dim;
# * Qwen3.5-MoE: every layer a sparse block: ``mlp.gate`` and ``mlp.shared_expert_gate``
#   replicated and never quantized (quant_config=None), ``mlp.shared_expert`` a TP MLP,
#   the routed experts a FusedMoE;
# * ``embed_tokens`` built on every pipeline stage (no PP check), norm and lm_head on the
#   last; ``mtp.*`` is not planned (``ModelConfig.not_planned``), the vision tower below.
# vllm-ascend 0.23.0.post1 replaces only forward-time methods of these classes
# (patch/worker/patch_qwen3_5.py:195-209, ops/gdn.py: forward, _forward_core, state
# shapes); parameters and weight loaders are vLLM's, so both engines hold the same layout.

_QWEN3_5_DIMS: Mapping[str, Dim] = {
    **_QWEN3_DIMS,
    "QG": Dim(
        "num_attention_heads",
        lambda c: c.num_attention_heads,
        lambda c: c.head_dim * (2 if c.attn_output_gate else 1),
    ),
    "SI": Dim("shared_expert_intermediate_size", lambda c: c.shared_expert_intermediate_size),
    "ONE": Dim("1", _one),
    "LK": Dim(
        "linear_num_key_heads", lambda c: c.linear_num_key_heads, lambda c: c.linear_key_head_dim
    ),
    "LV": Dim(
        "linear_num_value_heads",
        lambda c: c.linear_num_value_heads,
        lambda c: c.linear_value_head_dim,
    ),
    "LVH": Dim("linear_num_value_heads", lambda c: c.linear_num_value_heads),
    "LD": Dim("linear_value_head_dim", lambda c: c.linear_value_head_dim),
    "LQKV": Dim(
        "2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * "
        "linear_value_head_dim",
        lambda c: (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        ),
    ),
    "CK": Dim("linear_conv_kernel_dim", lambda c: c.linear_conv_kernel_dim),
    "H2": Dim("2 * hidden_size", lambda c: 2 * c.hidden_size),
}

_QWEN3_5_LM = "model.language_model"
_QWEN3_5_DEV = "language_model.model"


def _qkv_thirds(module: str, *rest: str) -> tuple[SourceSpec, ...]:
    """q, k and v rows of a GDN ``in_proj_qkv``-shaped tensor, each split over tp alone."""
    whole = ("LQKV", *rest)
    return (
        _S(module, "LK", *rest, part_of=whole),
        _S(module, "LK", *rest, part_of=whole, before=("LK",)),
        _S(module, "LV", *rest, part_of=whole, before=("LK", "LK")),
    )


_QWEN3_5_LAYER = (
    TensorRule("input_layernorm", "replicated", (_S("input_layernorm", "H"),), held="model"),
    # Gated DeltaNet (linear attention) layers
    TensorRule(
        "linear_attn.in_proj_qkvz",
        "column",
        (*_qkv_thirds("linear_attn.in_proj_qkv", "H"), _S("linear_attn.in_proj_z", "LV", "H")),
        when="linear_attention",
        linear=True,
    ),
    TensorRule(
        "linear_attn.in_proj_ba",
        "column",
        (_S("linear_attn.in_proj_b", "LVH", "H"), _S("linear_attn.in_proj_a", "LVH", "H")),
        when="linear_attention",
        linear=True,
    ),
    TensorRule(
        "linear_attn.conv1d",
        "column",
        _qkv_thirds("linear_attn.conv1d", "ONE", "CK"),
        when="linear_attention",
        held="model",
    ),
    TensorRule(
        "linear_attn",
        "column",
        (_S("linear_attn", "LVH", tensor="dt_bias"),),
        when="linear_attention",
        held="model",
    ),
    TensorRule(
        "linear_attn",
        "column",
        (_S("linear_attn", "LVH", tensor="A_log"),),
        when="linear_attention",
        held="float32",
    ),
    TensorRule(
        "linear_attn.norm",
        "replicated",
        (_S("linear_attn.norm", "LD"),),
        when="linear_attention",
        held="model",
    ),
    TensorRule(
        "linear_attn.out_proj",
        "row",
        (_S("linear_attn.out_proj", "H", "LV"),),
        when="linear_attention",
        linear=True,
    ),
    # gated full-attention layers
    TensorRule(
        "self_attn.qkv_proj",
        "column",
        (
            _S("self_attn.q_proj", "QG", "H"),
            _S("self_attn.k_proj", "KV", "H", split="kv_heads"),
            _S("self_attn.v_proj", "KV", "H", split="kv_heads"),
        ),
        when="full_attention",
        linear=True,
    ),
    TensorRule(
        "self_attn.q_norm",
        "replicated",
        (_S("self_attn.q_norm", "D"),),
        when="full_attention",
        held="model",
    ),
    TensorRule(
        "self_attn.k_norm",
        "replicated",
        (_S("self_attn.k_norm", "D"),),
        when="full_attention",
        held="model",
    ),
    TensorRule(
        "self_attn.o_proj",
        "row",
        (_S("self_attn.o_proj", "H", "Q"),),
        when="full_attention",
        linear=True,
    ),
    TensorRule(
        "post_attention_layernorm",
        "replicated",
        (_S("post_attention_layernorm", "H"),),
        held="model",
    ),
)

_QWEN3_5_MOE_MLP = (
    TensorRule("mlp.gate", "replicated", (_S("mlp.gate", "E", "H"),), when="moe", held="model"),
    TensorRule(
        "mlp.shared_expert_gate",
        "replicated",
        (_S("mlp.shared_expert_gate", "ONE", "H"),),
        when="shared_expert",
        held="model",
    ),
    TensorRule(
        "mlp.shared_expert.gate_up_proj",
        "column",
        (
            _S("mlp.shared_expert.gate_proj", "SI", "H"),
            _S("mlp.shared_expert.up_proj", "SI", "H"),
        ),
        when="shared_expert",
        linear=True,
        shared_expert=True,
    ),
    TensorRule(
        "mlp.shared_expert.down_proj",
        "row",
        (_S("mlp.shared_expert.down_proj", "H", "SI"),),
        when="shared_expert",
        linear=True,
        shared_expert=True,
    ),
    _EXPERTS,
)

_QWEN3_5_EMBED = TensorRule(
    f"{_QWEN3_5_DEV}.embed_tokens",
    "vocab",
    (_S(f"{_QWEN3_5_LM}.embed_tokens", "V", "H"),),
    place="first",
)
_QWEN3_5_FINAL = (
    TensorRule(
        f"{_QWEN3_5_DEV}.norm",
        "replicated",
        (_S(f"{_QWEN3_5_LM}.norm", "H"),),
        place="last",
        held="model",
    ),
    TensorRule(
        "language_model.lm_head",
        "vocab",
        (_S("lm_head", "V", "H"),),
        place="last",
        tied_source=f"{_QWEN3_5_LM}.embed_tokens",
    ),
)

# --- Qwen3.5's vision tower ----------------------------------------------------------------
#
# vLLM 0.23.0 models/qwen3_vl.py ``Qwen3_VisionTransformer`` (built by qwen3_5.py for both
# Qwen3.5 architectures unless every image/video limit is 0, i.e. --language-model-only;
# hf_to_vllm_mapper renames ``model.visual.`` to ``visual.``), with the default
# ``mm_encoder_tp_mode="weights"`` (TP-sharded):
# * each block: ``norm1``/``norm2`` LayerNorms (weight and bias) replicated;
#   ``attn.qkv`` a QKVParallelLinear with bias whose checkpoint tensor holds q, k and v,
#   loaded with no shard id, so each third is split over tp by heads on its own;
#   ``attn.proj`` RowParallelLinear (its bias whole on every rank); ``mlp.linear_fc1``
#   ColumnParallelLinear (bias split too), ``mlp.linear_fc2`` RowParallelLinear;
# * ``patch_embed.proj`` a Conv3d [hidden, in_channels, t, p, p] with bias, ``pos_embed``
#   an nn.Embedding: replicated, plain default_weight_loader;
# * ``merger``: ``norm`` (hidden wide), ``linear_fc1`` column and ``linear_fc2`` row over
#   hidden * spatial_merge_size**2; no deepstack mergers (Qwen3_5VisionConfig has no
#   ``deepstack_visual_indexes``);
# * every parameter in the model dtype; no PP check: every pipeline stage builds the tower.
# The quantization_config of the FP8 releases excludes ``model.visual``; a quantized vision
# tensor is refused (``linear=False``), as mxload plans the tower unquantized.
# vllm-ascend 0.23.0.post1 replaces only forward-time code of the tower
# (patch/worker/patch_qwen3vl.py: the position-embedding interpolation; ops/conv.py:
# AscendConv3dLayer.forward_oot; ops/mm_encoder_attention.py pads q/k/v activations to a
# head size its kernel takes, not the weights), so it holds the same parameters.


def _vdim(attr: str) -> Callable[[ModelConfig], int]:
    def get(c: ModelConfig) -> int:
        return int(getattr(c.vision, attr)) if c.vision is not None else 0

    return get


def _vision_head_dim(c: ModelConfig) -> int:
    return c.vision.hidden_size // c.vision.num_heads if c.vision is not None else 0


_VISION_DIMS: Mapping[str, Dim] = {
    "VH": Dim("vision_config.num_heads", _vdim("num_heads"), _vision_head_dim),
    "VQKV": Dim("3 * vision_config.hidden_size", lambda c: 3 * _vdim("hidden_size")(c)),
    "VI": Dim("vision_config.intermediate_size", _vdim("intermediate_size")),
    "VM": Dim("vision_config.hidden_size * spatial_merge_size**2", _vdim("merger_size")),
    "VO": Dim("vision_config.out_hidden_size", _vdim("out_hidden_size")),
    "VC": Dim("vision_config.in_channels", _vdim("in_channels")),
    "VT": Dim("vision_config.temporal_patch_size", _vdim("temporal_patch_size")),
    "VP": Dim("vision_config.patch_size", _vdim("patch_size")),
    "VPOS": Dim("vision_config.num_position_embeddings", _vdim("num_position_embeddings")),
}


def _vision_row(
    name: str, style: Style, *sources: SourceSpec, place: Place = "vision_layer"
) -> TensorRule:
    return TensorRule(name, style, sources, place=place, held="model")


def _weight_and_bias(
    name: str, style: Style, n: str, k: str, place: Place = "vision_layer"
) -> tuple[TensorRule, TensorRule]:
    """A linear with bias: the bias follows the output rows (split with a column weight,
    whole beside a row one)."""
    module = name if place == "vision_layer" else f"model.{name}"
    bias_style: Style = "column" if style == "column" else "replicated"
    return (
        _vision_row(name, style, _S(module, n, k), place=place),
        _vision_row(name, bias_style, _S(module, n, tensor="bias"), place=place),
    )


def _layer_norm(name: str, dim: str, place: Place = "vision_layer") -> tuple[TensorRule, ...]:
    module = name if place == "vision_layer" else f"model.{name}"
    return tuple(
        _vision_row(name, "replicated", _S(module, dim, tensor=t), place=place)
        for t in ("weight", "bias")
    )


def _vision_qkv(tensor: str, *rest: str) -> tuple[SourceSpec, ...]:
    whole = ("VQKV", *rest)
    return tuple(
        _S("attn.qkv", "VH", *rest, tensor=tensor, part_of=whole, before=("VH",) * j)
        for j in range(3)
    )


_QWEN3_5_VISION = (
    _vision_row(
        "visual.patch_embed.proj",
        "replicated",
        _S("model.visual.patch_embed.proj", "VH", "VC", "VT", "VP", "VP"),
        place="vision",
    ),
    _vision_row(
        "visual.patch_embed.proj",
        "replicated",
        _S("model.visual.patch_embed.proj", "VH", tensor="bias"),
        place="vision",
    ),
    _vision_row(
        "visual.pos_embed", "replicated", _S("model.visual.pos_embed", "VPOS", "VH"), place="vision"
    ),
    *_layer_norm("visual.merger.norm", "VH", place="vision"),
    *_weight_and_bias("visual.merger.linear_fc1", "column", "VM", "VM", place="vision"),
    *_weight_and_bias("visual.merger.linear_fc2", "row", "VO", "VM", place="vision"),
    *_layer_norm("norm1", "VH"),
    *_layer_norm("norm2", "VH"),
    _vision_row("attn.qkv", "column", *_vision_qkv("weight", "VH")),
    _vision_row("attn.qkv", "column", *_vision_qkv("bias")),
    *_weight_and_bias("attn.proj", "row", "VH", "VH"),
    *_weight_and_bias("mlp.linear_fc1", "column", "VI", "VH"),
    *_weight_and_bias("mlp.linear_fc2", "row", "VH", "VI"),
)

# --- Qwen3.5's MTP module (vLLM's MTP speculative decoding) -------------------------------
#
# vLLM 0.23.0 models/qwen3_5_mtp.py: ``speculative_config={"method": "mtp", ...}`` (the
# deprecated "qwen3_5_mtp" is renamed "mtp", config/speculative.py:550-554) builds
# ``Qwen3_5MTP`` / ``Qwen3_5MoeMTP`` from the target's own checkpoint; its
# ``load_weights`` renames ``mtp.`` to ``model.`` and takes ``embed_tokens`` and
# ``lm_head`` besides. ``Qwen3_5MultiTokenPredictor`` holds:
# * ``fc``: ColumnParallelLinear(2H -> H, gather_output) with the model's quant_config:
#   rows split over tp, a linear the checkpoint may quantize;
# * ``pre_fc_norm_hidden``, ``pre_fc_norm_embedding``, ``norm``: Qwen3_5RMSNorm, replicated;
# * ``layers.{i}`` (``mtp_num_hidden_layers``): Qwen3_5DecoderLayer(layer_type
#   "full_attention"), the MLP of every layer of the model, sharded as the model's;
# * ``embed_tokens`` and ``lm_head``: after loading, the proposer (v1/spec_decode/
#   llm_base_proposer.py:1275-1276, 1293-1430) replaces
#   both by the target's when pp is 1. vllm-ascend 0.23.0.post1 shares embed_tokens the
#   same way but keeps the drafter's own lm_head for method "mtp" on a non-MLA model
#   (vllm_ascend/spec_decode/llm_base_proposer.py:456-509): the engine profile says so.
# The drafter is built with the target's vllm_config (same TP group, same MoE/EP groups)
# on the last pipeline stage only (v1/worker/gpu_model_runner.py:541-545).
# The FP8 releases list ``mtp`` in modules_to_not_convert: the module ships in BF16.

_QWEN3_5_DRAFTER = f"{DRAFTER_PREFIX}model"
_QWEN3_5_MTP_ROWS = (
    TensorRule(
        f"{_QWEN3_5_DRAFTER}.fc", "column", (_S("mtp.fc", "H", "H2"),), place="mtp", linear=True
    ),
    *(
        TensorRule(
            f"{_QWEN3_5_DRAFTER}.{norm}",
            "replicated",
            (_S(f"mtp.{norm}", "H"),),
            place="mtp",
            held="model",
        )
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    ),
    TensorRule(
        f"{DRAFTER_PREFIX}lm_head",
        "vocab",
        (_S("lm_head", "V", "H"),),
        place="mtp",
        tied_source=f"{_QWEN3_5_LM}.embed_tokens",
        shared_with_target=True,
    ),
)


def _mtp_layer(rules: tuple[TensorRule, ...]) -> tuple[TensorRule, ...]:
    """The model's layer rows of a full-attention layer, as rows of the MTP layer."""
    return tuple(
        replace(r, place="mtp_layer", when="all" if r.when == "full_attention" else r.when)
        for r in rules
        if r.when != "linear_attention"
    )


def _qwen3_5(name: str, mlp: tuple[TensorRule, ...]) -> Architecture:
    return Architecture(
        name=name,
        dims={**_QWEN3_5_DIMS, **_VISION_DIMS},
        rules=(
            *_QWEN3_5_VISION,
            _QWEN3_5_EMBED,
            *_QWEN3_5_LAYER,
            *mlp,
            *_QWEN3_5_FINAL,
            *_QWEN3_5_MTP_ROWS,
            *_mtp_layer((*_QWEN3_5_LAYER, *mlp)),
        ),
        layer_prefix=f"{_QWEN3_5_LM}.layers.{{i}}",
        device_layer_prefix=f"{_QWEN3_5_DEV}.layers.{{i}}",
        vision_layer_prefix="model.visual.blocks.{i}",
        vision_device_layer_prefix="visual.blocks.{i}",
        mtp_layer_prefix="mtp.layers.{i}",
        mtp_device_layer_prefix=f"{_QWEN3_5_DRAFTER}.layers.{{i}}",
    )


QWEN3_5 = _qwen3_5("Qwen3_5ForConditionalGeneration", _DENSE_MLP)
QWEN3_5_MOE = _qwen3_5("Qwen3_5MoeForConditionalGeneration", _QWEN3_5_MOE_MLP)

ARCHITECTURES: Mapping[str, Architecture] = {
    a.name: a for a in (QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE, DEEPSEEK_V3)
}
"""Every architecture mxload can plan, by ``architectures[0]`` of config.json."""


def architecture_for(config: ModelConfig) -> Architecture:
    """The table of ``config.architecture``; UnsupportedError listing the known ones."""
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise UnsupportedError(
            f"{config.source}: unknown architecture {config.architecture!r}; supported: "
            + ", ".join(ARCHITECTURES),
            file=config.source,
            key="architectures",
        )
    return arch


def source_module(
    rule: TensorRule,
    source: SourceSpec,
    layer: int,
    expert: int = -1,
    arch: Architecture | None = None,
) -> str:
    """Full checkpoint module name of ``source`` in layer ``layer`` (and expert)."""
    module = source.module
    if expert >= 0:
        module = module.replace(EXPERT_PLACEHOLDER, str(expert))
    if rule.place == "layer":
        prefix = arch.layer_prefix if arch is not None else LAYER_PREFIX
        return f"{prefix.format(i=layer)}.{module}"
    if rule.place == "vision_layer" and arch is not None:
        return f"{arch.vision_layer_prefix.format(i=layer)}.{module}"
    if rule.place == "mtp_layer" and arch is not None:
        return f"{arch.mtp_layer_prefix.format(i=layer)}.{module}"
    return module


def device_name(rule: TensorRule, layer: int, arch: Architecture | None = None) -> str:
    """Full device module name of ``rule`` in layer ``layer``."""
    if rule.place == "layer":
        prefix = arch.device_layer_prefix if arch is not None else LAYER_PREFIX
        return f"{prefix.format(i=layer)}.{rule.name}"
    if rule.place == "vision_layer" and arch is not None:
        return f"{arch.vision_device_layer_prefix.format(i=layer)}.{rule.name}"
    if rule.place == "mtp_layer" and arch is not None:
        return f"{arch.mtp_device_layer_prefix.format(i=layer)}.{rule.name}"
    return rule.name
