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

A version is an identity (SPEC §4 "Reload"): the keeper records the version number *and*
the fingerprint of the checkpoint it came from (``catalog.fingerprint``), every unit on
every rank records the identity that wrote it, and ``status`` calls the session
consistent only when every unit of every rank holds the recorded identity, replicated
buffers (same name, same slice of the checkpoint on several ranks) have equal checksums,
no buffer moved and no reload is running. Reloads of one session are serialised by a
lease held in the keeper (one holder at a time, renewed while it runs, taken over when
its holder's process is gone or it expired); a second reload is refused naming the first.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from mxload.orchestrator.errors import (
    AddressMoved,
    HeadDown,
    HeadStopped,
    SessionBusy,
    SessionError,
    WorkerLost,
)
from mxload.orchestrator.plan.types import Plan
from mxload.orchestrator.runtime.driver import (
    LoadRequest,
    RayRun,
    build_manifest,
    first_load,
    plan_load,
    source_info,
    write_dump,
)
from mxload.orchestrator.runtime.outputs import OutputDir

NAMESPACE = "mxload"
VIRTUAL_DEVICES_PER_HEAD = 16
"""Virtual accelerators a background head declares: one Ascend node's worth."""


LEASE_TTL_S = 60.0
"""A reload's lease on its session lasts this long unless renewed (every quarter of it)."""


class SessionKeeper:
    """Actor body holding a detached session's state (plain data, pickled by Ray), and the
    lease that serialises reloads. Ray runs one call of this actor at a time, so taking the
    lease is atomic across every process that reaches the session."""

    def __init__(self, state: dict[str, Any]) -> None:
        from mxload.cluster.local import tighten_own_temp_dir

        tighten_own_temp_dir()  # this process's start made Ray's folders 0777 again
        self.state = state
        self.lease: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        return self.state

    def pid(self) -> int:
        return os.getpid()

    def update(self, changes: dict[str, Any]) -> None:
        self.state.update(changes)

    def acquire(self, holder: dict[str, Any], ttl_s: float) -> dict[str, Any] | None:
        """Take the lease for ``holder`` (None), or return the live holder that has it."""
        now = time.time()
        cur = self.lease
        if cur is not None and cur["expires"] > now and _holder_alive(cur):
            return dict(cur)
        self.lease = dict(holder, since=now, expires=now + ttl_s)
        if cur is not None:
            self.lease["took_over_from"] = {k: cur[k] for k in ("pid", "host", "src", "what")}
        return None

    def renew(self, token: str, ttl_s: float) -> bool:
        if self.lease is None or self.lease["token"] != token:
            return False
        self.lease["expires"] = time.time() + ttl_s
        return True

    def release(self, token: str) -> None:
        if self.lease is not None and self.lease["token"] == token:
            self.lease = None

    def holder(self) -> dict[str, Any] | None:
        cur = self.lease
        if cur is None or cur["expires"] <= time.time() or not _holder_alive(cur):
            return None
        return dict(cur)


def _holder_alive(holder: dict[str, Any]) -> bool:
    """A lease holder on this host whose process is gone holds nothing (a reload killed
    with -9); on another host only the lease's expiry can tell."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        import psutil
        from mxload.cluster.local import same_process

        return same_process(psutil.Process(holder["pid"]), holder)
    except Exception:
        return False


@contextmanager
def session_lease(keeper: Any, session: str, what: str, src: str = "") -> Iterator[dict[str, Any]]:
    """Hold the session's lease while the block runs, or refuse (SessionBusy) naming the
    command that holds it. Renewed from a thread, so a long reload keeps it."""
    import psutil
    import ray
    from mxload.cluster.local import process_identity

    holder = {
        "token": secrets.token_hex(8),
        **process_identity(psutil.Process(os.getpid())),
        "host": socket.gethostname(),
        "what": what,
        "src": src,
    }
    cur = ray.get(keeper.acquire.remote(holder, LEASE_TTL_S))
    if cur is not None:
        since = time.strftime("%H:%M:%S", time.localtime(cur["since"]))
        raise SessionBusy(
            f"session {session!r} is busy: {cur['what']} from {cur['src'] or '-'} by pid "
            f"{cur['pid']} on {cur['host']} since {since}; nothing was started (run it again "
            "once that has finished)",
            key="--session",
        )
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_TTL_S / 4):
            try:
                ray.get(keeper.renew.remote(holder["token"], LEASE_TTL_S), timeout=10)
            except Exception:  # the keeper unreachable: the run itself will fail too
                pass

    thread = threading.Thread(target=renew, name="mxload-lease", daemon=True)
    thread.start()
    try:
        yield holder
    finally:
        stop.set()
        thread.join(timeout=5)
        try:
            ray.get(keeper.release.remote(holder["token"]), timeout=10)
        except Exception:  # expires on its own
            pass


def _keeper_name(session: str) -> str:
    return f"{session}/keeper"


def _rank_name(session: str, rank: int) -> str:
    return f"{session}/rank-{rank:05d}"


SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a session name may be: it names Ray actors (``<session>/keeper``) and a file
under $MXLOAD_HOME/sessions, so no separators, spaces, control characters or dot-names."""


def check_session_name(name: str) -> str:
    """``name`` if it is a usable session name; SessionError (exit 2) naming --session if not."""
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise SessionError(
            f"--session {name!r}: not a usable session name (1 to 64 letters, digits, '.', "
            "'_' or '-', starting with a letter or digit)",
            key="--session",
        )
    return name


def _recorded_head(address: str | None) -> Any:
    """The head recorded under $MXLOAD_HOME if ``address`` is None or names it."""
    from mxload.cluster.local import read_head_record

    record = read_head_record()
    if record is None or address is None or same_address(address, record.address):
        return record
    return None


def same_address(a: str, b: str) -> bool:
    """Whether two HOST:PORT strings name one head (localhost is 127.0.0.1)."""

    def norm(x: str) -> tuple[str, str]:
        host, _, port = x.strip().removeprefix("ray://").rpartition(":")
        host = host.strip("[]").lower()
        return ("127.0.0.1" if host in ("localhost", "0.0.0.0", "") else host), port

    return norm(a) == norm(b)


def _head_down_error(record: Any, down: list[str]) -> HeadDown:
    from mxload.cluster.local import mxload_home

    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started_at))
    return HeadDown(
        f"the Ray head recorded in {mxload_home() / 'head.json'} ({record.address}, started "
        f"{since}) is down: {'; '.join(down)}. Its sessions' workers and buffers are gone "
        "with it; `mxload release` ends what is left of it and removes its files",
        key="--address",
    )


def _head_stopped_error(record: Any, stopped: list[str]) -> HeadStopped:
    from mxload.cluster.local import mxload_home

    pids = " ".join(s.rsplit("pid ", 1)[-1].rstrip(")") for s in stopped)
    return HeadStopped(
        f"the Ray head recorded in {mxload_home() / 'head.json'} ({record.address}) is "
        f"stopped, not down: {'; '.join(stopped)} (SIGSTOP or a debugger); Ray would wait "
        f"minutes for it. `kill -CONT {pids}` resumes it with its sessions; "
        "`mxload release --force` ends it",
        key="--address",
    )


def check_recorded_head(record: Any) -> None:
    """Before any Ray call to a recorded head, from its recorded processes alone: HeadDown
    when its GCS or raylet died (or nothing listens), HeadStopped when one is stopped."""
    from mxload.cluster.local import head_down, head_stopped

    down = head_down(record)
    if down:
        raise _head_down_error(record, down)
    stopped = head_stopped(record)
    if stopped:
        raise _head_stopped_error(record, stopped)


def _connect(address: str | None) -> tuple[str, bool]:
    """Join the session's Ray: --address, else the head recorded under $MXLOAD_HOME. A
    recorded head (also when --address names it) is checked first from its recorded
    processes (:func:`check_recorded_head`: at once, when its GCS or raylet died or is
    stopped) and joined with its token."""
    import ray
    from mxload.cluster.local import connect, mxload_home

    if ray.is_initialized():
        return "", False
    record = _recorded_head(address)
    if record is None and address is None:
        # The actual folder, not the variable's name: the user may not know it is set.
        raise SessionError(
            f"no detached session here: no running Ray head is recorded in "
            f"{mxload_home()} ($MXLOAD_HOME); start one with `mxload load SRC --detach`, "
            "or join a cluster with --address HOST:PORT",
            key="--address",
        )
    if record is None:
        assert address is not None
        connect(address)
        return address, False
    check_recorded_head(record)
    connect(address or record.address, token=record.token)
    return record.address, True


# --- what a session leaves on this machine (for release when its head is gone) -------------


def _session_file(session: str) -> Any:
    from mxload.cluster.local import mxload_home

    return mxload_home() / "sessions" / f"{check_session_name(session)}.json"


def _record_session(session: str, address: str, pids: list[int]) -> None:
    """$MXLOAD_HOME/sessions/<session>.json: the session's worker and keeper processes on
    this machine (pid and start time), so `release` can end them when Ray cannot."""
    import json

    from mxload.cluster.local import describe_processes

    try:
        import psutil

        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        path = _session_file(session)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = {"session": session, "address": address, "processes": describe_processes(procs)}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:  # a read-only home: release still works through Ray
        pass


def _recorded_sessions(address: str) -> dict[str, dict[str, Any]]:
    """Every session file recorded for the head at ``address``: path -> contents."""
    import json

    from mxload.cluster.local import mxload_home

    out = {}
    for path in sorted((mxload_home() / "sessions").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if same_address(str(data.get("address", "")), address):
            out[str(path)] = data
    return out


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
    dump: str | OutputDir | None = None,
    on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
) -> dict[str, Any]:
    """Load and leave the workers running under ``session``; returns the manifest."""
    import ray
    from mxload.cluster.local import start_detached_head

    check_session_name(session)
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

        check_recorded_head(record)  # a head already recorded here may be stopped
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
        "fingerprint": meta.fingerprint,
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
    keeper_pid = ray.get(keeper.pid.remote())
    if _recorded_head(req.address) is not None:
        _record_session(session, str(req.address), [*state["pids"].values(), keeper_pid])
    if dump:
        write_dump(run, manifest, dump)
    ray.shutdown()
    return manifest


def _attach(session: str, address: str | None) -> tuple[Any, dict[str, Any], RayRun]:
    import ray

    check_session_name(session)
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
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    req: LoadRequest = state["request"]
    meta = open_checkpoint(state["src"], storage_options=state["storage_options"])
    source = source_info(meta, req.allow_nonfinite, state["src"], state["storage_options"])
    _, fresh = plan_load(replace(req, src=state["src"], storage_options=state["storage_options"]))
    from mxload.orchestrator.runtime.session import reload_units

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
    _refresh_session_file(keeper, state)
    return lost


def _refresh_session_file(keeper: Any, state: dict[str, Any]) -> None:
    """Re-record a session's processes after some of its workers were restarted."""
    import json

    import ray

    try:
        path = _session_file(state["session"])
        address = json.loads(path.read_text())["address"]
    except (OSError, ValueError, KeyError):
        return  # not a session on a head recorded here
    _record_session(
        state["session"], address, [*state["pids"].values(), ray.get(keeper.pid.remote())]
    )


def _budget(plan: Plan, rank: int) -> int:
    from mxload.orchestrator.runtime.driver import staging_budget_of

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
    dump: str | OutputDir | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """Per-rank versions, consistency, addresses, memory of a detached session."""
    import ray

    try:
        keeper, state, run = _attach(session, address)
        _check_engine(session, state["plan"], engine)
        busy = ray.get(keeper.holder.remote())
        repaired: list[int] = []
        if busy is None:
            try:
                with session_lease(keeper, session, "status repairing restarted ranks"):
                    repaired = _repair(keeper, state, run)
            except SessionBusy:
                busy = ray.get(keeper.holder.remote())
        reports = ray.get([a.report.remote() for a in run.actors])
        for r in reports:
            r["addresses_changed"] = r["rank"] in state.get("restarted_ranks", [])
        manifest = build_manifest(state["plan"], reports)
        manifest["session"] = session
        manifest["src"] = state["src"]
        manifest["repaired_ranks"] = repaired
        manifest["reload_in_progress"] = busy
        manifest["last_reload"] = state.get("last_reload")
        verdict(state, manifest, busy=busy)
        if dump:
            write_dump(run, manifest, dump)
        return manifest
    finally:
        ray.shutdown()


def verdict(state: dict[str, Any], manifest: dict[str, Any], *, busy: Any = None) -> None:
    """Decide, from what the ranks report, whether the session holds one checkpoint, and
    say why not (SPEC §4). Sets ``consistent``, ``problems`` (each a reason it is not),
    ``notices`` (true but not inconsistent: restarted ranks, a failed reload that wrote
    nothing), ``identity``, ``replicated_tensors_agree`` and ``replica_mismatches``."""
    plan: Plan = state["plan"]
    want = (state["version"], state.get("fingerprint", ""))
    problems: list[str] = []
    notices: list[str] = []
    held: dict[tuple[int, str], list[int]] = {}
    for r in manifest["ranks"]:
        ident = r.get("identity")
        if ident is None:
            by = (r.get("units") or {}).get("units_by_identity", {})
            mix = ", ".join(f"{n} at version {_short(k)}" for k, n in by.items())
            problems.append(f"rank {r['rank']}: its units hold different versions ({mix})")
            continue
        held.setdefault((int(ident[0]), str(ident[1])), []).append(r["rank"])
    if len(held) > 1:
        parts = [
            f"ranks {_ranks(rs)} at version {v} of checkpoint {fp[:12]}"
            for (v, fp), rs in sorted(held.items())
        ]
        problems.append("ranks hold different checkpoints: " + "; ".join(parts))
    for (v, fp), rs in sorted(held.items()):
        if (v, fp) != want:
            problems.append(
                f"ranks {_ranks(rs)} hold version {v} of checkpoint {fp[:12]}, not the "
                f"session's version {want[0]} of {state['src']} ({want[1][:12]})"
            )
    mismatches = replica_mismatches(plan, manifest)
    manifest["replicated_tensors_agree"] = not mismatches
    manifest["replica_mismatches"] = mismatches[:50]
    if mismatches:
        problems.append(
            f"{len(mismatches)} replicated buffer(s) differ between ranks that must hold the "
            f"same bytes, e.g. {mismatches[0]}"
        )
    moved = []
    for r in manifest["ranks"]:
        first = state["addresses"].get(r["rank"], {})
        if r.get("addresses_changed"):
            notices.append(
                f"rank {r['rank']} was lost and restarted (pid now {r.get('pid')}): its "
                "buffers are at new addresses; graphs captured on that device must be recaptured"
            )
            continue
        moved += [
            f"rank {r['rank']}: {n}"
            for n, t in r["tensors"].items()
            if first.get(n) not in (None, t["data_ptr"])
        ]
    manifest["addresses_moved"] = moved
    if moved:
        problems.append(f"{len(moved)} buffer(s) moved: {', '.join(moved[:5])}")
    if manifest.get("repaired_ranks"):
        notices.append(
            f"ranks {_ranks(manifest['repaired_ranks'])} were reloaded by this status call "
            f"after a restart, from {state['src']}"
        )
    if busy:
        problems.append(
            f"a reload is running: {busy['what']} from {busy['src'] or '-'} by pid "
            f"{busy['pid']} on {busy['host']}"
        )
    last = state.get("last_reload")
    if last and not last.get("ok"):
        notices.append(f"the last reload, from {last['src']}, failed: {last['error']}")
    manifest["identity"] = {"version": want[0], "fingerprint": want[1], "src": state["src"]}
    manifest["consistent"] = not problems
    manifest["problems"] = problems
    manifest["notices"] = notices


def _short(key: str) -> str:
    v, _, fp = key.partition(":")
    return f"{v} of {fp[:12] or 'nothing'}" if v != "0" else "none (never written whole)"


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


def replica_mismatches(plan: Plan, manifest: dict[str, Any]) -> list[str]:
    """Buffers that ranks should hold byte for byte alike (the same buffer filled from the
    same slices of the checkpoint: dp replicas of attention, the norms, experts replicated
    without EP) but whose checksums differ: a check on the bytes themselves, independent
    of the version bookkeeping."""
    groups: dict[tuple[Any, ...], list[tuple[int, str]]] = {}
    for rp, r in zip(plan.ranks, manifest["ranks"], strict=True):
        units: dict[str, list[tuple[Any, ...]]] = {}
        for u in rp.units:
            units.setdefault(u.buffer, []).append(
                (
                    u.global_expert,
                    u.row0,
                    u.rows,
                    u.cols,
                    tuple((p.tensor_name, p.rows, p.cols, p.dst_row) for p in u.parts),
                )
            )
        for name, keys in units.items():
            for buf in (name, name + "_scale"):
                t = r["tensors"].get(buf)
                if t is not None:
                    groups.setdefault((buf, tuple(keys)), []).append((r["rank"], t["checksum"]))
    out = []
    for (buf, _), held in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len({c for _, c in held}) > 1:
            out.append(
                f"{buf} on ranks {_ranks([r for r, _ in held])}: "
                + ", ".join(f"rank {r} {c[:8]}" for r, c in held)
            )
    return out


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
    """In-place reload of a detached session from ``src`` (SPEC §4 "Reload"), holding the
    session's lease (SessionBusy when another command holds it)."""
    import ray

    try:
        keeper, _, run = _attach(session, address)
        with session_lease(keeper, session, "reload", src):
            # Read under the lease: a reload that finished meanwhile moved the version.
            state = ray.get(keeper.get.remote())
            _check_engine(session, state["plan"], engine)
            return _reload_locked(
                keeper, state, run, src, session, storage_options, staging_budget, on_progress
            )
    finally:
        ray.shutdown()


def _reload_locked(
    keeper: Any,
    state: dict[str, Any],
    run: RayRun,
    src: str,
    session: str,
    storage_options: Any,
    staging_budget: int | None,
    on_progress: Callable[[list[tuple[int, int, int]]], None] | None,
) -> dict[str, Any]:
    import ray
    from mxload.orchestrator.runtime.driver import workers_fused
    from mxload.orchestrator.runtime.session import plan_reload, reload_budgets, reload_units

    held: Plan = state["plan"]
    req = replace(
        state["request"],
        src=src,
        storage_options=storage_options,
        staging_budget=staging_budget,
    )
    meta, new_plan = plan_reload(held, req)  # refuses, touching nothing, on mismatch
    budgets = reload_budgets(held, new_plan, meta.config, staging_budget, workers_fused(req.device))
    _repair(keeper, state, run)
    source = source_info(meta, req.allow_nonfinite, src, storage_options)
    target = state["version"] + 1
    outcome: dict[str, Any] = {
        "src": src,
        "version": target,
        "fingerprint": meta.fingerprint,
        "at": time.time(),
        "ok": False,
        "error": "interrupted",
    }
    try:
        # Units already at (target, this fingerprint) are skipped: an interrupted reload
        # from this same checkpoint run again. Any other unit is rewritten.
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
            # run_all already redid them from this checkpoint; only their new processes'
            # pids and addresses are recorded (a repair here would load the old version).
            for rank in restarted:
                info = ray.get(run.actors[rank].info.remote())
                state["pids"][rank] = info["pid"]
                state["addresses"][rank] = info["addresses"]
            state["restarted_ranks"] = sorted(
                set(state.get("restarted_ranks", [])) | set(restarted)
            )
            ray.get(
                keeper.update.remote(
                    {k: state[k] for k in ("pids", "addresses", "restarted_ranks")}
                )
            )
            _refresh_session_file(keeper, state)
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
    except BaseException as err:
        # Recorded for status ("the last reload failed: ..."); the ranks' unit identities
        # say what each device holds now.
        outcome["error"] = f"{type(err).__name__}: {err}"[:400]
        try:
            ray.get(keeper.update.remote({"last_reload": outcome}), timeout=30)
        except Exception:
            pass
        raise
    outcome.update(ok=True, error="")
    ray.get(
        keeper.update.remote(
            {
                "version": target,
                "fingerprint": meta.fingerprint,
                "src": src,
                "storage_options": storage_options,
                "last_reload": outcome,
            }
        )
    )
    return manifest


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
    from mxload.cluster.local import head_down, read_head_record, stop_detached_head

    check_session_name(session)
    record = _recorded_head(address)
    if record is not None:
        down = head_down(record)
        if down or force:
            return _release_without_ray(session, record, down)
    own_head = record is not None
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
    try:
        _session_file(session).unlink(missing_ok=True)
    except OSError:
        pass
    return {"session": session, "workers_ended": killed, "head_stopped": stopped}


def _release_without_ray(session: str, record: Any, down: list[str]) -> dict[str, Any]:
    """End a recorded head and every session recorded on it, by pid, and remove their files."""
    from mxload.cluster.local import end_head

    sessions = _recorded_sessions(record.address)
    extra = [p for data in sessions.values() for p in data.get("processes", [])]
    ended = end_head(record, extra, grace_s=2.0 if down else 10.0)
    for path in sessions:
        try:
            os.unlink(path)
        except OSError:
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
