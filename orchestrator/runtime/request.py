"""What a load asks for (:class:`LoadRequest`, docs/contract.md §5) and the small facts
derived from it that the run, the sessions and reloads share: whether workers convert
fused, the staging budget a rank runs under, the checkpoint as the rank loaders read it.
No Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...workers.storage.urls import absolute
from ..plan.checkpoint import CheckpointMeta
from ..plan.message import SourceInfo
from ..plan.sharing import DEFAULT_SHARE
from ..plan.types import ParallelLayout, Plan, RankPlan


@dataclass
class LoadRequest:
    """Everything ``mxload load`` takes (docs/contract.md §5)."""

    src: str
    layout: ParallelLayout
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """Never shown (no repr): it holds credentials."""
    device: str = "auto"
    resource: str | None = None
    """Accelerator resource each rank asks for; default NPU (GPU with --device cuda)."""
    placement: str = "pack"
    address: str | None = None
    staging_budget: int | None = None
    device_memory: int | None = None
    dtype: str | None = None
    allow_nonfinite: bool = False
    max_restarts: int = 1
    placement_timeout_s: float = 120.0
    num_cpus: int | None = None
    """CPUs the embedded head declares (default: this machine's, capped at 2 in tests)."""
    threads_per_worker: int | None = None
    engine: str = "mxload"
    """Engine profile the buffers are laid out for (``mxload.orchestrator.plan.engines``)."""
    share: str = DEFAULT_SHARE
    """Read-once scope (``mxload.orchestrator.plan.sharing``): none | node | cluster."""

    def __post_init__(self) -> None:
        # Resolved here, in the process that names it: workers start elsewhere.
        self.src = absolute(self.src)

    @property
    def accelerator(self) -> str:
        if self.resource:
            return self.resource
        return "GPU" if self.device == "cuda" else "NPU"


def workers_fused(device: str) -> bool:
    """Whether workers will convert with the fused CPU kernel (plans no resolve
    scratch). Device paths (npu, cuda) resolve with eager torch ops: unfused."""
    if device not in ("cpu", "auto"):
        return False
    try:
        from ...workers.numerics.fast import fast_available

        return bool(fast_available())
    except ImportError:
        return False


def staging_budget_of(plan: Plan, rank: RankPlan) -> int:
    """The budget a rank runs under: what the plan's estimate was computed for."""
    if rank.staging is not None:
        return rank.staging.budget_bytes
    return plan.min_staging_reload


def source_info(
    meta: CheckpointMeta,
    allow_nonfinite: bool,
    src: str,
    storage_options: Mapping[str, Any] | None,
) -> SourceInfo:
    """The checkpoint ``meta`` (opened from ``src``) as the rank loaders read it."""
    q = meta.config.quant
    return SourceInfo(
        root=src,
        storage_options=dict(storage_options) if storage_options else None,
        quant=q.kind,
        block_n=q.block_n,
        block_k=q.block_k,
        allow_nonfinite=allow_nonfinite,
        fingerprint=meta.fingerprint,
        file_tags=dict(meta.file_tags) if all(meta.file_tags.values()) else None,
    )
