"""``mxload convert`` (docs/contract.md §1.2): offline block-FP8 -> ModelOpt-style MXFP8, unsharded.

Every output tensor is compared byte for byte with a conversion made here from the
source files read by the official ``safetensors`` library and the independent numpy
reference (``tests/independent_ref.py``: ``resolve_ref_bits`` on the whole tensor, then
``mx_quantize_ref``). The config's ``quantization_config`` must be exactly the four keys
of docs/contract.md §1.2, the index must agree with the files, and the output must load with
mxload's own catalog (and loader) as an MXFP8 checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import UnsupportedError
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.tools.convert import convert_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file

from tests.independent_ref import mx_quantize_ref, resolve_ref_bits, same_e4m3_bytes

BITS = {"bf16": (np.uint16, torch.bfloat16), "fp16": (np.uint16, torch.float16)}

CASES = {
    "moe-tiny": ("qwen3-moe-tiny", None),
    "dense-tiny": ("qwen3-dense-tiny", None),
    "awkward": ("qwen3-moe-awkward", None),
    # K not a multiple of 32: expert down_proj K = 80 and dense down_proj K = 208 are
    # written resolved and listed in ignore; 80 and 208 are also partial tiles.
    "awkward-k": ("qwen3-moe-awkward", {"moe_intermediate_size": 80, "intermediate_size": 208}),
    # A module the source already keeps unquantized (modules_to_not_convert).
    "dense-not-converted": (
        "qwen3-dense-tiny",
        {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["model.layers.1.mlp.down_proj"],
            }
        },
    ),
}


def read_all(path: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, str]]:
    """(config, name -> tensor, name -> file) with the official library."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for file in files:
        for name, t in load_file(os.path.join(path, file)).items():
            assert name not in tensors, f"{name} in two files"
            tensors[name] = t
            where[name] = file
    return config, tensors, where


def raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def model_dtype(config: dict) -> str:
    return {"float16": "fp16", "float32": "fp32"}.get(config.get("torch_dtype"), "bf16")


@pytest.fixture(scope="module")
def converted(ckpt_factory, tmp_path_factory):
    cache: dict[tuple[str, str], tuple[str, str, dict]] = {}

    def get(case: str, numerics: str = "auto") -> tuple[str, str, dict]:
        if (case, numerics) not in cache:
            preset, overrides = CASES[case]
            kw = {"overrides": overrides} if overrides else {}
            src = ckpt_factory(preset, 5, **kw)
            dst = str(tmp_path_factory.mktemp(f"mx-{case}-{numerics}") / "out")
            summary = convert_checkpoint(src, dst, numerics=numerics)
            cache[(case, numerics)] = (src, dst, summary)
        return cache[(case, numerics)]

    return get


def _merge_group(module: str) -> str:
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.\d+\.(gate|up|down)_proj", module)
    if m:
        return m.group(1)
    m = re.fullmatch(r"(model\.layers\.\d+\.self_attn)\.[qkv]_proj", module)
    if m:
        return m.group(1) + ".qkv"
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.(gate|up)_proj", module)
    if m:
        return m.group(1) + ".gate_up"
    return module


def expected_output(src: str) -> tuple[dict[str, tuple[str, np.ndarray]], list[str], dict]:
    """name -> (safetensors dtype, bytes) of the MXFP8 checkpoint, made independently;
    the modules that must be excluded; the source config."""
    config, tensors, _ = read_all(src)
    qc = config["quantization_config"]
    bn, bk = qc["weight_block_size"]
    dtype = model_dtype(config)
    np_bits, torch_dt = BITS[dtype]
    out: dict[str, tuple[str, np.ndarray]] = {}
    excluded = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    # vLLM builds a ParallelLMHead even with tied embeddings; mxload holds it in the model
    # dtype, so it is always excluded.
    excluded.append("lm_head")
    # Modules that fall back together (written here from vLLM's merge rules, not from the
    # planner): q/k/v and gate/up fill one tensor; a layer's routed experts share one layout.
    fallback_groups = {
        _merge_group(n[: -len(".weight")])
        for n, t in tensors.items()
        if t.dtype == torch.float8_e4m3fn and t.dim() == 2 and t.shape[1] % 32
    }
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        module = name[: -len(".weight")]
        scale_name = f"{module}.weight_scale_inv"
        if t.dtype == torch.float8_e4m3fn and scale_name in tensors:
            w = t.view(torch.uint8).numpy()
            s = tensors[scale_name].numpy()
            bits = resolve_ref_bits(w, s, row0=0, col0=0, block_n=bn, block_k=bk, dtype=dtype)
            n, k = w.shape
            if _merge_group(module) not in fallback_groups:
                values = (
                    torch.from_numpy(bits.astype(np_bits)).view(torch_dt).to(torch.float64).numpy()
                )
                payload, scale = mx_quantize_ref(values)
                out[name] = ("F8_E4M3", payload.reshape(-1))
                out[f"{module}.weight_scale"] = ("U8", scale.reshape(-1))
                assert scale.shape == (n, k // 32)
            else:
                out[name] = (
                    {"bf16": "BF16", "fp16": "F16"}[dtype],
                    bits.view(np.uint8).reshape(-1),
                )
                excluded.append(module)
        else:
            out[name] = (ST_DTYPE[t.dtype], raw(t))
            if name.endswith(".weight") and t.dim() == 2:
                # kept in the model dtype: a ModelOpt config must exclude it, or vLLM
                # quantizes lm_head / the router (ParallelLMHead and linears it does not
                # exclude) and cannot load the BF16 tensor
                excluded.append(module)
    return out, sorted(set(excluded)), config


ST_DTYPE = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
}


@pytest.mark.parametrize("numerics", ["fast", "reference"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_output_tensor_matches_the_independent_reference(converted, case, numerics) -> None:
    src, dst, summary = converted(case, numerics)
    assert summary["backend"] == f"cpu-{numerics}"
    want, excluded, src_config = expected_output(src)
    config, got, _ = read_all(dst)
    assert set(got) == set(want), (
        f"missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"
    )
    for file in set(read_all(dst)[2].values()):
        with safe_open(os.path.join(dst, file), "pt") as f:
            assert f.metadata() == {"format": "pt"}, file  # transformers requires it
    bad = []
    for name, (dtype, data) in want.items():
        t = got[name]
        if ST_DTYPE[t.dtype] != dtype:
            bad.append(f"{name}: dtype {t.dtype}, expected {dtype}")
            continue
        b = raw(t)
        if b.shape != data.shape:
            bad.append(f"{name}: {b.size} bytes, expected {data.size}")
            continue
        same = same_e4m3_bytes(b, data) if dtype == "F8_E4M3" else (b == data)
        if not same.all():
            bad.append(f"{name}: {int((~same).sum())} bytes differ")
    assert bad == [], bad[:10]
    # Shapes: MX payload [N, K] (not transposed), scale [N, K/32].
    for name, t in got.items():
        if name.endswith(".weight_scale"):
            w = got[name[: -len("_scale")]]
            assert t.shape == (w.shape[0], w.shape[1] // 32)
    # quantization_config exactly as docs/contract.md §1.2; everything else in config.json unchanged.
    assert config["quantization_config"] == {
        "quant_method": "modelopt",
        "quant_algo": "MXFP8",
        "ignore": excluded,
        "kv_cache_quant_algo": None,
    }
    rest = {k: v for k, v in config.items() if k != "quantization_config"}
    assert rest == {k: v for k, v in src_config.items() if k != "quantization_config"}
    assert summary["excluded_modules"] == excluded
    assert summary["tensors"] == len(want)


def test_fallback_case_really_has_excluded_modules(converted) -> None:
    """What convert writes, plan and load accept (one validator): the output of the
    K-not-multiple-of-32 case plans at the layout where the loader is strictest."""
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.types import ParallelLayout

    _, dst, _ = converted("awkward-k")
    config, got, _ = read_all(dst)
    excl = config["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.experts.0.down_proj" in excl
    assert "model.layers.0.mlp.down_proj" in excl
    # A layer's experts share one buffer layout in the loader: their gate/up fall back
    # with the down_proj whose K (80) is not a multiple of 32; a dense MLP's gate/up do not.
    assert "model.layers.1.mlp.experts.0.gate_proj" in excl
    assert "model.layers.0.mlp.gate_proj" not in excl
    # kept in the model dtype, so listed: lm_head, the embedding, the MoE router
    assert {"lm_head", "model.embed_tokens", "model.layers.1.mlp.gate"} <= set(excl)
    assert not any("norm" in m for m in excl)  # 1-D tensors are not linears
    assert got["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.0.down_proj.weight_scale" not in got
    meta = open_checkpoint(dst)
    build_plan(
        meta.config, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True), checkpoint=meta
    )
    _, dst2, _ = converted("dense-not-converted")
    config2, got2, _ = read_all(dst2)
    assert "model.layers.1.mlp.down_proj" in config2["quantization_config"]["ignore"]
    assert got2["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("case", sorted(CASES))
def test_index_is_consistent_with_the_files(converted, case) -> None:
    src, dst, _ = converted(case)
    _, tensors, where = read_all(dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    src_index = os.path.join(src, "model.safetensors.index.json")
    assert os.path.exists(index_path) == os.path.exists(src_index)
    assert "model.safetensors.index.json" in os.listdir(dst) or os.path.exists(
        os.path.join(dst, "model.safetensors")
    )
    if not os.path.exists(index_path):
        return
    with open(index_path) as f:
        index = json.load(f)
    assert index["weight_map"] == where, "weight_map must name each tensor's file, no more"
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    # Name-preserving: each tensor stays in its source shard; new scales sit with weights.
    with open(src_index) as f:
        src_map = json.load(f)["weight_map"]
    for name, file in where.items():
        origin = src_map.get(name) or src_map[name[: -len("_scale")]]
        assert file == origin, name


def test_single_file_checkpoint(ckpt_factory, tmp_path) -> None:
    src = ckpt_factory("qwen3-dense-tiny", 6, shards=1)
    dst = str(tmp_path / "out")
    convert_checkpoint(src, dst)
    # the serving files carried as they are (tests/engine/test_vllm_serving_files.py)
    assert sorted(os.listdir(dst)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(dst) / name).read_bytes() == (Path(src) / name).read_bytes(), name
    want, _, _ = expected_output(src)
    _, got, _ = read_all(dst)
    assert set(got) == set(want)
    for name, (_, data) in want.items():
        assert (raw(got[name]) == data).all() or same_e4m3_bytes(raw(got[name]), data).all()


@pytest.mark.parametrize("case", ["moe-tiny", "awkward-k"])
def test_output_opens_as_mxfp8_with_mxloads_catalog(converted, case) -> None:
    _, dst, _ = converted(case)
    meta = open_checkpoint(dst)
    assert meta.config.quant.kind == "mxfp8"
    _, got, _ = read_all(dst)
    assert set(meta.tensors) == set(got)
    for name, info in meta.tensors.items():
        assert tuple(info.shape) == tuple(got[name].shape)


def test_converted_checkpoint_loads_to_the_same_bytes(converted) -> None:
    """The short route (MXFP8, repack only) gives every rank the bytes the long route
    (block-FP8 -> resolve -> quantize) must give, per the independent reference."""
    from mxload.orchestrator.plan.message import SourceInfo
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.workers.numerics.select import select_backend
    from mxload.workers.rank.loader import RankLoader

    from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank

    src, dst, _ = converted("moe-tiny")
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    meta = open_checkpoint(dst)
    plan = build_plan(meta.config, layout, checkpoint=meta, fused=False)
    ref = RefCheckpoint(src)
    assert plan.min_staging_load < plan.min_staging_reload
    # The default budget, and one below a unit (MX scale rows split with their rows).
    for rp, budget in zip(
        plan.ranks[:2], (plan.ranks[0].staging.budget_bytes, plan.min_staging_load), strict=True
    ):
        loader = RankLoader(
            rp, model_dtype="bf16", backend=select_backend("cpu", prefer_fast=False)
        )
        stats = loader.load(
            list(rp.reads),
            SourceInfo(root=dst, quant="mxfp8", block_n=1, block_k=32),
            version=1,
            staging_budget=budget,
        )
        assert stats.measured_peak_staging_bytes <= budget
        problems = compare_rank(
            expected_rank(ref, Layout(2, 2, 1, True), rp.rank), loader.host_tensors()
        )
        assert problems == [], problems[:8]


@pytest.mark.parametrize("case", ["moe-tiny", "awkward-k"])
def test_converting_mxfp8_again_copies_it_through(converted, tmp_path, case) -> None:
    _, dst, _ = converted(case)
    again = str(tmp_path / "again")
    convert_checkpoint(dst, again)
    c1, t1, w1 = read_all(dst)
    c2, t2, w2 = read_all(again)
    assert c1 == c2
    assert w1 == w2
    assert set(t1) == set(t2)
    for name in t1:
        assert t1[name].dtype == t2[name].dtype and t1[name].shape == t2[name].shape, name
        assert (raw(t1[name]) == raw(t2[name])).all(), name
    for file in set(w1.values()):
        with open(os.path.join(dst, file), "rb") as a, open(os.path.join(again, file), "rb") as b:
            assert a.read() == b.read(), f"{file}: not copied through byte for byte"


def test_bf16_checkpoint_is_refused(ckpt_factory, tmp_path) -> None:
    src = ckpt_factory("qwen3-dense-tiny", 5, bf16=True)
    dst = str(tmp_path / "out")
    with pytest.raises(UnsupportedError) as err:
        convert_checkpoint(src, dst)
    assert err.value.exit_code == 2
    assert err.value.key == "quantization_config"
    assert "quantization_config" in str(err.value) and "config.json" in err.value.file
    assert not os.path.exists(dst), "nothing may be written for a refused convert"


def test_nonfinite_scale_refused_unless_allowed(ckpt_factory, tmp_path) -> None:
    """docs/contract.md §1.1: a NaN block scale is refused naming tensor and tile; with
    allow_nonfinite it passes and every MX group it touches is NaN (docs/contract.md §2.2)."""
    import shutil
    import struct

    from mxload.orchestrator.errors import NonFiniteScale

    src = str(tmp_path / "src")
    shutil.copytree(ckpt_factory("qwen3-dense-tiny", 5), src)
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        file = os.path.join(src, json.load(f)["weight_map"][name])
    with safe_open(file, "pt") as f:  # the official reader locates the bytes to patch
        cols = f.get_slice(name).get_shape()[1]
    header_len = int.from_bytes(open(file, "rb").read(8), "little")
    header = json.loads(open(file, "rb").read(8 + header_len)[8:])
    start = 8 + header_len + header[name]["data_offsets"][0]
    with open(file, "r+b") as f:
        f.seek(start + (2 * cols + 1) * 4)  # tile (2, 1)
        f.write(struct.pack("<f", float("nan")))
    assert np.isnan(load_file(file)[name][2, 1].item())

    with pytest.raises(NonFiniteScale) as err:
        convert_checkpoint(src, str(tmp_path / "refused"))
    assert name in str(err.value) and "(2, 1)" in str(err.value)
    assert err.value.exit_code == 2

    dst = str(tmp_path / "allowed")
    convert_checkpoint(src, dst, allow_nonfinite=True)
    want, _, _ = expected_output(src)
    _, got, _ = read_all(dst)
    module = name[: -len(".weight_scale_inv")]
    scale = got[f"{module}.weight_scale"]
    # rows 256..383 (tile row 2), K groups 4..7 (tile column 1): all NaN groups
    assert bool((scale[256:384, 4:8] == 0xFF).all())
    for key in (f"{module}.weight", f"{module}.weight_scale"):
        dtype, data = want[key]
        b = raw(got[key])
        same = same_e4m3_bytes(b, data) if dtype == "F8_E4M3" else (b == data)
        assert same.all(), key


# --- the pipeline: bounded memory, remote destinations, failures, no torch -----------------


def _shard_bytes(root: str) -> dict[str, bytes]:
    return {
        f: open(os.path.join(root, f), "rb").read()
        for f in sorted(os.listdir(root))
        if f.endswith(".safetensors")
    }


def test_one_tensor_window_and_memory_destination_give_the_same_files(converted) -> None:
    """A window of one byte lets one job through at a time (reader, converter and writer
    then never overlap); a ``memory://`` destination takes the sequential writer. Both
    give the files of the default run, byte for byte."""
    import fsspec

    src, dst, _ = converted("moe-tiny")
    want = _shard_bytes(dst)
    assert len(want) > 1
    url = "memory://mxload-convert-test/out"
    summary = convert_checkpoint(src, url, window_bytes=1)
    fs = fsspec.filesystem("memory")
    got = {f: fs.cat(f"{url}/{f}") for f in want}
    fs.rm("/mxload-convert-test", recursive=True)
    assert got == want
    assert set(summary["stage_seconds"]) == {"read", "convert", "write", "wait_read"}


def test_storage_failure_mid_run_names_the_range_and_leaves_no_shard(
    ckpt_factory, tmp_path, monkeypatch
) -> None:
    """Storage gone for good once the first shard is written: a StorageError naming the
    file and byte range, and no output shard left behind -- neither the one being
    written nor the one finished before the failure."""
    from mxload.orchestrator.errors import StorageError
    from mxload.orchestrator.tools import convert as convert_mod

    from tests.servers import Faults, RangeHTTPServer

    src = ckpt_factory("qwen3-moe-tiny", 5)
    dst = tmp_path / "out"
    finished: list[str] = []
    with RangeHTTPServer(src) as server:
        real_close = convert_mod.SafetensorsWriter.close

        def close_then_break_storage(self: Any) -> None:
            real_close(self)
            finished.append(self.path)
            server.faults = Faults(broken=True, broken_status=403)  # 403: not retryable

        monkeypatch.setattr(convert_mod.SafetensorsWriter, "close", close_then_break_storage)
        with pytest.raises(StorageError) as err:
            convert_checkpoint(server.url, str(dst), window_bytes=1)
    assert len(finished) == 1, "the failure must come after one whole shard was written"
    assert err.value.exit_code == 1
    assert "safetensors" in str(err.value) and "bytes" in str(err.value)
    assert not dst.exists(), "a failed convert must not create DST"
    assert os.listdir(tmp_path) == [], "nor leave its temporary folder beside it"


def _tree_bytes(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.mark.parametrize("overwrite", [False, True])
def test_failed_convert_leaves_an_earlier_conversion_byte_for_byte(
    ckpt_factory, tmp_path, monkeypatch, overwrite
) -> None:
    """DST holds a good conversion; a second convert into it fails part-way (storage gone
    after one whole shard was written). Without --overwrite it is refused before any
    read; with it, the run fails and DST is still the earlier conversion, byte for byte,
    with nothing beside it."""
    from mxload.orchestrator.errors import OutputError, StorageError
    from mxload.orchestrator.tools import convert as convert_mod

    from tests.servers import Faults, RangeHTTPServer

    dst = tmp_path / "out"
    convert_checkpoint(ckpt_factory("qwen3-moe-tiny", 7, shards=4), str(dst))
    before = _tree_bytes(str(dst))
    assert sum(f.endswith("-of-00004.safetensors") for f in before) == 4
    src = ckpt_factory("qwen3-moe-tiny", 5)
    finished: list[str] = []
    with RangeHTTPServer(src) as server:
        real_close = convert_mod.SafetensorsWriter.close

        def close_then_break_storage(self: Any) -> None:
            real_close(self)
            finished.append(self.path)
            server.faults = Faults(broken=True, broken_status=403)

        monkeypatch.setattr(convert_mod.SafetensorsWriter, "close", close_then_break_storage)
        expected = StorageError if overwrite else OutputError
        with pytest.raises(expected) as err:
            convert_checkpoint(server.url, str(dst), window_bytes=1, overwrite=overwrite)
        if not overwrite:
            assert "--overwrite" in str(err.value) and str(dst) in str(err.value)
            assert server.log == [], "a refused convert reads nothing"
    assert len(finished) == (1 if overwrite else 0)
    assert _tree_bytes(str(dst)) == before
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("where", ["local", "http-etag"])
def test_a_source_rewritten_while_converted_is_never_put_in_place(
    ckpt_factory, tmp_path, where
) -> None:
    """After the first tensor is converted, one shard of the source is overwritten in
    place by another checkpoint's (same model: same header and size, other weights), as
    a trainer saving over its last checkpoint does. convert fails naming that file (what
    load and reload say), and neither DST nor its temporary folder is left."""
    import shutil

    from mxload.orchestrator.errors import RunError

    from tests.servers import Faults, RangeHTTPServer

    src = tmp_path / "src"
    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 5), src)
    other = ckpt_factory("qwen3-moe-tiny", 6)
    shard = "model-00002-of-00002.safetensors"
    new_bytes = open(os.path.join(other, shard), "rb").read()
    assert os.path.getsize(src / shard) == len(new_bytes)
    rewritten: list[str] = []

    def rewrite_once(*_: int) -> None:
        if not rewritten:
            with open(src / shard, "r+b") as f:  # in place: same inode, same size
                f.write(new_bytes)
            rewritten.append(shard)

    dst = tmp_path / "out"
    with contextlib.ExitStack() as stack:
        url = str(src)
        if where == "http-etag":
            url = stack.enter_context(RangeHTTPServer(str(src), Faults(etag=True))).url
        with pytest.raises(RunError) as err:
            convert_checkpoint(url, str(dst), on_progress=rewrite_once)
    assert rewritten, "the source was rewritten during the run"
    msg = str(err.value)
    assert shard in msg and "changed while this run read it" in msg, msg
    assert err.value.exit_code == 1
    assert sorted(os.listdir(tmp_path)) == ["src"], "no DST, no temporary folder"


def test_overwrite_replaces_the_shard_set_whole(ckpt_factory, tmp_path) -> None:
    """Four shards, then a two-shard source with --overwrite: exactly the new set (no
    stale *-of-00004 beside the *-of-00002), equal to a fresh conversion of it."""
    dst, fresh = tmp_path / "out", tmp_path / "fresh"
    convert_checkpoint(ckpt_factory("qwen3-moe-tiny", 7, shards=4), str(dst))
    src = ckpt_factory("qwen3-moe-tiny", 5)
    convert_checkpoint(src, str(dst), overwrite=True)
    convert_checkpoint(src, str(fresh))
    assert _tree_bytes(str(dst)) == _tree_bytes(str(fresh))
    assert sorted(os.listdir(tmp_path)) == ["fresh", "out"]


def test_convert_refuses_src_and_dst_that_overlap(ckpt_factory, tmp_path) -> None:
    import shutil

    from mxload.orchestrator.errors import OutputError

    src = tmp_path / "ck"
    shutil.copytree(ckpt_factory("qwen3-dense-tiny", 5), src)
    before = _tree_bytes(str(src))
    (tmp_path / "link").symlink_to(src)
    cases = [
        (str(src), str(src), "is SRC"),
        (str(src), str(tmp_path / "link"), "is SRC"),  # through a symlink
        (str(src), f"file://{src}/", "is SRC"),
        (str(src), str(src / "sub"), "is inside SRC"),
        (str(src / "."), str(tmp_path), "contains SRC"),
    ]
    for a, b, why in cases:
        with pytest.raises(OutputError, match=why) as err:
            convert_checkpoint(a, b, overwrite=True)
        assert err.value.exit_code == 2
    assert _tree_bytes(str(src)) == before
    with pytest.raises(OutputError, match="no output may overwrite an input"):
        convert_checkpoint("memory://ck/a", "memory://ck//a/")


def test_convert_process_never_imports_torch(ckpt_factory, tmp_path) -> None:
    """The fast path is torch-free (its start-up is a third of a 2 GB conversion)."""
    import subprocess
    import sys

    src = ckpt_factory("qwen3-moe-tiny", 5)
    code = (
        "import sys, json\n"
        "from mxload.orchestrator.tools.convert import convert_checkpoint\n"
        "s = convert_checkpoint(sys.argv[1], sys.argv[2], numerics='fast')\n"
        "print(json.dumps([s['backend'], 'torch' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, src, str(tmp_path / "out")],
        check=True,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["cpu-fast", False]


def test_unknown_numerics_is_a_usage_error(ckpt_factory, tmp_path) -> None:
    from mxload.orchestrator.errors import UsageError

    with pytest.raises(UsageError, match="numerics"):
        convert_checkpoint(ckpt_factory("qwen3-moe-tiny", 5), str(tmp_path / "o"), numerics="x")


def _patched_checkpoint(base: str, dst, case: str) -> str:
    """A copy of ``base`` with one defect that plan and load refuse."""
    import shutil
    import struct

    shutil.copytree(base, dst)
    if case == "hidden-size-1e12":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["hidden_size"] = 10**12
        (dst / "config.json").write_text(json.dumps(cfg))
        return str(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    file = dst / index["weight_map"]["model.norm.weight"]
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8 : 8 + n]), blob[8 + n :]
    if case == "zero-length-norm":
        start = header["model.norm.weight"]["data_offsets"][0]
        header["model.norm.weight"].update(shape=[0], data_offsets=[start, start])
    else:
        name = {"nul-in-name": "model.a\x00b", "dotdot-in-name": "../../evil"}[case]
        header[name] = {"dtype": "U8", "shape": [4], "data_offsets": [len(data), len(data) + 4]}
        data += b"evil"
        index["weight_map"][name] = file.name
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    raw_header = json.dumps(header).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    file.write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + data)
    return str(dst)


@pytest.mark.parametrize(
    "case", ["hidden-size-1e12", "zero-length-norm", "nul-in-name", "dotdot-in-name"]
)
def test_convert_refuses_what_plan_refuses(ckpt_factory, tmp_path, case) -> None:
    """One validator: each defect is refused by plan (the planner over the catalog) and
    by convert, with the same error, and convert writes nothing."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.types import ParallelLayout

    src = _patched_checkpoint(ckpt_factory("qwen3-dense-tiny", 5), tmp_path / "src", case)
    with pytest.raises(InputError) as by_plan:
        meta = open_checkpoint(src)
        build_plan(meta.config, ParallelLayout(), checkpoint=meta)
    with pytest.raises(InputError) as by_convert:
        convert_checkpoint(src, str(tmp_path / "out"))
    assert type(by_convert.value) is type(by_plan.value)
    assert str(by_convert.value) == str(by_plan.value)
    assert by_convert.value.exit_code == 2
    assert sorted(os.listdir(tmp_path)) == ["src"], "a refused convert writes nothing"


def test_ascend_format_describes_every_tensor_and_reads_back(ckpt_factory, tmp_path) -> None:
    """--format ascend: the same tensors, vllm-ascend's description instead of a
    quantization_config (its field names read from vllm-ascend 0.23.0.post1's
    modelslim_config.py; tests/engine/test_quant_dispatch.py runs its dispatch on it)."""
    preset, overrides = CASES["awkward-k"]
    src = ckpt_factory(preset, 5, overrides=overrides)
    dst = str(tmp_path / "ascend")
    convert_checkpoint(src, dst, fmt="ascend")
    config, got, _ = read_all(dst)
    assert "quantization_config" not in config
    with open(os.path.join(dst, "quant_model_description.json")) as f:
        desc = json.load(f)
    assert desc["group_size"] == 32
    for name in got:
        if name.endswith("_scale"):
            continue
        want = "W8A8_MXFP8" if f"{name}_scale" in got else "FLOAT"
        assert desc[name] == want, name
    assert desc["model.embed_tokens.weight"] == desc["model.layers.1.mlp.gate.weight"] == "FLOAT"
    assert desc["model.layers.1.mlp.experts.0.down_proj.weight"] == "FLOAT"  # K = 80
    meta = open_checkpoint(dst)
    assert meta.config.quant.kind == "mxfp8"
    # A scheme mxload does not read is refused, naming the tensor.
    desc["model.layers.0.self_attn.o_proj.weight"] = "W4A8_DYNAMIC"
    with open(os.path.join(dst, "quant_model_description.json"), "w") as f:
        json.dump(desc, f)
    with pytest.raises(UnsupportedError, match=r"o_proj\.weight.*W4A8_DYNAMIC"):
        open_checkpoint(dst)


def test_an_ascend_description_that_contradicts_its_tensors_is_refused(
    ckpt_factory, tmp_path, capsys
) -> None:
    """A quant_model_description.json entry that says FLOAT over an MXFP8 weight (with its
    weight_scale), or W8A8_MXFP8 over a BF16 one: every command that opens the checkpoint
    refuses it naming the tensor and what it holds (exit 2), before a plan is made."""
    from mxload.orchestrator.cli import main
    from mxload.orchestrator.errors import CheckpointError

    dst = str(tmp_path / "ascend")
    convert_checkpoint(ckpt_factory("qwen3-dense-tiny", 5), dst, fmt="ascend")
    path = os.path.join(dst, "quant_model_description.json")
    with open(path) as f:
        good = json.load(f)
    for tensor, described, held in (
        ("model.layers.0.self_attn.o_proj.weight", "FLOAT", "F8_E4M3 with"),
        ("model.embed_tokens.weight", "W8A8_MXFP8", "BF16"),
    ):
        assert good[tensor] != described
        with open(path, "w") as f:
            json.dump({**good, tensor: described}, f)
        with pytest.raises(CheckpointError) as err:
            open_checkpoint(dst)
        msg = str(err.value)
        assert f"{tensor} is described {described}" in msg and f"holds it as {held}" in msg
        assert main(["plan", dst, "--tp", "1"]) == 2
        assert tensor in capsys.readouterr().err


@pytest.mark.parametrize(
    "engine,fmt", [("vllm-ascend-main", "modelopt"), ("mxload", "ascend")], ids=["main", "ascend"]
)
def test_deepseek_kv_b_proj_stays_in_model_dtype_in_every_layer_mtp_included(
    ckpt_factory, tmp_path, engine, fmt
) -> None:
    """vllm-ascend's MLA requires kv_b_proj unquantized: for a vllm-ascend engine, and for
    its --format ascend whatever --engine names, in the decoder layers and in the MTP layer
    after them (layer num_hidden_layers), each written resolved and ignored."""
    src = ckpt_factory("deepseek-v3-tiny", 5)
    with open(os.path.join(src, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    dst = str(tmp_path / "out")
    convert_checkpoint(src, dst, engine=engine, fmt=fmt)
    if fmt == "ascend":
        with open(os.path.join(dst, "quant_model_description.json")) as f:
            described = json.load(f)
        kvb = [n for n in described if n.endswith("self_attn.kv_b_proj.weight")]
        assert len(kvb) == layers + 1 and {described[n] for n in kvb} == {"FLOAT"}, kvb
        return
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    kvb = sorted(n for n in weight_map if n.endswith("self_attn.kv_b_proj.weight"))
    assert f"model.layers.{layers}.self_attn.kv_b_proj.weight" in kvb, kvb  # the MTP layer
    for name in kvb:
        with safe_open(os.path.join(dst, weight_map[name]), "pt") as f:
            assert f.get_slice(name).get_dtype() == "BF16", name
        assert name.replace(".weight", ".weight_scale") not in weight_map, name
    with open(os.path.join(dst, "config.json")) as f:
        ignored = set(json.load(f)["quantization_config"]["ignore"])
    assert {n.removesuffix(".weight") for n in kvb} <= ignored
    # the MTP layer's eh_proj: vLLM's DeepSeekMTP holds a plain nn.Linear (no quant_config)
    eh_proj = f"model.layers.{layers}.eh_proj"
    with safe_open(os.path.join(dst, weight_map[eh_proj + ".weight"]), "pt") as f:
        assert f.get_slice(eh_proj + ".weight").get_dtype() == "BF16"
    assert eh_proj + ".weight_scale" not in weight_map and eh_proj in ignored


def test_deepseek_kv_b_proj_quantized_for_plain_vllm(ckpt_factory, tmp_path) -> None:
    """Plain vLLM (the default profile) holds kv_b_proj as MXFP8 like every other linear,
    so the ModelOpt output quantizes it and does not ignore it."""
    src = ckpt_factory("deepseek-v3-tiny", 5)
    dst = str(tmp_path / "out")
    convert_checkpoint(src, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    kvb = sorted(n for n in weight_map if n.endswith("self_attn.kv_b_proj.weight"))
    assert kvb
    for name in kvb:
        with safe_open(os.path.join(dst, weight_map[name]), "pt") as f:
            assert f.get_slice(name).get_dtype() == "F8_E4M3", name
        assert name.replace(".weight", ".weight_scale") in weight_map, name
    with open(os.path.join(dst, "config.json")) as f:
        ignored = set(json.load(f)["quantization_config"]["ignore"])
    assert not {n.removesuffix(".weight") for n in kvb} & ignored


def test_convert_for_a_release_that_serves_only_ascend_writes_ascend(ckpt_factory, tmp_path):
    """No --format: ModelOpt, unless --engine names a release that cannot serve it
    (vllm-ascend 0.23.0.post1 refuses modelopt_mxfp8 at start)."""
    src = ckpt_factory("qwen3-dense-tiny", 5)
    convert_checkpoint(src, str(tmp_path / "a"), engine="vllm-ascend-0.23.0.post1")
    assert (tmp_path / "a" / "quant_model_description.json").is_file()
    with open(tmp_path / "a" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    convert_checkpoint(src, str(tmp_path / "m"))
    assert not (tmp_path / "m" / "quant_model_description.json").exists()


def test_an_ascend_form_output_converts_again_to_the_same_tensors(ckpt_factory, tmp_path):
    """The ascend form has no quantization_config (its description file says it all):
    converting it again, to ModelOpt, gives the same tensors, byte for byte."""
    src = ckpt_factory("qwen3-dense-tiny", 5)
    a, m = str(tmp_path / "a"), str(tmp_path / "m")
    convert_checkpoint(src, a, fmt="ascend")
    convert_checkpoint(a, m)
    with open(os.path.join(m, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "modelopt"
    for name in sorted(os.listdir(a)):
        if name.endswith(".safetensors"):
            x, y = load_file(os.path.join(a, name)), load_file(os.path.join(m, name))
            assert set(x) == set(y), name
            for t in x:
                assert torch.equal(x[t].view(torch.uint8), y[t].view(torch.uint8)), t
