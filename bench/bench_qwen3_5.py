"""Load and convert throughput of the Qwen3.5 preset beside Qwen3's, same bytes, same run.

Purpose: the seed's model is a Qwen3.5 (Gated DeltaNet + gated attention); its layers
cut ``in_proj_qkv`` and ``conv1d`` into q/k/v parts per rank and add small tensors
(``A_log`` cast to float32, ``dt_bias``, ``in_proj_a/b`` left unquantized), so a load
has more, smaller parts than a Qwen3 layer of the same bytes. This measures whether that
costs throughput: ``qwen3-dense-tiny`` and ``qwen3.5-tiny`` are both scaled to hidden
2048, MLP 4096, 4 layers (about 150-180 MB of block-FP8), then, taking turns in each
repeat, every rank of a tp-2 load is run in-process on the fast CPU path (no Ray: the
loader's own work) and ``mxload convert`` writes the MXFP8 checkpoint. Throughput is
source bytes per second; the headline is the ratio Qwen3.5 / Qwen3 per repeat.

Run: ``python bench/bench_qwen3_5.py [--repeats N] [--out DIR]``; writes ``qwen3_5.md``
and ``qwen3_5.json`` under ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common import interleave, load_average, log, machine_facts, md_table, paired_ratio
from mxload.orchestrator.plan.message import SourceInfo
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.tools.convert import convert_checkpoint
from mxload.orchestrator.tools.synth import make_checkpoint, preset_config
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import RankLoader

SIZE = {
    "hidden_size": 2048,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 4,
}


def overrides(preset: str) -> dict[str, Any]:
    if preset == "qwen3-dense-tiny":
        return dict(SIZE)
    text = dict(preset_config(preset)["text_config"])
    text.update(SIZE, linear_num_key_heads=16, linear_num_value_heads=16)
    text.update(linear_key_head_dim=128, linear_value_head_dim=128)
    return {"text_config": text}


def load_all_ranks(src: str, tp: int) -> None:
    meta = open_checkpoint(src)
    plan = build_plan(meta.config, ParallelLayout(tp=tp), checkpoint=meta)
    q = meta.config.quant
    for rp in plan.ranks:
        loader = RankLoader(rp, model_dtype="bf16", backend=select_backend("cpu"))
        loader.load(
            list(rp.reads or ()),
            SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k),
            version=1,
            staging_budget=plan.extra["staging_budget_bytes"],
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mxload-bench-q35-"))
    load_before = load_average()
    try:
        src: dict[str, str] = {}
        nbytes: dict[str, int] = {}
        for preset in ("qwen3-dense-tiny", "qwen3.5-tiny"):
            path = str(work / preset)
            summary = make_checkpoint(path, preset, seed=1, overrides=overrides(preset))
            src[preset], nbytes[preset] = path, summary["bytes"]
            log(f"{preset}: {summary['bytes'] / 1e6:.1f} MB in {summary['tensors']} tensors")

        def converter(preset: str) -> Any:
            def run() -> None:
                dst = work / f"{preset}-mx"
                shutil.rmtree(dst, ignore_errors=True)
                convert_checkpoint(src[preset], str(dst))

            return run

        cands: dict[str, Any] = {}
        for preset in src:
            cands[f"load {preset}"] = lambda p=preset: load_all_ranks(src[p], 2)
            cands[f"convert {preset}"] = converter(preset)
        timings = interleave(cands, repeats=args.repeats, warmup=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    out: dict[str, Any] = {
        "machine": machine_facts(),
        "load_average": [load_before, load_average()],
    }
    for what in ("load", "convert"):
        rates = {p: timings[f"{what} {p}"].rate(nbytes[p] / 1e9) for p in src}
        ratio = paired_ratio(rates["qwen3.5-tiny"], rates["qwen3-dense-tiny"])
        for p in src:
            t = timings[f"{what} {p}"]
            rows.append(
                [what, p, f"{nbytes[p] / 1e6:.0f} MB", t.text(), rates[p].text(unit=" GB/s")]
            )
        rows.append([what, "ratio qwen3.5 / qwen3", "", "", ratio.text(unit="x")])
        out[what] = {p: timings[f"{what} {p}"].to_json() for p in src} | {"ratio": ratio.to_json()}
    table = md_table(["stage", "checkpoint", "bytes", "seconds", "throughput"], rows)
    text = (
        "# Qwen3.5 beside Qwen3: load (tp 2, every rank in-process, cpu-fast) and convert\n\n"
        f"`python bench/bench_qwen3_5.py --repeats {args.repeats}`; load average "
        f"{load_before} before, {load_average()} after (2 cores, shared).\n\n{table}\n"
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qwen3_5.md").write_text(text)
    (Path(args.out) / "qwen3_5.json").write_text(json.dumps(out, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
