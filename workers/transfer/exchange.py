"""One refit step on the wire: a trainer rank sends, an engine rank receives.

Per (sender, receiver) link, in order: one header (step, the step the delta is taken
against, manifest hash, plan digest, where the receiver lands the link's pieces, and
which tensors changed), then the link's buckets of the transfer plan
(``mxload.orchestrator.plan.refit``), the transfers of unchanged tensors left out, each
bucket as the messages ``plan.refit.messages`` cuts it into (a run of pieces landing
side by side is received in place), then one trailer, sent once every link's buckets are out: whether a
tensor the sender read changed while it sent (a trainer step taken during the update).
A sender sends all its headers first, then its buckets on one thread, interleaved across
its receivers in the order they consume them (``plan.refit.send_order``), through one
bucket buffer. A receiver takes every link on its own thread, into its receive ring, and
checks every header before the first bucket lands and every trailer after the last; the
loader converts and writes units as their bytes land, and its run ends by waiting for
the trailers (a delta sends every tensor of a unit that reads a changed one, so no unit
waits for a byte that is not sent). A sender that dies or stops is named with the
bucket it owed, a tensor that changed with its name; either, or an engine rank that
fails or stalls, fails the whole update: the engine ranks stop taking bytes and leave
the group, so every trainer rank still sending is told too (docs/contract.md §4
"Refit").
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...orchestrator.errors import MxloadError, ReloadMismatch, RunError
from ...orchestrator.plan.refit import (
    ReceiveLayout,
    RefitPlan,
    Transfer,
    link_digest,
    messages,
    quiet_receivers,
    receive_layout,
    send_order,
)
from ...orchestrator.plan.types import Unit
from .transports import Transport
from .wire import ReceiveArea, local_rect, pack

MAGIC = 0x6D786C6F6164  # "mxload"
HEAD_WORDS = 8
TRAILER_WORDS = 3

Bucket = tuple[Transfer, ...]


def _hash_int(text: str) -> int:
    return int(text[:15], 16) if text else 0


def link_buckets(plan: RefitPlan) -> dict[tuple[int, int], list[Bucket]]:
    """Per (sender, receiver) link, its buckets in the order the sender sends them (none
    on the link from trainer rank 0 to an engine rank that copies all it holds:
    ``plan.refit.quiet_receivers``)."""
    out: dict[tuple[int, int], list[Bucket]] = {}
    for b in plan.buckets:
        out.setdefault((b.sender, b.receiver), []).append(b.transfers)
    for r in quiet_receivers(plan.summary):
        out.setdefault((0, r), [])
    return out


def _without(buckets: Sequence[Bucket], skip: Collection[str]) -> list[Bucket]:
    """The buckets with the transfers of unchanged tensors left out (empty ones too):
    both sides compute the same."""
    if not skip:
        return list(buckets)
    out = [tuple(t for t in b if t.tensor not in skip) for b in buckets]
    return [b for b in out if b]


def header(
    digest: str,
    manifest_hash: str,
    sender: int,
    step: int,
    delta_of: int | None,
    flags: list[bool],
    landing: int,
) -> torch.Tensor:
    """A link's first message; ``landing``: the link's ``plan.refit.link_digest``."""
    words = torch.tensor(
        [
            MAGIC,
            step,
            -1 if delta_of is None else delta_of,
            _hash_int(manifest_hash),
            _hash_int(digest),
            sender,
            len(flags),
            landing,
        ],
        dtype=torch.int64,
    )
    return torch.cat([words.view(torch.uint8), torch.tensor(flags, dtype=torch.uint8)])


def trailer(step: int, changed: int) -> torch.Tensor:
    """The last message of a link: ``changed`` is the index (in ``RefitPlan.tensors``) of a
    tensor the sender found written during the send, -1 when none was."""
    return torch.tensor([MAGIC, step, changed], dtype=torch.int64).view(torch.uint8)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A trainer rank's own shard of a parameter: a DTensor's (FSDP2, Megatron with
    DTensors) local tensor, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    # torch bumps ``_version`` on every in-place write (an optimizer step's ``add_``)
    # to the tensor or a view of it (a DTensor's own, not its local tensor's: the
    # parameter is stamped); ``data_ptr`` moves when the parameter is rebound.
    return t._version, local_shard(t).data_ptr()


@dataclass
class SendStats:
    bytes_sent: int = 0
    buckets: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0


class _Side:
    """What both ends of a refit's links work out from the transfer plan alike."""

    def __init__(self, plan: RefitPlan, rank: int, transport: Transport) -> None:
        self.summary = plan.summary
        self.rank = rank
        self.transport = transport
        self.senders = len(plan.summary.sender_bytes)
        self.tensors = list(plan.tensors)
        self.groups = plan_groups(plan)
        self.digest = plan.digest


class Sender(_Side):
    """A trainer rank's side of every link it has, from its share of the plan
    (``plan.refit.sender_share``: its buckets, and per engine rank it feeds, where that
    rank lands its pieces: a run of pieces landing side by side goes as one message,
    received in place)."""

    def __init__(
        self,
        share: RefitPlan,
        rank: int,
        transport: Transport,
        backend: Any,
        layouts: Mapping[int, ReceiveLayout],
    ) -> None:
        super().__init__(share, rank, transport)
        self.backend = backend
        self.links = {k: v for k, v in link_buckets(share).items() if k[0] == rank}
        self.order = send_order(share, rank)
        self.landing = {r: _Landing(layouts[r], bs) for (_, r), bs in self.links.items()}
        # One bucket buffer, allocated once (each send returns once it may be reused): with
        # the row chunks of a conversion on the sender (``pack``), what this rank holds
        # beyond its params. A transport that lends its own memory (shm) needs none.
        size = max((sum(t.nbytes for t in b) for bs in self.links.values() for b in bs), default=0)
        lends = hasattr(transport, "claim")
        self.buf = torch.empty(0 if lends else size, dtype=torch.uint8)
        self.last = SendStats()

    @contextmanager
    def _naming(self, step: int, receiver: int, buckets: int) -> Iterator[list[int]]:
        """Name the message of ``step`` to ``receiver`` whose send failed: the header
        (``where[0] == -1``), bucket ``where[0]``, or the trailer (-2)."""
        where = [-1]
        try:
            yield where
        except Exception as err:
            if isinstance(err, MxloadError) and not isinstance(err, RunError):
                raise  # a conversion's, naming the tensor
            # the transport's own words name group members, not ranks
            why = err.message if isinstance(err, RunError) else f"{type(err).__name__}: {err}"
            b = where[0]
            what = {-1: "the header", -2: "the trailer"}.get(b, f"bucket {b} of {buckets}")
            raise RunError(
                f"trainer rank {self.rank}: sending {what} of step {step} to engine rank "
                f"{receiver} failed: {why}",
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
        sent_flags = effective_flags(self.tensors, flags, self.groups)
        skip = {t for t, f in zip(self.tensors, sent_flags, strict=True) if not f}
        local = local_rect({n: local_shard(t) for n, t in params.items()}, self.rank)
        sent = [t for t in self.tensors if t not in skip and t in params]
        before = {t: _stamp(params[t]) for t in sent}
        links = sorted(self.links.items())
        # Every header first: each engine rank checks its headers and starts its loader
        # at once, instead of behind the ranks this one feeds before it.
        for (_, receiver), _buckets in links:
            digest = self.landing[receiver].digest(self.rank)
            head = header(
                self.digest, self.summary.manifest_digest, self.rank, step, delta_of,
                flags, digest,
            )  # fmt: skip
            with self._naming(step, receiver, -1):
                self.transport.send(self.senders + receiver, head)
        # Then the buckets, interleaved across the receivers in the order they consume
        # them (``plan.refit.send_order``: no cycle of waits between ring-bound
        # receivers, and no engine rank waits behind another's whole stream).
        count = {r: len(_without(bs, skip)) for (_, r), bs in links}
        claim = getattr(self.transport, "claim", None)
        where_of = dict.fromkeys(count, -1)
        for bucket in self.order:
            transfers = _without([bucket.transfers], skip)
            if not transfers:
                continue
            receiver = bucket.receiver
            where_of[receiver] += 1
            with self._naming(step, receiver, count[receiver]) as where:
                where[0] = where_of[receiver]
                peer = self.senders + receiver
                todo = transfers[0]
                for a, b, _ in self.landing[receiver].cut(todo)[1]:
                    tp = time.perf_counter()
                    if claim is not None:  # packed straight into the transport's memory
                        size = sum(t.nbytes for t in todo[a:b])
                        n = pack(todo[a:b], local, claim(peer, size), self.backend)
                        stats.pack_seconds += time.perf_counter() - tp
                        self.transport.publish(peer, n)  # type: ignore[attr-defined]
                    else:
                        n = pack(todo[a:b], local, self.buf, self.backend)
                        stats.pack_seconds += time.perf_counter() - tp
                        self.transport.send(peer, self.buf[:n])
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


class _Landing:
    """Where one engine rank lands the pieces of its links, and so how a bucket to it
    goes over the wire (``plan.refit.messages``). Both depend on the plan alone: the
    plan's own ``buckets`` are cut once, not every step (a delta's, with the unchanged
    tensors left out, are cut as they come)."""

    def __init__(self, layout: ReceiveLayout, buckets: Iterable[Bucket]) -> None:
        self.layout = layout
        self.index = {id(t): i for i, t in enumerate(layout.transfers)}
        self._cuts = {id(b): (b, *self._cut(b)) for b in buckets}
        self._digests: dict[int, int] = {}

    def _cut(self, bucket: Bucket) -> tuple[list[int], tuple[tuple[int, int, bool], ...]]:
        items = [self.index[id(t)] for t in bucket]
        return items, messages(self.layout, items)

    def cut(self, bucket: Bucket) -> tuple[list[int], tuple[tuple[int, int, bool], ...]]:
        """The bucket's transfers as layout indices, and its messages."""
        got = self._cuts.get(id(bucket))
        if got is not None and got[0] is bucket:
            return got[1], got[2]
        return self._cut(bucket)

    def digest(self, sender: int) -> int:
        """``plan.refit.link_digest`` of the link from ``sender``."""
        if sender not in self._digests:
            self._digests[sender] = link_digest(self.layout, sender)
        return self._digests[sender]


@dataclass
class Received:
    """What one receive brought: which tensors changed, and the bytes."""

    changed: dict[str, bool]
    bytes_received: int = 0
    seconds: float = 0.0
    per_sender: dict[int, int] = field(default_factory=dict)
    peak_ring_bytes: int = 0
    """The most ring bytes landed and not yet read at once."""
    in_place_bytes: int = 0
    """Bytes received straight into the receive area (the rest through a link's
    landing buffer, then copied)."""


def tensor_groups(units: Sequence[Sequence[str]]) -> dict[str, int]:
    """Tensors read together: per tensor, a group number, tensors sharing a unit (of
    any rank) in one group. A delta sends a group whole or not at all, so that no unit
    is left to read a tensor that was not sent."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for names in units:
        for a, b in itertools.pairwise(names):
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        for a in names:
            root(a)
    roots: dict[str, int] = {}
    return {t: roots.setdefault(root(t), len(roots)) for t in sorted(parent)}


def plan_groups(plan: RefitPlan) -> dict[str, int]:
    """:func:`tensor_groups` of the tensors each engine unit of the plan reads: both
    sides compute it from the plan alone."""
    return tensor_groups(list(plan.unit_tensors))


def effective_flags(
    tensors: Sequence[str], flags: Sequence[bool], groups: Mapping[str, int]
) -> list[bool]:
    """The changed flags a delta is sent under: a tensor is sent when any tensor of its
    group changed."""
    keys = [groups.get(t, -1 - i) for i, t in enumerate(tensors)]
    hot = {k for k, f in zip(keys, flags, strict=True) if f}
    return [k in hot for k in keys]


class Receiver(_Side):
    """An engine rank's side of every link it has, into its receive area: one thread per
    link lands its buckets in the ring while the loader reads (``units``: the rank's, in
    its loader's order). ``itemsize``: per tensor, its trainer dtype's size;
    ``row_bytes``: per wire file, one row's bytes."""

    def __init__(
        self,
        plan: RefitPlan,
        rank: int,
        transport: Transport,
        itemsize: Mapping[str, int],
        row_bytes: Mapping[str, int],
        units: Sequence[Unit],
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(plan, rank, transport)
        self.links = {k[0]: v for k, v in sorted(link_buckets(plan).items()) if k[1] == rank}
        self.landing = _Landing(
            receive_layout(units, plan, rank), [b for bs in self.links.values() for b in bs]
        )
        self.area = ReceiveArea(self.landing.layout, itemsize, row_bytes, timeout_s)
        # Per link, its largest bucket (RefitSummary.receiver_scratch), allocated once.
        self._scratch = {
            s: torch.empty(
                max((sum(t.nbytes for t in b) for b in bs), default=0), dtype=torch.uint8
            )
            for s, bs in self.links.items()
        }
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[int, Future[int]] = {}
        self._go = threading.Event()
        self._step = 0
        self._t0 = 0.0
        self._changed: dict[str, bool] = {}
        self._in_place: dict[int, int] = {}

    @property
    def held_bytes(self) -> int:
        """What receiving holds beside the loader: the area and the links' buffers."""
        return self.area.nbytes + sum(b.numel() for b in self._scratch.values())

    @property
    def planned_bytes(self) -> int:
        s = self.summary
        if not s.receiver_ring:
            return self.held_bytes
        r = self.rank
        return s.receiver_ring[r] + s.receiver_pinned[r] + s.receiver_scratch[r]

    def start(self, step: int, *, delta_of: int | None = None) -> dict[str, bool]:
        """Every link's header of ``step`` checked, then its buckets landing in the area
        on the link's own thread (:meth:`finish` waits for them and the trailers);
        returns which tensors the update sends (a delta's changed ones, grouped by
        :func:`tensor_groups`). RunError naming a trainer rank whose header did not
        come, ReloadMismatch for a header of another step, delta, manifest or plan, or
        trainer ranks that disagree on what changed: nothing landed, nothing written."""
        self._t0 = time.perf_counter()
        self._step = step
        self._go = threading.Event()
        self._futures = {}
        self._in_place = dict.fromkeys(self.links, 0)
        if not self.links:
            self._changed = dict.fromkeys(self.tensors, True)
            self.area.reset([])
            return self._changed
        self._pool = ThreadPoolExecutor(
            max_workers=len(self.links), thread_name_prefix=f"mxload-refit-{self.rank}"
        )
        heads: dict[int, Future[list[bool]]] = {}
        for s, buckets in self.links.items():
            got: Future[list[bool]] = Future()
            heads[s] = got
            self._futures[s] = self._pool.submit(self._link, s, buckets, step, delta_of, got)
        flags: dict[int, list[bool]] = {}
        try:
            for s, got in heads.items():
                try:
                    flags[s] = got.result(timeout=self.area.timeout_s + 5)
                except TimeoutError:
                    raise RunError(
                        f"engine rank {self.rank}: trainer rank {s} sent no header for step "
                        f"{step} in {self.area.timeout_s:g} s",
                        rank=self.rank,
                    ) from None
            first = next(iter(flags.values()))
            if any(f != first for f in flags.values()):
                raise ReloadMismatch(
                    f"engine rank {self.rank}: the trainer ranks disagree on which tensors "
                    f"changed since step {delta_of}; nothing was written",
                    rank=self.rank,
                )
        except BaseException as err:
            self.stop(err)
            raise
        sent = effective_flags(self.tensors, first, self.groups)
        skip = {t for t, f in zip(self.tensors, sent, strict=True) if not f}
        lay = self.area.layout
        self.area.reset([t.tensor not in skip for t in lay.transfers])
        self._changed = dict(zip(self.tensors, sent, strict=True))
        self._go.set()
        return self._changed

    def finish(self) -> Received:
        """Wait for every link's last bucket and trailer; the first link's error."""
        got: dict[int, int] = {}
        errors: list[BaseException] = []
        for s, fut in self._futures.items():
            try:
                got[s] = fut.result()
            except BaseException as err:
                errors.append(err)
        self._close_pool()
        if errors:
            raise errors[0]
        return Received(
            self._changed,
            bytes_received=sum(got.values()),
            seconds=time.perf_counter() - self._t0,
            per_sender=got,
            peak_ring_bytes=self.area.peak_held,
            in_place_bytes=sum(self._in_place.values()),
        )

    def stop(self, err: BaseException) -> None:
        """Fail the update: every wait of the area raises, each link stops once its
        message in flight ends (bounded by the transport's timeout), then this rank
        leaves the group (its transport closed): the trainer ranks' sends to it fail."""
        self.area.fail(err)
        self._go.set()
        self._close_pool()
        self.transport.close()

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _link(
        self,
        sender: int,
        buckets: list[Bucket],
        step: int,
        delta_of: int | None,
        head_out: Future[list[bool]],
    ) -> int:
        try:
            flags = self._header(sender, step, delta_of)
        except BaseException as err:
            head_out.set_exception(err)
            raise
        head_out.set_result(flags)
        try:
            got = self._body(sender, buckets, step, flags)
        except BaseException as err:
            self.area.fail(err)
            raise
        if self.area.error is not None:
            raise self.area.error
        return got

    def _take(self, sender: int, buf: torch.Tensor, failed: str) -> None:
        """The next message from ``sender`` into ``buf``; RunError ``failed`` when the
        transport fails (the sender died, stopped past the wait, or left)."""
        try:
            self.transport.recv(sender, buf)
        except Exception as err:
            raise RunError(
                f"engine rank {self.rank}: trainer rank {sender} {failed}: "
                f"{type(err).__name__}: {err}",
                rank=self.rank,
            ) from err

    def _header(self, sender: int, step: int, delta_of: int | None) -> list[bool]:
        n = len(self.tensors)
        head = torch.empty(HEAD_WORDS * 8 + n, dtype=torch.uint8)
        where = f"engine rank {self.rank}: trainer rank {sender}"
        self._take(sender, head, f"sent no header for step {step} (died, stopped or never joined)")
        words = head[: HEAD_WORDS * 8].view(torch.int64).tolist()
        want = [MAGIC, step, -1 if delta_of is None else delta_of]
        want += [_hash_int(self.summary.manifest_digest), _hash_int(self.digest), sender, n]
        want.append(self.landing.digest(sender))
        if words != want:
            names = ["magic", "step", "delta_of", "manifest hash", "plan digest", "rank", "tensors"]
            names.append(
                "landing digest (the two ends plan the engine differently, or run mxload "
                "versions whose wire formats differ)"
            )
            diff = [
                f"{a} {x} (expected {y})"
                for a, x, y in zip(names, words, want, strict=True)
                if x != y
            ]
            raise ReloadMismatch(
                f"{where} sent {', '.join(diff)}; nothing was written (a header left unread "
                "by an update the engine refused reads so too: initialise the weight "
                "transfer again)",
                rank=self.rank,
            )
        return [bool(x) for x in head[HEAD_WORDS * 8 :].tolist()]

    def _body(self, sender: int, buckets: list[Bucket], step: int, flags: list[bool]) -> int:
        """The link's buckets into the area, then its trailer. Once the update has failed
        (here, on another link, or in the loader) the link takes nothing more: its
        sender's next send to this rank fails or times out, so every trainer rank still
        sending is told (docs/contract.md §4 "Refit")."""
        where = f"engine rank {self.rank}: trainer rank {sender}"
        if not self._go.wait(self.area.timeout_s + 5):
            raise RunError(f"{where}: the update did not start", rank=self.rank)
        sent = effective_flags(self.tensors, flags, self.groups)
        todo = _without(buckets, {t for t, f in zip(self.tensors, sent, strict=True) if not f})
        total = 0
        area = self.area
        for b, bucket in enumerate(todo):
            items, cut = self.landing.cut(bucket)
            keep = set(area.wait_space(items, f"{where}, bucket {b} of {len(todo)} of step {step}"))
            for first, stop, direct in cut:
                mine = items[first:stop]
                size = sum(t.nbytes for t in bucket[first:stop])
                views = [area.view(i) for i in mine]
                # in place unless a piece is not read this update (its ring bytes may
                # hold another's)
                in_place = direct and keep.issuperset(mine)
                if in_place:
                    at = views[0].storage_offset()
                    buf = (area.pinned if area.layout.pinned[mine[0]] else area.ring)[
                        at : at + size
                    ]
                else:
                    buf = self._scratch[sender][:size]
                self._take(
                    sender, buf, f"died or stopped during bucket {b} of {len(todo)} of step {step}"
                )
                total += size
                if in_place:
                    self._in_place[sender] += size
                if area.error is not None:
                    raise area.error
                if not in_place:
                    at = 0
                    for i, v in zip(mine, views, strict=True):
                        if i in keep:
                            v.copy_(buf[at : at + v.numel()])
                        at += v.numel()
                area.landed([i for i in mine if i in keep])
        tail = torch.empty(TRAILER_WORDS * 8, dtype=torch.uint8)
        self._take(sender, tail, f"died or stopped after its last bucket of step {step}")
        magic, got_step, changed = tail.view(torch.int64).tolist()
        if (magic, got_step) != (MAGIC, step):
            raise ReloadMismatch(
                f"{where} ended step {step} with a trailer of step {got_step}; the units "
                "written from this update hold no step",
                rank=self.rank,
            )
        if changed >= 0:
            raise RunError(
                f"{where}: tensor {self.tensors[changed]} changed while step {step} was "
                "sent (a trainer step taken during the update); the units written from "
                "this update hold no step",
                rank=self.rank,
            )
        return total
