"""How long a load (and a reload) takes, predicted from bytes and bandwidths. Pure.

An operator asks the planner "how long?", not only "how much memory?". The answer is a
function of what each rank moves (``mxload.orchestrator.plan.sharing.RankTraffic``: bytes
from storage, from peers on other nodes) and converts (its ``bytes_needed``), and of
four rates:

* storage bandwidth **per node** (a node's link to the store) and **aggregate** (what the
  store serves the whole cluster at once);
* node **network** bandwidth (what a node takes in from peers' object stores);
* the **conversion** rate of one rank (source bytes per second through resolve, MX
  quantize and repack; on CPU calibrated by ``bench/``, on NPU an estimate).

The run has the two phases the driver runs: first the owners of shared reads fetch them
(nobody converts yet), then every rank loads, reading its unshared units, copying shared
ones from peers and converting, with reads overlapping conversion (docs/contract.md §4). Concurrent
transfers share a link equally (processor sharing): ``n`` flows on a link of capacity
``C`` each get ``C / n`` until the smallest finishes, and so on. A rank's transfer is
bounded by its node's link and by the store's aggregate, whichever finishes it later.
Phase 2 of a rank ends when the slowest of its storage reads, network pulls and
conversion ends (they overlap).

Requests cost time of their own, which bytes alone miss: a K-split slice (``o_proj``,
``down_proj`` at tp >= 2) read from an object store is one request per row, since no
gap is bridged that would read more than 1.25x what is needed (``REMOTE_POLICY``), so
tp >= 2 multiplies a dense layer's requests. Two terms: every rank
waits ``request_latency`` per request, ``request_concurrency`` requests in flight; and a
store that serves at most ``storage_requests`` requests/s shares that rate among ranks
like its bandwidth (the two are separate resources: a transfer ends when both its bytes
and its requests are through). Request counts come from the same coalescing the loader does
(``mxload.orchestrator.plan.readplan.predicted_reads``).

A reload moves and converts the same bytes as a load (whole units, same reads), so it is
predicted the same, less ``start_seconds``: the seconds a fresh rank process spends
before its first byte arrives beyond the request itself (importing the store's client,
opening its session), which a load pays once, at the start of its first phase, and a
reload, whose processes are warm, does not. Starting Ray and the workers and allocating
buffers are not modelled: the figures are from the first byte requested to the last unit
written.

A refit from a trainer's memory (``refit_times``) is predicted from its transfer plan
(``refit.refit_summary``): each node's bytes over the network and within itself at the
link kind's rates (:data:`TRAINER_LINKS`), and the conversion on the sender or the
receiver, overlapping bucket by bucket; beside it ``save_seconds`` prices the storage
round trip's save (docs/time-model.md, "Refit").
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .config import ModelConfig
from .ranges import LOCAL_POLICY, REMOTE_POLICY, CoalescePolicy
from .readplan import (
    estimated_fetch,
    estimated_requests,
    predicted_reads,
    share_key,
)
from .refit import RefitSummary
from .sharing import (
    ClassItem,
    RankTraffic,
    class_traffic,
    share_classes,
)
from .types import Plan, RankClass, ReadGroup, StagingEstimate, Unit, UnitReads

GB = 1e9

CPU_CONVERT_BYTES_PER_S = 0.45 * GB
"""One CPU core of the fused path, source bytes/s, as ``bench/bench_load.py`` measures a
rank loading from warm cache."""

NPU_CONVERT_BYTES_PER_S = 20 * GB
"""One Ascend NPU, an estimate until measured: the host-to-device copy of the FP8
source over PCIe 5 x16 (~50 GB/s peak, ~25 in practice) bounds it, and the eager
resolve/quantize ops make a few passes over HBM (1.6 TB/s) each."""

STORAGE_NODE_BYTES_PER_S = 5 * GB
"""A node's link to the checkpoint store: a 100 GbE-class front end, as parallel file
systems and object stores give one client node."""

STORAGE_AGGREGATE_BYTES_PER_S = 40 * GB
"""What the store serves the whole cluster at once (a mid-size parallel file system or
object store deployment)."""

NETWORK_NODE_BYTES_PER_S = 25 * GB
"""A node's inbound network for peer objects: 200 Gb/s RoCE/InfiniBand."""

REMOTE_REQUEST_LATENCY_S = 0.010
"""One request to an object store (S3, HTTP): time to first byte, ~10 ms."""

LOCAL_REQUEST_LATENCY_S = 0.0001
"""One pread of a local or NFS-cached file: ~0.1 ms."""

REQUEST_CONCURRENCY = 16
"""Requests one rank keeps in flight (``Storage``'s ``max_concurrency``)."""

MAX_REQUEST_BYTES = 32 << 20
"""Longest remote request ``Storage`` sends; a longer coalesced range is split."""


GLOO_BYTES_PER_S = 2 * GB
"""torch.distributed's gloo backend, one node's sends or receives: ~2 GB/s, as measured
on this project's test machine (host memory over TCP)."""

SHM_BYTES_PER_S = 6.7 * GB
"""Host shared memory within a node (buffers exported once, copied by the receiver):
6.7 GB/s, as measured on this project's test machine."""

DEVICE_IPC_BYTES_PER_S = 50 * GB
"""Device to device within a node (HCCS, NVLink; HCCL/NCCL's intra-node path), per
node: an estimate until measured, a fraction of the links' peak."""

RAY_PULL_BYTES_PER_S = 2.5 * GB
"""A node pulling objects from other nodes' Ray object stores: an estimate until
measured (Ray's object manager moves objects in chunks over gRPC, well under the
NIC's rate); within a node Ray's store is shared memory."""

NPU_REPACK_BYTES_PER_S = 200 * GB
"""One NPU repacking MXFP8 that arrived already converted into its kernel layout (a
permute over HBM, a few passes at 1.6 TB/s): an estimate until measured."""

CPU_REPACK_BYTES_PER_S = 4.4 * GB
"""One CPU core repacking MXFP8 into its kernel layout (wire bytes/s): ``bench/bench_refit.py``
measures an engine rank repacking 0.65 GB in 0.074 s on two threads (64-row line stores,
bench/results/refit.md)."""

TRAINER_LINKS: dict[str, tuple[float, float]] = {
    "hccl": (NETWORK_NODE_BYTES_PER_S, DEVICE_IPC_BYTES_PER_S),
    "nccl": (NETWORK_NODE_BYTES_PER_S, DEVICE_IPC_BYTES_PER_S),
    "gloo": (GLOO_BYTES_PER_S, GLOO_BYTES_PER_S),
    "ray": (RAY_PULL_BYTES_PER_S, SHM_BYTES_PER_S),
    "shm": (0.0, SHM_BYTES_PER_S),
}
"""Per link kind of a refit: (bytes/s a node sends or takes in from other nodes, bytes/s
moved within a node). ``shm`` reaches no other node (0)."""


@dataclass(frozen=True)
class Rates:
    """The time model's inputs (bytes per second; 0 = unlimited)."""

    storage_node: float = STORAGE_NODE_BYTES_PER_S
    storage_aggregate: float = STORAGE_AGGREGATE_BYTES_PER_S
    network_node: float = NETWORK_NODE_BYTES_PER_S
    convert: float = CPU_CONVERT_BYTES_PER_S
    """Per rank."""
    request_latency: float = REMOTE_REQUEST_LATENCY_S
    """Seconds one request waits (first byte), per rank, before concurrency."""
    request_concurrency: int = REQUEST_CONCURRENCY
    storage_requests: float = 0.0
    """Requests per second the store serves the whole cluster (0 = unlimited)."""
    start_seconds: float = 0.0
    """Seconds a fresh rank process's first storage read takes beyond a warm one (the
    store's client set up in that process); paid once per load, not by a reload."""
    unit_waits: bool = True
    """Whether each unit a rank reads from storage in phase 2 waits a request latency
    before its bytes flow (the loader reads one unit ahead of the one converting, so
    its units' reads follow one another)."""

    def __post_init__(self) -> None:
        if self.request_concurrency < 1:
            raise ValueError(f"request concurrency must be >= 1, got {self.request_concurrency}")
        for name in (
            "storage_node",
            "storage_aggregate",
            "network_node",
            "convert",
            "request_latency",
            "storage_requests",
            "start_seconds",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"rate {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RankTime:
    """Predicted seconds of one rank."""

    fetch_seconds: float
    """Phase 1: the whole cluster fetching shared reads (every rank waits for it)."""
    storage_seconds: float
    network_seconds: float
    convert_seconds: float
    load_seconds: float
    """start + fetch + max(storage, network, convert)."""
    requests: int = 0
    """Storage requests the rank sends (its own reads and the shared reads it owns)."""
    start_seconds: float = 0.0
    """The fresh process's first-read cost (``Rates.start_seconds``), in ``load_seconds``."""
    request_seconds: float = 0.0
    """What the rank waits on request latency: its requests over the concurrency, or a
    latency per unit it reads from storage one after another (``Rates.unit_waits``),
    whichever is longer (the model takes the two as overlapping)."""

    @property
    def reload_seconds(self) -> float:
        """A reload's processes are warm: no start cost."""
        return self.load_seconds - self.start_seconds


def shared_link(sizes: Sequence[float], capacity: float) -> list[float]:
    """Finish time of each of ``sizes`` bytes started together on one link of
    ``capacity`` bytes/s, shared equally among unfinished transfers; 0 = unlimited."""
    n = len(sizes)
    out = [0.0] * n
    if capacity <= 0:
        return out
    t = prev = 0.0
    order = sorted(range(n), key=lambda i: sizes[i])
    for k, i in enumerate(order):
        t += (sizes[i] - prev) * (n - k) / capacity
        prev = sizes[i]
        out[i] = t
    return out


def _storage_finish(
    sizes: Sequence[float],
    requests: Sequence[int],
    nodes: Sequence[str],
    rates: Rates,
    serial: Sequence[float] | None = None,
) -> list[float]:
    """When each rank's storage transfer ends, all starting together: the latest of its
    node's link (bytes), the store's aggregate bandwidth (bytes), the store's request
    handling (requests) and its own request pacing (latency x requests / concurrency).

    The store's bandwidth and its request handling are two resources, each shared
    equally among the ranks using it, working at the same time: a transfer ends when
    both its bytes and its requests are through (the larger, not the sum: the two
    overlap). ``serial``: per rank, reads it sends one after another (the units of its
    load: the loader reads one unit ahead of the one converting), each waiting a
    request latency before its bytes flow: that wait adds to its bytes' time."""
    agg = shared_link(sizes, rates.storage_aggregate)
    handled = shared_link([float(r) for r in requests], rates.storage_requests)
    per_node = _per_node(sizes, nodes, rates.storage_node)
    pace = [r * rates.request_latency / rates.request_concurrency for r in requests]
    waits = [n * rates.request_latency for n in (serial or [0] * len(sizes))]
    return [
        max(max(a, b) + w, h, p)
        for a, b, w, h, p in zip(agg, per_node, waits, handled, pace, strict=True)
    ]


def _per_node(sizes: Sequence[float], nodes: Sequence[str], capacity: float) -> list[float]:
    """Finish times of transfers sharing their own node's link of ``capacity`` (0 =
    unlimited)."""
    out = [0.0] * len(sizes)
    if capacity <= 0:
        return out
    by_node: dict[str, list[int]] = {}
    for i, x in enumerate(nodes):
        by_node.setdefault(x, []).append(i)
    for idx in by_node.values():
        for i, t in zip(idx, shared_link([sizes[i] for i in idx], capacity), strict=True):
            out[i] = t
    return out


def predict(
    traffic: Sequence[RankTraffic],
    convert_bytes: Sequence[int],
    node_of_rank: Sequence[str],
    rates: Rates,
    requests: Sequence[tuple[int, int]] | None = None,
    units: Sequence[float] | None = None,
) -> list[RankTime]:
    """Per rank: predicted load (and reload) seconds, itemised. ``requests``: per rank,
    (requests of its own reads, requests of the shared reads it owns), from
    :func:`mxload.orchestrator.plan.sharing.rank_requests`; None: requests cost nothing.
    ``units``: per rank, the request latencies its phase-2 reads wait one after another:
    the units it reads from storage itself over the steps its schedule keeps in flight
    (``StagingEstimate.read_ahead``; None: not counted). Phase 1 has no such
    term: an owner keeps ``request_concurrency`` of its shared units in flight."""
    nodes = list(node_of_rank)
    reqs = list(requests) if requests is not None else [(0, 0)] * len(traffic)
    fetch = [float(t.bytes_fetched_for_sharing) for t in traffic]
    phase1 = max(_storage_finish(fetch, [r[1] for r in reqs], nodes, rates), default=0.0)
    own = [float(t.bytes_from_storage - t.bytes_fetched_for_sharing) for t in traffic]
    storage = _storage_finish(
        own, [r[0] for r in reqs], nodes, rates, units if rates.unit_waits else None
    )
    remote = [float(t.bytes_from_other_nodes) for t in traffic]
    network = _per_node(remote, nodes, rates.network_node)
    serial = list(units) if units is not None and rates.unit_waits else [0] * len(traffic)
    out = []
    for i in range(len(traffic)):
        conv = convert_bytes[i] / rates.convert if rates.convert > 0 else 0.0
        n = reqs[i][0] + reqs[i][1]
        out.append(
            RankTime(
                fetch_seconds=phase1,
                storage_seconds=storage[i],
                network_seconds=network[i],
                convert_seconds=conv,
                load_seconds=rates.start_seconds + phase1 + max(storage[i], network[i], conv),
                requests=n,
                start_seconds=rates.start_seconds,
                request_seconds=rates.request_latency
                * max(n / rates.request_concurrency, serial[i]),
            )
        )
    return out


def _read_ahead(staging: StagingEstimate | None) -> float:
    """Steps a rank's schedule keeps in flight per request latency (1: none ahead)."""
    return max(1.0, staging.read_ahead) if staging is not None else 1.0


def plan_times(
    plan: Plan,
    config: ModelConfig,
    *,
    rates: Rates,
    scope: str,
    devices_per_node: int,
    local: bool | None = None,
    policy: CoalescePolicy | None = None,
) -> dict[str, Any]:
    """Predicted traffic and times of every rank of ``plan``, for ``mxload plan``.
    ``policy``: how a config-only plan's reads are coalesced (default: the remote or
    local policy, as ``local`` says).

    Ranks are placed as the driver packs them: consecutive ranks on a node,
    ``devices_per_node`` per node. A plan with byte ranges shares its identical unit
    reads and counts what storage is asked for (coalescing included); a config-only plan
    shares equal units and counts their ``bytes_needed``.

    Requests: a plan with byte ranges counts them as the loader will send them; a
    config-only plan estimates them (:func:`mxload.orchestrator.plan.readplan.estimated_requests`),
    for an object store unless ``local``."""
    if devices_per_node < 1:
        raise ValueError(f"devices per node must be >= 1, got {devices_per_node}")
    world = len(plan.summaries)
    nodes = [f"node{r // devices_per_node}" for r in range(world)]
    coalescing = plan.extra.get("coalescing", {})
    remote = bool(coalescing.get("remote")) if local is None else not local
    if policy is None:
        policy = REMOTE_POLICY if remote else LOCAL_POLICY
    items = _Items(config, policy, remote)
    sharing = _sharing(plan, items)
    share = share_classes(nodes, sharing.of_rank, scope, sharing.class_items)
    traffic, requests, units = class_traffic(share, sharing.class_items, sharing.private_of_rank)
    class_of_rank = [s.rank_class for s in plan.summaries]
    convert = [plan.classes[k].bytes_needed for k in class_of_rank]
    # A rank keeps the reads of several steps in flight where its schedule reads ahead
    # that far (an object store): its units' waits overlap that many at a time.
    depth = [_read_ahead(plan.classes[k].staging) for k in class_of_rank]
    serial = [n / d for n, d in zip(units, depth, strict=True)]
    times = predict(traffic, convert, nodes, rates, requests, serial)
    slowest = max(range(world), key=lambda r: times[r].load_seconds, default=0)
    by_kind = _requests_by_kind(plan.classes[class_of_rank[slowest]], items) if world else {}
    distinct: dict[Hashable, int] = {}
    for its in sharing.class_items:
        for item in its:
            distinct[item[0]] = item[2]
    # What only one rank reads (its experts), once per rank.
    private_fetch = sum(f for f, _, _ in sharing.private_of_rank)
    return {
        "share": scope,
        "devices_per_node": devices_per_node,
        "nodes": -(-world // devices_per_node),
        "rates_bytes_per_s": {
            "storage_node": rates.storage_node,
            "storage_aggregate": rates.storage_aggregate,
            "network_node": rates.network_node,
            "convert": rates.convert,
        },
        "request_latency_s": rates.request_latency,
        "request_concurrency": rates.request_concurrency,
        "storage_requests_per_s": rates.storage_requests,
        "requests_to_storage": sum(a + b for a, b in requests),
        "slowest_request_seconds": max((t.request_seconds for t in times), default=0.0),
        "slowest_rank": slowest,
        # its units' requests by unit kind (a shared read counted for every user)
        "slowest_rank_requests_by_kind": by_kind,
        "traffic": traffic,
        "times": times,
        "bytes_from_storage": sum(t.bytes_from_storage for t in traffic),
        "distinct_read_bytes": sum(distinct.values()) + private_fetch,
        "predicted_load_seconds": max((t.load_seconds for t in times), default=0.0),
        "predicted_reload_seconds": max((t.reload_seconds for t in times), default=0.0),
    }


class _Items:
    """What a unit's reads cost and which reads are the same, for sharing
    (``sharing.ClassItem``: share key, bytes, fetched bytes, requests).

    Classes share their unit (and reads) objects: each object is hashed by value and
    sized once, then known by a small int."""

    def __init__(self, config: ModelConfig, policy: CoalescePolicy, remote: bool) -> None:
        self.config = config
        self.policy = policy
        self.remote = remote
        self.whole = policy.whole_rows
        self.max_request = MAX_REQUEST_BYTES if remote else 0
        self.canon: dict[Hashable, int] = {}
        self.item_of: dict[int, ClassItem] = {}
        self.windowed: dict[int, list[bool]] = {}
        # A rank's own experts read as whole rows, by (block, the sample's costs, experts
        # held): ranks holding the same experts read the same whole rows (see
        # slice_free), and ranks whose samples cost the same count the same bytes.
        self.expanded: dict[tuple[Any, ...], tuple[list[ClassItem], int, int, int]] = {}

    def cost(self, unit: Unit, reads: UnitReads | None) -> tuple[int, int, int]:
        if reads is not None:
            fetch, requests = predicted_reads((reads,), self.policy, self.max_request)
            return reads.nbytes, fetch, requests
        nbytes = estimated_fetch(unit, self.config, whole=self.whole)
        requests = estimated_requests(unit, self.config, remote=self.remote, whole=self.whole)
        return nbytes, nbytes, requests

    def item(self, unit: Unit, reads: UnitReads | None) -> ClassItem:
        o: Any = reads if reads is not None else unit
        item = self.item_of.get(id(o))
        if item is None:
            fetched = reads.fetch_key if reads is not None else share_key(unit, whole=self.whole)
            key = self.canon.setdefault(fetched, len(self.canon))
            item = self.item_of[id(o)] = (key, *self.cost(unit, reads))
        return item

    def key(self, unit: Unit) -> int:
        """The share key of a config-only unit read as whole rows."""
        return self.canon.setdefault(share_key(unit, whole=self.whole), len(self.canon))

    def windowed_of(self, sample: tuple[Unit, ...]) -> list[bool]:
        """Per unit of a config-only sample: whether it is read as whole rows."""
        got = self.windowed.get(id(sample))
        if got is None:
            whole = self.whole
            got = self.windowed[id(sample)] = [share_key(u, whole=whole) is not u for u in sample]
        return got

    def slice_free(self, sample: tuple[Unit, ...], rows: list[bool]) -> bool:
        """Whether the whole-row keys of a group's units name nothing but tensors and
        whole source rows: every part of a unit read as whole rows covers its source's
        rows, and its columns too unless the key leaves them out. Then ranks that hold
        the same experts have the same keys, whichever slice of them each holds."""
        for u, read_whole in zip(sample, rows, strict=True):
            if not read_whole:
                continue
            key = share_key(u, whole=self.whole)
            assert isinstance(key, tuple)
            for p, (_, part_rows, part_cols) in zip(u.parts, key, strict=True):
                src = p.source_shape
                if len(src) != 2 or part_rows != (0, src[0]):
                    return False
                if part_cols is not None and part_cols != (0, src[1]):
                    return False
        return True


_Segment = list[ClassItem] | tuple[ReadGroup, list[ClassItem], list[bool], bool]
"""A class's reads in unit order: items every member reads, or a group of each member's
own experts whose whole rows other ranks read too (expanded per rank)."""


@dataclass(frozen=True)
class _Sharing:
    """Every rank's sharing class (``of_rank``), the classes' shareable items, and
    per rank (fetched bytes, requests, units) of what it alone reads."""

    of_rank: list[int]
    class_items: list[tuple[ClassItem, ...]]
    private_of_rank: list[tuple[int, int, int]]


def _sharing(plan: Plan, items: _Items) -> _Sharing:
    """Classes whose shareable reads are the same (a TP rank's attention on every MoE
    rank) are one class for sharing; what only one rank reads is counted apart."""
    world = len(plan.summaries)
    members: list[list[int]] = [[] for _ in plan.classes]
    for rank, s in enumerate(plan.summaries):
        members[s.rank_class].append(rank)
    sharing_class: dict[tuple[ClassItem, ...], int] = {}
    class_items: list[tuple[ClassItem, ...]] = []
    of_rank = [0] * world
    private_of_rank: list[tuple[int, int, int]] = [(0, 0, 0)] * world

    def sharing_class_of(its: tuple[ClassItem, ...]) -> int:
        sc = sharing_class.get(its)
        if sc is None:
            sc = sharing_class[its] = len(class_items)
            class_items.append(its)
        return sc

    for k, rank_class in enumerate(plan.classes):
        segments, private = _segments(rank_class, items)
        if len(segments) == 1 and isinstance(segments[0], list):
            sc = sharing_class_of(tuple(segments[0]))
            for rank in members[k]:
                of_rank[rank] = sc
                private_of_rank[rank] = private
            continue
        for rank in members[k]:
            its, private_r = _rank_items(plan, rank, segments, private, items)
            of_rank[rank] = sharing_class_of(its)
            private_of_rank[rank] = private_r
    return _Sharing(of_rank, class_items, private_of_rank)


def _segments(rank_class: RankClass, items: _Items) -> tuple[list[_Segment], tuple[int, int, int]]:
    """A class's reads in unit order, and (fetched bytes, requests, units) of the groups
    only each member reads, none of whose rows any other rank reads."""
    segments: list[_Segment] = [[]]
    fetch_p = requests_p = units_p = 0
    for g in rank_class.groups:
        sample = [
            items.item(u, g.reads[j] if g.reads is not None else None)
            for j, u in enumerate(g.units)
        ]
        if not g.private:
            last = segments[-1]
            if isinstance(last, list):
                last.extend(sample)
            else:
                segments.append(sample)
            continue
        rows = items.windowed_of(g.units)
        if not any(rows) or g.expand is None:
            fetch_p += sum(c[2] for c in sample) * g.repeat
            requests_p += sum(c[3] for c in sample) * g.repeat
            units_p += sum(1 for c in sample if c[1]) * g.repeat
            continue
        segments.append((g, sample, rows, items.slice_free(g.units, rows)))
    return segments, (fetch_p, requests_p, units_p)


def _rank_items(
    plan: Plan,
    rank: int,
    segments: Sequence[_Segment],
    private: tuple[int, int, int],
    items: _Items,
) -> tuple[tuple[ClassItem, ...], tuple[int, int, int]]:
    """One member's shareable items and what it alone reads, its own experts' groups
    expanded."""
    out: list[ClassItem] = []
    fetch_r, requests_r, units_r = private
    for seg in segments:
        if isinstance(seg, list):
            out.extend(seg)
            continue
        # Experts whose slices are read as whole rows: the other MoE ranks of the
        # group read the same rows, so those are items of their own (keyed by the
        # rows); the rest of the group is still this rank's alone.
        g, sample, rows, free = seg
        assert g.expand is not None
        costs = tuple(c[1:] for c in sample)
        memo = (id(g.expand), costs, plan.summaries[rank].experts) if free else None
        got = items.expanded.get(memo) if memo is not None else None
        if got is None:
            seg_items: list[ClassItem] = []
            seg_fetch = seg_requests = seg_units = 0
            n = len(g.units)
            for j, u in enumerate(g.expand(rank)):
                c = sample[j % n]
                if rows[j % n]:
                    seg_items.append((items.key(u), c[1], c[2], c[3]))
                else:
                    seg_fetch += c[2]
                    seg_requests += c[3]
                    seg_units += 1 if c[1] else 0
            got = (seg_items, seg_fetch, seg_requests, seg_units)
            if memo is not None:
                items.expanded[memo] = got
        out.extend(got[0])
        fetch_r += got[1]
        requests_r += got[2]
        units_r += got[3]
    return tuple(out), (fetch_r, requests_r, units_r)


def _requests_by_kind(rank_class: RankClass, items: _Items) -> dict[str, int]:
    """A class's units' requests by unit kind (a shared read counted for every user)."""
    by_kind: dict[str, int] = {}
    for g in rank_class.groups:
        for j, u in enumerate(g.units):
            item = items.item(u, g.reads[j] if g.reads is not None else None)
            by_kind[u.kind] = by_kind.get(u.kind, 0) + item[3] * g.repeat
    return by_kind


# --- refit from a trainer's memory ---------------------------------------------------------


@dataclass(frozen=True)
class RefitRates:
    """A refit's rates (bytes per second): ``network`` a node's sends or receipts from
    other nodes, ``same_node`` what moves within one node (links whose sender and
    receiver share a node, and pieces passed on to a node's other ranks), ``convert``
    one rank converting BF16 to MXFP8 (source bytes), ``repack`` one engine rank laying
    out MXFP8 converted on the sender (wire bytes)."""

    link: str = "hccl"
    network: float = NETWORK_NODE_BYTES_PER_S
    same_node: float = DEVICE_IPC_BYTES_PER_S
    convert: float = NPU_CONVERT_BYTES_PER_S
    repack: float = NPU_REPACK_BYTES_PER_S

    def __post_init__(self) -> None:
        for name in ("same_node", "convert", "repack"):
            if not getattr(self, name) > 0:
                raise ValueError(f"refit rate {name} must be > 0, got {getattr(self, name)}")
        if not self.network >= 0:
            raise ValueError(f"refit rate network must be >= 0, got {self.network}")

    @classmethod
    def for_link(
        cls, link: str, *, network: float | None = None, device: str = "npu", **rates: float
    ) -> RefitRates:
        """The rates of link kind ``link`` (:data:`TRAINER_LINKS`), its network rate
        replaced by ``network`` where given (not for ``shm``, which has none), and the
        conversion rates of ``device`` unless given."""
        if link not in TRAINER_LINKS:
            raise ValueError(f"link {link!r} is not one of {', '.join(TRAINER_LINKS)}")
        net, same = TRAINER_LINKS[link]
        cpu = device == "cpu"
        return cls(
            link=link,
            network=net if network is None or link == "shm" else network,
            same_node=rates.get("same_node", same),
            convert=rates.get(
                "convert", CPU_CONVERT_BYTES_PER_S if cpu else NPU_CONVERT_BYTES_PER_S
            ),
            repack=rates.get("repack", CPU_REPACK_BYTES_PER_S if cpu else NPU_REPACK_BYTES_PER_S),
        )


@dataclass(frozen=True)
class RefitTime:
    """Predicted seconds of one refit, itemised; the stages overlap bucket by bucket."""

    network_seconds: float
    """The busiest node's sends or receipts over the network, whichever is larger."""
    same_node_seconds: float
    """The busiest node's bytes within itself: same-node links (a colocated trainer's
    bytes) and copies between its ranks."""
    sender_convert_seconds: float
    """The slowest trainer rank converting its MX pieces (0 converting on the receiver)."""
    receiver_seconds: float
    """The slowest engine rank converting (or repacking) its MX units."""
    fill_seconds: float
    """The pipeline's fill: one bucket through the stages before the slowest one ends."""
    copy_seconds: float
    """The busiest node's copies between its ranks alone (``RefitSummary.fanout_bytes``;
    part of ``same_node_seconds``)."""
    seconds: float
    """max(network, same node, sender convert, receiver) + fill."""
    slowest_node: int


def refit_times(summary: RefitSummary, rates: RefitRates) -> RefitTime:
    """Predicted seconds of a refit of ``summary`` (``refit.refit_summary``).

    Every link carries its bytes at once: a node's network sends and receipts each
    share its ``network`` rate (full duplex: the larger of the two bounds it), its
    same-node bytes share ``same_node``; senders convert and receivers convert or
    repack while buckets flow (each stage works on another bucket), so the refit takes
    its slowest stage plus one bucket's way through the others. A node's ranks copy the
    buffers they share as they are written, within its same-node rate
    (docs/time-model.md, "Refit")."""
    out: dict[int, int] = {}
    into: dict[int, int] = {}
    within = {n: b for n, b in enumerate(summary.fanout_bytes) if b}
    for link in summary.links:
        if link.same_node:
            within[link.receiver_node] = within.get(link.receiver_node, 0) + link.nbytes
        else:
            out[link.sender_node] = out.get(link.sender_node, 0) + link.nbytes
            into[link.receiver_node] = into.get(link.receiver_node, 0) + link.nbytes
    if (out or into) and rates.network <= 0:
        crossing = sum(out.values())
        raise ValueError(
            f"link {rates.link} moves bytes within a node only; this refit sends {crossing} "
            "bytes between nodes"
        )
    nodes = sorted(set(out) | set(into) | set(within))
    net = {
        n: max(out.get(n, 0), into.get(n, 0)) / rates.network if rates.network else 0.0
        for n in nodes
    }
    same = {n: within.get(n, 0) / rates.same_node for n in nodes}
    slowest = max(nodes, key=lambda n: max(net[n], same[n]), default=0)
    sender = max(summary.sender_convert_bytes, default=0) / rates.convert
    per = rates.repack if summary.convert_on == "sender" else rates.convert
    receiver = max(summary.receiver_mx_bytes, default=0) / per
    stages = {
        "network": (max(net.values(), default=0.0), rates.network),
        "same_node": (max(same.values(), default=0.0), rates.same_node),
        "sender": (sender, rates.convert),
        "receiver": (receiver, per),
    }
    slow = max(stages, key=lambda k: stages[k][0])
    bucket = min(summary.bucket_bytes, max(summary.sender_bytes, default=0))
    fill = sum(bucket / rate for k, (t, rate) in stages.items() if k != slow and t > 0 and rate > 0)
    copy = max(summary.fanout_bytes, default=0) / rates.same_node
    return RefitTime(
        network_seconds=stages["network"][0],
        same_node_seconds=stages["same_node"][0],
        sender_convert_seconds=sender,
        receiver_seconds=receiver,
        fill_seconds=fill,
        copy_seconds=copy,
        seconds=stages[slow][0] + fill,
        slowest_node=slowest,
    )


def save_seconds(node_bytes: dict[int, int], rates: Rates) -> float:
    """A trainer writing a checkpoint and fsyncing it: each node's bytes through its
    link to the store, the whole through the store's aggregate, as a load reads them
    (the same rates: ``Rates.storage_node``, ``Rates.storage_aggregate``)."""
    node = max(node_bytes.values(), default=0) / rates.storage_node if rates.storage_node else 0.0
    total = sum(node_bytes.values())
    agg = total / rates.storage_aggregate if rates.storage_aggregate else 0.0
    return max(node, agg)
