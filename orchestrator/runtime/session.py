"""Sessions: a loaded model that stays resident and is reloaded in place
(docs/contract.md §4).

:class:`Session` is the Python API an RL trainer uses in-process::

    from mxload import ParallelLayout, Session

    s = Session.load("s3://bucket/step-0", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
                     storage_options={"endpoint_url": "http://127.0.0.1:9000"})
    for step in range(1, 100):
        ...train, write s3://bucket/step-{step}...
        s.reload(f"s3://bucket/step-{step}")   # every buffer rewritten in place
    s.release()

``--detach`` on the command line keeps the same actors alive as named, detached Ray
actors (``mxload.orchestrator.runtime.detached``). Both reload through
:func:`mxload.orchestrator.runtime.reload.reload`; here the state is an attribute.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..errors import SessionBusy
from ..plan.types import ParallelLayout
from .driver import load as driver_load
from .liveness import ask_ranks
from .ray_run import RayRun
from .reload import RayRanks, reload
from .reports import build_manifest
from .request import LoadRequest
from .state import Progress, SessionState, verdict


class Session:
    """A loaded model held by live workers, reloadable in place."""

    def __init__(self, run: RayRun, state: SessionState, manifest: dict[str, Any]) -> None:
        self.run = run
        self.state = state
        self.manifest = manifest
        """The manifest of the last load or reload."""
        self._reloading = threading.Lock()

    @classmethod
    def load(
        cls,
        src: str,
        layout: ParallelLayout,
        *,
        storage_options: Mapping[str, Any] | None = None,
        on_progress: Progress | None = None,
        **kwargs: Any,
    ) -> Session:
        req = LoadRequest(src=src, layout=layout, storage_options=storage_options, **kwargs)
        manifest, run = driver_load(req, keep=True, on_progress=on_progress)
        assert run is not None
        first = manifest["ranks"][0].get("identity") or [1, ""]
        state = SessionState.from_reports(
            run.plan,
            manifest["ranks"],
            src=req.src,
            fingerprint=str(first[1]),
            storage_options=storage_options,
            request=req,
            identity_basis=str(manifest.get("identity_established_by", "")),
        )
        return cls(run, state, manifest)

    @property
    def version(self) -> int:
        return self.state.version

    def reload(
        self,
        src: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        on_progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Rewrite every rank's buffers in place from ``src``; returns the manifest.
        Running it again after a failure completes the interrupted reload (from ``src``)
        or rewrites every unit not at the new checkpoint (from another). One reload at a
        time: a second, from another thread, is refused (SessionBusy)."""
        if not self._reloading.acquire(blocking=False):
            raise SessionBusy("this session is already reloading; nothing was started")
        try:
            req = self.run.req
            done = reload(
                RayRanks(self.run),
                self.state,
                lambda _: None,  # the state is this object's attribute
                src,
                storage_options=storage_options,
                staging_budget=req.staging_budget,
                allow_nonfinite=req.allow_nonfinite,
                on_progress=on_progress,
            )
        finally:
            self._reloading.release()
        manifest = build_manifest(self.state.plan, done.reports)
        manifest["seconds"] = done.seconds
        manifest["addresses_moved"] = []
        self.manifest = manifest
        return manifest

    def engine_nodes(self) -> list[int]:
        """Per rank, the machine its actor runs on, numbered from 0 in rank order: the
        trainer form's ``engine_nodes``. Give the same list to the trainer's senders, so
        that ranks of one machine holding the same buffers copy them there instead of
        each receiving them from the trainer."""
        from . import shared_reads
        from .refit import node_numbers

        return node_numbers(
            shared_reads.node_ids(self.run.actors, self.run.req.placement_timeout_s)
        )

    def attach_trainer(self, trainer: Mapping[str, Any]) -> None:
        """Take updates from a trainer's ranks (the trainer form of docs/adoption.md
        "Refit from the trainer"): plan the refit (ReloadMismatch, nothing touched, when
        the trainer's tensors do not give every rank what it holds) and have every rank
        join the refit group (waits for the trainer's ranks)."""
        from .catalog import open_checkpoint
        from .refit import TrainerSource, join_ray, refit_setup
        from .request import workers_fused

        req = self.run.req
        config = open_checkpoint(
            req.src, storage_options=req.storage_options, dtype=self.state.plan.model["dtype"]
        ).config
        setup = refit_setup(
            self.state.plan,
            config,
            TrainerSource.from_json(trainer),
            fused=workers_fused(req.device),
        )
        join_ray(self.run, setup)
        self._refit = setup

    def refit(
        self, step: int, manifest_hash: str, *, delta_of: int | None = None
    ) -> dict[str, Any]:
        """Receive trainer step ``step`` on every rank and write it in place (the trainer's
        ranks send it with ``MxloadSender.send_weights`` meanwhile); returns the manifest.
        The same semantics as :meth:`reload` (docs/contract.md §4 "Refit")."""
        from ..errors import RunError
        from .refit import RayRefitRanks, refit

        setup = getattr(self, "_refit", None)
        if setup is None:
            raise RunError("this session takes no trainer updates: call attach_trainer first")
        if not self._reloading.acquire(blocking=False):
            raise SessionBusy("this session is already reloading; nothing was started")
        try:
            done = refit(
                RayRefitRanks(self.run, step, delta_of),
                self.state,
                lambda _: None,  # the state is this object's attribute
                setup,
                [],
                step=step,
                manifest_hash=manifest_hash,
                delta_of=delta_of,
                staging_budget=self.run.req.staging_budget,
            )
        finally:
            self._reloading.release()
        manifest = build_manifest(self.state.plan, done.reports)
        manifest["seconds"] = done.seconds
        manifest["addresses_moved"] = []
        self.manifest = manifest
        return manifest

    def status(self) -> dict[str, Any]:
        """What every rank holds, with the same verdict as ``mxload status``:
        ``consistent`` only when every unit of every rank holds this session's version of
        one checkpoint and replicated buffers agree; ``problems`` and ``notices`` say why
        not and what else happened (a failed reload, a restarted rank)."""
        reports = ask_ranks(self.run.actors, "report", self.run.answer_timeout_s)
        self.state.observe(reports)
        manifest = build_manifest(self.state.plan, reports)
        verdict(self.state, manifest)
        last = self.state.last_reload
        manifest["last_reload"] = last.to_json() if last is not None else None
        return manifest

    def release(self) -> None:
        self.run.shutdown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
