"""The driver -> rank message: what a rank is told to load or reload. Pure.

The driver (``mxload.orchestrator.runtime``) builds one :class:`RankJob` per rank and
hands it to that rank's worker (``mxload.workers.rank``), through Ray or in-process
(an inference engine's own worker, docs/contract.md §4). It is plain data: picklable,
and the handles of published bytes are whatever the transport gives (Ray ObjectRefs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .types import Unit, UnitReads


@dataclass(frozen=True)
class SourceInfo:
    """The checkpoint a load or reload reads (each version plans from its own headers,
    docs/contract.md §4)."""

    root: str
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """Never shown: it holds credentials."""
    quant: str = "block_fp8"
    """How this checkpoint stores quantized linears: block_fp8 | mxfp8 | none."""
    block_n: int = 128
    block_k: int = 128
    allow_nonfinite: bool = False
    file_tags: Mapping[str, str] | None = field(default=None, repr=False)
    """Per shard, its change tag as the fingerprint saw it (``CheckpointMeta.file_tags``);
    None where the identity is unverified. A rank checks the shards it read against it
    at the end of its run."""
    fence: int = 0
    """The fencing token of the lease this run holds (``identities.Fence``; 0: none)."""
    fingerprint: str = ""
    """Identity of the checkpoint as read (``mxload.orchestrator.runtime.catalog.fingerprint``).
    Every unit records (version, fingerprint) of the run that wrote it; "" (unknown) never
    matches, so a unit is never skipped on the word of a source that cannot say what it is."""


@dataclass(frozen=True)
class PeerUnit:
    """Where a shared unit's bytes are (``mxload.orchestrator.plan.sharing``): published by rank
    ``owner`` as one handle per file, in the order the unit's reads group by file."""

    owner: int
    fetch_bytes: int
    """Bytes the owner requested from storage for the unit (what ``bytes_read`` counts)."""
    handles: tuple[tuple[str, Any], ...]
    """(file, handle) per file; ``peer_get(handle)`` gives the bytes (a uint8 buffer)."""


@dataclass(frozen=True)
class RankJob:
    """One rank's load or reload: every buffer filled from ``source``, each unit
    recording the identity ``(version, source.fingerprint)`` (docs/contract.md §4)."""

    reads: tuple[UnitReads, ...]
    """Per unit, its byte ranges in ``source``."""
    source: SourceInfo
    version: int
    staging_budget: int
    """Bytes of staging the rank's run may hold (the plan's estimate was made for it)."""
    whole_units: bool = False
    """A reload: every unit converted whole before it is written."""
    units: tuple[Unit, ...] | None = None
    """A reload's units: the plan's, with the new source's quantized flags (None: the
    plan's own)."""
    peers: Mapping[int, PeerUnit] = field(default_factory=dict)
    """Unit index -> where another rank published that unit's bytes (read once per
    cluster); a unit converted in row chunks is read from storage all the same."""
