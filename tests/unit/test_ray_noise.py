"""Ray's own tracebacks and warnings never reach the terminal of a normal run: they go
to a file under $MXLOAD_HOME/logs (cluster/local.py ``route_ray_output``), in-process and
without starting Ray. The two ways Ray's driver speaks are used as Ray uses them: its
``ray`` loggers (an unhandled task error is ``logger.error`` in ``ray._private.worker``)
and ``print_to_stdstream``, which its error-listener thread calls for the raylet's
"A worker died or was killed" messages."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from mxload.cluster import local


@pytest.fixture
def routed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    import ray._private.worker as worker

    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)
    monkeypatch.setattr(local, "_RAY_LOG", None)
    ray_logger = logging.getLogger("ray")
    saved = (list(ray_logger.handlers), ray_logger.propagate, ray_logger.level)
    try:
        from mxload.orchestrator.cli.commands import configure_logging

        configure_logging(debug=False, verbose=False)  # what main() does first
        yield tmp_path / "home"
    finally:
        for h in list(ray_logger.handlers):
            ray_logger.removeHandler(h)
        for h in saved[0]:
            ray_logger.addHandler(h)
        ray_logger.propagate, _ = saved[1], ray_logger.setLevel(saved[2])


def test_ray_messages_go_to_the_log_not_the_terminal(
    routed: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import ray._private.worker as worker

    assert local.ray_log_path() is None, "nothing said yet: no file"
    logging.getLogger("ray._private.worker").error(
        "Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): ValueError: boom"
    )
    worker.print_to_stdstream(
        {"lines": ["A worker died or was killed while executing a task"], "pid": "raylet",
         "is_err": False},
        ignore_prefix=False,
    )  # fmt: skip
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    path = local.ray_log_path()
    assert path is not None and Path(path).parent == routed / "logs"
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = Path(path).read_text()
    assert "Unhandled error" in text and "ValueError: boom" in text
    assert "(raylet) A worker died or was killed" in text


def test_a_failed_runs_traceback_log_names_what_ray_said(routed: Path) -> None:
    from mxload.orchestrator.cli.commands import write_error_log

    logging.getLogger("ray").error("something Ray says")
    ray_log = local.ray_log_path()
    assert ray_log is not None
    path = write_error_log(RuntimeError("lost"), ["load", "SRC"])
    assert path is not None and f"--- what Ray said: {ray_log} ---" in Path(path).read_text()
