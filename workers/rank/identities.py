"""What a rank's buffers hold: per unit, the identity of the run that last wrote it whole,
and the reports built from it (docs/contract.md §4 "Reload": an incomplete reload says
so), plus the documented buffer checksum.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ...orchestrator.errors import FencedOff
from ...orchestrator.plan.types import Unit

Identity = tuple[int, str]
"""(version number, checkpoint fingerprint): what a unit holds."""

NOTHING: Identity = (0, "")
"""A unit never written, or one whose write was cut part-way (it holds no one version)."""

CHECKSUM_NAME = "blake2b-128"
"""Checksum of a buffer: BLAKE2b with a 16-byte digest over its bytes in row-major order
(device buffers are copied to the host first), as lowercase hex. Same on every rank."""


def checksum(t: torch.Tensor) -> str:
    """The documented buffer checksum (see CHECKSUM_NAME)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    h = hashlib.blake2b(digest_size=16)
    if flat.numel():
        h.update(flat.numpy().data)
    return h.hexdigest()


class UnitIdentities:
    """The identity each unit of a plan holds, and the identity the latest run (finished
    or not) was writing. ``buffers``: every buffer's name (scale buffers included)."""

    def __init__(self, units: Sequence[Unit], buffers: Iterable[str]) -> None:
        self.units = units
        self.buffers = list(buffers)
        self._names = set(self.buffers)
        self.ids: list[Identity] = [NOTHING] * len(units)
        self.target: Identity = NOTHING

    @property
    def versions(self) -> list[int]:
        return [v for v, _ in self.ids]

    @property
    def version(self) -> int:
        return min(self.versions) if self.ids else self.target[0]

    @property
    def identity(self) -> Identity | None:
        """The one identity every unit holds; None when units differ (or none is loaded)."""
        ids = set(self.ids) or {self.target}
        only = next(iter(ids))
        return only if len(ids) == 1 and only != NOTHING else None

    @property
    def consistent(self) -> bool:
        """Every unit holds one identity: same version number *and* same checkpoint."""
        return len(set(self.ids)) <= 1

    def by_buffer(self) -> dict[str, Identity | None]:
        """Per buffer, the identity all its units hold (None: its units differ)."""
        seen: dict[str, set[Identity]] = {}
        for unit, ident in zip(self.units, self.ids, strict=True):
            seen.setdefault(unit.buffer, set()).add(ident)
            if unit.buffer + "_scale" in self._names:
                seen.setdefault(unit.buffer + "_scale", set()).add(ident)
            for d in unit.derived:  # recomputed with the unit, so at its identity
                seen.setdefault(d.buffer, set()).add(ident)
        out: dict[str, Identity | None] = {}
        for name in self.buffers:
            ids = seen.get(name, {self.identity or NOTHING})
            out[name] = next(iter(ids)) if len(ids) == 1 else None
        return out

    def versions_by_buffer(self) -> dict[str, int]:
        """Per buffer, the lowest version any of its units holds."""
        out: dict[str, int] = {}
        for unit, v in zip(self.units, self.versions, strict=True):
            out[unit.buffer] = min(out.get(unit.buffer, v), v)
            if unit.buffer + "_scale" in self._names:
                out[unit.buffer + "_scale"] = out[unit.buffer]
            for d in unit.derived:
                out[d.buffer] = out[unit.buffer]
        for name in self.buffers:
            out.setdefault(name, self.version)
        return out

    def status(self) -> dict[str, Any]:
        """Which units hold which version; stale units: not at what the latest run was
        writing (an interrupted reload's leftovers)."""
        by_version = Counter(self.versions)
        by_identity = Counter(f"{v}:{fp}" for v, fp in self.ids)
        blocks = Counter(u.buffer for u in self.units if u.expert < 0)

        def label(u: Unit) -> str:
            if u.expert >= 0:
                return f"{u.buffer}[{u.expert}]"
            if blocks[u.buffer] > 1:  # a vocab buffer cut into row blocks
                return f"{u.buffer}[rows {u.row0}:{u.row0 + u.rows}]"
            return u.buffer

        stale = [
            label(u) for u, ident in zip(self.units, self.ids, strict=True) if ident != self.target
        ]
        ident = self.identity
        return {
            "version": self.version,
            "consistent": self.consistent,
            "identity": list(ident) if ident is not None else None,
            "target": list(self.target),
            "units_by_version": {str(k): n for k, n in sorted(by_version.items())},
            "units_by_identity": dict(sorted(by_identity.items())),
            "stale_units": stale[:50],
            "stale_count": len(stale),
        }


class Fence:
    """The highest fencing token this rank has seen (docs/contract.md §4 "Reload"): each
    lease on a detached session comes with a larger one, and a run carrying a smaller
    one writes nothing more, checked before every unit's writes. So a reload that was
    suspended past its lease (Ctrl-Z, a debugger, a stalled node) cannot come back and
    write older weights over a later reload's. Token 0: an unfenced run (in-process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest = 0

    def advance(self, token: int) -> int:
        """Raise the fence to ``token`` (never lowers it); the fence now."""
        with self._lock:
            self.highest = max(self.highest, int(token))
            return self.highest

    def check(self, token: int, rank: int) -> None:
        """FencedOff when a run with ``token`` has been fenced off."""
        if token and token < self.highest:
            raise FencedOff(
                f"rank {rank}: this reload was fenced off: its lease on the session (token "
                f"{token}) lapsed and a later command (token {self.highest}) took the "
                "session; it writes nothing more (run `mxload status`)",
                rank=rank,
            )
