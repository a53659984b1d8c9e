"""A detached session you can trust: versions are identities, failures never hide, and a
crashed head is found and cleaned up (docs/contract.md §4 "Reload", "Detached sessions").

Run as a user runs it: one ``mxload`` subprocess per command against a background head
that ``load --detach`` starts (real Ray, real processes), except the ``status --json``
reads that check the session's state (:func:`status_json`, :func:`dump_matches`), which
call the CLI's ``main`` in this process: the same command, without a Python start-up and
a torch import each. Every claim ``status`` makes about consistency is checked against
the devices' bytes: ``status --dump`` compared with the independent reference
(``tests/reference_model.py``) of the checkpoint it names.

Failure sequences covered on one session (:func:`session`, loaded once per module and
again only by a test that finds it gone, so each test also passes alone):

1. a reload that fails on one rank only (a NaN block scale in an expert only rank 3
   holds), then a reload from *another* checkpoint: every rank must end with that
   checkpoint's bytes (the version-number-only skip left ranks 0-2 on the first);
2. a reload refused while another command holds the session's lease, naming it;
3. two reloads from different checkpoints started at once: one wins everywhere, or
   status says the session is inconsistent, never ``consistent`` over mixed weights;
4. kill -9 of the head's GCS, then of a second head's raylet (after ``status
   --address`` reached that head): ``status`` answers in bounded time naming what died,
   ``release`` ends every process and removes the files.

Every subprocess runs with its working directory in this module's folder; the module
ends, by pid, anything it started that is still running there.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file, save_file

from tests.procs import end_processes, processes_in
from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MXLOAD = [sys.executable, "-m", "mxload.orchestrator.cli"]
LAYOUT = ["--tp", "2", "--dp", "2", "--enable-expert-parallel"]
LAY = Layout(2, 2, 1, True, "linear")
NAN_TENSOR = "model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"
"""qwen3-moe-tiny has 8 experts; under EP 4 (linear) expert 7 is rank 3's alone."""
INLINE_MAX = 1024
"""Largest argument Ray passes inline in this module's commands (see :func:`env_of`)."""
BOUND_S = 30.0
"""status/release on a dead head: the head check itself is pid look-ups (well under a
second, the contract says 10 s); the rest is this interpreter's start-up on a busy
2-core machine. A Ray call on a dead raylet took ~65 s before."""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("trust")
    (root / "cwd").mkdir()
    (root / "home").mkdir()
    yield root
    end_processes(processes_in(root / "cwd"))


def env_of(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["MXLOAD_HOME"] = str(work / "home")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # What Ray passes inline (100 KiB by default), low enough that neither the session's
    # state (about 75 KiB for this model's plan) nor a rank's plan (about 26 KiB) is: as
    # for any real model, whose plan is megabytes. Arguments not inlined are owned by the
    # process that made the call (an actor's first ones: gone when `load` exits).
    env["RAY_max_direct_call_object_size"] = str(INLINE_MAX)
    return env


def mx(work: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MXLOAD, *args],
        cwd=work / "cwd",
        env=env_of(work),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started(work: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*MXLOAD, *args],
        cwd=work / "cwd",
        env=env_of(work),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def show(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstderr: {proc.stderr[-3000:]}\nstdout: {proc.stdout[-2000:]}"


@contextlib.contextmanager
def home_of(work: Path):
    """This process's environment as :func:`env_of` gives a subprocess's, restored after."""
    keys = ("MXLOAD_HOME", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["MXLOAD_HOME"] = str(work / "home")
    os.environ.pop("RAY_ADDRESS", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def mx_here(work: Path, *args: str) -> subprocess.CompletedProcess:
    """``mxload ARGS`` through the CLI's ``main`` in this process (exit status, stdout and
    stderr as a subprocess's would be)."""
    from mxload.orchestrator.cli.commands import main

    out, err = io.StringIO(), io.StringIO()
    with home_of(work), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(["mxload", *args], rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def ckpts(work: Path, ckpt_factory) -> dict[str, str]:
    out = {f"v{seed}": ckpt_factory("qwen3-moe-tiny", seed) for seed in (1, 2, 3, 4, 5)}
    # v2 with one NaN block scale in expert 7 (rank 3's): its reload fails on rank 3 only.
    import shutil

    nan = work / "v2-nan-expert7"
    shutil.copytree(out["v2"], nan)
    with open(nan / "model.safetensors.index.json") as f:
        file = json.load(f)["weight_map"][NAN_TENSOR]
    tensors = load_file(nan / file)
    tensors[NAN_TENSOR][0, 0] = float("nan")
    save_file(tensors, nan / file, metadata={"format": "pt"})
    out["nan"] = str(nan)
    return out


@pytest.fixture(scope="module")
def first_load(work: Path, ckpts) -> subprocess.CompletedProcess:
    """``load --detach`` of v1 over 4 ranks (TP 2 x DP 2, EP), the module's session."""
    return mx(work, "load", ckpts["v1"], *LAYOUT, "--device", "cpu", "--detach", "--json")


@pytest.fixture
def session(work: Path, ckpts, first_load) -> subprocess.CompletedProcess:
    """The module's detached session, loaded again (v1) where a test before ended it."""
    if (work / "home" / "head.json").exists():
        return first_load
    return mx(work, "load", ckpts["v1"], *LAYOUT, "--device", "cpu", "--detach", "--json")


def status_json(work: Path) -> tuple[int, dict]:
    st = mx_here(work, "status", "--json")
    assert st.returncode in (0, 4), show(st)
    return st.returncode, json.loads(st.stdout)


def dump_matches(work: Path, src: str, name: str) -> list[str]:
    """``status --dump``: every rank's bytes against ``src``'s independent reference."""
    dump = work / name
    st = mx_here(work, "status", "--dump", str(dump), "--json")
    assert st.returncode in (0, 4), show(st)
    ref = RefCheckpoint(src)
    problems = []
    for r in range(4):
        got = load_file(dump / f"rank-{r:05d}.safetensors")
        problems += [f"rank {r}: {p}" for p in compare_rank(expected_rank(ref, LAY, r), got)]
    return problems


# --- 1-3: versions are identities ---------------------------------------------------------


def test_failed_reload_on_one_rank_then_another_checkpoint(work: Path, ckpts, session) -> None:
    load = session
    assert load.returncode == 0, show(load)
    assert 7 in json.loads(load.stdout)["ranks"][3]["experts"]
    head = json.loads((work / "home" / "head.json").read_text())
    # The head's folders are private, Ray's sockets included (they were 0777).
    temp = Path(head["temp_dir"])
    sockets = list(temp.glob("r/session_*/sockets"))
    assert sockets, list(temp.rglob("*"))[:20]
    for path in [temp, *temp.glob("r"), *temp.glob("r/session_*"), *sockets]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert {p["role"] for p in head["processes"]} >= {"gcs_server", "raylet"}

    bad = mx_here(work, "reload", ckpts["nan"])
    assert bad.returncode != 0, show(bad)
    assert "experts.7" in bad.stderr and "rank 3" in bad.stderr, show(bad)

    # Ranks 0-2 finished the reload, rank 3 did not: inconsistent, said first, exit 4.
    human = mx_here(work, "status")
    assert human.returncode == 4, show(human)
    first = human.stdout.splitlines()[0]
    assert first.startswith("INCONSISTENT:"), show(human)
    assert "rank 3" in human.stdout and "failed" in human.stdout, show(human)
    rc, st = status_json(work)
    assert rc == 4 and st["consistent"] is False and st["problems"], st.get("problems")
    assert st["last_reload"]["ok"] is False

    # Another checkpoint at the same target version number: every unit rewritten.
    good = mx_here(work, "reload", ckpts["v3"], "--json")
    assert good.returncode == 0, show(good)
    rc, st = status_json(work)
    assert rc == 0 and st["consistent"] is True, st["problems"]
    assert st["identity"]["src"] == ckpts["v3"] and st["replicated_tensors_agree"]
    assert dump_matches(work, ckpts["v3"], "dump-v3") == []
    human = mx_here(work, "status")
    assert human.returncode == 0 and human.stdout.startswith("CONSISTENT:"), show(human)


def test_reload_refused_while_another_holds_the_session(work: Path, ckpts, session) -> None:
    """The lease is the keeper's: a reload, or a release, while another command holds it
    is refused, naming the holder, and touches nothing."""
    import ray
    from mxload.cluster.local import connect, read_head_record
    from mxload.orchestrator.runtime.keeper import session_lease
    from mxload.orchestrator.runtime.records import NAMESPACE

    _, before = status_json(work)
    with home_of(work):
        record = read_head_record()
        assert record is not None
        connect(record.address, token=record.token)
        try:
            keeper = ray.get_actor("default/keeper", namespace=NAMESPACE)
            with session_lease(keeper, "default", "a test holding the lease", "elsewhere"):
                refused = mx(work, "reload", ckpts["v4"])
                # release too: ending the ranks under a running reload made it blame them
                kept = mx(work, "release")
        finally:
            ray.shutdown()
    for proc in (refused, kept):
        assert proc.returncode == 2, show(proc)
        assert "busy" in proc.stderr and "a test holding the lease" in proc.stderr
        assert f"pid {os.getpid()}" in proc.stderr, show(proc)
    rc, after = status_json(work)
    assert rc == 0 and after["identity"] == before["identity"]
    assert [r["tensors"] for r in after["ranks"]] == [r["tensors"] for r in before["ranks"]]


def test_two_concurrent_reloads_never_end_consistent_over_mixed_weights(
    work, ckpts, session
) -> None:
    a = started(work, "reload", ckpts["v4"], "--json")
    b = started(work, "reload", ckpts["v5"], "--json")
    outs = {}
    for name, proc in (("v4", a), ("v5", b)):
        _, stderr = proc.communicate(timeout=600)
        outs[name] = (proc.returncode, stderr)
    print("concurrent reloads:", {k: (rc, err[-300:]) for k, (rc, err) in outs.items()})
    for name, (rc, err) in outs.items():
        assert rc in (0, 2), (name, rc, err[-2000:])
        if rc == 2:  # refused: it names the reload that holds the session
            assert "busy" in err and "reload from" in err, err[-2000:]
    assert any(rc == 0 for rc, _ in outs.values())
    rc, st = status_json(work)
    if rc == 0:
        assert st["consistent"] is True
        winner = st["identity"]["src"]
        assert winner in (ckpts["v4"], ckpts["v5"])
        assert dump_matches(work, winner, "dump-concurrent") == []
    else:  # reported inconsistent: allowed, never silently mixed
        assert st["consistent"] is False and st["problems"]


def test_a_restarted_rank_shows_in_human_status(work: Path, ckpts, session) -> None:
    """kill -9 of one rank's worker: Ray restarts it empty; status reloads it to the
    session's checkpoint and says, in its human output, that its addresses changed."""
    _, before = status_json(work)
    pid = before["ranks"][2]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    human = mx_here(work, "status")
    assert human.returncode == 0, show(human)
    assert human.stdout.startswith("CONSISTENT:"), show(human)
    assert "rank 2 was lost and restarted" in human.stdout, show(human)
    assert "recaptured" in human.stdout
    assert dump_matches(work, before["identity"]["src"], "dump-restarted") == []


@pytest.fixture
def full_disk(tmp_path: Path):
    """A real file system with no room left (a 64 KiB tmpfs, filled): new empty files
    can be made there, no bytes written. Needs the right to mount (root here)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode()[:200]}")
    try:
        with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_reload_whose_report_finds_a_full_disk_says_the_weights_are_replaced(
    work: Path, ckpts, session, full_disk: Path
) -> None:
    """--report on a full disk passes the check before any work (an empty file can still
    be made there) and fails once the weights were replaced: exit 2 as every output
    failure, with the reload's own outcome printed and the line saying the weights ARE
    replaced (it read as a reload that did not happen)."""
    assert session.returncode == 0, show(session)
    _, before = status_json(work)
    target = before["identity"]["version"] + 1
    proc = mx_here(work, "reload", ckpts["v3"], "--report", str(full_disk / "r.json"))
    assert proc.returncode == 2, show(proc)
    first = proc.stderr.splitlines()[0]
    assert "the weights ARE replaced" in first and f"version {target}" in first, show(proc)
    assert "--report" in first and "r.json" in first, show(proc)
    assert f"reloaded to version {target}" in proc.stdout, show(proc)
    rc, after = status_json(work)
    assert rc == 0 and after["identity"]["version"] == target
    assert after["identity"]["src"] == ckpts["v3"]


def test_a_stopped_rank_is_named_in_seconds(work: Path, ckpts, session) -> None:
    """SIGSTOP of one rank's worker: status and reload say which rank, in one line and in
    seconds (Ray's call would wait 42 s and name none); resumed, status is whole again."""
    _, before = status_json(work)
    pid = before["ranks"][1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        for args in (["status"], ["reload", ckpts["v2"]]):
            t0 = time.monotonic()
            proc = mx_here(work, *args)
            print(f"{args[0]} with rank 1 stopped: {time.monotonic() - t0:.1f} s")
            first = proc.stderr.splitlines()[0]
            assert proc.returncode == 1 and "rank 1 (pid" in first, show(proc)
            assert f"kill -CONT {pid}" in first and "\x1b" not in proc.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    rc, after = status_json(work)
    assert rc == 0 and after["identity"] == before["identity"], after["problems"]


def test_a_reload_suspended_past_its_lease_writes_nothing(work: Path, ckpts, session) -> None:
    """Ctrl-Z of a reload holding the lease, longer than the lease (2 s here): another
    reload is admitted and completes; the first, resumed, is fenced off (one line naming
    the reload that won, exit 2, no state recorded), and the session keeps the later
    checkpoint, checked byte for byte."""
    import ray
    from mxload.orchestrator.runtime.detached import _keeper
    from mxload.orchestrator.runtime.heads import connect_session

    assert session.returncode == 0, show(session)
    stale = subprocess.Popen(
        [*MXLOAD, "reload", ckpts["v3"]],
        cwd=work / "cwd",
        env=dict(env_of(work), MXLOAD_LEASE_TTL_S="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with home_of(work):
            connect_session(None)
            try:
                keeper = _keeper("default")
                deadline = time.monotonic() + 120
                while ray.get(keeper.holder.remote()) is None:
                    assert stale.poll() is None and time.monotonic() < deadline, stale.stderr
                    time.sleep(0.02)
                os.kill(stale.pid, signal.SIGSTOP)
            finally:
                ray.shutdown()
        time.sleep(2.5)  # past its lease
        later = mx_here(work, "reload", ckpts["v4"])
        assert later.returncode == 0, show(later)
        rc, mid = status_json(work)
        assert rc == 0 and mid["identity"]["src"] == ckpts["v4"], mid["problems"]
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    t0 = time.monotonic()
    _, err = stale.communicate(timeout=120)
    print(f"a resumed stale reload: exit {stale.returncode} in {time.monotonic() - t0:.1f} s")
    # Never 0: its caller must not believe it is on the devices. It names the reload
    # that took the session over (this process ran it) and what the session holds.
    assert stale.returncode == 2, err
    first, *rest = err.splitlines()
    assert first.startswith("mxload: error:") and "fenced off" in first, err
    assert f"reload from {ckpts['v4']} by pid {os.getpid()}" in first, err
    assert f"the session holds version {mid['identity']['version']} from {ckpts['v4']}" in first
    assert all(line.startswith("mxload: the traceback is in") for line in rest), err
    rc, after = status_json(work)
    assert rc == 0, after["problems"]
    assert after["identity"] == mid["identity"], "the version went back"
    assert any("refused" in n for n in after["notices"]), after["notices"]
    assert dump_matches(work, ckpts["v4"], "dump-fenced") == []


def test_a_keeper_killed_during_a_reload_keeps_the_state_and_the_reload_its_lease(
    work: Path, ckpts, session
) -> None:
    """kill -9 of the keeper while a reload holds the lease, after the `load` that made
    the session (and its state, larger than Ray passes inline) has exited: Ray restarts
    the keeper with the session's state, the reload keeps its lease and records its
    version (exit 0), and status holds that checkpoint, byte for byte."""
    import ray
    from mxload.orchestrator.runtime.detached import _keeper
    from mxload.orchestrator.runtime.heads import connect_session

    from tests.servers import RangeHTTPServer

    assert session.returncode == 0, show(session)
    _, before = status_json(work)
    root = Path(ckpts["v3"])
    with RangeHTTPServer(str(root.parent), bandwidth=1_000_000) as server:
        url = f"{server.url}/{root.name}"
        slow = started(work, "reload", url)
        with home_of(work):
            connect_session(None)
            try:
                keeper = _keeper("default")
                pid = ray.get(keeper.pid.remote())
                deadline = time.monotonic() + 120
                while ray.get(keeper.holder.remote()) is None:
                    assert slow.poll() is None and time.monotonic() < deadline
                    time.sleep(0.05)
            finally:
                ray.shutdown()
        time.sleep(1.0)  # reading
        assert slow.poll() is None, "the reload ended before the keeper was killed"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = slow.communicate(timeout=180)
    print(
        f"keeper killed during a reload: exit {slow.returncode} after {time.monotonic() - t0:.1f} s"
    )
    assert slow.returncode == 0, err
    rc, after = status_json(work)
    assert rc == 0, after["problems"]
    assert after["identity"]["src"] == url
    assert after["identity"]["version"] == before["identity"]["version"] + 1
    assert any("keeper died and was restarted" in n for n in after["session_events"])
    assert dump_matches(work, ckpts["v3"], "dump-keeper-killed") == []


def test_a_killed_keeper_comes_back_and_one_gone_for_good_is_named(work: Path, ckpts, session):
    """kill -9 of the session's keeper (an OOM victim): Ray restarts it with the state it
    had (status, reload keep working). Ended for good (no restart): status and a new
    `load --detach` of the name say in one line what to run; release ends the remains."""
    import ray
    from mxload.orchestrator.runtime.detached import _keeper
    from mxload.orchestrator.runtime.heads import connect_session

    assert session.returncode == 0, show(session)
    _, before = status_json(work)
    with home_of(work):
        connect_session(None)
        try:
            pid = ray.get(_keeper("default").pid.remote())
        finally:
            ray.shutdown()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    rc, after = status_json(work)
    print(f"status after the keeper's kill -9: {time.monotonic() - t0:.1f} s")
    assert rc == 0 and after["identity"] == before["identity"], after["problems"]
    assert any("keeper died and was restarted" in n for n in after["notices"])
    done = mx_here(work, "reload", ckpts["v5"])
    assert done.returncode == 0, show(done)
    rc, after = status_json(work)
    assert rc == 0 and after["identity"]["version"] == before["identity"]["version"] + 1

    with home_of(work):
        connect_session(None)
        try:
            ray.kill(_keeper("default"))  # no restart
        finally:
            ray.shutdown()
    for args in (["status"], ["load", ckpts["v1"], *LAYOUT, "--device", "cpu", "--detach"]):
        t0 = time.monotonic()
        proc = mx_here(work, *args)
        print(f"{args[0]} with the keeper gone: {time.monotonic() - t0:.1f} s")
        assert proc.returncode == 2, show(proc)
        assert proc.stderr.count("\n") == 1 and "keeper is gone for good" in proc.stderr
        assert "mxload release --session default" in proc.stderr
    gone = mx_here(work, "release", "--json")
    assert gone.returncode == 0 and json.loads(gone.stdout)["workers_ended"] == 4, show(gone)
    assert "no such session" in mx_here(work, "status").stderr


# --- session names ------------------------------------------------------------------------


UNSAFE_NAMES = ["", "/", "..", ".", "a b", "x\x01y", "a/keeper", ".hidden", "t\n", "x" * 65]


def test_unsafe_session_names_are_refused(work: Path, ckpts) -> None:
    """Every unsafe name is refused by the library (the CLI's path) before anything starts;
    one per command through the CLI (exit 2, naming --session, no traceback)."""
    from mxload.orchestrator.errors import SessionError
    from mxload.orchestrator.runtime.records import check_session_name

    for name in UNSAFE_NAMES:
        with pytest.raises(SessionError, match="--session"):
            check_session_name(name)
    for ok in ("default", "policy-7", "ref_model.v2", "A" * 64):
        assert check_session_name(ok) == ok
    for args in (
        ["load", ckpts["v1"], "--device", "cpu", "--detach", "--session", ""],
        ["load", ckpts["v1"], "--device", "cpu", "--detach", "--session", "a/keeper"],
        ["status", "--session", ".."],
        ["reload", ckpts["v1"], "--session", "a b"],
        ["release", "--session", "x\x01y"],
    ):
        proc = mx(work, *args, timeout=120)
        assert proc.returncode == 2, (args, show(proc))
        assert proc.stderr.startswith("mxload: error:") and "--session" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (work / "home" / "sessions" / ".json").exists()


# --- 4: a head that crashed ---------------------------------------------------------------


def _kill_and_check(work: Path, role: str, *, killed: bool = False) -> None:
    head = json.loads((work / "home" / "head.json").read_text())
    victim = next(p for p in head["processes"] if p["role"] == role)
    if not killed:
        os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(1.0)

    t0 = time.monotonic()
    st = mx(work, "status", timeout=120)
    took = time.monotonic() - t0
    assert st.returncode == 1, show(st)
    assert f"{role} (pid {victim['pid']})" in st.stderr and "down" in st.stderr, show(st)
    assert "Traceback" not in st.stderr
    print(f"\n{role} killed: status answered in {took:.1f}s (rc {st.returncode})")
    assert took < BOUND_S, f"status took {took:.1f}s"

    t0 = time.monotonic()
    rel = mx(work, "release", "--json", timeout=120)
    took = time.monotonic() - t0
    assert rel.returncode == 0, show(rel)
    print(f"{role} killed: release answered in {took:.1f}s")
    assert took < BOUND_S, f"release took {took:.1f}s"
    info = json.loads(rel.stdout)
    assert any(role in d for d in info["head_down"]), info
    assert not (work / "home" / "head.json").exists()
    assert not Path(head["temp_dir"]).exists()
    assert list((work / "home" / "sessions").glob("*.json")) == []
    # Nothing of the head or its session is left running (by recorded pid and by folder).
    deadline = time.monotonic() + 10
    while processes_in(work / "cwd") and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_in(work / "cwd")
    described = []
    for pid in left:
        try:
            described.append(" ".join(psutil.Process(pid).cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    end_processes(left)
    assert described == [], described
    again = mx_here(work, "status")
    assert again.returncode == 2 and "no running Ray head is recorded" in again.stderr, show(again)


def test_gcs_killed(work: Path, ckpts, session) -> None:
    """Runs on the module's session (kill -9 of its GCS)."""
    assert session.returncode == 0, show(session)
    _kill_and_check(work, "gcs_server")


def test_status_address_of_the_recorded_head_uses_its_token_then_raylet_killed(
    work: Path, ckpts
) -> None:
    """A second head, of one rank (the rank count is not what is checked): ``status
    --address`` of the recorded head, by its address and by ``localhost``, joins with the
    head's token; then kill -9 of its raylet. (The module's session, when a test before
    left it running, is released first, so that this is a head of its own.)"""
    if (work / "home" / "head.json").exists():
        rel = mx(work, "release", "--json", timeout=180)
        assert rel.returncode == 0, show(rel)
    load = mx(work, "load", ckpts["v1"], "--device", "cpu", "--detach")
    assert load.returncode == 0, show(load)
    head = json.loads((work / "home" / "head.json").read_text())
    port = head["address"].rpartition(":")[2]
    for address in (head["address"], f"localhost:{port}"):
        st = mx_here(work, "status", "--address", address, "--json")
        assert st.returncode == 0, show(st)
        assert json.loads(st.stdout)["consistent"] is True
    # The raylet dies while a reload runs (from a slow server, so that it is mid-way):
    # the reload names the head, in seconds, in one line, with no Ray log or colour.
    import ray
    from mxload.orchestrator.runtime.detached import _keeper
    from mxload.orchestrator.runtime.heads import connect_session

    from tests.servers import RangeHTTPServer

    raylet = next(p for p in head["processes"] if p["role"] == "raylet")
    root = Path(ckpts["v2"])
    with RangeHTTPServer(str(root.parent), bandwidth=100_000) as server:
        slow = started(work, "reload", f"{server.url}/{root.name}")
        with home_of(work):
            connect_session(None)
            try:
                keeper = _keeper("default")
                deadline = time.monotonic() + 120
                while ray.get(keeper.holder.remote()) is None:
                    assert slow.poll() is None and time.monotonic() < deadline
                    time.sleep(0.05)
            finally:
                ray.shutdown()
        time.sleep(1.0)  # reading
        assert slow.poll() is None, "the reload ended before the raylet was killed"
        os.kill(raylet["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = slow.communicate(timeout=180)
        took = time.monotonic() - t0
    print(f"raylet killed during a reload: exit {slow.returncode} after {took:.1f} s")
    first = err.splitlines()[0] if err else ""
    assert slow.returncode == 1 and f"raylet (pid {raylet['pid']})" in first, err
    assert "\x1b" not in err and len(err.splitlines()) <= 2, err
    assert took < BOUND_S, took
    _kill_and_check(work, "raylet", killed=True)
