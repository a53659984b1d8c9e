"""The refit's wire, without an engine: the transports and the byte bookkeeping.

* every transport kind moves byte messages in order between two members, and a peer
  that is gone is named (shared memory: its pid; torch.distributed: its socket);
* the transfer plan's pieces, packed by the sender and landed in the receiver's area,
  give every range the loader reads exactly the bytes of the gathered tensor (checked
  against slicing the whole tensor, not against the plan's own arithmetic).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import RunError
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.trainer import fsdp_manifest
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.refit import TrainerSource, refit_setup, row_bytes
from mxload.workers.transfer.exchange import link_buckets
from mxload.workers.transfer.transports import ShmTransport, make_transport
from mxload.workers.transfer.wire import ReceiveArea, local_rect, pack

from tests.refit_trainer import free_port, read_checkpoint, shards


def _exchange(make: Any, messages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Member 0 sends ``messages`` to member 1 (each side on its own thread)."""
    got = [torch.empty_like(m) for m in messages]
    ends: list[Any] = [None, None]
    errors: list[BaseException] = []

    def side(member: int) -> None:
        try:
            ends[member] = t = make(member)
            for m, g in zip(messages, got, strict=True):
                t.send(1, m) if member == 0 else t.recv(0, g)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=side, args=(m,)) for m in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    for t in ends:
        if t is not None:
            t.close()
    assert not errors, errors
    return got


MESSAGES = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (72, 4096, 1, 65536, 300)]


@pytest.mark.parametrize("kind", ["gloo", "shm"])
def test_transport_moves_messages_in_order(kind: str, tmp_path) -> None:
    port = free_port()

    def make(member: int) -> Any:
        if kind == "shm":
            return ShmTransport(
                member, 1, 2, slot_bytes=1 << 16, group="t", directory=str(tmp_path)
            )
        return make_transport(
            kind,
            addresses=[f"127.0.0.1:{port}"],
            member=member,
            senders=1,
            size=2,
            group="t",
            timeout_s=20,
            bucket_bytes=1 << 16,
        )

    got = _exchange(make, MESSAGES)
    assert all(torch.equal(a, b) for a, b in zip(MESSAGES, got, strict=True))
    if kind == "shm":
        assert list(tmp_path.iterdir()) == []  # the sender removed its segment


def test_shm_names_a_sender_that_is_gone(tmp_path) -> None:
    tx = ShmTransport(0, 1, 2, slot_bytes=64, group="g", directory=str(tmp_path))
    rx = ShmTransport(1, 1, 2, slot_bytes=64, group="g", directory=str(tmp_path), timeout_s=5)
    _, head = tx._maps[(0, 1)]
    head[2] = 2**22 + 12345  # a pid no process has: the sender's process is gone
    with pytest.raises(RunError, match=r"member 0 .*is gone"):
        rx.recv(0, torch.empty(8, dtype=torch.uint8))
    rx.close()
    tx.close()


def test_unknown_transport_is_refused_naming_it() -> None:
    with pytest.raises(Exception, match="transport 'carrier-pigeon'"):
        make_transport(
            "carrier-pigeon",
            addresses=[],
            member=0,
            senders=1,
            size=2,
            group="g",
            timeout_s=1,
            bucket_bytes=1,
        )


def test_packed_transfers_give_every_read_range_the_gathered_bytes(ckpt_factory) -> None:
    """Three FSDP trainer ranks -> tp2 x dp2 + EP: each sender packs its buckets, each
    lands where the receiver's area puts it, and every byte range the loader reads of
    the wire checkpoint is the gathered tensor's bytes (sliced here from the whole
    tensor, not from the plan)."""
    fp8 = open_checkpoint(ckpt_factory("qwen3-moe-tiny", seed=1))
    full = read_checkpoint(ckpt_factory("qwen3-moe-tiny", seed=1, bf16=True))
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 3)
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    held = build_plan(fp8.config, layout, checkpoint=fp8)
    bucket = 5000
    source = TrainerSource(transport="gloo", world=3, manifest=manifest, bucket_bytes=bucket)
    setup = refit_setup(held, fp8.config, source)
    links = link_buckets(setup.refit)
    itemsize = {t.name: t.itemsize for t in manifest.tensors}
    local = {s: local_rect(shards(full, s, 3), s) for s in range(3)}
    buf = torch.empty(bucket, dtype=torch.uint8)
    for r in range(layout.world):
        mine = sorted((s, b) for (s, rr), b in links.items() if rr == r)
        order = [t for _, bs in mine for b in bs for t in b]
        area = ReceiveArea(r, order, itemsize, row_bytes(setup.wire))
        at = iter(area.offsets)
        for s, bs in mine:
            for b in bs:
                n = pack(b, local[s], buf, backend=None)
                assert n <= bucket
                first = next(at)
                for _ in b[1:]:
                    next(at)
                area.tensor[first : first + n].copy_(buf[:n])
        store = area.storage()
        for ur in setup.plan.ranks[r].reads or ():
            for pr in ur.parts:
                out = bytearray(pr.weight.nbytes)
                store.read_ranges_into(pr.file, [pr.weight], memoryview(out))
                whole = full[pr.file].contiguous().reshape(-1).view(torch.uint8)
                want = b"".join(bytes(whole[s : s + k].numpy()) for s, k in pr.weight.segments())
                assert bytes(out) == want, (r, pr.file)


TRAINER = {"transport": "gloo", "world": 1, "addresses": ["127.0.0.1:1"]}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"transport": "pigeon"}, "trainer.transport"),
        ({"world": 2}, "trainer.world"),
        ({"world": True}, "trainer.world"),
        ({"convert_on": "both"}, "trainer.convert_on"),
        ({"bucket_bytes": 12}, "trainer.bucket_bytes"),
        ({"timeout_s": "soon"}, "trainer.timeout_s"),
        ({"group": "../etc"}, "trainer.group"),
        ({"addresses": "127.0.0.1:1"}, "trainer.addresses"),
        ({"colour": "blue"}, "trainer"),
    ],
)
def test_a_bad_trainer_form_is_one_line_naming_the_key(change: dict, key: str) -> None:
    """What an RL framework may get wrong in the init info's trainer form: each refused
    with one InputError naming the key (exit 2 through the CLI's error hierarchy)."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.plan.trainer import manifest_to_json

    manifest = fsdp_manifest({"a.weight": (4, 32)}, 1)
    form = {**TRAINER, "manifest": manifest_to_json(manifest), **change}
    with pytest.raises(InputError) as err:
        TrainerSource.from_json(form)
    assert err.value.context.get("key") == key, err.value.context
    assert "\n" not in str(err.value)
