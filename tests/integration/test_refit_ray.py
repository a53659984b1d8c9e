"""The refit's Ray object-store transport on the shared local Ray: messages in order, and
a sender that never sends is named after the timeout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import RunError
from mxload.workers.transfer.transports import RayTransport

from tests.unit.test_refit_transfer import MESSAGES, _exchange

pytestmark = pytest.mark.ray


def test_ray_transport_moves_messages_in_order_and_names_a_silent_sender(local_ray) -> None:
    got = _exchange(lambda m: RayTransport(m, group="refit-test", prefault_bytes=1 << 16), MESSAGES)
    assert all(torch.equal(a, b) for a, b in zip(MESSAGES, got, strict=True))
    rx = RayTransport(1, group="refit-test", timeout_s=1)
    with pytest.raises(RunError, match="no message from member 0"):
        rx.recv(0, torch.empty(4, dtype=torch.uint8))
    rx.close()


def test_session_refits_from_trainer_ranks(local_ray, ckpt_factory) -> None:
    """``Session`` (Ray actors as the engine's ranks) takes the same trainer form: each
    actor joins the refit group and receives its own bytes (and copies buffers from the
    other replica of its node); two trainer ranks (threads of this process) push FSDP
    shards of the BF16 twin over Ray's object store; every rank holds the independent
    reference of it, at the step, at the addresses of the load."""
    import threading

    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.refit import refit_summary
    from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.orchestrator.runtime.refit import MxloadSender
    from mxload.orchestrator.runtime.session import Session

    from tests.integration.test_reload import LAY, LAYOUT, assert_holds
    from tests.refit_trainer import free_port, read_checkpoint, shards

    fp8 = ckpt_factory("qwen3-moe-tiny", 1)
    twin = ckpt_factory("qwen3-moe-tiny", seed=2, bf16=True)
    full = read_checkpoint(twin)
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 2)
    port = free_port()
    form = {
        # the object store, and ranks 0 and 2 (one TP rank of each replica) said to share
        # a node, 1 and 3 another: the second replica copies what both hold alike
        "transport": "ray",
        "engine_nodes": [0, 1, 0, 1],
        "world": 2,
        "manifest": manifest_to_json(manifest),
        "bucket_bytes": 1 << 16,
        "group": f"session-{port}",
        "timeout_s": 60,
    }
    senders: list[Any] = [None, None]
    sent: list[dict[str, Any]] = [{}, {}]

    def join(r: int) -> None:
        senders[r] = MxloadSender(fp8, LAYOUT, form, rank=r)

    def send(r: int, step: int) -> None:
        sent[r] = senders[r].send_weights(shards(full, r, 2), step)

    with Session.load(fp8, LAYOUT, device="cpu") as s:
        assert s.engine_nodes() == [0] * LAYOUT.world  # one local Ray node
        first = {r["rank"]: r["tensors"] for r in s.manifest["ranks"]}
        if not torch.cuda.is_available():
            # a device transport on ranks without the device: a rank named in one line,
            # at once (not after waiting for the trainer), and the real form joins after
            with pytest.raises(RunError, match=r"^rank \d: engine rank \d: transport 'nccl' "):
                s.attach_trainer({**form, "transport": "nccl"})
        threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        s.attach_trainer(form)
        for t in threads:
            t.join(timeout=60)
        threads = [threading.Thread(target=send, args=(r, 7)) for r in range(2)]
        for t in threads:
            t.start()
        manifest_out = s.refit(7, manifest.digest())
        for t in threads:
            t.join(timeout=60)
        assert_holds(s, twin, like=fp8, lay=LAY)
        status = s.status()
        assert status["consistent"], status["problems"]
        assert status["identity"]["version"] == 7
        assert status["identity"]["fingerprint"] == f"trainer-{manifest.digest()}"
        for r in manifest_out["ranks"]:
            assert {n: t["data_ptr"] for n, t in r["tensors"].items()} == {
                n: t["data_ptr"] for n, t in first[r["rank"]].items()
            }
        for x in senders:
            x.close()
    # what crossed is the plan's, less than every rank receiving all it holds
    plan = build_plan(open_checkpoint(fp8).config, LAYOUT)
    with_copies = refit_summary(plan, manifest, receiver_nodes=(0, 1, 0, 1))
    without = refit_summary(plan, manifest, receiver_nodes=(0, 1, 0, 1), fanout=False)
    assert sum(x["bytes_sent"] for x in sent) == with_copies.wire_bytes < without.wire_bytes
