"""Every wait on a rank is bounded and names the rank that does not answer
(docs/contract.md §4 "Faults").

A rank that owes the driver an answer (a load, a reload, a shared fetch) is pinged
through its actor's second thread (``RankWorker.progress``, answered while the rank
works). A rank whose ping stays unanswered for ``timeout_s`` is not working slowly, it
does not run: its process is stopped (SIGSTOP, a debugger) or its node stalled. The
wait then ends with :class:`RankSilent` naming it, instead of renewing the session's
lease for ever. A rank whose process died answers with Ray's error at once: that is
the restart handling's business (``RayRun._wait_all``), not this one's.

The pings' answers are the ranks' progress, which the progress display shows: one
mechanism for both.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import RunError
from .worker_errors import first_line

RANK_ANSWER_S = 60.0
"""How long a rank with work may leave a ping unanswered before the run names it and
stops waiting for it (a parameter of the run, ``RayRun.answer_timeout_s``, not a flag:
tests wait less)."""


class RankSilent(RunError):
    """A rank did not answer a ping within the answer timeout (stopped or stalled)."""


def _stopped_here(pid: int | None) -> bool:
    """Whether ``pid`` is a process on this machine stopped by a signal or a debugger."""
    if pid is None:
        return False
    try:
        import psutil  # type: ignore[import-untyped]

        status = psutil.Process(pid).status()
    except Exception:  # not on this machine, or gone
        return False
    return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def silent_error(late: Sequence[int], pids: Sequence[int | None], timeout_s: float) -> RankSilent:
    """The error naming every rank in ``late`` (lowest first), with its pid and, when
    its process is stopped on this machine, the command that resumes it."""
    named = []
    for rank in late:
        pid = pids[rank] if rank < len(pids) else None
        named.append(f"rank {rank}" + (f" (pid {pid})" if pid is not None else ""))
    stopped = [pids[r] for r in late if r < len(pids) and _stopped_here(pids[r])]
    why = (
        f"stopped (SIGSTOP or a debugger): `kill -CONT {' '.join(map(str, stopped))}` resumes it"
        if stopped
        else "stopped, or its node stalled"
    )
    return RankSilent(
        f"{', '.join(named)} did not answer in {timeout_s:g} s ({why}); the run stopped "
        "waiting for it (`mxload status` says what the ranks hold)",
        rank=late[0],
    )


def ask_ranks(actors: Sequence[Any], method: str, timeout_s: float, *args: Any) -> list[Any]:
    """``method(*args)`` of every rank, or RankSilent naming the ranks that did not answer
    in ``timeout_s`` (a stopped worker, a stalled node; a rank Ray is restarting is
    waited for), RunError when one failed."""
    import ray

    refs = [getattr(a, method).remote(*args) for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    late = [r for r, ref in enumerate(refs) if ref not in ready]
    if late:
        raise RankSilent(
            f"rank(s) {', '.join(map(str, late))} did not answer in {timeout_s:g} s (a stopped "
            "or stalled worker, or its node); nothing was changed",
            rank=late[0],
        )
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayError as err:
        raise RunError(f"a rank failed to answer {method}: {first_line(err)}") from None


class Liveness:
    """Pings of the ranks a run waits on (module doc). ``pids``: each rank's worker pid
    as last seen (for the message); ``timeout_s``: :data:`RANK_ANSWER_S` by default."""

    def __init__(
        self,
        actors: Sequence[Any],
        timeout_s: float = RANK_ANSWER_S,
        pids: Sequence[int | None] = (),
    ) -> None:
        self.actors = actors
        self.timeout_s = timeout_s
        self.pids = list(pids) or [None] * len(actors)
        self._pending: dict[int, tuple[Any, float]] = {}
        self._last: dict[int, tuple[int, int, int]] = {}

    def poll(self, ranks: Iterable[int]) -> list[int]:
        """Ping every rank of ``ranks`` that has no ping in flight and collect the answers
        that came; the ranks of ``ranks`` that left a ping unanswered too long."""
        import ray

        waiting = set(ranks)
        for rank in list(self._pending):
            if rank not in waiting:  # done with it: its late ping no longer counts
                del self._pending[rank]
        now = time.monotonic()
        for rank in waiting - set(self._pending):
            self._pending[rank] = (self.actors[rank].progress.remote(), now)
        if not self._pending:
            return []
        refs = [ref for ref, _ in self._pending.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        answered = set(ready)
        for rank, (ref, _) in list(self._pending.items()):
            if ref in answered:
                del self._pending[rank]
                try:
                    done, total, nbytes = ray.get(ref)
                    self._last[rank] = (int(done), int(total), int(nbytes))
                except ray.exceptions.RayError:
                    pass  # lost or restarting: the run's own wait sees it
        return sorted(r for r, (_, since) in self._pending.items() if now - since > self.timeout_s)

    def error(self, late: Sequence[int]) -> RankSilent:
        """The error naming the ranks in ``late`` (from :meth:`poll`)."""
        return silent_error(late, self.pids, self.timeout_s)

    def settle(self, rank: int) -> None:
        """Record the final progress of a rank whose run returned (it answers at once: it
        is idle); a rank that does not answer in time keeps its last one."""
        import ray

        self._pending.pop(rank, None)
        try:
            done, total, nbytes = ray.get(
                self.actors[rank].progress.remote(), timeout=self.timeout_s
            )
            self._last[rank] = (int(done), int(total), int(nbytes))
        except (ray.exceptions.RayError, TimeoutError):
            pass

    def progress(self) -> list[tuple[int, int, int]]:
        """Each rank's last answered progress (done, total, bytes)."""
        return [self._last.get(r, (0, 0, 0)) for r in range(len(self.actors))]

    def wait(self, refs: Mapping[int, Any], period_s: float = 0.5) -> None:
        """Until every rank's call in ``refs`` (rank -> ObjectRef) finished, failed or
        not; RankSilent for a rank that stops answering meanwhile."""
        import ray

        left = dict(refs)
        while left:
            ready, _ = ray.wait(list(left.values()), num_returns=len(left), timeout=period_s)
            done = set(ready)
            left = {r: ref for r, ref in left.items() if ref not in done}
            late = self.poll(left)
            if late:
                raise self.error(late)
