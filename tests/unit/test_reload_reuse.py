"""A reload from a checkpoint with the last reload's header layout reuses its plan
(``runtime.reload.reload_inputs``): the same reads, units and budgets a fresh plan gives,
under the new checkpoint's own identity; anything else a plan depends on plans again."""

from __future__ import annotations

import shutil

import pytest
from mxload.orchestrator.errors import ReloadMismatch
from mxload.orchestrator.plan import planner
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.reload import LAST_RELOAD, reload_inputs
from safetensors.torch import load_file, save_file

LAYOUT = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the plans built (the reload's planning, not a cached hit)."""
    calls: list[int] = []
    real = planner.build_plan

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "build_plan", counting)
    LAST_RELOAD.clear()
    yield calls
    LAST_RELOAD.clear()


def _held(src: str):
    meta = open_checkpoint(src)
    return planner.build_plan(meta.config, LAYOUT, checkpoint=meta, device="cpu")


def _same_inputs(a, b) -> None:
    assert a.reads == b.reads and a.units == b.units and a.budgets == b.budgets


def test_same_layout_reuses_the_plan_under_the_new_identity(ckpt_factory, planned) -> None:
    v1, v2, v3 = (ckpt_factory("qwen3-moe-tiny", seed) for seed in (1, 2, 3))
    held = _held(v1)
    planned.clear()
    first = reload_inputs(held, v2)
    assert len(planned) == 1
    again = reload_inputs(held, v3)
    assert len(planned) == 1, "v3 has v2's header layout: its plan is the last one"
    assert again.source.root == v3 and again.source.fingerprint != first.source.fingerprint
    assert again.source.fingerprint == reload_inputs(held, v3).source.fingerprint
    LAST_RELOAD.clear()
    fresh = reload_inputs(held, v3)
    assert len(planned) == 2
    _same_inputs(again, fresh)
    assert again.source == fresh.source


def test_another_layout_budget_or_held_plan_plans_again(ckpt_factory, planned, tmp_path) -> None:
    v1, v2 = ckpt_factory("qwen3-moe-tiny", 1), ckpt_factory("qwen3-moe-tiny", 2)
    held = _held(v1)
    planned.clear()
    reload_inputs(held, v2)
    # the BF16 twin: other dtypes and offsets, the same buffers
    twin = ckpt_factory("qwen3-moe-tiny", 2, bf16=True)
    got = reload_inputs(held, twin)
    assert len(planned) == 2
    LAST_RELOAD.clear()
    _same_inputs(got, reload_inputs(held, twin))
    # a shard rewritten with a longer header (the same tensors, every one further on)
    moved = tmp_path / "moved"
    shutil.copytree(v2, moved)
    shard = sorted(moved.glob("*.safetensors"))[0]
    save_file(load_file(shard), shard, metadata={"format": "pt", "step": "7"})
    reload_inputs(held, v2)
    n = len(planned)
    reload_inputs(held, str(moved))
    assert len(planned) == n + 1
    # a staging budget of its own, then another held plan of the same model
    reload_inputs(held, str(moved), staging_budget=1 << 30)
    assert len(planned) == n + 2
    reload_inputs(_held(v1), str(moved), staging_budget=1 << 30)
    assert len(planned) == n + 4  # the held plan, then the reload's


def test_a_mismatched_checkpoint_is_refused_after_a_reuse(ckpt_factory, planned) -> None:
    v1, v2 = ckpt_factory("qwen3-moe-tiny", 1), ckpt_factory("qwen3-moe-tiny", 2)
    held = _held(v1)
    reload_inputs(held, v2)
    reload_inputs(held, v1)
    other = ckpt_factory("qwen3-dense-tiny", 1)
    with pytest.raises(ReloadMismatch, match="nothing was touched"):
        reload_inputs(held, other)
    # the refused plan is not kept: the last good one still serves
    n = len(planned)
    reload_inputs(held, v2)
    assert len(planned) == n


def test_the_kept_plan_goes_with_the_held_plan(ckpt_factory, planned) -> None:
    import gc
    import weakref

    held = _held(ckpt_factory("qwen3-moe-tiny", 1))
    inputs = weakref.ref(reload_inputs(held, ckpt_factory("qwen3-moe-tiny", 2)))
    gc.collect()
    assert inputs() is not None  # kept for the next reload of this session
    del held
    gc.collect()
    assert inputs() is None
