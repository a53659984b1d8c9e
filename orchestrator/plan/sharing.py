"""Read once per cluster: which rank fetches each replicated read from storage. Pure.

Without sharing every rank reads its own units, so a tensor replicated over data-parallel
replicas (attention, dense MLPs, norms, embeddings; experts without EP) is fetched from
storage ``dp`` times per load, and again on every reload. Here every unit read that
several ranks need *identically* (the same files and byte ranges: what the planner gives
the same slice on every replica) becomes one :class:`SharedRead`: one **owner** rank
fetches it from storage and publishes its bytes (Ray's object store in the driver: plasma
shares them within a node, the object manager moves them between nodes); every other
user copies them into its own staging lease instead of reading storage. Conversion stays
on each rank (a rank converts what it holds).

Scopes (``--share``):

* ``none``: every rank reads its own bytes;
* ``node``: one fetch per node that needs the read (peers within a node only: no
  inter-node traffic, storage traffic = nodes x replicated bytes);
* ``cluster``: one fetch in the whole cluster (storage traffic = unique bytes).

Owners are chosen greedily, largest read first, on the node with the fewest owned bytes
among the nodes of its users, then on that node's user rank with the fewest owned bytes,
so storage traffic is spread evenly over ranks and nodes; ties go to the lower rank, so
the choice is deterministic.

Limits: only identical unit reads are shared (two TP ranks whose slices overlap in one
scale tile each read it); a unit converted in row chunks (a staging budget below the
largest unit) is never shared, since its chunks are read separately.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from mxload.orchestrator.plan.ranges import ByteRange, CoalescePolicy
from mxload.orchestrator.plan.readplan import requested_bytes_fast
from mxload.orchestrator.plan.types import UnitReads

SHARE_SCOPES = ("none", "node", "cluster")
DEFAULT_SHARE = "cluster"
"""Storage is the scarce link of a real cluster: a shared file system or object store
serves a few GB/s per node and tens in aggregate, while NPU nodes exchange 25-50 GB/s
over their interconnect. Fetching every byte once (``cluster``) divides storage traffic
by dp; ``node`` still reads every replicated byte once per node (see docs/time-model.md
for the predicted times of both)."""

_EXACT = CoalescePolicy(max_gap_bytes=0, max_overread_ratio=1.0)


ReadItem = tuple[Hashable, int, int]
"""One unit's read as sharing sees it: (key, bytes that travel, bytes storage is asked
for). Equal keys are the same bytes: the unit's ``UnitReads`` when the plan has byte
ranges, the ``Unit`` itself for a config-only plan (equal units read equal slices)."""


def read_items(
    reads: Sequence[UnitReads], fetch_bytes: Callable[[UnitReads], int]
) -> list[ReadItem]:
    """A rank's unit reads as sharing items (key: the reads themselves)."""
    return [(r, r.nbytes, fetch_bytes(r)) for r in reads]


@dataclass(frozen=True)
class SharedRead:
    """One read that several (rank, unit) users need byte for byte."""

    key: int
    owner: int
    """The rank that fetches it from storage."""
    users: tuple[tuple[int, int], ...]
    """(rank, unit index in that rank's plan), the owner's own use included."""
    nbytes: int
    """Bytes that travel: the unit's reads concatenated (what a staging lease holds)."""
    fetch_bytes: int
    """Bytes the owner requests from storage for it (coalescing over-read included)."""


@dataclass(frozen=True)
class SharePlan:
    """Every shared read of a run, and what each rank does with them."""

    scope: str
    shared: tuple[SharedRead, ...]
    node_of_rank: tuple[str, ...]

    def owned_by(self, rank: int) -> list[SharedRead]:
        """The reads ``rank`` fetches for itself and its peers, largest first."""
        return [s for s in self.shared if s.owner == rank]

    def used_by(self, rank: int) -> dict[int, SharedRead]:
        """unit index -> the shared read that serves it, for ``rank``."""
        return {i: s for s in self.shared for r, i in s.users if r == rank}


def plan_sharing(
    node_of_rank: Sequence[str],
    scope: str,
    items_of: Callable[[int], Sequence[ReadItem]],
) -> SharePlan:
    """The owners of every replicated read under ``scope``.

    ``node_of_rank``: the node each rank was placed on (its length is the world size).
    ``items_of(rank)``: the rank's unit reads as :data:`ReadItem` s, in unit order."""
    if scope not in SHARE_SCOPES:
        raise ValueError(f"share scope {scope!r} is not one of {', '.join(SHARE_SCOPES)}")
    nodes = tuple(node_of_rank)
    world = len(nodes)
    if scope == "none":
        return SharePlan(scope, (), nodes)
    groups: dict[tuple[Hashable, str], list[tuple[int, int]]] = {}
    size: dict[Hashable, tuple[int, int]] = {}
    for rank in range(world):
        for i, (key, nbytes, fetch) in enumerate(items_of(rank)):
            if nbytes == 0:
                continue
            size[key] = (nbytes, fetch)
            where = nodes[rank] if scope == "node" else ""
            groups.setdefault((key, where), []).append((rank, i))
    candidates = [
        (size[key], users) for (key, _), users in groups.items() if len({u for u, _ in users}) > 1
    ]
    # Largest first, then by first user, so the greedy balance is deterministic.
    candidates.sort(key=lambda c: (-c[0][0], c[1][0]))
    owned_rank = [0] * world
    owned_node: dict[str, int] = {}
    shared: list[SharedRead] = []
    for key, ((nbytes, fetch), users) in enumerate(candidates):
        ranks = sorted({u for u, _ in users})
        node = min({nodes[u] for u in ranks}, key=lambda n: (owned_node.get(n, 0), n))
        owner = min((u for u in ranks if nodes[u] == node), key=lambda u: (owned_rank[u], u))
        owned_rank[owner] += nbytes
        owned_node[node] = owned_node.get(node, 0) + nbytes
        shared.append(SharedRead(key, owner, tuple(users), nbytes, fetch))
    return SharePlan(scope, tuple(shared), nodes)


@dataclass(frozen=True)
class RankTraffic:
    """Predicted bytes of one rank under a share plan."""

    bytes_from_storage: int
    """Everything the rank fetches from storage: its unshared reads and the shared
    reads it owns (for itself and its peers)."""
    bytes_from_peers: int
    """Bytes of shared reads another rank fetched (same node: plasma; else the network)."""
    bytes_from_other_nodes: int
    """The part of ``bytes_from_peers`` whose owner is on another node."""
    shared_put_bytes: int
    """Bytes the rank publishes for its peers (held in its node's object store)."""
    bytes_fetched_for_sharing: int
    """The part of ``bytes_from_storage`` that is shared reads it owns (fetched first,
    before any rank converts)."""


def rank_traffic(
    share: SharePlan, items_of: Callable[[int], Sequence[ReadItem]]
) -> list[RankTraffic]:
    """Per rank: bytes from storage, from peers, and published (docs/contract.md §6's bytes, shared)."""
    out = []
    owned: dict[int, list[SharedRead]] = {}
    used: dict[int, dict[int, SharedRead]] = {}
    for s in share.shared:
        owned.setdefault(s.owner, []).append(s)
        for r, i in s.users:
            used.setdefault(r, {})[i] = s
    for rank in range(len(share.node_of_rank)):
        mine = used.get(rank, {})
        storage = peers = remote = put = first = 0
        for i, (_, _, fetch) in enumerate(items_of(rank)):
            got = mine.get(i)
            if got is None:
                storage += fetch
            elif got.owner != rank:
                peers += got.nbytes
                if share.node_of_rank[got.owner] != share.node_of_rank[rank]:
                    remote += got.nbytes
        for s in owned.get(rank, ()):
            first += s.fetch_bytes
            put += s.nbytes
        out.append(RankTraffic(storage + first, peers, remote, put, first))
    return out


def rank_requests(
    share: SharePlan, requests_of: Callable[[int], Sequence[int]]
) -> list[tuple[int, int]]:
    """Per rank: (storage requests for its unshared reads, storage requests for the
    shared reads it owns). ``requests_of(rank)``: requests per unit read, in unit order
    (the same order as the :data:`ReadItem` s the share plan was made from); a shared
    read costs its owner the requests of its own copy, and its other users none."""
    used: dict[int, set[int]] = {}
    for s in share.shared:
        for r, i in s.users:
            used.setdefault(r, set()).add(i)
    owned = [0] * len(share.node_of_rank)
    for s in share.shared:
        i = next(i for r, i in s.users if r == s.owner)
        owned[s.owner] += requests_of(s.owner)[i]
    out = []
    for rank in range(len(share.node_of_rank)):
        mine = used.get(rank, set())
        own = sum(n for i, n in enumerate(requests_of(rank)) if i not in mine)
        out.append((own, owned[rank]))
    return out


def unique_bytes(all_reads: Sequence[Sequence[UnitReads]]) -> int:
    """Checkpoint bytes any rank needs, each byte counted once (overlaps merged): what
    a cluster fetching every byte exactly once reads."""
    by_file: dict[str, set[ByteRange]] = {}
    for reads in all_reads:
        for ur in reads:
            for p in ur.parts:
                by_file.setdefault(p.file, set()).add(p.weight)
                if p.scale is not None:
                    by_file.setdefault(p.scale_file or p.file, set()).add(p.scale)
    return sum(requested_bytes_fast(rs, _EXACT) for rs in by_file.values())
