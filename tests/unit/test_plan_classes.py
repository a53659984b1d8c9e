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
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.engines import MXLOAD, MoEMode
from mxload.orchestrator.plan.planner import build_plan, plan_to_json
from mxload.orchestrator.plan.ranges import ROW_REMOTE_POLICY
from mxload.orchestrator.plan.timemodel import Rates, plan_times
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "plan_per_rank.json").read_text())

GOLDEN_RULES = replace(
    MXLOAD,
    moe=MoEMode("flashinfer_all2allv", (), sp_replicates_shared=False),
    dense_linears={"DeepseekV3ForCausalLM": ("self_attn.kv_b_proj",)},
)
"""The rules the per-rank code of the golden file planned by, as a profile: DeepSeek's
kv_b_proj in the model dtype and shared experts always TP-split (today's mxload profile
follows plain vLLM: kv_b_proj MXFP8, shared experts whole under sequence-parallel MoE)."""
NEW_KEYS = ("moe_mode", "scale_alg")
"""``plan --json`` keys the per-rank code did not write."""


def golden_json(plan: Any) -> dict[str, Any]:
    obj = plan_to_json(plan)
    for key in NEW_KEYS:
        obj.pop(key, None)
    return obj


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
    plan = build_plan(config, ParallelLayout(**case["layout"]), device="npu", engine=GOLDEN_RULES)
    diffs = same(golden_json(plan), case["plan"], "plan")
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
    plan = build_plan(
        meta.config, ParallelLayout(**case["layout"]), checkpoint=meta, engine=GOLDEN_RULES
    )
    diffs = same(golden_json(plan), case["plan"], "plan")
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


def _small(name: str, **over: Any) -> Any:
    from mxload.orchestrator.runtime.models import model_config

    raw = dict(model_config(name))
    raw.update(over)
    return parse_config(raw, name)


KIND_CASES = [
    # Experts TP-sharded over dp*tp: slices at different offsets within their scale tiles
    # (192 rows from 0, 192, 384, 576) are one kind; 48-row slices cover one or two tiles.
    ("moe", {"tp": 1, "dp": 4}),
    ("moe", {"tp": 2, "dp": 8}),
    ("moe", {"tp": 2, "dp": 6, "pp": 2}),
    # Expert parallel: 8 experts over 6 ranks (two of them hold two).
    ("ds", {"tp": 2, "dp": 3, "enable_expert_parallel": True}),
    ("ds", {"tp": 1, "dp": 8, "enable_expert_parallel": True, "pp": 2}),
]


def _kind_config(name: str) -> Any:
    if name == "moe":
        return _small(
            "qwen3-30b-a3b-fp8", num_hidden_layers=2, num_experts=8, moe_intermediate_size=768
        )
    return _small(
        "deepseek-v3",
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_nextn_predict_layers=0,
    )


@pytest.mark.parametrize("case", KIND_CASES, ids=[f"{c}-{lay}" for c, lay in KIND_CASES])
def test_kinds_equal_classes_per_moe_rank(case: tuple[str, dict[str, Any]]) -> None:
    """A config-only plan made once per kind (ranks whose experts differ but not their
    shapes) gives every rank the JSON entry, traffic and time, and units, that the plan
    made once per stage, TP rank and MoE rank gives (the path the golden file checks)."""
    from mxload.orchestrator.plan.planner import _build_plan, plan_rank

    name, lay = case
    config = _kind_config(name)
    layout = ParallelLayout(**lay)
    common: dict[str, Any] = {
        "checkpoint": None,
        "staging_budget": None,
        "device_memory": None,
        "device": "npu",
        "remote": False,
    }
    fast = _build_plan(config, layout, **common)
    slow = _build_plan(config, layout, **common, by_kind=False)
    assert len(fast.classes) < len(slow.classes)  # kinds merged MoE ranks
    diffs = same(plan_to_json(fast), plan_to_json(slow), "plan")
    for local in (True, False):
        rates = Rates(request_latency=0.0001 if local else 0.01, convert=20e9)
        for scope in SCOPES:
            got, want = (
                plan_times(p, config, rates=rates, scope=scope, devices_per_node=3, local=local)
                for p in (fast, slow)
            )
            diffs += same(per_rank(got), per_rank(want), f"{scope}-{local}.ranks")
            keys = [k for k in want if k not in ("times", "traffic")]
            diffs += same({k: got[k] for k in keys}, {k: want[k] for k in keys}, f"{scope}")
    for rank in (0, layout.world // 2 + 1, layout.world - 1):
        assert fast.ranks[rank].units == plan_rank(config, layout, rank)[1]
    assert not diffs, "\n".join(diffs[:20])


@pytest.mark.parametrize("case", KIND_CASES[:3], ids=[f"{c}-{lay}" for c, lay in KIND_CASES[:3]])
def test_kinds_traffic_equals_rank_by_rank_sharing(case: tuple[str, dict[str, Any]]) -> None:
    """Under an object store's policy, experts sharded over dp x tp are read as whole
    rows that those ranks share: the traffic the time model gives over kinds equals
    read-once sharing run rank by rank over each rank's own units (``plan_sharing``)."""
    from mxload.orchestrator.plan.ranges import REMOTE_POLICY
    from mxload.orchestrator.plan.readplan import estimated_fetch, share_key
    from mxload.orchestrator.plan.sharing import plan_sharing, rank_traffic

    name, lay = case
    config = _kind_config(name)
    layout = ParallelLayout(**lay)
    plan = build_plan(config, layout, device="npu")
    whole = REMOTE_POLICY.whole_rows
    keys: dict[Any, int] = {}

    def items_of(rank: int) -> list[tuple[Any, int, int]]:
        out = []
        for u in plan.ranks[rank].units:
            key = keys.setdefault(share_key(u, whole=whole), len(keys))
            nbytes = estimated_fetch(u, config, whole=whole)
            out.append((key, nbytes, nbytes))
        return out

    nodes = [f"node{r // 3}" for r in range(layout.world)]
    for scope in SCOPES:
        got = plan_times(plan, config, rates=Rates(), scope=scope, devices_per_node=3, local=False)
        want = rank_traffic(plan_sharing(nodes, scope, items_of), items_of)
        assert got["traffic"] == want, scope


def test_plan_json_text_is_json_dump_indent_1() -> None:
    """``--json`` is written by a faster writer: byte for byte ``json.dump(indent=1)``,
    on a plan (lists of expert ids met again on every rank) and on values where equal
    Python values have different JSON text (1, 1.0 and True; lists and tuples)."""
    import io

    from mxload.orchestrator.cli.rendering import write_json

    config = _kind_config("moe")
    obj = plan_to_json(build_plan(config, ParallelLayout(tp=2, dp=4), device="npu"))
    ints = list(range(8))
    odd = {
        "ints": ints,
        "again": list(ints),
        "bools": [False, True, *ints[2:]],  # == ints
        "floats": [0.0, 1.0, *ints[2:]],  # == ints
        "tuple": tuple(ints),
        "nested": [ints, {"x": (1, 2.5, None)}, [], {}],
        "special": [float("nan"), float("inf"), -float("inf"), -0.0, 1e-300, 10**30],
        "text": ['é"\\\n', "\u2603", ""],
        1: "int key",
        2.5: "float key",
        None: "none key",
        False: [False],
    }
    for value in (obj, odd, [], {}, "x", 3):
        want = io.StringIO()
        json.dump(value, want, indent=1)
        got = io.StringIO()
        write_json(value, got)
        assert got.getvalue() == want.getvalue()
