"""The time model (``mxload.orchestrator.plan.timemodel``): processor sharing worked by hand, the
two phases, and ``mxload plan``'s predicted seconds. No timing is measured here (the
model is checked against measured loads in ``bench/bench_cluster.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from mxload.orchestrator.cli.commands import main
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.sharing import RankTraffic
from mxload.orchestrator.plan.timemodel import Rates, plan_times, predict, shared_link
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import model_config, model_config_path


def test_shared_link_by_hand() -> None:
    # 3 transfers of 10, 20, 40 bytes on 10 B/s: all three at 10/3 B/s until the first
    # ends (3 s), the other two at 5 B/s for 10 more bytes (2 s: t=5), the last alone for
    # 20 more bytes (2 s: t=7) = total bytes / capacity.
    assert shared_link([40, 10, 20], 10.0) == pytest.approx([7.0, 3.0, 5.0])
    assert shared_link([0, 5], 5.0) == pytest.approx([0.0, 1.0])  # nothing to share with
    assert shared_link([5, 5], 0.0) == [0.0, 0.0]  # unlimited


def traffic(storage: int, peers: int = 0, remote: int = 0, fetched: int = 0) -> RankTraffic:
    return RankTraffic(storage, peers, remote, fetched, fetched)


def test_two_phases_and_the_slowest_resource() -> None:
    rates = Rates(storage_node=100.0, storage_aggregate=150.0, network_node=50.0, convert=40.0)
    nodes = ["a", "a", "b"]
    t = [traffic(300, fetched=200), traffic(100), traffic(0, peers=100, remote=100)]
    got = predict(t, [100, 100, 100], nodes, rates)
    # phase 1: only rank 0 fetches 200 shared bytes: node a's link, 2 s
    assert all(r.fetch_seconds == pytest.approx(2.0) for r in got)
    # phase 2 storage: ranks 0 and 1 read 100 each on node a (100 B/s shared): 2 s each;
    # the aggregate (150 B/s for 200 bytes) would allow 1.33 s
    assert got[0].storage_seconds == pytest.approx(2.0) == got[1].storage_seconds
    # rank 2 pulls 100 bytes from node a at 50 B/s; converting 100 bytes takes 2.5 s
    assert got[2].network_seconds == pytest.approx(2.0)
    assert [r.convert_seconds for r in got] == pytest.approx([2.5, 2.5, 2.5])
    assert [r.load_seconds for r in got] == pytest.approx([4.5, 4.5, 4.5])
    assert got[0].reload_seconds == got[0].load_seconds
    with pytest.raises(ValueError, match="convert"):
        Rates(convert=-1.0)


def test_a_fresh_process_start_cost_is_paid_by_a_load_not_a_reload() -> None:
    # The same cluster as above, with each fresh rank process taking 0.5 s longer over
    # its first read: every load starts 0.5 s later (4.5 -> 5.0 s); a reload's processes
    # are warm, so it stays at 4.5 s.
    rates = Rates(
        storage_node=100.0,
        storage_aggregate=150.0,
        network_node=50.0,
        convert=40.0,
        start_seconds=0.5,
    )
    t = [traffic(300, fetched=200), traffic(100), traffic(0, peers=100, remote=100)]
    got = predict(t, [100, 100, 100], ["a", "a", "b"], rates)
    assert [r.load_seconds for r in got] == pytest.approx([5.0, 5.0, 5.0])
    assert [r.reload_seconds for r in got] == pytest.approx([4.5, 4.5, 4.5])
    assert all(r.fetch_seconds == pytest.approx(2.0) for r in got)  # phases unchanged
    with pytest.raises(ValueError, match="start_seconds"):
        Rates(start_seconds=-0.1)


def qwen_plan(layout: ParallelLayout):
    name = "qwen3-30b-a3b-fp8"
    cfg = parse_config(model_config(name), str(model_config_path(name)))
    return cfg, build_plan(cfg, layout, device="npu", fused=False)


def test_plan_times_sharing_scopes_on_a_config_plan() -> None:
    cfg, plan = qwen_plan(ParallelLayout(tp=2, dp=4, enable_expert_parallel=True))
    storage_bound = Rates(storage_node=1e9, storage_aggregate=2e9, network_node=0, convert=0)
    got = {
        s: plan_times(plan, cfg, rates=storage_bound, scope=s, devices_per_node=4)
        for s in ("none", "node", "cluster")
    }
    none, node, cluster = got["none"], got["node"], got["cluster"]
    assert none["bytes_from_storage"] == sum(rp.bytes_needed for rp in plan.ranks)
    assert cluster["bytes_from_storage"] == cluster["distinct_read_bytes"]
    assert cluster["bytes_from_storage"] < node["bytes_from_storage"] < none["bytes_from_storage"]
    loads = [g["predicted_load_seconds"] for g in (cluster, node, none)]
    assert loads == sorted(loads) and loads[0] > 0
    # every rank gets all of its bytes: from storage, from peers, or a unit it owns
    for rp, tr in zip(plan.ranks, cluster["traffic"], strict=True):
        own = tr.bytes_from_storage - tr.bytes_fetched_for_sharing
        assert own + tr.bytes_from_peers + tr.shared_put_bytes >= rp.bytes_needed
    with pytest.raises(ValueError, match="devices per node"):
        plan_times(plan, cfg, rates=storage_bound, scope="cluster", devices_per_node=0)


def test_mxload_plan_prints_and_reports_predicted_times(capsys) -> None:
    args = ["plan", "--model", "qwen3-30b-a3b-fp8", "--tp", "2", "--dp", "2"]
    assert main([*args, "--enable-expert-parallel", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    for r in obj["ranks"]:
        assert r["predicted_load_seconds"] > 0
        assert r["predicted_reload_seconds"] == r["predicted_load_seconds"]
        assert r["bytes_from_storage"] >= 0 and r["bytes_from_peers"] >= 0
    tm = obj["time_model"]
    assert tm["share"] == "cluster" and tm["rates_bytes_per_s"]["storage_node"] == 5e9
    assert tm["predicted_load_seconds"] == max(r["predicted_load_seconds"] for r in obj["ranks"])
    # a slower store predicts a slower load; the table says so in words
    assert main([*args, "--storage-bandwidth", "500MB", "--share", "none"]) == 0
    out = capsys.readouterr().out
    assert "predicted load" in out and "--share none" in out
    # a zero rate is refused naming the flag (exit 2)
    assert main([*args, "--convert-rate", "0B"]) == 2
    assert "--convert-rate" in capsys.readouterr().err


def test_request_latency_paces_a_rank() -> None:
    # 1000 requests, 10 ms each, 10 in flight: 1 s, whatever few bytes they carry; the
    # same bytes in 10 requests are link-bound instead (100 bytes at 100 B/s).
    rates = Rates(
        storage_node=100.0,
        storage_aggregate=0.0,
        network_node=0.0,
        convert=0.0,
        request_latency=0.01,
        request_concurrency=10,
    )
    many, few = predict(
        [traffic(100), traffic(100)], [0, 0], ["a", "b"], rates, [(1000, 0), (10, 0)]
    )
    assert many.storage_seconds == pytest.approx(1.0)
    assert few.storage_seconds == pytest.approx(1.0)  # 100 B at 100 B/s; latency 0.01 s
    assert (many.requests, few.requests) == (1000, 10)
    with pytest.raises(ValueError, match="concurrency"):
        Rates(request_concurrency=0)


def test_units_read_one_after_another_each_wait_a_latency() -> None:
    # Phase 2 reads a rank's own units one after another: 3 units of 100 B in all on a
    # 100 B/s link with 0.5 s to first byte wait 3 x 0.5 s besides the bytes' 1 s (2.5 s),
    # where their 4 requests 16 in flight alone would say 0.125 s; the owners' phase 1
    # has no such wait (their shared units are in flight together).
    rates = Rates(
        storage_node=100.0,
        storage_aggregate=0.0,
        network_node=0.0,
        convert=0.0,
        request_latency=0.5,
    )
    t = [traffic(300, fetched=200)]
    (got,) = predict(t, [0], ["a"], rates, [(4, 2)], [3])
    assert got.storage_seconds == pytest.approx(1.0 + 1.5)
    assert got.fetch_seconds == pytest.approx(2.0)  # 200 B; 2 requests in flight
    assert got.request_seconds == pytest.approx(0.5 * 3)  # 3 waits over 6 / 16 paced
    # 40 units of 1 B: their waits (20 s) over the requests' pacing (40 x 0.5 / 16)
    (many,) = predict([traffic(40)], [0], ["a"], rates, [(40, 0)], [40])
    assert many.storage_seconds == pytest.approx(0.4 + 20.0)
    (off,) = predict(t, [0], ["a"], replace(rates, unit_waits=False), [(4, 2)], [3])
    assert off.storage_seconds == pytest.approx(1.0)


def test_store_request_rate_is_shared_like_its_bandwidth() -> None:
    # One store: 100 B/s and 100 requests/s, two resources, no latency. Rank 0: 200 B
    # and 50 requests; rank 1: 100 requests. Bandwidth: rank 0 alone, 2 s. Requests:
    # 50/s each until rank 0's 50 are through (1 s), then rank 1's last 50 alone (0.5 s).
    # Rank 0 ends at max(2, 1) = 2 s, rank 1 at 1.5 s (one shared server time, the sum,
    # would say 3.5 s and 2 s).
    rates = Rates(
        storage_node=0.0,
        storage_aggregate=100.0,
        network_node=0.0,
        convert=0.0,
        request_latency=0.0,
        storage_requests=100.0,
    )
    got = predict([traffic(200), traffic(0)], [0, 0], ["a", "b"], rates, [(50, 0), (100, 0)])
    assert [r.storage_seconds for r in got] == pytest.approx([2.0, 1.5])
    # the shared reads' owners pay their requests in phase 1, which everyone waits for
    got = predict(
        [traffic(0, fetched=0), traffic(0)], [0, 0], ["a", "b"], rates, [(0, 200), (0, 0)]
    )
    assert [r.fetch_seconds for r in got] == pytest.approx([2.0, 2.0])
    # without request counts the model is the bytes-only one
    assert predict([traffic(100)], [0], ["a"], rates)[0].storage_seconds == pytest.approx(1.0)


def test_rank_requests_charge_the_owner_only() -> None:
    from mxload.orchestrator.plan.sharing import SharedRead, SharePlan, rank_requests

    # rank 0 owns unit 1 (shared with rank 1's unit 0); rank 1 also reads unit 1 alone
    share = SharePlan(
        "cluster",
        (SharedRead(key=0, owner=0, users=((0, 1), (1, 0)), nbytes=8, fetch_bytes=8),),
        ("n", "n"),
    )
    got = rank_requests(share, [[3, 5], [5, 7]].__getitem__)
    assert got == [(3, 5), (7, 0)]


def test_config_plan_counts_k_split_rows_as_requests() -> None:
    from mxload.orchestrator.plan.readplan import estimated_requests

    cfg, plan = qwen_plan(ParallelLayout(tp=2))
    o_proj = next(u for u in plan.ranks[0].units if ".o_proj." in u.buffer)
    (part,) = o_proj.parts
    assert part.ncols * 2 == part.source_shape[-1]  # K-split at tp 2
    # remote: one request per row, and one per row of 128-row scale tiles
    assert estimated_requests(o_proj, cfg) == part.nrows + -(-part.nrows // 128)
    # local: the gap (K/2 bytes of FP8, 2048 here) is under a page: one span, one scale read
    assert estimated_requests(o_proj, cfg, remote=False) == 2
    qkv = next(u for u in plan.ranks[0].units if ".qkv_proj." in u.buffer)
    assert estimated_requests(qkv, cfg) == 2 * len(qkv.parts)  # row-split: weight + scale


def test_mxload_plan_reports_requests(capsys) -> None:
    args = ["plan", "--model", "qwen3-30b-a3b-fp8", "--tp", "2", "--dp", "2", "--json"]
    assert main([*args, "--request-latency", "0.5"]) == 0
    obj = json.loads(capsys.readouterr().out)
    tm = obj["time_model"]
    assert tm["request_latency_s"] == 0.5 and tm["requests_to_storage"] > 0
    slowest = max(obj["ranks"], key=lambda r: r["predicted_requests"])
    # half a second per request, 16 in flight: the requests alone bound the load time
    assert tm["predicted_load_seconds"] >= slowest["predicted_requests"] * 0.5 / 16
    assert main([*args[:-1], "--request-latency", "0.5"]) == 0
    assert "the slowest rank waits" in capsys.readouterr().out
    assert main([*args, "--request-latency", "-1"]) == 2
    assert "--request-latency" in capsys.readouterr().err
