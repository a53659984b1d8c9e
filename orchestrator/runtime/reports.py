"""What a run reports: the mxload-dump/1 manifest from the ranks' reports
(docs/contract.md §5) and ``--dump``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..plan.formats import DUMP_FORMAT
from ..plan.types import Plan
from .liveness import Liveness
from .outputs import OutputDir
from .state import Report

if TYPE_CHECKING:
    from .ray_run import RayRun


def build_manifest(plan: Plan, reports: list[Report]) -> dict[str, Any]:
    """The mxload-dump/1 manifest (docs/contract.md §5) from the ranks' reports."""
    ranks = []
    for rp, rep in zip(plan.ranks, reports, strict=True):
        entry: dict[str, Any] = {
            "rank": rp.rank,
            "tp_rank": rp.tp_rank,
            "dp_rank": rp.dp_rank,
            "pp_rank": rp.pp_rank,
            "ep_rank": rp.ep_rank,
            "node_id": rep.get("node_id", ""),
            "pid": rep.get("pid"),
            "device": rep.get("device", ""),
            "backend": rep.get("backend", ""),
            "backend_note": rep.get("backend_note", ""),
            "visible_devices": rep.get("visible_devices", ""),
            "experts": list(rp.experts),
            "layers": list(rp.layers),
            "tensors": rep.get("tensors", {}),
            "version": rep.get("version"),
            "consistent": rep.get("consistent"),
            # [version, checkpoint fingerprint] every unit holds; None when they differ
            "identity": rep.get("identity"),
            "units": rep.get("units"),
            "bytes_read": rep.get("bytes_read"),
            "bytes_needed": rep.get("bytes_needed"),
            "bytes_to_read": rp.bytes_to_read,
            "read_amplification": _ratio(rep.get("bytes_read"), rep.get("bytes_needed")),
            "persistent_bytes": rp.persistent_bytes,
            "predicted_peak_staging_bytes": rep.get("predicted_peak_staging_bytes"),
            "measured_peak_staging_bytes": rep.get("measured_peak_staging_bytes"),
            "device_peak_staging_bytes": rep.get("device_peak_staging_bytes"),
            "rss_growth_bytes": rep.get("rss_growth_bytes"),
            "bytes_from_storage": rep.get("bytes_from_storage"),
            "bytes_from_peers": rep.get("bytes_from_peers"),
            "predicted_bytes_from_storage": rep.get("predicted_bytes_from_storage"),
            "predicted_bytes_from_peers": rep.get("predicted_bytes_from_peers"),
            "shared_put_bytes": rep.get("shared_put_bytes", 0),
            "peer_fallbacks": rep.get("peer_fallbacks", 0),
            "seconds": rep.get("seconds"),
            # the shared reads it fetched for its peers before loading (owners only)
            "fetch_seconds": rep.get("fetch_seconds"),
            "restarts": rep.get("restarts", 0),
            "addresses_changed": rep.get("addresses_changed", False),
        }
        ranks.append(entry)
    from ...workers.rank.loader import CHECKSUM_NAME

    return {
        "format": DUMP_FORMAT,
        "model": plan.model,
        "parallel": plan.layout.to_json(),
        "engine": plan.engine,
        "checksum": CHECKSUM_NAME,
        "ranks": ranks,
    }


def _ratio(a: Any, b: Any) -> float | None:
    if not a or not b:
        return None
    return round(float(a) / float(b), 4)


def write_dump(run: RayRun, manifest: dict[str, Any], out_dir: str | OutputDir) -> None:
    """``--dump DIR``: each rank's buffers as rank-NNNNN.safetensors + manifest.json.

    Written into a temporary folder beside DIR and renamed into place when complete
    (:mod:`mxload.orchestrator.runtime.outputs`): never a ``.partial``, never another
    run's rank files beside this manifest. A plain path is checked here (a non-empty DIR is refused); the
    CLI passes an :class:`OutputDir` it checked before any work, with ``--overwrite``."""
    import json

    import ray

    from ...workers.safetensors_io import SafetensorsWriter
    from ..plan.formats import BUFFER_TO_SAFETENSORS

    out = out_dir if isinstance(out_dir, OutputDir) else dump_target(out_dir)
    with out:
        tmp = out.begin()
        for rank, actor in enumerate(run.actors):
            ref = actor.host_tensors.remote()
            # a rank stopped or stalled mid-copy is named, not waited for for ever
            Liveness(run.actors, run.answer_timeout_s).wait({rank: ref})
            raw = ray.get(ref)
            specs = [
                (n, BUFFER_TO_SAFETENSORS[d], tuple(shape)) for n, (d, shape, _) in raw.items()
            ]
            path = os.path.join(tmp, f"rank-{rank:05d}.safetensors")
            with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as w:
                for name in w.order:
                    w.write(name, raw[name][2].tobytes())
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)


def dump_target(out_dir: str, *, overwrite: bool = False) -> OutputDir:
    """The checked ``--dump`` folder (OutputError, before any work, if it cannot be used)."""
    out = OutputDir(out_dir, "--dump", overwrite=overwrite)
    out.check()
    return out


def sharing_summary(run: RayRun) -> dict[str, Any]:
    """The manifest's "sharing" object: scope, cluster totals, the data phases' seconds
    and the predicted traffic per rank (what ``mxload.orchestrator.plan.timemodel`` takes)."""
    info = dict(run.last_sharing)
    info["predicted_traffic"] = info.pop("predicted", [])
    return info
