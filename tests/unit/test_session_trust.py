"""The parts of a trustworthy session that need no Ray: the verdict over ranks' reports,
replica checksums, the keeper's lease, session names, and recognising and ending a
crashed head from its recorded processes (real subprocesses, real sockets).

The same behaviours end to end, on a real Ray head: tests/integration/test_session_trust.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mxload.cluster import local
from mxload.orchestrator.errors import HeadStopped, SessionError
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.heads import check_recorded_head, same_address
from mxload.orchestrator.runtime.keeper import SessionKeeper
from mxload.orchestrator.runtime.records import check_session_name
from mxload.orchestrator.runtime.state import (
    Lease,
    LeaseHolder,
    ReloadRecord,
    SessionState,
    replica_mismatches,
    verdict,
)

# --- verdict ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan(ckpt_factory):
    meta = open_checkpoint(ckpt_factory("qwen3-moe-tiny", 1))
    return build_plan(meta.config, ParallelLayout(tp=2, dp=2), checkpoint=meta)


def manifest_of(plan, identity=(1, "f1"), sums=None) -> dict:
    """What status builds from four healthy ranks' reports: every buffer's checksum is
    its name (so replicas agree) unless ``sums`` says otherwise."""
    ranks = []
    for rp in plan.ranks:
        tensors = {
            b.name: {"checksum": (sums or {}).get((rp.rank, b.name), b.name), "data_ptr": 1000}
            for b in rp.buffers
        }
        ranks.append(
            {
                "rank": rp.rank,
                "identity": list(identity),
                "tensors": tensors,
                "pid": 10 + rp.rank,
                "units": {"units_by_identity": {f"{identity[0]}:{identity[1]}": 3}},
            }
        )
    return {"ranks": ranks}


def state_of(plan, version=1, fp="f1") -> SessionState:
    return SessionState(
        plan=plan,
        version=version,
        fingerprint=fp,
        src="/ckpt/v1",
        addresses={rp.rank: {b.name: 1000 for b in rp.buffers} for rp in plan.ranks},
        pids={rp.rank: 10 + rp.rank for rp in plan.ranks},
    )


def test_healthy_session_is_consistent(plan) -> None:
    m = manifest_of(plan)
    verdict(state_of(plan), m)
    assert m["consistent"] is True and m["problems"] == [] and m["replicated_tensors_agree"]


def test_status_says_how_the_identity_was_established(plan) -> None:
    from mxload.orchestrator.cli.rendering import status_headline

    state = state_of(plan)
    state.identity_basis = "unverified: the store gives no ETag or VersionId for x"
    m = manifest_of(plan)
    verdict(state, m)
    assert m["identity"]["established_by"] == state.identity_basis
    assert any("is unverified: the store gives no ETag" in n for n in m["notices"])
    assert status_headline(m)[1] == f"identity: {state.identity_basis}"
    state.identity_basis = "local files: inode, size, ctime and mtime (ns) of every shard"
    m = manifest_of(plan)
    verdict(state, m)
    assert m["notices"] == [] and m["identity"]["established_by"].startswith("local files")


def test_same_version_number_from_another_checkpoint_is_not_consistent(plan) -> None:
    """The bug: rank 3 at version 2 of one checkpoint, the others at version 2 of another."""
    m = manifest_of(plan, identity=(2, "fB"))
    m["ranks"][3]["identity"] = [2, "fA"]
    verdict(state_of(plan, 2, "fB"), m)
    assert m["consistent"] is False
    assert any("ranks hold different checkpoints" in p for p in m["problems"]), m["problems"]
    assert any("ranks 3 hold version 2 of checkpoint fA" in p for p in m["problems"])


def test_a_rank_with_mixed_units_is_named(plan) -> None:
    m = manifest_of(plan)
    m["ranks"][1]["identity"] = None
    m["ranks"][1]["units"] = {"units_by_identity": {"1:f1": 5, "2:fA": 4}}
    verdict(state_of(plan), m)
    assert not m["consistent"]
    assert m["problems"][0].startswith("rank 1: its units hold different versions")
    assert "5 at version 1 of f1" in m["problems"][0] and "4 at version 2 of fA" in m["problems"][0]


def test_every_rank_at_an_unrecorded_identity_is_not_consistent(plan) -> None:
    m = manifest_of(plan, identity=(2, "fA"))
    verdict(state_of(plan, 1, "f1"), m)
    assert not m["consistent"] and "not the session's version 1" in m["problems"][0]


def test_replicas_that_differ_are_found_by_their_bytes(plan) -> None:
    """Identities all agree, but dp rank 1's copy of a replicated buffer differs."""
    name = next(b.name for b in plan.ranks[2].buffers if "input_layernorm" in b.name)
    m = manifest_of(plan, sums={(2, name): "deadbeef"})
    found = replica_mismatches(plan, m)
    assert len(found) == 1 and found[0].startswith(f"{name} on ranks 0,1,2,3: "), found
    assert "rank 2 deadbeef" in found[0]
    verdict(state_of(plan), m)
    assert not m["consistent"] and not m["replicated_tensors_agree"]
    # A tp shard is compared only with its dp replica (rank 1 with 3), never with the
    # other tp rank's slice (rank 0 holds different rows).
    tp_sharded = next(b.name for b in plan.ranks[1].buffers if "o_proj" in b.name)
    m = manifest_of(plan, sums={(1, tp_sharded): "other"})
    found = replica_mismatches(plan, m)
    assert len(found) == 1 and found[0].startswith(f"{tp_sharded} on ranks 1,3: "), found


def test_moved_buffers_and_restarted_ranks_are_shown(plan) -> None:
    m = manifest_of(plan)
    name = next(iter(m["ranks"][0]["tensors"]))
    m["ranks"][0]["tensors"][name]["data_ptr"] = 2000
    m["ranks"][2]["addresses_changed"] = True
    for t in m["ranks"][2]["tensors"].values():
        t["data_ptr"] = 3000
    verdict(state_of(plan), m)
    assert not m["consistent"] and m["addresses_moved"] == [f"rank 0: {name}"]
    assert any("rank 2 was lost and restarted" in n for n in m["notices"])


def test_a_running_reload_and_a_failed_one_are_said(plan) -> None:
    m = manifest_of(plan)
    busy = Lease(LeaseHolder("t", 42, 1.0, "h", "reload", "/ckpt/v9"), since=1.0, expires=2.0)
    state = state_of(plan)
    state.last_reload = ReloadRecord("/x", 2, "fX", ok=False, error="boom")
    verdict(state, m, busy=busy)
    assert not m["consistent"] and "a reload is running" in m["problems"][0]
    assert any("failed: boom" in n for n in m["notices"])


# --- the lease ---------------------------------------------------------------------------------


def holder(pid: int | None = None, **kw) -> LeaseHolder:
    proc = psutil.Process(pid or os.getpid())
    return LeaseHolder(
        token=kw.pop("token", "t1"),
        pid=proc.pid,
        created=proc.create_time(),
        host=kw.pop("host", socket.gethostname()),
        what="reload",
        src=kw.pop("src", "/a"),
    )


def got(k: SessionKeeper, h: LeaseHolder, ttl: float) -> bool:
    """Whether ``h`` took the lease (else the keeper answered with another's)."""
    return k.acquire(h, ttl).holder.token == h.token


def test_lease_one_holder_at_a_time(plan) -> None:
    k = SessionKeeper("k", state_of(plan))
    assert got(k, holder(), 60)
    busy = k.acquire(holder(token="t2", src="/b"), 60)
    assert busy.holder.token == "t1" and busy.holder.src == "/a" and busy.holder.pid == os.getpid()
    assert k.renew("t2", 60) is False and k.renew("t1", 60) is True
    k.release("t2")  # not the holder: no effect
    assert k.holder() is not None
    k.release("t1")
    assert k.holder() is None and got(k, holder(token="t2"), 60)


def test_lease_of_a_dead_holder_or_expired_is_taken_over(plan) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        k = SessionKeeper("k", state_of(plan))
        assert got(k, holder(proc.pid, src="/dead"), 60)
        assert not got(k, holder(token="t2"), 60)  # its holder is alive
    finally:
        proc.kill()
        proc.wait()
    assert got(k, holder(token="t2"), 60)  # killed with -9: taken over
    assert k.lease.took_over_from.src == "/dead"
    shown = k.lease.to_json()  # what status --json says of a running reload
    assert shown["took_over_from"]["src"] == "/dead" and shown["src"] == "/a"
    assert "token" not in shown, "the token renews and releases the lease: not shown"
    # A holder on another host is trusted until its lease expires.
    k = SessionKeeper("k", state_of(plan))
    assert got(k, holder(host="elsewhere"), 60)
    assert not got(k, holder(token="t2"), 60)
    k = SessionKeeper("k", state_of(plan))
    assert got(k, holder(host="elsewhere"), 0)  # a lease that has expired
    assert got(k, holder(token="t2"), 60)


def test_a_fenced_holder_is_told_the_command_whose_result_the_session_holds(plan) -> None:
    """Reload A's lease lapses (suspended); reload B takes the session and records its
    result; a status takes the lease after it and records nothing. A, resumed, is
    refused, and the command named to it is B (the one that won), not the last lease."""
    k = SessionKeeper("k", state_of(plan))
    a = k.acquire(holder(token="ta", src="/a"), 0)  # lapsed at once
    b = k.acquire(holder(token="tb", src="/b"), 60)
    assert b.fence > a.fence
    won = dataclasses.replace(state_of(plan, version=2, fp="fb"), src="/b")
    assert k.put(won, "tb") == ""
    k.release("tb")
    status = k.acquire(dataclasses.replace(holder(token="ts"), what="status"), 60)
    k.release("ts")
    assert status.fence > b.fence
    assert "lapsed" in k.put(state_of(plan, version=2, fp="fa"), "ta")
    winner = k.took_over(a.fence)
    assert winner is not None and (winner.holder.src, winner.fence) == ("/b", b.fence)
    assert k.took_over(status.fence) is None


# --- names and addresses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["", "/", "..", ".", "a b", "x\x01y", "a/keeper", ".hidden", "t\n", "-x", "x" * 65]
)
def test_unsafe_session_names(name: str) -> None:
    with pytest.raises(SessionError, match="--session") as err:
        check_session_name(name)
    assert err.value.exit_code == 2


def test_same_address() -> None:
    assert same_address("127.0.0.1:6379", "localhost:6379")
    assert same_address("ray://127.0.0.1:6379", "127.0.0.1:6379")
    assert not same_address("127.0.0.1:6379", "127.0.0.1:6380")
    assert not same_address("10.0.0.2:6379", "127.0.0.1:6379")


# --- a crashed head, from its record ---------------------------------------------------------


def test_head_down_names_what_died_and_end_head_ends_only_recorded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    temp = Path(local.short_temp_dir("mxhead-"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    gcs, raylet, bystander = (subprocess.Popen(sleeper) for _ in range(3))
    try:
        procs = local.describe_processes([psutil.Process(gcs.pid), psutil.Process(raylet.pid)])
        procs = tuple(
            dict(p, role=role) for p, role in zip(procs, ("gcs_server", "raylet"), strict=True)
        )
        stale = {"pid": bystander.pid, "created": 1.0, "role": "ray::RankWorker"}  # reused pid
        record = local.HeadRecord(
            address=f"127.0.0.1:{port}",
            temp_dir=str(temp),
            resource="NPU",
            num_devices=1,
            started_at=time.time(),
            processes=procs,
        )
        path = tmp_path / "home" / "head.json"
        path.write_text(json.dumps(dataclasses.asdict(record)))
        assert local.read_head_record() == record
        assert local.head_down(record) == []
        raylet.kill()
        raylet.wait()
        assert local.head_down(record) == [f"raylet (pid {raylet.pid})"]
        listener.close()
        assert local.head_down(record)[-1].startswith("nothing listens at")
        ended = local.end_head(record, [stale])
        assert [f"(pid {gcs.pid})" in e for e in ended] == [True], ended
        assert gcs.wait(timeout=15) is not None
        assert bystander.poll() is None, "a pid with another start time is not ours"
        assert not path.exists() and not temp.exists()
    finally:
        for p in (gcs, raylet, bystander):
            p.kill()
            p.wait()
        listener.close()


def test_a_recorded_process_survives_a_clock_step_but_not_pid_reuse() -> None:
    """psutil's create_time moves by a whole second when /proc/stat's btime is recomputed
    after a clock adjustment; the start in ticks since boot does not. A record is matched
    on ticks (a live head was once reported down on a 0.01 s create_time comparison)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = psutil.Process(sleeper.pid)
        entry = dict(local.process_identity(proc), role="raylet")
        assert entry["start_ticks"] == local.start_ticks(sleeper.pid) is not None
        stepped = dict(entry, created=entry["created"] + 1.0)  # btime stepped by a second
        assert local.live_process(stepped) is not None
        reused = dict(entry, start_ticks=entry["start_ticks"] + 1)  # same pid, another start
        assert local.live_process(reused) is None
        # a record without ticks (another OS): start times within the slack
        legacy = {"pid": sleeper.pid, "created": entry["created"] + 1.0, "role": "raylet"}
        assert local.live_process(legacy) is not None
        assert local.live_process(dict(legacy, created=entry["created"] - 60)) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert local.live_process(entry) is None  # gone


def test_a_stopped_head_is_named_not_ended(tmp_path, monkeypatch) -> None:
    """A SIGSTOPped raylet: its port still accepts connections, so only its process state
    tells. The check refuses before any Ray call (which would wait minutes), names the
    process and the way to resume it, and says the head is not down; resumed, it passes."""
    import signal

    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    gcs, raylet = (subprocess.Popen(sleeper) for _ in range(2))
    try:
        procs = local.describe_processes([psutil.Process(gcs.pid), psutil.Process(raylet.pid)])
        record = local.HeadRecord(
            address=f"127.0.0.1:{listener.getsockname()[1]}",
            temp_dir=str(tmp_path / "t"),
            resource="NPU",
            num_devices=1,
            started_at=time.time(),
            processes=tuple(
                dict(p, role=role) for p, role in zip(procs, ("gcs_server", "raylet"), strict=True)
            ),
        )
        check_recorded_head(record)  # running: passes
        os.kill(raylet.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(raylet.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the raylet stand-in never stopped"
            time.sleep(0.01)
        assert local.head_down(record) == []  # alive and listening: not down
        assert local.head_stopped(record) == [f"raylet (pid {raylet.pid})"]
        with pytest.raises(HeadStopped) as err:
            check_recorded_head(record)
        msg = str(err.value)
        assert f"kill -CONT {raylet.pid}" in msg and "not down" in msg, msg
        assert "release --force" in msg
        os.kill(raylet.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while local.head_stopped(record):
            assert time.monotonic() < deadline, "the raylet stand-in never resumed"
            time.sleep(0.01)
        check_recorded_head(record)
        assert gcs.poll() is None and raylet.poll() is None, "nothing was ended"
    finally:
        for p in (gcs, raylet):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        listener.close()


def test_own_temp_dirs_are_private(tmp_path) -> None:
    root = Path(local.short_temp_dir("mxray-"))
    try:
        inner = Path(local.ray_temp_dir(str(root)))
        (inner / "session_x" / "sockets").mkdir(parents=True)
        for d in (root, inner, inner / "session_x", inner / "session_x" / "sockets"):
            d.chmod(0o777)  # what Ray does
        local.make_private(str(root))
        for d in (root, inner, inner / "session_x", inner / "session_x" / "sockets"):
            assert oct(d.stat().st_mode & 0o777) == "0o700", d
    finally:
        import shutil

        shutil.rmtree(root)


# --- restarts and the reload every host runs ------------------------------------------------


def test_restarts_are_counted_from_the_recorded_processes(plan) -> None:
    """One rule for every host: a report from another process than the one recorded is a
    restart; its new addresses become the recorded ones, and it stays marked."""
    state = state_of(plan)
    m = manifest_of(plan)
    m["ranks"][2]["pid"] = 99
    for t in m["ranks"][2]["tensors"].values():
        t["data_ptr"] = 3000
    assert state.observe(m["ranks"]) == [2]
    assert [r.get("restarts", 0) for r in m["ranks"]] == [0, 0, 1, 0]
    assert [r["addresses_changed"] for r in m["ranks"]] == [False, False, True, False]
    assert state.pids[2] == 99 and set(state.addresses[2].values()) == {3000}
    assert state.restarted == {2}
    again = manifest_of(plan)
    again["ranks"][2]["pid"] = 99
    assert state.observe(again["ranks"]) == []  # the same process: not counted twice
    assert again["ranks"][2]["addresses_changed"] is True and "restarts" not in again["ranks"][2]
    lost_in_run = manifest_of(plan)
    lost_in_run["ranks"][0]["restarts"] = 1  # the run itself saw rank 0's process lost
    lost_in_run["ranks"][2]["pid"] = 99
    assert state.observe(lost_in_run["ranks"]) == [0]


class _FakeRanks:
    """Ranks that report what they are told to (the reload sequence without workers)."""

    fused = False

    def __init__(self, reports) -> None:
        self.reports = reports
        self.ran: list[int] = []

    def run_ranks(self, inputs, version, on_progress):
        self.ran.append(version)
        return self.reports


def test_reload_records_the_new_identity_or_the_failure(plan, ckpt_factory) -> None:
    from mxload.orchestrator.errors import AddressMoved, ReloadMismatch
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.orchestrator.runtime.reload import reload

    v2 = ckpt_factory("qwen3-moe-tiny", 2)
    saved: list[tuple[int, bool]] = []

    def save(s: SessionState) -> None:
        saved.append((s.version, s.last_reload.ok))

    state = state_of(plan)
    ok = _FakeRanks(manifest_of(plan)["ranks"])
    done = reload(ok, state, save, v2)
    assert ok.ran == [2] and saved == [(2, True)]
    assert state.identity == (2, open_checkpoint(v2).fingerprint) and state.src == v2
    assert done.restarted == [] and state.last_reload.ok

    moved = manifest_of(plan)["ranks"]
    name = next(iter(moved[1]["tensors"]))
    moved[1]["tensors"][name]["data_ptr"] = 2000
    with pytest.raises(AddressMoved, match=f"rank 1: {name}"):
        reload(_FakeRanks(moved), state, save, v2)
    assert state.version == 2 and saved[-1] == (2, False)
    assert state.last_reload.version == 3 and "AddressMoved" in state.last_reload.error

    other = ckpt_factory("qwen3-moe-tiny", 7, overrides={"moe_intermediate_size": 96})
    refused = _FakeRanks(manifest_of(plan)["ranks"])
    with pytest.raises(ReloadMismatch):
        reload(refused, state, save, other)
    assert refused.ran == [] and len(saved) == 2, "refused before running or recording"


def test_a_head_going_down_interrupts_a_command_waiting_on_it(monkeypatch) -> None:
    """A command blocked on the head (here a sleep; in a run, a Ray call that would wait
    minutes after its raylet died) ends within a period with the head's own error."""
    import time

    from mxload.orchestrator.errors import HeadDown
    from mxload.orchestrator.runtime import heads

    checks: list[float] = []

    def check(record: object) -> None:
        checks.append(time.monotonic())
        if len(checks) >= 3:
            raise HeadDown("head 127.0.0.1:6379 is down: its raylet (pid 4242) died")

    monkeypatch.setattr(heads, "check_recorded_head", check)
    t0 = time.monotonic()
    with pytest.raises(HeadDown, match="raylet"):
        with heads.watching_head(object(), period_s=0.05):
            time.sleep(30)
    assert time.monotonic() - t0 < 5
    # Nothing is watched after the body: no later interrupt.
    n = len(checks)
    with heads.watching_head(object(), period_s=0.05):
        pass
    time.sleep(0.2)
    assert len(checks) == n


def test_the_credentials_are_kept_in_a_file_only_the_user_reads(tmp_path, monkeypatch, plan):
    """A detached session's storage options, the caller's part (credentials), are kept
    outside the cluster, in a file only the user can read, for this load of the name."""
    import stat

    from mxload.orchestrator.runtime.records import keep_options, kept_options, options_file
    from mxload.orchestrator.runtime.request import LoadRequest

    options = {
        "key": "AKIA-not-a-real-key-0123",
        "client_kwargs": {"headers": {"X-Token": 987654321}},
        "mxload_connect_timeout_s": 7.0,
    }
    state = dataclasses.replace(
        state_of(plan),
        storage_options=options,
        request=LoadRequest(src="/ckpt/v1", layout=plan.layout, storage_options=options),
    )
    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    assert keep_options("s1", state.created, options)
    path = options_file("s1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    theirs = {k: v for k, v in options.items() if not k.startswith("mxload_")}
    assert kept_options("s1", state.created) == theirs
    assert kept_options("s1", state.created + 1) is None  # an earlier load of the name
    assert state.without_credentials().with_credentials(theirs).storage_options == options
    assert keep_options("s1", time.time(), {"mxload_connect_timeout_s": 7.0})
    assert not path.exists()  # nothing of the caller's: no file


# --- mxload's own state is an input ---------------------------------------------------------


def test_no_output_may_overwrite_mxloads_own_state(tmp_path, monkeypatch, capsys, ckpt_factory):
    """`--dump $MXLOAD_HOME --overwrite` would replace head.json and the session records
    (the head orphaned), `--dump` onto the recorded head's folder delete its sockets, a
    `--report` onto head.json its token: each refused in one line, exit 2, before any
    work (no head is asked: the one recorded here is not running)."""
    from mxload.orchestrator.cli.commands import main

    home = tmp_path / "home"
    head_dir = tmp_path / "mxhead-x"
    (head_dir / "r" / "sockets").mkdir(parents=True)
    (home / "sessions").mkdir(parents=True)
    record = {"address": "127.0.0.1:9", "temp_dir": str(head_dir), "resource": "NPU"}
    record.update(num_devices=1, started_at=0.0)
    (home / "head.json").write_text(json.dumps(record))
    (home / "sessions" / "default.json").write_text("{}")
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    src = ckpt_factory("qwen3-moe-tiny", 1)
    cases = [
        (["status", "--dump", str(home), "--overwrite"], "mxload's record of its Ray head"),
        (["status", "--dump", str(home / "sessions"), "--overwrite"], "session records"),
        (["status", "--dump", str(head_dir), "--overwrite"], "the folder of the Ray head"),
        (["status", "--dump", str(head_dir / "r" / "sockets")], "the folder of the Ray head"),
        (["load", src, "--device", "cpu", "--report", str(home / "head.json")], "Ray head"),
        (
            ["make-checkpoint", str(tmp_path), "--preset", "qwen3-moe-tiny", "--overwrite"],
            "Ray head",
        ),
    ]
    for argv, said in cases:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and said in err, (argv, err)
    assert json.loads((home / "head.json").read_text()) == record
    assert (head_dir / "r" / "sockets").is_dir() and (home / "sessions" / "default.json").exists()


def test_load_detach_with_an_unwritable_home_starts_nothing(
    tmp_path, monkeypatch, capsys, ckpt_factory
):
    """A $MXLOAD_HOME that cannot be written (here under a file; a read-only mount for a
    user) is refused before any head starts: one line naming it, exit 2."""
    import ray
    from mxload.orchestrator.cli.commands import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MXLOAD_HOME", str(blocker / "home"))
    before = {p.pid for p in psutil.process_iter()}
    rc = main(["load", ckpt_factory("qwen3-moe-tiny", 1), "--device", "cpu", "--detach"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"$MXLOAD_HOME {blocker / 'home'}" in err and "nothing was started" in err
    assert not ray.is_initialized()
    started = [p for p in psutil.process_iter(["name"]) if p.pid not in before]
    assert not [p for p in started if p.info["name"] in ("gcs_server", "raylet")]


@pytest.mark.slow
def test_a_head_whose_record_cannot_be_written_is_stopped(tmp_path, monkeypatch) -> None:
    """head.json fails to be written after `ray start` (the home turned read-only or
    full meanwhile): the head just started is ended, not left running recorded nowhere,
    and the error names $MXLOAD_HOME (exit 2)."""
    import errno

    home = tmp_path / "home"
    monkeypatch.setenv("MXLOAD_HOME", str(home))
    started: list[local.HeadRecord] = []
    real_end = local.end_head

    def refuse(at: Path, record: local.HeadRecord) -> None:
        started.append(record)
        raise OSError(errno.EROFS, "Read-only file system", str(at / "head.json"))

    monkeypatch.setattr(local, "_write_head_record", refuse)
    monkeypatch.setattr(local, "end_head", lambda r, *a, **k: real_end(r, *a, grace_s=2.0))
    try:
        with pytest.raises(SessionError, match=r"\$MXLOAD_HOME .*it was stopped") as err:
            local.start_detached_head(1, num_cpus=1)
        assert err.value.exit_code == 2
        (record,) = started
        assert [p for p in record.processes if local.live_process(p) is not None] == []
        assert not Path(record.temp_dir).exists() and not (home / "head.json").exists()
    finally:
        for record in started:  # whatever the outcome, nothing of it outlives the test
            real_end(record, grace_s=2.0)
