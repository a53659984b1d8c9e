"""One refit step on the wire: a trainer rank sends, an engine rank receives.

Per (sender, receiver) link, in order: one header (step, the step the delta is taken
against, manifest hash, plan digest, and which tensors changed), then the link's buckets
(``mxload.orchestrator.plan.refit.buckets``: the pieces of unchanged tensors left out).
A receiver takes every link on its own thread, into its receive area, and checks every
header before the first bucket; nothing is written into the engine's buffers here (the
loader does that once every byte has arrived). A sender that dies or stops is named with
the bucket it owed (docs/contract.md §4 "Refit").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ...orchestrator.errors import MxloadError, ReloadMismatch, RunError
from ...orchestrator.plan.refit import Piece, RefitPlan, buckets, unchanged_files
from .transports import Transport
from .wire import LocalBytes, ReceiveArea, pack

MAGIC = 0x6D786C6F6164  # "mxload"
HEAD_WORDS = 8


def _hash_int(text: str) -> int:
    return int(text[:15], 16) if text else 0


def plan_tensors(plan: RefitPlan) -> list[str]:
    """The trainer tensors of a plan, in the order of the changed flags."""
    return list(dict.fromkeys(f.tensor for f in plan.files))


def header(
    plan: RefitPlan, sender: int, step: int, delta_of: int | None, flags: list[bool]
) -> torch.Tensor:
    words = torch.tensor(
        [
            MAGIC,
            step,
            -1 if delta_of is None else delta_of,
            _hash_int(plan.manifest_hash),
            _hash_int(plan.digest),
            sender,
            len(flags),
            0,
        ],
        dtype=torch.int64,
    )
    return torch.cat([words.view(torch.uint8), torch.tensor(flags, dtype=torch.uint8)])


@dataclass
class SendStats:
    bytes_sent: int = 0
    buckets: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0
    convert_seconds: float = 0.0


class Sender:
    """A trainer rank's side of every link it has (``plan.links_of_sender``)."""

    def __init__(self, plan: RefitPlan, rank: int, transport: Transport, backend: Any) -> None:
        self.plan = plan
        self.rank = rank
        self.transport = transport
        self.backend = backend
        self.tensors = plan_tensors(plan)
        self.files = plan.file_info()
        # Two buckets of staging, allocated once: what this rank holds beyond its params.
        self.bufs = [torch.empty(plan.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        self.last = SendStats()

    def send(
        self,
        params: Mapping[str, torch.Tensor],
        step: int,
        *,
        delta_of: int | None = None,
        changed: Collection[str] | None = None,
    ) -> SendStats:
        """Send this rank's slices of ``params`` (trainer name -> local shard) to every
        receiver; ``changed``: the tensors changed since ``delta_of`` (None: all)."""
        stats = SendStats()
        t0 = time.perf_counter()
        flags = [changed is None or t in changed for t in self.tensors]
        if delta_of is None:
            flags = [True] * len(flags)
        skip = unchanged_files(self.plan, dict(zip(self.tensors, flags, strict=True)))
        local = LocalBytes(self.files, params, self.backend, self.rank)
        head = header(self.plan, self.rank, step, delta_of, flags)
        for link in self.plan.links_of_sender(self.rank):
            peer = self.plan.senders + link.receiver
            todo = buckets(link.pieces, self.plan.bucket_bytes, skip)
            b = -1
            try:
                self.transport.send(peer, head)
                for b, pieces in enumerate(todo):
                    buf = self.bufs[b % 2]
                    tp = time.perf_counter()
                    n = pack(pieces, local, buf)
                    stats.pack_seconds += time.perf_counter() - tp
                    self.transport.send(peer, buf[:n])
                    stats.bytes_sent += n
                    stats.buckets += 1
            except MxloadError:
                raise
            except Exception as err:
                what = "the header" if b < 0 else f"bucket {b} of {len(todo)}"
                raise RunError(
                    f"trainer rank {self.rank}: sending {what} of step {step} to engine rank "
                    f"{link.receiver} failed: {type(err).__name__}: {err}",
                    rank=self.rank,
                ) from err
        stats.seconds = time.perf_counter() - t0
        self.last = stats
        return stats


@dataclass
class Received:
    """What one receive brought: which tensors changed, and the bytes."""

    changed: dict[str, bool]
    bytes_received: int = 0
    seconds: float = 0.0
    per_sender: dict[int, int] = field(default_factory=dict)


class Receiver:
    """An engine rank's side of every link it has, into its receive area."""

    def __init__(self, plan: RefitPlan, rank: int, transport: Transport) -> None:
        self.plan = plan
        self.rank = rank
        self.transport = transport
        self.area = ReceiveArea(plan, rank)
        self.tensors = plan_tensors(plan)
        self.links = plan.links_of_receiver(rank)
        self._scratch = {
            k.sender: torch.empty(plan.bucket_bytes, dtype=torch.uint8) for k in self.links
        }
        self._lock = threading.Lock()

    def receive(self, step: int, *, delta_of: int | None = None) -> Received:
        """Every link's header and buckets of ``step``; RunError naming the trainer rank
        and bucket that did not arrive, ReloadMismatch for a header of another step,
        delta, manifest or plan."""
        t0 = time.perf_counter()
        flags: dict[int, list[bool]] = {}
        got: dict[int, int] = {}
        if not self.links:
            return Received(dict.fromkeys(self.tensors, True))
        with ThreadPoolExecutor(
            max_workers=len(self.links), thread_name_prefix=f"mxload-refit-{self.rank}"
        ) as pool:
            futures = [
                pool.submit(self._link, k.sender, k.pieces, step, delta_of) for k in self.links
            ]
            errors = []
            for k, fut in zip(self.links, futures, strict=True):
                try:
                    flags[k.sender], got[k.sender] = fut.result()
                except BaseException as err:
                    errors.append(err)
            if errors:
                raise errors[0]
        first = next(iter(flags.values()))
        if any(f != first for f in flags.values()):
            raise ReloadMismatch(
                f"engine rank {self.rank}: the trainer ranks disagree on which tensors "
                f"changed since step {delta_of}; nothing was written",
                rank=self.rank,
            )
        return Received(
            dict(zip(self.tensors, first, strict=True)),
            bytes_received=sum(got.values()),
            seconds=time.perf_counter() - t0,
            per_sender=got,
        )

    def _link(
        self, sender: int, pieces: tuple[Piece, ...], step: int, delta_of: int | None
    ) -> tuple[list[bool], int]:
        n = len(self.tensors)
        head = torch.empty(HEAD_WORDS * 8 + n, dtype=torch.uint8)
        where = f"engine rank {self.rank}: trainer rank {sender}"
        try:
            self.transport.recv(sender, head)
        except Exception as err:
            raise RunError(
                f"{where} sent no header for step {step} (died, stopped or never joined): "
                f"{type(err).__name__}: {err}",
                rank=self.rank,
            ) from err
        words = head[: HEAD_WORDS * 8].view(torch.int64).tolist()
        want = [MAGIC, step, -1 if delta_of is None else delta_of]
        want += [_hash_int(self.plan.manifest_hash), _hash_int(self.plan.digest), sender, n]
        if words[:7] != want:
            names = ["magic", "step", "delta_of", "manifest hash", "plan digest", "rank", "tensors"]
            diff = [
                f"{a} {x} (expected {y})"
                for a, x, y in zip(names, words[:7], want, strict=True)
                if x != y
            ]
            raise ReloadMismatch(
                f"{where} sent {', '.join(diff)}; nothing was written",
                rank=self.rank,
            )
        flags = [bool(x) for x in head[HEAD_WORDS * 8 :].tolist()]
        skip = unchanged_files(self.plan, dict(zip(self.tensors, flags, strict=True)))
        todo = buckets(pieces, self.plan.bucket_bytes, skip)
        total = 0
        for b, bucket in enumerate(todo):
            size = sum(p.nbytes for p in bucket)
            first = bucket[0].dst
            direct = all(
                p.dst == first + off for p, off in zip(bucket, _offsets(bucket), strict=True)
            )
            buf = self.area.tensor[first : first + size] if direct else self._scratch[sender][:size]
            try:
                self.transport.recv(sender, buf)
            except Exception as err:
                raise RunError(
                    f"{where} died or stopped during bucket {b} of {len(todo)} of step "
                    f"{step}: {type(err).__name__}: {err}",
                    rank=self.rank,
                ) from err
            if not direct:
                self.area.scatter(bucket, buf)
            total += size
        return flags, total


def _offsets(bucket: tuple[Piece, ...]) -> list[int]:
    out, at = [], 0
    for p in bucket:
        out.append(at)
        at += p.nbytes
    return out
