"""One engine rank's side of a refit, held between updates, in whatever process hosts the
rank (an engine worker, a Ray actor): its transport and its receive area are made once.

Before each update's writes it checks every link's header (``exchange.Receiver``),
records the step it is bringing the rank to (until written, status lists every unit not
at it), and re-stamps the units a delta leaves unchanged; the loader then reads the bytes
from the receive ring as they land (:meth:`RankRefit.prepare` returns the storage), and
its run ends once every link's trailer is checked; then the rank takes the buffers it
copies from another rank of its node, and gives those that others copy from it
(``copies.NodeCopies``). A receive that fails part-way breaks
the group: bytes of that step may still be on the links, so no update
goes through it until it is formed again, and this rank leaves it at once, so a sender
that was stopped past the wait is told its send failed when it resumes (docs/contract.md
§4 "Refit").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...orchestrator.errors import ReloadMismatch, RunError
from ...orchestrator.plan.refit import RefitPlan
from ...orchestrator.plan.types import Unit, UnitReads
from .copies import NodeCopies
from .exchange import Received, Receiver
from .transports import Transport, make_transport
from .wire import SCALE_SUFFIX, AreaStorage


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
    """An engine rank's receiver (joins the group on construction: waits for the others).
    ``units``: the rank's units, in its loader's order (its receive ring's order)."""

    def __init__(
        self,
        plan: RefitPlan,
        rank: int,
        spec: TransportSpec,
        itemsize: Mapping[str, int],
        row_bytes: Mapping[str, int],
        units: Sequence[Unit],
    ) -> None:
        self.rank = rank
        transport = spec.make()
        self.receiver = Receiver(
            plan, rank, transport, itemsize, row_bytes, units, timeout_s=spec.timeout_s
        )
        self.copies = NodeCopies(plan, rank, units, transport, spec.senders, spec.bucket_bytes)
        self.broken = ""
        self.last: Received | None = None
        self.copied_bytes = 0
        """Bytes the last update copied into this rank from others of its node."""

    def prepare(
        self,
        loader: Any,
        reads: Sequence[UnitReads],
        fingerprint: str,
        step: int,
        delta_of: int | None,
    ) -> AreaStorage:
        """Start receiving step ``step`` into the area (every header checked) and re-stamp
        what a delta leaves unchanged (``loader``: the rank's ``RankLoader``); the
        storage its reload reads from while the rest arrives, whose ``finish`` (at the
        end of the loader's run) waits for every link's trailer."""
        self.last = None
        self.copied_bytes = 0
        if self.broken:
            raise RunError(
                f"engine rank {self.rank}: the refit group broke ({self.broken}); "
                "initialise the weight transfer again (the trainer form) before the next "
                "update",
                rank=self.rank,
            )
        try:
            changed = self.receiver.start(step, delta_of=delta_of)
        except ReloadMismatch as err:
            # refused at a header (another step, manifest, plan or landing): nothing was
            # written here, and every unit says it holds what it held
            self._broke(step, err)
            raise
        except BaseException as err:
            # a trainer rank that sent no header failed an update other ranks may be
            # writing: this rank is not at a step either (docs/contract.md §4 "Refit")
            loader.begin((step, fingerprint))
            self._broke(step, err)
            raise
        loader.begin((step, fingerprint))
        if delta_of is not None:
            same = [all(not changed.get(_tensor(pr.file), True) for pr in r.parts) for r in reads]
            try:
                loader.restamp(same, (delta_of, fingerprint), (step, fingerprint))
            except BaseException as err:
                self._broke(step, err)
                raise

        def finish() -> None:
            try:
                self.last = self.receiver.finish()
            except BaseException as err:
                self._broke(step, err)
                raise

        def sent(unit: Unit) -> bool:
            return any(changed.get(p.tensor_name, True) for p in unit.parts)

        def start_copies(
            buffers: Mapping[str, torch.Tensor],
            check: Callable[[], None],
            written: Callable[[Sequence[int]], bool],
            synchronize: Callable[[], None],
        ) -> None:
            self.copies.start(step, buffers, sent, check, written, synchronize)

        def finish_copies() -> None:
            try:
                self.copied_bytes = self.copies.finish()
            except BaseException as err:
                self._broke(step, err)
                raise

        return AreaStorage(
            self.receiver.area,
            finish=finish,
            abort=lambda err: self._broke(step, err),
            planned_bytes=self.receiver.planned_bytes,
            held_bytes=self.receiver.held_bytes,
            copied_units=self.copies.units_taken(sent),
            copies=(start_copies, finish_copies),
        )

    def _broke(self, step: int, err: BaseException) -> None:
        # Leave the group now: a sender that was only stopped (past the wait) finds its
        # sends failing when it resumes, instead of handing bytes to nobody.
        if not self.broken:
            self.broken = f"step {step}: {err}"[:300]
        self.copies.halt()
        self.receiver.stop(err)  # the transport closed: the copies' waits end
        self.copies.stop()

    def close(self) -> None:
        self.receiver.transport.close()


def _tensor(file: str) -> str:
    """The trainer tensor a wire file carries (an MXFP8 scale file: its tensor's)."""
    return file[: -len(SCALE_SUFFIX)] if file.endswith(SCALE_SUFFIX) else file
