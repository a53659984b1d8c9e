"""The node fan-out of a refit against every rank receiving all it holds:
``python bench/bench_refit_fanout.py``.

A model held by two trainer ranks as FSDP dim-0 shards, refitting two engine ranks that
are data-parallel replicas on one node (tp 1, dp 2) over shared memory: ``--model
dense`` (default), two Qwen3-32B-sized dense layers (1.4 GB in BF16), which each replica
holds whole as MXFP8 (the Qwen3.8-27B case); ``--model moe``, one Qwen3-30B-A3B layer
(``bench_refit.py``'s, 1.2 GB), whose experts vLLM shards over tp x dp without expert
parallelism, so the replicas share only attention and norms.
Side by side in each repeat (``common.interleave``, medians of 3 after one warm-up):

* ``each rank from the trainer``: no ``engine_nodes``: both replicas receive the layer
  in BF16 and convert it;
* ``node copies``: ``engine_nodes`` ``[0, 0]``: the layer crosses once, to rank 0, which
  converts it; rank 1 copies rank 0's MXFP8 buffers as they are written.

Printed and written to ``bench/results/refit-fanout.{json,md}``: each median with its
spread, the ratio node copies / each rank per repeat, the bytes the trainer ranks sent
and the bytes copied, and the second replica's own convert-and-write seconds. Trainer
and engine ranks are threads of this process sharing its two cores, so the refit's
seconds here mostly count conversions: a replica that copies converts nothing. On a
cluster the same copies also halve what crosses each node's network (the time model's
figures, docs/time-model.md "Refit"). The load average before and after is printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_refit import OVERRIDES, engine_model, read_twin
from bench.common import interleave, load_average, machine_facts, md_table, paired_ratio

DENSE = {
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 2048,
}
"""Two layers of Qwen3-32B's shape (a small vocabulary: the layers are the point)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="", help="folder for the checkpoints (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--model", choices=("dense", "moe"), default="dense")
    ap.add_argument("--small", action="store_true", help="a 30 MB model: a smoke run")
    args = ap.parse_args()
    if args.model == "moe":
        preset, overrides = "qwen3-moe-tiny", dict(OVERRIDES)
        if args.small:
            overrides.update(hidden_size=512, moe_intermediate_size=256, num_experts=16)
    else:
        preset, overrides = "qwen3-dense-tiny", dict(DENSE)
        if args.small:
            overrides.update(hidden_size=512, intermediate_size=1024, num_hidden_layers=1)

    from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.orchestrator.runtime.refit import MxloadSender
    from mxload.orchestrator.tools.synth import make_checkpoint

    from tests.refit_trainer import free_port

    machine = machine_facts()
    print(f"load average before: {machine['load_average_start']}", flush=True)
    work = args.work or tempfile.mkdtemp(prefix="mxload-bench-fanout-")
    fp8, twin = (os.path.join(work, n) for n in ("fp8", "bf16"))
    if not os.path.exists(os.path.join(twin, "config.json")):
        make_checkpoint(fp8, preset, seed=1, overrides=overrides)
        make_checkpoint(twin, preset, seed=1, overrides=overrides, bf16=True)
    full = read_twin(twin)
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 2)
    h = manifest.digest()
    shards = [
        {t.name: full[t.name][s.start : s.stop] for t in manifest.tensors for s in t.placement
         if s.rank == r}
        for r in range(2)
    ]  # fmt: skip

    layout = ParallelLayout(tp=1, dp=2)
    meta = open_checkpoint(fp8)
    plan = build_plan(meta.config, layout, checkpoint=meta)

    groups: dict[str, tuple[list[Attachment], list[Any]]] = {}
    for name, nodes in (("each rank from the trainer", None), ("node copies", [0, 0])):
        port = free_port()
        form: dict[str, Any] = {
            "transport": "shm",
            "world": 2,
            "manifest": manifest_to_json(manifest),
            "bucket_bytes": 64 << 20,
            "group": f"bench-fanout-{port}",
            "timeout_s": 600,
            **({"engine_nodes": nodes} if nodes else {}),
        }
        engines = [
            Attachment(
                fp8,
                EngineFacts(layout, 0, 0, r, "mxload", {}),
                engine_params(engine_model(plan.ranks[r])),
            )
            for r in range(2)
        ]
        senders: list[Any] = [None, None]

        def join(r: int, form: dict[str, Any] = form, senders: list[Any] = senders) -> None:
            senders[r] = MxloadSender(fp8, layout, form, rank=r)

        def attach(e: Attachment, form: dict[str, Any] = form) -> None:
            e.attach_trainer(form)

        threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
        threads += [threading.Thread(target=attach, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        groups[name] = (engines, senders)

    steps = itertools.count(1)
    stats: dict[str, list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]] = {
        n: [] for n in groups
    }

    def refit_fn(name: str) -> Any:
        engines, senders = groups[name]

        def run() -> None:
            step = next(steps)
            sent: list[Any] = [None, None]
            got: list[Any] = [None, None]

            def send(r: int) -> None:
                sent[r] = senders[r].send_weights(shards[r], step)

            def take(r: int) -> None:
                got[r] = engines[r].refit(step, h)

            threads = [
                threading.Thread(target=f, args=(r,)) for f in (send, take) for r in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(isinstance(g, dict) for g in got), got
            stats[name].append((sent, got))

        return run

    timings = interleave({n: refit_fn(n) for n in groups}, repeats=args.repeats, warmup=1)
    base = timings["each rank from the trainer"]
    rows = []
    out: dict[str, Any] = {"bytes_bf16_per_rank": nbytes, "machine": machine, "candidates": {}}
    for name, t in timings.items():
        runs = stats[name][1 : 1 + args.repeats]
        sent = statistics.median(sum(s["bytes_sent"] for s in ss) for ss, _ in runs)
        copied = statistics.median(g[1]["bytes_copied"] for _, g in runs)
        second = statistics.median(g[1]["convert_seconds"] for _, g in runs)
        ratio = paired_ratio(t, base)
        out["candidates"][name] = {
            "seconds": t.to_json(),
            "vs_each_rank": ratio.to_json(),
            "bytes_sent": sent,
            "bytes_copied": copied,
            "second_replica_convert_seconds": second,
        }
        rows.append(
            [
                name,
                t.text(),
                ratio.text(digits=2, unit="x") if t is not base else "1",
                f"{sent / 2**30:.2f} GiB",
                f"{copied / 2**30:.2f} GiB",
                f"{second:.3f}",
            ]
        )
    c = out["candidates"]
    out["bytes_sent_ratio"] = (
        c["node copies"]["bytes_sent"] / c["each rank from the trainer"]["bytes_sent"]
    )
    out["load_average_after"] = load_average()
    table = md_table(
        [
            "candidate",
            "seconds (median [min-max])",
            "/ each rank from the trainer",
            "trainer bytes sent",
            "bytes copied",
            "second replica's own convert+write s",
        ],
        rows,
    )
    extra = (
        f"\ntrainer bytes sent, node copies / each rank: {out['bytes_sent_ratio']:.3f}\n"
        f"load average before {machine.get('load_average_start')}, after "
        f"{out['load_average_after']}\n"
    )
    print(table + extra, flush=True)
    os.makedirs(args.out, exist_ok=True)
    suffix = ("-moe" if args.model == "moe" else "") + ("-small" if args.small else "")
    with open(os.path.join(args.out, f"refit-fanout{suffix}.json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(args.out, f"refit-fanout{suffix}.md"), "w") as f:
        f.write(
            f"# Refit: node copies vs every rank from the trainer ({args.model}, "
            f"{nbytes / 2**30:.2f} GiB BF16, 2 trainer ranks -> 2 replicas on one node, "
            f"medians of {args.repeats})\n\n"
            f"`python bench/bench_refit_fanout.py --model {args.model}`\n\n" + table + extra
        )
    for engines, senders in groups.values():
        for e in engines:
            e.close()
        for s in senders:
            s.close()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
