"""``mxload plan --from-trainer``, in-process through the CLI's ``main()``: the transfer
plan beside the storage round trip, and every refusal as one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.cli.commands import main
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.refit import needed_shapes
from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.tools.synth import preset_config

LAYOUT = ["--tp", "2", "--dp", "2", "--enable-expert-parallel"]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset_config("qwen3-dense-tiny")))
    return path


def manifest_json(**over: Any) -> dict[str, Any]:
    cfg = parse_config(preset_config("qwen3-dense-tiny"), "qwen3-dense-tiny")
    plan = build_plan(cfg, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True))
    return manifest_to_json(fsdp_manifest(needed_shapes(plan), 2, **over))


def plan(config: Path, *extra: str) -> list[str]:
    return ["plan", "--config", str(config), *LAYOUT, *extra]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_the_transfer_plan_beside_the_storage_round_trip(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(plan(config, "--from-trainer", "fsdp:2", "--device", "npu", "--json")) == 0
    r = json.loads(capsys.readouterr().out)["refit"]
    assert r["trainer_world"] == 2 and r["convert_on"] == "receiver"
    assert r["trainer_link"] == "hccl"
    assert r["wire_bytes"] == r["needed_bytes"] == sum(k["bytes"] for k in r["links"])
    assert [x["rank"] for x in r["receivers"]] == [0, 1, 2, 3]
    # the second data-parallel replica on the node copies all it holds from the first
    assert all(x["peak_staging_bytes"] > 0 for x in r["receivers"][:2])
    assert all(x["landing_bytes"] == x["peak_staging_bytes"] == 0 for x in r["receivers"][2:])
    assert sum(r["fanout_bytes"]) > 0
    assert all(s["staging_bytes"] <= 2 * r["bucket_bytes"] for s in r["senders"])
    trip = r["storage_round_trip"]
    assert trip["predicted_seconds"] == pytest.approx(
        trip["save_seconds"] + trip["reload_seconds"], abs=1e-3
    )
    assert 0 < r["predicted_seconds"] < trip["predicted_seconds"]
    # Without the node fan-out every rank receives all it needs: the four ranks' needs
    # added up (two data-parallel replicas on the one node).
    cfg = parse_config(preset_config("qwen3-dense-tiny"), "qwen3-dense-tiny")
    held = build_plan(cfg, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True), device="npu")
    each = [
        {(p.tensor_name, p.rows, p.cols): p.nrows * p.ncols * 2 for u in rk.units for p in u.parts}
        for rk in held.ranks
    ]
    direct = r["without_fanout"]
    assert direct["link_bytes"] == sum(sum(e.values()) for e in each) > r["wire_bytes"]
    # the same manifest from a file: the same plan
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(manifest_json(devices_per_node=16)))
    assert main(plan(config, "--from-trainer", str(path), "--device", "npu", "--json")) == 0
    again = json.loads(capsys.readouterr().out)["refit"]
    assert again["manifest_digest"] == r["manifest_digest"]
    assert again["links"] == r["links"] and again["receivers"] == r["receivers"]
    # converted on the sender: MXFP8 on the wire, 33/64 of the MX bytes
    args = ["--from-trainer", "fsdp:2", "--convert-on", "sender", "--bucket-size", "64KiB"]
    assert main(plan(config, *args, "--json")) == 0
    s = json.loads(capsys.readouterr().out)["refit"]
    assert s["mx_wire_bytes"] * 64 == s["mx_needed_bytes"] * 33
    assert s["bucket_bytes"] == 64 << 10
    assert all(x["staging_bytes"] <= 128 << 10 for x in s["senders"])
    # the table says it in words
    assert main(plan(config, "--from-trainer", "fsdp:2", "--trainer-link", "gloo")) == 0
    out = capsys.readouterr().out
    assert "predicted refit" in out and "storage round trip of the same bytes" in out
    assert "link gloo" in out and "device buffers" not in out
    # a device link is priced at its rate, its two copies per message said, not priced
    assert main(plan(config, "--from-trainer", "fsdp:2", "--trainer-link", "nccl")) == 0
    out = capsys.readouterr().out
    assert "link nccl: priced at the link's rate" in out and "through device buffers" in out


def test_a_bad_manifest_is_one_line_naming_the_file_and_tensor(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trainer.json"
    data = manifest_json()
    name = "model.layers.1.mlp.down_proj.weight"
    (t,) = [t for t in data["tensors"] if t["name"] == name]
    t["placement"][1]["start"] += 1  # a gap
    path.write_text(json.dumps(data))
    err = refused(capsys, plan(config, "--from-trainer", str(path)))
    assert str(path) in err and name in err and "gap" in err
    # a tensor the engine needs that the trainer does not list
    data = manifest_json()
    data["tensors"] = [t for t in data["tensors"] if t["name"] != name]
    path.write_text(json.dumps(data))
    err = refused(capsys, plan(config, "--from-trainer", str(path)))
    assert str(path) in err and name in err and "engine rank" in err
    path.write_text("{not json")
    assert str(path) in refused(capsys, plan(config, "--from-trainer", str(path)))
    missing = tmp_path / "nope.json"
    assert str(missing) in refused(capsys, plan(config, "--from-trainer", str(missing)))


def test_a_cut_the_sender_cannot_convert_is_refused_naming_tensor_and_rank(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    data = manifest_json()
    (t,) = [t for t in data["tensors"] if t["name"] == name]
    t["placement"] = [
        {"rank": 0, "dim": 1, "start": 0, "stop": 144},
        {"rank": 1, "dim": 1, "start": 144, "stop": 256},
    ]
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(data))
    err = refused(capsys, plan(config, "--from-trainer", str(path), "--convert-on", "sender"))
    assert str(path) in err and name in err and "engine rank 1" in err
    assert main(plan(config, "--from-trainer", str(path), "--convert-on", "receiver")) == 0
    capsys.readouterr()


def test_refit_flags_without_a_trainer_and_links_that_cannot_carry_it(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag, value in (("--convert-on", "sender"), ("--trainer-link", "gloo")):
        err = refused(capsys, plan(config, flag, value))
        assert flag in err and "--from-trainer" in err
    err = refused(capsys, plan(config, "--from-trainer", "fsdp:0"))
    assert "fsdp:0" in err
    # shared memory stays within a node: two nodes of two engine ranks are refused
    args = ["--from-trainer", "fsdp:2", "--trainer-link", "shm", "--devices-per-node", "2"]
    err = refused(capsys, plan(config, *args))
    assert "--trainer-link shm" in err and "between nodes" in err
    for size in ("100B", "17GiB"):  # the trainer form's range, 1 KiB..16 GiB
        err = refused(capsys, plan(config, "--from-trainer", "fsdp:2", "--bucket-size", size))
        assert "--bucket-size" in err and "1KiB..16GiB" in err
    err = refused(capsys, plan(config, "--from-trainer", "fsdp:2", "--bucket-size", "0B"))
    assert "--bucket-size" in err
    assert "--from-trainer" in refused(capsys, plan(config, "--from-trainer", ""))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout", "most"),
    [
        ("qwen3-235b-a22b-fp8", ["--tp", "8", "--dp", "8", "--enable-expert-parallel"], 5.0),
        ("qwen3.8-27b-fp8", ["--tp", "8", "--dp", "8"], 2.0),
    ],
)
def test_on_paper_refits_of_real_models(
    model: str,
    layout: list[str],
    most: float,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # docs/time-model.md "Refit": FSDP over 64 trainer ranks -> 64 engine ranks, 16 a
    # node, hccl at the default 25 GB/s a node; a prediction, not a measured time.
    argv = ["plan", "--model", model, *layout, "--device", "npu", "--from-trainer", "fsdp:64"]
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["refit"]
    assert r["wire_bytes"] == r["needed_bytes"]
    assert r["predicted_seconds"] <= most < r["storage_round_trip"]["predicted_seconds"]
    # the copies pay for themselves: the links carry less, and the refit is faster
    assert r["predicted_seconds"] < r["without_fanout"]["predicted_seconds"]
