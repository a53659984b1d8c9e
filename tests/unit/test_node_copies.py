"""Node copies of a refit (``workers.transfer.copies``) between two engine ranks over a
real shared-memory transport, each rank driven from its own thread: what the giver holds
is what the taker holds after, each buffer given only once written, a delta moves only
changed buffers, and a giver that fails, a step that differs or a fence is named, not
waited on for ever."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from mxload.orchestrator.errors import ReloadMismatch, RunError
from mxload.orchestrator.plan.refit import refit_plan
from mxload.orchestrator.plan.trainer import fsdp_manifest
from mxload.workers.transfer.copies import NodeCopies
from mxload.workers.transfer.transports import ShmTransport

from tests.integration.test_refit import on_threads
from tests.unit.test_refit_plan import needed_shapes, preset_plan


def _plan() -> Any:
    # qwen3-dense-tiny at tp2 x dp2 on one node: ranks 2 and 3 copy all they hold from
    # ranks 0 and 1 (data-parallel replicas)
    # (ranks 1 and 3 copy norms from rank 0 too: left out, only 0 and 2 run here)
    plan = preset_plan("qwen3-dense-tiny")
    rp = refit_plan(plan, fsdp_manifest(needed_shapes(plan), 2), devices_per_node=4)
    return plan, replace(rp, copies=tuple(c for c in rp.copies if c.receiver == 2))


def _buffers(plan: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in plan.ranks[rank].buffers:
        t = torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=g)
        out[b.name] = t
    return out


def _copy(side: NodeCopies, step: int, buffers: Any, **kw: Any) -> Any:
    """One update's copies on ``side``, as the loader drives them: started, then
    finished (its own update whole)."""

    def go() -> int:
        side.start(
            step,
            buffers,
            kw.get("changed", lambda u: True),
            kw.get("check", lambda: None),
            kw.get("written", lambda units: True),
            lambda: None,
        )
        return side.finish()

    return go


def _pair(plan: Any, rp: Any, tmp_path: Any, timeout: float = 10.0) -> tuple[Any, Any]:
    def side(rank: int) -> NodeCopies:
        tx = ShmTransport(
            2 + rank, 2, 6, slot_bytes=4096, group="c", directory=str(tmp_path),
            timeout_s=timeout,
        )  # fmt: skip
        return NodeCopies(rp.only(receiver=rank), rank, plan.ranks[rank].units, tx, 2, 4096)

    return side(0), side(2)


def test_the_taker_holds_what_the_giver_wrote_and_a_delta_moves_changed_buffers(
    tmp_path: Any,
) -> None:
    plan, rp = _plan()
    (c,) = rp.copies_into(2)
    assert c.source == 0 and set(c.units) == set(range(len(plan.ranks[2].units)))
    give, take = _pair(plan, rp, tmp_path)
    mine, theirs = _buffers(plan, 0, 1), _buffers(plan, 2, 2)
    before = {n: t.data_ptr() for n, t in theirs.items()}
    checks: list[int] = []
    # the giver's loader has written nothing yet: nothing may be given until it has
    done: set[int] = set()
    when: dict[str, float] = {}

    def written(units: Any) -> bool:
        return set(units) <= done

    def loader() -> None:
        time.sleep(0.3)
        when["written"] = time.monotonic()
        done.update(range(len(plan.ranks[0].units)))

    def taker() -> int:
        n = _copy(take, 7, theirs, check=lambda: checks.append(1))()
        when["taken"] = time.monotonic()
        return n

    got = on_threads([_copy(give, 7, mine, written=written), taker, loader])
    assert when["taken"] >= when["written"]
    assert got == [0, c.nbytes, None], got
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert {n: t.data_ptr() for n, t in theirs.items()} == before
    assert len(checks) == len(theirs)  # the fence is checked before each buffer
    # a delta: only layer 1's buffers move, the rest stay as they were
    mine = _buffers(plan, 0, 3)
    old = {n: t.clone() for n, t in theirs.items()}

    def hot(u: Any) -> bool:
        return any(".layers.1." in p.tensor_name for p in u.parts)

    assert take.units_taken(hot) == tuple(i for i, u in enumerate(plan.ranks[2].units) if hot(u))
    got = on_threads([_copy(give, 8, mine, changed=hot), _copy(take, 8, theirs, changed=hot)])
    assert not [g for g in got if isinstance(g, BaseException)], got
    moved = {u.buffer for u in plan.ranks[2].units if hot(u)}
    for n in theirs:
        want = mine[n] if n.removesuffix("_scale") in moved else old[n]
        assert torch.equal(theirs[n], want), n


def test_a_giver_that_fails_is_named_and_another_step_or_a_fence_writes_nothing(
    tmp_path: Any,
) -> None:
    plan, rp = _plan()
    theirs = _buffers(plan, 2, 2)
    kept = {n: t.clone() for n, t in theirs.items()}
    mine = _buffers(plan, 0, 1)
    # the giver never gives (its own update failed): named within the wait
    (tmp_path / "a").mkdir()
    _, take = _pair(plan, rp, tmp_path / "a", timeout=2)
    (err,) = on_threads([_copy(take, 7, theirs)])
    assert isinstance(err, RunError) and "engine rank 0 gave no copy of step 7" in str(err)
    # a giver of another step (or plan): refused at the header
    (tmp_path / "b").mkdir()
    give, take = _pair(plan, rp, tmp_path / "b", timeout=2)
    got = on_threads([_copy(give, 8, mine), _copy(take, 7, theirs)])
    assert isinstance(got[1], ReloadMismatch) and "for step 8" in str(got[1]), got
    # fenced off (a later lease took the session): stops before its first buffer
    (tmp_path / "c").mkdir()
    give, take = _pair(plan, rp, tmp_path / "c", timeout=2)

    def fenced() -> None:
        raise RunError("fenced off")

    got = on_threads([_copy(give, 7, mine), _copy(take, 7, theirs, check=fenced)])
    assert isinstance(got[1], RunError) and "fenced off" in str(got[1]), got
    assert isinstance(got[0], RunError) and "giving engine rank 2" in str(got[0]), got
    assert all(torch.equal(kept[n], theirs[n]) for n in theirs)


def test_no_copies_without_ranks_sharing_a_node() -> None:
    plan = preset_plan("qwen3-dense-tiny")
    rp = refit_plan(plan, fsdp_manifest(needed_shapes(plan), 2), devices_per_node=1)
    assert rp.copies == () and rp.summary.fanout_bytes == (0, 0, 0, 0)


def test_two_ends_that_place_the_engine_ranks_differently_plan_other_digests() -> None:
    # the trainer's engine_nodes and the engine's must agree: each link's header carries
    # the plan digest, which covers the copies
    plan = preset_plan("qwen3-dense-tiny")
    m = fsdp_manifest(needed_shapes(plan), 2)
    one = refit_plan(plan, m, receiver_nodes=(0, 0, 0, 0))
    pairs = refit_plan(plan, m, receiver_nodes=(0, 1, 0, 1))
    alone = refit_plan(plan, m, receiver_nodes=(0, 1, 2, 3))
    assert len({one.digest, pairs.digest, alone.digest}) == 3
