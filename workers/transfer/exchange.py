"""One refit step on the wire: a trainer rank sends, an engine rank receives.

Per (sender, receiver) link, in order: one header (step, the step the delta is taken
against, manifest hash, plan digest, and which tensors changed), then the link's buckets
of the transfer plan (``mxload.orchestrator.plan.refit``), the transfers of unchanged
tensors left out, then one trailer, sent once every link's buckets are out: whether a
tensor the sender read changed while it sent (a trainer step taken during the update).
A receiver takes every link on its own thread, into its receive area, and checks every
header before the first bucket and every trailer after the last; nothing is written into
the engine's buffers here (the loader does that once every byte has arrived). A sender
that dies or stops is named with the bucket it owed, a tensor that changed with its
name, both failing the update the same way (docs/contract.md §4 "Refit").
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...orchestrator.errors import MxloadError, ReloadMismatch, RunError
from ...orchestrator.plan.refit import RefitPlan, Transfer
from .transports import Transport
from .wire import ReceiveArea, local_rect, pack

MAGIC = 0x6D786C6F6164  # "mxload"
HEAD_WORDS = 8
TRAILER_WORDS = 3

Bucket = tuple[Transfer, ...]


def _hash_int(text: str) -> int:
    return int(text[:15], 16) if text else 0


def plan_tensors(plan: RefitPlan) -> list[str]:
    """The trainer tensors a plan sends, in the order of the changed flags."""
    return sorted({t.tensor for b in plan.buckets for t in b.transfers})


def plan_digest(plan: RefitPlan) -> str:
    """What both sides check the other planned: every bucket and transfer."""
    h = hashlib.sha256()
    s = plan.summary
    h.update(f"{s.manifest_digest}|{s.convert_on}|{s.bucket_bytes}".encode())
    for b in plan.buckets:
        h.update(f"/{b.sender}>{b.receiver}#{b.index}".encode())
        for t in b.transfers:
            h.update(f"{t.tensor}{t.rows}{t.cols}{int(t.on_sender)};".encode())
    return h.hexdigest()[:15]


def link_buckets(plan: RefitPlan) -> dict[tuple[int, int], list[Bucket]]:
    """Per (sender, receiver) link, its buckets in the order the sender sends them."""
    out: dict[tuple[int, int], list[Bucket]] = {}
    for b in plan.buckets:
        out.setdefault((b.sender, b.receiver), []).append(b.transfers)
    return out


def _without(buckets: Sequence[Bucket], skip: Collection[str]) -> list[Bucket]:
    """The buckets with the transfers of unchanged tensors left out (empty ones too):
    both sides compute the same."""
    if not skip:
        return list(buckets)
    out = [tuple(t for t in b if t.tensor not in skip) for b in buckets]
    return [b for b in out if b]


def header(
    digest: str, manifest_hash: str, sender: int, step: int, delta_of: int | None, flags: list[bool]
) -> torch.Tensor:
    words = torch.tensor(
        [
            MAGIC,
            step,
            -1 if delta_of is None else delta_of,
            _hash_int(manifest_hash),
            _hash_int(digest),
            sender,
            len(flags),
            0,
        ],
        dtype=torch.int64,
    )
    return torch.cat([words.view(torch.uint8), torch.tensor(flags, dtype=torch.uint8)])


def trailer(step: int, changed: int) -> torch.Tensor:
    """The last message of a link: ``changed`` is the index (in ``plan_tensors``) of a
    tensor the sender found written during the send, -1 when none was."""
    return torch.tensor([MAGIC, step, changed], dtype=torch.int64).view(torch.uint8)


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    # torch bumps ``_version`` on every in-place write (an optimizer step's ``add_``)
    # to the tensor or a view of it; ``data_ptr`` moves when the parameter is rebound.
    return t._version, t.data_ptr()


@dataclass
class SendStats:
    bytes_sent: int = 0
    buckets: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0


class Sender:
    """A trainer rank's side of every link it has."""

    def __init__(self, plan: RefitPlan, rank: int, transport: Transport, backend: Any) -> None:
        self.plan = plan
        self.rank = rank
        self.transport = transport
        self.backend = backend
        self.senders = len(plan.summary.sender_bytes)
        self.tensors = plan_tensors(plan)
        self.digest = plan_digest(plan)
        self.links = {k: v for k, v in link_buckets(plan).items() if k[0] == rank}
        # One bucket buffer, allocated once (each send returns once it may be reused): with
        # the row chunks of a conversion on the sender (``pack``), what this rank holds
        # beyond its params.
        size = max((sum(t.nbytes for t in b) for bs in self.links.values() for b in bs), default=0)
        self.buf = torch.empty(size, dtype=torch.uint8)
        self.last = SendStats()

    @contextmanager
    def _naming(self, step: int, receiver: int, buckets: int) -> Iterator[list[int]]:
        """Name the message of ``step`` to ``receiver`` whose send failed: the header
        (``where[0] == -1``), bucket ``where[0]``, or the trailer (-2)."""
        where = [-1]
        try:
            yield where
        except MxloadError:
            raise
        except Exception as err:
            b = where[0]
            what = {-1: "the header", -2: "the trailer"}.get(b, f"bucket {b} of {buckets}")
            raise RunError(
                f"trainer rank {self.rank}: sending {what} of step {step} to engine rank "
                f"{receiver} failed: {type(err).__name__}: {err}",
                rank=self.rank,
            ) from err

    def send(
        self,
        params: Mapping[str, torch.Tensor],
        step: int,
        *,
        delta_of: int | None = None,
        changed: Collection[str] | None = None,
    ) -> SendStats:
        """Send this rank's slices of ``params`` (checkpoint name -> local shard) to every
        receiver; ``changed``: the tensors changed since ``delta_of`` (None: all)."""
        stats = SendStats()
        t0 = time.perf_counter()
        if delta_of is None or changed is None:
            flags = [True] * len(self.tensors)
        else:
            flags = [t in changed for t in self.tensors]
        skip = {t for t, f in zip(self.tensors, flags, strict=True) if not f}
        local = local_rect(params, self.rank)
        head = header(
            self.digest, self.plan.summary.manifest_digest, self.rank, step, delta_of, flags
        )
        sent = [t for t in self.tensors if t not in skip and t in params]
        before = {t: _stamp(params[t]) for t in sent}
        links = sorted(self.links.items())
        for (_, receiver), buckets in links:
            todo = _without(buckets, skip)
            with self._naming(step, receiver, len(todo)) as where:
                self.transport.send(self.senders + receiver, head)
                for bucket in todo:
                    where[0] += 1
                    tp = time.perf_counter()
                    n = pack(bucket, local, self.buf, self.backend)
                    stats.pack_seconds += time.perf_counter() - tp
                    self.transport.send(self.senders + receiver, self.buf[:n])
                    stats.bytes_sent += n
                    stats.buckets += 1
        # Checked once every link's bytes are out, so that no engine rank writes a step
        # another rank got different bytes of (docs/contract.md §4 "Refit").
        moved = [t for t in sent if _stamp(params[t]) != before[t]]
        index = self.tensors.index(moved[0]) if moved else -1
        for (_, receiver), _todo in links:
            with self._naming(step, receiver, -1) as where:
                where[0] = -2
                self.transport.send(self.senders + receiver, trailer(step, index))
        if moved:
            raise RunError(
                f"trainer rank {self.rank}: tensor {moved[0]} changed while step {step} was "
                f"sent ({len(moved)} tensor(s) written during the send: a trainer step or "
                "another in-place write); the engine does not take the step; initialise the "
                "weight transfer again and send a step whose parameters stay still until "
                "send_weights returns",
                rank=self.rank,
            )
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
    """An engine rank's side of every link it has, into its receive area. ``itemsize``:
    per tensor, its trainer dtype's size; ``row_bytes``: per wire file, one row's bytes."""

    def __init__(
        self,
        plan: RefitPlan,
        rank: int,
        transport: Transport,
        itemsize: Mapping[str, int],
        row_bytes: Mapping[str, int],
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.transport = transport
        self.senders = len(plan.summary.sender_bytes)
        self.tensors = plan_tensors(plan)
        self.digest = plan_digest(plan)
        self.links = {k[0]: v for k, v in sorted(link_buckets(plan).items()) if k[1] == rank}
        order = [t for s in sorted(self.links) for b in self.links[s] for t in b]
        self.area = ReceiveArea(rank, order, itemsize, row_bytes)
        self.at = {id(t): off for t, off in zip(order, self.area.offsets, strict=True)}
        cap = plan.summary.bucket_bytes
        self._scratch = {s: torch.empty(cap, dtype=torch.uint8) for s in self.links}

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
            futures = {
                s: pool.submit(self._link, s, buckets, step, delta_of)
                for s, buckets in self.links.items()
            }
            errors = []
            for s, fut in futures.items():
                try:
                    flags[s], got[s] = fut.result()
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
        self, sender: int, buckets: list[Bucket], step: int, delta_of: int | None
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
        want += [_hash_int(self.plan.summary.manifest_digest), _hash_int(self.digest), sender, n]
        if words[:7] != want:
            names = ["magic", "step", "delta_of", "manifest hash", "plan digest", "rank", "tensors"]
            diff = [
                f"{a} {x} (expected {y})"
                for a, x, y in zip(names, words[:7], want, strict=True)
                if x != y
            ]
            raise ReloadMismatch(
                f"{where} sent {', '.join(diff)}; nothing was written", rank=self.rank
            )
        flags = [bool(x) for x in head[HEAD_WORDS * 8 :].tolist()]
        skip = {t for t, f in zip(self.tensors, flags, strict=True) if not f}
        todo = _without(buckets, skip)
        total = 0
        area = self.area.tensor
        for b, bucket in enumerate(todo):
            size = sum(t.nbytes for t in bucket)
            first = self.at[id(bucket[0])]
            offs = [self.at[id(t)] for t in bucket]
            direct = offs[-1] + bucket[-1].nbytes - first == size
            buf = area[first : first + size] if direct else self._scratch[sender][:size]
            try:
                self.transport.recv(sender, buf)
            except Exception as err:
                raise RunError(
                    f"{where} died or stopped during bucket {b} of {len(todo)} of step "
                    f"{step}: {type(err).__name__}: {err}",
                    rank=self.rank,
                ) from err
            if not direct:
                at = 0
                for t, off in zip(bucket, offs, strict=True):
                    area[off : off + t.nbytes].copy_(buf[at : at + t.nbytes])
                    at += t.nbytes
            total += size
        tail = torch.empty(TRAILER_WORDS * 8, dtype=torch.uint8)
        try:
            self.transport.recv(sender, tail)
        except Exception as err:
            raise RunError(
                f"{where} died or stopped after its last bucket of step {step}: "
                f"{type(err).__name__}: {err}",
                rank=self.rank,
            ) from err
        magic, got_step, changed = tail.view(torch.int64).tolist()
        if (magic, got_step) != (MAGIC, step):
            raise ReloadMismatch(
                f"{where} ended step {step} with a trailer of step {got_step}; nothing was written",
                rank=self.rank,
            )
        if changed >= 0:
            raise RunError(
                f"{where}: tensor {self.tensors[changed]} changed while step {step} was "
                "sent (a trainer step taken during the update); nothing was written",
                rank=self.rank,
            )
        return flags, total
