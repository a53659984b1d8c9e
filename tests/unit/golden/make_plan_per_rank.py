"""How ``plan_per_rank.json`` was made: run at commit f309478, the last commit whose
planner, read-once sharing and time model worked rank by rank, as
``python tests/unit/golden/make_plan_per_rank.py tests/unit/golden/plan_per_rank.json``.

It is kept to say where the expected values come from; run against a later commit it
would produce that commit's values, which is not what the test compares to."""

import json
import sys
import tempfile

from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan, plan_to_json
from mxload.orchestrator.plan.timemodel import Rates, plan_times
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.models import model_config
from mxload.orchestrator.tools.synth import make_checkpoint


def small(name, **over):
    raw = dict(model_config(name))
    raw.update(over)
    return raw


CONFIGS = {
    "moe": small(
        "qwen3-30b-a3b-fp8", num_hidden_layers=3, num_experts=8, moe_intermediate_size=768
    ),
    "ds": small(
        "deepseek-v3",
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_nextn_predict_layers=0,
    ),
    "dense": small("qwen3-32b-fp8", num_hidden_layers=2),
}
LAYOUTS = [
    ("moe", dict(tp=2, dp=2)),
    ("moe", dict(tp=2, dp=3, enable_expert_parallel=True)),
    ("moe", dict(tp=2, dp=2, pp=2)),
    ("moe", dict(tp=1, dp=4, enable_expert_parallel=True, expert_placement="round_robin")),
    ("ds", dict(tp=2, dp=2, enable_expert_parallel=True)),
    ("ds", dict(tp=2, dp=2)),
    ("dense", dict(tp=4, dp=3)),
    ("dense", dict(tp=2, dp=2, pp=2)),
    ("dense", dict(tp=16, dp=2)),
]


def trim(obj):
    return obj


out = []
for cname, lay in LAYOUTS:
    config = parse_config(CONFIGS[cname], cname)
    layout = ParallelLayout(**lay)
    plan = build_plan(config, layout, device="npu")
    js = plan_to_json(plan)
    case = {"config": cname, "layout": lay, "plan": js, "times": {}}
    for scope in ("none", "node", "cluster"):
        for local in (True, False):
            got = plan_times(
                plan,
                config,
                rates=Rates(request_latency=0.0001 if local else 0.01, convert=20e9),
                scope=scope,
                devices_per_node=3,
                local=local,
            )
            case["times"][f"{scope}-{'local' if local else 'remote'}"] = {
                "ranks": [
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
                ],
                "totals": {k: v for k, v in got.items() if k not in ("times", "traffic")},
            }
    out.append(case)
    print(cname, lay, len(plan.ranks), file=sys.stderr)

ck = []
for preset, lay in (
    ("qwen3-moe-tiny", dict(tp=2, dp=2)),
    ("qwen3-moe-tiny", dict(tp=2, dp=4, enable_expert_parallel=True)),
    ("qwen3-dense-tiny", dict(tp=2, dp=4)),
):
    d = tempfile.mkdtemp()
    make_checkpoint(d, preset, seed=3)
    meta = open_checkpoint(d)
    plan = build_plan(meta.config, ParallelLayout(**lay), checkpoint=meta)
    case = {"preset": preset, "layout": lay, "plan": plan_to_json(plan), "times": {}}
    for scope in ("none", "node", "cluster"):
        got = plan_times(
            plan,
            meta.config,
            rates=Rates(request_latency=0.0001),
            scope=scope,
            devices_per_node=3,
            local=True,
        )
        case["times"][scope] = {
            "ranks": [
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
            ],
            "totals": {k: v for k, v in got.items() if k not in ("times", "traffic")},
        }
    ck.append(case)
json.dump({"configs": CONFIGS, "cases": out, "checkpoint_cases": ck}, open(sys.argv[1], "w"))
