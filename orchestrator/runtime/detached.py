"""Detached sessions: workers that outlive the command that loaded them
(docs/contract.md §4).

``mxload load --detach`` leaves, in the Ray namespace ``mxload``, under the session
name (``--session``, default ``default``):

* ``<session>/rank-NNNNN`` — one named, ``lifetime="detached"`` worker actor per rank,
  holding its buffers;
* ``<session>/pg`` — the placement group pinning them;
* ``<session>/keeper`` — a small detached actor holding the session's
  :class:`~mxload.orchestrator.runtime.state.SessionState` (the plan, the request, the
  current version and source, every buffer's address as first loaded: the addresses a
  captured graph points at) and the lease that serialises reloads.

On the embedded default, ``load --detach`` first starts a local Ray head as its own
background process and records its address under ``$MXLOAD_HOME``
(``mxload.cluster.local.start_detached_head``), so ``status``/``reload``/``release`` in other
processes find it without ``--address``. ``release`` ends the session's actors and, when
no session is left on a head that mxload started, stops that head.

A rank whose worker process died is restarted by Ray (``--max-restarts``) with fresh,
empty buffers at new addresses: ``status`` and ``reload`` notice it (its pid changed),
reload it to the session's version from the current source, and report
``addresses_changed: true`` for it — the graph on that device must be recaptured.

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
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import (
    FencedOff,
    HeadDown,
    HeadStopped,
    MxloadError,
    RunError,
    SessionBusy,
    SessionError,
    WorkerLost,
)
from ..plan.types import Plan
from .driver import first_load, plan_load
from .liveness import RANK_ANSWER_S, silent_error
from .outputs import OutputDir, check_not_input
from .ray_run import RayRun
from .reload import RayRanks, reload, repair
from .reports import build_manifest, first_line, write_dump
from .request import LoadRequest
from .state import Lease, LeaseHolder, Progress, SessionState, verdict

log = logging.getLogger(__name__)

NAMESPACE = "mxload"
VIRTUAL_DEVICES_PER_HEAD = 16
"""Virtual accelerators a background head declares: one Ascend node's worth."""


LEASE_TTL_S = 60.0
"""A reload's lease on its session lasts this long unless renewed (every quarter of it)."""


class SessionKeeper:
    """Actor body holding a detached session's state (pickled by Ray), and the lease that
    serialises reloads. Ray runs one call of this actor at a time, so taking the lease is
    atomic across every process that reaches the session."""

    def __init__(self, state: SessionState, persist: bool = True) -> None:
        from ...cluster.local import tighten_own_temp_dir

        tighten_own_temp_dir()  # this process's start made Ray's folders 0777 again
        self.persist = persist
        self.state = state
        self.lease: Lease | None = None
        self.fence = 0
        """The last fencing token handed out (with a lease)."""
        self.granted: Lease | None = None
        """The last lease handed out, kept after its release."""
        self.recorded: Lease | None = None
        """The lease whose holder's result the state is (its last accepted ``put``): the
        command that won over one fenced off (``took_over``)."""
        self.notes: list[str] = []
        """What status should say happened to the session: commands refused because
        their lease had lapsed, a restart of this keeper."""
        saved = self._restore()
        if saved is not None:
            # Ray restarted this actor (it died: OOM, a kill) with its first arguments;
            # the state and fence it had are in the GCS.
            self.state, self.fence, self.notes = saved
            self._note("the session's keeper died and was restarted; its state restored")
        self._save()

    def _key(self) -> str:
        return f"{self.state.session}/{self.state.created!r}/keeper"

    def _restore(self) -> tuple[SessionState, int, list[str]] | None:
        if not self.persist:
            return None
        import pickle

        from ...cluster import raycompat

        raw = raycompat.kv_get(self._key())
        if raw is None:
            return None
        saved: tuple[SessionState, int, list[str]] = pickle.loads(raw)
        return saved

    def _save(self) -> None:
        """The state and the fence into the GCS, where a restarted keeper finds them."""
        if not self.persist:
            return
        import pickle

        from ...cluster import raycompat

        raycompat.kv_put(self._key(), pickle.dumps((self.state, self.fence, self.notes)))

    def forget(self) -> None:
        """Drop the persisted state (release)."""
        if self.persist:
            from ...cluster import raycompat

            raycompat.kv_del(self._key())

    def _note(self, what: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime())
        self.notes = [*self.notes[-9:], f"at {stamp} {what}"]

    def get(self) -> SessionState:
        return self.state

    def put(self, state: SessionState, token: str = "") -> str:
        """Replace the state, by the holder of the live lease (``token``) only, and never
        with an older version; "" when done, else why it was refused (recorded)."""
        cur, now = self.lease, time.time()
        why = ""
        if cur is None or cur.holder.token != token:
            why = "its lease on the session lapsed and was taken over or released"
        elif cur.expires <= now:
            why = "its lease on the session lapsed"
        elif state.version < self.state.version:
            why = f"version {state.version} is older than the session's {self.state.version}"
        if why:
            self._note(f"a command's result was refused: {why} (nothing it wrote counts)")
            self._save()
            return why
        self.state = state
        self.recorded = cur
        self._save()
        return ""

    def pid(self) -> int:
        return os.getpid()

    def acquire(self, holder: LeaseHolder, ttl_s: float) -> Lease:
        """Take the lease for ``holder``, with the next fencing token; or return the live
        lease of another holder (the caller compares tokens)."""
        now = time.time()
        cur = self.lease
        if cur is not None and cur.expires > now and _holder_alive(cur.holder):
            return cur
        self.fence += 1
        self._save()  # a restarted keeper never hands out a token twice
        self.lease = Lease(
            holder,
            since=now,
            expires=now + ttl_s,
            took_over_from=cur.holder if cur else None,
            fence=self.fence,
        )
        self.granted = self.lease
        return self.lease

    def took_over(self, fence: int) -> Lease | None:
        """The lease that fenced off the holder of token ``fence``: the one whose result
        the session holds when it is later, else the last one handed out when that is
        (None when neither is, or after a restart of this keeper: only its token was
        kept)."""
        for lease in (self.recorded, self.granted):
            if lease is not None and lease.fence > fence:
                return lease
        return None

    def renew(self, token: str, ttl_s: float) -> bool:
        """Extend the live lease of ``token``; an expired one stays lapsed (its holder was
        stopped past it: another command may have run meanwhile)."""
        now = time.time()
        if self.lease is None or self.lease.holder.token != token or self.lease.expires <= now:
            return False
        self.lease = replace(self.lease, expires=now + ttl_s)
        return True

    def events(self) -> list[str]:
        """What status says happened (:attr:`notes`)."""
        return list(self.notes)

    def release(self, token: str) -> None:
        if self.lease is not None and self.lease.holder.token == token:
            self.lease = None

    def holder(self) -> Lease | None:
        """The lease, while its holder lives and it has not expired."""
        cur = self.lease
        if cur is None or cur.expires <= time.time() or not _holder_alive(cur.holder):
            return None
        return cur


def _holder_alive(holder: LeaseHolder) -> bool:
    """A lease holder on this host whose process is gone holds nothing (a reload killed
    with -9); on another host only the lease's expiry can tell."""
    if holder.host != socket.gethostname():
        return True
    try:
        import psutil  # type: ignore[import-untyped]

        from ...cluster.local import same_process

        return same_process(psutil.Process(holder.pid), holder.process())
    except Exception:  # no such process, or not ours to inspect
        return False


def lease_ttl_s() -> float:
    """The lease's time to live: :data:`LEASE_TTL_S`, or ``$MXLOAD_LEASE_TTL_S`` (seconds,
    at least 1), for a cluster whose commands stall longer, or a test that suspends one."""
    raw = os.environ.get("MXLOAD_LEASE_TTL_S")
    if not raw:
        return LEASE_TTL_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1.0 <= value < 86400:
        raise SessionError(
            f"MXLOAD_LEASE_TTL_S={raw!r}: must be seconds in [1, 86400)", key="MXLOAD_LEASE_TTL_S"
        )
    return value


@contextmanager
def session_lease(keeper: Any, session: str, what: str, src: str = "") -> Iterator[Lease]:
    """Hold the session's lease while the block runs, or refuse (SessionBusy) naming the
    command that holds it. Renewed from a thread, so a long reload keeps it."""
    import psutil
    import ray

    from ...cluster.local import process_identity

    me = process_identity(psutil.Process(os.getpid()))
    holder = LeaseHolder(
        token=secrets.token_hex(8),
        pid=int(me["pid"]),
        created=float(me["created"]),
        start_ticks=me["start_ticks"],
        host=socket.gethostname(),
        what=what,
        src=src,
    )
    ttl = lease_ttl_s()
    cur: Lease = ray.get(keeper.acquire.remote(holder, ttl))
    if cur.holder.token != holder.token:
        h = cur.holder
        since = time.strftime("%H:%M:%S", time.localtime(cur.since))
        raise SessionBusy(
            f"session {session!r} is busy: {h.what} from {h.src or '-'} by pid {h.pid} on "
            f"{h.host} since {since}; nothing was started (run it again once that has "
            "finished)",
            key="--session",
        )
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 4):
            try:
                ray.get(keeper.renew.remote(holder.token, ttl), timeout=10)
            except Exception:  # the keeper unreachable: the run itself will fail too
                pass

    thread = threading.Thread(target=renew, name="mxload-lease", daemon=True)
    thread.start()
    try:
        yield cur
    finally:
        stop.set()
        thread.join(timeout=5)
        try:
            ray.get(keeper.release.remote(holder.token), timeout=10)
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
    from ...cluster.local import read_head_record

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
    from ...cluster.local import mxload_home

    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started_at))
    return HeadDown(
        f"the Ray head recorded in {mxload_home() / 'head.json'} ({record.address}, started "
        f"{since}) is down: {'; '.join(down)}. Its sessions' workers and buffers are gone "
        "with it; `mxload release` ends what is left of it and removes its files",
        key="--address",
    )


def _head_stopped_error(record: Any, stopped: list[str]) -> HeadStopped:
    from ...cluster.local import mxload_home

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
    from ...cluster.local import head_down, head_stopped

    down = head_down(record)
    if down:
        raise _head_down_error(record, down)
    stopped = head_stopped(record)
    if stopped:
        raise _head_stopped_error(record, stopped)


@contextmanager
def watching_head(record: Any | None, period_s: float = 1.0) -> Iterator[None]:
    """While the body runs, the recorded head is checked every ``period_s`` from its
    recorded processes (:func:`check_recorded_head`). When it goes down or is stopped,
    the body is interrupted wherever it waits on Ray (which then might wait minutes, or
    for ever) and the head's error is raised instead: it names the head, not a rank.

    The interrupt is a SIGUSR1 to the main thread, handled for the body's duration as a
    KeyboardInterrupt (what Ray's waits give way to): SIGINT may be ignored, as in a
    command started in the background by a script."""
    import signal

    if record is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    found: list[MxloadError] = []
    done = threading.Event()
    sending = threading.Lock()  # no signal once the body is over and the handler gone

    def watch() -> None:
        while not done.wait(period_s):
            try:
                check_recorded_head(record)
            except MxloadError as err:
                with sending:
                    if not done.is_set() and main is not None:
                        found.append(err)
                        signal.pthread_kill(main, signal.SIGUSR1)
                return

    previous = signal.signal(signal.SIGUSR1, signal.default_int_handler)
    threading.Thread(target=watch, name="mxload-head-watch", daemon=True).start()
    try:
        yield
    except (KeyboardInterrupt, MxloadError, RuntimeError):
        # Ray's own error for a lost raylet may surface before the interrupt does.
        err = found[0] if found else _head_error(record)
        if err is not None:
            raise err from None
        raise
    finally:
        with sending:
            done.set()
        signal.signal(signal.SIGUSR1, previous)


def _head_error(record: Any) -> MxloadError | None:
    """The recorded head's error if it is down or stopped now, else None."""
    try:
        check_recorded_head(record)
    except MxloadError as err:
        return err
    return None


def _connect(address: str | None) -> tuple[str, bool]:
    """Join the session's Ray: --address, else the head recorded under $MXLOAD_HOME. A
    recorded head (also when --address names it) is checked first from its recorded
    processes (:func:`check_recorded_head`: at once, when its GCS or raylet died or is
    stopped) and joined with its token."""
    import ray

    from ...cluster.local import connect, mxload_home

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


def _session_file(session: str) -> Path:
    from ...cluster.local import mxload_home

    return mxload_home() / "sessions" / f"{check_session_name(session)}.json"


def _record_session(session: str, address: str, pids: list[int | None]) -> None:
    """$MXLOAD_HOME/sessions/<session>.json: the session's worker and keeper processes on
    this machine (pid and start time), so `release` can end them when Ray cannot."""
    from ...cluster.local import describe_processes

    try:
        import psutil

        procs = []
        for pid in pids:
            if pid is None:
                continue
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
    from ...cluster.local import mxload_home

    out = {}
    for path in sorted((mxload_home() / "sessions").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if same_address(str(data.get("address", "")), address):
            out[str(path)] = data
    return out


def _remains(session: str) -> list[str]:
    """Names of the rank workers of ``session`` still registered in the connected Ray."""
    import ray

    prefix = _rank_name(session, 0)[: -len("00000")]
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
        return ray.get_actor(_keeper_name(session), namespace=NAMESPACE)
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

    from ...cluster.local import start_detached_head

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
        from ...cluster.local import connect

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
    keeper_cls = ray.remote(num_cpus=0)(SessionKeeper)
    # Restarted by Ray when it dies (an OOM victim, a kill): it restores its state from
    # the GCS, and calls made meanwhile wait for it.
    keeper: Any = keeper_cls.options(
        name=_keeper_name(session),
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
    ).remote(state)
    keeper_pid = ray.get(keeper.pid.remote())
    if _recorded_head(req.address) is not None:
        _record_session(session, str(req.address), [*state.pids.values(), keeper_pid])
    if dump:
        write_dump(run, manifest, dump)
    ray.shutdown()
    return manifest


def _attach(session: str, address: str | None) -> tuple[Any, SessionState, RayRun]:
    import ray

    check_session_name(session)
    _connect(address)
    keeper = _keeper(session)
    state: SessionState = ray.get(keeper.get.remote())
    plan = state.plan
    assert state.request is not None, "a detached session records its request"
    run = RayRun(state.request, plan, detached_name=session)
    for r in range(plan.layout.world):
        try:
            run.actors.append(ray.get_actor(_rank_name(session, r), namespace=NAMESPACE))
        except ValueError:  # Ray's text lists guesses; what is known is said here
            raise WorkerLost(
                f"session {session!r}: rank {r}'s worker is gone for good (lost more often "
                f"than --max-restarts allows); `mxload release --session {session}` ends the "
                "rest, then load again",
                rank=r,
            ) from None
    return keeper, state, run


def _saver(keeper: Any, state: SessionState, lease: Lease) -> Callable[[SessionState], None]:
    """Where a detached session's state lives: its keeper, which takes it only from the
    holder of the live ``lease`` (SessionError when that lapsed: a later command may
    have run meanwhile). When its processes changed since ``state`` (a restarted rank),
    the session's file is re-recorded too."""
    import ray

    recorded = dict(state.pids)

    def save(state: SessionState) -> None:
        why = ray.get(keeper.put.remote(state, lease.holder.token), timeout=60)
        if why:
            raise fenced_off(keeper, lease, why)
        if recorded != state.pids:
            _refresh_session_file(keeper, state)
            recorded.clear()
            recorded.update(state.pids)

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
        path = _session_file(state.session)
        address = json.loads(path.read_text())["address"]
    except (OSError, ValueError, KeyError):
        return  # not a session on a head recorded here
    _record_session(state.session, address, [*state.pids.values(), ray.get(keeper.pid.remote())])


def check_ranks_running(state: SessionState) -> None:
    """RunError naming every rank whose worker on this machine is stopped (SIGSTOP, a
    debugger), before a call to it waits minutes. Only processes recorded for the
    session here (pid *and* start time: a pid reused elsewhere is not taken for one)."""
    import psutil

    from ...cluster.local import live_process

    try:
        recorded = json.loads(_session_file(state.session).read_text())["processes"]
    except (OSError, ValueError, KeyError, SessionError):
        return
    rank_of = {pid: r for r, pid in state.pids.items() if pid is not None}
    stopped = []
    for entry in recorded:
        rank = rank_of.get(int(entry.get("pid", -1)))
        proc = live_process(entry) if rank is not None else None
        try:
            if proc is not None and proc.status() in (
                psutil.STATUS_STOPPED,
                psutil.STATUS_TRACING_STOP,
            ):
                stopped.append((rank, proc.pid))
        except psutil.Error:
            pass
    if stopped:
        ranks = ", ".join(f"rank {r} (pid {p})" for r, p in sorted(stopped))
        pids = " ".join(str(p) for _, p in sorted(stopped))
        raise RunError(
            f"session {state.session!r}: {ranks} stopped (SIGSTOP or a debugger), not down; "
            f"a call to it would wait minutes. `kill -CONT {pids}` resumes it",
            rank=stopped[0][0],
        )


def ask_ranks(run: RayRun, method: str, timeout_s: float = 30.0) -> list[Any]:
    """``method()`` of every rank, or RunError naming the ranks that did not answer in
    ``timeout_s`` (a stalled node; a rank Ray is restarting is waited for)."""
    import ray

    refs = [getattr(a, method).remote() for a in run.actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    late = [r for r, ref in enumerate(refs) if ref not in ready]
    if late:
        raise RunError(
            f"session: rank(s) {', '.join(map(str, late))} did not answer in {timeout_s:g} s "
            "(a stopped or stalled worker, or its node); nothing was changed",
            rank=late[0],
        )
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayError as err:
        raise RunError(f"session: a rank failed to answer: {first_line(err)}") from None


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
                    state = ray.get(keeper.get.remote())
                    repaired = repair(run, state, _saver(keeper, state, lease), lease.fence)
            except SessionBusy:
                busy = ray.get(keeper.holder.remote())
        reports = ask_ranks(run, "report")
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
            watching_head(_recorded_head(address)),
            session_lease(keeper, session, "reload", src) as lease,
        ):
            # Read under the lease: a reload that finished meanwhile moved the version.
            state: SessionState = ray.get(keeper.get.remote())
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
    record = _recorded_head(address)
    if record is not None:
        down = head_down(record)
        if down or force:
            return _release_without_ray(session, record, down)
    own_head = record is not None
    _connect(address)
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
        and a.get("name") != _keeper_name(session)
    ]
    hold.close()
    ray.shutdown()
    stopped = False
    # A keeper gone for good took with it whether this session started the head: kept.
    if own_head and state is not None and state.started_head and not others:
        stopped = stop_detached_head(read_head_record())
    try:
        _session_file(session).unlink(missing_ok=True)
    except OSError:
        pass
    return {"session": session, "workers_ended": killed, "head_stopped": stopped}


def _release_without_ray(session: str, record: Any, down: list[str]) -> dict[str, Any]:
    """End a recorded head and every session recorded on it, by pid, and remove their files."""
    from ...cluster.local import end_head

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
