"""Benchmark: K-split slices from an object store, one request per row against whole rows.

Purpose: what reading a K-split slice (row-parallel ``o_proj``/``down_proj``, a
TP-sharded expert's ``w2``) as its whole rows, fetched once per TP group and shared,
does to a load from an object store, measured over the loopback HTTP server with a
per-request latency added (an object store's time to first byte) and its bandwidth
throttled (the store's aggregate).

Layouts: a dense model and a MoE model (experts TP-sharded, no EP) at tp 4 on one node
of four ranks, ``--share cluster``. Baseline in the same run: the same load with the
remote policy of one request per K-split row (``ranges.ROW_REMOTE_POLICY`` patched into
the planner for that load only), taking turns with whole rows.

Reported per load, from the server's own log: requests per K-split tensor (most, mean),
requests in all, bytes served against the unique bytes the ranks need; the data phase's
wall time (``manifest["sharing"]["run_seconds"]``) and its ratio baseline / whole rows;
predicted / measured, the time model's inputs measured in the same run, as a user
would pass them to ``mxload plan``: request latency and rate of the server (as
``bench_cluster.py --only timemodel`` measures them); the conversion rate of the load's
own rank (rank 0 of the tp 4 plan, from local disk, the fastest of five: other work on
a shared machine only slows it; per-unit costs make a tp 4 slice convert slower per
byte than tp 1) divided among the ranks sharing the cores; and the start cost of a
fresh rank process (``Rates.start_seconds``: its first fetch of a shared read, less the
same fetch warm, in a new process, median of three), multiplied likewise by the ranks
per core, since it is CPU work the ranks do at once.

Usage: ``python bench/bench_whole_rows.py [--quick] [--latency S] [--bandwidth B]``;
prints markdown and writes ``bench/results/whole-rows.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_cluster import (
    TwoNodes,
    checkpoints,
    convert_rate,
    predicted,
    probe_requests,
)
from bench.common import Rate, Timing, load_average, machine_facts, md_table

K_SPLIT = ("o_proj.weight", "down_proj.weight", "o_proj.weight_scale_inv")
"""Tensors a tp 4 rank holds a column window of (the experts' down_proj included)."""


@contextlib.contextmanager
def rows_policy(on: bool) -> Iterator[None]:
    """While ``on``: plans read every K-split row on its own, as before whole rows."""
    import mxload.orchestrator.plan.planner as planner
    import mxload.orchestrator.plan.ranges as ranges

    saved = (planner.REMOTE_POLICY, ranges.REMOTE_POLICY)
    if on:
        planner.REMOTE_POLICY = ranges.ROW_REMOTE_POLICY
        ranges.REMOTE_POLICY = ranges.ROW_REMOTE_POLICY
    try:
        yield
    finally:
        planner.REMOTE_POLICY, ranges.REMOTE_POLICY = saved


def k_split_spans(src: str) -> dict[tuple[str, int, int], str]:
    """(file, start, end) of every K-split tensor's bytes (and of its scale)."""
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    meta = open_checkpoint(src)
    out = {}
    for name, info in meta.tensors.items():
        if name.endswith(K_SPLIT) or name.endswith("down_proj.weight_scale_inv"):
            out[(info.file, info.start, info.start + info.nbytes)] = name
    return out


START_PROBE = r"""
import pickle, sys, time
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import RankLoader
rank, items, source, budget, dtype = pickle.load(open(sys.argv[1], "rb"))
took = []
for _ in range(2):
    ldr = RankLoader(rank, model_dtype=dtype, backend=select_backend("cpu"))
    t = time.perf_counter()
    ldr.fetch_for_peers(items, source, staging_budget=budget, publish=lambda a: a.copy())
    took.append(time.perf_counter() - t)
print(took[0] - took[1])
"""


def _rank_inputs(src: str, layout: Any, *, remote: bool) -> tuple[Any, Any, Any]:
    """The plan of ``layout`` on ``src``, its rank 0 and the source the loader reads."""
    from mxload.orchestrator.plan.message import SourceInfo
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    meta = open_checkpoint(src)
    plan = build_plan(meta.config, layout, checkpoint=meta, remote=remote)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    return plan, plan.ranks[0], source


def probe_start(url: str, layout: Any, work: Path, *, runs: int = 3) -> float:
    """Seconds a fresh process's first fetch of rank 0's largest shared read from ``url``
    takes beyond the same fetch warm (median of ``runs`` processes): the start cost a
    load's new rank processes pay (their first phase is fetching shared reads)."""
    import pickle
    import statistics
    import subprocess

    from mxload.orchestrator.plan.message import RankJob
    from mxload.orchestrator.runtime import shared_reads
    from mxload.orchestrator.runtime.request import staging_budget_of

    plan, rp, source = _rank_inputs(url, layout, remote=True)
    reads_all = [r.reads for r in plan.ranks]
    budgets = [staging_budget_of(plan, r) for r in plan.ranks]
    nodes = ["node"] * len(plan.ranks)
    jobs = [
        RankJob(tuple(reads), source, 1, budget, whole_units=True)
        for reads, budget in zip(reads_all, budgets, strict=True)
    ]
    share, _ = shared_reads.plan_shares(plan, nodes, "cluster", jobs)
    owned = [next(i for r, i in s.users if r == 0) for s in share.owned_by(0)]
    i = max(owned, key=lambda i: reads_all[0][i].nbytes)
    items = [(0, rp.units[i], reads_all[0][i])]
    path = work / "start-probe.pkl"
    path.write_bytes(pickle.dumps((rp, items, source, budgets[0], plan.model["dtype"])))
    cwd = str(Path(__file__).resolve().parents[1])
    took = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", START_PROBE, str(path)],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
        took.append(float(out.stdout.strip().splitlines()[-1]))
    return max(0.0, statistics.median(took))


def _range(header: str | None) -> tuple[int, int]:
    first, _, last = (header or "bytes=0-0").removeprefix("bytes=").partition("-")
    return int(first), int(last) + 1


def served(server: Any, prefix: str, spans: dict[tuple[str, int, int], str]) -> dict[str, Any]:
    """From the server's log: requests per K-split tensor, requests and bytes in all (the
    load's own planning pass, the 8-byte prefix and header of each shard, left out)."""
    per: dict[str, int] = dict.fromkeys(spans.values(), 0)
    total = nbytes = 0
    for rec in server.requests("GET"):
        if rec.outcome != "ok" or not rec.path.endswith(".safetensors"):
            continue
        a, b = _range(rec.range)
        if a in (0, 8):
            continue
        total += 1
        nbytes += b - a
        file = rec.path.removeprefix(prefix)
        for (f, s, e), name in spans.items():
            if f == file and a < e and b > s:
                per[name] += 1
    counts = list(per.values())
    return {
        "requests": total,
        "bytes": nbytes,
        "k_split_max": max(counts, default=0),
        "k_split_mean": sum(counts) / max(len(counts), 1),
        "k_split_tensors": len(counts),
    }


def run(
    work: Path,
    *,
    quick: bool,
    latency: float,
    bandwidth: float,
    runs_each: int = 3,
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    from mxload.orchestrator.plan.timemodel import Rates
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.driver import load
    from mxload.orchestrator.runtime.request import LoadRequest

    from tests.servers import RangeHTTPServer

    srv_root = work / "srv"
    cores = os.cpu_count() or 1
    layout = ParallelLayout(tp=4)
    # the fastest of five: other work on a shared machine only slows a run
    models, rate_rank = checkpoints(
        srv_root, rate=lambda src: convert_rate(src, layout, runs=5, pick=max)
    )
    repeats = 1 if quick else runs_each
    rows: list[dict[str, Any]] = []
    shard = sorted(p.name for p in Path(models["dense"]).glob("*.safetensors"))[0]
    with RangeHTTPServer(str(srv_root), bandwidth=bandwidth, latency=latency) as server:
        probe = probe_requests(f"{server.url}/dense", shard)
        start = {m: probe_start(f"{server.url}/{m}", layout, work) for m in models}
        with TwoNodes(4, count=1) as nodes:
            for model in only or ("dense", "moe"):
                spans = k_split_spans(models[model])
                runs: dict[str, list[dict[str, Any]]] = {"rows": [], "whole": []}
                for _ in range(repeats):
                    for policy in ("rows", "whole"):  # taking turns
                        req = LoadRequest(
                            src=f"{server.url}/{model}",
                            layout=layout,
                            device="cpu",
                            address=nodes.cluster.address,
                            share="cluster",
                        )
                        server.clear_log()
                        with rows_policy(policy == "rows"):
                            manifest, _ = load(req)
                        sh = manifest["sharing"]
                        rates = Rates(
                            storage_node=0.0,
                            storage_aggregate=bandwidth,
                            network_node=0.0,
                            convert=rate_rank[model] * min(1.0, cores / layout.world),
                            request_latency=probe["latency"],
                            request_concurrency=16,
                            storage_requests=probe["rate"],
                            # a fresh process's start is CPU work (imports, the
                            # store client's session): the ranks start at once and
                            # share the cores, as they share them converting
                            start_seconds=start[model] * max(1.0, layout.world / cores),
                        )
                        times = predicted(manifest, rates, requests=True)
                        log = served(server, f"{model}/", spans)
                        runs[policy].append(
                            {
                                **log,
                                "unique": sh["unique_bytes_needed"],
                                "measured": sh["run_seconds"],
                                "predicted": max(t.load_seconds for t in times),
                                "predicted_requests": sum(t.requests for t in times),
                                # phases apart: the owners' fetch (start cost included)
                                # and the slowest rank's load after it
                                "fetch_measured": sh["fetch_seconds"],
                                "plan_measured": sh["plan_seconds"],
                                "owner_fetch_measured": max(
                                    (r.get("fetch_seconds") or 0.0 for r in manifest["ranks"]),
                                    default=0.0,
                                ),
                                "fetch_predicted": times[0].start_seconds + times[0].fetch_seconds,
                                "load_average": load_average()[0],
                            }
                        )
                for policy, got in runs.items():
                    first = got[0]
                    rows.append(
                        {
                            "model": model,
                            "policy": policy,
                            "k_split_max": first["k_split_max"],
                            "k_split_mean": first["k_split_mean"],
                            "requests": first["requests"],
                            "predicted_requests": first["predicted_requests"],
                            "served_over_unique": first["bytes"] / first["unique"],
                            "measured": Timing(tuple(r["measured"] for r in got)),
                            "predicted": Timing(tuple(r["predicted"] for r in got)),
                            "ratio": Rate(tuple(r["predicted"] / r["measured"] for r in got)),
                            "speedup": Rate(
                                tuple(
                                    a["measured"] / b["measured"]
                                    for a, b in zip(runs["rows"], runs["whole"], strict=True)
                                )
                            ),
                            "runs": got,
                        }
                    )
    return {
        "latency": latency,
        "bandwidth": bandwidth,
        "probe": probe,
        "convert_rate_rank": rate_rank,
        "start_seconds": start,
        "cores": cores,
        "rows": rows,
    }


def _samples(o: Any, cls: Any) -> Any:
    """A Timing or Rate, also from its JSON (``--render``)."""
    if isinstance(o, dict):
        return cls(tuple(o["samples_s"] if "samples_s" in o else o["samples"]))
    return o


def _phases(wr: dict[str, Any]) -> list[list[Any]]:
    """Per model and policy: the owners' phase and the loads after it, measured against
    predicted, and the machine's load average over the runs."""
    out = []
    for r in wr["rows"]:
        runs = r["runs"]
        fetch = Timing(tuple(x["fetch_measured"] for x in runs))
        planned = Timing(tuple(x["plan_measured"] for x in runs))
        owners = Timing(tuple(x["owner_fetch_measured"] for x in runs))
        fetch_p = Timing(tuple(x["fetch_predicted"] for x in runs))
        load = Timing(tuple(x["measured"] - x["fetch_measured"] for x in runs))
        load_p = Timing(tuple(x["predicted"] - x["fetch_predicted"] for x in runs))
        la = [x["load_average"] for x in runs]
        out.append(
            [
                r["model"],
                "one request per row" if r["policy"] == "rows" else "whole rows",
                fetch.text(2),
                planned.text(2),
                owners.text(2),
                fetch_p.text(2),
                load.text(2),
                load_p.text(2),
                f"{min(la):.1f}-{max(la):.1f}",
            ]
        )
    return out


def render(res: dict[str, Any], command: str) -> str:
    wr = res["whole_rows"]
    for r in wr["rows"]:
        for k in ("measured", "predicted"):
            r[k] = _samples(r[k], Timing)
        for k in ("ratio", "speedup"):
            r[k] = _samples(r[k], Rate)
    table = [
        [
            r["model"],
            "one request per row" if r["policy"] == "rows" else "whole rows",
            r["k_split_max"],
            f"{r['k_split_mean']:.1f}",
            f"{r['requests']} ({r['predicted_requests']})",
            f"{r['served_over_unique']:.3f}",
            r["measured"].text(2),
            r["predicted"].text(2),
            r["ratio"].text(2),
            r["speedup"].text(1) if r["policy"] == "whole" else "-",
        ]
        for r in wr["rows"]
    ]
    head = [
        "model, tp 4, --share cluster",
        "K-split reads",
        "requests per K-split tensor, most",
        "mean",
        "requests (predicted)",
        "served / unique bytes",
        "data phase (s)",
        "predicted (s)",
        "predicted / measured",
        "rows / whole rows",
    ]
    return "\n".join(
        [
            "# K-split slices from an object store: one request per row against whole rows",
            "",
            f"`{command}`, {res['date']}; {res['machine']}; load {res['load_before']} before, "
            f"{res['load_after']} after.",
            "",
            f"Loopback HTTP server: {wr['latency'] * 1000:g} ms added to every request, "
            f"{wr['bandwidth'] / 1e6:g} MB/s in all; measured request latency "
            f"{wr['probe']['latency'] * 1000:.1f} ms (one client), rate "
            f"{wr['probe']['rate']:.0f}/s (four clients, 16 in flight each); conversion "
            f"{', '.join(f'{k} {v / 1e6:.0f} MB/s' for k, v in wr['convert_rate_rank'].items())}"
            f" for one tp 4 rank alone, shared by the ranks on {wr['cores']} cores; start cost "
            "of a fresh rank process "
            f"{', '.join(f'{k} {v:.2f} s' for k, v in wr['start_seconds'].items())}. "
            "Requests and bytes from "
            "the server's log, planning pass left out; the data phase is "
            "`manifest.sharing.run_seconds`.",
            "",
            md_table(head, table),
            "",
            "Phases (median, range): phase 1 is from the load's first request to the last "
            "owner's publication, the driver's sharing plan and the owners' own fetch "
            "(slowest owner) within it; predicted phase 1 includes the start cost. Phase 2 "
            "is the rest of the data phase. Load average (1 min) after each load.",
            "",
            md_table(
                [
                    "model",
                    "K-split reads",
                    "phase 1 (s)",
                    "of which sharing plan",
                    "owners' fetch",
                    "predicted",
                    "phase 2 (s)",
                    "predicted",
                    "load average",
                ],
                _phases(wr),
            ),
        ]
    )


def _jsonable(o: Any) -> Any:
    if isinstance(o, (Timing, Rate)):
        return o.to_json()
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one load per policy")
    ap.add_argument("--runs", type=int, default=3, help="loads per policy and model")
    ap.add_argument("--models", nargs="+", choices=("dense", "moe"), default=())
    ap.add_argument("--latency", type=float, default=0.005, help="seconds added per request")
    ap.add_argument("--bandwidth", type=float, default=50e6, help="server bytes/s in all")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--render", metavar="JSON", help="print a recorded run's markdown again")
    args = ap.parse_args(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        print(render(res, res.get("command", "python bench/bench_whole_rows.py")))
        return 0
    work = Path(tempfile.mkdtemp(prefix="mxbench-rows-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = ("python bench/bench_whole_rows.py " + " ".join(argv or sys.argv[1:])).strip()
    try:
        res: dict[str, Any] = {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine_facts(),
            "load_before": load_average(),
        }
        res["whole_rows"] = run(
            work,
            quick=args.quick,
            latency=args.latency,
            bandwidth=args.bandwidth,
            runs_each=args.runs,
            only=tuple(args.models),
        )
        res["load_after"] = load_average()
        text = render(res, command)
        (out / "whole-rows.md").write_text(text + "\n")
        (out / "whole-rows.json").write_text(json.dumps(_jsonable(res), indent=1, default=str))
        print(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
