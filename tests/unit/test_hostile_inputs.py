"""Hostile inputs, in-process through the CLI's ``main()``: every one is refused in one
line with exit status 2, naming what is wrong, with no traceback, no wait and nothing
written (docs/contract.md §5). Tables, so a case costs one row and no Ray start."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.cli.commands import main

RECORD = {
    "address": "127.0.0.1:1",
    "temp_dir": "/nonexistent/mxhead-x",
    "resource": "NPU",
    "num_devices": 1,
    "started_at": 0.0,
    "token": "t",
    "processes": [],
}


def _write(text: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(text)


HEAD_RECORDS: list[tuple[str, Callable[[Path], None]]] = [
    ("a folder", lambda path: path.mkdir()),
    ("a FIFO", lambda path: os.mkfifo(path)),  # read as a file, it blocks for ever
    ("not JSON", _write("{half")),
    ("a JSON list", _write("[1]")),
    ("an address that is a number", _write(json.dumps({**RECORD, "address": 5}))),
    ("a start time that is text", _write(json.dumps({**RECORD, "started_at": "x"}))),
    ("processes that are numbers", _write(json.dumps({**RECORD, "processes": [5]}))),
]


@pytest.mark.parametrize(("what", "make"), HEAD_RECORDS, ids=[w for w, _ in HEAD_RECORDS])
@pytest.mark.parametrize("command", [["status"], ["release"], ["reload", "/nonexistent"]])
def test_a_head_record_mxload_did_not_write_is_named(
    what: str,
    make: Callable[[Path], None],
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    make(home / "head.json")
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    assert main(command) == 2, what
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(home / "head.json") in err, err
    assert os.path.lexists(home / "head.json")  # nothing removed: it may be someone's


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def unused(**tensor: Any) -> dict[str, Any]:
    return {"name": "extra.weight", "dtype": "bfloat16"} | tensor


def good_manifest() -> dict[str, Any]:
    """FSDP over 2 of qwen3-dense-tiny as tp2 x dp2 + EP needs it: planned as it is."""
    from mxload.orchestrator.plan.config import parse_config
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.refit import needed_shapes
    from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.tools.synth import preset_config

    cfg = parse_config(preset_config("qwen3-dense-tiny"), "qwen3-dense-tiny")
    plan = build_plan(cfg, ParallelLayout(tp=2, dp=2, enable_expert_parallel=True))
    return manifest_to_json(fsdp_manifest(needed_shapes(plan), 2))


def _extra(**tensor: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["tensors"].append(unused(**tensor))


MANIFESTS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # a world no trainer has: every per-sender table of the walk would take it
    ("a world of 10^12 ranks", lambda m: m.update(world=10**12), "world"),
    # an unused tensor is still summed into the trainer's save: no float holds its bytes
    ("a tensor of 10^400 bytes", _extra(shape=[10**200] * 2, placement=[{"rank": 0}]), "extra"),
    ("a node below 0", lambda m: m.update(nodes=[0, -1]), "node"),
    # names a checkpoint may not have: the table prints them (a terminal's escapes)
    (
        "a name with an escape",
        _extra(name="x\x1b[2J", shape=[4], placement=[{"rank": 0}]),
        "control",
    ),
    ("an empty name", _extra(name="", shape=[4], placement=[{"rank": 0}]), "empty"),
]


@pytest.mark.parametrize(("what", "spoil", "named"), MANIFESTS, ids=[w for w, _, _ in MANIFESTS])
def test_a_manifest_no_trainer_has_is_refused(
    what: str,
    spoil: Callable[[dict[str, Any]], None],
    named: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mxload.orchestrator.tools.synth import preset_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(preset_config("qwen3-dense-tiny")))
    data = good_manifest()
    spoil(data)
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(data))
    argv = ["plan", "--config", str(config), "--tp", "2", "--dp", "2"]
    err = refused(capsys, [*argv, "--enable-expert-parallel", "--from-trainer", str(path)])
    assert str(path) in err and named in err, err


def test_megatron_holds_the_moe_gates_whole_on_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Megatron replicates the router and the shared expert's gate over its TP ranks (only
    linears are split): megatron:N plans Qwen3.5-MoE, whose shared_expert_gate has 1 row."""
    from mxload.orchestrator.plan.trainer import megatron_manifest
    from mxload.orchestrator.tools.synth import preset_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(preset_config("qwen3.5-moe-tiny")))
    argv = ["plan", "--config", str(config), "--tp", "2", "--from-trainer", "megatron:2"]
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    shapes = {
        "model.layers.0.mlp.gate.weight": (8, 64),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 64),
        "model.layers.0.mlp.shared_expert.gate_proj.weight": (64, 64),
    }
    held = {t.name: t.placement for t in megatron_manifest(shapes, 2).tensors}
    assert [s.dim for s in held["model.layers.0.mlp.gate.weight"]] == [None, None]
    assert [s.dim for s in held["model.layers.0.mlp.shared_expert_gate.weight"]] == [None, None]
    assert [s.dim for s in held["model.layers.0.mlp.shared_expert.gate_proj.weight"]] == [0, 0]


SESSION_RECORDS: list[tuple[str, Callable[[Path], None]]] = [
    ("a JSON list", _write("[1]")),
    ("a FIFO", lambda path: os.mkfifo(path)),
    ("a folder", lambda path: path.mkdir()),
]


@pytest.mark.parametrize(("what", "make"), SESSION_RECORDS, ids=[w for w, _ in SESSION_RECORDS])
def test_release_of_a_dead_head_passes_over_session_records_it_cannot_read(
    what: str,
    make: Callable[[Path], None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A head recorded at a port nothing listens on is down: `release` ends it without
    Ray, reading its sessions' records; one that is no record is passed over, not a
    traceback or a wait, and left where it is."""
    home = tmp_path / "home"
    (home / "sessions").mkdir(parents=True)
    (home / "head.json").write_text(json.dumps(RECORD))
    make(home / "sessions" / "x.json")
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    assert main(["release", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["sessions_removed"] == []
    assert os.path.lexists(home / "sessions" / "x.json") and not (home / "head.json").exists()


def test_an_error_log_never_goes_through_a_link_in_place_of_the_logs_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$MXLOAD_HOME/logs a link to a shared folder: the log of a failed run is not
    written there and the folder's mode is not made 0700 (it would lock others out)."""
    from mxload.orchestrator.cli.commands import write_error_log

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / "logs").symlink_to(shared)
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    assert write_error_log(RuntimeError("boom"), ["status"]) is None
    assert shared.stat().st_mode & 0o777 == 0o755 and not list(shared.iterdir())
    (home / "logs").unlink()  # a real folder: the log is written, private
    path = write_error_log(RuntimeError("boom"), ["status"])
    assert path is not None and Path(path).stat().st_mode & 0o777 == 0o600


def test_equal_placements_of_a_manifest_file_are_parsed_into_one() -> None:
    """The checks and the refit walk do their work once per placement object: a manifest
    read from a file must share them as fsdp:N does, and still check each as written."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.plan.trainer import manifest_from_json

    half = [
        {"rank": 0, "dim": 0, "start": 0, "stop": 2},
        {"rank": 1, "dim": 0, "start": 2, "stop": 4},
    ]
    tensors = [
        {
            "name": f"t{i}",
            "shape": [4, 4],
            "dtype": "bfloat16",
            "placement": json.loads(json.dumps(half)),
        }
        for i in range(3)
    ]
    m = manifest_from_json({"world": 2, "tensors": tensors})
    assert m.tensors[0].placement is m.tensors[1].placement is m.tensors[2].placement
    tensors.append({"name": "b", "shape": [4], "dtype": "bfloat16", "placement": [{"rank": True}]})
    tensors.insert(0, {"name": "a", "shape": [4], "dtype": "bfloat16", "placement": [{"rank": 1}]})
    with pytest.raises(InputError, match="'b' placement rank must be an integer, not True"):
        manifest_from_json({"world": 2, "tensors": tensors})


def test_a_rank_placed_twice_in_one_tensor_is_refused() -> None:
    """A rank sends one local tensor per name: two slices of one tensor on one rank
    would both be sent from it, and one half would land as the other (it did)."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.plan.trainer import manifest_from_json

    halves = [
        {"rank": 0, "dim": 0, "start": 0, "stop": 2},
        {"rank": 0, "dim": 0, "start": 2, "stop": 4},
    ]
    tensor = {"name": "w", "shape": [4, 4], "dtype": "bfloat16", "placement": halves}
    with pytest.raises(InputError, match="'w': rank 0 is placed twice"):
        manifest_from_json({"world": 1, "tensors": [tensor]})
    whole_twice = {**tensor, "placement": [{"rank": 0}, {"rank": 0}]}
    with pytest.raises(InputError, match="rank 0 is placed twice"):
        manifest_from_json({"world": 1, "tensors": [whole_twice]})


TRAINER_SPELLINGS = [
    ("megatron:8", "heads (4)"),  # qwen3-dense-tiny: 4 heads, 2 KV heads
    ("megatron:4", "KV heads (2)"),
    ("fsdp:\u0663", "fsdp:N"),  # an Arabic-Indic 3: a digit to str.isdigit, no rank count
]


@pytest.mark.parametrize(("source", "named"), TRAINER_SPELLINGS)
def test_a_trainer_no_framework_builds_is_refused(
    source: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mxload.orchestrator.tools.synth import preset_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(preset_config("qwen3-dense-tiny")))
    err = refused(capsys, ["plan", "--config", str(config), "--from-trainer", source])
    assert "--from-trainer" in err and named in err, err


def test_a_home_that_is_a_file_records_no_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    home.write_text("")
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    err = refused(capsys, ["status"])
    assert "no detached session here" in err and str(home) in err, err
