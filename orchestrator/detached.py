"""Detached sessions: workers that outlive the command that loaded them (SPEC §4).

``mxload load --detach`` leaves, in the Ray namespace ``mxload``, under the session
name (``--session``, default ``default``):

* ``<session>/rank-NNNNN`` — one named, ``lifetime="detached"`` worker actor per rank,
  holding its buffers;
* ``<session>/pg`` — the placement group pinning them;
* ``<session>/keeper`` — a small detached actor holding what later commands need: the
  plan, the request, the current version and source, and every buffer's address as
  first loaded (the addresses a captured graph points at).

On the embedded default, ``load --detach`` first starts a local Ray head as its own
background process and records its address under ``$MXLOAD_HOME``
(``mxload.cluster.local.start_detached_head``), so ``status``/``reload``/``release`` in other
processes find it without ``--address``. ``release`` ends the session's actors and, when
no session is left on a head that mxload started, stops that head.

A rank whose worker process died is restarted by Ray (``--max-restarts``) with fresh,
empty buffers at new addresses: ``status`` and ``reload`` notice it (its pid changed),
reload it to the session's version from the current source, and report
``addresses_changed: true`` for it — the graph on that device must be recaptured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .driver import (
    LoadRequest,
    RayRun,
    build_manifest,
    first_load,
    plan_load,
    source_info,
    write_dump,
)
from .errors import AddressMoved, SessionError, WorkerLost
from .plantypes import Plan

NAMESPACE = "mxload"
VIRTUAL_DEVICES_PER_HEAD = 16
"""Virtual accelerators a background head declares: one Ascend node's worth."""


class SessionKeeper:
    """Actor body holding a detached session's state (plain data, pickled by Ray)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def get(self) -> dict[str, Any]:
        return self.state

    def update(self, changes: dict[str, Any]) -> None:
        self.state.update(changes)


def _keeper_name(session: str) -> str:
    return f"{session}/keeper"


def _rank_name(session: str, rank: int) -> str:
    return f"{session}/rank-{rank:05d}"


def _connect(address: str | None) -> tuple[str, bool]:
    """Join the session's Ray: --address, else the head recorded under $MXLOAD_HOME."""
    import ray
    from mxload.cluster.local import connect, head_alive, mxload_home, read_head_record

    if ray.is_initialized():
        return "", False
    own = False
    if address is None:
        record = read_head_record()
        if record is None or not head_alive(record):
            # The actual folder, not the variable's name: the user may not know it is set.
            raise SessionError(
                f"no detached session here: no running Ray head is recorded in "
                f"{mxload_home()} ($MXLOAD_HOME); start one with `mxload load SRC --detach`, "
                "or join a cluster with --address HOST:PORT",
                key="--address",
            )
        address, own = record.address, True
        connect(address, token=record.token)
        return address, own
    connect(address)
    return address, own


def _keeper(session: str) -> Any:
    import ray

    try:
        return ray.get_actor(_keeper_name(session), namespace=NAMESPACE)
    except ValueError:
        names = session_names()
        hint = (
            f"sessions here: {', '.join(names)} (e.g. `mxload status --session {names[0]}`)"
            if names
            else "no session is running here; start one with `mxload load SRC --detach`"
        )
        raise SessionError(
            f"no such session {session!r} in this Ray cluster; {hint}", key="--session"
        ) from None


def session_names() -> list[str]:
    """Names of the detached sessions in the connected Ray cluster, sorted."""
    import ray

    suffix = "/keeper"
    return sorted(
        str(a["name"])[: -len(suffix)]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE and str(a.get("name", "")).endswith(suffix)
    )


def detached_load(
    req: LoadRequest,
    *,
    session: str = "default",
    dump: str | None = None,
    on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
) -> dict[str, Any]:
    """Load and leave the workers running under ``session``; returns the manifest."""
    import ray
    from mxload.cluster.local import start_detached_head

    meta, plan = plan_load(req)  # refuse bad input before starting anything
    started_head = False
    if req.address is None and not ray.is_initialized():
        # One node's worth of virtual devices (at least the layout's), so a second
        # session (a reference model beside the policy) fits on the same head.
        record = start_detached_head(
            max(plan.layout.world, VIRTUAL_DEVICES_PER_HEAD), resource=req.accelerator
        )
        req = replace(req, address=record.address)
        started_head = True
        from mxload.cluster.local import connect

        connect(record.address, token=record.token)
    else:
        _connect(req.address)
    try:
        ray.get_actor(_keeper_name(session), namespace=NAMESPACE)
        raise SessionError(
            f"session {session!r} already exists; `mxload release --session {session}` first, "
            "or choose another --session",
            key="--session",
        )
    except ValueError:
        pass
    run = RayRun(req, plan, detached_name=session)
    try:
        manifest = first_load(run, meta, on_progress=on_progress)
    except BaseException:
        for a in run.actors:
            ray.kill(a)
        if run.pg is not None:
            ray.util.remove_placement_group(run.pg)
        raise
    reports = manifest["ranks"]
    manifest["session"] = session
    manifest["address"] = req.address
    state = {
        "session": session,
        "request": replace(req, fault_at={}),
        "plan": plan,
        "version": 1,
        "src": req.src,
        "storage_options": req.storage_options,
        "addresses": {
            r["rank"]: {n: t["data_ptr"] for n, t in r["tensors"].items()} for r in reports
        },
        "pids": {r["rank"]: r["pid"] for r in reports},
        "started_head": started_head,
        "created": time.time(),
    }
    keeper_cls = ray.remote(num_cpus=0)(SessionKeeper)
    keeper = keeper_cls.options(
        name=_keeper_name(session), namespace=NAMESPACE, lifetime="detached"
    ).remote(state)
    ray.get(keeper.get.remote())
    if dump:
        write_dump(run, manifest, dump)
    ray.shutdown()
    return manifest


def _attach(session: str, address: str | None) -> tuple[Any, dict[str, Any], RayRun]:
    import ray

    _connect(address)
    keeper = _keeper(session)
    state = ray.get(keeper.get.remote())
    plan: Plan = state["plan"]
    run = RayRun(state["request"], plan, detached_name=session)
    try:
        run.actors = [
            ray.get_actor(_rank_name(session, r), namespace=NAMESPACE)
            for r in range(plan.layout.world)
        ]
    except ValueError as err:
        raise WorkerLost(f"session {session!r}: a rank actor is gone for good: {err}") from None
    return keeper, state, run


def _repair(keeper: Any, state: dict[str, Any], run: RayRun) -> list[int]:
    """Reload ranks whose worker was restarted (fresh process, empty buffers) to the
    session's version from its current source. Returns those ranks."""
    import ray
    from ray.exceptions import RayActorError

    infos: list[dict[str, Any] | None] = []
    for a in run.actors:
        try:
            infos.append(ray.get(a.info.remote(), timeout=120))
        except RayActorError:
            infos.append(None)
    lost = [r for r, info in enumerate(infos) if info is None or info["pid"] != state["pids"][r]]
    if not lost:
        return []
    from .catalog import open_checkpoint

    req: LoadRequest = state["request"]
    meta = open_checkpoint(state["src"], storage_options=state["storage_options"])
    source = source_info(meta, req.allow_nonfinite, state["src"], state["storage_options"])
    _, fresh = plan_load(replace(req, src=state["src"], storage_options=state["storage_options"]))
    from .session import reload_units

    for rank in lost:
        ray.get(
            run.actors[rank].load.remote(
                list(fresh.ranks[rank].reads or ()),
                source,
                state["version"],
                _budget(state["plan"], rank),
                False,
                reload_units(state["plan"], fresh, rank),
            )
        )
        info = ray.get(run.actors[rank].info.remote())
        state["pids"][rank] = info["pid"]
        state["addresses"][rank] = info["addresses"]
    state.setdefault("restarted_ranks", [])
    state["restarted_ranks"] = sorted(set(state["restarted_ranks"]) | set(lost))
    ray.get(keeper.update.remote({k: state[k] for k in ("pids", "addresses", "restarted_ranks")}))
    return lost


def _budget(plan: Plan, rank: int) -> int:
    from .driver import staging_budget_of

    return staging_budget_of(plan, plan.ranks[rank])


def _check_engine(session: str, held: Plan, engine: str | None) -> None:
    """``--engine`` on reload/status names what the caller expects; the session's buffers
    are laid out for the engine it was loaded with, and cannot change."""
    if engine is not None and engine != held.engine:
        raise SessionError(
            f"session {session!r} holds buffers laid out for --engine {held.engine}, not "
            f"{engine}; release it and load again to change the engine",
            key="--engine",
        )


def detached_status(
    *,
    session: str = "default",
    address: str | None = None,
    dump: str | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """Per-rank versions, consistency, addresses, memory of a detached session."""
    import ray

    try:
        keeper, state, run = _attach(session, address)
        _check_engine(session, state["plan"], engine)
        repaired = _repair(keeper, state, run)
        reports = ray.get([a.report.remote() for a in run.actors])
        for r in reports:
            r["addresses_changed"] = r["rank"] in state.get("restarted_ranks", [])
        manifest = build_manifest(state["plan"], reports)
        manifest["session"] = session
        manifest["src"] = state["src"]
        manifest["repaired_ranks"] = repaired
        manifest["consistent"] = (
            all(r["consistent"] for r in manifest["ranks"])
            and len({r["version"] for r in manifest["ranks"]}) == 1
        )
        manifest["replicated_tensors_agree"] = _replicas_agree(state["plan"], manifest)
        if dump:
            write_dump(run, manifest, dump)
        return manifest
    finally:
        ray.shutdown()


def _replicas_agree(plan: Plan, manifest: dict[str, Any]) -> bool:
    """Ranks holding the same shard (dp replicas of attention, say) must have equal
    checksums: a cheap proof that all ranks hold the same version."""
    seen: dict[tuple[Any, ...], str] = {}
    for rp, r in zip(plan.ranks, manifest["ranks"], strict=True):
        for u in rp.units:
            key = (
                u.buffer,
                u.global_expert,
                tuple((p.tensor_name, p.rows, p.cols) for p in u.parts),
            )
            if u.expert >= 0:
                continue  # experts are stacked per rank; checksums cover the whole stack
            t = r["tensors"].get(u.buffer)
            if t is None:
                continue
            if key in seen and seen[key] != t["checksum"]:
                return False
            seen.setdefault(key, t["checksum"])
    return True


def detached_reload(
    src: str,
    *,
    session: str = "default",
    address: str | None = None,
    storage_options: Any = None,
    staging_budget: int | None = None,
    on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """In-place reload of a detached session from ``src`` (SPEC §4 "Reload")."""
    import ray

    from .driver import workers_fused
    from .session import plan_reload, reload_budgets, reload_units

    try:
        keeper, state, run = _attach(session, address)
        held: Plan = state["plan"]
        _check_engine(session, held, engine)
        req = replace(
            state["request"],
            src=src,
            storage_options=storage_options,
            staging_budget=staging_budget,
        )
        meta, new_plan = plan_reload(held, req)  # refuses, touching nothing, on mismatch
        budgets = reload_budgets(
            held, new_plan, meta.config, staging_budget, workers_fused(req.device)
        )
        _repair(keeper, state, run)
        source = source_info(meta, req.allow_nonfinite, src, storage_options)
        target = state["version"] + 1
        # An interrupted reload run again: ranks already at the target skip finished units.
        t0 = time.perf_counter()
        reports = run.run_all(
            lambda r: (list(new_plan.ranks[r].reads or ()), reload_units(held, new_plan, r)),
            source,
            version=target,
            whole_units=True,
            on_progress=on_progress,
            budgets=budgets,
        )
        restarted = [r["rank"] for r in reports if r.get("restarts")]
        if restarted:
            _repair(keeper, state, run)
            reports = ray.get([a.report.remote() for a in run.actors])
        moved = []
        changed = set(state.get("restarted_ranks", [])) | set(restarted)
        for r in reports:
            r["addresses_changed"] = r["rank"] in changed
            if r["rank"] in changed:
                continue
            for name, t in r["tensors"].items():
                if state["addresses"][r["rank"]].get(name) != t["data_ptr"]:
                    moved.append(f"rank {r['rank']}: {name}")
        manifest = build_manifest(held, reports)
        manifest["seconds"] = round(time.perf_counter() - t0, 3)
        manifest["session"] = session
        manifest["addresses_moved"] = moved
        if moved:
            raise AddressMoved("buffers moved during reload: " + ", ".join(moved[:20]))
        ray.get(
            keeper.update.remote(
                {"version": target, "src": src, "storage_options": storage_options}
            )
        )
        return manifest
    finally:
        ray.shutdown()


def detached_release(*, session: str = "default", address: str | None = None) -> dict[str, Any]:
    """End a detached session; stop the head mxload started when no session is left."""
    import ray
    from mxload.cluster.local import read_head_record, stop_detached_head

    own_head = address is None
    _connect(address)
    keeper = _keeper(session)
    state = ray.get(keeper.get.remote())
    killed = 0
    for r in range(state["plan"].layout.world):
        try:
            ray.kill(ray.get_actor(_rank_name(session, r), namespace=NAMESPACE))
            killed += 1
        except ValueError:
            pass
    try:
        pg = ray.util.get_placement_group(f"{session}/pg")
        ray.util.remove_placement_group(pg)
    except ValueError:
        pass
    ray.kill(keeper)
    others = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE
        and str(a.get("name", "")).endswith("/keeper")
        and a.get("name") != _keeper_name(session)
    ]
    ray.shutdown()
    stopped = False
    if own_head and state.get("started_head") and not others:
        stopped = stop_detached_head(read_head_record())
    return {"session": session, "workers_ended": killed, "head_stopped": stopped}
