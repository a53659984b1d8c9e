"""The node fan-out of a refit: engine ranks of one node that hold the same buffers take
them from the first of them (``plan.refit.NodeCopy``), so their pieces cross to the node
once.

Once an engine rank's own update is whole (every link's trailer checked), it first takes
the buffers it copies, source by source in rank order, then gives the buffers it is the
source of, receiver by receiver in rank order. Each copy is one header (step, plan
digest, the two ranks, its bytes), then its buffers' bytes as they are, in messages of at
most a bucket. A rank only ever waits on ranks before it in its node's order, and those
have nothing left to wait on before they give: the copies cannot deadlock. A rank that
fails before it gives is named by the ranks waiting on it (docs/contract.md §4 "Refit").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ...orchestrator.errors import ReloadMismatch, RunError
from ...orchestrator.plan.refit import NodeCopy, RefitPlan
from ...orchestrator.plan.types import Unit
from .transports import Transport

MAGIC = 0x6D78636F7079  # "mxcopy"
HEAD_WORDS = 6


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as flat uint8, in its storage's order (a buffer the engine reads
    as a transposed view is copied as the storage it views)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride()[d])
    flat = t.permute(*order)
    if not flat.is_contiguous():
        raise RunError(f"a buffer of shape {list(t.shape)} does not cover one dense block")
    return flat.reshape(-1).view(torch.uint8)


class NodeCopies:
    """One engine rank's copies of one update: what it takes and what it gives."""

    def __init__(
        self,
        plan: RefitPlan,
        rank: int,
        units: Sequence[Unit],
        transport: Transport,
        senders: int,
        chunk_bytes: int,
    ) -> None:
        self.rank = rank
        self.into = plan.copies_into(rank)
        self.out = plan.copies_from(rank)
        self.units = units
        self.transport = transport
        self.senders = senders
        """Trainer ranks in the group: engine rank ``r`` is member ``senders + r``."""
        self.chunk = chunk_bytes
        self.digest = int(plan.digest[:15], 16) if plan.digest else 0

    def units_taken(self, changed: Callable[[Unit], bool]) -> tuple[int, ...]:
        """The rank's units this update copies from others of its node: every unit of a
        copied buffer, when any of them reads a tensor the update sends."""
        out: list[int] = []
        for c in self.into:
            for name in self._sent(c, changed):
                out.extend(i for i in c.units if self.units[i].buffer == name)
        return tuple(sorted(out))

    def _sent(self, c: NodeCopy, changed: Callable[[Unit], bool]) -> list[str]:
        """The buffers of ``c`` this update moves (both ends compute the same: the
        buffers' units are equal on both)."""
        hot = {u.buffer for u in self.units if changed(u)}
        return [name for name in c.buffers if name in hot]

    def run(
        self,
        step: int,
        buffers: Mapping[str, torch.Tensor],
        changed: Callable[[Unit], bool],
        check: Callable[[], None],
    ) -> int:
        """Take, then give (``buffers``: the rank's, by name); ``check`` before each
        buffer written (the fence). Returns the bytes taken."""
        taken = 0
        for c in self.into:
            taken += self._take(c, step, buffers, self._sent(c, changed), check)
        for c in self.out:
            self._give(c, step, buffers, self._sent(c, changed))
        return taken

    def _tensors(
        self, buffers: Mapping[str, torch.Tensor], names: Sequence[str]
    ) -> list[torch.Tensor]:
        out = []
        for name in names:
            out.append(raw_bytes(buffers[name]))
            scale = buffers.get(name + "_scale")
            if scale is not None:
                out.append(raw_bytes(scale))
        return out

    def _head(self, c: NodeCopy, step: int, nbytes: int) -> torch.Tensor:
        words = [MAGIC, step, self.digest, c.source, c.receiver, nbytes]
        return torch.tensor(words, dtype=torch.int64).view(torch.uint8)

    def _give(
        self, c: NodeCopy, step: int, buffers: Mapping[str, torch.Tensor], names: Sequence[str]
    ) -> None:
        parts = self._tensors(buffers, names)
        peer = self.senders + c.receiver
        where = f"engine rank {self.rank}: giving engine rank {c.receiver} its copy of step {step}"
        try:
            self.transport.send(peer, self._head(c, step, sum(p.numel() for p in parts)))
            for p in parts:
                for at in range(0, p.numel(), self.chunk):
                    self.transport.send(peer, p[at : at + self.chunk])
        except Exception as err:
            raise RunError(f"{where}: {type(err).__name__}: {err}", rank=self.rank) from err

    def _take(
        self,
        c: NodeCopy,
        step: int,
        buffers: Mapping[str, torch.Tensor],
        names: Sequence[str],
        check: Callable[[], None],
    ) -> int:
        parts = self._tensors(buffers, names)
        peer = self.senders + c.source
        where = f"engine rank {self.rank}: engine rank {c.source}"
        head = torch.empty(HEAD_WORDS * 8, dtype=torch.uint8)
        self._recv(peer, head, f"{where} gave no copy of step {step} (failed, died or stopped)")
        want = self._head(c, step, sum(p.numel() for p in parts))
        if not torch.equal(head, want):
            got = head.view(torch.int64).tolist()
            raise ReloadMismatch(
                f"{where} gave a copy of {got[5]} bytes for step {got[1]} (expected "
                f"{sum(p.numel() for p in parts)} bytes for step {step}): the two ranks "
                "planned the update differently",
                rank=self.rank,
            )
        for name, p in zip(self._names(names, buffers), parts, strict=True):
            check()
            for at in range(0, p.numel(), self.chunk):
                self._recv(
                    peer,
                    p[at : at + self.chunk],
                    f"{where} stopped during its copy of {name} of step {step}",
                )
        return sum(p.numel() for p in parts)

    @staticmethod
    def _names(names: Sequence[str], buffers: Mapping[str, torch.Tensor]) -> list[str]:
        out = []
        for name in names:
            out.append(name)
            if name + "_scale" in buffers:
                out.append(name + "_scale")
        return out

    def _recv(self, peer: int, buf: torch.Tensor, failed: str) -> None:
        try:
            self.transport.recv(peer, buf)
        except Exception as err:
            raise RunError(f"{failed}: {type(err).__name__}: {err}", rank=self.rank) from err
