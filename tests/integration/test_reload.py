"""Hot reload in place and faults, on a real local Ray (docs/contract.md §4 Reload,
Faults).

The tests that only reload share one 4-rank (TP 2 x DP 2, EP) session, loaded once per
module (:func:`shared`); each starts by reloading it to its own first checkpoint, so it
passes alone or in any order. Tests that kill workers or need another load-time setting
share a second, 2-rank session (:func:`small`); only the tests of a load that loses a
worker start their own (starting rank workers is most of a test's cost). Every check reads the devices' bytes back and
compares them with the independent reference of the version that should be there;
addresses are compared with the first load's. A worker process dies for real
(``os._exit``) in a test-only subclass of the worker (:func:`dying_worker`).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
import torch
from mxload.orchestrator.errors import ReloadMismatch, StorageError, WorkerLost
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.driver import first_load, plan_load
from mxload.orchestrator.runtime.liveness import RankSilent
from mxload.orchestrator.runtime.ray_run import RayRun
from mxload.orchestrator.runtime.reports import write_dump
from mxload.orchestrator.runtime.request import LoadRequest
from mxload.orchestrator.runtime.session import Session
from mxload.workers.rank.actor import RankWorker

from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank
from tests.servers import Faults, RangeHTTPServer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LAYOUT = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
LAY = Layout(2, 2, 1, True, "linear")
SMALL = ParallelLayout(tp=2)
"""For tests whose claim does not depend on the rank count: two rank workers, not four."""
SMALL_LAY = Layout(2, 1, 1, False, "linear")


def _raw_to_tensors(raw: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, (dtype, shape, data) in raw.items():
        t = torch.from_numpy(data.copy()).view(getattr(torch, dtype)).reshape(shape)
        out[name] = t
    return out


def held(session: Session, rank: int) -> dict[str, torch.Tensor]:
    return _raw_to_tensors(ray.get(session.run.actors[rank].host_tensors.remote()))


def assert_holds(session: Session, src: str, like: str | None = None, lay: Layout = LAY) -> None:
    ref = RefCheckpoint(src)
    like_ref = RefCheckpoint(like) if like else None
    for rank in range(lay.world):
        problems = compare_rank(expected_rank(ref, lay, rank, like=like_ref), held(session, rank))
        assert problems == [], f"rank {rank}: {problems[:8]}"


@pytest.fixture(scope="module")
def shared_session(local_ray, ckpt_factory):
    """One 4-rank session of seed 1 for the module's reload-only tests."""
    with Session.load(ckpt_factory("qwen3-moe-tiny", 1), LAYOUT, device="cpu") as s:
        yield s


@pytest.fixture
def shared(shared_session: Session, ckpt_factory) -> Session:
    """The shared session, reloaded to seed 1 (consistent) unless it already holds it: a
    fresh state without starting workers. Its version number is wherever the module left
    it, so tests compare versions with the one they start from."""
    v1 = ckpt_factory("qwen3-moe-tiny", 1)
    st = shared_session.status()
    if not (st["consistent"] and shared_session.state.src == v1):
        shared_session.reload(v1)
        assert shared_session.status()["consistent"] is True
    return shared_session


@pytest.fixture(scope="module")
def small(local_ray, ckpt_factory):
    """A second, 2-rank session (each rank reads for itself, two restarts allowed) for the
    tests that break storage or kill a worker under a live session; each test compares
    versions with the one it starts from, so it passes alone or in any order."""
    v1 = ckpt_factory("qwen3-moe-tiny", 1)
    with Session.load(v1, SMALL, device="cpu", share="none", max_restarts=2) as s:
        yield s


def dying_worker(exit_after: dict[int, int]) -> type[RankWorker]:
    """A worker whose process exits hard (a real death, no exception) once rank N has
    written ``exit_after[N]`` units, in its first process only: Ray's restart of it
    loads normally. Defined in a function so Ray ships the class by value."""

    class DyingRankWorker(RankWorker):
        def _set_progress(self, done: int, total: int, nbytes: int) -> None:
            super()._set_progress(done, total, nbytes)
            at = exit_after.get(self.loader.rank)
            if at is not None and done >= at:
                if not ray.get_runtime_context().was_current_actor_reconstructed:
                    os._exit(17)

    return DyingRankWorker


def load_with(req: LoadRequest, worker: type[RankWorker], dump: str | None = None) -> dict:
    """``driver.load`` with another worker class: plan, start, first load, dump."""
    meta, plan = plan_load(req)
    run = RayRun(req, plan, worker=worker)
    try:
        run.start()
        manifest = first_load(run, meta)
        if dump:
            write_dump(run, manifest, dump)
        return manifest
    finally:
        run.shutdown()


def addresses(manifest: dict) -> dict:
    return {
        (r["rank"], n): t["data_ptr"] for r in manifest["ranks"] for n, t in r["tensors"].items()
    }


def test_reload_three_times_keeps_addresses(shared: Session, ckpt_factory) -> None:
    versions = [ckpt_factory("qwen3-moe-tiny", seed) for seed in (1, 2, 3, 4)]
    s = shared
    assert_holds(s, versions[0])
    start = s.version
    first = addresses(s.manifest)
    sums = {
        (r["rank"], n): t["checksum"] for r in s.manifest["ranks"] for n, t in r["tensors"].items()
    }
    for i, src in enumerate(versions[1:], start=1):
        m = s.reload(src)
        assert addresses(m) == first, "a buffer moved"
        assert m["addresses_moved"] == []
        assert all(r["version"] == start + i and r["consistent"] for r in m["ranks"])
        assert_holds(s, src)
    changed = sum(
        1
        for r in m["ranks"]
        for n, t in r["tensors"].items()
        if t["checksum"] != sums[(r["rank"], n)]
    )
    assert changed > 0.9 * len(sums), "values must change between versions"


def test_mismatched_reload_refused_and_nothing_touched(shared: Session, ckpt_factory) -> None:
    v1 = ckpt_factory("qwen3-moe-tiny", 1)
    other = ckpt_factory(
        "qwen3-moe-tiny", 7, overrides={"moe_intermediate_size": 96}
    )  # every expert another shape
    s = shared
    version = s.version
    before = s.status()
    with pytest.raises(ReloadMismatch) as err:
        s.reload(other)
    assert "w13_weight" in str(err.value) and "shape" in str(err.value)
    after = s.status()
    for a, b in zip(before["ranks"], after["ranks"], strict=True):
        assert {n: t["checksum"] for n, t in a["tensors"].items()} == {
            n: t["checksum"] for n, t in b["tensors"].items()
        }
        assert b["version"] == version
    assert_holds(s, v1)


def test_reload_from_bf16_trainer_checkpoint(shared: Session, ckpt_factory) -> None:
    """What an RL trainer writes: BF16 linears, MX-quantized straight into the buffers."""
    v1 = ckpt_factory("qwen3-moe-tiny", 1)
    bf16 = ckpt_factory("qwen3-moe-tiny", 2, bf16=True)
    first = addresses(shared.manifest)
    m = shared.reload(bf16)
    assert addresses(m) == first
    assert_holds(shared, bf16, like=v1)


def test_reload_over_flaky_http(small: Session, ckpt_factory) -> None:
    """Failed requests and connections cut mid-body are retried: every byte arrives."""
    src = ckpt_factory("qwen3-moe-tiny", 3)
    first = addresses(small.manifest)
    with RangeHTTPServer(src, Faults(fail_fraction=0.05, cut_fraction=0.03)) as server:
        m = small.reload(server.url)
        assert server.injected_failures > 0 and server.injected_cuts > 0
    assert all(r["consistent"] for r in m["ranks"]) and addresses(m) == first
    assert_holds(small, src, lay=SMALL_LAY)


def test_worker_killed_mid_load_is_restarted_and_redone(local_ray, ckpt_factory, tmp_path) -> None:
    src = ckpt_factory("qwen3-moe-tiny", 1)
    dump = str(tmp_path / "dump")
    manifest = load_with(
        LoadRequest(src=src, layout=SMALL, device="cpu", max_restarts=1),
        dying_worker({1: 5}),
        dump,
    )
    r1 = manifest["ranks"][1]
    assert r1["restarts"] == 1 and r1["addresses_changed"] is True
    assert [r["restarts"] for r in manifest["ranks"] if r["rank"] != 1] == [0]
    from safetensors.torch import load_file

    ref = RefCheckpoint(src)
    for rank in range(SMALL.world):
        got = load_file(os.path.join(dump, f"rank-{rank:05d}.safetensors"))
        assert compare_rank(expected_rank(ref, SMALL_LAY, rank), got) == []


def test_worker_lost_beyond_restarts(local_ray, ckpt_factory) -> None:
    src = ckpt_factory("qwen3-moe-tiny", 1)
    with pytest.raises(WorkerLost) as err:
        load_with(
            LoadRequest(src=src, layout=SMALL, device="cpu", max_restarts=0),
            dying_worker({1: 3}),
        )
    assert "rank 1" in str(err.value)


def test_interrupted_reload_runs_again_to_completion(small: Session, ckpt_factory) -> None:
    v2 = ckpt_factory("qwen3-moe-tiny", 2)
    s = small
    start = s.version
    first = addresses(s.manifest)
    with RangeHTTPServer(v2) as server:
        # Each rank reads for itself (--share none): with sharing, the owners' fetch of
        # the shared reads fails first and no rank writes a unit (nothing part-way).
        # The second shard's data becomes unreadable after planning, for good: every rank
        # stops at its first unit that needs it, with earlier units already written.
        server.faults = Faults(data_gone=frozenset({"model-00002-of-00002.safetensors"}))
        with pytest.raises(StorageError) as err:
            s.reload(server.url)
        msg = str(err.value)
        assert "rank " in msg and ".safetensors" in msg and "bytes" in msg, msg
        assert err.value.exit_code == 1
        st = s.status()
        assert any(not r["consistent"] for r in st["ranks"]), "part-way: mixed versions"
        assert all(r["version"] == start for r in st["ranks"])
        server.faults = Faults()
        m = s.reload(server.url)
        assert all(r["version"] == start + 1 and r["consistent"] for r in m["ranks"])
        assert addresses(m) == first
        assert_holds(s, v2, lay=SMALL_LAY)


def test_a_rank_stopped_during_a_reload_is_named_and_the_wait_ends(
    small: Session, ckpt_factory
) -> None:
    """SIGSTOP of rank 1's worker once the reload runs (after every check before it):
    the reload names rank 1, its pid and what resumes it once its answer timeout (2 s
    here) passed and rank 0 finished, instead of waiting for ever; resumed, the same
    reload run again completes.
    The checkpoint is served slowly (0.1 s per request) so the rank is still reading
    when it is stopped."""
    s = small
    v5 = ckpt_factory("qwen3-moe-tiny", 5)
    pid = s.run.pids()[1]
    assert pid is not None
    stopped: list[float] = []

    def stop_rank_1(_progress: object) -> None:
        if not stopped:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(time.monotonic())

    s.run.answer_timeout_s = 2.0
    try:
        with RangeHTTPServer(v5, Faults(etag=True), latency=0.1) as server:
            try:
                with pytest.raises(RankSilent) as err:
                    s.reload(server.url, on_progress=stop_rank_1)
                waited = time.monotonic() - stopped[0]
                with pytest.raises(RankSilent) as silent:
                    s.status()  # asked while rank 1 is still stopped: named, not waited for
                assert str(silent.value).startswith("rank(s) 1 did not answer in 2 s"), silent
            finally:
                os.kill(pid, signal.SIGCONT)
            server.state.latency = 0.0
            print(f"a stopped rank named after {waited:.1f} s: {err.value}")
            msg = str(err.value)
            assert msg.startswith(f"rank 1 (pid {pid}) did not answer in 2 s"), msg
            assert f"kill -CONT {pid}" in msg and err.value.exit_code == 1
            assert waited < 30, "bounded by the answer timeout, not by the load"
            # Rank 0, which answered, was waited for: it is free at once. The resumed
            # rank 1 finishes its own run first (a rank runs one load at a time).
            assert ray.get(s.run.actors[0].fence.remote(0, 0.0)) is True
            assert ray.get(s.run.actors[1].fence.remote(0, 60.0)) is True
            m = s.reload(server.url)
    finally:
        s.run.answer_timeout_s = 60.0
    assert all(r["consistent"] for r in m["ranks"])
    assert_holds(s, v5, lay=SMALL_LAY)


def test_killed_worker_of_a_session_reports_changed_addresses(small: Session, ckpt_factory) -> None:
    v4 = ckpt_factory("qwen3-moe-tiny", 4)
    s = small
    start = s.version
    pid = ray.get(s.run.actors[1].pid.remote())
    os.kill(pid, signal.SIGKILL)
    # Asked at once, while Ray restarts the process: the rank answers once restarted
    # (what ``mxload status`` asks first), never a raw "actor is restarting".
    now = s.run.pids()
    assert now[1] is not None and now[1] != pid, now
    m = s.reload(v4)
    r1 = m["ranks"][1]
    assert r1["addresses_changed"] is True and r1["restarts"] >= 1
    assert all(r["version"] == start + 1 for r in m["ranks"] if r["rank"] != 1)
    assert_holds(s, v4, lay=SMALL_LAY)


def test_a_repair_survives_its_rank_dying_again(small: Session, ckpt_factory) -> None:
    """repair() (what `mxload status` runs for a restarted rank) goes through the run's
    restart handling: rank 0 killed (-9), then killed again while its repair reads (the
    checkpoint served at 0.05 s per request), is restarted and redone, and holds the
    session's checkpoint, its new addresses recorded."""
    import threading

    from mxload.orchestrator.runtime.reload import repair

    s = small
    v3 = ckpt_factory("qwen3-moe-tiny", 3)
    with RangeHTTPServer(v3, Faults(etag=True)) as server:
        s.reload(server.url)
        first = s.run.pids()[0]
        assert first is not None
        os.kill(first, signal.SIGKILL)
        second = s.run.pids()[0]  # answers once Ray restarted it
        assert second is not None and second != first
        server.state.latency = 0.05
        killed: list[int] = []

        def kill_mid_repair() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done, total, _ = ray.get(s.run.actors[0].progress.remote())
                if 1 <= done < total:
                    os.kill(second, signal.SIGKILL)
                    killed.append(second)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_mid_repair)
        killer.start()
        try:
            assert repair(s.run, s.state, lambda _: None) == [0]
        finally:
            killer.join()
        assert killed == [second], "rank 0 died during its repair"
    third = s.run.pids()[0]
    assert third not in (None, first, second) and s.state.pids[0] == third
    assert 0 in s.state.restarted
    assert_holds(s, v3, lay=SMALL_LAY)


def test_two_sessions_side_by_side(shared: Session, small: Session, ckpt_factory) -> None:
    """A policy and a reference model held at once; reloading one leaves the other alone."""
    v2 = ckpt_factory("qwen3-moe-tiny", 2)
    policy = shared
    reference = small
    ref_before = reference.status()
    policy.reload(v2)
    assert_holds(policy, v2)
    ref_after = reference.status()
    for a, b in zip(ref_before["ranks"], ref_after["ranks"], strict=True):
        assert {n: t["checksum"] for n, t in a["tensors"].items()} == {
            n: t["checksum"] for n, t in b["tensors"].items()
        }
    devices = {r["visible_devices"] for r in policy.manifest["ranks"]} | {
        r["visible_devices"] for r in reference.manifest["ranks"]
    }
    assert len(devices) == 6, "each rank of each session has its own device"


def test_failed_reload_on_one_rank_then_another_checkpoint_in_process(
    shared: Session, ckpt_factory, tmp_path
) -> None:
    """The Python API's view of a version as an identity (docs/contract.md §4): a reload
    that fails on rank 3 only (a NaN block scale in expert 7, rank 3's alone under EP),
    then a reload from another checkpoint at the same version number: every rank ends
    with that checkpoint's bytes, and ``status`` says inconsistent in between. A second
    reload from another thread while one runs is refused."""
    import shutil
    import threading

    from mxload.orchestrator.errors import NonFiniteScale, SessionBusy
    from safetensors.torch import load_file, save_file

    v3 = ckpt_factory("qwen3-moe-tiny", 3)
    nan = tmp_path / "nan"
    shutil.copytree(ckpt_factory("qwen3-moe-tiny", 2), nan)
    name = "model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"
    with open(nan / "model.safetensors.index.json") as f:
        file = json.load(f)["weight_map"][name]
    tensors = load_file(nan / file)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, nan / file, metadata={"format": "pt"})
    s = shared
    start = s.version
    assert s.status()["consistent"] is True
    with pytest.raises(NonFiniteScale, match="rank 3"):
        s.reload(str(nan))
    st = s.status()
    assert st["consistent"] is False and st["problems"], st
    assert [r["identity"] is None for r in st["ranks"]] == [False, False, False, True]
    assert any("failed" in n for n in st["notices"])

    entered, release = threading.Event(), threading.Event()
    real = s.run.run_all

    def slow_run_all(*args, **kwargs):  # holds the first reload inside the session
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    s.run.run_all = slow_run_all  # type: ignore[method-assign]
    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.setdefault("m", s.reload(v3)))
    t.start()
    try:
        assert entered.wait(120)
        with pytest.raises(SessionBusy):
            s.reload(ckpt_factory("qwen3-moe-tiny", 4))
    finally:
        release.set()
        t.join(300)
        del s.run.run_all  # the shared session's own method again
    assert all(r["version"] == start + 1 and r["consistent"] for r in outcome["m"]["ranks"])
    st = s.status()
    assert st["consistent"] is True, st["problems"]
    assert_holds(s, v3)
