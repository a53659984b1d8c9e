"""Synthetic checkpoints (orchestrator/tools/synth.py): real HF layout, shapes per preset, determinism.

Expected names and shapes are written out by hand from the preset numbers (docs/contract.md §1.1:
scale ``[ceil(N/128), ceil(K/128)]``); the files are read with the official safetensors
library, and the BF16 twin is checked against a resolve written here with explicit
tile indices.
"""

from __future__ import annotations

import json
import math
import os
import uuid

import fsspec
import pytest
import torch
from mxload.orchestrator.errors import UsageError
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.tools.synth import PRESETS, make_checkpoint
from safetensors import safe_open

from tests.servers import moto_s3

QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _load(d: str) -> tuple[dict, dict[str, str], dict[str, torch.Tensor], dict[str, str]]:
    """config, weight_map, all tensors, dtype strings (from the raw headers)."""
    config = json.load(open(os.path.join(d, "config.json")))
    index_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index_path):
        index = json.load(open(index_path))
        weight_map = index["weight_map"]
    else:
        index, weight_map = None, None
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    dtypes: dict[str, str] = {}
    seen: dict[str, str] = {}
    for fname in files:
        path = os.path.join(d, fname)
        with safe_open(path, "pt") as f:
            for k in f.keys():
                assert k not in tensors, f"{k} present twice"
                tensors[k] = f.get_tensor(k)
                seen[k] = fname
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        dtypes.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    if weight_map is not None:
        assert weight_map == seen  # every name in exactly the file the index says
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert index["metadata"]["total_size"] == total
    else:
        weight_map = seen
    return config, weight_map, tensors, dtypes


@pytest.fixture(scope="module")
def moe_tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moe_tiny"))
    return d, make_checkpoint(d, "qwen3-moe-tiny", seed=3)


@pytest.fixture(scope="module")
def awkward(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("awkward"))
    return d, make_checkpoint(d, "qwen3-moe-awkward", seed=3)


def test_moe_tiny_layout(moe_tiny):
    d, summary = moe_tiny
    config, _, tensors, dtypes = _load(d)
    assert config == PRESETS["qwen3-moe-tiny"]
    assert config["quantization_config"] == QUANT and config["torch_dtype"] == "bfloat16"
    assert config["vocab_size"] % 64 != 0
    cfg = parse_config(config)
    assert cfg.quant.kind == "block_fp8"
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    assert sorted(os.listdir(d)) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert summary["files"][0] == "config.json" and len(summary["files"]) == 7
    # 3 global + 4 layers x (8 attn + 4 norms) + 3 MoE layers x (router + 8 x 3 x 2) + 6
    assert len(tensors) == summary["tensors"] == 3 + 4 * 12 + 3 * 49 + 6 == 204
    assert summary["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert 2_000_000 < summary["bytes"] < 8_000_000  # a few MB
    want = {
        "model.embed_tokens.weight": ("BF16", (1000, 256)),
        "lm_head.weight": ("BF16", (1000, 256)),
        "model.norm.weight": ("BF16", (256,)),
        "model.layers.0.self_attn.q_proj.weight": ("F8_E4M3", (256, 256)),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": ("F32", (2, 2)),
        "model.layers.1.self_attn.k_proj.weight": ("F8_E4M3", (128, 256)),
        "model.layers.1.self_attn.k_proj.weight_scale_inv": ("F32", (1, 2)),
        "model.layers.3.self_attn.o_proj.weight_scale_inv": ("F32", (2, 2)),
        "model.layers.0.self_attn.q_norm.weight": ("BF16", (64,)),
        "model.layers.0.input_layernorm.weight": ("BF16", (256,)),
        "model.layers.0.mlp.gate.weight": ("BF16", (8, 256)),
        "model.layers.3.mlp.experts.7.gate_proj.weight": ("F8_E4M3", (128, 256)),
        "model.layers.3.mlp.experts.7.gate_proj.weight_scale_inv": ("F32", (1, 2)),
        "model.layers.3.mlp.experts.7.down_proj.weight": ("F8_E4M3", (256, 128)),
        "model.layers.3.mlp.experts.7.down_proj.weight_scale_inv": ("F32", (2, 1)),
        "model.layers.2.mlp.up_proj.weight": ("F8_E4M3", (512, 256)),
        "model.layers.2.mlp.down_proj.weight_scale_inv": ("F32", (2, 4)),
    }
    for name, (dtype, shape) in want.items():
        assert (dtypes[name], tuple(tensors[name].shape)) == (dtype, shape), name
    assert "model.layers.2.mlp.gate.weight" not in tensors  # the dense layer has no router
    assert "model.layers.2.mlp.experts.0.up_proj.weight" not in tensors


def test_awkward_preset_edges(awkward):
    d, _ = awkward
    config, _, tensors, dtypes = _load(d)
    cfg = parse_config(config)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert config["hidden_size"] % 128 != 0 and (config["hidden_size"] // 32) % 2 == 1
    assert (config["moe_intermediate_size"] // 32) % 2 == 1
    want = {
        "model.embed_tokens.weight": ("BF16", (997, 160)),
        "model.layers.0.self_attn.q_proj.weight": ("F8_E4M3", (192, 160)),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": ("F32", (2, 2)),
        "model.layers.0.self_attn.k_proj.weight_scale_inv": ("F32", (1, 2)),
        "model.layers.0.self_attn.o_proj.weight": ("F8_E4M3", (160, 192)),
        "model.layers.0.self_attn.o_proj.weight_scale_inv": ("F32", (2, 2)),
        "model.layers.0.mlp.down_proj.weight": ("F8_E4M3", (160, 224)),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", (2, 2)),
        "model.layers.1.mlp.gate.weight": ("BF16", (6, 160)),
        "model.layers.1.mlp.experts.5.up_proj.weight": ("F8_E4M3", (96, 160)),
        "model.layers.1.mlp.experts.5.down_proj.weight": ("F8_E4M3", (160, 96)),
        "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv": ("F32", (2, 1)),
        "model.layers.0.self_attn.k_norm.weight": ("BF16", (48,)),
    }
    for name, (dtype, shape) in want.items():
        assert (dtypes[name], tuple(tensors[name].shape)) == (dtype, shape), name


def test_dense_tiny_is_dense():
    d = f"memory://mxload-test-{uuid.uuid4().hex}"
    summary = make_checkpoint(d, "qwen3-dense-tiny", shards=1)
    assert summary["files"] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ]
    fs = fsspec.filesystem("memory")
    assert not fs.exists(f"{d}/model.safetensors.index.json")
    from safetensors.torch import load

    tensors = load(fs.cat_file(f"{d}/model.safetensors"))
    assert not any(".experts." in k or k.endswith("mlp.gate.weight") for k in tensors)
    assert tensors["model.layers.1.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    cfg = json.loads(fs.cat_file(f"{d}/config.json"))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert len(tensors) == summary["tensors"] == 3 + 2 * (12 + 6)


def test_values_are_sane_and_special_tiles_present(moe_tiny):
    d, summary = moe_tiny
    _, _, tensors, _ = _load(d)
    specials = {s["kind"]: s for s in summary["special_tiles"]}
    zero = specials["zero_weights"]
    tiny = specials["tiny_scale"]
    assert zero["tensor"] == "model.layers.0.self_attn.q_proj.weight" and zero["tile"] == [0, 0]
    assert tiny["tensor"] == "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"
    scales = []
    saturated = subnormal = 0
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            b = t.view(torch.uint8)
            assert not ((b == 0x7F) | (b == 0xFF)).any(), f"NaN code in {name}"
            saturated += int(((b & 0x7F) == 0x7E).sum())  # ±448
            subnormal += int((((b & 0x78) == 0) & ((b & 0x07) != 0)).sum())
        if name.endswith("weight_scale_inv"):
            assert t.dtype == torch.float32
            assert torch.isfinite(t).all() and (t > 0).all(), name
            if name != tiny["tensor"]:
                scales.append(t.reshape(-1))
    assert saturated > 0 and subnormal > 0  # the extremes of E4M3 occur
    allscales = torch.cat(scales)
    assert allscales.max() / allscales.min() >= 2.0**6  # spans several binades
    zt = tensors[zero["tensor"]][:128, :128].view(torch.uint8)
    assert (zt == 0).all()
    assert (tensors[zero["tensor"]][128:].view(torch.uint8) != 0).any()
    assert tensors[tiny["tensor"]][0, -1].item() == 2.0**-120
    assert tensors[tiny["tensor"]][0, 0].item() > 2.0**-20


def test_no_special_tiles(tmp_path):
    summary = make_checkpoint(str(tmp_path), "qwen3-dense-tiny", special_tiles=False)
    assert summary["special_tiles"] == []
    _, _, tensors, _ = _load(str(tmp_path))
    q = tensors["model.layers.0.self_attn.q_proj.weight"][:128, :128].view(torch.uint8)
    assert (q != 0).any()
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].min() > 2.0**-20


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = (str(tmp_path / x) for x in "abc")
    make_checkpoint(a, "qwen3-moe-awkward", seed=11)
    make_checkpoint(b, "qwen3-moe-awkward", seed=11)
    make_checkpoint(c, "qwen3-moe-awkward", seed=12)
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) == sorted(os.listdir(c))
    for n in names:
        assert open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read(), n
    _, _, ta, _ = _load(a)
    _, _, tc, _ = _load(c)
    w = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert not torch.equal(ta[w].view(torch.uint8), tc[w].view(torch.uint8))
    assert set(ta) == set(tc)


def test_sharding_changes_files_not_tensors(tmp_path, moe_tiny):
    d3 = str(tmp_path / "three")
    make_checkpoint(d3, "qwen3-moe-tiny", seed=3, shards=3)
    _, wm3, t3, _ = _load(d3)
    _, wm2, t2, _ = _load(moe_tiny[0])
    assert sorted(set(wm3.values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(t2) == set(t3)
    for k in t2:
        assert torch.equal(t2[k].view(torch.uint8), t3[k].view(torch.uint8)), k
    for wm in (wm2, wm3):
        files_of_layer: dict[str, set[str]] = {}
        for name, f in wm.items():
            if name.startswith("model.layers."):
                files_of_layer.setdefault(name.split(".")[2], set()).add(f)
        assert any(len(fs) > 1 for fs in files_of_layer.values())  # a layer straddles shards


def _resolve_by_tiles(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """docs/contract.md §2.1 with explicit tile indices: R[r, c] = bf16(f32(W[r, c]) * S[r//128, c//128])."""
    n, k = w.shape
    rows = torch.arange(n) // 128
    cols = torch.arange(k) // 128
    return (w.to(torch.float32) * s[rows[:, None], cols[None, :]]).to(torch.bfloat16)


def test_bf16_twin_is_the_resolved_model(tmp_path, moe_tiny):
    d = str(tmp_path / "bf16")
    summary = make_checkpoint(d, "qwen3-moe-tiny", seed=3, bf16=True)
    assert summary["quantized"] is False
    config, _, tb, dtypes = _load(d)
    assert "quantization_config" not in config
    assert parse_config(config).quant.kind == "none"
    _, _, tq, _ = _load(moe_tiny[0])
    assert not any(k.endswith("weight_scale_inv") for k in tb)
    assert set(tb) == {k for k in tq if not k.endswith("weight_scale_inv")}
    for name, t in tb.items():
        scale = tq.get(name + "_scale_inv")
        if scale is None:
            assert torch.equal(t.view(torch.uint8), tq[name].view(torch.uint8)), name
        else:
            assert dtypes[name] == "BF16" and t.shape == tq[name].shape
            want = _resolve_by_tiles(tq[name], scale)
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), name


def test_overrides_and_ignored_modules(tmp_path):
    d = str(tmp_path / "o")
    quant = dict(QUANT, modules_to_not_convert=["model.layers.0.self_attn", "down_proj"])
    make_checkpoint(d, "qwen3-dense-tiny", overrides={"quantization_config": quant})
    config, _, tensors, dtypes = _load(d)
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "model.layers.0.self_attn",
        "down_proj",
    ]
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "BF16"
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in tensors
    assert dtypes["model.layers.1.mlp.down_proj.weight"] == "BF16"
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.up_proj.weight"] == "F8_E4M3"

    d2 = str(tmp_path / "p")
    make_checkpoint(d2, "qwen3-dense-tiny", overrides={"torch_dtype": "float16", "vocab_size": 512})
    _, _, t2, dt2 = _load(d2)
    assert dt2["model.embed_tokens.weight"] == "F16" and t2["lm_head.weight"].shape == (512, 256)


def test_bad_arguments():
    with pytest.raises(UsageError, match=r"unknown preset 'nope'.*qwen3-moe-tiny"):
        make_checkpoint("memory://x", "nope")
    with pytest.raises(UsageError, match="--shards"):
        make_checkpoint("memory://x", "qwen3-dense-tiny", shards=0)
    with pytest.raises(UsageError, match="non-empty shards"):
        make_checkpoint("memory://x", "qwen3-dense-tiny", shards=10_000)


def test_presets_are_small_and_valid():
    for name, cfg in PRESETS.items():
        parsed = parse_config(cfg, name)
        assert parsed.quant.kind == "block_fp8", name
        assert (parsed.quant.block_n, parsed.quant.block_k) == (128, 128)
        text = cfg.get("text_config", cfg)  # Qwen3.5 nests the language model
        assert text.get("torch_dtype", text.get("dtype")) == "bfloat16"
        assert math.prod([text["hidden_size"], text["vocab_size"]]) < 1_000_000


def test_writes_through_fsspec_to_s3():
    with moto_s3() as s3:
        _write_and_check_s3(s3)


def _write_and_check_s3(s3) -> None:
    s3.create_bucket("mxload-synth")
    opts = s3.storage_options
    summary = make_checkpoint("s3://mxload-synth/v1", "qwen3-dense-tiny", storage_options=opts)
    local = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    for name in summary["files"]:
        assert local.size(f"mxload-synth/v1/{name}") > 0, name
    from safetensors.torch import load

    index = json.loads(local.cat_file("mxload-synth/v1/model.safetensors.index.json"))
    first = load(local.cat_file("mxload-synth/v1/model-00001-of-00002.safetensors"))
    assert set(first) == {k for k, f in index["weight_map"].items() if f.startswith("model-00001")}
