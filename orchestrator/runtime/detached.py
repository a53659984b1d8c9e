"""Detached sessions: workers that outlive the command that loaded them
(docs/contract.md §4).

``mxload load --detach`` leaves, in the Ray namespace ``mxload``, under the session
name (``--session``, default ``default``):

* ``<session>/rank-NNNNN`` — one named, ``lifetime="detached"`` worker actor per rank,
  holding its buffers, started with the key of its rank plan in the GCS;
* ``<session>/pg`` — the placement group pinning them;
* ``<session>/keeper`` — a small detached actor holding the session's
  :class:`~mxload.orchestrator.runtime.state.SessionState` (the plan, the request, the
  current version and source, every buffer's address as first loaded: the addresses a
  captured graph points at) and the lease that serialises reloads, started with the key
  of its record in the GCS (:mod:`.keeper`): so Ray can restart either after this
  command exits, at any model size;
* ``$MXLOAD_HOME/sessions/<session>.options`` — the caller's storage options
  (credentials), which never enter the cluster (docs/contract.md §4 "Reads").

On the embedded default, ``load --detach`` first starts a local Ray head as its own
background process and records its address under ``$MXLOAD_HOME``
(``mxload.cluster.local.start_detached_head``), so ``status``/``reload``/``release`` in other
processes find it without ``--address``. ``release`` ends the session's actors and, when
no session is left on a head that mxload started, stops that head.

A rank whose worker process died is restarted by Ray (``--max-restarts``) with fresh,
empty buffers at new addresses: ``status`` and ``reload`` notice it (its pid changed),
reload it to the session's version from the current source, and report
``addresses_changed: true`` for it — the graph on that device must be recaptured.

The commands on a session are here; what they rely on is split by what it decides:
:mod:`.keeper` (the session's state and lease), :mod:`.heads` (which head, and whether
it is up), :mod:`.records` (names, and what a session leaves on this machine).

A version is an identity (docs/contract.md §4 "Reload"): the keeper records the version number *and*
the fingerprint of the checkpoint it came from (``catalog.fingerprint``), every unit on
every rank records the identity that wrote it, and ``status`` calls the session
consistent only when every unit of every rank holds the recorded identity, replicated
buffers (same name, same slice of the checkpoint on several ranks) have equal checksums,
no buffer moved and no reload is running. Reloads of one session are serialised by a
lease held in the keeper (one holder at a time, renewed while it runs, taken over when
its holder's process is gone or it expired); a second reload is refused naming the first.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

from ..errors import (
    FencedOff,
    SessionBusy,
    SessionError,
    WorkerLost,
)
from ..plan.types import Plan
from .driver import first_load, plan_load
from .heads import check_recorded_head, connect_session, recorded_head, watching_head
from .keeper import SessionKeeper, session_lease, store
from .liveness import RANK_ANSWER_S, ask_ranks, silent_error
from .outputs import OutputDir, check_not_input
from .placement import forget_rank_plans
from .ray_run import RayRun
from .records import (
    NAMESPACE,
    check_ranks_running,
    check_session_name,
    keep_options,
    keeper_name,
    kept_options,
    options_file,
    rank_name,
    record_session,
    recorded_sessions,
    session_file,
)
from .reload import RayRanks, reload, repair
from .reports import build_manifest, write_dump
from .request import LoadRequest
from .state import Lease, Progress, SessionState, caller_options, verdict

log = logging.getLogger(__name__)

VIRTUAL_DEVICES_PER_HEAD = 16
"""Virtual accelerators a background head declares: one Ascend node's worth."""


def _remains(session: str) -> list[str]:
    """Names of the rank workers of ``session`` still registered in the connected Ray."""
    import ray

    prefix = rank_name(session, 0)[: -len("00000")]
    return sorted(
        str(a["name"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE and str(a.get("name", "")).startswith(prefix)
    )


def _remains_error(session: str, remains: list[str]) -> SessionError:
    return SessionError(
        f"session {session!r}: its keeper is gone for good (and the session's state with "
        f"it) while {len(remains)} rank worker(s) remain; `mxload release --session "
        f"{session}` ends them, then load it again",
        key="--session",
    )


def _keeper(session: str) -> Any:
    import ray

    try:
        return ray.get_actor(keeper_name(session), namespace=NAMESPACE)
    except ValueError:
        remains = _remains(session)
        if remains:
            raise _remains_error(session, remains) from None
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
    dump: str | OutputDir | None = None,
    on_progress: Progress | None = None,
) -> dict[str, Any]:
    """Load and leave the workers running under ``session``; returns the manifest."""
    import ray

    from ...cluster.local import check_home_writable, start_detached_head

    check_session_name(session)
    starts_head = req.address is None and not ray.is_initialized()
    if starts_head:
        check_home_writable()  # where the head is recorded: before anything starts
    meta, plan = plan_load(req)  # refuse bad input before starting anything
    started_head = False
    if starts_head:
        # One node's worth of virtual devices (at least the layout's), so a second
        # session (a reference model beside the policy) fits on the same head.
        record = start_detached_head(
            max(plan.layout.world, VIRTUAL_DEVICES_PER_HEAD), resource=req.accelerator
        )
        req = replace(req, address=record.address)
        started_head = True
        from ...cluster.local import connect

        check_recorded_head(record)  # a head already recorded here may be stopped
        connect(record.address, token=record.token)
    else:
        connect_session(req.address)
    try:
        ray.get_actor(keeper_name(session), namespace=NAMESPACE)
        raise SessionError(
            f"session {session!r} already exists; `mxload release --session {session}` first, "
            "or choose another --session",
            key="--session",
        )
    except ValueError:
        remains = _remains(session)
        if remains:
            raise _remains_error(session, remains) from None
    run = RayRun(req, plan, detached_name=session)
    try:
        manifest = first_load(run, meta, on_progress=on_progress)
    except BaseException:
        for a in run.actors:
            ray.kill(a)
        if run.pg is not None:
            ray.util.remove_placement_group(run.pg)
        forget_rank_plans(session)
        raise
    manifest["session"] = session
    manifest["address"] = req.address
    state = SessionState.from_reports(
        plan,
        manifest["ranks"],
        src=req.src,
        fingerprint=meta.fingerprint,
        identity_basis=meta.identity,
        storage_options=req.storage_options,
        request=req,
        session=session,
        started_head=started_head,
    )
    if not keep_options(session, state.created, req.storage_options):
        log.warning(
            "the storage options could not be kept in %s: give --storage-options again "
            "to reload this session",
            options_file(session),
        )
    keeper_cls = ray.remote(num_cpus=0)(SessionKeeper)
    # Restarted by Ray when it dies (an OOM victim, a kill): it reads its record from
    # the GCS (store), and calls made meanwhile wait for it.
    keeper: Any = keeper_cls.options(
        name=keeper_name(session),
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
    ).remote(store(state))
    keeper_pid = ray.get(keeper.pid.remote())
    if recorded_head(req.address) is not None:
        record_session(session, str(req.address), [*state.pids.values(), keeper_pid])
    if dump:
        write_dump(run, manifest, dump)
    ray.shutdown()
    return manifest


def _attach(session: str, address: str | None) -> tuple[Any, SessionState, RayRun]:
    import ray

    check_session_name(session)
    connect_session(address)
    keeper = _keeper(session)
    state = _state_of(keeper)
    plan = state.plan
    assert state.request is not None, "a detached session records its request"
    run = RayRun(state.request, plan, detached_name=session)
    for r in range(plan.layout.world):
        try:
            run.actors.append(ray.get_actor(rank_name(session, r), namespace=NAMESPACE))
        except ValueError:  # Ray's text lists guesses; what is known is said here
            raise WorkerLost(
                f"session {session!r}: rank {r}'s worker is gone for good (lost more often "
                f"than --max-restarts allows); `mxload release --session {session}` ends the "
                "rest, then load again",
                rank=r,
            ) from None
    return keeper, state, run


def _state_of(keeper: Any) -> SessionState:
    """The session's state as its keeper holds it, with the caller's storage options
    kept on this machine (:func:`records.kept_options`) added."""
    import ray

    state: SessionState = ray.get(keeper.get.remote())
    return state.with_credentials(kept_options(state.session, state.created))


def _saver(keeper: Any, state: SessionState, lease: Lease) -> Callable[[SessionState], None]:
    """Where a detached session's state lives: its keeper, which takes it only from the
    holder of the live ``lease`` (SessionError when that lapsed: a later command may
    have run meanwhile). When its processes changed since ``state`` (a restarted rank),
    the session's file is re-recorded too."""
    import ray

    recorded = dict(state.pids)
    kept = caller_options(state.storage_options)

    def save(state: SessionState) -> None:
        why = ray.get(
            keeper.put.remote(state.without_credentials(), lease.holder.token), timeout=60
        )
        if why:
            raise fenced_off(keeper, lease, why)
        if recorded != state.pids:
            _refresh_session_file(keeper, state)
            recorded.clear()
            recorded.update(state.pids)
        if caller_options(state.storage_options) != kept:
            keep_options(state.session, state.created, state.storage_options)

    return save


def fenced_off(keeper: Any, lease: Lease, why: str) -> FencedOff:
    """The error of a command fenced off its session (``why``: the keeper's or a rank's
    reason), naming the command that took the session over and what it holds now."""
    import ray

    session = "?"
    winner = ""
    try:
        later: Lease | None = ray.get(keeper.took_over.remote(lease.fence), timeout=10)
        state: SessionState = ray.get(keeper.get.remote(), timeout=10)
        session = state.session
        if later is not None:
            h = later.holder
            since = time.strftime("%H:%M:%S", time.localtime(later.since))
            winner = (
                f"; {h.what} from {h.src or '-'} by pid {h.pid} on {h.host} took the "
                f"session at {since} (token {later.fence})"
            )
        winner += f"; the session holds version {state.version} from {state.src}"
    except Exception as err:  # the keeper unreachable: the refusal itself still stands
        log.info("who fenced off this command is unknown: %s", err)
    return FencedOff(
        f"session {session!r}: this {lease.holder.what} (token {lease.fence}) was fenced "
        f"off, suspended past its lease: {why}{winner}; nothing it wrote counts "
        "(`mxload status` says what the ranks hold)",
        key="--session",
    )


def _refresh_session_file(keeper: Any, state: SessionState) -> None:
    """Re-record a session's processes after some of its workers were restarted."""
    import ray

    try:
        path = session_file(state.session)
        address = json.loads(path.read_text())["address"]
    except (OSError, ValueError, KeyError):
        return  # not a session on a head recorded here
    record_session(state.session, address, [*state.pids.values(), ray.get(keeper.pid.remote())])


def _check_engine(session: str, held: Plan, engine: str | None) -> None:
    """``--engine`` on reload/status names what the caller expects; the session's buffers
    are laid out for the engine it was loaded with, and cannot change."""
    from ..plan.engines import engine_profile

    if engine is not None and engine_profile(engine).name != held.engine:
        raise SessionError(
            f"session {session!r} holds buffers laid out for --engine {held.engine}, not "
            f"{engine}; release it and load again to change the engine",
            key="--engine",
        )


def _check_outputs(state: SessionState, outputs: Sequence[tuple[str, str]]) -> None:
    """No output of a command on a session may overwrite the session's checkpoint (nor
    the one its last reload read: a failed reload leaves ranks on it)."""
    inputs = [("the session's checkpoint", state.src)]
    if state.last_reload is not None and state.last_reload.src != state.src:
        inputs.append(("the last reload's checkpoint", state.last_reload.src))
    for path, flag in outputs:
        check_not_input(path, flag, inputs)


def detached_status(
    *,
    session: str = "default",
    address: str | None = None,
    dump: str | OutputDir | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """Per-rank versions, consistency, addresses, memory of a detached session. Ranks
    whose worker was restarted are first reloaded to the session's version, under the
    session's lease (not while a reload holds it)."""
    import ray

    try:
        keeper, state, run = _attach(session, address)
        check_ranks_running(state)
        _check_engine(session, state.plan, engine)
        if dump:
            target = dump.target if isinstance(dump, OutputDir) else dump
            _check_outputs(state, [(target, "--dump")])
        busy = ray.get(keeper.holder.remote())
        repaired: list[int] = []
        if busy is None:
            try:
                with session_lease(keeper, session, "status repairing restarted ranks") as lease:
                    state = _state_of(keeper)
                    repaired = repair(run, state, _saver(keeper, state, lease), lease.fence)
            except SessionBusy:
                busy = ray.get(keeper.holder.remote())
        reports = ask_ranks(run.actors, "report", run.answer_timeout_s)
        state.observe(reports)
        manifest = build_manifest(state.plan, reports)
        manifest["session"] = session
        manifest["src"] = state.src
        manifest["repaired_ranks"] = repaired
        manifest["reload_in_progress"] = busy.to_json() if busy is not None else None
        last = state.last_reload
        manifest["last_reload"] = last.to_json() if last is not None else None
        verdict(state, manifest, busy=busy)
        events = ray.get(keeper.events.remote())
        manifest["session_events"] = events
        manifest["notices"] += events[-3:]
        if dump:
            write_dump(run, manifest, dump)
        return manifest
    finally:
        ray.shutdown()


def detached_reload(
    src: str,
    *,
    session: str = "default",
    address: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    staging_budget: int | None = None,
    on_progress: Progress | None = None,
    engine: str | None = None,
    outputs: Sequence[tuple[str, str]] = (),
    answer_timeout_s: float = RANK_ANSWER_S,
) -> dict[str, Any]:
    """In-place reload of a detached session from ``src`` (docs/contract.md §4 "Reload"),
    holding the session's lease (SessionBusy when another command holds it).
    ``outputs``: (path, flag) of what the caller will write, refused before any work
    when it would overwrite the session's checkpoint. ``answer_timeout_s``: how long a
    rank may not answer before the reload names it and ends (``liveness``)."""
    import ray

    from ...workers.storage.urls import absolute

    src = absolute(src)
    try:
        keeper, first, run = _attach(session, address)
        run.answer_timeout_s = answer_timeout_s
        check_ranks_running(first)
        with (
            watching_head(recorded_head(address)),
            session_lease(keeper, session, "reload", src) as lease,
        ):
            # Read under the lease: a reload that finished meanwhile moved the version.
            state = _state_of(keeper)
            _check_engine(session, state.plan, engine)
            _check_outputs(state, outputs)
            fence_ranks(run, lease.fence, [state.pids.get(r) for r in range(len(run.actors))])
            try:
                done = reload(
                    RayRanks(run),
                    state,
                    _saver(keeper, state, lease),
                    src,
                    fence=lease.fence,
                    storage_options=storage_options,
                    staging_budget=staging_budget,
                    allow_nonfinite=run.req.allow_nonfinite,
                    on_progress=on_progress,
                )
            except FencedOff as err:
                rank = err.context.get("rank")
                if rank is None:
                    raise  # the keeper's refusal (``_saver``), already naming the winner
                why = f"rank {rank} refused to write for it (a later token reached it)"
                raise fenced_off(keeper, lease, why) from None
        manifest = build_manifest(state.plan, done.reports)
        manifest["seconds"] = done.seconds
        manifest["session"] = session
        manifest["addresses_moved"] = []
        return manifest
    finally:
        ray.shutdown()


def fence_ranks(
    run: RayRun, token: int, pids: Sequence[int | None] = (), wait_s: float = 30.0
) -> None:
    """Every rank takes ``token`` before this command writes: a run of an older lease
    still going (its command was suspended past it) stops at its next unit. SessionError
    naming the ranks that are still busy after ``wait_s``; RankSilent naming those that
    do not answer (``pids``: each rank's worker, for the message)."""
    import ray

    refs = [a.fence.remote(token, wait_s) for a in run.actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s + run.answer_timeout_s)
    late = [r for r, ref in enumerate(refs) if ref not in ready]
    if late:
        raise silent_error(late, pids, wait_s + run.answer_timeout_s)
    free = ray.get(refs)
    busy = [r for r, ok in enumerate(free) if not ok]
    if busy:
        raise SessionBusy(
            f"ranks {','.join(map(str, busy))} are still writing for an earlier command "
            f"after {wait_s:g} s; nothing was started (run it again)",
            key="--session",
        )


def detached_release(
    *, session: str = "default", address: str | None = None, force: bool = False
) -> dict[str, Any]:
    """End a detached session; stop the head mxload started when no session is left.

    When the recorded head is down (its GCS or raylet died: nothing can be asked of Ray)
    or with ``force``, ends every process recorded for that head and its sessions
    (pid and start time checked) and removes their files: head.json, the sessions'
    records, the head's temp dir. ``force`` ends the whole head mxload started, every
    session on it, without asking Ray (for a head that is up but does not answer)."""
    import ray

    from ...cluster.local import head_down, read_head_record, stop_detached_head

    check_session_name(session)
    record = recorded_head(address)
    if record is not None:
        down = head_down(record)
        if down or force:
            return _release_without_ray(session, record, down)
    own_head = record is not None
    connect_session(address)
    try:
        keeper = _keeper(session)
    except SessionError:
        if not _remains(session):
            raise
        keeper = None  # gone for good: end what it left, by name
    state: SessionState | None = None
    hold = ExitStack()
    if keeper is not None:
        try:
            # Not under a running reload (its ranks would vanish and be blamed): refused,
            # naming it; and no reload starts while the session is ended (§5 "release").
            hold.enter_context(session_lease(keeper, session, "release"))
        except SessionBusy:
            ray.shutdown()
            raise
        state = ray.get(keeper.get.remote())
        ray.get(keeper.forget.remote())
    killed = 0
    for name in _remains(session):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            killed += 1
        except ValueError:
            pass
    forget_rank_plans(session)
    try:
        pg = ray.util.get_placement_group(f"{session}/pg")
        ray.util.remove_placement_group(pg)
    except ValueError:
        pass
    if keeper is not None:
        ray.kill(keeper)
    others = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE
        and str(a.get("name", "")).endswith("/keeper")
        and a.get("name") != keeper_name(session)
    ]
    hold.close()
    ray.shutdown()
    stopped = False
    # A keeper gone for good took with it whether this session started the head: kept.
    if own_head and state is not None and state.started_head and not others:
        stopped = stop_detached_head(read_head_record())
    for path in (session_file(session), options_file(session)):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    return {"session": session, "workers_ended": killed, "head_stopped": stopped}


def _release_without_ray(session: str, record: Any, down: list[str]) -> dict[str, Any]:
    """End a recorded head and every session recorded on it, by pid, and remove their files."""
    from ...cluster.local import end_head

    sessions = recorded_sessions(record.address)
    extra = [
        p
        for data in sessions.values()
        if isinstance(data.get("processes"), list)
        for p in data["processes"]
        if isinstance(p, dict)
    ]
    ended = end_head(record, extra, grace_s=2.0 if down else 10.0)
    for path, data in sessions.items():
        try:
            os.unlink(path)
            options_file(str(data.get("session"))).unlink(missing_ok=True)
        except (OSError, SessionError):  # SessionError: not a session's name
            pass
    return {
        "session": session,
        "head_down": down,
        "forced": not down,
        "processes_ended": ended,
        "sessions_removed": sorted(str(d.get("session")) for d in sessions.values()),
        "head_stopped": True,
        "workers_ended": sum(1 for e in ended if e.startswith("ray::")),
    }
