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

import heapq
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .ranges import ByteRange, CoalescePolicy
from .readplan import requested_bytes_fast
from .types import UnitReads

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
    """A rank's unit reads as sharing items (key: what they fetch, so ranks that keep
    different columns of the same whole rows share them)."""
    return [(r.fetch_key, r.nbytes, fetch_bytes(r)) for r in reads]


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


ClassItem = tuple[Hashable, int, int, int]
"""One unit's read of a rank class: (key, bytes that travel, bytes storage is asked for,
requests storage is sent for it); equal keys are the same bytes."""


@dataclass(frozen=True)
class ClassShare:
    """One shared read, as :func:`share_classes` decides it over rank classes."""

    key: Hashable
    where: str
    """The node its users are on (``node`` scope); "" in ``cluster`` scope."""
    owner: int
    classes: tuple[int, ...]
    """The classes whose ranks (on ``where``, when set) use it."""
    nbytes: int
    fetch_bytes: int
    requests: int


@dataclass(frozen=True)
class ClassSharing:
    """The shared reads of a run over rank classes, and how to find their users."""

    scope: str
    shared: tuple[ClassShare, ...]
    node_of_rank: tuple[str, ...]
    class_of_rank: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]
    """Ranks of each class, ascending."""
    positions: tuple[dict[Hashable, list[int]], ...]
    """Per class: key -> the unit indices that read it, ascending."""

    def users(self, s: ClassShare) -> list[tuple[int, int]]:
        """(rank, unit index) of every use of ``s``, by rank then index."""
        out = [
            (r, i)
            for k in s.classes
            for r in self.members[k]
            if not s.where or self.node_of_rank[r] == s.where
            for i in self.positions[k][s.key]
        ]
        out.sort()
        return out


class _LazyMin:
    """The least (value, name) of a fixed set of names whose values only grow: a heap
    whose stale entries are refreshed as they surface."""

    __slots__ = ("heap", "value")

    def __init__(self, names: Iterable[Any], value: Callable[[Any], Any]) -> None:
        self.value = value
        self.heap = [(value(n), n) for n in names]
        heapq.heapify(self.heap)

    def top(self) -> Any:
        heap, value = self.heap, self.value
        while True:
            v, name = heap[0]
            now = value(name)
            if now == v:
                return name
            heapq.heapreplace(heap, (now, name))


def share_classes(
    node_of_rank: Sequence[str],
    class_of_rank: Sequence[int],
    scope: str,
    class_items: Sequence[Sequence[ClassItem]],
) -> ClassSharing:
    """The owners of every replicated read under ``scope``, with ranks grouped in
    classes that read the same units (``class_items[k]``: class ``k``'s unit reads in
    unit order). The cost follows the classes and the shared reads, not the ranks.

    Owners are chosen as :func:`plan_sharing` says (largest first, ties by first user;
    the node of its users with the fewest owned bytes, then its user rank with the
    fewest), with lazy heaps in place of scans over every user."""
    if scope not in SHARE_SCOPES:
        raise ValueError(f"share scope {scope!r} is not one of {', '.join(SHARE_SCOPES)}")
    nodes = tuple(node_of_rank)
    world = len(nodes)
    classes = tuple(class_of_rank)
    members_l: list[list[int]] = [[] for _ in class_items]
    for rank, k in enumerate(classes):
        members_l[k].append(rank)
    members = tuple(tuple(m) for m in members_l)
    positions: list[dict[Hashable, list[int]]] = []
    size: dict[Hashable, tuple[int, int, int]] = {}
    for items in class_items:
        pos: dict[Hashable, list[int]] = {}
        for i, (key, nbytes, fetch, requests) in enumerate(items):
            if nbytes == 0:
                continue
            size[key] = (nbytes, fetch, requests)
            pos.setdefault(key, []).append(i)
        positions.append(pos)
    if scope == "none":
        return ClassSharing(scope, (), nodes, classes, members, tuple(positions))
    users_of: dict[Hashable, list[int]] = {}
    for k, pos in enumerate(positions):
        if members[k]:
            for key in pos:
                users_of.setdefault(key, []).append(k)
    on_node: dict[tuple[int, str], list[int]] = {}
    for rank, k in enumerate(classes):
        on_node.setdefault((k, nodes[rank]), []).append(rank)
    nodes_of_class = [sorted({nodes[r] for r in m}) for m in members]
    # (sort key, key, where, classes) of every read that more than one rank needs.
    candidates: list[tuple[tuple[int, int, int], Hashable, str, tuple[int, ...]]] = []
    for key, ks in users_of.items():
        cs = tuple(ks)
        nbytes = size[key][0]
        if scope == "cluster":
            if sum(len(members[k]) for k in cs) > 1:
                first = min((members[k][0], positions[k][key][0]) for k in cs)
                candidates.append(((-nbytes, *first), key, "", cs))
            continue
        for node in sorted({n for k in cs for n in nodes_of_class[k]}):
            here = [(k, on_node.get((k, node), ())) for k in cs]
            if sum(len(m) for _, m in here) > 1:
                first = min((m[0], positions[k][key][0]) for k, m in here if m)
                used = tuple(k for k, m in here if m)
                candidates.append(((-nbytes, *first), key, node, used))
    candidates.sort(key=lambda c: c[0])
    owned_rank = [0] * world
    owned_node: dict[str, int] = {}
    node_heaps: dict[tuple[int, ...], _LazyMin] = {}
    rank_heaps: dict[tuple[tuple[int, ...], str], _LazyMin] = {}

    def node_value(n: str) -> int:
        return owned_node.get(n, 0)

    def rank_value(r: int) -> int:
        return owned_rank[r]

    shared: list[ClassShare] = []
    for _, key, where, cs in candidates:
        nbytes, fetch, requests = size[key]
        node = where
        if not node:
            heap = node_heaps.get(cs)
            if heap is None:
                names = {n for k in cs for n in nodes_of_class[k]}
                heap = node_heaps[cs] = _LazyMin(names, node_value)
            node = heap.top()
        rheap = rank_heaps.get((cs, node))
        if rheap is None:
            ranks = [r for k in cs for r in on_node.get((k, node), ())]
            rheap = rank_heaps[(cs, node)] = _LazyMin(ranks, rank_value)
        owner = rheap.top()
        owned_rank[owner] += nbytes
        owned_node[node] = owned_node.get(node, 0) + nbytes
        shared.append(ClassShare(key, where, owner, cs, nbytes, fetch, requests))
    return ClassSharing(scope, tuple(shared), nodes, classes, members, tuple(positions))


def plan_sharing(
    node_of_rank: Sequence[str],
    scope: str,
    items_of: Callable[[int], Sequence[ReadItem]],
) -> SharePlan:
    """The owners of every replicated read under ``scope``.

    ``node_of_rank``: the node each rank was placed on (its length is the world size).
    ``items_of(rank)``: the rank's unit reads as :data:`ReadItem` s, in unit order.
    Ranks with the same reads form one class (:func:`share_classes`)."""
    nodes = tuple(node_of_rank)
    class_of: dict[tuple[ReadItem, ...], int] = {}
    class_of_rank = []
    class_items: list[list[ClassItem]] = []
    for rank in range(len(nodes)):
        items = tuple(items_of(rank))
        k = class_of.get(items)
        if k is None:
            k = class_of[items] = len(class_items)
            class_items.append([(key, nbytes, fetch, 0) for key, nbytes, fetch in items])
        class_of_rank.append(k)
    got = share_classes(nodes, class_of_rank, scope, class_items)
    shared = tuple(
        SharedRead(i, s.owner, tuple(got.users(s)), s.nbytes, s.fetch_bytes)
        for i, s in enumerate(got.shared)
    )
    return SharePlan(got.scope, shared, nodes)


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


def class_traffic(
    sh: ClassSharing,
    class_items: Sequence[Sequence[ClassItem]],
    private: Sequence[tuple[int, int, int]],
) -> tuple[list[RankTraffic], list[tuple[int, int]], list[int]]:
    """Per rank: what :func:`rank_traffic` and :func:`rank_requests` give, from a
    :class:`ClassSharing`, summed once per class and node instead of per rank, and the
    units it reads from storage itself (not served by a shared read).
    ``private[rank]``: (bytes, requests, units) storage is asked for by the rank's reads
    that no other rank needs, beyond its class's ``class_items``."""
    total_fetch = [sum(f for _, _, f, _ in items) for items in class_items]
    total_req = [sum(n for _, _, _, n in items) for items in class_items]
    total_units = [sum(1 for _, b, _, _ in items if b) for items in class_items]
    # Per (class, where): uses of shared reads, their bytes, fetched bytes, requests,
    # uses.
    shared_acc: dict[tuple[int, str], list[int]] = {}
    local_credit: dict[tuple[int, str], int] = {}
    world = len(sh.node_of_rank)
    self_uses = [0] * world
    put = [0] * world
    first = [0] * world
    owned_req = [0] * world
    for s in sh.shared:
        owner_node = sh.node_of_rank[s.owner]
        for k in s.classes:
            uses = len(sh.positions[k][s.key])
            acc = shared_acc.setdefault((k, s.where), [0, 0, 0, 0])
            acc[0] += uses * s.nbytes
            acc[1] += uses * s.fetch_bytes
            acc[2] += uses * s.requests
            acc[3] += uses
            local_credit[(k, owner_node)] = local_credit.get((k, owner_node), 0) + uses * s.nbytes
        k_owner = sh.class_of_rank[s.owner]
        self_uses[s.owner] += len(sh.positions[k_owner][s.key]) * s.nbytes
        put[s.owner] += s.nbytes
        first[s.owner] += s.fetch_bytes
        owned_req[s.owner] += s.requests
    traffic = []
    requests = []
    units = []
    zero = [0, 0, 0, 0]
    for rank in range(world):
        k = sh.class_of_rank[rank]
        node = sh.node_of_rank[rank]
        acc = shared_acc.get((k, node if sh.scope == "node" else ""), zero)
        own_fetch = total_fetch[k] - acc[1] + private[rank][0]
        own_req = total_req[k] - acc[2] + private[rank][1]
        peers = acc[0] - self_uses[rank]
        remote = acc[0] - local_credit.get((k, node), 0)
        traffic.append(RankTraffic(own_fetch + first[rank], peers, remote, put[rank], first[rank]))
        requests.append((own_req, owned_req[rank]))
        units.append(total_units[k] - acc[3] + private[rank][2])
    return traffic, requests, units


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
    world = len(share.node_of_rank)
    counts = [list(requests_of(rank)) for rank in range(world)]
    owned = [0] * world
    for s in share.shared:
        i = next(i for r, i in s.users if r == s.owner)
        owned[s.owner] += counts[s.owner][i]
    out = []
    for rank in range(world):
        mine = used.get(rank, set())
        own = sum(n for i, n in enumerate(counts[rank]) if i not in mine)
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
