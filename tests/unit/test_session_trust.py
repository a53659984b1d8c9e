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
from mxload.orchestrator.runtime.detached import (
    SessionKeeper,
    check_recorded_head,
    check_session_name,
    same_address,
)
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
    k = SessionKeeper(state_of(plan), persist=False)
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
        k = SessionKeeper(state_of(plan), persist=False)
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
    k = SessionKeeper(state_of(plan), persist=False)
    assert got(k, holder(host="elsewhere"), 60)
    assert not got(k, holder(token="t2"), 60)
    k = SessionKeeper(state_of(plan), persist=False)
    assert got(k, holder(host="elsewhere"), 0)  # a lease that has expired
    assert got(k, holder(token="t2"), 60)


def test_a_fenced_holder_is_told_the_command_whose_result_the_session_holds(plan) -> None:
    """Reload A's lease lapses (suspended); reload B takes the session and records its
    result; a status takes the lease after it and records nothing. A, resumed, is
    refused, and the command named to it is B (the one that won), not the last lease."""
    k = SessionKeeper(state_of(plan), persist=False)
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
    from mxload.orchestrator.runtime import detached

    checks: list[float] = []

    def check(record: object) -> None:
        checks.append(time.monotonic())
        if len(checks) >= 3:
            raise HeadDown("head 127.0.0.1:6379 is down: its raylet (pid 4242) died")

    monkeypatch.setattr(detached, "check_recorded_head", check)
    t0 = time.monotonic()
    with pytest.raises(HeadDown, match="raylet"):
        with detached.watching_head(object(), period_s=0.05):
            time.sleep(30)
    assert time.monotonic() - t0 < 5
    # Nothing is watched after the body: no later interrupt.
    n = len(checks)
    with detached.watching_head(object(), period_s=0.05):
        pass
    time.sleep(0.2)
    assert len(checks) == n
