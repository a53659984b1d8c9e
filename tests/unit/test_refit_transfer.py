"""The refit's wire, without an engine: the transports and the byte bookkeeping.

* every transport kind moves byte messages in order between two members, and a peer
  that is gone is named (shared memory: its pid; torch.distributed: its socket);
* the transfer plan's pieces, packed by the sender and landed in the receiver's area,
  give every range the loader reads exactly the bytes of the gathered tensor (checked
  against slicing the whole tensor, not against the plan's own arithmetic);
* the worst case of the streaming refit over shm and gloo: three trainer ranks in
  4 KiB buckets into four engine ranks whose rings wrap many times, completing
  byte-exact (a cycle of waits would fail on the receive timeout, not hang).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import RunError
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.refit import Transfer, receive_layout
from mxload.orchestrator.plan.trainer import fsdp_manifest
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.refit import TrainerSource, node_numbers, refit_setup, row_bytes
from mxload.workers.transfer.exchange import link_buckets
from mxload.workers.transfer.transports import ShmTransport, TorchTransport, make_transport
from mxload.workers.transfer.wire import AreaStorage, ReceiveArea, local_rect, pack

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


def pair_member(
    kind: str, member: int, port: int = 1, *, timeout_s: float = 1, bucket_bytes: int = 64
) -> Any:
    """``make_transport`` of member ``member`` of a group of one sender and one receiver
    at 127.0.0.1:``port`` (port 1: nothing listens there, for refusals)."""
    return make_transport(
        kind,
        addresses=[f"127.0.0.1:{port}"],
        member=member,
        senders=1,
        size=2,
        group="t",
        timeout_s=timeout_s,
        bucket_bytes=bucket_bytes,
    )


@pytest.mark.parametrize("kind", ["gloo", "shm", "gloo-through-a-device-buffer"])
def test_transport_moves_messages_in_order(kind: str, tmp_path) -> None:
    """Byte-exact, in order, on each kind; the last is the path NCCL and HCCL take (every
    message in chunks through a buffer of its link on the member's device), run over gloo
    with the buffers in host memory."""
    port = free_port()

    def make(member: int) -> Any:
        if kind == "shm":
            return ShmTransport(
                member, 1, 2, slot_bytes=1 << 16, group="t", directory=str(tmp_path)
            )
        if kind == "gloo-through-a-device-buffer":
            return bounced(member, 2, port)
        return pair_member(kind, member, port, timeout_s=20, bucket_bytes=1 << 16)

    got = _exchange(make, MESSAGES)
    assert all(torch.equal(a, b) for a, b in zip(MESSAGES, got, strict=True))
    if kind == "shm":
        assert list(tmp_path.iterdir()) == []  # the sender removed its segment


def bounced(member: int, size: int, port: int) -> TorchTransport:
    """A gloo member whose messages cross through per-link buffers, as NCCL's and HCCL's
    do (the buffers in host memory here)."""
    return TorchTransport(
        "gloo",
        [f"127.0.0.1:{port}"],
        member,
        size,
        group="t",
        timeout_s=20,
        bounce=torch.device("cpu"),
    )


def test_device_buffers_carry_links_received_at_once_in_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two senders to one receiver that takes each link on its own thread (as an engine
    rank does), messages of several chunks: every message arrives whole and in order,
    through buffers of its link alone."""
    from mxload.workers.transfer import transports

    from tests.integration.test_refit import on_threads

    monkeypatch.setattr(transports, "BOUNCE_CHUNK_BYTES", 1000)
    port = free_port()
    gen = torch.Generator().manual_seed(3)
    sent = {
        s: [
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            for n in (4096, 999, 3001) * 6
        ]
        for s in (0, 1)
    }
    got = {s: [torch.empty_like(m) for m in sent[s]] for s in (0, 1)}
    ends: list[Any] = [None] * 3

    def sender(m: int) -> Callable[[], None]:
        def run() -> None:
            t = ends[m] = bounced(m, 3, port)
            for msg in sent[m]:
                t.send(2, msg)

        return run

    def link(t: Any, s: int) -> Callable[[], None]:
        def run() -> None:
            for g in got[s]:
                t.recv(s, g)

        return run

    def receiver() -> list[Any]:
        t = ends[2] = bounced(2, 3, port)
        return on_threads([link(t, 0), link(t, 1)])

    results = on_threads([sender(0), sender(1), receiver])
    for t in ends:
        if t is not None:
            t.close()
    links = results[2] if isinstance(results[2], list) else [results[2]]
    errors = [r for r in [*results[:2], *links] if isinstance(r, BaseException)]
    assert not errors, errors
    for s in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(sent[s], got[s], strict=True)), s


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize(("kind", "needs"), [("nccl", "a CUDA device"), ("hccl", "torch_npu")])
def test_a_device_transport_without_its_device_is_one_line_naming_it(kind: str, needs: str) -> None:
    with pytest.raises(RunError, match=f"engine rank 0: transport '{kind}' needs {needs}") as err:
        pair_member(kind, 1)
    assert "\n" not in str(err.value)


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
        pair_member("carrier-pigeon", 0)


def test_packed_transfers_give_every_read_range_the_gathered_bytes(ckpt_factory) -> None:
    """Three FSDP trainer ranks -> tp2 x dp2 + EP: each sender packs its buckets, one
    thread per link lands them in the receiver's ring (waiting for the bytes the loader
    released) while the units are read in order, each released once read, and every
    byte range the loader reads of the wire checkpoint is the gathered tensor's bytes
    (sliced here from the whole tensor, not from the plan). The ring is smaller than
    what the rank needs."""
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
    for r in range(layout.world):
        lay = receive_layout(held.ranks[r].units, setup.refit, r)
        assert 0 < lay.capacity < setup.refit.summary.receiver_bytes[r]
        area = ReceiveArea(lay, itemsize, row_bytes(setup.wire), timeout_s=20)
        area.reset([True] * len(lay.transfers))
        index = {id(t): i for i, t in enumerate(lay.transfers)}

        def land(
            buckets: list[tuple[Transfer, ...]],
            s: int,
            area: ReceiveArea = area,
            index: dict[int, int] = index,
        ) -> None:
            buf = torch.empty(bucket, dtype=torch.uint8)
            for b in buckets:
                n = pack(b, local[s], buf, backend=None)
                assert n <= bucket
                items = [index[id(t)] for t in b]
                keep = area.wait_space(items, f"trainer rank {s}")
                at = 0
                for t, i in zip(b, items, strict=True):
                    area.view(i).copy_(buf[at : at + t.nbytes])
                    at += t.nbytes
                area.landed(keep)

        mine = sorted((s, b) for (s, rr), b in links.items() if rr == r)
        with ThreadPoolExecutor(len(mine)) as pool:
            futures = [pool.submit(land, bs, s) for s, bs in mine]
            store = AreaStorage(area)
            reads = setup.plan.ranks[r].reads or ()
            store.begin_reads([True] * len(reads))
            for u, ur in enumerate(reads):
                for pr in ur.parts:
                    out = bytearray(pr.weight.nbytes)
                    store.read_ranges_into(pr.file, [pr.weight], memoryview(out))
                    whole = full[pr.file].contiguous().reshape(-1).view(torch.uint8)
                    want = b"".join(
                        bytes(whole[s : s + k].numpy()) for s, k in pr.weight.segments()
                    )
                    assert bytes(out) == want, (r, pr.file)
                store.units_read([u])
            for f in futures:
                f.result()
        assert 0 < area.peak_held <= lay.capacity


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
        # what once passed: a NaN lease never ends, an address is no list, a name is
        # no file name, a bucket is a unit mistake, a manifest path is no manifest
        ({"timeout_s": float("nan")}, "trainer.timeout_s"),
        ({"timeout_s": float("inf")}, "trainer.timeout_s"),
        ({"timeout_s": 1e300}, "trainer.timeout_s"),
        ({"addresses": 5}, "trainer.addresses"),
        ({"addresses": None}, "trainer.addresses"),
        ({"addresses": {"127.0.0.1:1": 1}}, "trainer.addresses"),
        ({"addresses": ["127.0.0.1:99999"]}, "trainer.addresses"),
        ({"addresses": ["127.0.0.1"]}, "trainer.addresses"),
        ({"group": "a\x00b"}, "trainer.group"),
        ({"group": "g" * 300}, "trainer.group"),
        ({"bucket_bytes": 1 << 45}, "trainer.bucket_bytes"),
        ({"manifest": "/dev/zero"}, "trainer.manifest"),
        ({"manifest": "/nonexistent/manifest.json"}, "trainer.manifest"),
        ({"engine_nodes": "0,1"}, "trainer.engine_nodes"),
        ({"engine_nodes": [0, -1]}, "trainer.engine_nodes"),
        ({"engine_nodes": [0, True]}, "trainer.engine_nodes"),
        ({"engine_nodes": [0, 1.0]}, "trainer.engine_nodes"),
        ({"engine_nodes": [1 << 40]}, "trainer.engine_nodes"),
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
    if key == "trainer.manifest":  # a file: named as the file
        assert err.value.context.get("file") == change["manifest"], err.value.context
        assert str(err.value).startswith("trainer.manifest: ")
    else:
        assert err.value.context.get("key") == key, err.value.context
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "reason"),
    [(b'{"world": 1, "tensors": [', "not a JSON"), (b"\xff\xfe", "not a JSON"),
     (b"[" * 100000 + b"]" * 100000, "not a JSON")],
)  # fmt: skip
def test_a_manifest_file_that_is_no_json_is_one_line_naming_it(
    text: bytes, reason: str, tmp_path: Path
) -> None:
    from mxload.orchestrator.errors import InputError

    path = tmp_path / "manifest.json"
    path.write_bytes(text)
    with pytest.raises(InputError) as err:
        TrainerSource.from_json({**TRAINER, "manifest": str(path)})
    assert err.value.context.get("file") == str(path)
    assert reason in str(err.value) and "\n" not in str(err.value)


@pytest.fixture
def dtensor_mesh() -> Iterator[Any]:
    """A one-rank CPU device mesh (gloo on an in-memory store), for FSDP2-style DTensor
    parameters; the default process group is destroyed afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("write", ["optimizer step", "rebound", "optimizer step on a DTensor"])
def test_a_trainer_step_during_the_send_fails_the_update_naming_the_tensor(
    ckpt_factory, request: pytest.FixtureRequest, write: str
) -> None:
    """A parameter written while ``send_weights`` runs (after the first bucket left): by
    an optimizer step (in place; also on FSDP2-style DTensor parameters, given as they
    are), or rebound to new memory (``p.data = ...``). The
    trainer rank is told which tensor changed, the engine rank does not take the step
    (not consistent, identity the step it held), and the next update, once the group is
    formed again, repairs it. In process: one trainer rank, one engine rank, shm."""
    import os

    from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
    from mxload.orchestrator.plan.trainer import manifest_to_json
    from mxload.orchestrator.runtime.refit import MxloadSender

    from tests.integration.test_refit import on_threads
    from tests.unit.test_engine_ext import _engine_model

    src = ckpt_factory("qwen3-moe-tiny", seed=1)
    full = read_checkpoint(ckpt_factory("qwen3-moe-tiny", seed=1, bf16=True))
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 1)
    h = manifest.digest()
    layout = ParallelLayout(tp=1)
    meta = open_checkpoint(src)
    model = _engine_model(build_plan(meta.config, layout, checkpoint=meta).ranks[0])
    engine = Attachment(src, EngineFacts(layout, 0, 0, 0, "mxload", {}), engine_params(model))
    local = shards(full, 0, 1)
    if write.endswith("DTensor"):
        from torch.distributed.tensor import DTensor, Shard

        mesh = request.getfixturevalue("dtensor_mesh")
        local = {n: DTensor.from_local(t, mesh, [Shard(0)]) for n, t in local.items()}
    params = {n: torch.nn.Parameter(t) for n, t in local.items()}
    stepped = sorted(params)[-1]  # not the first tensor sent: the whole plan is walked
    params[stepped].grad = torch.ones_like(params[stepped])

    def optimizer_step() -> None:
        p = params[stepped]
        with torch.no_grad():
            if write == "rebound":
                p.data = p.data - 1.0
            else:  # SGD's update (torch.optim's own import costs seconds here)
                p.add_(p.grad, alpha=-1.0)

    def form() -> dict[str, Any]:
        group = f"refit-step-{os.getpid()}-{free_port()}"
        return {"transport": "shm", "world": 1, "manifest": manifest_to_json(manifest),
                "bucket_bytes": 1 << 20, "group": group, "timeout_s": 20}  # fmt: skip

    def join() -> MxloadSender:
        f = form()
        got = on_threads(
            [lambda: MxloadSender(src, layout, f, rank=0), lambda: engine.attach_trainer(f)]
        )
        assert not [g for g in got if isinstance(g, BaseException)], got
        return got[0]

    def update(sender: MxloadSender, n: int) -> list[Any]:
        with torch.no_grad():
            return on_threads([lambda: sender.send_weights(params, n), lambda: engine.refit(n, h)])

    sender = join()
    try:
        sent, got = update(sender, 1)
        assert not isinstance(sent, BaseException) and got["identity"] == f"1:trainer-{h}"
        assert engine.consistent

        transport = sender.sender.transport
        count = [0]

        def counted(real: Any) -> Any:
            def go(peer: int, message: Any) -> None:
                real(peer, message)
                count[0] += 1
                if count[0] == 2:  # the header and bucket 0 are out: the trainer steps
                    optimizer_step()

            return go

        # a message goes out through send, or (shm: packed in place) publish
        transport.send = counted(transport.send)  # type: ignore[method-assign]
        transport.publish = counted(transport.publish)  # type: ignore[method-assign]
        sent, got = update(sender, 2)
        assert count[0] > 3, "the step came before the send's end"
        assert isinstance(sent, RunError), sent
        assert f"trainer rank 0: tensor {stepped} changed while step 2" in str(sent)
        assert isinstance(got, RunError), got
        assert f"tensor {stepped} changed while step 2" in str(got)
        assert not engine.consistent
        assert not engine.status(checksums=False)["consistent"]
        assert engine.identity == f"1:trainer-{h}"  # the step it held before
        sender.close()

        sender = join()
        sent, got = update(sender, 3)
        assert not isinstance(sent, BaseException), sent
        assert not isinstance(got, BaseException), got
        assert engine.consistent and engine.identity == f"3:trainer-{h}"
    finally:
        sender.close()
        engine.close()


def test_a_sender_that_lands_pieces_elsewhere_is_refused_before_a_byte_lands(ckpt_factory) -> None:
    """The trainer rank cuts each bucket into messages by where the engine rank lands its
    pieces, worked out from its own copy of the engine plan. Where the two disagree (here
    the sender's copy is moved 64 bytes along the ring) the engine rank refuses the
    update at the header, naming the landing digest, with nothing written; the trainer
    rank's send fails too. In process: one trainer rank, one engine rank, shm."""
    import os
    from dataclasses import replace

    from mxload.orchestrator.errors import ReloadMismatch
    from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
    from mxload.orchestrator.plan.trainer import manifest_to_json
    from mxload.orchestrator.runtime.refit import MxloadSender
    from mxload.workers.transfer.exchange import _Landing

    from tests.integration.test_refit import on_threads
    from tests.unit.test_engine_ext import _engine_model

    src = ckpt_factory("qwen3-moe-tiny", seed=1)
    full = read_checkpoint(ckpt_factory("qwen3-moe-tiny", seed=1, bf16=True))
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 1)
    layout = ParallelLayout(tp=1)
    meta = open_checkpoint(src)
    model = _engine_model(build_plan(meta.config, layout, checkpoint=meta).ranks[0])
    engine = Attachment(src, EngineFacts(layout, 0, 0, 0, "mxload", {}), engine_params(model))
    group = f"refit-landing-{os.getpid()}-{free_port()}"
    form = {"transport": "shm", "world": 1, "manifest": manifest_to_json(manifest),
            "bucket_bytes": 1 << 20, "group": group, "timeout_s": 2}  # fmt: skip
    joined = on_threads(
        [lambda: MxloadSender(src, layout, form, rank=0), lambda: engine.attach_trainer(form)]
    )
    sender = joined[0]
    assert isinstance(sender, MxloadSender), joined
    try:
        held, was = engine.identity, engine.consistent
        lay = sender.sender.landing[0].layout
        moved = replace(lay, at=tuple(a + 64 for a in lay.at))
        sender.sender.landing[0] = _Landing(moved, sender.sender.links[(0, 0)])
        sent, got = on_threads(
            [
                lambda: sender.send_weights(shards(full, 0, 1), 1),
                lambda: engine.refit(1, manifest.digest()),
            ]
        )
        assert isinstance(got, ReloadMismatch), got
        assert "landing digest" in str(got) and "nothing was written" in str(got), got
        assert isinstance(sent, RunError), sent
        # the trainer is told in its own terms, not the transport's group members
        assert "trainer rank 0: sending " in str(sent), sent
        assert "of step 1 to engine rank 0 failed" in str(sent), sent
        assert (engine.identity, engine.consistent) == (held, was)
    finally:
        sender.close()
        engine.close()


def test_sender_side_conversion_quantizes_under_the_engines_scale_rule(ckpt_factory) -> None:
    """An engine that quantizes under scale rule 1 (docs/contract.md §2.2) only repacks
    what a trainer rank converts, so the trainer rank converts under rule 1 too: the
    refitted buffers equal the engine's own reload of the same BF16 weights, and differ
    from rule 0's. In process: one trainer rank, one engine rank, shm."""
    import os

    from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
    from mxload.orchestrator.plan.trainer import manifest_to_json
    from mxload.orchestrator.runtime.refit import MxloadSender

    from tests.integration.test_refit import on_threads
    from tests.unit.test_engine_ext import _engine_model

    src = ckpt_factory("qwen3-moe-tiny", seed=1)
    twin = ckpt_factory("qwen3-moe-tiny", seed=2, bf16=True)
    full = read_checkpoint(twin)
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 1)

    def refit_under(alg: int) -> dict[str, torch.Tensor]:
        layout = ParallelLayout(tp=1, scale_alg=alg)
        meta = open_checkpoint(src)
        model = _engine_model(build_plan(meta.config, layout, checkpoint=meta).ranks[0])
        facts = EngineFacts(layout, 0, 0, 0, "mxload", {})
        engine = Attachment(src, facts, engine_params(model))
        form = {"transport": "shm", "world": 1, "manifest": manifest_to_json(manifest),
                "convert_on": "sender", "bucket_bytes": 1 << 20,
                "group": f"refit-alg-{os.getpid()}-{free_port()}", "timeout_s": 20}  # fmt: skip
        joined = on_threads(
            [lambda: MxloadSender(src, layout, form, rank=0), lambda: engine.attach_trainer(form)]
        )
        sender = joined[0]
        assert isinstance(sender, MxloadSender), joined
        try:
            got = on_threads(
                [
                    lambda: sender.send_weights(shards(full, 0, 1), 1),
                    lambda: engine.refit(1, manifest.digest()),
                ]
            )
            assert not [g for g in got if isinstance(g, BaseException)], got
            refitted = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine.reload(twin)  # the engine converts the same BF16 weights itself
            for n, p in model.named_parameters():
                assert torch.equal(p.view(torch.uint8), refitted[n].view(torch.uint8)), (alg, n)
            return refitted
        finally:
            sender.close()
            engine.close()

    held = {alg: refit_under(alg) for alg in (0, 1)}
    assert any(
        not torch.equal(held[0][n].view(torch.uint8), held[1][n].view(torch.uint8)) for n in held[0]
    )


def test_a_sender_under_another_scale_rule_is_refused_when_it_converts(ckpt_factory) -> None:
    """The scale rule is part of the plan both ends check when the sender converts: a
    trainer rank planning the engine under rule 0 against an engine under rule 1 would
    hand it other bytes than its own reload, so the engine rank refuses the header
    (plan digest), nothing written. Converted on the receiver the engine quantizes
    under its own rule and the same pair refits. In process: one trainer rank, one
    engine rank, shm."""
    import os

    from mxload.orchestrator.errors import ReloadMismatch
    from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
    from mxload.orchestrator.plan.trainer import manifest_to_json
    from mxload.orchestrator.runtime.refit import MxloadSender

    from tests.integration.test_refit import on_threads
    from tests.unit.test_engine_ext import _engine_model

    src = ckpt_factory("qwen3-moe-tiny", seed=1)
    full = read_checkpoint(ckpt_factory("qwen3-moe-tiny", seed=1, bf16=True))
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 1)
    meta = open_checkpoint(src)
    engine_layout = ParallelLayout(tp=1, scale_alg=1)
    model = _engine_model(build_plan(meta.config, engine_layout, checkpoint=meta).ranks[0])
    facts = EngineFacts(engine_layout, 0, 0, 0, "mxload", {})
    engine = Attachment(src, facts, engine_params(model))

    def refit(convert_on: str, step: int) -> tuple[object, object]:
        form = {"transport": "shm", "world": 1, "manifest": manifest_to_json(manifest),
                "convert_on": convert_on, "bucket_bytes": 1 << 20, "timeout_s": 2,
                "group": f"refit-rule-{os.getpid()}-{free_port()}"}  # fmt: skip
        joined = on_threads(
            [
                lambda: MxloadSender(src, ParallelLayout(tp=1, scale_alg=0), form, rank=0),
                lambda: engine.attach_trainer(form),
            ]
        )
        sender = joined[0]
        assert isinstance(sender, MxloadSender), joined
        try:
            sent, got = on_threads(
                [
                    lambda: sender.send_weights(shards(full, 0, 1), step),
                    lambda: engine.refit(step, manifest.digest()),
                ]
            )
        finally:
            sender.close()
        return sent, got

    try:
        held, was = engine.identity, engine.consistent
        sent, got = refit("sender", 1)
        assert isinstance(got, ReloadMismatch), got
        assert "plan digest" in str(got) and "nothing was written" in str(got), got
        assert isinstance(sent, RunError), sent
        assert (engine.identity, engine.consistent) == (held, was)
        sent, got = refit("receiver", 2)
        assert not isinstance(got, BaseException), got
        assert not isinstance(sent, BaseException), sent
    finally:
        engine.close()


class _Allocations:
    """Peak bytes of the tensors torch allocates on this thread while in use: every op's
    output storage that is none of its inputs' is counted until it is freed (a finalizer
    on the storage, which outlives views and numpy arrays of it)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.held: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self.held.discard(ptr)
        self.live -= nbytes

    def mode(self) -> Any:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                given = {
                    x.untyped_storage().data_ptr()
                    for x in tree_leaves((args, kwargs))
                    if isinstance(x, torch.Tensor)
                }
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    st = t.untyped_storage()
                    ptr, nbytes = st.data_ptr(), st.nbytes()
                    if nbytes and ptr not in given and ptr not in counter.held:
                        counter.held.add(ptr)
                        counter.live += nbytes
                        counter.peak = max(counter.peak, counter.live)
                        weakref.finalize(st, counter._free, ptr, nbytes)
                return out

        return Mode()


@pytest.mark.parametrize("on_sender", [True, False], ids=["convert-on-sender", "bf16"])
def test_packing_a_bucket_holds_at_most_one_more_bucket(on_sender: bool) -> None:
    """A trainer rank's staging beyond its bucket buffer, measured: packing a bucket of
    K-split pieces (views with a row stride, converted to MXFP8 on the sender or not)
    allocates at most the buffer's size at any time (docs/contract.md §4 "Refit": a
    sender holds at most two buckets). Sent as they are, nothing is allocated."""
    from mxload.orchestrator.plan.refit import Transfer
    from mxload.workers.numerics.select import select_backend

    held = (2048, 6144)  # this rank holds K columns 2048..6144 of a [4096, 8192] tensor
    shard = torch.randn(4096, held[1] - held[0]).to(torch.bfloat16)
    cols = (3072, 6144)  # the receiver's K columns: 3072 of them, starting inside the shard
    width = cols[1] - cols[0]
    wire_row = width + width // 32 if on_sender else width * 2
    transfers = [
        Transfer(
            sender=0,
            receiver=0,
            tensor="w",
            rows=rows,
            cols=cols,
            shard_origin=(0, held[0]),
            nbytes=(rows[1] - rows[0]) * wire_row,
            source_bytes=(rows[1] - rows[0]) * width * 2,
            mx=True,
            on_sender=on_sender,
        )
        for rows in ((0, 2048), (2048, 4096))
    ]
    buf = torch.empty(sum(t.nbytes for t in transfers), dtype=torch.uint8).fill_(0)
    local = local_rect({"w": shard}, 0)
    backend = select_backend("cpu")
    assert backend.name == "cpu-fast"
    counted = _Allocations()
    with counted.mode():
        n = pack(transfers, local, buf, backend)
    assert n == buf.numel()
    if on_sender:
        assert 0 < counted.peak <= buf.numel(), counted.peak
    else:
        assert counted.peak == 0, counted.peak
    # what went on the wire is each piece as the receiver reads it
    at = 0
    for t in transfers:
        piece = shard[t.rows[0] : t.rows[1], t.cols[0] - held[0] : t.cols[1] - held[0]]
        if not on_sender:
            want = piece.contiguous().view(torch.uint8).reshape(-1)
        else:
            q, s = backend.mx_quantize(piece)
            want = torch.cat([q.view(torch.uint8).reshape(-1), s.reshape(-1)])
        assert torch.equal(buf[at : at + want.numel()], want)
        at += want.numel()


def test_a_trainer_tensor_unlike_its_manifest_is_refused_before_sending() -> None:
    """What send_weights checks first (``check_local``): the dtype and local shape the
    manifest places on the rank; fp32 master weights under a bfloat16 manifest, or a
    whole tensor where the rank holds a shard, name the tensor and rank."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.runtime.refit import check_local, local_tensors

    manifest = fsdp_manifest({"a.weight": (10, 64), "n.weight": (64,)}, 2)
    local = local_tensors(manifest, 1)
    assert local == {"a.weight": ("bfloat16", (5, 64)), "n.weight": ("bfloat16", (32,))}
    good = {"a.weight": torch.zeros(5, 64, dtype=torch.bfloat16), "other": torch.zeros(3)}
    check_local(good, local, 1)
    for bad, what in (
        (torch.zeros(5, 64), "float32 [5, 64]"),
        (torch.zeros(10, 64, dtype=torch.bfloat16), "bfloat16 [10, 64]"),
    ):
        with pytest.raises(InputError) as err:
            check_local({**good, "a.weight": bad}, local, 1)
        assert f"trainer rank 1: tensor 'a.weight' is {what}, the manifest places" in str(err.value)
        assert (err.value.context["tensor"], err.value.context["rank"]) == ("a.weight", 1)


@pytest.fixture(scope="module")
def worst_case(ckpt_factory) -> dict[str, Any]:
    """For the worst-case refit: the FP8 checkpoint the engine starts from, the BF16
    weights of another seed its trainer ranks send, their 3-rank FSDP manifest, and what
    every engine rank must hold after the refit (the reference model's, no mxload code)."""
    from tests.integration.test_refit import REF
    from tests.reference_model import RefCheckpoint, expected_rank

    src = ckpt_factory("qwen3-moe-tiny", seed=1)
    weights = ckpt_factory("qwen3-moe-tiny", seed=2, bf16=True)  # other values than src's
    full = read_checkpoint(weights)
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 3)
    ref, like = RefCheckpoint(weights), RefCheckpoint(src)
    want = [expected_rank(ref, REF, r, like=like) for r in range(4)]
    return {"src": src, "full": full, "manifest": manifest, "want": want}


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_three_senders_in_tiny_buckets_through_wrapping_rings_complete_byte_exact(
    worst_case: dict[str, Any], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst case of the streaming refit over a real transport: three trainer ranks
    (FSDP shards), each on its own thread, send the smallest buckets the trainer form
    allows but for a factor 4 (4 KiB: hundreds of buckets each) at once to four engine ranks (tp2 x
    dp2 + EP, Attachments in this process), each receiving through a ring a fraction of
    its need, so every ring wraps many times while all senders feed all receivers
    (``plan.refit.send_order``'s deadlock-freedom argument, on real links). A cycle of
    waits would end in the receive area's timeout naming a trainer rank, not a hang.
    Every rank then holds what the reference model makes of the BF16 weights. Every run
    of pieces lying side by side in a ring is its own message here (``messages``' least
    size 1 byte, not 1 MiB), received in place: between the ring's laps and the pinned
    region, runs are cut where the receive area cuts them."""
    import os

    from mxload.orchestrator.plan import refit as plan_refit

    monkeypatch.setattr(plan_refit, "MIN_DIRECT_BYTES", 1)

    from mxload.orchestrator.plan.trainer import manifest_to_json
    from mxload.orchestrator.runtime.refit import MxloadSender

    from tests.integration.test_refit import LAYOUT, Engine, on_threads
    from tests.reference_model import compare_rank

    src, full, manifest, want = (worst_case[k] for k in ("src", "full", "manifest", "want"))
    world = manifest.world
    h = manifest.digest()
    port = free_port()
    form: dict[str, Any] = {
        "transport": kind,
        "world": world,
        "manifest": manifest_to_json(manifest),
        "bucket_bytes": 1 << 12,
        "group": f"refit-worst-{os.getpid()}-{port}",
        "timeout_s": 30,
    }
    if kind == "gloo":
        form["addresses"] = [f"127.0.0.1:{port}"]
    engine = Engine(src)
    senders: list[MxloadSender] = []
    try:
        # not what the refit must bring already: a refit that moved nothing would fail
        assert all(compare_rank(want[r], engine.held(r)) for r in range(LAYOUT.world))
        joined = on_threads(
            [lambda s=s: MxloadSender(src, LAYOUT, form, rank=s) for s in range(world)]
            + [lambda a=a: a.attach_trainer(form) for a in engine.ranks]
        )
        senders = [j for j in joined[:world] if isinstance(j, MxloadSender)]
        assert not [j for j in joined if isinstance(j, BaseException)], joined
        # The case is the worst one: many buckets per link, and every engine rank's ring
        # (its own plan's) a fraction of what lands on it, so it wraps again and again.
        # every trainer rank feeds every engine rank (each engine rank keeps its links)
        assert {k for setup in joined[world:] for k in link_buckets(setup.refit)} == {
            (s, r) for s in range(world) for r in range(LAYOUT.world)
        }
        for r, setup in enumerate(joined[world:]):
            summary = setup.refit.summary
            assert min(summary.sender_buckets) > 250, summary.sender_buckets
            assert 0 < 4 * summary.receiver_ring[r] < summary.receiver_bytes[r], r
        params = [shards(full, s, world) for s in range(world)]
        got = on_threads(
            [lambda s=s: senders[s].send_weights(params[s], 1) for s in range(world)]
            + [lambda a=a: a.refit(1, h) for a in engine.ranks]
        )
        assert not [g for g in got if isinstance(g, BaseException)], got
        sent, received = got[:world], got[world:]
        for r, g in enumerate(received):
            assert compare_rank(want[r], engine.held(r)) == [], f"rank {r}"
            assert g["identity"] == f"1:trainer-{h}" and g["consistent"], g
            assert g["bytes_received"] == joined[world + r].refit.summary.receiver_bytes[r]
            assert 0 < g["receive_area_bytes"] < g["bytes_received"], g
            assert g["bytes_received_in_place"] == g["bytes_received"], g
        assert sum(s["bytes_sent"] for s in sent) == sum(g["bytes_received"] for g in received)
        # A delta of half the tensors: the runs the unchanged ones leave out are cut where
        # they were, on both ends alike.
        half = sorted(full)[::2]
        got = on_threads(
            [
                lambda s=s: senders[s].send_weights(params[s], 2, delta_of=1, changed=half)
                for s in range(world)
            ]
            + [lambda a=a: a.refit(2, h, delta_of=1) for a in engine.ranks]
        )
        assert not [g for g in got if isinstance(g, BaseException)], got
        for r, g in enumerate(got[world:]):
            assert compare_rank(want[r], engine.held(r)) == [], f"rank {r}"
            assert g["identity"] == f"2:trainer-{h}" and g["consistent"], g
            assert (
                0
                < g["bytes_received_in_place"]
                == g["bytes_received"]
                < received[r]["bytes_received"]
            ), g
    finally:
        for s in senders:
            s.close()
        engine.close()


@pytest.mark.parametrize(
    ("step", "delta_of", "changed", "key"),
    [
        (0, None, None, "step"),
        (-5, None, None, "step"),
        (True, None, None, "step"),
        (1.5, None, None, "step"),
        ("3", None, None, "step"),
        (1 << 63, None, None, "step"),
        (2, -1, [], "delta_of"),  # -1 is the header's word for "no delta"
        (2, 0, [], "delta_of"),
        (2, True, [], "delta_of"),
        (2, 1, "model.norm.weight", "changed"),
        (2, 1, [b"model.norm.weight"], "changed"),
    ],
)
def test_an_update_that_names_no_step_is_refused_on_either_side(
    step: Any, delta_of: Any, changed: Any, key: str
) -> None:
    """``send_weights`` and the engine's update take the same arguments through one
    check: a step or delta the header cannot carry is refused before anything is sent
    (a sender once sent them and learnt of it only at its lease's end)."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.runtime.refit import check_update

    with pytest.raises(InputError) as err:
        check_update(step, delta_of, changed)
    assert err.value.context.get("key") == key
    check_update((1 << 63) - 1, 1, ["model.norm.weight"])  # the widest that is fine


def test_engine_nodes_number_the_ranks_nodes_in_order_of_first_appearance() -> None:
    assert node_numbers(["b", "a", "b", "c", "a"]) == [0, 1, 0, 2, 1]
    assert node_numbers([]) == []
