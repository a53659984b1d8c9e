"""The distributed load (docs/contract.md §4): read config + headers (``catalog``) ->
plan (``planner``) -> refuse a plan that does not fit or a staging budget below the
minimum, before starting anything -> start or join Ray, place and spawn one worker per
rank (:mod:`.placement`) -> every rank loads its shard concurrently, a lost process
restarted and redone (:mod:`.ray_run`) -> reports become the manifest (:mod:`.reports`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...workers.storage.urls import is_remote
from ..errors import InputError, PlanDoesNotFit, StagingBudgetError, UsageError
from ..plan.checkpoint import CheckpointMeta
from ..plan.message import RankJob
from ..plan.types import Plan
from .outputs import OutputDir
from .ray_run import RayRun
from .reports import (
    build_manifest,
    dump_target,
    sharing_summary,
    write_dump,
)
from .request import (
    LoadRequest,
    source_info,
    staging_budget_of,
    workers_fused,
)


def plan_load(req: LoadRequest) -> tuple[CheckpointMeta, Plan]:
    """Read config and headers, build and check the plan. Pure apart from the reads."""
    if req.address:
        # First: a dead --address is refused in seconds, before the slow imports.
        from ...cluster.local import check_reachable

        check_reachable(req.address)
    from ..plan.planner import build_plan
    from ..plan.sharing import SHARE_SCOPES
    from .catalog import open_checkpoint

    if req.share not in SHARE_SCOPES:
        raise UsageError(
            f"--share: {req.share!r} is not one of {', '.join(SHARE_SCOPES)}", key="--share"
        )
    meta = open_checkpoint(req.src, storage_options=req.storage_options, dtype=req.dtype)
    from ..plan.config import LOADABLE_ARCHITECTURES

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
        remote=is_remote(req.src),
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
    meta: CheckpointMeta,
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
    jobs = [
        RankJob(
            reads=r.reads or (),
            source=source,
            version=1,
            staging_budget=staging_budget_of(plan, r),
        )
        for r in plan.ranks
    ]
    reports = run.run_all(jobs, on_progress=on_progress)
    manifest = build_manifest(plan, reports)
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    manifest["placement"] = {
        "strategy": req.placement,
        "tp_groups_across_nodes": run.split_tp_groups,
    }
    manifest["sharing"] = sharing_summary(run)
    manifest["identity_established_by"] = meta.identity
    return manifest
