"""Refit of a dense model whose trainer holds layers split along K (docs/contract.md §4
"Refit"): the dense half of the end-to-end refit tests (``test_refit.py`` is the MoE half,
FSDP dim-0 shards; its engine, trainer processes and helpers are reused here).

Two real trainer processes (``tests/refit_trainer.py``) hold Megatron-style shards of the
BF16 twin of ``qwen3-dense-tiny``: ``megatron_manifest`` splits the row-parallel
``o_proj`` / ``down_proj`` along dim 1 (K), the column-parallel linears, embedding and
head along dim 0, norms whole on both. At tp 2 the engine cuts the row-parallel layers at
the same column, so each engine part is one trainer's slice; the MLP's ``up_proj`` is held
K-split as well (a row-parallel placement the engine does not share), so the engine's
fused gate/up unit takes its ``up_proj`` columns from both trainer ranks, across a cut.
They push over gloo into an engine of four ranks (tp2 x dp2) in this process. What every
parameter must hold comes from ``tests/reference_model.py`` (no mxload code); it is also
compared with a checkpoint reload of the same BF16 weights, and with sender-side
conversion.
"""

from __future__ import annotations

import pytest
import torch
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.trainer import TrainerManifest, megatron_manifest
from mxload.orchestrator.plan.types import Plan
from mxload.orchestrator.runtime.catalog import open_checkpoint

from tests.integration.test_refit import (
    LAYOUT,
    Engine,
    assert_same_as_reload,
    assert_steps_exact,
    expected,
    join,
    shapes_of,
    step,
    trainer_form,
)
from tests.reference_model import compare_rank
from tests.refit_trainer import Trainers

pytestmark = pytest.mark.slow

PRESET = "qwen3-dense-tiny"
K_SPLIT = ("o_proj.weight", "down_proj.weight", "up_proj.weight")
"""Held along dim 1: Megatron's row-parallel layers, and ``up_proj`` (see the docstring)."""


@pytest.fixture(scope="module")
def ckpts(ckpt_factory) -> dict[str, str]:
    return {
        "fp8": ckpt_factory(PRESET, seed=1),
        "bf16-1": ckpt_factory(PRESET, seed=1, bf16=True),
        "bf16-2": ckpt_factory(PRESET, seed=2, bf16=True),
    }


@pytest.fixture(scope="module")
def manifest(ckpts) -> TrainerManifest:
    return megatron_manifest(shapes_of(ckpts["bf16-1"]), 2, row_parallel=K_SPLIT)


@pytest.fixture(scope="module")
def plan(ckpts) -> Plan:
    meta = open_checkpoint(ckpts["fp8"])
    return build_plan(meta.config, LAYOUT, checkpoint=meta)


@pytest.fixture(scope="module")
def trainers():
    t = Trainers(2)
    yield t
    t.close()


@pytest.fixture(scope="module")
def engine(ckpts, manifest, trainers):
    e = Engine(ckpts["fp8"])
    join(trainers, e, "A", ckpts, trainer_form(manifest))
    yield e
    e.close()


def k_cuts_inside_parts(plan: Plan, manifest: TrainerManifest) -> set[tuple[str, int, int, str]]:
    """(tensor, engine rank, column, unit layout) for every trainer cut along dim 1 that
    falls strictly inside an engine rank's part of a 2-D tensor: that part is assembled
    from two trainer ranks' K slices."""
    cuts = {
        t.name: [s.start for s in t.placement if s.dim == 1 and s.start > 0]
        for t in manifest.tensors
        if len(t.shape) == 2
    }
    out = set()
    for r in range(LAYOUT.world):
        for unit in plan.ranks[r].units:
            for part in unit.parts:
                for col in cuts.get(part.tensor_name, ()):
                    if part.cols[0] < col < part.cols[1]:
                        out.add((part.tensor_name, r, col, unit.layout))
    return out


def test_the_trainer_holds_k_slices_some_engine_part_crosses(plan, manifest):
    # So this file cannot quietly become a dim-0 test: Megatron's row-parallel layers are
    # dim-1 slices, and some engine rank's MXFP8 part is cut by a trainer's K slice.
    by_dim = {t.name: {s.dim for s in t.placement} for t in manifest.tensors if len(t.shape) == 2}
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    assert by_dim[o_proj] == by_dim[down] == {1}
    assert by_dim["model.layers.0.self_attn.q_proj.weight"] == {0}
    crossing = k_cuts_inside_parts(plan, manifest)
    assert ("model.layers.0.mlp.up_proj.weight", 0, 128, "mx_linear") in crossing
    assert {c[0].rsplit(".", 2)[-2] for c in crossing} == {"up_proj"}
    # Trainer rank 1's o_proj slice starts at column 128: its engine part is all of it.
    assert [(s.rank, s.start) for s in manifest.by_name()[o_proj].placement] == [(0, 0), (1, 128)]


def test_refits_are_byte_exact_in_place_and_equal_a_checkpoint_reload(
    engine, trainers, ckpts, manifest
):
    h = manifest.digest()
    assert_steps_exact(engine, trainers, ckpts, h, ((1, "bf16-2"), (2, "bf16-1")))
    assert_same_as_reload(engine, ckpts["fp8"], ckpts["bf16-1"])


def test_sender_side_conversion_of_k_slices_agrees_and_sends_fewer_bytes(
    engine, trainers, ckpts, manifest
):
    h = manifest.digest()
    mx_engine = Engine(ckpts["fp8"])
    join(trainers, mx_engine, "B", ckpts, trainer_form(manifest, "sender"))
    try:
        got, sent = step(trainers, mx_engine, "B", 1, ckpts["bf16-2"], h)
        assert not [g for g in got if isinstance(g, BaseException)], got
        assert all(s["ok"] for s in sent), sent
        got_bf16, ref_sent = step(trainers, engine, "A", 3, ckpts["bf16-2"], h)
        assert not [g for g in got_bf16 if isinstance(g, BaseException)], got_bf16
        want = expected(ckpts, "bf16-2")
        for r in range(LAYOUT.world):
            assert compare_rank(want[r], mx_engine.held(r)) == [], f"rank {r}"
            a, b = engine.held(r), mx_engine.held(r)
            assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
        mx_bytes = sum(s["bytes_sent"] for s in sent)
        bf16_bytes = sum(s["bytes_sent"] for s in ref_sent)
        assert mx_bytes == sum(g["bytes_received"] for g in got)
        assert mx_bytes < 0.75 * bf16_bytes, (mx_bytes, bf16_bytes)
    finally:
        mx_engine.close()
