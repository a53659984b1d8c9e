"""A run on Ray: the started (or joined) cluster, the placement group, one worker actor
per rank, and every rank loading concurrently, a rank whose process dies restarted and
redone up to ``--max-restarts`` (docs/contract.md §4 "Faults").
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import MxloadError, RunError, WorkerLost
from ..plan.message import RankJob
from ..plan.types import Plan
from . import placement, shared_reads
from .liveness import RANK_ANSWER_S, Liveness
from .request import LoadRequest
from .state import Progress, Report
from .worker_errors import first_line, plain, rank_error

if TYPE_CHECKING:
    from ...workers.rank.actor import RankWorker


class RayRun:
    """A started (or joined) Ray, the placement group and the rank actors.

    ``worker`` is the actor body (default ``RankWorker``); a detached session names its
    placement group and actors after ``detached_name``."""

    def __init__(
        self,
        req: LoadRequest,
        plan: Plan,
        *,
        detached_name: str | None = None,
        worker: type[RankWorker] | None = None,
    ) -> None:
        self.req = req
        self.plan = plan
        self.detached_name = detached_name
        self.worker = worker
        self.temp_dir: str | None = None
        self.started_ray = False
        self.placed: placement.Placement | None = None
        self.actors: list[Any] = []
        self.last_sharing: dict[str, Any] = {}
        """What the last run's read-once sharing planned and measured (manifest "sharing")."""
        self.answer_timeout_s = RANK_ANSWER_S
        """How long a rank with work may leave a ping unanswered (``liveness``)."""

    # --- cluster ------------------------------------------------------------------------

    @property
    def pg(self) -> Any:
        return self.placed.pg if self.placed is not None else None

    @property
    def split_tp_groups(self) -> list[int]:
        return self.placed.split_tp_groups if self.placed is not None else []

    def start(self) -> None:
        import ray

        if ray.is_initialized():
            return
        self.temp_dir = placement.start_ray(self.req, self.plan.layout.world)
        self.started_ray = self.temp_dir is not None

    def place(self) -> None:
        self.placed = placement.place(self.req, self.plan, name=self.detached_name)

    def check_devices(self) -> None:
        assert self.placed is not None, "place() first"
        placement.check_devices(self.req, self.placed)

    def spawn(self) -> None:
        from ...workers.rank.actor import RankWorker

        assert self.placed is not None, "place() first"
        self.actors = placement.spawn(
            self.req, self.plan, self.placed, self.worker or RankWorker, name=self.detached_name
        )

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # already removed
                pass
        if self.started_ray:
            from ...cluster.raycompat import kill_own_autoscaler_monitor

            kill_own_autoscaler_monitor()
            ray.shutdown()
            if self.temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)

    # --- running ---------------------------------------------------------------------------

    def run_all(
        self,
        jobs: Sequence[RankJob],
        *,
        on_progress: Progress | None = None,
        only: Sequence[int] | None = None,
    ) -> list[Report]:
        """Every rank runs its job (one per rank, all of one source) concurrently; a dead
        rank is redone; a rank that stops answering is named (``liveness``).

        Read-once sharing adds each job's ``peers``. ``only``: the ranks to run (default:
        all; a repair runs the restarted ones), whose reports are returned in that order,
        without read-once sharing (``jobs`` still holds one job per rank). Each report's
        ``restarts`` counts how often the rank's process was lost during this run."""
        pids = self.pids()
        live = Liveness(self.actors, self.answer_timeout_s, pids)
        t_run = time.perf_counter()
        shared, self.last_sharing = shared_reads.Shared(), {}
        t_planned = t_run
        if only is None:
            share, self.last_sharing = shared_reads.plan_shares(
                self.plan,
                shared_reads.node_ids(self.actors, self.req.placement_timeout_s),
                self.req.share,
                jobs,
            )
            t_planned = time.perf_counter()
            shared = shared_reads.fetch_shares(self.actors, share, self.plan, jobs, live)
        t_fetched = time.perf_counter()

        def submit(rank: int) -> Any:
            peers = shared.peers_of.get(rank)
            job = replace(jobs[rank], peers=peers) if peers else jobs[rank]
            return self.actors[rank].load.remote(job)

        ranks = list(range(len(self.actors))) if only is None else list(only)
        reports, attempts = self._wait_all(submit, on_progress, live, ranks)
        for rank, rep in zip(ranks, reports, strict=True):
            rep["restarts"] = max(attempts[rank], int(rep["pid"] != pids[rank]))
            rep["addresses_changed"] = rep["restarts"] > 0
        shared_reads.add_fetched(reports, shared)
        shared_reads.sharing_totals(self.last_sharing, reports)
        if self.last_sharing:
            # the data phases the time model predicts (mxload.orchestrator.plan.timemodel)
            self.last_sharing["fetch_seconds"] = round(t_fetched - t_run, 4)
            # of which the driver's placement lookup and sharing plan
            self.last_sharing["plan_seconds"] = round(t_planned - t_run, 4)
            self.last_sharing["run_seconds"] = round(time.perf_counter() - t_run, 4)
        return reports

    def _wait_all(
        self,
        submit: Callable[[int], Any],
        on_progress: Progress | None,
        live: Liveness,
        ranks: Sequence[int],
    ) -> tuple[list[Report], list[int]]:
        """Run ``submit`` for every rank of ``ranks`` and wait for them all, resubmitting
        a rank whose process was lost (up to ``--max-restarts``) or is being restarted.
        Returns their reports (in ``ranks`` order) and how often each rank's process was
        lost; raises the first rank's error naming every rank that failed (RankSilent for
        one that stopped answering, ``live``).

        Every rank that answers is waited for even after one failed: a rank still writing
        must not be handed the next load, and the error names every rank that failed. A
        silent rank cannot be waited for: it is given up and named."""
        import ray
        from ray.exceptions import RayActorError

        world = len(self.actors)
        attempts = [0] * world
        refs = {submit(r): r for r in ranks}
        reports: list[Report | None] = [None] * world
        failures: dict[int, MxloadError] = {}
        unavailable_since: dict[int, float] = {}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            # A rank that stopped answering is given up (named); the others are still
            # waited for, as after any failure.
            silent = set(live.poll(r for ref, r in refs.items() if ref not in done))
            for ref, rank in list(refs.items()):
                if rank in silent and ref not in done:
                    del refs[ref]
                    failures[rank] = live.error([rank])
            for ref in done:
                rank = refs.pop(ref)
                try:
                    reports[rank] = ray.get(ref)
                    unavailable_since.pop(rank, None)
                    if on_progress is not None:
                        live.settle(rank)  # its last units, not the ping before them
                except ray.exceptions.ActorUnavailableError:
                    # The process is being restarted (already counted): try again shortly.
                    since = unavailable_since.setdefault(rank, time.monotonic())
                    if time.monotonic() - since > self.req.placement_timeout_s:
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
            if on_progress is not None:
                on_progress(live.progress())
        if failures:
            raise _first_failure(failures)
        return [rep for rep in (reports[r] for r in ranks) if rep is not None], attempts

    def pids(self) -> list[int | None]:
        """Each rank's worker pid now (None for one that does not answer). A rank whose
        process Ray is restarting (Ray refuses calls to it meanwhile) is waited for, up
        to the placement timeout, and answers from its new process (a worker still
        starting, importing torch on a busy host, answers late but answers)."""
        import ray

        out: list[int | None] = []
        deadline = time.monotonic() + self.req.placement_timeout_s
        for rank, a in enumerate(self.actors):
            pid: int | None = None
            while True:
                try:
                    pid = ray.get(a.pid.remote(), timeout=max(deadline - time.monotonic(), 1))
                except ray.exceptions.GetTimeoutError:
                    raise RunError(
                        f"rank {rank}: its worker did not answer in "
                        f"{self.req.placement_timeout_s:g} s (stopped, or its node stalled)",
                        rank=rank,
                    ) from None
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() < deadline:
                        time.sleep(0.2)
                        continue
                except ray.exceptions.RayActorError:
                    pass
                break
            out.append(pid)
        return out


def _first_failure(failures: dict[int, MxloadError]) -> MxloadError:
    """The lowest rank's error, naming the other ranks that failed."""
    first = min(failures)
    err = failures[first]
    if len(failures) > 1:
        others = ", ".join(str(r) for r in sorted(failures) if r != first)
        err.message = f"{err.message} (ranks {others} failed too)"
        err.args = (err.message,)
    return err
