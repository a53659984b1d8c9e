"""mxload.orchestrator.plan.checkpoint: the index, index/shard agreement and weight/scale pairing
(docs/contract.md §1.1, §1.2, §1.4)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from mxload.orchestrator.errors import (
    CheckpointError,
    DuplicateTensor,
    IndexError_,
    MismatchedScale,
    MissingTensor,
    UnpairedTensor,
)
from mxload.orchestrator.plan.checkpoint import (
    CheckpointMeta,
    ModuleWeights,
    build_meta,
    parse_index,
)
from mxload.orchestrator.plan.config import ModelConfig, parse_config
from mxload.orchestrator.plan.safetensors_header import (
    FileHeader,
    parse_header,
    parse_header_length,
)

from tests.hostile import build_safetensors

ROOT = "memory://ckpt"
INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
Q = "model.layers.0.self_attn.q_proj"
D = "model.layers.0.mlp.down_proj"


def config(quant: Mapping[str, Any] | str | None = "block", **extra: Any) -> ModelConfig:
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 200,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 100,
        "intermediate_size": 300,
        "vocab_size": 64,
        "torch_dtype": "bfloat16",
    }
    if quant == "block":
        quant = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    elif quant == "mx":
        quant = {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}
    if quant is not None:
        cfg["quantization_config"] = quant
    cfg.update(extra)
    return parse_config(cfg, "config.json")


def header(file: str, entries: Mapping[str, tuple[str, Sequence[int]]]) -> FileHeader:
    blob = build_safetensors(entries)
    n = parse_header_length(blob[:8], file=file, file_size=len(blob))
    return parse_header(blob[8 : 8 + n], file=file, file_size=len(blob))


# A block-FP8 linear [300, 200] with 128x128 tiles has a [ceil(300/128), ceil(200/128)] =
# [3, 2] scale; [256, 256] tiles exactly into [2, 2].
BLOCK_OK = {
    "model.embed_tokens.weight": ("BF16", [64, 200]),
    f"{Q}.weight": ("F8_E4M3", [256, 256]),
    f"{Q}.weight_scale_inv": ("F32", [2, 2]),
    f"{D}.weight": ("F8_E4M3", [300, 200]),
    f"{D}.weight_scale_inv": ("F32", [3, 2]),
    "model.norm.weight": ("BF16", [200]),
}


def single(entries: Mapping[str, tuple[str, Sequence[int]]], cfg: ModelConfig) -> CheckpointMeta:
    return build_meta(ROOT, cfg, None, {"model.safetensors": header("model.safetensors", entries)})


# --- parse_index ------------------------------------------------------------------------------


def index_bytes(weight_map: Any, **extra: Any) -> bytes:
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map, **extra}).encode()


def test_parse_index_returns_weight_map() -> None:
    wm = {"a": SHARD1, "b": SHARD2, "c": SHARD1}
    assert parse_index(index_bytes(wm), file=INDEX) == wm


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (b'{"weight_map": {"a": ', None),
        (b"\xff\xfe{}", None),
        (b"[]", None),
        (b'{"weight_map": {"a": NaN}}', None),
        (b'{"metadata": {}}', "weight_map"),
        (b'{"weight_map": ["a"]}', "weight_map"),
        (b'{"weight_map": {}}', "weight_map"),
        (b'{"metadata": 3, "weight_map": {"a": "x.safetensors"}}', "metadata"),
        (b'{"weight_map": {"a": "x.safetensors"}, "weight_map": {}}', "weight_map"),
    ],
    ids=[
        "bad_json",
        "not_utf8",
        "array",
        "nan",
        "weight_map_missing",
        "weight_map_list",
        "weight_map_empty",
        "metadata_not_object",
        "weight_map_twice",
    ],
)
def test_parse_index_refuses_malformed(data: bytes, key: str | None) -> None:
    with pytest.raises(IndexError_) as info:
        parse_index(data, file=INDEX)
    assert info.value.file == INDEX
    assert INDEX in str(info.value)
    if key is not None:
        assert info.value.key == key


@pytest.mark.parametrize(
    "shard",
    [
        "../model.safetensors",
        "/etc/model.safetensors",
        "s3://other-bucket/model.safetensors",
        "sub/../../x.safetensors",
        "a//b.safetensors",
        "./x.safetensors",
        "C:\\x.safetensors",
        "model.bin",
        "",
        5,
        None,
    ],
)
def test_parse_index_refuses_shard_names_outside_the_checkpoint(shard: Any) -> None:
    with pytest.raises(IndexError_) as info:
        parse_index(index_bytes({"good": SHARD1, "evil": shard}), file=INDEX)
    assert info.value.tensor == "evil"
    assert "'evil'" in str(info.value)


def test_parse_index_accepts_subfolder_shards() -> None:
    assert parse_index(index_bytes({"a": "weights/a.safetensors"}), file=INDEX) == {
        "a": "weights/a.safetensors"
    }


def test_parse_index_tensor_listed_twice_is_duplicate() -> None:
    data = b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'
    with pytest.raises(DuplicateTensor) as info:
        parse_index(data, file=INDEX)
    assert info.value.tensor == "a" and info.value.file == INDEX


# --- index vs shards ----------------------------------------------------------------------------


def sharded(cfg: ModelConfig | None = None) -> tuple[dict[str, str], dict[str, FileHeader]]:
    cfg = cfg or config()
    names = list(BLOCK_OK)
    part1 = {n: BLOCK_OK[n] for n in names[:3]}
    part2 = {n: BLOCK_OK[n] for n in names[3:]}
    wm = {n: SHARD1 for n in part1} | {n: SHARD2 for n in part2}
    return wm, {SHARD1: header(SHARD1, part1), SHARD2: header(SHARD2, part2)}


def test_sharded_checkpoint_joins_headers() -> None:
    wm, headers = sharded()
    meta = build_meta(ROOT, config(), wm, headers)
    assert meta.files == (SHARD1, SHARD2)
    assert set(meta.tensors) == set(BLOCK_OK)
    assert meta.tensor(f"{D}.weight").file == SHARD2
    assert meta.tensor("model.embed_tokens.weight").file == SHARD1
    assert meta.total_bytes == headers[SHARD1].file_size + headers[SHARD2].file_size
    assert meta.root == ROOT


def test_tensor_named_by_index_but_absent_from_its_file() -> None:
    wm, headers = sharded()
    wm["model.layers.0.self_attn.k_proj.weight"] = SHARD2
    with pytest.raises(MissingTensor) as info:
        build_meta(ROOT, config(), wm, headers)
    assert info.value.tensor == "model.layers.0.self_attn.k_proj.weight"
    assert info.value.file == SHARD2
    assert SHARD2 in str(info.value)


def test_index_pointing_at_the_wrong_shard_is_missing() -> None:
    wm, headers = sharded()
    wm["model.norm.weight"] = SHARD1  # it lives in SHARD2
    with pytest.raises(MissingTensor) as info:
        build_meta(ROOT, config(), wm, headers)
    assert info.value.tensor == "model.norm.weight" and info.value.file == SHARD1


def test_tensor_present_in_two_files_is_duplicate() -> None:
    wm, _ = sharded()
    names = list(BLOCK_OK)
    # model.norm.weight is listed in SHARD2 and also written into SHARD1.
    part1 = {n: BLOCK_OK[n] for n in [*names[:3], "model.norm.weight"]}
    part2 = {n: BLOCK_OK[n] for n in names[3:]}
    headers = {SHARD1: header(SHARD1, part1), SHARD2: header(SHARD2, part2)}
    with pytest.raises(DuplicateTensor) as info:
        build_meta(ROOT, config(), wm, headers)
    assert info.value.tensor == "model.norm.weight"
    assert SHARD1 in str(info.value) and SHARD2 in str(info.value)


def test_tensor_in_a_shard_but_not_in_the_index() -> None:
    wm, headers = sharded()
    del wm["model.norm.weight"]
    with pytest.raises(IndexError_) as info:
        build_meta(ROOT, config(), wm, headers)
    assert info.value.tensor == "model.norm.weight"
    assert info.value.file == SHARD2
    assert "does not list" in str(info.value)


def test_missing_header_for_a_shard_and_extra_header() -> None:
    wm, headers = sharded()
    with pytest.raises(CheckpointError):
        build_meta(ROOT, config(), wm, {SHARD1: headers[SHARD1]})
    extra = {**headers, "model-x.safetensors": header("model-x.safetensors", {})}
    with pytest.raises(CheckpointError):
        build_meta(ROOT, config(), wm, extra)
    with pytest.raises(CheckpointError):
        build_meta(ROOT, config(), wm, {SHARD1: headers[SHARD2], SHARD2: headers[SHARD2]})


# --- pairing: block FP8 -------------------------------------------------------------------------


def test_block_fp8_module_weights() -> None:
    meta = single(BLOCK_OK, config())
    mw = meta.module_weights(D)
    assert isinstance(mw, ModuleWeights)
    assert mw.quant == "block_fp8"
    assert mw.weight.name == f"{D}.weight" and mw.weight.shape == (300, 200)
    assert mw.scale is not None and mw.scale.name == f"{D}.weight_scale_inv"
    assert mw.scale.shape == (3, 2) and mw.scale.dtype == "F32"
    emb = meta.module_weights("model.embed_tokens")
    assert emb.quant == "none" and emb.scale is None
    assert meta.quantized_modules() == (D, Q)
    assert meta.has(f"{Q}.weight") and not meta.has(f"{Q}.bias")
    with pytest.raises(MissingTensor) as info:
        meta.module_weights("model.layers.0.mlp.up_proj")
    assert info.value.tensor == "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize(
    ("weight_shape", "scale_shape"),
    [
        ([300, 200], [2, 2]),  # ceil must be used, not floor
        ([300, 200], [3, 1]),
        ([300, 200], [2, 3]),  # transposed
        ([300, 200], [6]),  # flattened
        ([128, 129], [1, 1]),
    ],
)
def test_block_scale_of_wrong_shape(weight_shape: list[int], scale_shape: list[int]) -> None:
    entries = {
        f"{D}.weight": ("F8_E4M3", weight_shape),
        f"{D}.weight_scale_inv": ("F32", scale_shape),
    }
    with pytest.raises(MismatchedScale) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.weight_scale_inv"
    assert "mismatched or unpaired scale" in str(info.value)
    assert info.value.file == "model.safetensors"


def test_block_scale_edge_shapes_accepted() -> None:
    # [129, 1] -> [2, 1]; [1, 1] -> [1, 1]; [128, 384] -> [1, 3].
    entries = {
        "a.weight": ("F8_E4M3", [129, 1]),
        "a.weight_scale_inv": ("F32", [2, 1]),
        "b.weight": ("F8_E4M3", [1, 1]),
        "b.weight_scale_inv": ("F32", [1, 1]),
        "c.weight": ("F8_E4M3", [128, 384]),
        "c.weight_scale_inv": ("F32", [1, 3]),
    }
    assert single(entries, config()).quantized_modules() == ("a", "b", "c")


def test_block_scale_with_other_block_size() -> None:
    cfg = config(
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [64, 32],
        }
    )
    # [300, 200] with 64x32 tiles: [ceil(300/64), ceil(200/32)] = [5, 7].
    ok = {f"{D}.weight": ("F8_E4M3", [300, 200]), f"{D}.weight_scale_inv": ("F32", [5, 7])}
    assert single(ok, cfg).module_weights(D).scale is not None
    bad = {f"{D}.weight": ("F8_E4M3", [300, 200]), f"{D}.weight_scale_inv": ("F32", [3, 2])}
    with pytest.raises(MismatchedScale):
        single(bad, cfg)


def test_block_scale_of_wrong_dtype() -> None:
    # F32 (the seed's releases) and BF16 (third-party Qwen3.5 copies) are accepted; F16 is not
    entries = {f"{D}.weight": ("F8_E4M3", [300, 200]), f"{D}.weight_scale_inv": ("F16", [3, 2])}
    with pytest.raises(MismatchedScale) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.weight_scale_inv"


def test_weight_without_scale() -> None:
    entries = dict(BLOCK_OK)
    del entries[f"{D}.weight_scale_inv"]
    with pytest.raises(UnpairedTensor) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.weight"
    assert f"{D}.weight_scale_inv" in str(info.value)


def test_scale_without_weight() -> None:
    entries = dict(BLOCK_OK)
    del entries[f"{D}.weight"]
    with pytest.raises(UnpairedTensor) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.weight_scale_inv"


def test_scale_of_an_unquantized_weight() -> None:
    entries = dict(BLOCK_OK)
    entries[f"{D}.weight"] = ("BF16", [300, 200])
    with pytest.raises(UnpairedTensor) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.weight_scale_inv"


def test_fp8_tensor_that_is_not_a_weight() -> None:
    entries = {**BLOCK_OK, f"{D}.bias": ("F8_E4M3", [300])}
    with pytest.raises(UnpairedTensor) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.bias"


def test_fp8_weight_not_2d() -> None:
    entries = {f"{D}.weight": ("F8_E4M3", [2, 300, 200]), f"{D}.weight_scale_inv": ("F32", [3, 2])}
    with pytest.raises(MismatchedScale) as info:
        single(entries, config())
    assert info.value.tensor == f"{D}.weight"


def test_fp8_weights_without_quantization_config() -> None:
    with pytest.raises(CheckpointError) as info:
        single(BLOCK_OK, config(None))
    assert info.value.key == "quantization_config"
    assert info.value.tensor in {f"{D}.weight", f"{Q}.weight"}


def test_unquantized_checkpoint() -> None:
    entries = {f"{D}.weight": ("BF16", [300, 200]), "model.norm.weight": ("BF16", [200])}
    meta = single(entries, config(None))
    mw = meta.module_weights(D)
    assert mw.quant == "none" and mw.scale is None
    assert meta.quantized_modules() == ()


# --- pairing: MXFP8 ------------------------------------------------------------------------------


def test_mxfp8_pairs() -> None:
    # [64, 96] has 96 / 32 = 3 groups per row.
    entries = {
        f"{D}.weight": ("F8_E4M3", [64, 96]),
        f"{D}.weight_scale": ("U8", [64, 3]),
        "lm_head.weight": ("BF16", [64, 96]),
    }
    meta = single(entries, config("mx"))
    mw = meta.module_weights(D)
    assert mw.quant == "mxfp8"
    assert mw.scale is not None and mw.scale.name == f"{D}.weight_scale" and mw.scale.dtype == "U8"
    assert meta.module_weights("lm_head").quant == "none"


@pytest.mark.parametrize(
    ("scale", "culprit"),
    [
        (("U8", [64, 4]), "weight_scale"),
        (("U8", [3, 64]), "weight_scale"),
        (("F32", [64, 3]), "weight_scale"),
        (("U8", [2, 3]), "weight_scale"),  # a block-FP8-style tile scale
    ],
)
def test_mxfp8_scale_mismatch(scale: tuple[str, list[int]], culprit: str) -> None:
    entries = {f"{D}.weight": ("F8_E4M3", [64, 96]), f"{D}.weight_scale": scale}
    with pytest.raises(MismatchedScale) as info:
        single(entries, config("mx"))
    assert info.value.tensor == f"{D}.{culprit}"
    assert "mismatched or unpaired scale" in str(info.value)


def test_mxfp8_weight_with_ragged_k() -> None:
    entries = {f"{D}.weight": ("F8_E4M3", [64, 100]), f"{D}.weight_scale": ("U8", [64, 3])}
    with pytest.raises(MismatchedScale) as info:
        single(entries, config("mx"))
    assert info.value.tensor == f"{D}.weight"


def test_mxfp8_unpaired() -> None:
    with pytest.raises(UnpairedTensor) as info:
        single({f"{D}.weight": ("F8_E4M3", [64, 96])}, config("mx"))
    assert info.value.tensor == f"{D}.weight"
    with pytest.raises(UnpairedTensor) as info:
        single({f"{D}.weight_scale": ("U8", [64, 3])}, config("mx"))
    assert info.value.tensor == f"{D}.weight_scale"
    # A block-FP8 scale in an MXFP8 checkpoint leaves the weight unpaired.
    with pytest.raises(UnpairedTensor):
        single(
            {f"{D}.weight": ("F8_E4M3", [64, 96]), f"{D}.weight_scale_inv": ("F32", [1, 1])},
            config("mx"),
        )


# --- crossing processes, staying pure -------------------------------------------------------------


def test_meta_pickles() -> None:
    wm, headers = sharded()
    meta = build_meta(ROOT, config(), wm, headers)
    again = pickle.loads(pickle.dumps(meta))
    assert again == meta
    assert again.module_weights(D) == meta.module_weights(D)


def test_pure_modules_import_nothing_heavy() -> None:
    code = (
        "import sys, mxload.orchestrator.plan.checkpoint, mxload.orchestrator.plan.safetensors_header;"
        "bad = [m for m in ('torch', 'numpy', 'ray', 'fsspec', 'safetensors', 'mxload.workers')"
        " if m in sys.modules]; print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
