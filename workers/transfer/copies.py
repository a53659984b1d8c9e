"""The node fan-out of a refit: engine ranks of one node that hold the same buffers take
them from the first of them (``plan.refit.NodeCopy``), so their pieces cross to the node
once.

The copies run beside the transfer. A giving rank has one thread per rank it gives to:
it sends a header (step, plan digest, the two ranks, the bytes), then each buffer as
soon as its own loader has written it, in messages of at most a bucket, and, once its
own update is whole (every trailer checked), a confirmation. A taking rank has one
thread per rank it takes from, writing the buffers in place as they come; its update
ends once every confirmation is in, so it never reports a step its giver failed. No
stage of the transfer waits on a copy (a taker writes straight into its buffers, through
no ring), and a giver's thread waits only on its own loader and its taker: the copies
add no cycle to the transfer's waits. A giver that fails is named by the ranks waiting
on it (docs/contract.md §4 "Refit").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...orchestrator.errors import ReloadMismatch, RunError
from ...orchestrator.plan.refit import NodeCopy, RefitPlan
from ...orchestrator.plan.types import Unit
from .transports import Transport

MAGIC = 0x6D78636F7079  # "mxcopy"
DONE = 0x6D78646F6E65  # "mxdone"
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
    """One engine rank's copies, what it takes and what it gives, held between updates
    (:meth:`start` one update, :meth:`finish` it)."""

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
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[int]] = []
        self._whole = threading.Event()
        self._stop = threading.Event()

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

    def start(
        self,
        step: int,
        buffers: Mapping[str, torch.Tensor],
        changed: Callable[[Unit], bool],
        check: Callable[[], None],
        written: Callable[[Sequence[int]], bool],
        synchronize: Callable[[], None],
    ) -> None:
        """Start taking and giving step ``step`` (``buffers``: the rank's, by name):
        ``check`` before each buffer taken is written (the fence); ``written(units)``:
        whether the rank's loader has written those of its units this update, each
        buffer given once they are (``synchronize`` first: a device's writes are
        queued)."""
        self._whole = threading.Event()
        self._stop = threading.Event()
        self._futures = []
        if not self.into and not self.out:
            return
        self._pool = ThreadPoolExecutor(
            max_workers=len(self.into) + len(self.out),
            thread_name_prefix=f"mxload-copy-{self.rank}",
        )
        for c in self.into:
            names = self._sent(c, changed)
            self._futures.append(self._pool.submit(self._take, c, step, buffers, names, check))
        for c in self.out:
            names = self._sent(c, changed)
            self._futures.append(
                self._pool.submit(self._give, c, step, buffers, names, written, synchronize)
            )

    def finish(self) -> int:
        """This rank's own update is whole: confirm it to the ranks it gives to, and
        wait for every copy; the first copy's error. Returns the bytes taken."""
        self._whole.set()
        errors: list[BaseException] = []
        taken = 0
        for i, fut in enumerate(self._futures):
            try:
                got = fut.result()
            except BaseException as err:
                errors.append(err)
                continue
            if i < len(self.into):
                taken += got
        self._close()
        if errors:
            raise errors[0]
        return taken

    def halt(self) -> None:
        """The update failed here: give nothing more, confirm nothing (:meth:`stop`
        waits for the threads once the transport is closed)."""
        self._stop.set()
        self._whole.set()

    def stop(self) -> None:
        """:meth:`halt`, then wait for the threads (a wait on the transport ends once it
        is closed, or times out)."""
        self.halt()
        self._close()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _tensors(
        self, buffers: Mapping[str, torch.Tensor], names: Sequence[str]
    ) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name in names:
            for n in (name, name + "_scale"):
                if n in buffers:
                    out.append((n, raw_bytes(buffers[n])))
        return out

    def _head(self, c: NodeCopy, step: int, nbytes: int) -> torch.Tensor:
        words = [MAGIC, step, self.digest, c.source, c.receiver, nbytes]
        return torch.tensor(words, dtype=torch.int64).view(torch.uint8)

    def _give(
        self,
        c: NodeCopy,
        step: int,
        buffers: Mapping[str, torch.Tensor],
        names: Sequence[str],
        written: Callable[[Sequence[int]], bool],
        synchronize: Callable[[], None],
    ) -> int:
        peer = self.senders + c.receiver
        where = f"engine rank {self.rank}: giving engine rank {c.receiver} its copy of step {step}"
        mine = {name: [i for i, u in enumerate(self.units) if u.buffer == name] for name in names}
        parts = self._tensors(buffers, names)
        try:
            self.transport.send(peer, self._head(c, step, sum(p.numel() for _, p in parts)))
            for name in names:
                pause = 0.0
                while not written(mine[name]):
                    if self._stop.is_set():
                        return 0
                    pause = min(0.005, pause + 0.0002)
                    time.sleep(pause)
                synchronize()
                for n, p in parts:
                    if n.removesuffix("_scale") != name:
                        continue
                    for at in range(0, p.numel(), self.chunk):
                        self.transport.send(peer, p[at : at + self.chunk])
            self._whole.wait()
            if self._stop.is_set():
                return 0
            done = torch.tensor([DONE, step], dtype=torch.int64).view(torch.uint8)
            self.transport.send(peer, done)
        except Exception as err:
            raise RunError(f"{where}: {type(err).__name__}: {err}", rank=self.rank) from err
        return 0

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
        nbytes = sum(p.numel() for _, p in parts)
        if not torch.equal(head, self._head(c, step, nbytes)):
            got = head.view(torch.int64).tolist()
            raise ReloadMismatch(
                f"{where} gave a copy of {got[5]} bytes for step {got[1]} (expected {nbytes} "
                f"bytes for step {step}): the two ranks planned the update differently",
                rank=self.rank,
            )
        for name, p in parts:
            check()
            for at in range(0, p.numel(), self.chunk):
                self._recv(
                    peer,
                    p[at : at + self.chunk],
                    f"{where} failed, died or stopped during its copy of {name} of step {step}",
                )
        done = torch.empty(16, dtype=torch.uint8)
        self._recv(peer, done, f"{where} did not end step {step} whole (failed, died or stopped)")
        if done.view(torch.int64).tolist() != [DONE, step]:
            raise ReloadMismatch(f"{where} ended its copy of step {step} out of order")
        return nbytes

    def _recv(self, peer: int, buf: torch.Tensor, failed: str) -> None:
        if self._stop.is_set():
            raise RunError(f"engine rank {self.rank}: the update failed here", rank=self.rank)
        try:
            self.transport.recv(peer, buf)
        except Exception as err:
            raise RunError(f"{failed}: {type(err).__name__}: {err}", rank=self.rank) from err
