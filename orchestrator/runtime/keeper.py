"""A detached session's keeper and its lease (docs/contract.md §4 "Reload").

The keeper is a small detached actor holding the session's
:class:`~mxload.orchestrator.runtime.state.SessionState` and the lease that serialises the
commands that change it: one holder at a time, renewed while it runs, taken over when
its holder's process is gone or it expired, each lease with a larger fencing token.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ..errors import SessionBusy, SessionError
from .state import Lease, LeaseHolder, SessionState

LEASE_TTL_S = 60.0
"""A reload's lease on its session lasts this long unless renewed (every quarter of it)."""


class SessionKeeper:
    """Actor body holding a detached session's state and the lease that serialises
    reloads. Ray runs one call of this actor at a time, so taking the lease is atomic
    across every process that reaches the session.

    Its one constructor argument is the key of its record in the GCS (:func:`store`):
    an argument larger than Ray passes inline is owned by the process that created the
    actor, and gone with it, so a keeper given the state itself could not be restarted
    once the ``load`` that made it exited. The record is rewritten on every change (the
    state when it is put, the small rest, fencing counter, leases and notes, on each
    lease call), so a keeper that Ray restarts (it died: OOM, a kill) has all of it, the
    running reload's lease and the one whose result the state is included. It never holds the caller's storage options
    (credentials: docs/contract.md §4 "Reads")."""

    def __init__(self, key: str, state: SessionState | None = None) -> None:
        """``state``: held in this process only, nothing stored (an in-process keeper)."""
        from ...cluster.local import tighten_own_temp_dir

        tighten_own_temp_dir()  # this process's start made Ray's folders 0777 again
        self.key = key
        self.persist = state is None
        self.lease: Lease | None = None
        self.fence = 0
        """The last fencing token handed out (with a lease)."""
        self.granted: Lease | None = None
        """The last lease handed out, kept after its release."""
        self.recorded: Lease | None = None
        """The lease whose holder's result the state is (its last accepted ``put``): the
        command that won over one fenced off (:meth:`took_over`)."""
        self.notes: list[str] = []
        """What status should say happened to the session: commands refused because
        their lease had lapsed, a restart of this keeper."""
        self.starts = 0
        """How often a keeper of this session started (more than once: restarted)."""
        if state is not None:
            self.state = state.without_credentials()
            return
        record = _read(key)
        if record is None:
            raise SessionError(f"the session's record {key!r} is not in the Ray cluster")
        self.state, meta = record
        self.fence, self.notes, self.lease, self.starts, self.granted, self.recorded = meta
        self.starts += 1
        if self.starts > 1:
            self._note("the session's keeper died and was restarted; its state restored")
        self._save()

    def _save(self, *, state: bool = False) -> None:
        """The record into the GCS, where a restarted keeper finds it: the fencing
        counter, lease and notes, and with ``state`` the state too."""
        if self.persist:
            if state:
                _write_state(self.key, self.state)
            meta = (self.fence, self.notes, self.lease, self.starts, self.granted, self.recorded)
            _write(self.key, meta)

    def forget(self) -> None:
        """Drop the stored record (release); nothing is stored again after it (the
        release's own lease, given back after this, would write the record back)."""
        if self.persist:
            from ...cluster import raycompat

            self.persist = False
            for suffix in ("", STATE_SUFFIX, PLAN_SUFFIX):
                raycompat.kv_del(self.key + suffix)

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
        self.state = state.without_credentials()
        self.recorded = cur
        self._save(state=True)
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
        self.lease = Lease(
            holder,
            since=now,
            expires=now + ttl_s,
            took_over_from=cur.holder if cur else None,
            fence=self.fence,
        )
        self.granted = self.lease
        self._save()  # a restarted keeper never hands out a token twice, nor drops a lease
        return self.lease

    def took_over(self, fence: int) -> Lease | None:
        """The lease that fenced off the holder of token ``fence``: the one whose result
        the session holds when it is later, else the last one handed out when that is
        (None when neither is)."""
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
        self._save()
        return True

    def events(self) -> list[str]:
        """What status says happened (:attr:`notes`)."""
        return list(self.notes)

    def release(self, token: str) -> None:
        if self.lease is not None and self.lease.holder.token == token:
            self.lease = None
            self._save()

    def holder(self) -> Lease | None:
        """The lease, while its holder lives and it has not expired."""
        cur = self.lease
        if cur is None or cur.expires <= time.time() or not _holder_alive(cur.holder):
            return None
        return cur


PLAN_SUFFIX = "/plan"
"""The plan is stored once, under the keeper's key and this: it never changes, and is
the bulk of the state (megabytes for a large model)."""
STATE_SUFFIX = "/state"
"""The rest of the state, rewritten when a command puts it (not on each lease renewal)."""

Meta = tuple[int, list[str], Lease | None, int, Lease | None, Lease | None]
"""What the keeper's own key holds: fencing counter, notes, lease, starts, the last lease
handed out and the lease whose result the state is."""


def keeper_key(state: SessionState) -> str:
    """The key of a session's record in the GCS: one per load of the name."""
    return f"{state.session}/{state.created!r}/keeper"


def store(state: SessionState) -> str:
    """Record a new session's state in the GCS (before its keeper starts, which reads
    it); returns the key to give the keeper. Without credentials."""
    import pickle

    from ...cluster import raycompat

    key = keeper_key(state)
    raycompat.kv_put(key + PLAN_SUFFIX, pickle.dumps(state.plan))
    _write_state(key, state.without_credentials())
    _write(key, (0, [], None, 0, None, None))
    return key


def _write_state(key: str, state: SessionState) -> None:
    import pickle

    from ...cluster import raycompat

    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    del fields["plan"]  # stored once (PLAN_SUFFIX)
    raycompat.kv_put(key + STATE_SUFFIX, pickle.dumps(fields))


def _write(key: str, meta: Meta) -> None:
    import pickle

    from ...cluster import raycompat

    raycompat.kv_put(key, pickle.dumps(meta))


def _read(key: str) -> tuple[SessionState, Meta] | None:
    import pickle

    from ...cluster import raycompat

    raw = [raycompat.kv_get(key + s) for s in ("", STATE_SUFFIX, PLAN_SUFFIX)]
    if any(r is None for r in raw):
        return None
    meta, fields, plan = (pickle.loads(r) for r in raw if r is not None)
    return SessionState(plan=plan, **fields), meta


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
