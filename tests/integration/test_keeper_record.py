"""A detached session's keeper on the shared local Ray: started from its key alone, its
record in the GCS holds no credential (docs/contract.md §4 "Credentials"), and a keeper
Ray restarts has the state, the fence and the lease it had. Where the credentials are
kept instead: tests/unit/test_session_trust.py.

The same keeper in a real detached session, killed during a reload:
tests/integration/test_session_trust.py.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import psutil
import pytest

pytestmark = pytest.mark.ray

SECRET = "AKIA-not-a-real-key-0123"
NUMERIC = 987654321
"""A header value that is a number in JSON: a secret all the same."""
OPTIONS = {
    "key": SECRET,
    "client_kwargs": {"headers": {"X-Token": NUMERIC}},
    "mxload_connect_timeout_s": 7.0,
}


@pytest.fixture(scope="module")
def state(ckpt_factory):
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.orchestrator.runtime.request import LoadRequest
    from mxload.orchestrator.runtime.state import SessionState

    src = ckpt_factory("qwen3-moe-tiny", 1)
    meta = open_checkpoint(src)
    layout = ParallelLayout(tp=2)
    plan = build_plan(meta.config, layout, checkpoint=meta)
    req = LoadRequest(src=src, layout=layout, storage_options=OPTIONS)
    return SessionState(
        plan,
        src,
        meta.fingerprint,
        {0: {}, 1: {}},
        {0: 1, 1: 2},
        storage_options=OPTIONS,
        request=req,
        session=f"keeper-test-{os.getpid()}",
    )


def _holder(token: str):
    from mxload.orchestrator.runtime.state import LeaseHolder

    me = psutil.Process()
    return LeaseHolder(token, me.pid, me.create_time(), socket.gethostname(), "reload", "x")


def test_a_keeper_restarts_from_its_record_which_holds_no_credential(local_ray, state) -> None:
    from mxload.cluster import raycompat
    from mxload.orchestrator.runtime.keeper import (
        PLAN_SUFFIX,
        STATE_SUFFIX,
        SessionKeeper,
        store,
    )

    ray = local_ray
    key = store(state)
    keeper = (
        ray.remote(num_cpus=0)(SessionKeeper)
        .options(max_restarts=1, max_task_retries=-1)
        .remote(key)
    )
    try:
        lease = ray.get(keeper.acquire.remote(_holder("t1"), 60.0))
        newer = dataclasses.replace(state, version=2)  # with its credentials
        assert ray.get(keeper.put.remote(newer, "t1")) == ""
        names = [key + suffix for suffix in ("", STATE_SUFFIX, PLAN_SUFFIX)]
        for name in names:
            raw = raycompat.kv_get(name)
            assert raw is not None
            assert SECRET.encode() not in raw and str(NUMERIC).encode() not in raw, name
        held = ray.get(keeper.get.remote())
        assert held.storage_options == {"mxload_connect_timeout_s": 7.0}
        assert held.request.storage_options == {"mxload_connect_timeout_s": 7.0}

        os.kill(ray.get(keeper.pid.remote()), 9)  # Ray restarts it from its key alone
        back = ray.get(keeper.get.remote(), timeout=120)
        assert (back.version, back.fingerprint, back.plan) == (2, state.fingerprint, state.plan)
        assert ray.get(keeper.holder.remote()).fence == lease.fence
        assert ray.get(keeper.renew.remote("t1", 60.0)) is True
        assert any("restarted" in n for n in ray.get(keeper.events.remote()))
        # Who holds the session's result is kept too: a command fenced off after the
        # restart is still told the command that won (docs/contract.md §4).
        won = ray.get(keeper.took_over.remote(lease.fence - 1))
        assert won is not None and (won.fence, won.holder.token) == (lease.fence, "t1")
    finally:
        ray.get(keeper.forget.remote())
        # release gives its own lease back after forgetting: that writes nothing back
        ray.get(keeper.release.remote("t1"))
        ray.kill(keeper)
    assert [raycompat.kv_get(name) for name in names] == [None, None, None]
