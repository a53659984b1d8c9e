"""Read once per cluster, on Ray (``mxload.orchestrator.plan.sharing`` plans it): which
ranks own which shared reads, the owners fetching them into Ray's object store before
the ranks load, and the cluster totals the manifest's "sharing" reports.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...workers.storage.urls import is_remote
from ..errors import MxloadError, RunError
from ..plan.message import PeerUnit, RankJob
from ..plan.types import Plan, UnitReads
from .state import Report

if TYPE_CHECKING:
    from ..plan.sharing import SharePlan
    from .liveness import Liveness


@dataclass
class Shared:
    """What the owners fetched for their peers before the ranks load."""

    fetched: dict[int, dict[str, Any]] = field(default_factory=dict)
    """owner rank -> what its ``fetch_shared`` returned (bytes, peak, seconds)."""
    peers_of: dict[int, dict[int, PeerUnit]] = field(default_factory=dict)
    """rank -> unit index -> where a peer published that unit's bytes."""


def plan_shares(
    plan: Plan,
    nodes: Sequence[str],
    scope: str,
    jobs: Sequence[RankJob],
) -> tuple[SharePlan, dict[str, Any]]:
    """The sharing plan for this run (``jobs``: one per rank, all of one source) and
    what it predicts (the manifest's "sharing").

    A unit converted in row chunks is read chunk by chunk, so sharing needs every unit
    whole: a load whose staging budget is below the largest unit does not share (the
    manifest says so)."""
    from ..plan.ranges import LOCAL_POLICY, REMOTE_POLICY
    from ..plan.readplan import predicted_reads
    from ..plan.sharing import (
        plan_sharing,
        rank_requests,
        rank_traffic,
        read_items,
        unique_bytes,
    )
    from ..plan.timemodel import MAX_REQUEST_BYTES

    reads_all = [job.reads for job in jobs]
    local = not is_remote(jobs[0].source.root)
    policy = LOCAL_POLICY if local else REMOTE_POLICY
    counted: dict[int, tuple[int, int]] = {}  # id(reads) -> (bytes, requests)

    def reads_cost(r: UnitReads) -> tuple[int, int]:
        got = counted.get(id(r))
        if got is None:
            got = counted[id(r)] = predicted_reads((r,), policy, 0 if local else MAX_REQUEST_BYTES)
        return got

    def fetch_bytes(r: UnitReads) -> int:
        return reads_cost(r)[0]

    requested = scope
    note = ""
    budget = min(job.staging_budget for job in jobs)
    if scope != "none" and not jobs[0].whole_units and budget < plan.min_staging_reload:
        scope, note = "none", "staging budget below the largest unit: units run in chunks"
    items = [read_items(reads, fetch_bytes) for reads in reads_all]
    share = plan_sharing(list(nodes), scope, items.__getitem__)
    traffic = rank_traffic(share, items.__getitem__)
    requests = rank_requests(share, lambda rank: [reads_cost(r)[1] for r in reads_all[rank]])
    used: list[set[int]] = [set() for _ in reads_all]
    for s in share.shared:
        for rank, i in s.users:
            used[rank].add(i)
    info = {
        "scope": share.scope,
        "requested_scope": requested,
        "note": note,
        "shared_reads": len(share.shared),
        "nodes": len(set(nodes)),
        "unique_bytes_needed": unique_bytes(reads_all),
        "predicted": [t.__dict__ for t in traffic],
        # per rank: storage requests of its own reads, of the shared reads it owns
        "predicted_requests": [list(r) for r in requests],
        # per rank: units it reads from storage itself while loading, one after another
        "predicted_storage_units": [
            sum(1 for i, r in enumerate(reads) if r.nbytes and i not in used[rank])
            for rank, reads in enumerate(reads_all)
        ],
    }
    return share, info


def fetch_shares(
    actors: Sequence[Any],
    share: SharePlan,
    plan: Plan,
    jobs: Sequence[RankJob],
    live: Liveness,
) -> Shared:
    """The owners fetch every shared read and publish it in Ray's object store. An owner
    whose process is lost publishes nothing: its users read storage themselves; one
    that stops answering is named (``live``, RankSilent).

    An owner fetches several of its units at once within the staging of its run's
    largest unit read: every unit's reads are staged whole at some point of the load,
    so this is within the rank's predicted staging."""
    import ray

    out = Shared()
    if not share.shared:
        return out
    refs = {}
    for rank in sorted({s.owner for s in share.shared}):
        job = jobs[rank]
        units = job.units if job.units is not None else plan.ranks[rank].units
        items = []
        for s in share.owned_by(rank):
            i = next(i for r, i in s.users if r == rank)
            items.append((s.key, units[i], job.reads[i]))
        window = max((r.nbytes for r in job.reads), default=0)
        refs[rank] = actors[rank].fetch_shared.remote(items, job.source, job.staging_budget, window)
    live.wait(refs)
    handles: dict[Any, Any] = {}
    for rank, ref in refs.items():
        try:
            got = ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else err
            if isinstance(cause, MxloadError):
                raise cause from None
            raise RunError(f"rank {rank}: fetching shared reads: {cause}", rank=rank) from err
        except ray.exceptions.RayActorError:
            continue
        out.fetched[rank] = got
        handles.update(got["handles"])
    for s in share.shared:
        if s.key not in handles:
            continue
        for rank, i in s.users:
            out.peers_of.setdefault(rank, {})[i] = PeerUnit(
                owner=s.owner, fetch_bytes=s.fetch_bytes, handles=handles[s.key]
            )
    return out


def add_fetched(reports: Sequence[Report], shared: Shared) -> None:
    """Count in each owner's report what it fetched for its peers before loading."""
    for rank, got in shared.fetched.items():
        rep = reports[rank]
        rep["bytes_from_storage"] = rep.get("bytes_from_storage", 0) + got["fetched"]
        rep["shared_put_bytes"] = got["published"]
        rep["measured_peak_staging_bytes"] = max(
            rep.get("measured_peak_staging_bytes") or 0, got["peak"]
        )
        rep["fetch_seconds"] = got["seconds"]


def sharing_totals(info: dict[str, Any], reports: Sequence[Report]) -> None:
    """Cluster totals of a run: storage bytes against the unique bytes; each report gets
    its predicted traffic beside the measured one."""
    if not info:
        return
    storage = sum(r.get("bytes_from_storage") or 0 for r in reports)
    unique = info["unique_bytes_needed"]
    info["bytes_from_storage"] = storage
    info["bytes_from_peers"] = sum(r.get("bytes_from_peers") or 0 for r in reports)
    info["storage_over_unique"] = round(storage / unique, 4) if unique else None
    info["predicted_bytes_from_storage"] = sum(p["bytes_from_storage"] for p in info["predicted"])
    for rep, pred in zip(reports, info["predicted"], strict=True):
        rep["predicted_bytes_from_storage"] = pred["bytes_from_storage"]
        rep["predicted_bytes_from_peers"] = pred["bytes_from_peers"]


def node_ids(actors: Sequence[Any], timeout_s: float) -> list[str]:
    """Each rank's node. A worker being restarted is waited for (up to ``timeout_s``);
    one that does not answer gets a node of its own, so sharing plans around it (its
    users fall back to storage if it owned anything)."""
    import ray

    out: list[str] = []
    for rank, a in enumerate(actors):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                out.append(ray.get(a.node_id.remote(), timeout=timeout_s))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                out.append(f"unavailable-rank-{rank}")
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                out.append(f"unavailable-rank-{rank}")
                break
    return out
