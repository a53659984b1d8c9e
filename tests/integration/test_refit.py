"""Refit from the trainer's memory, end to end (docs/contract.md §4 "Refit").

Two real trainer processes (``tests/refit_trainer.py``) hold FSDP-style dim-0 shards of
the BF16 twin of ``qwen3-moe-tiny`` and push them over gloo into an engine of four ranks
(tp2 x dp2 + EP) hosted here, each rank an :class:`Attachment` over its own parameters,
driven on its own thread as a vLLM worker would be. The two data-parallel replicas of
each TP rank are said to share a node (``engine_nodes``): the second copies the buffers
both hold (attention, norms, the router) from the first once written. What every parameter must hold after
a refit comes from ``tests/reference_model.py`` (no mxload code); the same parameters
are also compared with a checkpoint reload of the same BF16 weights.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import ReloadMismatch, RunError
from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from safetensors import safe_open

from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank
from tests.refit_trainer import Trainers, free_port
from tests.unit.test_engine_ext import _engine_model

pytestmark = pytest.mark.slow

LAYOUT = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
REF = Layout(tp=2, dp=2, ep=True)
BUCKET = 64 << 10
NODES = [0, 1, 0, 1]
"""Engine ranks 0 and 2 (tp 0 of each replica) on one node, 1 and 3 on another."""


def shapes_of(path: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                for n in st.keys():
                    out[n] = tuple(st.get_slice(n).get_shape())
    return out


def on_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each on its own thread (as each vLLM worker runs its own call); the results,
    or the exception each raised."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as err:  # returned for the test to look at
            out[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


class Engine:
    """Four engine ranks in this process, each an Attachment over its own parameters."""

    def __init__(self, src: str) -> None:
        meta = open_checkpoint(src)
        plan = build_plan(meta.config, LAYOUT, checkpoint=meta)
        self.models = [_engine_model(plan.ranks[r]) for r in range(LAYOUT.world)]
        self.ranks = []
        for r, model in enumerate(self.models):
            dp, tp = divmod(r, LAYOUT.tp)
            facts = EngineFacts(LAYOUT, tp, 0, dp, "mxload", {})
            self.ranks.append(Attachment(src, facts, engine_params(model)))

    def attach(self, trainer: dict[str, Any]) -> list[Any]:
        return on_threads([lambda a=a: a.attach_trainer(trainer) for a in self.ranks])

    def refit(self, step: int, manifest_hash: str, **kw: Any) -> list[Any]:
        return on_threads([lambda a=a: a.refit(step, manifest_hash, **kw) for a in self.ranks])

    def held(self, r: int) -> dict[str, torch.Tensor]:
        return {
            n.replace(".routed_experts.", "."): p.data.contiguous()
            for n, p in self.models[r].named_parameters()
        }

    def ptrs(self) -> list[dict[str, int]]:
        return [{n: p.data_ptr() for n, p in m.named_parameters()} for m in self.models]

    def close(self) -> None:
        for a in self.ranks:
            a.close()


@pytest.fixture(scope="module")
def ckpts(ckpt_factory) -> dict[str, str]:
    return {
        "fp8": ckpt_factory("qwen3-moe-tiny", seed=1),
        "bf16-1": ckpt_factory("qwen3-moe-tiny", seed=1, bf16=True),
        "bf16-2": ckpt_factory("qwen3-moe-tiny", seed=2, bf16=True),
    }


@pytest.fixture(scope="module")
def manifest(ckpts):
    return fsdp_manifest(shapes_of(ckpts["bf16-1"]), 2)


@pytest.fixture(scope="module")
def trainers():
    t = Trainers(2)
    yield t
    t.close()


def trainer_form(
    manifest, convert_on: str = "receiver", nodes: list[int] | None = NODES
) -> dict[str, Any]:
    port = free_port()
    return {
        **({"engine_nodes": nodes} if nodes else {}),
        "transport": "gloo",
        "addresses": [f"127.0.0.1:{port}"],
        "world": 2,
        "manifest": manifest_to_json(manifest),
        "convert_on": convert_on,
        "bucket_bytes": BUCKET,
        "group": f"refit-test-{port}",
        "timeout_s": 10,
    }


def join(trainers: Trainers, engine: Engine, name: str, ckpts, form: dict[str, Any]) -> None:
    trainers.post(
        {
            "op": "join",
            "name": name,
            "src": ckpts["fp8"],
            "layout": {"tp": 2, "dp": 2, "enable_expert_parallel": True},
            "trainer": form,
        }
    )
    got = engine.attach(form)
    assert not [g for g in got if isinstance(g, BaseException)], got
    assert all(r["ok"] for r in trainers.replies()), "trainers could not join"


def step(
    trainers: Trainers, engine: Engine, name: str, n: int, weights: str, h: str, **kw: Any
) -> list[Any]:
    cmd = {"op": "send", "name": name, "step": n, "weights": weights}
    cmd.update({k: v for k, v in kw.items() if k in ("delta_of", "changed", "mix")})
    trainers.post(cmd)
    got = engine.refit(n, h, delta_of=kw.get("delta_of"))
    sent = trainers.replies()
    return [got, sent]


@pytest.fixture(scope="module")
def engine(ckpts, manifest, trainers):
    e = Engine(ckpts["fp8"])
    join(trainers, e, "A", ckpts, trainer_form(manifest))
    yield e
    e.close()


def expected(ckpts, which: str) -> list[dict[str, Any]]:
    ref, like = RefCheckpoint(ckpts[which]), RefCheckpoint(ckpts["fp8"])
    return [expected_rank(ref, REF, r, like=like) for r in range(LAYOUT.world)]


def assert_steps_exact(
    engine: Engine, trainers: Trainers, ckpts: dict[str, str], h: str, steps: Any
) -> None:
    """Each (step, weights) of ``steps`` refit in turn: every rank holds the reference of
    the weights, reads back as the step, moved no parameter; the bytes sent are the bytes
    received, and each rank's staging is what the plan predicted."""
    ptrs = engine.ptrs()
    want = {w: expected(ckpts, w) for w in {w for _, w in steps}}
    for n, w in steps:
        got, sent = step(trainers, engine, "A", n, ckpts[w], h)
        assert not [g for g in got if isinstance(g, BaseException)], got
        assert all(s["ok"] for s in sent), sent
        for r in range(LAYOUT.world):
            assert compare_rank(want[w][r], engine.held(r)) == [], f"step {n} rank {r}"
        assert {g["identity"] for g in got} == {f"{n}:trainer-{h}"}
        assert engine.ptrs() == ptrs, f"step {n} moved a parameter"
        # every byte a rank needs crossed once: what the senders sent is what was received
        assert sum(s["bytes_sent"] for s in sent) == sum(g["bytes_received"] for g in got)
        # the second replica on each node took its shared buffers from the first: their
        # bytes, as held (MXFP8 for attention), not the trainer's again
        copied = [g["bytes_copied"] for g in got]
        assert copied[:2] == [0, 0] and all(c > 0 for c in copied[2:]), copied
        assert all(got[r]["bytes_received"] < got[r - 2]["bytes_received"] for r in (2, 3))
        # The plan's receiver staging is what each rank held: its loader pool's high water
        # and what receiving holds (allocated once: ring, pinned region, link buffers; not
        # the rank's whole need).
        for g in got:
            measured, predicted = g["measured_peak_staging_bytes"], g["predicted_staging_bytes"]
            if not g["bytes_received"]:  # copies all it holds (a dense model's replica)
                assert measured == predicted == g["receive_area_bytes"] == 0, g
                continue
            assert 0 < measured <= predicted <= 1.10 * measured, (g["rank"], measured, predicted)
            assert 0 < g["receive_area_bytes"] < g["bytes_received"], g
    assert all(a.status(checksums=False)["consistent"] for a in engine.ranks)


def assert_same_as_reload(engine: Engine, fp8: str, weights: str) -> None:
    """A checkpoint reload of the same BF16 weights writes the same bytes."""
    other = Engine(fp8)
    try:
        for a in other.ranks:
            a.reload(weights)
        for r in range(LAYOUT.world):
            a, b = engine.held(r), other.held(r)
            assert [
                n for n in a if not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))
            ] == []
    finally:
        other.close()


def test_refits_are_byte_exact_in_place_and_read_back_as_the_step(
    engine, trainers, ckpts, manifest
):
    h = manifest.digest()
    assert_steps_exact(engine, trainers, ckpts, h, ((1, "bf16-2"), (2, "bf16-1"), (3, "bf16-2")))
    assert_same_as_reload(engine, ckpts["fp8"], ckpts["bf16-2"])


def test_sender_side_conversion_agrees_and_sends_fewer_bytes(engine, trainers, ckpts, manifest):
    h = manifest.digest()
    mx_engine = Engine(ckpts["fp8"])
    join(trainers, mx_engine, "B", ckpts, trainer_form(manifest, "sender"))
    try:
        got, sent = step(trainers, mx_engine, "B", 1, ckpts["bf16-1"], h)
        assert not [g for g in got if isinstance(g, BaseException)], got
        _, ref_sent = step(trainers, engine, "A", 4, ckpts["bf16-1"], h)
        want = expected(ckpts, "bf16-1")
        for r in range(LAYOUT.world):
            assert compare_rank(want[r], mx_engine.held(r)) == []
            a, b = engine.held(r), mx_engine.held(r)
            assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
        mx_bytes = sum(s["bytes_sent"] for s in sent)
        bf16_bytes = sum(s["bytes_sent"] for s in ref_sent)
        assert mx_bytes < 0.75 * bf16_bytes, (mx_bytes, bf16_bytes)
    finally:
        mx_engine.close()


def test_delta_restamps_unchanged_tensors(engine, trainers, ckpts, manifest):
    h = manifest.digest()
    got, _ = step(trainers, engine, "A", 5, ckpts["bf16-1"], h)
    assert not [g for g in got if isinstance(g, BaseException)], got
    full = sum(g["bytes_received"] for g in got)
    layer1 = [t.name for t in manifest.tensors if ".layers.1." in t.name]
    got, _ = step(
        trainers,
        engine,
        "A",
        6,
        ckpts["bf16-1"],
        h,
        delta_of=5,
        changed=layer1,
        mix={"from": ckpts["bf16-2"], "tensors": layer1},
    )
    assert not [g for g in got if isinstance(g, BaseException)], got
    delta = sum(g["bytes_received"] for g in got)
    assert 0 < delta < full / 2
    one, two = expected(ckpts, "bf16-1"), expected(ckpts, "bf16-2")
    for r in range(LAYOUT.world):
        mine = engine.held(r)
        new = {n for n in mine if ".layers.1." in n}
        assert compare_rank({n: two[r][n] for n in new}, {n: mine[n] for n in new}) == []
        old = set(mine) - new
        assert compare_rank({n: one[r][n] for n in old}, {n: mine[n] for n in old}) == []
    assert {g["identity"] for g in got} == {f"6:trainer-{h}"}
    # Units reading only unchanged tensors were re-stamped, not converted and written;
    # the second replica copied layer 1's shared buffers (and only those) whole.
    for a, g in zip(engine.ranks, got, strict=True):
        touched = [
            u for u in a.loader.plan.units if any(".layers.1." in p.tensor_name for p in u.parts)
        ]
        if g["rank"] < 2:
            assert 0 < g["units_written"] == len(touched) < len(a.loader.plan.units)
            assert g["bytes_copied"] == 0
        else:
            assert 0 < g["units_written"] < len(touched)
            layer1 = {u.buffer for u in touched}
            held = sum(t.numel() * t.element_size() for n, t in a.loader.buffers.items()
                       if n.removesuffix("_scale") in layer1)  # fmt: skip
            assert 0 < g["bytes_copied"] < held
    assert all(a.status(checksums=False)["consistent"] for a in engine.ranks)

    # A delta of a step the engine does not hold is refused before anything is received.
    sums = [a.status()["tensors"] for a in engine.ranks]
    refused = engine.refit(7, h, delta_of=5)
    assert all(isinstance(g, ReloadMismatch) and "delta of step 5" in str(g) for g in refused)
    assert [a.status()["tensors"] for a in engine.ranks] == sums


def test_a_changed_manifest_is_refused_with_nothing_touched(engine, manifest):
    before = [a.status() for a in engine.ranks]
    shapes = {t.name: t.shape for t in manifest.tensors}
    changed = fsdp_manifest(shapes, 2, dtype="float16")
    got = engine.refit(7, changed.digest())
    assert all(isinstance(g, ReloadMismatch) for g in got)
    assert "manifest hash" in str(got[0]) and "nothing was touched" in str(got[0])
    after = [a.status() for a in engine.ranks]
    assert [s["tensors"] for s in after] == [s["tensors"] for s in before]
    assert [s["identity"] for s in after] == [s["identity"] for s in before]


def test_a_killed_sender_is_named_and_leaves_inconsistent_until_the_next_update(
    engine, trainers, ckpts, manifest
):
    h = manifest.digest()
    # A group of its own whose waits are short: the engine rank the dead trainer rank never
    # sent a header to waits that long for it (the default's 10 s, 5 s here).
    join(trainers, engine, "K", ckpts, {**trainer_form(manifest), "timeout_s": 5})
    trainers.post({"op": "send", "name": "K", "step": 7, "weights": ckpts["bf16-2"]}, [0])
    trainers.post(
        {"op": "send", "name": "K", "step": 7, "weights": ckpts["bf16-2"], "die_after": 3}, [1]
    )
    got = engine.refit(7, h)
    trainers.replies([0])
    assert trainers.procs[1].wait(timeout=30) != 0
    assert all(isinstance(g, RunError) for g in got), got
    msgs = [str(g) for g in got]
    assert all("trainer rank 1" in m for m in msgs), msgs
    # it died after three sends: its headers to engine ranks 0-2 (headers go first)
    assert any("bucket 0 of" in m or "waited" in m for m in msgs), msgs
    assert any("sent no header" in m for m in msgs), msgs
    status = [a.status(checksums=False) for a in engine.ranks]
    assert not any(s["consistent"] for s in status)
    assert all(
        s["units"]["stale_count"] == len(a.loader.plan.units)
        for s, a in zip(status, engine.ranks, strict=True)
    )

    # Bytes of the failed step may still be on the links: no update goes through the group
    # until it is formed again (refused before anything is received).
    again = engine.refit(8, h)
    assert all(
        isinstance(g, RunError) and "initialise the weight transfer again" in str(g) for g in again
    )

    # The trainer restarts its rank, both sides form the group again, the next step repairs.
    trainers.start(1)
    join(trainers, engine, "A", ckpts, trainer_form(manifest))
    got, _ = step(trainers, engine, "A", 8, ckpts["bf16-2"], h)
    assert not [g for g in got if isinstance(g, BaseException)], got
    want = expected(ckpts, "bf16-2")
    for r in range(LAYOUT.world):
        assert compare_rank(want[r], engine.held(r)) == []
    assert all(a.status(checksums=False)["consistent"] for a in engine.ranks)
    assert {a.identity for a in engine.ranks} == {f"8:trainer-{h}"}


def test_a_stopped_sender_past_the_wait_leaves_inconsistent_and_is_told_it_failed(
    engine, trainers, ckpts, manifest
):
    h = manifest.digest()
    join(trainers, engine, "S", ckpts, {**trainer_form(manifest), "timeout_s": 3})
    before = [a.status()["tensors"] for a in engine.ranks]
    trainers.post({"op": "send", "name": "S", "step": 20, "weights": ckpts["bf16-1"]}, [0])
    trainers.post(
        {"op": "send", "name": "S", "step": 20, "weights": ckpts["bf16-1"], "stop_after": 3}, [1]
    )
    got = engine.refit(20, h)
    # Every engine rank is told, naming the trainer rank it waited for: the stopped one,
    # or the live one, itself held up by a rank that waits for the stopped one (one
    # thread feeds them all, interleaved); the stopped one is named.
    assert all(isinstance(g, RunError) and "trainer rank " in str(g) for g in got), got
    assert any("trainer rank 1" in str(g) for g in got), got
    # A rank may have written the units whose bytes all came before the stop (units are
    # converted as they land): those hold no step, and every rank says it is not at one.
    status = [a.status() for a in engine.ranks]
    assert not any(s["consistent"] for s in status)
    for a, s, b in zip(engine.ranks, status, before, strict=True):
        written = [n for n in b if s["tensors"][n]["checksum"] != b[n]["checksum"]]
        assert a.loader.unit_status()["stale_count"] == len(a.loader.plan.units), written
    # The update failed as a whole: the live trainer rank is told too (its next send to
    # an engine rank that left the group fails), and the stopped rank, resumed, is told.
    os.kill(trainers.procs[1].pid, signal.SIGCONT)
    first, second = trainers.replies()
    assert not first["ok"] and "trainer rank 0: sending" in first["error"], first
    assert not second["ok"] and "trainer rank 1: sending" in second["error"], second
