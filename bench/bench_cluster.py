"""Benchmark 8: read once per cluster, the time model, and TP-sharded experts.

Purpose (issue 13): what sharing replicated reads through Ray's object store saves when
storage is the bottleneck, and whether ``mxload.orchestrator.timemodel`` predicts the
load time; and what page-aware local reads do for experts TP-sharded without EP.

* **Sharing**: a simulated two-node cluster (``ray.cluster_utils.Cluster``, both nodes on
  127.0.0.1, ranks spread two or four per node) loads a dense and a MoE checkpoint over a
  *throttled* loopback HTTP server (``tests/servers.py``: one link of ``--bandwidth``
  bytes/s shared by every connection, a store's aggregate limit), at tp 2 x dp 2 and
  tp 2 x dp 4, with ``--share none`` and ``--share cluster`` taking turns. Reported: the
  server's own count of bytes sent against the unique bytes the ranks need, the data
  phase's wall time (fetch + load, ``manifest["sharing"]["run_seconds"]``), the ratio of
  the two scopes per repeat, and predicted / measured time.
* **Time model inputs**: the storage aggregate is the throttle; per-node storage and the
  network are unlimited (one machine); the conversion rate per rank is measured first in
  this run (one tp=1 ``RankLoader`` on the same checkpoint from local disk, source bytes
  over its convert seconds) and divided by the ranks sharing this machine's cores.
* **TP-sharded experts**: one ``RankLoader`` per rank in this process, Qwen3-30B-A3B expert
  dims (K-split ``down_proj`` rows of 96 bytes at tp=8), rank-seconds per byte at tp=8
  without EP against tp=1, with page-aware reads (the default) and with one pread per
  row (the policy before issue 13, patched in for the comparison only).

Every headline is a ratio against a baseline of the same run, median with min-max.

Usage: ``python bench/bench_cluster.py [--quick] [--out DIR]`` writes ``cluster.md`` and
``cluster.json`` there (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Rate, Timing, load_average, machine_facts, md_table

DENSE = {
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 2048,
}
MOE = {
    "hidden_size": 512,
    "moe_intermediate_size": 512,
    "intermediate_size": 1024,
    "num_experts": 8,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 2048,
    "mlp_only_layers": [],
}
EXPERTS = {  # Qwen3-30B-A3B expert and attention dims, one layer of 8 experts
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 1024,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def make(work: Path, name: str, preset: str, overrides: dict[str, Any]) -> str:
    from mxload.workers.synth import make_checkpoint

    path = work / name
    make_checkpoint(str(path), preset, seed=13, shards=2, overrides=overrides)
    return str(path)


def convert_rate(src: str) -> float:
    """Source bytes per second one fused CPU rank converts (tp=1, local disk, warm)."""
    from mxload.orchestrator.catalog import open_checkpoint
    from mxload.orchestrator.planner import build_plan
    from mxload.orchestrator.plantypes import ParallelLayout
    from mxload.workers.loader import RankLoader, SourceInfo
    from mxload.workers.numerics.backend import select_backend

    meta = open_checkpoint(src)
    plan = build_plan(meta.config, ParallelLayout(), checkpoint=meta)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    rp = plan.ranks[0]
    rates = []
    for _ in range(3):
        ldr = RankLoader(rp, model_dtype=plan.model["dtype"], backend=select_backend("cpu"))
        st = ldr.load(rp.reads, source, version=1, staging_budget=rp.staging.budget_bytes)
        rates.append(rp.bytes_needed / max(st.convert_seconds, 1e-9))
    return _median(rates)


class TwoNodes:
    """A head and one more node on 127.0.0.1, ``npus`` virtual NPUs and 1 CPU each."""

    def __init__(self, npus: int) -> None:
        self.npus = npus

    def __enter__(self) -> TwoNodes:
        import ray
        from mxload.cluster.local import LOOPBACK, free_port, prepare_environment, short_temp_dir
        from ray.cluster_utils import Cluster

        prepare_environment()
        self.temp = short_temp_dir("mxbc-")
        os.makedirs(os.path.join(self.temp, "ray"))
        self.saved = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.temp
        node = {
            "node_ip_address": LOOPBACK,
            "num_cpus": 1,
            "resources": {"NPU": self.npus},
            "temp_dir": self.temp,
            "object_store_memory": 256 * 1024 * 1024,
        }
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                node, include_dashboard=False, dashboard_agent_listen_port=free_port()
            ),
        )
        self.cluster.add_node(**node)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self.saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self.saved
        shutil.rmtree(self.temp, ignore_errors=True)


def sharing_section(work: Path, *, quick: bool, bandwidth: float) -> dict[str, Any]:
    from mxload.orchestrator.driver import LoadRequest, load
    from mxload.orchestrator.plantypes import ParallelLayout
    from mxload.orchestrator.sharing import RankTraffic
    from mxload.orchestrator.timemodel import Rates, predict

    from tests.servers import RangeHTTPServer

    srv_root = work / "srv"
    srv_root.mkdir()
    models = {
        "dense": make(srv_root, "dense", "qwen3-dense-tiny", DENSE),
        "moe": make(srv_root, "moe", "qwen3-moe-tiny", MOE),
    }
    rate_1 = {k: convert_rate(v) for k, v in models.items()}
    cores = os.cpu_count() or 1
    layouts = {
        "tp2xdp2": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
        "tp2xdp4": ParallelLayout(tp=2, dp=4, enable_expert_parallel=True),
    }
    repeats = 2 if quick else 3
    rows: list[dict[str, Any]] = []
    with RangeHTTPServer(str(srv_root), bandwidth=bandwidth) as server, TwoNodes(4) as nodes:
        address = nodes.cluster.address
        for model in models:
            for lname, layout in layouts.items():
                url = f"{server.url}/{model}"
                runs: dict[str, list[dict[str, Any]]] = {"none": [], "cluster": []}
                for _ in range(repeats):
                    for share in ("none", "cluster"):
                        req = LoadRequest(
                            src=url,
                            layout=layout,
                            device="cpu",
                            address=address,
                            placement="spread",
                            share=share,
                        )
                        sent0 = server.state.bytes_sent
                        manifest, _ = load(req)
                        sent = server.state.bytes_sent - sent0
                        sh = manifest["sharing"]
                        ranks = manifest["ranks"]
                        nodes_of = [r["node_id"] for r in ranks]
                        traffic = [RankTraffic(**t) for t in sh["predicted_traffic"]]
                        per_rank_rate = rate_1[model] * min(1.0, cores / layout.world)
                        rates = Rates(
                            storage_node=0.0,
                            storage_aggregate=bandwidth,
                            network_node=0.0,
                            convert=per_rank_rate,
                        )
                        times = predict(
                            traffic, [r["bytes_needed"] for r in ranks], nodes_of, rates
                        )
                        runs[share].append(
                            {
                                "server_bytes": sent,
                                "unique_bytes": sh["unique_bytes_needed"],
                                "storage_bytes": sh["bytes_from_storage"],
                                "peer_bytes": sh["bytes_from_peers"],
                                "run_seconds": sh["run_seconds"],
                                "fetch_seconds": sh["fetch_seconds"],
                                "predicted_seconds": max(t.load_seconds for t in times),
                                "nodes": len(set(nodes_of)),
                                "peak_ok": all(
                                    r["measured_peak_staging_bytes"]
                                    <= r["predicted_peak_staging_bytes"]
                                    <= 1.10 * r["measured_peak_staging_bytes"]
                                    for r in ranks
                                ),
                            }
                        )
                none, shared = runs["none"], runs["cluster"]
                rows.append(
                    {
                        "model": model,
                        "layout": lname,
                        "none": none,
                        "cluster": shared,
                        "wall_ratio": Rate(
                            tuple(
                                c["run_seconds"] / n["run_seconds"]
                                for c, n in zip(shared, none, strict=True)
                            )
                        ),
                        "server_over_unique": Rate(
                            tuple(c["server_bytes"] / c["unique_bytes"] for c in shared)
                        ),
                        "server_over_unique_none": Rate(
                            tuple(n["server_bytes"] / n["unique_bytes"] for n in none)
                        ),
                        "pred_over_meas_cluster": Rate(
                            tuple(c["predicted_seconds"] / c["run_seconds"] for c in shared)
                        ),
                        "pred_over_meas_none": Rate(
                            tuple(n["predicted_seconds"] / n["run_seconds"] for n in none)
                        ),
                        "wall_none": Timing(tuple(n["run_seconds"] for n in none)),
                        "wall_cluster": Timing(tuple(c["run_seconds"] for c in shared)),
                    }
                )
    return {"bandwidth": bandwidth, "convert_rate_1_rank": rate_1, "rows": rows}


def experts_section(work: Path, *, quick: bool) -> dict[str, Any]:
    """Rank-seconds per byte of experts TP-sharded at tp=8 without EP, against tp=1."""
    import mxload.workers.storage as storage_mod
    from mxload.orchestrator.catalog import open_checkpoint
    from mxload.orchestrator.planner import build_plan
    from mxload.orchestrator.plantypes import ParallelLayout
    from mxload.orchestrator.ranges import CoalescePolicy
    from mxload.workers.loader import RankLoader, SourceInfo
    from mxload.workers.numerics.backend import select_backend

    src = make(work, "experts", "qwen3-moe-tiny", EXPERTS)
    meta = open_checkpoint(src)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    plans = {tp: build_plan(meta.config, ParallelLayout(tp=tp), checkpoint=meta) for tp in (1, 8)}
    per_row = CoalescePolicy(max_gap_bytes=0, max_overread_ratio=1.0)  # before issue 13

    def rank_seconds(tp: int) -> tuple[float, int, float, float]:
        plan = plans[tp]
        secs = nbytes = read_s = 0.0
        for rp in plan.ranks:
            ldr = RankLoader(rp, model_dtype=plan.model["dtype"], backend=select_backend("cpu"))
            st = ldr.load(rp.reads, source, version=1, staging_budget=rp.staging.budget_bytes)
            secs += st.seconds
            read_s += st.read_seconds
            nbytes += rp.bytes_needed
        return secs, int(nbytes), secs / nbytes, read_s

    samples: dict[str, list[tuple[float, int, float, float]]] = {
        "tp1": [],
        "tp8": [],
        "tp8-rows": [],
    }
    rank_seconds(1)  # warm the page cache and numba
    for _ in range(2 if quick else 3):
        samples["tp1"].append(rank_seconds(1))
        samples["tp8"].append(rank_seconds(8))
        saved = storage_mod.LOCAL_POLICY
        storage_mod.LOCAL_POLICY = per_row
        try:
            samples["tp8-rows"].append(rank_seconds(8))
        finally:
            storage_mod.LOCAL_POLICY = saved
    base = samples["tp1"]
    return {
        "checkpoint": src,
        "samples": samples,
        "tp8_over_tp1": Rate(tuple(b[2] / a[2] for a, b in zip(base, samples["tp8"], strict=True))),
        "tp8_rows_over_tp1": Rate(
            tuple(b[2] / a[2] for a, b in zip(base, samples["tp8-rows"], strict=True))
        ),
        "read_share_tp8": Rate(tuple(s[3] / s[0] for s in samples["tp8"])),
        "read_share_tp8_rows": Rate(tuple(s[3] / s[0] for s in samples["tp8-rows"])),
    }


def render(res: dict[str, Any], command: str) -> str:
    lines = [
        "# Benchmark 8: read once per cluster, time model, TP-sharded experts",
        "",
        f"Command: `{command}`; {res['date']}; load average before {res['load_before']}, after "
        f"{res['load_after']}.",
        "",
    ]
    sh = res.get("sharing")
    if sh:
        mb = sh["bandwidth"] / 1e6
        lines += [
            f"Two simulated nodes on 127.0.0.1 (ray.cluster_utils.Cluster), ranks spread "
            f"evenly; storage: loopback HTTP throttled to {mb:.0f} MB/s in all. Time = the "
            "data phase (shared fetch + load), `manifest.sharing.run_seconds`. Convert rate "
            "of one tp=1 rank here (bytes/s): "
            + ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in sh["convert_rate_1_rank"].items())
            + ".",
            "",
        ]
        table = []
        for r in sh["rows"]:
            table.append(
                [
                    r["model"],
                    r["layout"],
                    r["server_over_unique_none"].text(3),
                    r["server_over_unique"].text(3),
                    r["wall_none"].text(2),
                    r["wall_cluster"].text(2),
                    r["wall_ratio"].text(2, "x"),
                    r["pred_over_meas_none"].text(2),
                    r["pred_over_meas_cluster"].text(2),
                ]
            )
        lines.append(
            md_table(
                [
                    "model",
                    "layout",
                    "server bytes / unique, none",
                    "server bytes / unique, cluster",
                    "wall none",
                    "wall cluster",
                    "cluster / none wall",
                    "predicted / measured, none",
                    "predicted / measured, cluster",
                ],
                table,
            )
        )
        lines.append("")
    ex = res.get("experts")
    if ex:
        lines += [
            "TP-sharded experts without EP (Qwen3-30B-A3B expert dims, 8 experts, one layer; "
            "one RankLoader per rank in this process, local disk, warm cache): sum of rank "
            "seconds per byte needed, against tp=1 in the same repeat.",
            "",
            md_table(
                ["candidate", "rank-seconds per byte / tp=1", "read share of rank seconds"],
                [
                    [
                        "tp=8, page-aware reads (default)",
                        ex["tp8_over_tp1"].text(2, "x"),
                        ex["read_share_tp8"].text(2),
                    ],
                    [
                        "tp=8, one pread per row (before)",
                        ex["tp8_rows_over_tp1"].text(2, "x"),
                        ex["read_share_tp8_rows"].text(2),
                    ],
                ],
            ),
            "",
        ]
    return "\n".join(lines)


def _jsonable(o: Any) -> Any:
    if isinstance(o, Rate | Timing):
        return o.to_json()
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_jsonable(v) for v in o]
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--out", default="bench/results", help="folder for cluster.md/.json")
    ap.add_argument(
        "--bandwidth", type=float, default=24e6, help="HTTP throttle, bytes/s (default 24e6)"
    )
    ap.add_argument("--only", default="sharing,experts", help="sections to run")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="mxbench13-"))
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_facts(),
        "load_before": load_average(),
    }
    try:
        if "experts" in only:
            res["experts"] = experts_section(work, quick=args.quick)
        if "sharing" in only:
            res["sharing"] = sharing_section(work, quick=args.quick, bandwidth=args.bandwidth)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = load_average()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python bench/bench_cluster.py " + " ".join(argv or sys.argv[1:])
    (out / "cluster.md").write_text(render(res, command.strip()))
    (out / "cluster.json").write_text(json.dumps(_jsonable(res), indent=1, default=str))
    print((out / "cluster.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
