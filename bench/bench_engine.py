"""Reload cost of one rank under each engine profile: ``python bench/bench_engine.py``.

Same synthetic checkpoint (a 115 MB-per-rank Qwen3-MoE, tp=1), same staging budget; the
only difference is the buffer layout: mxload's K-major MoE buffers (converted through the
packed ``[K, rows]`` stage) against vllm-ascend's ``[N, K]``-ordered storage (the
row-major MX result copied in storage order). Prints the convert-and-write seconds per
reload (median, min, max of 5) and measured against predicted peak staging.
"""

from __future__ import annotations

import statistics
import sys
import tempfile

from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.request import source_info
from mxload.orchestrator.tools.synth import make_checkpoint
from mxload.workers.rank.loader import RankLoader

OVERRIDES = {
    "hidden_size": 1024,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_hidden_layers": 2,
    "mlp_only_layers": [],
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
}


def main(reloads: int = 5) -> None:
    root = tempfile.mkdtemp(prefix="mxload-bench-engine-")
    make_checkpoint(root, "qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    meta = open_checkpoint(root)
    src = source_info(meta, False, root, None)
    for engine in ("mxload", "vllm-ascend-0.23"):
        plan = build_plan(meta.config, ParallelLayout(), checkpoint=meta, engine=engine)
        rp = plan.ranks[0]
        budget = plan.extra["staging_budget_bytes"]
        loader = RankLoader(rp, model_dtype=meta.config.model_dtype)
        loader.load(list(rp.reads or ()), src, version=1, staging_budget=budget)
        seconds = []
        for v in range(2, 2 + reloads):
            st = loader.reload(list(rp.reads or ()), src, version=v, staging_budget=budget)
            seconds.append(st.convert_seconds)
        print(
            f"{engine:18} {rp.persistent_bytes} B  convert+write per reload: "
            f"median {statistics.median(seconds):.3f} s (min {min(seconds):.3f}, "
            f"max {max(seconds):.3f}); staging measured {st.measured_peak_staging_bytes} / "
            f"predicted {st.predicted_peak_staging_bytes} B",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
