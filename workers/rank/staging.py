"""The staging pool: every byte a rank stages is taken from here and accounted.

The plan (``mxload.orchestrator.plan.memory``) says how many staging bytes a rank may hold at once;
this pool enforces that number and records the high-water mark the run reports beside the
prediction (docs/contract.md §6: memory is planned, then allocated).

Why an accountant over real allocations rather than one preallocated arena: with
read-ahead, a unit's reads are taken before the previous unit's output is released, and
units differ in size, so a single arena fragments (a first-fit arena can refuse a request
that fits the budget). Taking each lease as its own tensor keeps the budget exact and
the high-water mark honest; the allocator underneath (glibc for large host blocks,
the NPU/CUDA caching allocator on a device) returns the memory when a lease ends.
A lease that would exceed the budget is a bug (plan and loader disagree) and raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ...orchestrator.errors import RunError


@dataclass
class Lease:
    """Bytes taken from the pool; ``tensor`` is a flat uint8 buffer of ``nbytes``."""

    tensor: torch.Tensor
    nbytes: int
    tag: str
    released: bool = field(default=False)


class StagingPool:
    """Accounts staging bytes against a budget and keeps the high-water mark."""

    def __init__(self, budget_bytes: int, *, rank: int = -1) -> None:
        self.budget_bytes = budget_bytes
        self.rank = rank
        self._lock = threading.Lock()
        self._in_use = 0
        self._high_water = 0

    @property
    def high_water(self) -> int:
        return self._high_water

    def take(self, nbytes: int, *, device: torch.device | str = "cpu", tag: str = "") -> Lease:
        """A fresh uint8 buffer of ``nbytes`` bytes, counted against the budget."""
        with self._lock:
            if self._in_use + nbytes > self.budget_bytes:
                raise RunError(
                    f"rank {self.rank}: staging would exceed its budget "
                    f"({self._in_use} + {nbytes} > {self.budget_bytes} bytes) for {tag}; "
                    "the loader left the plan's schedule",
                    rank=self.rank,
                    tensor=tag,
                )
            self._in_use += nbytes
            self._high_water = max(self._high_water, self._in_use)
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except BaseException:
            with self._lock:
                self._in_use -= nbytes
            raise
        return Lease(tensor=tensor, nbytes=nbytes, tag=tag)

    def reserve(self, nbytes: int, *, tag: str = "") -> Lease:
        """Account for ``nbytes`` that a conversion call allocates itself (its results,
        the unfused resolve intermediate): counted against the budget like a buffer."""
        with self._lock:
            if self._in_use + nbytes > self.budget_bytes:
                raise RunError(
                    f"rank {self.rank}: staging would exceed its budget "
                    f"({self._in_use} + {nbytes} > {self.budget_bytes} bytes) for {tag}",
                    rank=self.rank,
                    tensor=tag,
                )
            self._in_use += nbytes
            self._high_water = max(self._high_water, self._in_use)
        return Lease(tensor=torch.empty(0, dtype=torch.uint8), nbytes=nbytes, tag=tag)

    def release(self, lease: Lease | None) -> None:
        if lease is None or lease.released:
            return
        lease.released = True
        lease.tensor = torch.empty(0, dtype=torch.uint8)
        with self._lock:
            self._in_use -= lease.nbytes
