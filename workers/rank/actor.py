"""The Ray actor around :class:`mxload.workers.rank.loader.RankLoader`: a thin wrapper.

One actor per rank, pinned by its placement bundle to one accelerator (Ray sets
``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``). The actor reserves no CPU
(docs/contract.md §4) and sets its torch threads to its share of the node's cores. It is threaded
(``max_concurrency=2``) so the driver can poll progress while a load runs.

Everything here is the loader's behaviour plus what only a process can say: its node,
its visible devices, its pid.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
from typing import Any

import torch

from ...orchestrator.plan.message import RankJob, SourceInfo
from ...orchestrator.plan.types import RankPlan, Unit, UnitReads
from .loader import RankLoader, RunStats

VISIBLE_DEVICE_VARS = {
    "NPU": "ASCEND_RT_VISIBLE_DEVICES",
    "GPU": "CUDA_VISIBLE_DEVICES",
}


class RankWorker:
    """Actor body: a plain class (tests can use it without Ray)."""

    def __init__(
        self,
        plan: RankPlan | str,
        *,
        model_dtype: str,
        device: str,
        resource: str,
        threads: int,
        incarnation_note: str = "",
    ) -> None:
        from ...cluster.local import tighten_own_temp_dir

        tighten_own_temp_dir()  # this process's start made Ray's folders 0777 again
        if isinstance(plan, str):
            plan = stored_rank_plan(plan)
        self.resource = resource
        var = VISIBLE_DEVICE_VARS.get(resource, "")
        self.visible_devices = os.environ.get(var, "") if var else ""
        from ..numerics.select import select_backend

        self.backend = select_backend(device, visible_devices=self.visible_devices or None)
        # After the backend: its first kernel compile and self-test reset torch's thread
        # count, and this rank must use only its share of the node's cores.
        torch.set_num_threads(max(1, threads))
        self.loader = RankLoader(plan, model_dtype=model_dtype, backend=self.backend)
        self._progress = (0, len(plan.units), 0)
        self._lock = threading.Lock()
        self._refit: Any = None
        """This rank's side of a refit group once joined (``transfer.rank.RankRefit``)."""
        # torch, numba's kernels and the rank's plan are loaded for good: keep their many
        # objects out of the cyclic collector's walks, which would pause a load.
        gc.freeze()

    # --- identity ---------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        node_id = ""
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:
            node_id = socket.gethostname()
        return {
            "rank": self.loader.rank,
            "node_id": node_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "visible_devices": self.visible_devices,
            "device": str(self.backend.device),
            "backend": self.backend.name,
            "backend_note": getattr(self.backend, "note", ""),
            "threads": torch.get_num_threads(),
            "addresses": dict(self.loader.addresses),
        }

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this rank runs on (what read-once sharing groups ranks by)."""
        try:
            import ray

            return str(ray.get_runtime_context().get_node_id())
        except Exception:
            return socket.gethostname()

    # --- work -------------------------------------------------------------------------

    def _set_progress(self, done: int, total: int, nbytes: int) -> None:
        with self._lock:
            self._progress = (done, total, nbytes)

    def progress(self) -> tuple[int, int, int]:
        with self._lock:
            return self._progress

    def load(self, job: RankJob) -> dict[str, Any]:
        """Load (or reload) this rank; ``job.peers``: the shared units other ranks (or
        this one) published, as ObjectRefs of raw bytes (never pickled tensors)."""
        peer_get = None
        if job.peers:
            import ray

            peer_get = ray.get
        stats = self.loader.run(job, progress=self._set_progress, peer_get=peer_get)
        return self.report(stats)

    def refit_join(self, *args: Any) -> bool:
        """Join a refit group (``mxload.workers.transfer.rank.RankRefit(*args)``; waits for
        the trainer's ranks), leaving the one joined before."""
        from ..transfer.rank import RankRefit

        self.refit_close()
        self._refit = RankRefit(*args)
        return True

    def refit_load(
        self,
        step: int,
        delta_of: int | None,
        reads: list[UnitReads],
        source: SourceInfo,
        staging_budget: int,
        units: list[Unit],
    ) -> dict[str, Any]:
        """Receive trainer step ``step`` and write it in place (a reload whose bytes came
        from the trainer's ranks, docs/contract.md §4 "Refit")."""
        refit = self._refit
        if refit is None:
            from ...orchestrator.errors import RunError

            raise RunError(f"rank {self.loader.rank}: no refit group joined", rank=self.loader.rank)
        storage = refit.prepare(self.loader, reads, source.fingerprint, step, delta_of)
        stats = self.loader.reload(
            reads,
            source,
            version=step,
            staging_budget=staging_budget,
            units=units,
            progress=self._set_progress,
            storage=storage,
        )
        out = self.report(stats)
        got = refit.last
        out["bytes_received"] = got.bytes_received if got is not None else 0
        out["bytes_copied"] = refit.copied_bytes
        return out

    def refit_close(self) -> None:
        refit = self._refit
        if refit is not None:
            refit.close()
            self._refit = None

    def fence(self, token: int, wait_s: float = 30.0) -> bool:
        """A new lease's token: runs with a smaller one write nothing more
        (``RankLoader.advance_fence``); whether this rank is free now."""
        return self.loader.advance_fence(token, wait_s)

    def fetch_shared(
        self,
        items: list[tuple[int, Unit, UnitReads]],
        source: SourceInfo,
        staging_budget: int,
        window_bytes: int = 0,
    ) -> dict[str, Any]:
        """Fetch the shared reads this rank owns from storage and ``ray.put`` their raw
        bytes (uint8 arrays: plasma shares them within a node, the object manager moves
        them to other nodes). The refs go back to the driver, which hands them to the
        users; this process owns the objects while it lives. ``window_bytes``: staging
        the units fetched at once may hold (``RankLoader.fetch_for_peers``)."""
        import ray

        got = self.loader.fetch_for_peers(
            items,
            source,
            staging_budget=staging_budget,
            publish=ray.put,
            window_bytes=window_bytes,
        )
        return {
            "handles": got.handles,
            "fetched": got.bytes_from_storage,
            "published": got.published_bytes,
            "peak": got.peak_staging_bytes,
            "seconds": round(got.seconds, 4),
        }

    def report(self, stats: RunStats | None = None) -> dict[str, Any]:
        stats = stats or self.loader.last_stats
        out = self.info()
        out.update(
            {
                "version": self.loader.version,
                "consistent": self.loader.consistent,
                "identity": list(self.loader.identity) if self.loader.identity else None,
                "units": self.loader.unit_status(),
                "tensors": self.loader.tensor_report(),
                "bytes_read": stats.bytes_read,
                "bytes_needed": stats.bytes_needed,
                "predicted_peak_staging_bytes": stats.predicted_peak_staging_bytes,
                "measured_peak_staging_bytes": stats.measured_peak_staging_bytes,
                "device_peak_staging_bytes": stats.device_peak_bytes,
                "rss_growth_bytes": stats.rss_growth_bytes,
                "bytes_from_storage": stats.bytes_from_storage,
                "bytes_from_peers": stats.bytes_from_peers,
                "peer_fallbacks": stats.peer_fallbacks,
                "seconds": round(stats.seconds, 4),
                "read_seconds": round(stats.read_seconds, 4),
                "convert_seconds": round(stats.convert_seconds, 4),
            }
        )
        return out

    def host_tensors(self) -> dict[str, tuple[str, list[int], Any]]:
        """name -> (torch dtype name, shape, raw bytes as a numpy uint8 array).

        Raw bytes, not tensors: Ray would pickle tensors through torch.load, which mxload
        never uses (and which fails for float8 storages)."""
        out = {}
        for name, t in self.loader.host_tensors().items():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            out[name] = (str(t.dtype).removeprefix("torch."), list(t.shape), raw)
        return out

    def checksums(self) -> dict[str, str]:
        return self.loader.checksums()


def probe_device(device: str, resource: str) -> str:
    """Whether this process can compute on ``device``: "" if it can, else the reason (one
    line, naming the node). Run by the driver as a small task on every node of the
    placement group before any worker starts, so a node without torch_npu or CUDA is a
    refusal in seconds rather than workers failing, restarting and failing again."""
    from ...orchestrator.errors import MxloadError
    from ..numerics.select import select_backend

    var = VISIBLE_DEVICE_VARS.get(resource, "")
    visible = os.environ.get(var, "") if var else ""
    try:
        select_backend(device, visible_devices=visible or None)
    except MxloadError as err:
        return f"node {socket.gethostname()} ({_node_ip()}): {err.message}"
    return ""


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # outside Ray: the name alone says where
        return "?"


def stored_rank_plan(key: str) -> RankPlan:
    """The rank plan a detached session stored in the GCS under ``key``. A detached rank
    is given the key, not the plan: Ray restarts it with its first arguments, and one
    larger than Ray passes inline is owned by the command that made the actor, gone once
    that exits (docs/contract.md §4 "Detached sessions")."""
    import pickle

    from ...cluster import raycompat

    raw = raycompat.kv_get(key)
    if raw is None:
        raise RuntimeError(f"this rank's plan {key!r} is not in the Ray cluster (released?)")
    plan: RankPlan = pickle.loads(raw)
    return plan


def remote_class(worker: type[RankWorker] = RankWorker) -> Any:
    """The Ray actor class of ``worker`` (built lazily so importing this module needs no
    Ray). Threaded, so the driver can poll progress while a load runs."""
    import ray

    # Ray's stubs leave max_concurrency out of ray.remote's overloads.
    return ray.remote(num_cpus=0, max_concurrency=2)(worker)  # type: ignore[call-overload]
