"""The coordinator's run side: place one worker per rank, drive load and reload, collect
reports (SPEC §4). Planning is pure and lives elsewhere; this module is where Ray is.

Flow of a load: read config + headers (``catalog``) -> plan (``planner``) -> refuse a
plan that does not fit or a staging budget below the minimum, before starting anything
-> start or join Ray -> one placement group, one bundle per rank, each asking one unit of
the accelerator resource and no CPU -> ranks mapped to bundles so a TP group shares a
node -> one ``RankWorker`` actor per rank -> every rank loads its shard concurrently ->
a rank whose process dies is restarted and redone up to ``max_restarts`` times ->
reports become the manifest of SPEC §5.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mxload.orchestrator.errors import (
    InputError,
    MxloadError,
    PlanDoesNotFit,
    RunError,
    StagingBudgetError,
    UsageError,
    WorkerLost,
)
from mxload.orchestrator.plan.formats import DUMP_FORMAT
from mxload.orchestrator.plan.types import ParallelLayout, Plan, RankPlan
from mxload.orchestrator.runtime.outputs import OutputDir

PLACEMENTS = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}


@dataclass
class LoadRequest:
    """Everything ``mxload load`` takes (SPEC §5)."""

    src: str
    layout: ParallelLayout
    storage_options: Mapping[str, Any] | None = None
    device: str = "auto"
    resource: str | None = None
    """Accelerator resource each rank asks for; default NPU (GPU with --device cuda)."""
    placement: str = "pack"
    address: str | None = None
    staging_budget: int | None = None
    device_memory: int | None = None
    dtype: str | None = None
    allow_nonfinite: bool = False
    max_restarts: int = 1
    placement_timeout_s: float = 120.0
    num_cpus: int | None = None
    """CPUs the embedded head declares (default: this machine's, capped at 2 in tests)."""
    threads_per_worker: int | None = None
    engine: str = "mxload"
    """Engine profile the buffers are laid out for (``mxload.orchestrator.plan.engines``)."""
    share: str = "cluster"
    """Read-once scope (``mxload.orchestrator.plan.sharing``): none | node | cluster."""
    fault_at: dict[int, int] = field(default_factory=dict)
    """Test hook: rank -> unit index at which that rank's process exits hard (first try only)."""

    @property
    def accelerator(self) -> str:
        if self.resource:
            return self.resource
        return "GPU" if self.device == "cuda" else "NPU"


def plan_load(req: LoadRequest) -> tuple[Any, Plan]:
    """Read config and headers, build and check the plan. Pure apart from the reads."""
    if req.address:
        # First: a dead --address is refused in seconds, before the slow imports.
        from mxload.cluster.local import check_reachable

        check_reachable(req.address)
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.sharing import SHARE_SCOPES
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    if req.share not in SHARE_SCOPES:
        raise UsageError(
            f"--share: {req.share!r} is not one of {', '.join(SHARE_SCOPES)}", key="--share"
        )
    meta = open_checkpoint(req.src, storage_options=req.storage_options, dtype=req.dtype)
    from mxload.orchestrator.plan.config import LOADABLE_ARCHITECTURES

    if meta.config.architecture not in LOADABLE_ARCHITECTURES:
        raise InputError(
            f"{meta.config.source}: {meta.config.architecture} is planning-only; loadable "
            f"architectures: {', '.join(LOADABLE_ARCHITECTURES)}",
            key="architectures",
        )
    plan = build_plan(
        meta.config,
        req.layout,
        checkpoint=meta,
        staging_budget=req.staging_budget,
        device_memory=req.device_memory,
        device="cpu" if req.device in ("cpu", "auto") else req.device,
        remote=not _is_local(req.src),
        fused=workers_fused(req.device),
        engine=req.engine,
    )
    if req.staging_budget is not None and req.staging_budget < plan.min_staging_load:
        raise StagingBudgetError(
            f"--staging-budget {req.staging_budget} bytes is below the minimum a load can "
            f"run under ({plan.min_staging_load} bytes); raise --staging-budget",
            key="--staging-budget",
        )
    if not plan.fits:
        worst = max(plan.ranks, key=lambda r: r.peak_bytes)
        raise PlanDoesNotFit(
            f"rank {worst.rank} needs {worst.peak_bytes} bytes at its peak, more than "
            f"--device-memory {plan.device_memory_bytes}; nothing was started",
            rank=worst.rank,
        )
    return meta, plan


def workers_fused(device: str) -> bool:
    """Whether workers will convert with the fused CPU kernel (plans no resolve
    scratch). Device paths (npu, cuda) resolve with eager torch ops: unfused."""
    if device not in ("cpu", "auto"):
        return False
    try:
        from mxload.workers.numerics.fast import fast_available

        return bool(fast_available())
    except ImportError:
        return False


def _is_local(src: str) -> bool:
    return "://" not in src or src.startswith("file://")


def staging_budget_of(plan: Plan, rank: RankPlan) -> int:
    """The budget a rank runs under: what the plan's estimate was computed for."""
    if rank.staging is not None:
        return rank.staging.budget_bytes
    return plan.min_staging_reload


class RayRun:
    """A started (or joined) Ray, the placement group and the rank actors."""

    def __init__(self, req: LoadRequest, plan: Plan, *, detached_name: str | None = None) -> None:
        self.req = req
        self.plan = plan
        self.temp_dir: str | None = None
        self.started_ray = False
        self.pg: Any = None
        self.actors: list[Any] = []
        self.bundle_of_rank: list[int] = []
        self.split_tp_groups: list[int] = []
        self.detached_name = detached_name
        self.last_sharing: dict[str, Any] = {}
        """What the last run's read-once sharing planned and measured (manifest "sharing")."""

    # --- cluster ------------------------------------------------------------------------

    def start(self) -> None:
        import ray
        from mxload.cluster.local import connect, start_embedded

        if ray.is_initialized():
            return
        if self.req.address:
            connect(self.req.address)
        else:
            if self.req.device in ("npu", "cuda"):
                # The embedded head's one node is this machine: ask here, in a second,
                # rather than after Ray has started.
                from mxload.workers.rank.actor import probe_device

                problem = probe_device(self.req.device, self.req.accelerator)
                if problem:
                    raise InputError(problem, key="--device")
            self.temp_dir = start_embedded(
                self.plan.layout.world,
                resource=self.req.accelerator,
                num_cpus=self.req.num_cpus,
            )
            self.started_ray = True

    def place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        world = self.plan.layout.world
        res = self.req.accelerator
        have = ray.cluster_resources().get(res, 0)
        if have < world:
            raise InputError(
                f"the Ray cluster has {int(have)} {res} resources, the layout needs {world} "
                f"(one per rank); change the layout or --resource, or add nodes",
                key="--resource",
            )
        strategy = PLACEMENTS.get(self.req.placement)
        if strategy is None:
            raise InputError(
                f"--placement: {self.req.placement!r} is not one of {', '.join(PLACEMENTS)}",
                key="--placement",
            )
        bundles = [{res: 1.0} for _ in range(world)]
        kwargs: dict[str, Any] = {"strategy": strategy}
        if self.detached_name:
            kwargs["name"] = f"{self.detached_name}/pg"
            kwargs["lifetime"] = "detached"
        self.pg = placement_group(bundles, **kwargs)
        ready, _ = ray.wait([self.pg.ready()], timeout=self.req.placement_timeout_s)
        if not ready:
            raise RunError(
                f"placement group of {world} x {{{res}: 1}} ({strategy}) was not ready after "
                f"{self.req.placement_timeout_s:.0f}s; the cluster cannot place it",
            )
        table = placement_group_table(self.pg)
        self.bundle_of_rank = assign_ranks(table["bundles_to_node_id"], world)
        # PACK is best effort: say which TP groups ended up across nodes (a slow TP
        # all-reduce), rather than hide it.
        tp = self.plan.layout.tp
        nodes = table["bundles_to_node_id"]
        self.split_tp_groups = [
            g
            for g in range(world // tp)
            if len({nodes[self.bundle_of_rank[r]] for r in range(g * tp, (g + 1) * tp)}) > 1
        ]

    def check_devices(self) -> None:
        """Refuse (exit 2, one line) before any worker starts when a node of the placement
        group cannot compute on ``--device`` (npu without torch_npu, cuda without CUDA).
        One small task per node, inside one of that node's bundles (so Ray sets its visible
        devices as it will for the workers); ``auto`` and ``cpu`` always have a path."""
        if self.req.device not in ("npu", "cuda"):
            return
        import ray
        from mxload.workers.rank.actor import probe_device
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        table = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
        first_bundle: dict[str, int] = {}
        for b in sorted(table):
            first_bundle.setdefault(table[b], b)
        task = ray.remote(num_cpus=0, max_retries=0)(probe_device)
        refs = [
            task.options(
                resources={self.req.accelerator: 0.01},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=b
                ),
            ).remote(self.req.device, self.req.accelerator)
            for b in first_bundle.values()
        ]
        problems = sorted({p for p in ray.get(refs, timeout=self.req.placement_timeout_s) if p})
        if problems:
            more = f" (and {len(problems) - 1} more node(s))" if len(problems) > 1 else ""
            raise InputError(problems[0] + more, key="--device")

    def spawn(self) -> None:
        import ray
        from mxload.workers.rank.actor import remote_class
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = remote_class()
        world = self.plan.layout.world
        per_node: dict[str, int] = {}
        table = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
        for b in self.bundle_of_rank:
            per_node[table[b]] = per_node.get(table[b], 0) + 1
        cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n["Alive"]}
        model_dtype = self.plan.model["dtype"]
        self.actors = []
        for rank in range(world):
            bundle = self.bundle_of_rank[rank]
            node = table[bundle]
            threads = self.req.threads_per_worker or max(
                1, cpus.get(node, 1) // max(1, per_node[node])
            )
            opts: dict[str, Any] = {
                "num_cpus": 0,
                "resources": {self.req.accelerator: 1},
                "max_restarts": self.req.max_restarts,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundle
                ),
            }
            if self.detached_name:
                opts["name"] = f"{self.detached_name}/rank-{rank:05d}"
                opts["lifetime"] = "detached"
            actor = cls.options(**opts).remote(
                self.plan.ranks[rank],
                model_dtype=model_dtype,
                device=self.req.device,
                resource=self.req.accelerator,
                threads=threads,
            )
            self.actors.append(actor)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:
                pass
        if self.started_ray:
            ray.shutdown()
            if self.temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)

    # --- running ---------------------------------------------------------------------------

    def run_all(
        self,
        reads_of: Callable[[int], Any],
        source: Any,
        *,
        version: int,
        whole_units: bool,
        on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
        budgets: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Every rank loads (or reloads) concurrently; a dead rank is redone.

        ``budgets``: staging budget per rank (default: the plan's); a reload passes its
        own (a BF16 checkpoint stages more bytes per unit than the FP8 one loaded first)."""
        import ray
        from ray.exceptions import RayActorError

        world = len(self.actors)
        attempts = [0] * world
        if budgets is None:
            budgets = [staging_budget_of(self.plan, r) for r in self.plan.ranks]
        for rank, unit in self.req.fault_at.items():
            ray.get(self.actors[rank].set_fault.remote(unit))

        inputs = [reads_of(r) for r in range(world)]
        reads_all = [list(g[0] if isinstance(g, tuple) else g) for g in inputs]
        units_all = [g[1] if isinstance(g, tuple) else None for g in inputs]
        pids = self.pids()
        t_run = time.perf_counter()
        fetched, peers_of = self._share(reads_all, units_all, source, budgets, whole_units)
        t_fetched = time.perf_counter()

        def submit(rank: int) -> Any:
            return self.actors[rank].load.remote(
                reads_all[rank],
                source,
                version,
                budgets[rank],
                whole_units,
                units_all[rank],
                peers_of.get(rank),
            )

        refs = {submit(r): r for r in range(world)}
        reports: list[dict[str, Any] | None] = [None] * world
        failures: dict[int, MxloadError] = {}
        unavailable_since: dict[int, float] = {}
        # Wait for every rank even after one failed: a rank still writing must not be
        # handed the next load, and the error names every rank that failed.
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            if on_progress is not None:
                on_progress(self._poll_progress())
            for ref in done:
                rank = refs.pop(ref)
                try:
                    reports[rank] = ray.get(ref)
                    unavailable_since.pop(rank, None)
                except ray.exceptions.ActorUnavailableError:
                    # The process is being restarted (already counted): try again shortly.
                    if time.monotonic() - unavailable_since.setdefault(rank, time.monotonic()) > (
                        self.req.placement_timeout_s
                    ):
                        failures[rank] = WorkerLost(
                            f"rank {rank}: worker did not come back after a restart", rank=rank
                        )
                        continue
                    time.sleep(0.5)
                    refs[submit(rank)] = rank
                except RayActorError as err:
                    unavailable_since.pop(rank, None)
                    attempts[rank] += 1
                    if attempts[rank] > self.req.max_restarts:
                        failures[rank] = WorkerLost(
                            f"rank {rank}: worker process lost {attempts[rank]} time(s) "
                            f"(--max-restarts {self.req.max_restarts}): {first_line(err)}",
                            rank=rank,
                            details=plain(str(err)),
                        )
                        continue
                    refs[submit(rank)] = rank
                except ray.exceptions.RayTaskError as err:
                    # Say which rank failed (a bad scale in an expert only it holds).
                    failures[rank] = rank_error(rank, err)
        if failures:
            first = min(failures)
            err = failures[first]
            if len(failures) > 1:
                others = ", ".join(str(r) for r in sorted(failures) if r != first)
                err.message = f"{err.message} (ranks {others} failed too)"
                err.args = (err.message,)
            raise err
        out: list[dict[str, Any]] = []
        for rank, rep in enumerate(reports):
            assert rep is not None
            # A new process means new buffers: the rank's addresses changed (SPEC §4).
            restarted = rep["pid"] != pids[rank]
            rep["restarts"] = max(attempts[rank], int(restarted))
            rep["addresses_changed"] = restarted
            got = fetched.get(rank)
            if got is not None:  # what the rank fetched for its peers before loading
                rep["bytes_from_storage"] = rep.get("bytes_from_storage", 0) + got["fetched"]
                rep["shared_put_bytes"] = got["published"]
                rep["measured_peak_staging_bytes"] = max(
                    rep.get("measured_peak_staging_bytes") or 0, got["peak"]
                )
                rep["fetch_seconds"] = got["seconds"]
            out.append(rep)
        self._sharing_totals(out)
        if self.last_sharing:
            # the data phases the time model predicts (mxload.orchestrator.plan.timemodel)
            self.last_sharing["fetch_seconds"] = round(t_fetched - t_run, 4)
            self.last_sharing["run_seconds"] = round(time.perf_counter() - t_run, 4)
        return out

    def _share(
        self,
        reads_all: list[list[Any]],
        units_all: list[Any],
        source: Any,
        budgets: list[int],
        whole_units: bool,
    ) -> tuple[dict[int, dict[str, Any]], dict[int, dict[int, Any]]]:
        """Read once per cluster (``mxload.orchestrator.plan.sharing``): the owners fetch every
        shared read and publish it in Ray's object store; returns what each owner fetched
        and, per rank, unit index -> PeerUnit.

        A unit converted in row chunks is read chunk by chunk, so sharing needs every
        unit whole: a load whose staging budget is below the largest unit does not share
        (the manifest says so)."""
        import ray
        from mxload.orchestrator.plan.ranges import LOCAL_POLICY, REMOTE_POLICY
        from mxload.orchestrator.plan.readplan import predicted_reads
        from mxload.orchestrator.plan.sharing import (
            plan_sharing,
            rank_requests,
            rank_traffic,
            read_items,
            unique_bytes,
        )
        from mxload.orchestrator.plan.timemodel import MAX_REQUEST_BYTES
        from mxload.workers.rank.loader import PeerUnit

        local = _is_local(source.root)
        policy = LOCAL_POLICY if local else REMOTE_POLICY
        counted: dict[int, tuple[int, int]] = {}  # id(reads) -> (bytes, requests)

        def reads_cost(r: Any) -> tuple[int, int]:
            got = counted.get(id(r))
            if got is None:
                got = counted[id(r)] = predicted_reads(
                    (r,), policy, 0 if local else MAX_REQUEST_BYTES
                )
            return got

        def fetch_bytes(r: Any) -> int:
            return reads_cost(r)[0]

        scope = self.req.share
        note = ""
        if scope != "none" and not whole_units and min(budgets) < self.plan.min_staging_reload:
            scope, note = "none", "staging budget below the largest unit: units run in chunks"
        nodes = self.node_ids()
        items = [read_items(reads, fetch_bytes) for reads in reads_all]
        share = plan_sharing(nodes, scope, items.__getitem__)
        traffic = rank_traffic(share, items.__getitem__)
        requests = rank_requests(share, lambda rank: [reads_cost(r)[1] for r in reads_all[rank]])
        self.last_sharing = {
            "scope": share.scope,
            "requested_scope": self.req.share,
            "note": note,
            "shared_reads": len(share.shared),
            "nodes": len(set(nodes)),
            "unique_bytes_needed": unique_bytes(reads_all),
            "predicted": [t.__dict__ for t in traffic],
            # per rank: storage requests of its own reads, of the shared reads it owns
            "predicted_requests": [list(r) for r in requests],
        }
        fetched: dict[int, dict[str, Any]] = {}
        if not share.shared:
            return fetched, {}
        owners = sorted({s.owner for s in share.shared})
        refs = {}
        for rank in owners:
            items = []
            for s in share.owned_by(rank):
                i = next(i for r, i in s.users if r == rank)
                unit = (units_all[rank] or self.plan.ranks[rank].units)[i]
                items.append((s.key, unit, reads_all[rank][i]))
            refs[rank] = self.actors[rank].fetch_shared.remote(items, source, budgets[rank])
        handles: dict[int, Any] = {}
        for rank, ref in refs.items():
            try:
                got = ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                if isinstance(cause, MxloadError):
                    raise cause from None
                raise RunError(f"rank {rank}: fetching shared reads: {cause}", rank=rank) from err
            except ray.exceptions.RayActorError:
                continue  # its users read storage themselves (PeerUnit absent)
            fetched[rank] = got
            handles.update(got["handles"])
        peers_of: dict[int, dict[int, Any]] = {}
        for s in share.shared:
            if s.key not in handles:
                continue
            for rank, i in s.users:
                peers_of.setdefault(rank, {})[i] = PeerUnit(
                    owner=s.owner, fetch_bytes=s.fetch_bytes, handles=handles[s.key]
                )
        return fetched, peers_of

    def _sharing_totals(self, reports: list[dict[str, Any]]) -> None:
        """Cluster totals of the last run: storage bytes against the unique bytes."""
        info = self.last_sharing
        if not info:
            return
        storage = sum(r.get("bytes_from_storage") or 0 for r in reports)
        unique = info["unique_bytes_needed"]
        info["bytes_from_storage"] = storage
        info["bytes_from_peers"] = sum(r.get("bytes_from_peers") or 0 for r in reports)
        info["storage_over_unique"] = round(storage / unique, 4) if unique else None
        info["predicted_bytes_from_storage"] = sum(
            p["bytes_from_storage"] for p in info["predicted"]
        )
        for rep, pred in zip(reports, info["predicted"], strict=True):
            rep["predicted_bytes_from_storage"] = pred["bytes_from_storage"]
            rep["predicted_bytes_from_peers"] = pred["bytes_from_peers"]

    def node_ids(self) -> list[str]:
        """Each rank's node. A worker being restarted is waited for (up to the placement
        timeout); one that does not answer gets a node of its own, so sharing plans
        around it (its users fall back to storage if it owned anything)."""
        import ray

        out: list[str] = []
        for rank, a in enumerate(self.actors):
            deadline = time.monotonic() + self.req.placement_timeout_s
            while True:
                try:
                    out.append(ray.get(a.node_id.remote(), timeout=self.req.placement_timeout_s))
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

    def pids(self) -> list[int | None]:
        """Each rank's worker pid now (None for one that does not answer)."""
        import ray

        out: list[int | None] = []
        for a in self.actors:
            try:
                out.append(ray.get(a.pid.remote(), timeout=self.req.placement_timeout_s))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def _poll_progress(self) -> list[tuple[int, int, int]]:
        import ray

        refs = [a.progress.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.2)
        got = {r: ray.get(r) for r in ready}
        return [got.get(r, (0, 0, 0)) for r in refs]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain(text: str) -> str:
    """``text`` without terminal colour codes (Ray colours its remote tracebacks)."""
    return _ANSI.sub("", text)


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's text, without colour codes."""
    lines = [ln.strip() for ln in plain(str(err)).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def rank_error(rank: int, err: Any) -> MxloadError:
    """A worker's error as the user sees it: ``rank N: <what>``, one error of mxload's
    hierarchy (its exit status kept), the remote traceback kept aside in ``details`` for
    ``--debug`` and the log file."""
    cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err
    details = plain(str(err))
    if isinstance(cause, MxloadError):
        if not cause.message.startswith(f"rank {rank}"):
            cause.message = f"rank {rank}: {cause.message}"
            cause.args = (cause.message,)
        cause.context.setdefault("rank", rank)
        cause.context["details"] = details
        return cause
    return RunError(
        f"rank {rank}: {type(cause).__name__}: {first_line(cause)}", rank=rank, details=details
    )


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


def source_info(meta: Any, req_allow_nonfinite: bool, src: str, storage_options: Any) -> Any:
    from mxload.workers.rank.loader import SourceInfo

    q = meta.config.quant
    return SourceInfo(
        root=src,
        storage_options=dict(storage_options) if storage_options else None,
        quant=q.kind,
        block_n=q.block_n,
        block_k=q.block_k,
        allow_nonfinite=req_allow_nonfinite,
        fingerprint=meta.fingerprint,
    )


def build_manifest(
    plan: Plan, reports: list[dict[str, Any]], *, with_tensors: bool = True
) -> dict[str, Any]:
    """SPEC §5's mxload-dump/1 manifest from the ranks' reports."""
    ranks = []
    for rp, rep in zip(plan.ranks, reports, strict=True):
        entry: dict[str, Any] = {
            "rank": rp.rank,
            "tp_rank": rp.tp_rank,
            "dp_rank": rp.dp_rank,
            "pp_rank": rp.pp_rank,
            "ep_rank": rp.ep_rank,
            "node_id": rep.get("node_id", ""),
            "pid": rep.get("pid"),
            "device": rep.get("device", ""),
            "backend": rep.get("backend", ""),
            "backend_note": rep.get("backend_note", ""),
            "visible_devices": rep.get("visible_devices", ""),
            "experts": list(rp.experts),
            "layers": list(rp.layers),
            "tensors": rep.get("tensors", {}),
            "version": rep.get("version"),
            "consistent": rep.get("consistent"),
            # [version, checkpoint fingerprint] every unit holds; None when they differ
            "identity": rep.get("identity"),
            "units": rep.get("units"),
            "bytes_read": rep.get("bytes_read"),
            "bytes_needed": rep.get("bytes_needed"),
            "bytes_to_read": rp.bytes_to_read,
            "read_amplification": _ratio(rep.get("bytes_read"), rep.get("bytes_needed")),
            "persistent_bytes": rp.persistent_bytes,
            "predicted_peak_staging_bytes": rep.get("predicted_peak_staging_bytes"),
            "measured_peak_staging_bytes": rep.get("measured_peak_staging_bytes"),
            "device_peak_staging_bytes": rep.get("device_peak_staging_bytes"),
            "rss_growth_bytes": rep.get("rss_growth_bytes"),
            "bytes_from_storage": rep.get("bytes_from_storage"),
            "bytes_from_peers": rep.get("bytes_from_peers"),
            "predicted_bytes_from_storage": rep.get("predicted_bytes_from_storage"),
            "predicted_bytes_from_peers": rep.get("predicted_bytes_from_peers"),
            "shared_put_bytes": rep.get("shared_put_bytes", 0),
            "peer_fallbacks": rep.get("peer_fallbacks", 0),
            "seconds": rep.get("seconds"),
            "restarts": rep.get("restarts", 0),
            "addresses_changed": rep.get("addresses_changed", False),
        }
        ranks.append(entry)
    from mxload.workers.rank.loader import CHECKSUM_NAME

    return {
        "format": DUMP_FORMAT,
        "model": plan.model,
        "parallel": plan.layout.to_json(),
        "engine": plan.engine,
        "checksum": CHECKSUM_NAME,
        "ranks": ranks,
    }


def _ratio(a: Any, b: Any) -> float | None:
    if not a or not b:
        return None
    return round(a / b, 4)


def write_dump(run: RayRun, manifest: dict[str, Any], out_dir: str | OutputDir) -> None:
    """``--dump DIR``: each rank's buffers as rank-NNNNN.safetensors + manifest.json.

    Written into a temporary folder beside DIR and renamed into place when complete
    (``orchestrator/runtime/outputs.py``): never a ``.partial``, never another run's rank files
    beside this manifest. A plain path is checked here (a non-empty DIR is refused); the
    CLI passes an :class:`OutputDir` it checked before any work, with ``--overwrite``."""
    import json

    import ray
    from mxload.orchestrator.plan.formats import BUFFER_TO_SAFETENSORS
    from mxload.workers.safetensors_io import SafetensorsWriter

    out = out_dir if isinstance(out_dir, OutputDir) else dump_target(out_dir)
    with out:
        tmp = out.begin()
        for rank, actor in enumerate(run.actors):
            raw = ray.get(actor.host_tensors.remote())
            specs = [
                (n, BUFFER_TO_SAFETENSORS[d], tuple(shape)) for n, (d, shape, _) in raw.items()
            ]
            path = os.path.join(tmp, f"rank-{rank:05d}.safetensors")
            with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as w:
                for name in w.order:
                    w.write(name, raw[name][2].tobytes())
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)


def dump_target(out_dir: str, *, overwrite: bool = False) -> OutputDir:
    """The checked ``--dump`` folder (OutputError, before any work, if it cannot be used)."""
    out = OutputDir(out_dir, "--dump", overwrite=overwrite)
    out.check()
    return out


def load(
    req: LoadRequest,
    *,
    dump: str | OutputDir | None = None,
    on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
    keep: bool = False,
) -> tuple[dict[str, Any], RayRun | None]:
    """The whole distributed load. Returns the manifest (with tensors' metadata) and,
    with ``keep``, the live run (the caller shuts it down)."""
    if isinstance(dump, str):
        dump = dump_target(dump)  # refused before any work, not after the load
    meta, plan = plan_load(req)
    run = RayRun(req, plan)
    try:
        run.start()
        manifest = first_load(run, meta, on_progress=on_progress)
        if dump:
            write_dump(run, manifest, dump)
    except BaseException:
        run.shutdown()
        raise
    if keep:
        return manifest, run
    run.shutdown()
    return manifest, None


def first_load(
    run: RayRun,
    meta: Any,
    *,
    on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
) -> dict[str, Any]:
    """Place and spawn the workers of a started run and load version 1; the manifest."""
    req, plan = run.req, run.plan
    source = source_info(meta, req.allow_nonfinite, req.src, req.storage_options)
    t0 = time.perf_counter()
    run.place()
    run.check_devices()
    run.spawn()
    reports = run.run_all(
        lambda r: list(plan.ranks[r].reads or ()),
        source,
        version=1,
        whole_units=False,
        on_progress=on_progress,
    )
    manifest = build_manifest(plan, reports)
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    manifest["placement"] = {
        "strategy": req.placement,
        "tp_groups_across_nodes": run.split_tp_groups,
    }
    manifest["sharing"] = sharing_summary(run)
    return manifest


def sharing_summary(run: RayRun) -> dict[str, Any]:
    """The manifest's "sharing" object: scope, cluster totals, the data phases' seconds
    and the predicted traffic per rank (what ``mxload.orchestrator.plan.timemodel`` takes)."""
    info = dict(run.last_sharing)
    info["predicted_traffic"] = info.pop("predicted", [])
    return info


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
