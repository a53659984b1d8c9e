"""Hostile inputs, in-process through the CLI's ``main()``: every one is refused in one
line with exit status 2, naming what is wrong, with no traceback, no wait and nothing
written (docs/contract.md §5). Tables, so a case costs one row and no Ray start."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

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
