"""The engine's KV cache beside the weights (orchestrator/plan/kvcache.py) and ``plan``'s
verdict with vLLM's memory knobs, in-process. The page and state sizes themselves are
checked against vLLM's own spec classes in tests/engine/test_vllm_kv_cache.py; here the
arithmetic is written out from the model's numbers."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from mxload.orchestrator.cli.commands import main
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.kvcache import ServeKnobs, geometry, kv_room
from mxload.orchestrator.runtime.models import model_config

MiB = 1 << 20


@pytest.fixture
def mxload(
    capsys: pytest.CaptureFixture[str], tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path))

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_full_attention_room_in_blocks() -> None:
    """Qwen3-32B at tp 4 on an NPU: 8 kv heads / 4 = 2 per rank, head_dim 128, bf16: a
    token of a layer is 2 x (128 + 128) x 2 = 1024 B; a block (128 tokens) of all 64
    layers 8 MiB; a request of 40960 tokens 320 blocks, beside the null block."""
    cfg = parse_config(model_config("qwen3-32b-fp8"))
    g = geometry(cfg, range(64), 4, ServeKnobs(), "npu")
    assert g is not None and (g.block_size, g.page_bytes, g.block_bytes) == (
        128,
        128 << 10,
        8 * MiB,
    )
    knobs = ServeKnobs()
    one = kv_room(g, 321 * 8 * MiB, 40960, knobs, 40960)
    assert (one.bytes_per_sequence, one.largest_batch, one.largest_context) == (
        320 * 8 * MiB,
        1,
        40960,
    )
    short = kv_room(g, 321 * 8 * MiB - 1, 40960, knobs, 40960)
    assert short.largest_batch == 0 and not short.fits
    assert short.largest_context == 319 * 128  # 319 whole blocks beside the null block
    many = kv_room(g, 10_000 * 8 * MiB, 40960, ServeKnobs(max_num_seqs=5), 40960)
    assert many.largest_batch == 5, "at most --max-num-seqs"
    fp8 = geometry(cfg, range(64), 4, ServeKnobs(kv_cache_dtype="fp8"), "npu")
    assert fp8 is not None and fp8.block_bytes == 4 * MiB


def test_pipeline_stage_holds_its_layers_only() -> None:
    cfg = parse_config(model_config("qwen3-32b-fp8"))
    whole = geometry(cfg, range(64), 1, ServeKnobs(), "cuda")
    half = geometry(cfg, range(32), 1, ServeKnobs(), "cuda")
    assert whole is not None and half is not None
    assert (whole.block_size, half.block_bytes * 2) == (16, whole.block_bytes)
    assert geometry(cfg, (), 1, ServeKnobs(), "cuda") is None


def test_weights_fit_but_no_request_of_max_model_len_exits_3(
    mxload: Callable[..., tuple[int, str, str]],
) -> None:
    rc, out, _ = mxload(
        "plan", "--model", "qwen3.8-27b-fp8", "--tp", "4", "--device-memory", "8GiB"
    )
    last = out.strip().splitlines()[-1]
    assert rc == 3, out
    assert last.startswith("DOES NOT FIT: the weights fit 8.00 GiB, but rank 0's KV cache")
    assert "--max-model-len 262144" in last and "--gpu-memory-utilization" in last
    rc, out, _ = mxload(
        "plan", "--model", "qwen3.8-27b-fp8", "--tp", "4", "--device-memory", "8GiB", "--json"
    )
    doc = json.loads(out)
    assert rc == 3 and doc["fits"] is False and doc["kv_cache"]["fits"] is False
    assert all(r["peak_bytes"] <= 8 << 30 for r in doc["ranks"]), "the weights do fit"


def test_kv_room_is_utilization_of_the_device_less_the_peak(
    mxload: Callable[..., tuple[int, str, str]],
) -> None:
    argv = ["plan", "--model", "qwen3.8-27b-fp8", "--tp", "4", "--device-memory", "64GiB"]
    rc, out, _ = mxload(*argv, "--max-model-len", "4096", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["fits"] is True
    kv = doc["kv_cache"]
    assert (kv["kind"], kv["max_model_len"], kv["gpu_memory_utilization"]) == (
        "hybrid",
        4096,
        0.92,
    )
    for r in doc["ranks"]:
        assert r["kv_cache"]["room_bytes"] == int(0.92 * (64 << 30)) - r["peak_bytes"]
        assert r["kv_cache"]["largest_batch"] == 128, "--max-num-seqs caps it"
    rc, out, _ = mxload(*argv, "--max-model-len", "32768")
    assert out.strip().splitlines()[-1].startswith("FITS: the weights and a KV cache of ")
    # less of the device for the engine: less room, and the verdict names the knob
    rc, out, _ = mxload(*argv, "--gpu-memory-utilization", "0.1")
    assert rc == 3 and "leaves no KV cache under --gpu-memory-utilization 0.1" in out


def test_vllm_spellings_of_the_layout_flags(mxload: Callable[..., tuple[int, str, str]]) -> None:
    base = ["plan", "--model", "qwen3-30b-a3b-fp8", "--json"]
    _, ours, _ = mxload(*base, "--tp", "2", "--dp", "2", "--enable-expert-parallel")
    for spelled in (
        ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--enable-expert-parallel"],
        ["-tp", "2", "-dp", "2", "-ep"],
        [
            "--tensor-parallel-size=2",
            "--data-parallel-size=2",
            "-ep",
            "--pipeline-parallel-size",
            "1",
        ],
    ):
        rc, out, _ = mxload(*base, *spelled)
        assert rc == 0 and json.loads(out)["parallel"] == json.loads(ours)["parallel"], spelled


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--max-num-seqs", "-1"], "--max-num-seqs"),
        (["--block-size", "0"], "--block-size"),
        (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
        (["--tensor-parallel-size", "0"], "--tp"),
        (["--max-model-len", "40961"], "--max-model-len"),  # above max_position_embeddings
    ],
)
def test_knob_refusals(
    mxload: Callable[..., tuple[int, str, str]], argv: list[str], flag: str
) -> None:
    for memory in (["--device-memory", "64GiB"], []):  # checked whether or not sized
        rc, out, err = mxload("plan", "--model", "qwen3-32b-fp8", *memory, *argv)
        assert rc == 2 and out == "", (rc, out)
        assert err.startswith("mxload: error: ") and flag in err and len(err.splitlines()) == 1, err


def test_a_config_without_a_length_takes_vllms_default() -> None:
    from mxload.orchestrator.plan.kvcache import max_model_len

    raw = dict(model_config("qwen3-32b-fp8"))
    raw.pop("max_position_embeddings")
    cfg = parse_config(raw)
    assert max_model_len(cfg, ServeKnobs()) == 2048  # vLLM's _get_and_verify_max_len
    assert max_model_len(cfg, ServeKnobs(max_model_len=100_000)) == 100_000


def test_an_mtp_drafter_shares_the_pool(mxload: Callable[..., tuple[int, str, str]]) -> None:
    """With --speculative-config MTP the drafter's one full-attention layer joins the
    16 of Qwen3.8-27B (groups of 17 layers), and a request keeps more GDN states."""
    argv = ["plan", "--model", "qwen3.8-27b-fp8", "--tp", "4", "--device-memory", "64GiB", "--json"]
    _, plain, _ = mxload(*argv)
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    _, out, _ = mxload(*argv, "--speculative-config", spec)
    kv0, kv = json.loads(plain)["kv_cache"], json.loads(out)["kv_cache"]
    assert kv0["block_bytes"] == 16 * kv0["page_bytes"]
    assert kv["block_bytes"] == 17 * kv["page_bytes"]
    seq0 = json.loads(plain)["ranks"][0]["kv_cache"]["bytes_per_sequence"]
    seq = json.loads(out)["ranks"][0]["kv_cache"]["bytes_per_sequence"]
    assert seq > seq0
