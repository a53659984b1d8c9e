"""``mxload sessions`` lists what $MXLOAD_HOME records (orchestrator/runtime/listing.py),
in-process, from record files in the formats ``load --detach`` writes (head.json:
cluster/local.py ``HeadRecord``; sessions/<name>.json: address and processes), with no Ray."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from mxload.cluster.local import describe_processes
from mxload.orchestrator.cli.commands import main


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def listener() -> Iterator[str]:
    """Something listening on loopback, as a head's GCS port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def mxload(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _write_home(home: Path, address: str) -> None:
    me = [dict(p) for p in describe_processes([psutil.Process(os.getpid())])]
    head = {
        "address": address,
        "temp_dir": str(home / "ray"),
        "resource": "NPU",
        "num_devices": 4,
        "started_at": time.time(),
        "processes": [{**me[0], "role": "gcs_server"}, {**me[0], "role": "raylet"}],
    }
    (home / "sessions").mkdir(parents=True)
    (home / "head.json").write_text(json.dumps(head))
    gone = {"pid": os.getpid(), "created": 1.0, "start_ticks": 1, "role": "worker"}
    (home / "sessions" / "default.json").write_text(
        json.dumps({"session": "default", "address": address, "processes": [*me, gone]})
    )
    (home / "sessions" / "old.json").write_text(
        json.dumps({"session": "old", "address": "127.0.0.1:1", "processes": [gone]})
    )
    (home / "sessions" / "torn.json").write_text("{not json")


def test_lists_the_head_and_sessions(
    home: Path, listener: str, mxload: Callable[..., tuple[int, str, str]]
) -> None:
    _write_home(home, listener)
    rc, out, err = mxload("sessions", "--json")
    doc = json.loads(out)
    assert rc == 0 and err == ""
    assert doc["home"] == str(home)
    assert (doc["head"]["address"], doc["head"]["state"]) == (listener, "up")
    by = {s["session"]: s for s in doc["sessions"]}
    assert set(by) == {"default", "old", "torn"}
    assert (by["default"]["running"], by["default"]["processes"]) == (1, 2)
    assert by["default"]["on_recorded_head"] is True
    assert (by["old"]["on_recorded_head"], by["old"]["running"]) == (False, 0)
    assert by["torn"]["unreadable"].endswith("torn.json")
    rc, out, _ = mxload("sessions")
    assert rc == 0
    assert f"head {listener}, 4 NPU" in out and ": up" in out
    assert "session default: head" in out and "1 of 2 processes running" in out
    assert "(not the recorded head)" in out and "record unreadable" in out


def test_a_dead_head_is_said_without_waiting(
    home: Path, mxload: Callable[..., tuple[int, str, str]]
) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    _write_home(home, address)
    rc, out, _ = mxload("sessions", "--json")
    head = json.loads(out)["head"]
    assert rc == 0 and head["state"] == "down"
    assert any("nothing listens" in w for w in head["why"])


def test_an_empty_home(home: Path, mxload: Callable[..., tuple[int, str, str]]) -> None:
    rc, out, _ = mxload("sessions")
    assert rc == 0
    assert "no head recorded" in out and "no sessions recorded" in out
    assert not home.exists(), "listing creates nothing"
