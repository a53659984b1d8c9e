"""Hugging Face ``config.json`` -> a validated :class:`ModelConfig`. Pure.

docs/contract.md §1.1 (block-FP8 quantization_config), §1.2 (already-MXFP8), §1.4 (ignored modules,
model dtype), §3 (architectures). A bad config gets an error that names the key and the
file; a valid config mxload does not implement gets an :class:`UnsupportedError`.

The parser takes the already-decoded JSON object: reading the file is the caller's job
(``mxload.orchestrator.runtime.catalog``), so the planner can run on a config alone with no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from ..errors import CheckpointError, ConfigError, UnsupportedError
from .formats import ASCEND_MXFP8, MODEL_DTYPES, TORCH_DTYPE_ALIASES

QuantKind = Literal["block_fp8", "mxfp8", "none"]

QWEN3_5 = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE = "Qwen3_5MoeForConditionalGeneration"
QWEN3_5_ARCHITECTURES = (QWEN3_5, QWEN3_5_MOE)
"""The Qwen3.5 family: the language model under ``text_config`` (docs/contract.md §3)."""

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    QWEN3_5,
    QWEN3_5_MOE,
    "DeepseekV3ForCausalLM",
)
"""Architectures mxload can plan. See ``LOADABLE_ARCHITECTURES`` for those it can load."""

LOADABLE_ARCHITECTURES: tuple[str, ...] = SUPPORTED_ARCHITECTURES
"""Architectures mxload can load from weights (docs/contract.md §3): every one it plans."""

_MX_METHODS = ("mxfp8", "modelopt_mxfp8")


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's linears are quantized."""

    kind: QuantKind
    """``block_fp8`` (E4M3 + F32 tile scales), ``mxfp8`` (E4M3 + E8M0 per 32), ``none`` (BF16 etc.)."""
    block_n: int = 0
    """Tile height B_N of ``weight_scale_inv`` (block_fp8 only)."""
    block_k: int = 0
    """Tile width B_K of ``weight_scale_inv`` (block_fp8 only)."""
    not_converted: tuple[str, ...] = ()
    """Module patterns kept unquantized (modules_to_not_convert / ignored_layers / exclude_modules)."""

    def is_excluded(self, module: str) -> bool:
        """docs/contract.md §1.4: a pattern matches a module when equal to it, a dotted prefix of it,
        or its last component. Patterns ending in ``*`` (ModelOpt style) match by prefix."""
        exact, starred = _patterns(self.not_converted)
        if any(module.startswith(p) for p in starred):
            return True
        if not exact:
            return False
        # Equal to a pattern, a dotted prefix of it, or its last component: a few set
        # lookups (a plan asks for every expert of every layer, against every pattern).
        parts = module.split(".")
        if parts[-1] in exact:
            return True
        prefix = parts[0]
        if prefix in exact:
            return True
        for part in parts[1:]:
            prefix += "." + part
            if prefix in exact:
                return True
        return False


@lru_cache(maxsize=64)
def _patterns(not_converted: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """(patterns matched whole, prefixes of the ``*`` patterns)."""
    exact = frozenset(p for p in not_converted if not p.endswith("*"))
    return exact, tuple(p[:-1] for p in not_converted if p.endswith("*"))


@dataclass(frozen=True)
class VisionConfig:
    """Qwen3.5's vision tower (``vision_config``), as vLLM's ``Qwen3_VisionTransformer`` builds
    it; absent keys take the defaults of vLLM's ``Qwen3_5VisionConfig``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int

    @property
    def merger_size(self) -> int:
        """Width of the patch merger's linears: ``hidden_size * spatial_merge_size**2``."""
        return self.hidden_size * self.spatial_merge_size**2


VISION_DEFAULTS: Mapping[str, int] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
"""vLLM 0.23's ``Qwen3_5VisionConfig`` defaults."""


@dataclass(frozen=True)
class ModelConfig:
    """The fields of config.json mxload plans with, validated."""

    architecture: str
    """``architectures[0]``; one of SUPPORTED_ARCHITECTURES."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width."""
    vocab_size: int
    tie_word_embeddings: bool
    model_dtype: str
    """``bf16`` | ``fp16`` | ``fp32``: what resolved tensors are stored as (docs/contract.md §1.4)."""
    quant: QuantConfig
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V3 (MLA) fields; zero elsewhere.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    moe_layer_freq: int = 1
    # Qwen3.5 (hybrid Gated DeltaNet + gated attention) fields; empty/zero elsewhere.
    layer_types: tuple[str, ...] = ()
    """Per decoder layer: ``linear_attention`` (Gated DeltaNet) or ``full_attention``."""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False
    """q_proj carries a sigmoid output gate per head: ``[q_h, gate_h]`` rows per head."""
    shared_expert_intermediate_size: int = 0
    """Qwen3.5-MoE: width of the one shared expert (with its own ``shared_expert_gate``)."""
    mtp_layers: int = 0
    """MTP (multi-token prediction) layers the checkpoint carries; planned only for a
    layout with MTP speculative decoding (Qwen3.5)."""
    max_position_embeddings: int = 0
    """The model's length, vLLM's default ``max_model_len``; 0 when the config gives none."""
    mamba_ssm_dtype: str = ""
    """Qwen3.5: the Gated DeltaNet temporal state's dtype vLLM caches (``""``: the model's)."""
    vision: VisionConfig | None = None
    """The vision tower (``model.visual.*``) the engine builds unless it runs
    language-model-only (``ParallelLayout.language_model_only``)."""
    source: str = field(default="config.json", compare=False)
    """Where the config came from, for error messages."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """docs/contract.md §3: which decoder layers have routed experts."""
        if self.num_experts <= 0:
            return False
        if self.architecture == "DeepseekV3ForCausalLM":
            return i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0
        if self.architecture == QWEN3_5_MOE:
            return True  # vLLM: every layer of qwen3_5_moe_text is a sparse MoE block
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def is_linear_attention(self, i: int) -> bool:
        """Qwen3.5: decoder layer ``i`` is a Gated DeltaNet layer (``layer_types``)."""
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    def not_planned(self, mtp: bool = False) -> tuple[str, ...]:
        """Checkpoint scopes no plan holds, each with the reason (docs/contract.md §3);
        ``mtp``: the layout plans the MTP module (``ParallelLayout.speculative_method``)."""
        out = []
        if self.mtp_layers and not mtp:
            where = (
                f"model.layers.{self.num_hidden_layers}.*"
                if self.architecture == "DeepseekV3ForCausalLM"
                else "mtp.*"
            )
            out.append(
                f"{where} ({self.mtp_layers} MTP layer(s)): vLLM skips them unless "
                "speculative decoding is configured; --speculative-config with method "
                "'mtp' plans them"
            )
        return tuple(out)

    def summary(self) -> dict[str, Any]:
        """The ``model`` object of plan and dump JSON."""
        out: dict[str, Any] = {
            "architecture": self.architecture,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.model_dtype,
            "quantization": self.quant.kind,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
        }
        if self.quant.kind == "block_fp8":
            out["weight_block_size"] = [self.quant.block_n, self.quant.block_k]
        if self.layer_types:
            out["linear_attention_layers"] = sum(t == "linear_attention" for t in self.layer_types)
        if self.not_planned():
            out["not_planned"] = list(self.not_planned())
        return out


def _vision_config(cfg: Mapping[str, Any], source: str) -> VisionConfig:
    """The vision tower vLLM builds: without ``vision_config`` (absent or null) its
    ``Qwen3_5Config`` fills a default tower, which the checkpoint must then hold (or
    ``--language-model-only`` skip); planning none would leave it unloaded."""
    raw = cfg.get("vision_config")
    if raw is None:
        return VisionConfig(**VISION_DEFAULTS)
    vsrc = f"{source} (vision_config)"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{source}: key 'vision_config' must be an object", file=source, key="vision_config"
        )
    values = {k: _positive(raw, k, vsrc, default=d) for k, d in VISION_DEFAULTS.items()}
    vision = VisionConfig(**values)
    if vision.hidden_size % vision.num_heads:
        raise ConfigError(
            f"{vsrc}: hidden_size ({vision.hidden_size}) is not a multiple of num_heads "
            f"({vision.num_heads})",
            file=source,
            key="vision_config.num_heads",
        )
    return vision


MAX_DIM = 1 << 21
"""Largest width, head count or vocabulary a config may give (released models stay below
2^19): the plan holds per-row reads of a tensor, so a hostile 10^9 would exhaust memory."""

MAX_COUNT = {
    "num_hidden_layers": 1024,
    "depth": 1024,
    "num_experts": 4096,
    "n_routed_experts": 4096,
    "num_nextn_predict_layers": 16,
    "mtp_num_hidden_layers": 16,
    "max_position_embeddings": 1 << 30,  # a length: nothing is held per token
}
"""Largest layer and expert counts a config may give (released models: at most 128 layers
and 512 experts); the plan holds one unit per layer and expert."""


def _int(cfg: Mapping[str, Any], key: str, source: str, *, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"{source}: missing key {key!r}", file=source, key=key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{source}: key {key!r} must be an integer, got {value!r}", file=source, key=key
        )
    if value < 0:
        raise ConfigError(f"{source}: key {key!r} must be >= 0, got {value}", file=source, key=key)
    cap = MAX_COUNT.get(key, MAX_DIM)
    if value > cap:
        raise ConfigError(
            f"{source}: key {key!r} is {value}, above the most mxload plans ({cap}); no "
            "released model comes near it",
            file=source,
            key=key,
        )
    return value


def _flag(cfg: Mapping[str, Any], key: str, source: str, *, default: bool) -> bool:
    """A JSON boolean: ``"false"`` (a non-empty string) must not read as true."""
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(
            f"{source}: key {key!r} must be true or false, got {value!r}", file=source, key=key
        )
    return value


def _positive(cfg: Mapping[str, Any], key: str, source: str, **kw: Any) -> int:
    value = _int(cfg, key, source, **kw)
    if value <= 0:
        raise ConfigError(f"{source}: key {key!r} must be > 0, got {value}", file=source, key=key)
    return value


def model_dtype_of(cfg: Mapping[str, Any], override: str | None = None) -> str:
    """docs/contract.md §1.4: torch_dtype when bf16/fp16/fp32, else bf16; ``--dtype`` overrides."""
    if override is not None:
        if override not in MODEL_DTYPES:
            raise ConfigError(
                f"--dtype: {override!r} is not one of {', '.join(MODEL_DTYPES)}", key="--dtype"
            )
        return override
    raw = cfg.get("torch_dtype", cfg.get("dtype"))
    if isinstance(raw, str):
        return TORCH_DTYPE_ALIASES.get(raw.lower(), "bf16")
    return "bf16"


def parse_quant_config(cfg: Mapping[str, Any], source: str = "config.json") -> QuantConfig:
    """docs/contract.md §1.1 validation table and §1.2 MXFP8 recognition."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return QuantConfig(kind="none")
    if not isinstance(qc, Mapping):
        raise ConfigError(
            f"{source}: key 'quantization_config' must be an object",
            file=source,
            key="quantization_config",
        )
    key = "quantization_config.quant_method"
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(f"{source}: missing or non-string key {key!r}", file=source, key=key)
    method_l = method.lower()
    algo = str(qc.get("quant_algo", "")).upper()
    excluded = _string_list(
        qc, ("modules_to_not_convert", "ignored_layers", "exclude_modules", "ignore"), source
    )

    if method_l in _MX_METHODS or (method_l == "modelopt" and algo == "MXFP8"):
        return QuantConfig(kind="mxfp8", not_converted=excluded)
    if "fp8" not in method_l:
        detail = f" with quant_algo {algo!r}" if algo else ""
        raise UnsupportedError(
            f"{source}: unsupported quantization {method!r}{detail} at key {key!r}; "
            "mxload reads block-wise FP8 ('fp8' with weight_block_size) and MXFP8 "
            "('modelopt' + quant_algo MXFP8, 'mxfp8')",
            file=source,
            key=key,
        )
    fmt = qc.get("fmt", "e4m3")
    if not isinstance(fmt, str) or fmt.lower() != "e4m3":
        raise UnsupportedError(
            f"{source}: key 'quantization_config.fmt' is {fmt!r}; only 'e4m3' weights are supported",
            file=source,
            key="quantization_config.fmt",
        )
    if "weight_block_size" not in qc or qc["weight_block_size"] is None:
        raise UnsupportedError(
            f"{source}: key 'quantization_config.weight_block_size' is missing: this is per-tensor "
            "or per-channel FP8, and mxload converts block-wise FP8 only",
            file=source,
            key="quantization_config.weight_block_size",
        )
    block = qc["weight_block_size"]
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)
    ):
        raise ConfigError(
            f"{source}: key 'quantization_config.weight_block_size' must be two positive "
            f"integers [B_N, B_K], got {block!r}",
            file=source,
            key="quantization_config.weight_block_size",
        )
    scheme = qc.get("activation_scheme")
    if scheme != "dynamic":
        raise UnsupportedError(
            f"{source}: key 'quantization_config.activation_scheme' is {scheme!r}; only "
            "'dynamic' activation scaling is supported (MXFP8 quantizes activations per group)",
            file=source,
            key="quantization_config.activation_scheme",
        )
    return QuantConfig(
        kind="block_fp8", block_n=int(block[0]), block_k=int(block[1]), not_converted=excluded
    )


def _string_list(qc: Mapping[str, Any], keys: tuple[str, ...], source: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        value = qc.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"{source}: key 'quantization_config.{key}' must be a list of strings",
                file=source,
                key=f"quantization_config.{key}",
            )
        out.extend(value)
    return tuple(out)


def ascend_description_quant(desc: Any, source: str) -> dict[str, Any]:
    """The ``quantization_config`` an MXFP8 checkpoint described by vllm-ascend's
    ``quant_model_description.json`` (and no ``quantization_config``) stands for: MXFP8,
    with every ``FLOAT`` module not converted. Any other scheme is refused, naming it."""
    if not isinstance(desc, Mapping):
        raise ConfigError(f"{source}: not a JSON object", file=source)
    floats = []
    for key, value in desc.items():
        if not key.endswith(".weight"):
            continue
        if value == "FLOAT":
            floats.append(key[: -len(".weight")])
        elif value != ASCEND_MXFP8:
            raise UnsupportedError(
                f"{source}: {key!r} is {value!r}; mxload reads the {ASCEND_MXFP8} and FLOAT "
                "entries of a vllm-ascend description",
                file=source,
                key=key,
            )
    group = desc.get("group_size", 32)
    if group != 32:
        raise UnsupportedError(
            f"{source}: group_size {group!r}; MXFP8 groups are 32", file=source, key="group_size"
        )
    return {"quant_method": "mxfp8", "modules_to_not_convert": sorted(floats)}


def check_ascend_description(
    desc: Mapping[str, Any], dtypes: Mapping[str, str], source: str
) -> None:
    """The description agrees with the tensors it describes (``dtypes``: every tensor's
    safetensors dtype): a ``W8A8_MXFP8`` weight is ``F8_E4M3`` with a ``U8``
    ``weight_scale``, a ``FLOAT`` one is neither. vllm-ascend builds each layer from the
    description alone, so a contradiction would load payload bytes as model-dtype values
    or the reverse: refused, naming the tensor (CheckpointError)."""
    for key, value in desc.items():
        if not key.endswith(".weight") or key not in dtypes:
            continue
        scale = f"{key}_scale"
        held = dtypes[key] + (f" with {scale} {dtypes[scale]}" if scale in dtypes else "")
        if value == ASCEND_MXFP8:
            agrees = dtypes[key] == "F8_E4M3" and dtypes.get(scale) == "U8"
        else:  # FLOAT (any other scheme is refused by ascend_description_quant)
            agrees = dtypes[key] != "F8_E4M3" and scale not in dtypes
        if not agrees:
            raise CheckpointError(
                f"{source}: {key} is described {value}, but the checkpoint holds it as "
                f"{held}: the description contradicts its tensors",
                file=source,
                tensor=key,
            )


MAX_EXPERT_UNITS = 1 << 17
"""Most routed experts over all layers (experts x layers) a config may give: 4x the largest
released model; each is a unit of the plan on every rank that holds it."""


def parse_config(
    cfg: Mapping[str, Any], source: str = "config.json", *, dtype: str | None = None
) -> ModelConfig:
    """Validate a decoded config.json. ``dtype`` is the ``--dtype`` override."""
    model = _parse_config(cfg, source, dtype)
    layers = model.num_hidden_layers + model.mtp_layers
    if model.num_experts * layers > MAX_EXPERT_UNITS:
        raise ConfigError(
            f"{source}: {model.num_experts} experts x {layers} layers (MTP included) is "
            f"above the most mxload plans ({MAX_EXPERT_UNITS} expert-layers); no released "
            "model comes near it",
            file=source,
            key="num_experts",
        )
    for keys, width in _derived_widths(model).items():
        if width > MAX_DIM:
            raise ConfigError(
                f"{source}: {keys} is {width}, above the widest tensor mxload plans "
                f"({MAX_DIM} rows or columns); no released model comes near it",
                file=source,
                key=keys.split(" x ")[0],
            )
    return model


def _derived_widths(m: ModelConfig) -> dict[str, int]:
    """Tensor widths the config gives as products of its keys (each key alone is bounded)."""
    out = {
        "num_attention_heads x head_dim x 2": m.num_attention_heads * m.head_dim * 2,
        "num_key_value_heads x head_dim": m.num_key_value_heads * m.head_dim,
        "n_shared_experts x moe_intermediate_size x 2": (
            m.n_shared_experts * m.moe_intermediate_size * 2
        ),
        "shared_expert_intermediate_size x 2": m.shared_expert_intermediate_size * 2,
        "moe_intermediate_size x 2": m.moe_intermediate_size * 2,
        "intermediate_size x 2": m.intermediate_size * 2,
        "linear_num_key_heads x linear_key_head_dim x 2 + linear_num_value_heads x "
        "linear_value_head_dim x 2": (
            2 * m.linear_num_key_heads * m.linear_key_head_dim
            + 2 * m.linear_num_value_heads * m.linear_value_head_dim
        ),
        "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)": (
            m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        ),
        "num_attention_heads x (qk_nope_head_dim + v_head_dim)": (
            m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        ),
    }
    if m.vision is not None:
        v = m.vision
        out["vision_config.hidden_size x spatial_merge_size^2"] = v.merger_size
        out["vision_config.hidden_size x 3"] = v.hidden_size * 3
        out["vision_config in_channels x temporal_patch_size x patch_size^2"] = (
            v.in_channels * v.temporal_patch_size * v.patch_size**2
        )
    return out


def _parse_config(cfg: Mapping[str, Any], source: str, dtype: str | None) -> ModelConfig:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{source}: not a JSON object", file=source)
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(
            f"{source}: key 'architectures' must be a non-empty list; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES),
            file=source,
            key="architectures",
        )
    arch = archs[0]
    if arch in QWEN3_5_ARCHITECTURES:
        return _parse_qwen3_5(cfg, arch, source, dtype)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(
            f"{source}: unknown architecture {arch!r} at key 'architectures'; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES),
            file=source,
            key="architectures",
        )
    quant = parse_quant_config(cfg, source)
    hidden = _positive(cfg, "hidden_size", source)
    heads = _positive(cfg, "num_attention_heads", source)
    kv_heads = _positive(cfg, "num_key_value_heads", source, default=heads)
    head_dim_default = hidden // heads if hidden % heads == 0 else None
    common: dict[str, Any] = dict(
        architecture=arch,
        hidden_size=hidden,
        num_hidden_layers=_positive(cfg, "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=_positive(cfg, "intermediate_size", source),
        vocab_size=_positive(cfg, "vocab_size", source),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", source, default=False),
        model_dtype=model_dtype_of(cfg, dtype),
        quant=quant,
        max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=0),
        source=source,
    )
    if arch == "DeepseekV3ForCausalLM":
        return ModelConfig(
            head_dim=_positive(cfg, "v_head_dim", source),
            num_experts=_int(cfg, "n_routed_experts", source, default=0),
            moe_intermediate_size=_int(cfg, "moe_intermediate_size", source, default=0),
            q_lora_rank=_int(cfg, "q_lora_rank", source, default=0),
            kv_lora_rank=_positive(cfg, "kv_lora_rank", source),
            qk_nope_head_dim=_positive(cfg, "qk_nope_head_dim", source),
            qk_rope_head_dim=_positive(cfg, "qk_rope_head_dim", source),
            v_head_dim=_positive(cfg, "v_head_dim", source),
            first_k_dense_replace=_int(cfg, "first_k_dense_replace", source, default=0),
            n_shared_experts=_int(cfg, "n_shared_experts", source, default=0),
            moe_layer_freq=_positive(cfg, "moe_layer_freq", source, default=1),
            mtp_layers=_int(cfg, "num_nextn_predict_layers", source, default=0),
            **common,
        )
    head_dim = _positive(cfg, "head_dim", source, default=head_dim_default)
    num_experts = 0
    moe_inter = 0
    step = 1
    mlp_only: tuple[int, ...] = ()
    if arch == "Qwen3MoeForCausalLM":
        num_experts = _int(cfg, "num_experts", source, default=0)
        moe_inter = _positive(cfg, "moe_intermediate_size", source) if num_experts else 0
        step = _positive(cfg, "decoder_sparse_step", source, default=1)
        raw = cfg.get("mlp_only_layers", []) or []
        if not isinstance(raw, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in raw
        ):
            raise ConfigError(
                f"{source}: key 'mlp_only_layers' must be a list of layer indices",
                file=source,
                key="mlp_only_layers",
            )
        mlp_only = tuple(sorted(set(raw)))
    return ModelConfig(
        head_dim=head_dim,
        num_experts=num_experts,
        moe_intermediate_size=moe_inter,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
        **common,
    )


def _mamba_ssm_dtype(text: Mapping[str, Any], source: str) -> str:
    """``mamba_ssm_dtype`` of a Qwen3.5 text config (vLLM caches the temporal state in it)."""
    value = text.get("mamba_ssm_dtype")
    if value is None:
        return ""
    if value not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            f"{source}: key 'mamba_ssm_dtype' must be float32, bfloat16 or float16, got {value!r}",
            file=source,
            key="mamba_ssm_dtype",
        )
    return str(value)


def _parse_qwen3_5(
    cfg: Mapping[str, Any], arch: str, source: str, dtype: str | None
) -> ModelConfig:
    """Qwen3.5 / Qwen3.5-MoE: the language model's fields live under ``text_config``
    (vLLM's ``hf_text_config``); ``quantization_config`` and the dtype may sit at the top."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(
            f"{source}: {arch} needs an object at key 'text_config'", file=source, key="text_config"
        )
    tsrc = f"{source} (text_config)"
    quant_holder = cfg if "quantization_config" in cfg else text
    quant = parse_quant_config(quant_holder, source)
    dtype_holder = text if ("torch_dtype" in text or "dtype" in text) else cfg
    hidden = _positive(text, "hidden_size", tsrc)
    heads = _positive(text, "num_attention_heads", tsrc)
    layers = _positive(text, "num_hidden_layers", tsrc)
    raw_types = text.get("layer_types")
    if raw_types is None:
        # vLLM's Qwen3_5TextConfig: every full_attention_interval-th layer is full attention.
        interval = _positive(text, "full_attention_interval", tsrc, default=4)
        types = tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        )
    elif (
        not isinstance(raw_types, list)
        or len(raw_types) != layers
        or any(t not in ("linear_attention", "full_attention") for t in raw_types)
    ):
        raise ConfigError(
            f"{tsrc}: key 'layer_types' must list {layers} entries, each 'linear_attention' "
            "or 'full_attention'",
            file=source,
            key="text_config.layer_types",
        )
    else:
        types = tuple(raw_types)
    moe = arch == QWEN3_5_MOE
    num_experts = _positive(text, "num_experts", tsrc) if moe else 0
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        # vLLM's Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults.
        num_key_value_heads=_positive(text, "num_key_value_heads", tsrc, default=2 if moe else 4),
        head_dim=_positive(text, "head_dim", tsrc, default=256),
        intermediate_size=0 if moe else _positive(text, "intermediate_size", tsrc),
        vocab_size=_positive(text, "vocab_size", tsrc),
        # vLLM's Qwen3_5TextConfig sets its own (default false) after the base class has
        # read any top-level value, and the model reads the text config's.
        tie_word_embeddings=_flag(text, "tie_word_embeddings", tsrc, default=False),
        model_dtype=model_dtype_of(dtype_holder, dtype),
        quant=quant,
        num_experts=num_experts,
        moe_intermediate_size=_positive(text, "moe_intermediate_size", tsrc) if moe else 0,
        shared_expert_intermediate_size=(
            _int(text, "shared_expert_intermediate_size", tsrc, default=512) if moe else 0
        ),
        layer_types=types,
        linear_num_key_heads=_positive(text, "linear_num_key_heads", tsrc),
        linear_num_value_heads=_positive(text, "linear_num_value_heads", tsrc),
        linear_key_head_dim=_positive(text, "linear_key_head_dim", tsrc),
        linear_value_head_dim=_positive(text, "linear_value_head_dim", tsrc),
        linear_conv_kernel_dim=_positive(text, "linear_conv_kernel_dim", tsrc),
        attn_output_gate=_flag(text, "attn_output_gate", tsrc, default=True),
        mtp_layers=_int(text, "mtp_num_hidden_layers", tsrc, default=0),
        max_position_embeddings=_int(text, "max_position_embeddings", tsrc, default=0),
        mamba_ssm_dtype=_mamba_ssm_dtype(text, tsrc),
        vision=_vision_config(cfg, source),
        source=source,
    )
