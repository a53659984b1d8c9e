"""How a refit's bytes cross from trainer ranks to engine ranks: one interface, three kinds.

A transport joins a group of ``senders + receivers`` members (sender ``s`` is member ``s``,
receiver ``r`` member ``senders + r``) and moves byte buffers between two members in
order: ``send(peer, buf)`` on one side, ``recv(peer, buf)`` (into a buffer of the same
size) on the other. Each kind is built once per refit group and reused every step:

* ``gloo`` / ``nccl`` / ``hccl``: torch.distributed point-to-point over a process group
  of the group's own (built from a ``TCPStore`` at ``addresses[0]``, never the default
  group, so an engine's own torch.distributed state is left alone). NCCL and HCCL send
  device memory only: a message crosses in chunks of :data:`BOUNCE_CHUNK_BYTES` through
  a device buffer of that size per peer and direction (host -> device before sending,
  device -> host after receiving), each allocated on the member's current CUDA / NPU
  device on its first message and reused after; one per link, because an engine rank
  receives its links on threads of their own;
* ``ray``: Ray's object store, pulled by the receiver (a named mailbox actor carries the
  object refs); the store is pre-faulted at start with one bucket's worth;
* ``shm``: same-node shared memory: one segment per (sender, receiver) link with two
  bucket slots, created once (``/dev/shm``) and mapped once by both sides.

A peer that dies or stops is seen as an error or a timeout (``timeout_s``): the caller
names the rank and bucket (docs/contract.md §4 "Refit").
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch

from ...orchestrator.errors import InputError, RunError

log = logging.getLogger(__name__)

KINDS = ("gloo", "nccl", "hccl", "ray", "shm")

BOUNCE_CHUNK_BYTES = 8 << 20
"""Bytes of a message that cross NCCL / HCCL at once: the size of each device buffer a
member holds per peer and direction (both ends cut a message alike)."""


class Transport(Protocol):
    """Ordered byte messages between two members of a refit group."""

    kind: str

    def send(self, peer: int, buf: torch.Tensor) -> None:
        """Send the uint8 tensor ``buf`` to member ``peer`` (returns once it may be reused)."""
        ...

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        """Fill the uint8 tensor ``buf`` (its size is the message's) from member ``peer``."""
        ...

    def close(self) -> None: ...


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"refit address {address!r} is not HOST:PORT", key="addresses")
    return host, int(port)


class TorchTransport:
    """torch.distributed point-to-point on a process group built for this refit group."""

    def __init__(
        self,
        kind: str,
        addresses: Sequence[str],
        member: int,
        size: int,
        *,
        group: str = "mxload-refit",
        timeout_s: float = 60.0,
        bounce: torch.device | None = None,
    ) -> None:
        """``bounce``: the device every message crosses through (``nccl`` / ``hccl``:
        :func:`device_of`), in chunks through one buffer per peer and direction."""
        dist: Any = importlib.import_module("torch.distributed")

        if not addresses:
            raise InputError(f"transport {kind!r} needs addresses=['HOST:PORT']", key="addresses")
        host, port = _host_port(addresses[0])
        self.kind = kind
        self.member = member
        self.timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(
            host,
            port,
            size,
            is_master=member == 0,
            timeout=timedelta(seconds=max(timeout_s, 30.0)),
            wait_for_workers=False,
        )
        store = dist.PrefixStore(group + "/", self._store)
        self._device = bounce
        self._links: dict[tuple[int, bool], tuple[torch.Tensor, threading.Lock]] = {}
        self._links_lock = threading.Lock()
        self.pg = _process_group(kind, store, member, size, self.timeout)

    def _link(self, peer: int, sending: bool) -> tuple[torch.Tensor, threading.Lock]:
        """The device buffer of (``peer``, direction), allocated on first use."""
        with self._links_lock:
            link = self._links.get((peer, sending))
            if link is None:
                buf = torch.empty(BOUNCE_CHUNK_BYTES, dtype=torch.uint8, device=self._device)
                link = self._links[(peer, sending)] = (buf, threading.Lock())
        return link

    def _wait(self, work: Any, peer: int) -> None:
        if not work.wait(self.timeout):
            raise RunError(f"no message from member {peer} within {self.timeout}")

    def send(self, peer: int, buf: torch.Tensor) -> None:
        if self._device is None:
            self.pg.send([buf], peer, 0).wait(self.timeout)
            return
        wire, lock = self._link(peer, True)
        flat = buf.reshape(-1)
        with lock:
            for at in range(0, flat.numel(), BOUNCE_CHUNK_BYTES):
                part = flat[at : at + BOUNCE_CHUNK_BYTES]
                # The copy in is ordered before the send on the current stream (the
                # process group waits for it), the next one after this send (its wait).
                wire[: part.numel()].copy_(part)
                self.pg.send([wire[: part.numel()]], peer, 0).wait(self.timeout)

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        if self._device is None:
            self._wait(self.pg.recv([buf], peer, 0), peer)
            return
        wire, lock = self._link(peer, False)
        flat = buf.reshape(-1)
        with lock:
            for at in range(0, flat.numel(), BOUNCE_CHUNK_BYTES):
                part = flat[at : at + BOUNCE_CHUNK_BYTES]
                self._wait(self.pg.recv([wire[: part.numel()]], peer, 0), peer)
                part.copy_(wire[: part.numel()])  # a blocking copy: the bytes are there after

    def close(self) -> None:
        self.pg = None
        self._links.clear()  # the device buffers go back to the device's allocator


def _process_group(kind: str, store: Any, member: int, size: int, timeout: timedelta) -> Any:
    """A process group of ``kind`` (``gloo``; ``nccl`` / ``hccl`` on devices) on ``store``."""
    dist: Any = importlib.import_module("torch.distributed")

    if kind == "gloo":
        return dist.ProcessGroupGloo(store, member, size, timeout)
    if kind == "nccl":  # pragma: no cover - needs CUDA devices
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, member, size, opts)
    if kind == "hccl":  # pragma: no cover - needs Ascend devices
        from torch_npu._C._distributed_c10d import (  # type: ignore[import-not-found]
            ProcessGroupHCCL,
        )

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, member, size, opts)
    raise InputError(f"transport {kind!r} is not one of {list(KINDS)}", key="transport")


# --- Ray's object store ----------------------------------------------------------------------


class _Mailbox:
    """Ray actor body: object refs by (from, to, seq), handed to the one who takes them."""

    def __init__(self) -> None:
        import asyncio

        self._items: dict[tuple[int, int, int], Any] = {}
        self._events: dict[tuple[int, int, int], asyncio.Event] = {}

    def _event(self, key: tuple[int, int, int]) -> Any:
        import asyncio

        return self._events.setdefault(key, asyncio.Event())

    async def put(self, key: tuple[int, int, int], boxed: list[Any]) -> None:
        self._items[key] = boxed
        self._event(key).set()

    async def take(self, key: tuple[int, int, int], timeout_s: float) -> list[Any] | None:
        import asyncio

        try:
            await asyncio.wait_for(self._event(key).wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        self._events.pop(key, None)
        boxed: list[Any] = self._items.pop(key)
        return boxed


class RayTransport:
    """Ray object-store pull: the sender puts, the receiver gets (zero-copy) and copies."""

    kind = "ray"

    def __init__(
        self,
        member: int,
        *,
        group: str = "mxload-refit",
        timeout_s: float = 60.0,
        prefault_bytes: int = 0,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise RunError("transport 'ray' needs a connected Ray (ray.init) in this process")
        self.member = member
        self.timeout_s = timeout_s
        actor: Any = ray.remote(num_cpus=0)(_Mailbox)
        self.box: Any = actor.options(
            name=f"{group}-mailbox", namespace="mxload", get_if_exists=True, lifetime=None
        ).remote()
        self._seq: dict[tuple[int, int], int] = {}
        if prefault_bytes:
            # The first put into a fresh store faults its pages in: pay it at setup.
            ref = ray.put(np.zeros(prefault_bytes, dtype=np.uint8))
            del ref

    def _next(self, a: int, b: int) -> int:
        n = self._seq.get((a, b), 0)
        self._seq[(a, b)] = n + 1
        return n

    def send(self, peer: int, buf: torch.Tensor) -> None:
        import ray

        key = (self.member, peer, self._next(self.member, peer))
        ray.get(self.box.put.remote(key, [ray.put(buf.numpy())]), timeout=self.timeout_s)

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        import ray

        key = (peer, self.member, self._next(peer, self.member))
        boxed = ray.get(self.box.take.remote(key, self.timeout_s))
        if boxed is None:
            raise RunError(f"no message from member {peer} within {self.timeout_s} s")
        buf.numpy()[...] = ray.get(boxed[0], timeout=self.timeout_s)

    def close(self) -> None:
        self.box = None


# --- same-node shared memory -------------------------------------------------------------------

_HEAD = 64
"""Slot header of a link segment: int64 published, acked, sender pid, receiver pid."""


class ShmTransport:
    """Same-node shared memory: per (sender, receiver) link one segment with two slots of
    ``slot_bytes``, created by the sender once, mapped once by the receiver."""

    kind = "shm"

    def __init__(
        self,
        member: int,
        senders: int,
        size: int,
        *,
        slot_bytes: int,
        group: str = "mxload-refit",
        timeout_s: float = 60.0,
        directory: str = "/dev/shm",
    ) -> None:
        self.member = member
        self.senders = senders
        self.slot = slot_bytes + 8
        self.timeout_s = timeout_s
        self.dir = directory
        self.group = group
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, np.ndarray]] = {}
        self._seq: dict[tuple[int, int], int] = {}
        self._owned: list[str] = []
        if member < senders:
            for r in range(senders, size):
                self._open(member, r, create=True)

    def _path(self, s: int, r: int) -> str:
        return os.path.join(self.dir, f"{self.group}-{s}-{r}")

    def _open(self, s: int, r: int, *, create: bool) -> tuple[mmap.mmap, np.ndarray]:
        got = self._maps.get((s, r))
        if got is not None:
            return got
        path = self._path(s, r)
        n = _HEAD + 2 * self.slot
        if create:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            self._owned.append(path)  # removed on close, also when sizing it fails
            try:
                os.ftruncate(fd, n)
            except BaseException:
                os.close(fd)
                raise
        else:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    fd = os.open(path, os.O_RDWR)
                    if os.fstat(fd).st_size >= n:
                        break
                    os.close(fd)
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise RunError(f"shared memory {path} of member {s} did not appear")
                time.sleep(0.005)
        try:
            m = mmap.mmap(fd, n)
        finally:
            os.close(fd)
        head = np.frombuffer(m, dtype=np.int64, count=4)
        if create:
            head[:] = (0, 0, os.getpid(), 0)
        self._maps[(s, r)] = (m, head)
        return m, head

    def _wait(self, cond: Any, pid_slot: int, head: np.ndarray, peer: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while not cond():
            pid = int(head[pid_slot])
            if pid and not _alive(pid):
                raise RunError(f"member {peer} (pid {pid}) is gone")
            if time.monotonic() > deadline:
                raise RunError(f"member {peer} did not answer within {self.timeout_s} s")
            pause = min(0.002, pause + 0.0001)
            time.sleep(pause)

    def claim(self, peer: int, nbytes: int) -> torch.Tensor:
        """The next message to ``peer``, to be written in place: a uint8 view of
        ``nbytes`` of its slot, once the receiver has taken what the slot held;
        :meth:`publish` sends it (the sender packs straight into shared memory)."""
        m, head = self._open(self.member, peer, create=True)
        seq = self._seq.get((self.member, peer), 0) + 1
        self._wait(lambda: seq - int(head[1]) <= 2, 3, head, peer)
        if nbytes + 8 > self.slot:
            raise RunError(f"message of {nbytes} bytes exceeds the shared-memory slot")
        at = _HEAD + (seq % 2) * self.slot + 8
        return torch.from_numpy(np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=at))

    def publish(self, peer: int, nbytes: int) -> None:
        """Send the message :meth:`claim` gave, of ``nbytes``."""
        m, head = self._open(self.member, peer, create=True)
        seq = self._seq.get((self.member, peer), 0) + 1
        self._seq[(self.member, peer)] = seq
        at = _HEAD + (seq % 2) * self.slot
        np.frombuffer(m, dtype=np.int64, count=1, offset=at)[0] = nbytes
        head[0] = seq

    def send(self, peer: int, buf: torch.Tensor) -> None:
        n = buf.numel()
        self.claim(peer, n).copy_(buf)
        self.publish(peer, n)

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        m, head = self._open(peer, self.member, create=False)
        if head[3] != os.getpid():
            head[3] = os.getpid()
        seq = self._seq.get((peer, self.member), 0) + 1
        self._seq[(peer, self.member)] = seq
        self._wait(lambda: int(head[0]) >= seq, 2, head, peer)
        at = _HEAD + (seq % 2) * self.slot
        view = np.frombuffer(m, dtype=np.uint8, count=self.slot, offset=at)
        n = int(view[:8].view(np.int64)[0])
        if n != buf.numel():
            raise RunError(f"member {peer} sent {n} bytes, {buf.numel()} expected")
        buf.numpy()[...] = view[8 : 8 + n]
        head[1] = seq

    def close(self) -> None:
        for m, _ in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view still held by the caller; the mapping goes with it
                pass
        self._maps.clear()
        for path in self._owned:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._owned.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def device_of(kind: str, who: str) -> torch.device:
    """The current device for ``nccl`` (CUDA) or ``hccl`` (Ascend NPU, ``torch_npu``,
    imported here) of the thread building the transport (a trainer or engine process has
    set it); a process without one is refused in one line naming ``who`` (the member: a
    trainer or an engine rank)."""
    if kind == "nccl":
        if not torch.cuda.is_available():
            raise RunError(f"{who}: transport 'nccl' needs a CUDA device; none is visible")
        return torch.device("cuda", torch.cuda.current_device())
    try:  # pragma: no cover - needs Ascend devices
        npu: Any = importlib.import_module("torch_npu").npu
        if npu.is_available():
            return torch.device("npu", npu.current_device())
    except Exception:  # torch_npu missing, or failing to load its runtime: no NPU here
        pass
    raise RunError(f"{who}: transport 'hccl' needs torch_npu and an NPU; none is visible")


def make_transport(
    kind: str,
    *,
    addresses: Sequence[str],
    member: int,
    senders: int,
    size: int,
    group: str,
    timeout_s: float,
    bucket_bytes: int,
) -> Transport:
    """The transport ``kind`` for member ``member`` of a group of ``size``."""
    if kind == "gloo":
        return TorchTransport(kind, addresses, member, size, group=group, timeout_s=timeout_s)
    if kind in ("nccl", "hccl"):
        return TorchTransport(
            kind,
            addresses,
            member,
            size,
            group=group,
            timeout_s=timeout_s,
            bounce=device_of(
                kind,
                f"trainer rank {member}" if member < senders else f"engine rank {member - senders}",
            ),
        )
    if kind == "ray":
        return RayTransport(
            member,
            group=group,
            timeout_s=timeout_s,
            prefault_bytes=bucket_bytes if member < senders else 0,
        )
    if kind == "shm":
        return ShmTransport(
            member, senders, size, slot_bytes=bucket_bytes, group=group, timeout_s=timeout_s
        )
    raise InputError(f"transport {kind!r} is not one of {list(KINDS)}", key="transport")
