"""Where the ranks run: start or join Ray, one placement group with one bundle per rank
(each asking one unit of the accelerator resource and no CPU), ranks mapped to bundles
so a TP group shares a node, a device probe per node, one worker actor per rank
(docs/contract.md §4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InputError, RunError
from ..plan.types import Plan, RankPlan
from .request import LoadRequest

if TYPE_CHECKING:
    from ...workers.rank.actor import RankWorker

PLACEMENTS = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}


def start_ray(req: LoadRequest, world: int) -> str | None:
    """Join ``req.address``, or start the embedded head (returns its temp dir)."""
    from ...cluster.local import connect, start_embedded

    if req.address:
        connect(req.address)
        return None
    if req.device in ("npu", "cuda"):
        # The embedded head's one node is this machine: ask here, in a second, rather
        # than after Ray has started.
        from ...workers.rank.actor import probe_device

        problem = probe_device(req.device, req.accelerator)
        if problem:
            raise InputError(problem, key="--device")
    return start_embedded(world, resource=req.accelerator, num_cpus=req.num_cpus)


@dataclass
class Placement:
    """The placement group and which bundle each rank runs in."""

    pg: Any
    bundle_of_rank: list[int] = field(default_factory=list)
    split_tp_groups: list[int] = field(default_factory=list)
    """TP groups whose ranks ended up on more than one node (PACK is best effort)."""

    def node_of_bundle(self) -> dict[int, str]:
        import ray

        return dict(ray.util.placement_group_table(self.pg)["bundles_to_node_id"])


def place(req: LoadRequest, plan: Plan, *, name: str | None = None) -> Placement:
    """Reserve one bundle per rank (a detached session's group is named and detached)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    world = plan.layout.world
    res = req.accelerator
    have = ray.cluster_resources().get(res, 0)  # type: ignore[no-untyped-call]
    if have < world:
        raise InputError(
            f"the Ray cluster has {int(have)} {res} resources, the layout needs {world} "
            f"(one per rank); change the layout or --resource, or add nodes",
            key="--resource",
        )
    strategy = PLACEMENTS.get(req.placement)
    if strategy is None:
        raise InputError(
            f"--placement: {req.placement!r} is not one of {', '.join(PLACEMENTS)}",
            key="--placement",
        )
    kwargs: dict[str, Any] = {"strategy": strategy}
    if name:
        kwargs["name"] = f"{name}/pg"
        kwargs["lifetime"] = "detached"
    pg = placement_group([{res: 1.0} for _ in range(world)], **kwargs)
    ready, _ = ray.wait([pg.ready()], timeout=req.placement_timeout_s)
    if not ready:
        # A pending group stays queued in Ray and would hold the next load behind it.
        ray.util.remove_placement_group(pg)
        raise RunError(
            f"placement group of {world} x {{{res}: 1}} ({strategy}) was not ready after "
            f"{req.placement_timeout_s:.0f}s; the cluster cannot place it",
        )
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    bundle_of_rank = assign_ranks(nodes, world)
    tp = plan.layout.tp
    split = [
        g
        for g in range(world // tp)
        if len({nodes[bundle_of_rank[r]] for r in range(g * tp, (g + 1) * tp)}) > 1
    ]
    return Placement(pg, bundle_of_rank, split)


def assign_ranks(bundles_to_node: Mapping[int, str], world: int) -> list[int]:
    """Rank -> bundle index so consecutive ranks (a TP group) share a node where the
    placement allows: bundles grouped by node, nodes in order of their first bundle."""
    order: list[str] = []
    by_node: dict[str, list[int]] = {}
    for b in sorted(bundles_to_node):
        node = bundles_to_node[b]
        if node not in by_node:
            order.append(node)
            by_node[node] = []
        by_node[node].append(b)
    flat = [b for node in order for b in by_node[node]]
    if len(flat) != world:
        raise RunError(f"placement group has {len(flat)} bundles for {world} ranks")
    return flat


def check_devices(req: LoadRequest, placed: Placement) -> None:
    """Refuse (exit 2, one line) before any worker starts when a node of the placement
    group cannot compute on ``--device`` (npu without torch_npu, cuda without CUDA).
    One small task per node, inside one of that node's bundles (so Ray sets its visible
    devices as it will for the workers); ``auto`` and ``cpu`` always have a path."""
    if req.device not in ("npu", "cuda"):
        return
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ...workers.rank.actor import probe_device

    table = placed.node_of_bundle()
    first_bundle: dict[str, int] = {}
    for b in sorted(table):
        first_bundle.setdefault(table[b], b)
    task = ray.remote(num_cpus=0, max_retries=0)(probe_device)
    refs = [
        task.options(
            resources={req.accelerator: 0.01},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placed.pg, placement_group_bundle_index=b
            ),
        ).remote(req.device, req.accelerator)
        for b in first_bundle.values()
    ]
    problems = sorted({p for p in ray.get(refs, timeout=req.placement_timeout_s) if p})
    if problems:
        more = f" (and {len(problems) - 1} more node(s))" if len(problems) > 1 else ""
        raise InputError(problems[0] + more, key="--device")


def rank_plan_key(session: str, rank: int) -> str:
    """Where a detached session's rank plan is stored in the GCS (:func:`store_rank_plan`)."""
    return f"{session}/rank-{rank:05d}/plan"


def store_rank_plan(session: str, rank_plan: RankPlan) -> str:
    """Store a detached rank's plan in the GCS; its key, which the rank is started with
    (``workers.rank.actor.stored_rank_plan``) so that Ray can restart it after the
    command that made it exited, at any model size."""
    import pickle

    from ...cluster import raycompat

    key = rank_plan_key(session, rank_plan.rank)
    raycompat.kv_put(key, pickle.dumps(rank_plan))
    return key


def forget_rank_plans(session: str) -> None:
    """Remove every rank plan of a detached session from the GCS (release)."""
    from ...cluster import raycompat

    raycompat.kv_del(f"{session}/rank-", by_prefix=True)


def spawn(
    req: LoadRequest,
    plan: Plan,
    placed: Placement,
    worker: type[RankWorker],
    *,
    name: str | None = None,
) -> list[Any]:
    """One ``worker`` actor per rank in its bundle, restarted by Ray up to
    ``--max-restarts``; its torch threads are its share of its node's cores."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ...workers.rank.actor import remote_class

    cls = remote_class(worker)
    table = placed.node_of_bundle()
    per_node: dict[str, int] = {}
    for b in placed.bundle_of_rank:
        per_node[table[b]] = per_node.get(table[b], 0) + 1
    cpus = {
        n["NodeID"]: int(n["Resources"].get("CPU", 1))
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n["Alive"]
    }
    actors = []
    for rank in range(plan.layout.world):
        bundle = placed.bundle_of_rank[rank]
        node = table[bundle]
        threads = req.threads_per_worker or max(1, cpus.get(node, 1) // max(1, per_node[node]))
        opts: dict[str, Any] = {
            "num_cpus": 0,
            "resources": {req.accelerator: 1},
            "max_restarts": req.max_restarts,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placed.pg, placement_group_bundle_index=bundle
            ),
        }
        given: RankPlan | str = plan.ranks[rank]
        if name:
            opts["name"] = f"{name}/rank-{rank:05d}"
            opts["lifetime"] = "detached"
            given = store_rank_plan(name, plan.ranks[rank])
        actors.append(
            cls.options(**opts).remote(
                given,
                model_dtype=plan.model["dtype"],
                device=req.device,
                resource=req.accelerator,
                threads=threads,
            )
        )
    return actors
