"""A plan made once per rank class equals the plan made rank by rank.

The expected values (``golden/plan_per_rank.json``) were produced by the per-rank
planner, sharing and time model before they worked on classes (commit f309478;
``golden/make_plan_per_rank.py`` says how): every rank's ``plan --json`` entry, and per
rank its predicted seconds, requests, bytes from storage, from peers, from other nodes,
published and fetched for sharing, under every share scope, for small layouts of the
packaged models (TP-sharded and expert-parallel experts, pipeline stages, replicated kv
heads, nodes of three ranks) and for synthetic checkpoints with byte ranges.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan, plan_to_json
from mxload.orchestrator.plan.ranges import ROW_REMOTE_POLICY
from mxload.orchestrator.plan.timemodel import Rates, plan_times
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "plan_per_rank.json").read_text())
SCOPES = ("none", "node", "cluster")


def same(got: Any, want: Any, path: str = "") -> list[str]:
    """Where ``got`` and ``want`` differ (floats to 1e-9 relative)."""
    if isinstance(got, float) or isinstance(want, float):
        ok = isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)
        return [] if ok else [f"{path}: {got!r} != {want!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        return [
            d
            for k in sorted(set(got) | set(want))
            for d in same(got.get(k), want.get(k), f"{path}.{k}")
        ]
    if isinstance(want, list) and isinstance(got, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items != {len(want)}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in same(g, w, f"{path}[{i}]")
        ]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def per_rank(got: dict[str, Any]) -> list[list[Any]]:
    return [
        [
            t.load_seconds,
            t.requests,
            tr.bytes_from_storage,
            tr.bytes_from_peers,
            tr.bytes_from_other_nodes,
            tr.shared_put_bytes,
            tr.bytes_fetched_for_sharing,
        ]
        for t, tr in zip(got["times"], got["traffic"], strict=True)
    ]


def check_times(plan, config, want: dict[str, Any], *, local: bool, rates: Rates) -> list[str]:
    # The per-rank code read every K-split row on its own from an object store.
    policy = None if local else ROW_REMOTE_POLICY
    diffs = []
    for scope, expected in want.items():
        got = plan_times(
            plan, config, rates=rates, scope=scope, devices_per_node=3, local=local, policy=policy
        )
        diffs += same(per_rank(got), expected["ranks"], f"{scope}.ranks")
        # every total the per-rank code gave (later ones are new)
        totals = {k: got[k] for k in expected["totals"]}
        diffs += same(totals, expected["totals"], f"{scope}.totals")
    return diffs


@pytest.mark.parametrize(
    "case", GOLDEN["cases"], ids=[f"{c['config']}-{c['layout']}" for c in GOLDEN["cases"]]
)
def test_config_plan_per_class_equals_per_rank(case: dict[str, Any]) -> None:
    config = parse_config(GOLDEN["configs"][case["config"]], case["config"])
    plan = build_plan(config, ParallelLayout(**case["layout"]), device="npu")
    diffs = same(plan_to_json(plan), case["plan"], "plan")
    if case["config"] == "dense":  # data-parallel replicas are one class
        assert len(plan.classes) == plan.layout.tp * plan.layout.pp
    for local in (True, False):
        want = {
            scope: case["times"][f"{scope}-{'local' if local else 'remote'}"] for scope in SCOPES
        }
        # the per-rank code had no per-unit wait (Rates.unit_waits)
        rates = Rates(request_latency=0.0001 if local else 0.01, convert=20e9, unit_waits=False)
        diffs += check_times(plan, config, want, local=local, rates=rates)
    assert not diffs, "\n".join(diffs[:20])


@pytest.mark.parametrize(
    "case",
    GOLDEN["checkpoint_cases"],
    ids=[f"{c['preset']}-{c['layout']}" for c in GOLDEN["checkpoint_cases"]],
)
def test_checkpoint_plan_per_class_equals_per_rank(ckpt_factory, case: dict[str, Any]) -> None:
    meta = open_checkpoint(ckpt_factory(case["preset"], 3))
    plan = build_plan(meta.config, ParallelLayout(**case["layout"]), checkpoint=meta)
    diffs = same(plan_to_json(plan), case["plan"], "plan")
    diffs += check_times(
        plan,
        meta.config,
        case["times"],
        local=True,
        rates=Rates(request_latency=0.0001, unit_waits=False),
    )
    assert not diffs, "\n".join(diffs[:20])


def test_lazy_ranks_are_the_classes_units() -> None:
    """A config-only plan builds a rank's units when asked: every expert of every layer,
    in local order, as many as the class says, and the same objects' content per class."""
    case = GOLDEN["cases"][0]
    config = parse_config(GOLDEN["configs"][case["config"]], case["config"])
    plan = build_plan(config, ParallelLayout(tp=2, dp=2), device="npu")
    for s in plan.summaries:
        rp = plan.ranks[s.rank]
        k = plan.classes[s.rank_class]
        assert (rp.rank, rp.tp_rank, rp.dp_rank) == (s.rank, s.tp_rank, s.dp_rank)
        assert len(rp.units) == k.unit_count
        moe = [u for u in rp.units if u.kind == "moe_w2"]
        # 3 layers x 8 experts, each the rank's quarter of the intermediate columns.
        assert len(moe) == 3 * 8
        assert {u.global_expert for u in moe} == set(range(8))
        assert {u.parts[0].cols for u in moe} == {
            (192 * (2 * s.dp_rank + s.tp_rank), 192 * (2 * s.dp_rank + s.tp_rank + 1))
        }
