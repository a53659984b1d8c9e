"""Read once per cluster (``mxload.orchestrator.plan.sharing``): every rank simulated in one loop.

Invariants, as Run:ai's partition tests state them: every (rank, unit) read is served by
exactly one fetch of its scope (its own, or one shared read's owner), a shared read's
users need those exact bytes, owners are among the users, owned bytes are balanced over
ranks and nodes; with ``cluster`` the storage traffic is the unique bytes (within the
tiles two TP slices both cover), with ``node`` one fetch per node, with ``none`` what
every rank reading for itself costs. Then the loader without Ray: a unit served from a
peer's published bytes gives the same buffers as one read from storage, and a lost peer
falls back to storage.
"""

from __future__ import annotations

from collections import Counter

import pytest
from mxload.orchestrator.plan.message import PeerUnit, SourceInfo
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.ranges import LOCAL_POLICY, CoalescePolicy
from mxload.orchestrator.plan.readplan import predicted_read_bytes
from mxload.orchestrator.plan.sharing import (
    plan_sharing as _plan_sharing,
)
from mxload.orchestrator.plan.sharing import (
    rank_traffic as _rank_traffic,
)
from mxload.orchestrator.plan.sharing import (
    read_items,
    unique_bytes,
)
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import RankLoader


def fetch_bytes(r) -> int:
    return predicted_read_bytes((r,), LOCAL_POLICY)


def exact_bytes(r) -> int:
    """Bytes of the ranges themselves (local reads span rows under a page apart, which
    would count another TP rank's columns: the sharing invariants are about ranges)."""
    return predicted_read_bytes((r,), CoalescePolicy(0, 1.0))


def items(plan, fetch):
    return [read_items(rp.reads, fetch) for rp in plan.ranks].__getitem__


def plan_sharing(plan, nodes, scope, fetch=exact_bytes):
    return _plan_sharing(nodes, scope, items(plan, fetch))


def rank_traffic(plan, share, fetch=exact_bytes):
    return _rank_traffic(share, items(plan, fetch))


LAYOUTS = {
    "moe-tp2-dp2": ("qwen3-moe-tiny", ParallelLayout(tp=2, dp=2)),
    "moe-tp2-dp4-ep": ("qwen3-moe-tiny", ParallelLayout(tp=2, dp=4, enable_expert_parallel=True)),
    "dense-tp2-dp4": ("qwen3-dense-tiny", ParallelLayout(tp=2, dp=4)),
}


def plan_for(ckpt_factory, name: str):
    preset, layout = LAYOUTS[name]
    src = ckpt_factory(preset, 3)
    meta = open_checkpoint(src)
    return src, meta, build_plan(meta.config, layout, checkpoint=meta)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cluster_scope_fetches_every_read_once(ckpt_factory, name: str) -> None:
    _, _, plan = plan_for(ckpt_factory, name)
    world = plan.layout.world
    nodes = [f"node{r * 2 // world}" for r in range(world)]  # two nodes
    share = plan_sharing(plan, nodes, "cluster")
    served = Counter()
    for s in share.shared:
        users = {r for r, _ in s.users}
        assert s.owner in users and len(users) > 1
        reads = {plan.ranks[r].reads[i] for r, i in s.users}
        assert len(reads) == 1, "a shared read's users need the same bytes"
        assert s.nbytes == next(iter(reads)).nbytes
        for u in s.users:
            served[u] += 1
    # a (rank, unit) is in at most one shared read; the rest are read by their own rank
    assert max(served.values()) == 1
    # no read that several ranks need identically is left unshared
    needs = Counter(r for rp in plan.ranks for r in rp.reads if r.nbytes)
    unshared = [
        (rp.rank, i)
        for rp in plan.ranks
        for i, r in enumerate(rp.reads)
        if r.nbytes and (rp.rank, i) not in served
    ]
    assert all(needs[plan.ranks[r].reads[i]] == 1 for r, i in unshared)
    traffic = rank_traffic(plan, share)
    storage = sum(t.bytes_from_storage for t in traffic)
    unique = unique_bytes([rp.reads for rp in plan.ranks])
    every_rank = sum(exact_bytes(r) for rp in plan.ranks for r in rp.reads)
    assert storage <= 1.02 * unique, (storage, unique)
    # exactly one fetch per distinct read (MoE experts without EP are sharded over
    # tp x dp, so only the replicated part is saved)
    distinct = {r for rp in plan.ranks for r in rp.reads if r.nbytes}
    assert storage == sum(exact_bytes(r) for r in distinct) < every_rank
    # every rank still gets all of its bytes, from storage or peers
    for rp, t in zip(plan.ranks, traffic, strict=True):
        own = sum(s.nbytes for s in share.owned_by(rp.rank))
        got = t.bytes_from_storage - sum(s.fetch_bytes for s in share.owned_by(rp.rank))
        held = sum(s.nbytes for s in share.used_by(rp.rank).values() if s.owner == rp.rank)
        assert got + t.bytes_from_peers + held == sum(map(exact_bytes, rp.reads)), rp.rank
        assert t.shared_put_bytes == own


def test_owners_are_balanced_over_ranks_and_nodes(ckpt_factory) -> None:
    _, _, plan = plan_for(ckpt_factory, "dense-tp2-dp4")
    world = plan.layout.world
    nodes = [f"n{r // 4}" for r in range(world)]
    share = plan_sharing(plan, nodes, "cluster")
    largest = max(s.nbytes for s in share.shared)
    owned = [sum(s.nbytes for s in share.owned_by(r)) for r in range(world)]
    # Replicated tensors are needed by tp-rank groups; within each group the greedy
    # keeps owners within one read of each other.
    for tp_rank in range(plan.layout.tp):
        group = [owned[r] for r in range(world) if plan.ranks[r].tp_rank == tp_rank]
        assert max(group) - min(group) <= largest, group
    per_node = Counter()
    for s in share.shared:
        per_node[nodes[s.owner]] += s.nbytes
    assert abs(per_node["n0"] - per_node["n1"]) <= largest


def test_node_scope_fetches_once_per_node(ckpt_factory) -> None:
    _, _, plan = plan_for(ckpt_factory, "moe-tp2-dp4-ep")
    world = plan.layout.world
    nodes = [f"n{r // 4}" for r in range(world)]
    share = plan_sharing(plan, nodes, "node")
    cluster = plan_sharing(plan, nodes, "cluster")
    for s in share.shared:
        assert len({nodes[r] for r, _ in s.users}) == 1
    node_storage = sum(t.bytes_from_storage for t in rank_traffic(plan, share))
    cluster_storage = sum(t.bytes_from_storage for t in rank_traffic(plan, cluster))
    every_rank = sum(exact_bytes(r) for rp in plan.ranks for r in rp.reads)
    assert cluster_storage < node_storage < every_rank
    for t in rank_traffic(plan, share):
        assert t.bytes_from_other_nodes == 0


def test_none_scope_and_bad_input(ckpt_factory) -> None:
    _, _, plan = plan_for(ckpt_factory, "moe-tp2-dp2")
    nodes = ["a"] * plan.layout.world
    none = plan_sharing(plan, nodes, "none")
    assert none.shared == ()
    traffic = rank_traffic(plan, none)
    assert [t.bytes_from_storage for t in traffic] == [
        sum(map(exact_bytes, rp.reads)) for rp in plan.ranks
    ]
    with pytest.raises(ValueError, match="share scope"):
        plan_sharing(plan, nodes, "everything")


def test_loader_takes_shared_units_from_peers(ckpt_factory) -> None:
    """Rank 1 loads with every shared unit served from what rank 0 published (as raw
    bytes); its buffers equal those of a plain storage load, and what it counts as from
    peers is exactly the shared units rank 0 owns; a lost object falls back to storage."""
    src, meta, plan = plan_for(ckpt_factory, "moe-tp2-dp2")
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    budget = plan.ranks[0].staging.budget_bytes
    nodes = ["a"] * plan.layout.world
    share = plan_sharing(plan, nodes, "cluster", fetch_bytes)
    store: dict[int, bytes] = {}

    def publish(arr) -> int:
        store[len(store)] = arr.tobytes()  # bytes out, as ray.put copies them out
        return len(store) - 1

    handles = {}
    for owner in sorted({s.owner for s in share.shared}):
        ldr = RankLoader(plan.ranks[owner], model_dtype="bf16", backend=select_backend("cpu"))
        items = []
        for s in share.owned_by(owner):
            i = next(i for r, i in s.users if r == owner)
            items.append((s.key, plan.ranks[owner].units[i], plan.ranks[owner].reads[i]))
        got = ldr.fetch_for_peers(items, source, staging_budget=budget, publish=publish)
        assert got.bytes_from_storage == sum(s.fetch_bytes for s in share.owned_by(owner))
        assert 0 < got.peak_staging_bytes <= plan.ranks[owner].staging.staging_bytes
        handles.update(got.handles)
    rank = 1 if share.owned_by(1) != share.shared else 0
    peers = {
        i: PeerUnit(owner=s.owner, fetch_bytes=s.fetch_bytes, handles=handles[s.key])
        for i, s in share.used_by(rank).items()
    }
    assert peers, "the layout has shared units"

    def peer_get(h: int):
        import numpy as np

        return np.frombuffer(store[h], dtype=np.uint8)

    plain = RankLoader(plan.ranks[rank], model_dtype="bf16", backend=select_backend("cpu"))
    base = plain.load(plan.ranks[rank].reads, source, version=1, staging_budget=budget)
    shared = RankLoader(plan.ranks[rank], model_dtype="bf16", backend=select_backend("cpu"))
    stats = shared.load(
        plan.ranks[rank].reads,
        source,
        version=1,
        staging_budget=budget,
        peers=peers,
        peer_get=peer_get,
    )
    assert shared.checksums() == plain.checksums()
    from_others = sum(s.nbytes for s in share.used_by(rank).values() if s.owner != rank)
    assert stats.bytes_from_peers == from_others > 0
    assert stats.bytes_read == base.bytes_read == plan.ranks[rank].bytes_to_read
    assert stats.bytes_from_storage == base.bytes_from_storage - sum(
        s.fetch_bytes for s in share.used_by(rank).values()
    )
    assert stats.measured_peak_staging_bytes == base.measured_peak_staging_bytes

    asked: list[int] = []

    def lost(h: int):
        asked.append(h)
        raise RuntimeError("owner died")

    again = RankLoader(plan.ranks[rank], model_dtype="bf16", backend=select_backend("cpu"))
    fb = again.load(
        plan.ranks[rank].reads, source, version=1, staging_budget=budget, peers=peers, peer_get=lost
    )
    assert again.checksums() == plain.checksums()
    assert fb.peer_fallbacks == len(peers) and fb.bytes_from_peers == 0
    # An owner whose bytes could not be had once is not asked again in the run (each
    # ask of a dead owner's object costs Ray about a second).
    owners = {p.owner for p in peers.values()}
    assert len(asked) == len(owners) < len(peers), (len(asked), owners, len(peers))
    assert fb.bytes_from_storage == base.bytes_from_storage
