"""One engine rank's side of a refit, held between updates, in whatever process hosts the
rank (an engine worker, a Ray actor): its transport and its receive area are made once.

Before each update's writes it receives the rank's bytes (``exchange.Receiver``),
records the step it is bringing the rank to (until written, status lists every unit not
at it), and re-stamps the units a delta leaves unchanged; the loader then reads the bytes
from the area (:meth:`RankRefit.prepare` returns the storage). A receive that fails
part-way breaks the group: bytes of that step may still be on the links, so no update
goes through it until it is formed again, and this rank leaves it at once, so a sender
that was stopped past the wait is told its send failed when it resumes (docs/contract.md
§4 "Refit").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...orchestrator.errors import RunError
from ...orchestrator.plan.refit import RefitPlan
from ...orchestrator.plan.types import UnitReads
from .exchange import Received, Receiver
from .transports import Transport, make_transport
from .wire import AreaStorage


@dataclass(frozen=True)
class TransportSpec:
    """How one member joins its refit group (picklable: sent to a Ray actor)."""

    kind: str
    addresses: tuple[str, ...]
    member: int
    senders: int
    size: int
    group: str
    timeout_s: float
    bucket_bytes: int

    def make(self) -> Transport:
        return make_transport(
            self.kind,
            addresses=self.addresses,
            member=self.member,
            senders=self.senders,
            size=self.size,
            group=self.group,
            timeout_s=self.timeout_s,
            bucket_bytes=self.bucket_bytes,
        )


class RankRefit:
    """An engine rank's receiver (joins the group on construction: waits for the others)."""

    def __init__(
        self,
        plan: RefitPlan,
        rank: int,
        spec: TransportSpec,
        itemsize: Mapping[str, int],
        row_bytes: Mapping[str, int],
    ) -> None:
        self.rank = rank
        self.receiver = Receiver(plan, rank, spec.make(), itemsize, row_bytes)
        self.broken = ""
        self.last: Received | None = None

    def prepare(
        self,
        loader: Any,
        reads: Sequence[UnitReads],
        fingerprint: str,
        step: int,
        delta_of: int | None,
    ) -> AreaStorage:
        """Receive step ``step`` into the area and re-stamp what a delta leaves unchanged
        (``loader``: the rank's ``RankLoader``); the storage its reload reads from."""
        loader.begin((step, fingerprint))
        if self.broken:
            raise RunError(
                f"engine rank {self.rank}: the refit group broke ({self.broken}); "
                "initialise the weight transfer again (the trainer form) before the next "
                "update",
                rank=self.rank,
            )
        try:
            got = self.receiver.receive(step, delta_of=delta_of)
        except BaseException as err:
            self.broken = f"step {step}: {err}"[:300]
            # Leave the group now: a sender that was only stopped (past the wait) finds
            # its sends failing when it resumes, instead of handing bytes to nobody.
            self.receiver.transport.close()
            raise
        self.last = got
        if delta_of is not None:
            same = [all(not got.changed.get(pr.file, True) for pr in r.parts) for r in reads]
            loader.restamp(same, (delta_of, fingerprint), (step, fingerprint))
        return self.receiver.area.storage()

    def close(self) -> None:
        self.receiver.transport.close()
