"""Benchmark 8: read once per cluster, the time model, and TP-sharded experts.

Purpose (issue 13): what sharing replicated reads through Ray's object store saves when
storage is the bottleneck, and whether ``mxload.orchestrator.plan.timemodel`` predicts the
load time; and what page-aware local reads do for experts TP-sharded without EP.

* **Sharing**: a simulated two-node cluster (``ray.cluster_utils.Cluster``, both nodes on
  127.0.0.1, ranks spread two or four per node) loads a dense and a MoE checkpoint over a
  *throttled* loopback HTTP server (``tests/servers.py``: one link of ``--bandwidth``
  bytes/s shared by every connection, a store's aggregate limit), at tp 2 x dp 2 and
  tp 2 x dp 4, with ``--share none`` and ``--share cluster`` taking turns. Reported: the
  server's own count of bytes sent against the unique bytes the ranks need, the data
  phase's wall time (fetch + load, ``manifest["sharing"]["run_seconds"]``), the ratio of
  the two scopes per repeat, and predicted / measured time.
* **Time model** (its own section): four ranks on one node and on two simulated nodes load
  dense tp 1 x dp 4 (bytes-bound), dense tp 2 x dp 2 and MoE tp 2 x dp 2 EP (their
  K-split slices are read as whole rows, a few requests per TP group; until whole rows
  they were one HTTP request per row: request-bound) over the loopback server
  throttled to ``--tm-bandwidth``, with both scopes; predicted / measured data-phase time.
  Inputs: the storage aggregate is the throttle; per-node storage and the network are
  unlimited (one machine); the conversion rate per rank is measured first in this run
  (one tp=1 ``RankLoader`` on the same checkpoint from local disk, source bytes over its
  convert seconds) and divided by the ranks sharing this machine's cores; the server's
  request latency (one client) and request rate (four client processes, 16 in flight
  each, as four ranks send) are measured by ``Storage`` from other processes; request
  counts are the plan's (``manifest.sharing.predicted_requests``). The sharing section
  predicts without request terms (it was recorded before they existed).
* **TP-sharded experts**: one ``RankLoader`` per rank in this process, Qwen3-30B-A3B expert
  dims (K-split ``down_proj`` rows of 96 bytes at tp=8), rank-seconds per byte at tp=8
  without EP against tp=1: the default, and one ablation per change (one unit a step,
  every read on the reader thread, one pread per row), each patched in for its own
  measurement only
  (``EXPERT_CANDIDATES``); then where tp=8's extra seconds go, with the MX conversion
  call and/or the storage read replaced by a no-op (``STUBS``).

Every headline is a ratio against a baseline of the same run, median with min-max.

Usage: ``python bench/bench_cluster.py [--quick] [--only SECTIONS] [--out DIR]`` writes
one ``.md``/``.json`` pair per section there (default ``bench/results``): ``cluster``
(sharing), ``cluster-timemodel`` and ``cluster-experts``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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
    from mxload.orchestrator.tools.synth import make_checkpoint

    path = work / name
    make_checkpoint(str(path), preset, seed=13, shards=2, overrides=overrides)
    return str(path)


def convert_rate(
    src: str,
    layout: Any = None,
    *,
    runs: int = 3,
    pick: Callable[[list[float]], float] = _median,
) -> float:
    """Source bytes per second one fused CPU rank converts (rank 0 of ``layout``, default
    tp=1; local disk, warm): ``pick`` of ``runs`` loads."""
    from mxload.orchestrator.plan.message import SourceInfo
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.workers.numerics.select import select_backend
    from mxload.workers.rank.loader import RankLoader

    meta = open_checkpoint(src)
    plan = build_plan(meta.config, layout or ParallelLayout(), checkpoint=meta)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    rp = plan.ranks[0]
    rates = []
    for _ in range(runs):
        ldr = RankLoader(rp, model_dtype=plan.model["dtype"], backend=select_backend("cpu"))
        st = ldr.load(rp.reads, source, version=1, staging_budget=rp.staging.budget_bytes)
        rates.append(rp.bytes_needed / max(st.convert_seconds, 1e-9))
    return pick(rates)


class TwoNodes:
    """A head and ``count - 1`` more nodes on 127.0.0.1, ``npus`` virtual NPUs and 1 CPU
    each (``count=1``: a local single-node cluster)."""

    def __init__(self, npus: int, count: int = 2) -> None:
        self.npus = npus
        self.count = count

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
        for _ in range(self.count - 1):
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


def checkpoints(
    root: Path, rate: Callable[[str], float] = convert_rate
) -> tuple[dict[str, str], dict[str, float]]:
    """The dense and MoE checkpoints a section serves (in ``root``), and the convert rate
    ``rate`` measures on each now (default: one tp=1 rank, median of three)."""
    root.mkdir()
    models = {
        "dense": make(root, "dense", "qwen3-dense-tiny", DENSE),
        "moe": make(root, "moe", "qwen3-moe-tiny", MOE),
    }
    return models, {k: rate(v) for k, v in models.items()}


def predicted(manifest: dict[str, Any], rates: Any, *, requests: bool) -> list[Any]:
    """The time model's per-rank prediction for a load's manifest (its predicted traffic
    and, with ``requests``, its predicted storage requests)."""
    from mxload.orchestrator.plan.sharing import RankTraffic
    from mxload.orchestrator.plan.timemodel import predict

    sh, ranks = manifest["sharing"], manifest["ranks"]
    return predict(
        [RankTraffic(**t) for t in sh["predicted_traffic"]],
        [r["bytes_needed"] for r in ranks],
        [r["node_id"] for r in ranks],
        rates,
        [tuple(x) for x in sh["predicted_requests"]] if requests else None,
        sh.get("predicted_storage_units") if requests else None,
    )


def sharing_section(work: Path, *, quick: bool, bandwidth: float) -> dict[str, Any]:
    from mxload.orchestrator.plan.timemodel import Rates
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.driver import load
    from mxload.orchestrator.runtime.request import LoadRequest

    from tests.servers import RangeHTTPServer

    srv_root = work / "srv"
    models, rate_1 = checkpoints(srv_root)
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
                        rates = Rates(
                            storage_node=0.0,
                            storage_aggregate=bandwidth,
                            network_node=0.0,
                            convert=rate_1[model] * min(1.0, cores / layout.world),
                        )
                        times = predicted(manifest, rates, requests=False)
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


PROBE = r"""
import json, statistics, sys, time
from mxload.orchestrator.plan.ranges import ByteRange
from mxload.workers.storage import Storage

url, name, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = Storage(url)
st.read_range(name, 0, 64)  # connect
lat = []
for i in range(40):
    t = time.perf_counter()
    st.read_range(name, 4096 * i, 64)
    lat.append(time.perf_counter() - t)
# rows 64 bytes long, 4 KiB apart: no gap is bridged, one request each, 16 in flight
# (what a K-split slice sends)
r = ByteRange(0, 64, 4096, rows)
buf = bytearray(r.nbytes)
t = time.perf_counter()
st.read_ranges_into(name, [r], buf)
dt = time.perf_counter() - t
print(json.dumps({"latency": statistics.median(lat), "rate": rows / dt}))
"""


def probe_requests(url: str, name: str, *, clients: int = 4, rows: int = 1000) -> dict[str, float]:
    """The HTTP store's request latency (one client, serial) and the rate it serves
    requests at with ``clients`` processes each keeping 16 in flight, as the ranks of a
    load do. Clients run in separate processes (the server runs in this one, so a
    client here would share its interpreter lock)."""
    import subprocess

    cmd = [sys.executable, "-c", PROBE, url, name, str(rows)]
    cwd = str(Path(__file__).resolve().parents[1])

    def run(n: int) -> list[dict[str, float]]:
        procs = [
            subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True) for _ in range(n)
        ]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("request probe failed")
        return [json.loads(o.strip().splitlines()[-1]) for o in outs]

    alone = run(1)[0]
    together = run(clients)
    return {
        "latency": alone["latency"],
        "rate_one_client": alone["rate"],
        "rate": sum(c["rate"] for c in together),
        "clients": clients,
    }


def timemodel_section(work: Path, *, quick: bool, bandwidth: float) -> dict[str, Any]:
    """Predicted against measured data-phase time, three layouts, one and two nodes."""
    from mxload.orchestrator.plan.timemodel import Rates
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.driver import load
    from mxload.orchestrator.runtime.request import LoadRequest

    from tests.servers import RangeHTTPServer

    srv_root = work / "srv-tm"
    models, rate_1 = checkpoints(srv_root)
    cores = os.cpu_count() or 1
    cases = [
        ("dense", "tp1xdp4", ParallelLayout(tp=1, dp=4)),
        ("dense", "tp2xdp2", ParallelLayout(tp=2, dp=2)),
        ("moe", "tp2xdp2-ep", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)),
    ]
    repeats = 2 if quick else 3
    rows: list[dict[str, Any]] = []
    shard = sorted(p.name for p in Path(models["dense"]).glob("*.safetensors"))[0]
    with RangeHTTPServer(str(srv_root), bandwidth=bandwidth) as server:
        probe = probe_requests(f"{server.url}/dense", shard)
        for count in (1, 2):
            with TwoNodes(4 // count, count=count) as nodes:
                for model, lname, layout in cases:
                    for share in ("none", "cluster"):
                        runs = []
                        for _ in range(repeats):
                            req = LoadRequest(
                                src=f"{server.url}/{model}",
                                layout=layout,
                                device="cpu",
                                address=nodes.cluster.address,
                                placement="spread",
                                share=share,
                            )
                            manifest, _ = load(req)
                            sh = manifest["sharing"]
                            ranks = manifest["ranks"]
                            nodes_of = [r["node_id"] for r in ranks]
                            rates = Rates(
                                storage_node=0.0,
                                storage_aggregate=bandwidth,
                                network_node=0.0,
                                convert=rate_1[model] * min(1.0, cores / layout.world),
                                request_latency=probe["latency"],
                                request_concurrency=16,
                                storage_requests=probe["rate"],
                            )
                            times = predicted(manifest, rates, requests=True)
                            runs.append(
                                {
                                    "measured": sh["run_seconds"],
                                    "predicted": max(t.load_seconds for t in times),
                                    "requests": sum(t.requests for t in times),
                                    "nodes": len(set(nodes_of)),
                                }
                            )
                        rows.append(
                            {
                                "cluster": f"{count} node{'s' if count > 1 else ''}",
                                "model": model,
                                "layout": lname,
                                "share": share,
                                "requests": runs[0]["requests"],
                                "measured": Timing(tuple(r["measured"] for r in runs)),
                                "predicted": Timing(tuple(r["predicted"] for r in runs)),
                                "ratio": Rate(tuple(r["predicted"] / r["measured"] for r in runs)),
                            }
                        )
    return {
        "bandwidth": bandwidth,
        "probe": probe,
        "convert_rate_1_rank": rate_1,
        "cores": cores,
        "rows": rows,
    }


EXPERT_CANDIDATES: dict[str, str] = {
    "tp8": "tp=8 (default: page-aware reads, small local units inline, steps of small units)",
    "tp8-unit": "tp=8, one unit a step (the schedule before steps of several units)",
    "tp8-thread": "tp=8, every read on the reader thread (INLINE_READ_BYTES=0)",
    "tp8-rows": "tp=8, one pread per row (the policy before issue 13)",
}
"""The default and one ablation per change of issue 13's experts work, each patched in
for its measurement only."""


def experts_section(work: Path, *, quick: bool) -> dict[str, Any]:
    """Rank-seconds per byte of experts TP-sharded at tp=8 without EP, against tp=1."""
    import mxload.orchestrator.plan.memory as memory_mod
    import mxload.workers.rank.run as loader_mod
    import mxload.workers.storage.store as storage_mod
    from mxload.orchestrator.plan.message import SourceInfo
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.ranges import CoalescePolicy
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.workers.numerics.select import select_backend
    from mxload.workers.rank.loader import RankLoader

    src = make(work, "experts", "qwen3-moe-tiny", EXPERTS)
    meta = open_checkpoint(src)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    plans = {tp: build_plan(meta.config, ParallelLayout(tp=tp), checkpoint=meta) for tp in (1, 8)}
    patches: dict[str, tuple[Any, str, Any]] = {
        "tp8-unit": (
            memory_mod,
            "_steps",
            lambda units, whole, opts, budget: [(i, 1) for i in range(len(units))],
        ),
        "tp8-thread": (loader_mod, "INLINE_READ_BYTES", 0),
        "tp8-rows": (
            storage_mod,
            "LOCAL_POLICY",
            CoalescePolicy(max_gap_bytes=0, max_overread_ratio=1.0),
        ),
    }

    def rank_seconds(tp: int) -> dict[str, float]:
        """Sums over ranks: seconds, bytes needed, read seconds; and the expert units'
        own seconds (between the progress calls around each) and read bytes."""
        plan = plans[tp]
        out = dict.fromkeys(("seconds", "bytes", "read_seconds", "expert_s", "expert_bytes"), 0.0)
        # A full collection walks this process's ~250K torch and numba objects (0.2 s);
        # the bench's own leftovers set one off now and then, inside some sample. Collect
        # before each sample, as timeit does, so none lands in the timed loads (a worker
        # freezes those objects, RankWorker.__init__).
        gc.collect()
        for rp in plan.ranks:
            ldr = RankLoader(rp, model_dtype=plan.model["dtype"], backend=select_backend("cpu"))
            stamps = [time.perf_counter()]
            st = ldr.load(
                rp.reads,
                source,
                version=1,
                staging_budget=rp.staging.budget_bytes,
                progress=lambda i, n, b, stamps=stamps: stamps.append(time.perf_counter()),
            )
            for i, u in enumerate(rp.units):
                if u.expert >= 0:
                    out["expert_s"] += stamps[i + 1] - stamps[i]
                    out["expert_bytes"] += rp.reads[i].nbytes
            out["seconds"] += st.seconds
            out["read_seconds"] += st.read_seconds
            out["bytes"] += rp.bytes_needed
        return out

    samples: dict[str, list[dict[str, float]]] = {name: [] for name in ("tp1", *EXPERT_CANDIDATES)}
    rank_seconds(1)  # warm the page cache and numba
    rank_seconds(8)
    for _ in range(3 if quick else 7):
        # tp=1 next to every candidate: the machine's speed drifts within seconds
        for name in EXPERT_CANDIDATES:
            samples["tp1"].append(rank_seconds(1))
            patch = patches.get(name)
            saved = getattr(patch[0], patch[1]) if patch else None
            if patch:
                setattr(patch[0], patch[1], patch[2])
            try:
                samples[name].append(rank_seconds(8))
            finally:
                if patch:
                    setattr(patch[0], patch[1], saved)
    n = len(EXPERT_CANDIDATES)
    out: dict[str, Any] = {"checkpoint": src, "samples": samples, "candidates": {}}
    out["decomposition"] = _experts_decomposition(rank_seconds, repeats=3 if quick else 5)
    for j, name in enumerate(EXPERT_CANDIDATES):
        base = samples["tp1"][j::n]
        pairs = list(zip(base, samples[name], strict=True))
        out["candidates"][name] = {
            "over_tp1": Rate(
                tuple((b["seconds"] / b["bytes"]) / (a["seconds"] / a["bytes"]) for a, b in pairs)
            ),
            "experts_over_tp1": Rate(
                tuple(
                    (b["expert_s"] / b["expert_bytes"]) / (a["expert_s"] / a["expert_bytes"])
                    for a, b in pairs
                )
            ),
            "read_share": Rate(tuple(x["read_seconds"] / x["seconds"] for x in samples[name])),
        }
    return out


STUBS: dict[str, tuple[bool, bool]] = {
    "as loaded": (False, False),
    "kernel stubbed": (True, False),
    "reads stubbed": (False, True),
    "both stubbed": (True, True),
}
"""Where the tp=8 experts' extra seconds go: the default load with the MX conversion
call (``Backend.convert``) and/or the storage read
(``Storage.read_ranges_into``) replaced by a no-op (the scale check is off when reads
are stubbed: the staging bytes are then garbage). Instrumentation, not a configuration:
what is left when both are stubbed is the loader's own per-unit cost."""


def _experts_decomposition(rank_seconds: Any, *, repeats: int) -> dict[str, dict[str, Timing]]:
    """Per stub variant (:data:`STUBS`), whole-layer load seconds summed over ranks at
    tp=1 and tp=8, the two interleaved."""
    import mxload.workers.numerics.backend as backend_mod
    import mxload.workers.numerics.reference as reference_mod
    import mxload.workers.storage as storage_mod

    real = (
        backend_mod.Backend.convert,
        storage_mod.Storage.read_ranges_into,
        reference_mod.check_block_scales,
    )

    def no_convert(self: Any, parts: Any, **kw: Any) -> list[Any]:
        return []

    def no_read(self: Any, relpath: str, ranges: Any, view: Any) -> int:
        return sum(r.nbytes for r in ranges)

    def no_check(*a: Any, **kw: Any) -> None:
        return None

    samples: dict[str, dict[int, list[float]]] = {v: {1: [], 8: []} for v in STUBS}
    try:
        for _ in range(repeats):
            for variant, (kernel, reads) in STUBS.items():
                backend_mod.Backend.convert = (  # type: ignore[method-assign]
                    no_convert if kernel else real[0]
                )
                storage_mod.Storage.read_ranges_into = (  # type: ignore[method-assign]
                    no_read if reads else real[1]
                )
                reference_mod.check_block_scales = no_check if reads else real[2]
                for tp in (1, 8):
                    samples[variant][tp].append(rank_seconds(tp)["seconds"])
    finally:
        backend_mod.Backend.convert = real[0]  # type: ignore[method-assign]
        storage_mod.Storage.read_ranges_into = real[1]  # type: ignore[method-assign]
        reference_mod.check_block_scales = real[2]
    return {
        v: {
            "tp1": Timing(tuple(samples[v][1])),
            "tp8": Timing(tuple(samples[v][8])),
            "extra": Timing(
                tuple(b - a for a, b in zip(samples[v][1], samples[v][8], strict=True))
            ),
        }
        for v in STUBS
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
    tm = res.get("timemodel")
    if tm:
        probe = tm["probe"]
        lines += [
            "Time model (`mxload.orchestrator.plan.timemodel.predict`) against the measured data "
            "phase (`manifest.sharing.run_seconds`: shared fetch + load), four ranks on one "
            "node and on two simulated nodes (127.0.0.1), storage a loopback HTTP server "
            f"throttled to {tm['bandwidth'] / 1e6:.0f} MB/s in all. Inputs measured in this "
            "run: convert rate of one tp=1 rank "
            + ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in tm["convert_rate_1_rank"].items())
            + f" (a rank gets its share of {tm['cores']} cores); the server's request latency "
            f"{probe['latency'] * 1000:.1f} ms (one client) and rate {probe['rate']:.0f} "
            f"requests/s ({probe['clients']} client processes, 16 in flight each). Storage requests are the plan's count "
            "(`predicted_requests`).",
            "",
            md_table(
                [
                    "cluster",
                    "model",
                    "layout",
                    "share",
                    "requests",
                    "measured",
                    "predicted",
                    "predicted / measured",
                ],
                [
                    [
                        r["cluster"],
                        r["model"],
                        r["layout"],
                        r["share"],
                        str(r["requests"]),
                        r["measured"].text(2),
                        r["predicted"].text(2),
                        r["ratio"].text(2),
                    ]
                    for r in tm["rows"]
                ],
            ),
            "",
        ]
    ex = res.get("experts")
    if ex:
        lines += [
            "TP-sharded experts without EP (Qwen3-30B-A3B expert dims, 8 experts, one layer; "
            "one RankLoader per rank in this process, local disk, warm cache): sum over "
            "ranks of seconds per byte, against a tp=1 load measured just before each "
            "candidate's. Expert units: the time between the progress calls around each "
            "expert unit, over those units' read bytes (a unit's interval also holds the "
            "inline read-ahead of the next; the units of one step report together, so the "
            "step's time falls on its first). Whole layer: attention and vocab blocks too, "
            "load seconds over bytes needed. Read share: `RunStats.read_seconds` (waiting "
            "for the reader thread, or reading inline) over rank seconds.",
            "",
            md_table(
                [
                    "candidate",
                    "expert units: rank-seconds per byte / tp=1",
                    "whole layer: rank-seconds per byte / tp=1",
                    "read share of rank seconds",
                ],
                [
                    [
                        label,
                        ex["candidates"][name]["experts_over_tp1"].text(2, "x"),
                        ex["candidates"][name]["over_tp1"].text(2, "x"),
                        ex["candidates"][name]["read_share"].text(2),
                    ]
                    for name, label in EXPERT_CANDIDATES.items()
                ],
            ),
            "",
        ]
        dec = ex.get("decomposition")
        if dec:
            lines += [
                "Where tp=8's extra seconds go (whole layer, seconds summed over ranks, "
                "median with min-max; the conversion call and/or the storage read replaced "
                "by a no-op, `STUBS`): what is left with both stubbed is the loader's own "
                "cost per unit, and tp=8 has 8x the expert units.",
                "",
                md_table(
                    ["variant", "tp=1", "tp=8", "tp=8 - tp=1"],
                    [
                        [v, d["tp1"].text(3), d["tp8"].text(3), d["extra"].text(3)]
                        for v, d in dec.items()
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
        "--bandwidth",
        type=float,
        default=24e6,
        help="HTTP throttle of the sharing section, bytes/s (default 24e6)",
    )
    ap.add_argument(
        "--tm-bandwidth",
        type=float,
        default=5e6,
        help="HTTP throttle of the time-model section, bytes/s (default 5e6)",
    )
    ap.add_argument(
        "--only", default="sharing,timemodel,experts", help="sections to run, comma-separated"
    )
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="mxbench13-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = ("python bench/bench_cluster.py " + " ".join(argv or sys.argv[1:])).strip()
    # one file pair per section, so a section run alone keeps the others' results
    files = {"sharing": "cluster", "timemodel": "cluster-timemodel", "experts": "cluster-experts"}
    try:
        for section, stem in files.items():
            if section not in only:
                continue
            res: dict[str, Any] = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": machine_facts(),
                "load_before": load_average(),
            }
            if section == "experts":
                res[section] = experts_section(work, quick=args.quick)
            elif section == "sharing":
                res[section] = sharing_section(work, quick=args.quick, bandwidth=args.bandwidth)
            else:
                res[section] = timemodel_section(
                    work, quick=args.quick, bandwidth=args.tm_bandwidth
                )
            res["load_after"] = load_average()
            (out / f"{stem}.md").write_text(render(res, command))
            (out / f"{stem}.json").write_text(json.dumps(_jsonable(res), indent=1, default=str))
            print((out / f"{stem}.md").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
