"""Hostile sequences that need no Ray: a relative SRC, outputs aimed at inputs, inputs
that never end or hang, switches given as strings, secrets in options, identities that
metadata cannot vouch for, reloads whose lease lapsed, processes that are not ours.

Each test names the sequence it stands for; the end-to-end ones, on a real detached
session, are in tests/integration/test_session_trust.py.
"""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest
from mxload.orchestrator.cli import flags
from mxload.orchestrator.errors import CheckpointError, OutputError, UsageError
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.outputs import check_not_input
from mxload.orchestrator.runtime.reload import reload_inputs
from mxload.orchestrator.runtime.request import LoadRequest
from mxload.workers.storage import Storage

LAYOUT = ParallelLayout(tp=2, dp=1)

# --- 1. a relative SRC is one folder -------------------------------------------------------


def test_a_relative_src_is_made_absolute_where_it_is_named(tmp_path, monkeypatch, ckpt_factory):
    """`mxload reload ck/B` from a folder other than the workers': every path the workers
    get is absolute, and names the folder the command meant."""
    import shutil

    here = tmp_path / "here"
    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 2), here / "ck" / "B")
    monkeypatch.chdir(here)
    args = flags.parse_args(["reload", "ck/B", "--report", "r.json"])
    assert args.src == str(here / "ck" / "B")
    assert args.report == str(here / "r.json")
    args = flags.parse_args(["convert", "ck/B", "out"])
    assert (args.src, args.dst) == (str(here / "ck" / "B"), str(here / "out"))
    assert LoadRequest(src="ck/B", layout=LAYOUT).src == str(here / "ck" / "B")

    meta = open_checkpoint(str(here / "ck" / "B"))
    held = build_plan(meta.config, LAYOUT, checkpoint=meta, device="cpu")
    inputs = reload_inputs(held, "ck/B")
    assert inputs.source.root == str(here / "ck" / "B")
    # The same relative name from another folder is another checkpoint's identity.
    shutil.copytree(here / "ck", tmp_path / "elsewhere" / "ck")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert reload_inputs(held, "ck/B").source.fingerprint != inputs.source.fingerprint


# --- 8. no output may overwrite an input -----------------------------------------------------


def test_outputs_aimed_at_an_input_are_refused_with_one_message(tmp_path) -> None:
    src = tmp_path / "ck"
    src.mkdir()
    (tmp_path / "link").symlink_to(src)
    cases = [
        (str(src), "--dump", "is SRC"),
        (str(tmp_path / "link"), "--dump", "is SRC"),  # real paths compared
        (str(src / "config.json"), "--report", "is inside SRC"),
        (str(tmp_path), "DST", "contains SRC"),
    ]
    for out, flag, relation in cases:
        with pytest.raises(OutputError) as err:
            check_not_input(out, flag, [("SRC", str(src))])
        assert str(err.value).startswith(f"{flag} {out} {relation} {src}: no output may")
    check_not_input(str(tmp_path / "ck-out"), "--dump", [("SRC", str(src))])


def test_cli_refuses_report_inside_src_before_any_work(tmp_path, ckpt_factory, capsys) -> None:
    from mxload.orchestrator.cli.commands import main

    src = ckpt_factory("qwen3-moe-tiny", 1)
    before = open(os.path.join(src, "config.json"), "rb").read()
    rc = main(["load", src, "--report", os.path.join(src, "config.json"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--report" in err and "is inside SRC" in err and len(err.splitlines()) == 1
    assert open(os.path.join(src, "config.json"), "rb").read() == before


def test_a_status_dump_over_the_sessions_checkpoint_is_refused(plan_and_src) -> None:
    from mxload.orchestrator.runtime.detached import _check_outputs
    from mxload.orchestrator.runtime.state import ReloadRecord, SessionState

    held, src = plan_and_src
    state = SessionState(held, src, "f", {}, {})
    with pytest.raises(OutputError, match="is the session's checkpoint"):
        _check_outputs(state, [(src, "--dump")])
    state.last_reload = ReloadRecord("/elsewhere/ck", 2, "g", ok=False)
    with pytest.raises(OutputError, match="is inside the last reload's checkpoint"):
        _check_outputs(state, [("/elsewhere/ck/config.json", "--report")])


@pytest.fixture(scope="module")
def plan_and_src(ckpt_factory):
    src = ckpt_factory("qwen3-moe-tiny", 1)
    meta = open_checkpoint(src)
    return build_plan(meta.config, LAYOUT, checkpoint=meta, device="cpu"), src


# --- 9. bounded input -------------------------------------------------------------------------


def test_a_huge_sparse_index_is_refused_unread(tmp_path, ckpt_factory) -> None:
    import shutil
    import tracemalloc

    src = tmp_path / "ck"
    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 1), src)
    with open(src / "model.safetensors.index.json", "r+b") as f:
        f.truncate(3 << 30)  # 3 GiB, sparse
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="larger than 67108864 bytes"):
            open_checkpoint(str(src))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, peak


@pytest.mark.parametrize("kind", ["fifo", "device", "socket"])
def test_only_regular_files_are_opened(tmp_path, ckpt_factory, kind) -> None:
    """A FIFO named config.json hung every command; /dev/zero behind an allowed link
    filled the memory; neither is opened now (with --allow-outside-links too)."""
    import shutil

    src = tmp_path / "ck"
    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 1), src)
    index = src / "model.safetensors.index.json"
    target = src / "config.json" if kind == "fifo" else index
    target.unlink()
    sock = None
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        target.symlink_to("/dev/zero")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
    done: list[BaseException] = []

    def run() -> None:
        try:
            open_checkpoint(str(src), storage_options={"mxload_allow_outside_links": True})
        except BaseException as err:
            done.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if sock is not None:
        sock.close()
    assert done, "open_checkpoint hung"
    assert isinstance(done[0], CheckpointError), done[0]
    want = {"fifo": "a FIFO", "device": "a character device", "socket": "a socket"}[kind]
    assert f"is {want}, not a regular file" in str(done[0])
    assert os.path.basename(target) in str(done[0])


def test_a_fifo_swapped_in_after_the_check_is_not_waited_on(tmp_path) -> None:
    from mxload.workers.storage.local import read_whole

    os.mkfifo(tmp_path / "f")
    with pytest.raises(CheckpointError, match="is a FIFO"):
        read_whole(str(tmp_path / "f"), 100)


@pytest.mark.parametrize("value", ["false", 0, 1, None, "true"])
def test_a_switch_is_a_json_boolean(tmp_path, value) -> None:
    with pytest.raises(UsageError, match="must be a JSON boolean") as err:
        Storage(str(tmp_path), {"mxload_allow_outside_links": value})
    assert err.value.context.get("key") == "--allow-outside-links"
    assert (
        Storage(str(tmp_path), {"mxload_allow_outside_links": False}).allow_outside_links is False
    )


# --- 7. secrets stay secret --------------------------------------------------------------------

KEY, SECRET = "AKIAEXAMPLEKEY42", "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"


def test_a_failed_run_logs_no_secret_privately(tmp_path, monkeypatch, capsys) -> None:
    """A run that fails with a key and secret in --storage-options: neither reaches the
    error line or the log file, which is 0600 in a 0700 folder under $MXLOAD_HOME."""
    import stat

    from mxload.orchestrator.cli.commands import main

    home = tmp_path / "home"
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # options HTTP takes (headers for every request, the session's own), secrets as values
    opts = json.dumps(
        {"headers": {"Authorization": SECRET}, "client_kwargs": {"headers": {"X-Key": KEY}}}
    )
    url = f"http://127.0.0.1:{port}/ck/{SECRET}"
    timeouts = ["--connect-timeout", "0.5", "--read-timeout", "0.5"]
    rc = main(["inspect", url, "--storage-options", opts, *timeouts])
    err = capsys.readouterr().err
    assert rc == 1, err
    logs = list((home / "logs").iterdir())
    assert len(logs) == 1 and str(logs[0]) in err
    text = logs[0].read_text()
    assert "Traceback" in text and "<hidden>" in text
    for secret in (KEY, SECRET):
        assert secret not in err and secret not in text
    assert stat.S_IMODE(os.stat(home / "logs").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(logs[0]).st_mode) == 0o600


def test_storage_options_from_a_file(tmp_path) -> None:
    path = tmp_path / "creds.json"
    path.write_text(f'{{"key": "{KEY}", "secret": "{SECRET}", "mxload_read_timeout_s": 5}}')
    args = flags.parse_args(["inspect", str(tmp_path), "--storage-options", f"@{path}"])
    assert flags.storage_options(args) == {
        "key": KEY,
        "secret": SECRET,
        "mxload_read_timeout_s": 5,
    }
    path.write_text(f'{{"secret": "{SECRET}",')
    with pytest.raises(UsageError) as err:
        flags.storage_options(args)
    assert "not valid JSON" in str(err.value) and SECRET not in str(err.value)
    for bad in (f"@{tmp_path}/none.json", f"@{tmp_path}"):
        args = flags.parse_args(["inspect", str(tmp_path), "--storage-options", bad])
        with pytest.raises(UsageError, match="--storage-options @"):
            flags.storage_options(args)


def test_a_malformed_option_is_named_and_a_numeric_value_hidden(tmp_path, monkeypatch, capsys):
    """A header that is a number, or client_kwargs that is not an object: refused in one
    line naming the key (fsspec's HTTP back end would report "config.json: no such file",
    or fail with a traceback), never the value; numbers are hidden as texts are."""
    from mxload.orchestrator.cli.commands import main
    from mxload.workers.storage.options import scrub, secret_values

    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    src = str(tmp_path / "ck")
    opts = tmp_path / "opts.json"
    cases = [
        ('{"client_kwargs": {"headers": {"X-Num": 987654321}}}', "client_kwargs.headers 'X-Num'"),
        ('{"headers": {"X-Num": 987654321}}', "headers 'X-Num' must be a JSON string"),
        ('{"client_kwargs": 5}', "client_kwargs must be a JSON object"),
        ('{"client_kwargs": {"headers": ["x"]}}', "client_kwargs.headers must be a JSON object"),
    ]
    for text, said in cases:
        opts.write_text(text)
        for given in (text, f"@{opts}"):
            rc = main(["inspect", src, "--storage-options", given])
            err = capsys.readouterr().err
            assert rc == 2 and err.count("\n") == 1 and said in err, (given, err)
            assert "987654321" not in err and "config.json" not in err
    found = secret_values({"n": 987654321, "f": 1234.5, "short": 12, "on": True, "x": "abc"})
    assert found == ["987654321", "1234.5"]
    assert scrub("X-Num: 987654321", found) == "X-Num: <hidden>"


def test_objects_that_carry_options_do_not_show_them(plan_and_src) -> None:
    from mxload.orchestrator.plan.message import SourceInfo
    from mxload.orchestrator.runtime.state import SessionState

    opts = {"key": KEY, "secret": SECRET}
    held, src = plan_and_src
    for obj in (
        LoadRequest(src=src, layout=LAYOUT, storage_options=opts),
        SourceInfo(root=src, storage_options=opts),
        SessionState(held, src, "f", {}, {}, storage_options=opts),
    ):
        assert SECRET not in repr(obj) and KEY not in repr(obj)


# --- 5. release ends only what it started -------------------------------------------------------


def test_release_spares_a_process_that_only_names_the_heads_folder(tmp_path, monkeypatch) -> None:
    """A user's `tail -f` of a Ray log (its command line names the head's temp dir) lives
    on; a recorded daemon and its child (a Ray worker) are ended."""
    import subprocess
    import sys
    import time

    import psutil
    from mxload.cluster import local

    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    temp = local.short_temp_dir("mxhead-")
    log = os.path.join(temp, "session_latest", "logs", "raylet.out")
    nap = "import subprocess, sys, time; time.sleep(60)"
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {nap!r}]).wait()"
    tail = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", log])
    daemon = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.time() + 10
        while not psutil.Process(daemon.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(daemon.pid).children()
        procs = local.describe_processes([psutil.Process(daemon.pid)])
        record = local.HeadRecord("127.0.0.1:1", temp, "NPU", 1, time.time(), processes=procs)
        ended = local.end_head(record, grace_s=2)
        assert sorted(int(e.rsplit("pid ", 1)[1].rstrip(")")) for e in ended) == sorted(
            [daemon.pid, child.pid]
        ), ended
        assert daemon.wait(timeout=10) is not None
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert tail.poll() is None, "a process that only names the folder is not ours"
    finally:
        for p in (tail, daemon):
            p.kill()
            p.wait()


# --- 2. identity from what a writer cannot forge back -------------------------------------------


def _rewrite_in_place_keeping_mtime(path: str) -> None:
    """The same size and header, other weight bytes, and the old mtime put back."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size - 64)
        tail = f.read(64)
        f.seek(st.st_size - 64)
        f.write(bytes(b ^ 0x5A for b in tail))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_a_local_shard_rewritten_in_place_with_its_mtime_restored_is_another_identity(
    tmp_path, ckpt_factory
) -> None:
    import shutil
    import time

    src = tmp_path / "ck"
    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 1), src)
    before = open_checkpoint(str(src))
    assert open_checkpoint(str(src)).fingerprint == before.fingerprint  # stable when unchanged
    assert before.identity.startswith("local files: inode, size, ctime and mtime")
    time.sleep(0.01)  # a ctime the kernel can tell apart
    _rewrite_in_place_keeping_mtime(str(src / before.files[0]))
    assert open_checkpoint(str(src)).fingerprint != before.fingerprint


def test_a_plain_http_server_gives_an_unverified_identity_that_never_matches(
    tmp_path, ckpt_factory
) -> None:
    """No ETag, no Last-Modified: consecutive checkpoints rewritten in place under one URL
    look alike; the identity says so and never matches an earlier one (no unit skipped)."""
    import shutil

    from tests.servers import Faults, RangeHTTPServer

    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 1), tmp_path / "latest")
    with RangeHTTPServer(str(tmp_path)) as server:
        url = server.url + "/latest"
        a, b = open_checkpoint(url), open_checkpoint(url)
        assert a.fingerprint != b.fingerprint
        assert a.identity.startswith("unverified: the store gives no ETag or VersionId for")
        server.faults = Faults(etag=True)
        c = open_checkpoint(url)
        assert c.fingerprint == open_checkpoint(url).fingerprint
        assert c.identity.startswith("the store's change tags")
        _rewrite_in_place_keeping_mtime(str(tmp_path / "latest" / c.files[0]))
        assert open_checkpoint(url).fingerprint != c.fingerprint


# --- 3. versions only go forward: the keeper's fence ---------------------------------------------


def test_a_lapsed_lease_can_neither_renew_nor_record(plan_and_src) -> None:
    import dataclasses
    import time

    import psutil
    from mxload.orchestrator.runtime.keeper import SessionKeeper
    from mxload.orchestrator.runtime.state import LeaseHolder, SessionState

    held, src = plan_and_src
    me = psutil.Process()

    def holder(token: str) -> LeaseHolder:
        return LeaseHolder(token, me.pid, me.create_time(), socket.gethostname(), "reload", src)

    k = SessionKeeper("k", SessionState(held, src, "f4", {}, {}, version=4))
    first = k.acquire(holder("stopped"), 0.2)
    time.sleep(0.3)  # suspended past its lease
    assert k.renew("stopped", 60) is False
    second = k.acquire(holder("later"), 60)
    assert (first.fence, second.fence) == (1, 2)
    assert k.put(dataclasses.replace(k.state, version=5, fingerprint="f5"), "later") == ""
    stale = dataclasses.replace(k.state, version=5, fingerprint="f5-stale")
    assert "lapsed" in k.put(stale, "stopped")
    assert (k.state.version, k.state.fingerprint) == (5, "f5")
    assert "lapsed" in k.events()[0]
    assert "older than the session's 5" in k.put(dataclasses.replace(k.state, version=4), "later")


# --- 6. a server that drips -----------------------------------------------------------------------


@pytest.mark.timeout(60)  # a hang guard: without a total budget this never ends
def test_a_dripping_server_is_given_up_on_naming_the_url(tmp_path) -> None:
    """A byte every 0.05 s: never silent for the 0.3 s read timeout, so only the total
    budget (connect + read timeout + bytes at --min-read-rate) ends each attempt."""
    import time

    from mxload.orchestrator.errors import StorageError
    from mxload.workers.storage import RetryPolicy

    from tests.servers import Faults, RangeHTTPServer

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    with RangeHTTPServer(str(tmp_path), Faults(drip_s=0.05)) as server:
        url = server.url + "/ck"
        opts = {"mxload_connect_timeout_s": 0.3, "mxload_read_timeout_s": 0.3}
        st = Storage(url, opts, retry=RetryPolicy(attempts=3), sleep=lambda s: None)
        t0 = time.monotonic()
        with pytest.raises(StorageError) as err:
            st.read_range("model.safetensors", 0, 4096)
        took = time.monotonic() - t0
        drips = len(server.requests(path="ck/model.safetensors"))
    print(f"dripping server: StorageError after {took:.1f} s, {drips} attempts")
    assert f"{url}/model.safetensors" in str(err.value) and "3 attempts" in str(err.value)
    # each attempt: 0.3 + 0.3 + 4096 B / 1 MiB/s = 0.604 s at most
    assert drips == 3 and took < 3 * 0.604 + 1.5, took
