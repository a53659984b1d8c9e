"""A detached session's keeper and its lease (docs/contract.md §4 "Reload").

The keeper is a small detached actor holding the session's
:class:`~mxload.orchestrator.runtime.state.SessionState` and the lease that serialises the
commands that change it: one holder at a time, renewed while it runs, taken over when
its holder's process is gone or it expired, each lease with a larger fencing token.
"""

from __future__ import annotations

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
        return self.lease

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
