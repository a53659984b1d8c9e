"""mxload.orchestrator.plan.config against docs/contract.md §1.1's validation table, §1.2, §1.4 and the real configs."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest
from mxload.orchestrator.errors import ConfigError, InputError, UnsupportedError
from mxload.orchestrator.plan.config import QuantConfig, parse_config
from mxload.orchestrator.runtime.models import model_config_path

CONFIGS = model_config_path("deepseek-v3").parent  # the packaged configs
SRC = "/ckpt/qwen3-tiny/config.json"

BASE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


def with_quant(**changes: Any) -> dict[str, Any]:
    """BASE with quantization_config keys changed (a value of ... deletes the key)."""
    cfg = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is ...:
            cfg["quantization_config"].pop(key, None)
        else:
            cfg["quantization_config"][key] = value
    return cfg


# --- docs/contract.md §1.1 validation table: one row, one case (or several) -----------------------------


@pytest.mark.parametrize(
    ("cfg", "error", "key"),
    [
        # quant_method neither fp8 nor MXFP8 -> unsupported quantization
        (with_quant(quant_method="gptq"), UnsupportedError, "quantization_config.quant_method"),
        (with_quant(quant_method="awq"), UnsupportedError, "quantization_config.quant_method"),
        (
            with_quant(quant_method="modelopt", quant_algo="NVFP4"),
            UnsupportedError,
            "quantization_config.quant_method",
        ),
        # weight_block_size missing (per-tensor / per-channel FP8) -> NotImplementedError-class
        (
            with_quant(weight_block_size=...),
            UnsupportedError,
            "quantization_config.weight_block_size",
        ),
        (
            with_quant(weight_block_size=None),
            UnsupportedError,
            "quantization_config.weight_block_size",
        ),
        # weight_block_size not two positive ints -> error
        (with_quant(weight_block_size=[128]), ConfigError, "quantization_config.weight_block_size"),
        (
            with_quant(weight_block_size=[128, 128, 1]),
            ConfigError,
            "quantization_config.weight_block_size",
        ),
        (
            with_quant(weight_block_size=[0, 128]),
            ConfigError,
            "quantization_config.weight_block_size",
        ),
        (
            with_quant(weight_block_size=[128, -1]),
            ConfigError,
            "quantization_config.weight_block_size",
        ),
        (
            with_quant(weight_block_size=[128.0, 128]),
            ConfigError,
            "quantization_config.weight_block_size",
        ),
        (
            with_quant(weight_block_size=["128", 128]),
            ConfigError,
            "quantization_config.weight_block_size",
        ),
        (
            with_quant(weight_block_size=[True, 128]),
            ConfigError,
            "quantization_config.weight_block_size",
        ),
        (with_quant(weight_block_size=128), ConfigError, "quantization_config.weight_block_size"),
        # activation_scheme missing or not dynamic -> NotImplementedError-class
        (
            with_quant(activation_scheme=...),
            UnsupportedError,
            "quantization_config.activation_scheme",
        ),
        (
            with_quant(activation_scheme="static"),
            UnsupportedError,
            "quantization_config.activation_scheme",
        ),
        # unknown architecture -> error listing the supported ones
        ({**BASE, "architectures": ["LlamaForCausalLM"]}, UnsupportedError, "architectures"),
        ({**BASE, "architectures": []}, ConfigError, "architectures"),
        ({k: v for k, v in BASE.items() if k != "architectures"}, ConfigError, "architectures"),
    ],
    ids=[
        "gptq",
        "awq",
        "modelopt_nvfp4",
        "block_size_missing",
        "block_size_null",
        "block_size_one",
        "block_size_three",
        "block_size_zero",
        "block_size_negative",
        "block_size_float",
        "block_size_string",
        "block_size_bool",
        "block_size_scalar",
        "activation_missing",
        "activation_static",
        "arch_unknown",
        "arch_empty",
        "arch_missing",
    ],
)
def test_validation_table(cfg: dict[str, Any], error: type[InputError], key: str) -> None:
    with pytest.raises(error) as info:
        parse_config(cfg, SRC)
    err = info.value
    assert type(err) is error
    assert err.key == key
    assert key.rsplit(".", 1)[-1] in str(err), f"message does not name the key: {err}"
    assert SRC in str(err), f"message does not name the file: {err}"
    assert err.exit_code == 2


@pytest.mark.parametrize(
    "changes",
    [{"weight_block_size": ...}, {"activation_scheme": "static"}, {"activation_scheme": ...}],
)
def test_not_implemented_rows_are_not_implemented_errors(changes: dict[str, Any]) -> None:
    with pytest.raises(NotImplementedError):
        parse_config(with_quant(**changes), SRC)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedError) as info:
        parse_config({**BASE, "architectures": ["LlamaForCausalLM"]}, SRC)
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        assert arch in str(info.value)
    assert "LlamaForCausalLM" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("hidden_size", 0), ("hidden_size", "256"), ("num_hidden_layers", -1), ("vocab_size", None)],
)
def test_bad_dimensions_name_key_and_file(key: str, value: Any) -> None:
    cfg = copy.deepcopy(BASE)
    if value is None:
        del cfg[key]
    else:
        cfg[key] = value
    with pytest.raises(ConfigError) as info:
        parse_config(cfg, SRC)
    assert info.value.key == key and SRC in str(info.value) and key in str(info.value)


def test_config_errors_pickle() -> None:
    with pytest.raises(UnsupportedError) as info:
        parse_config(with_quant(quant_method="gptq"), SRC)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnsupportedError and again.key == info.value.key
    assert str(again) == str(info.value)


# --- what a valid config becomes ---------------------------------------------------------------


def test_block_fp8_recognised() -> None:
    q = parse_config(with_quant(weight_block_size=[64, 32]), SRC).quant
    assert (q.kind, q.block_n, q.block_k) == ("block_fp8", 64, 32)


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]},
        {"quant_method": "mxfp8"},
        {"quant_method": "modelopt_mxfp8", "kv_cache_quant_algo": None},
    ],
)
def test_mxfp8_recognised(quant: dict[str, Any]) -> None:
    cfg = {**BASE, "quantization_config": quant}
    assert parse_config(cfg, SRC).quant.kind == "mxfp8"


def test_no_quantization_config_is_unquantized() -> None:
    cfg = {k: v for k, v in BASE.items() if k != "quantization_config"}
    assert parse_config(cfg, SRC).quant.kind == "none"


@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])
def test_ignored_module_lists(key: str) -> None:
    q = parse_config(with_quant(**{key: ["lm_head", "model.layers.0.mlp"]}), SRC).quant
    assert q.not_converted == ("lm_head", "model.layers.0.mlp")


def test_ignored_module_list_must_be_strings() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_quant(modules_to_not_convert=[1]), SRC)
    assert info.value.key == "quantization_config.modules_to_not_convert"


def test_is_excluded_rules() -> None:
    # docs/contract.md §1.4: equal, dotted prefix, or last component.
    q = QuantConfig(
        kind="block_fp8", block_n=128, block_k=128, not_converted=("lm_head", "model.layers.1")
    )
    assert q.is_excluded("lm_head")
    assert q.is_excluded("model.layers.1")
    assert q.is_excluded("model.layers.1.mlp.down_proj")
    assert not q.is_excluded("model.layers.10.mlp.down_proj")  # prefix must end at a dot
    assert not q.is_excluded("model.layers.0.mlp.down_proj")
    assert not q.is_excluded("lm_head_extra")
    assert q.is_excluded("some.wrapper.lm_head")
    # ModelOpt-style patterns match by prefix; a dotted pattern only from the start.
    q = QuantConfig(
        kind="block_fp8", block_n=128, block_k=128, not_converted=("model.visual*", "mlp.gate")
    )
    assert q.is_excluded("model.visual.blocks.0.attn")
    assert q.is_excluded("model.visualizer")
    assert not q.is_excluded("model.vis")
    assert q.is_excluded("mlp.gate.weight")
    assert not q.is_excluded("model.layers.0.mlp.gate")


@pytest.mark.parametrize(
    ("torch_dtype", "override", "want"),
    [
        ("bfloat16", None, "bf16"),
        ("float16", None, "fp16"),
        ("float32", None, "fp32"),
        ("float8_e4m3fn", None, "bf16"),  # not a model dtype -> bf16
        (None, None, "bf16"),
        ("float16", "fp32", "fp32"),  # --dtype overrides
    ],
)
def test_model_dtype(torch_dtype: str | None, override: str | None, want: str) -> None:
    cfg = copy.deepcopy(BASE)
    if torch_dtype is None:
        del cfg["torch_dtype"]
    else:
        cfg["torch_dtype"] = torch_dtype
    assert parse_config(cfg, SRC, dtype=override).model_dtype == want


def test_bad_dtype_override() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE, SRC, dtype="int8")
    assert info.value.key == "--dtype"


def test_moe_layers_qwen3() -> None:
    cfg = {**BASE, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    mc = parse_config(cfg, SRC)
    # (i + 1) % 2 == 0 -> layers 1, 3; layer 3 is mlp-only.
    assert [i for i in range(4) if mc.is_moe_layer(i)] == [1]


# --- the real configs ------------------------------------------------------------------------------


def real(name: str) -> dict[str, Any]:
    path = CONFIGS / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    cfg: dict[str, Any] = json.loads(path.read_text())
    return cfg


def test_real_qwen3_32b_fp8() -> None:
    mc = parse_config(real("qwen3-32b-fp8.json"), "qwen3-32b-fp8.json")
    # Published Qwen3-32B shape.
    assert mc.architecture == "Qwen3ForCausalLM"
    assert (mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size) == (5120, 64, 25600)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (64, 8, 128)
    assert mc.vocab_size == 151936
    assert (mc.quant.kind, mc.quant.block_n, mc.quant.block_k) == ("block_fp8", 128, 128)
    assert mc.model_dtype == "bf16"
    assert not mc.is_moe and not any(mc.is_moe_layer(i) for i in range(64))


def test_real_qwen3_30b_a3b_fp8() -> None:
    mc = parse_config(real("qwen3-30b-a3b-fp8.json"), "qwen3-30b-a3b-fp8.json")
    # Published Qwen3-30B-A3B shape: 128 experts of width 768, every layer MoE.
    assert mc.architecture == "Qwen3MoeForCausalLM"
    assert (mc.hidden_size, mc.num_hidden_layers) == (2048, 48)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (32, 4, 128)
    assert (mc.num_experts, mc.moe_intermediate_size) == (128, 768)
    assert mc.quant.kind == "block_fp8"
    assert all(mc.is_moe_layer(i) for i in range(48))


def test_real_deepseek_v3() -> None:
    mc = parse_config(real("deepseek-v3.json"), "deepseek-v3.json")
    # Published DeepSeek-V3 shape: 61 layers, the first 3 dense, 256 routed experts.
    assert mc.architecture == "DeepseekV3ForCausalLM"
    assert (mc.hidden_size, mc.num_hidden_layers) == (7168, 61)
    assert (mc.num_experts, mc.moe_intermediate_size, mc.n_shared_experts) == (256, 2048, 1)
    assert (mc.q_lora_rank, mc.kv_lora_rank) == (1536, 512)
    assert (mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim) == (128, 64, 128)
    assert mc.first_k_dense_replace == 3
    assert [i for i in range(61) if not mc.is_moe_layer(i)] == [0, 1, 2]
    assert (mc.quant.kind, mc.quant.block_n, mc.quant.block_k) == ("block_fp8", 128, 128)


HOSTILE_SIZES = [
    # (file, where the key lives, key, value, what the message says)
    ("qwen3-32b-fp8.json", (), "hidden_size", 10**9, "above the most mxload plans (2097152)"),
    ("qwen3-32b-fp8.json", (), "vocab_size", 10**15, "above the most mxload plans (2097152)"),
    ("qwen3-32b-fp8.json", (), "num_hidden_layers", 10**7, "above the most mxload plans (1024)"),
    ("qwen3-32b-fp8.json", (), "tie_word_embeddings", "false", "must be true or false"),
    ("qwen3.8-27b-fp8.json", ("vision_config",), "depth", 10**9, "(1024)"),
    ("qwen3.8-27b-fp8.json", ("text_config",), "attn_output_gate", "yes", "true or false"),
    ("qwen3.8-27b-fp8.json", ("text_config",), "tie_word_embeddings", 0, "true or false"),
    ("deepseek-v3.json", (), "n_routed_experts", 5000, "above the most mxload plans (4096)"),
]


@pytest.mark.parametrize("file,where,key,value,says", HOSTILE_SIZES)
def test_hostile_sizes_and_switches_are_refused_naming_the_key(
    file: str, where: tuple[str, ...], key: str, value: Any, says: str
) -> None:
    # Each of these ran out of memory in plan (or read "false" as true) before the bounds.
    cfg = real(file)
    holder = cfg
    for part in where:
        holder = holder[part]
    holder[key] = value
    with pytest.raises(ConfigError) as info:
        parse_config(cfg, SRC)
    msg = str(info.value)
    assert info.value.key == key and key in msg and SRC in msg and says in msg
    assert "\n" not in msg


def test_experts_times_layers_is_bounded() -> None:
    cfg = real("qwen3-30b-a3b-fp8.json")
    cfg["num_hidden_layers"], cfg["num_experts"] = 128, 1024  # exactly the bound: planned
    assert parse_config(cfg, SRC).num_experts == 1024
    cfg["num_hidden_layers"] = 129
    with pytest.raises(ConfigError, match=r"1024 experts x 129 layers .* \(131072 expert-layers\)"):
        parse_config(cfg, SRC)


@pytest.mark.parametrize(
    "file,where,changes,names",
    [
        ("qwen3-32b-fp8.json", (), {"num_attention_heads": 1 << 20, "head_dim": 1 << 20}, "num_attention_heads x head_dim"),
        ("qwen3.8-27b-fp8.json", ("vision_config",), {"spatial_merge_size": 1 << 11}, "spatial_merge_size^2"),
        ("deepseek-v3.json", (), {"n_shared_experts": 1 << 11, "moe_intermediate_size": 1 << 11}, "n_shared_experts x moe_intermediate_size"),
        ("qwen3.8-27b-fp8.json", ("text_config",), {"linear_num_value_heads": 1 << 12, "linear_value_head_dim": 1 << 12}, "linear_num_key_heads"),
        ("qwen3.5-397b-a17b-fp8.json", ("text_config",), {"num_experts": 4096, "mtp_num_hidden_layers": 16, "num_hidden_layers": 24, "layer_types": None}, "(MTP included)"),
    ],
)  # fmt: skip
def test_widths_that_are_products_of_bounded_keys_are_bounded(
    file: str, where: tuple[str, ...], changes: dict[str, Any], names: str
) -> None:
    # Each key alone within its bound; the tensor width (or expert count) they make ran
    # plan out of memory before.
    cfg = real(file)
    holder = cfg
    for part in where:
        holder = holder[part]
    for key, value in changes.items():
        if value is None:
            holder.pop(key, None)
        else:
            holder[key] = value
    with pytest.raises(ConfigError) as info:
        parse_config(cfg, SRC)
    assert names in str(info.value) and "above" in str(info.value)


def test_qwen3_5_defaults_are_vllms_text_config_defaults() -> None:
    # vLLM's Qwen3_5(Moe)TextConfig: tie_word_embeddings false whatever the top level says,
    # num_key_value_heads 4 (dense) / 2 (MoE), shared_expert_intermediate_size 512.
    dense = real("qwen3.8-27b-fp8.json")
    dense["tie_word_embeddings"] = True
    for key in ("tie_word_embeddings", "num_key_value_heads"):
        dense["text_config"].pop(key, None)
    mc = parse_config(dense, SRC)
    assert mc.tie_word_embeddings is False and mc.num_key_value_heads == 4
    moe = real("qwen3.5-397b-a17b-fp8.json")
    for key in ("num_key_value_heads", "shared_expert_intermediate_size"):
        moe["text_config"].pop(key, None)
    mc = parse_config(moe, SRC)
    assert mc.num_key_value_heads == 2 and mc.shared_expert_intermediate_size == 512
