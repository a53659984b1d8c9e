"""K-split slices from an object store read as whole rows, fetched once and shared.

A row-parallel ``o_proj`` or a TP-sharded expert's ``w2`` slice is a column window of
every row: from an object store it was one request per row. The remote policy plans it
as the whole rows (a few large requests) with a window, the TP ranks share the fetched
rows through read-once sharing, and each rank cuts its columns out in place. Checked
here without Ray: the buffers equal a load of the exact rectangles, the owner publishes
whole rows, and staging stays under the plan's prediction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mxload.orchestrator.plan.message import PeerUnit, SourceInfo
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.ranges import REMOTE_POLICY
from mxload.orchestrator.plan.readplan import predicted_read_bytes
from mxload.orchestrator.plan.sharing import plan_sharing, read_items
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import RankLoader
from mxload.workers.rank.reads import keep_columns


def test_keep_columns_packs_each_rows_window_in_place() -> None:
    rows = torch.arange(4 * 10, dtype=torch.uint8)  # 4 rows of 10 bytes: 0..9, 10..19, ...
    got = keep_columns(rows, (10, 3, 4))
    assert got.tolist() == [3, 4, 5, 6, 13, 14, 15, 16, 23, 24, 25, 26, 33, 34, 35, 36]
    assert got.data_ptr() == rows.data_ptr()


def test_keep_columns_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import mxload.workers.rank.reads as reads

    monkeypatch.setattr(reads, "GATHER_SCRATCH_BYTES", 8)  # two rows of 4 per block
    rows = torch.arange(5 * 6, dtype=torch.uint8)
    got = keep_columns(rows, (6, 2, 4))
    want = [r * 6 + c for r in range(5) for c in range(2, 6)]
    assert got.tolist() == want


def test_tp_ranks_share_whole_rows_and_load_the_same_buffers(ckpt_factory) -> None:
    src = ckpt_factory("qwen3-moe-tiny", 3)
    meta = open_checkpoint(src)
    layout = ParallelLayout(tp=2)
    exact = build_plan(meta.config, layout, checkpoint=meta)
    rows = build_plan(meta.config, layout, checkpoint=meta, remote=True)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    windowed = {
        u.buffer
        for u, r in zip(rows.ranks[0].units, rows.ranks[0].reads, strict=True)
        if any(p.weight_window != (0, 0, 0) for p in r.parts)
    }
    # row-parallel o_proj and down_proj, and every expert's w2 (K split over tp=2)
    assert any(b.endswith("o_proj.weight") for b in windowed)
    assert any(b.endswith("w2_weight") for b in windowed)
    assert rows.ranks[0].bytes_needed == exact.ranks[0].bytes_needed

    def fetch(r) -> int:
        return predicted_read_bytes((r,), REMOTE_POLICY)

    items = [read_items(rp.reads, fetch) for rp in rows.ranks]
    share = plan_sharing(["a", "a"], "cluster", items.__getitem__)
    shared_rows = [s for s in share.shared if len({r for r, _ in s.users}) == 2]
    assert shared_rows, "the TP ranks share the whole rows of their K-split slices"
    store: dict[int, bytes] = {}

    def publish(arr) -> int:
        store[len(store)] = arr.tobytes()
        return len(store) - 1

    budget = rows.ranks[0].staging.budget_bytes
    handles = {}
    for owner in sorted({s.owner for s in share.shared}):
        ldr = RankLoader(rows.ranks[owner], model_dtype="bf16", backend=select_backend("cpu"))
        owned = []
        for s in share.owned_by(owner):
            i = next(i for r, i in s.users if r == owner)
            owned.append((s.key, rows.ranks[owner].units[i], rows.ranks[owner].reads[i]))
        got = ldr.fetch_for_peers(owned, source, staging_budget=budget, publish=publish)
        # the owner publishes the whole rows, not its own columns
        assert got.published_bytes == sum(s.nbytes for s in share.owned_by(owner))
        handles.update(got.handles)
    # Rank 1 (its columns at an offset): every other shared read from the rows rank 0
    # published, the rest from storage; both paths cut the rows to its columns.
    rank = 1
    used = sorted(share.used_by(rank).items())
    peers = {
        i: PeerUnit(owner=s.owner, fetch_bytes=s.fetch_bytes, handles=handles[s.key])
        for n, (i, s) in enumerate(used)
        if n % 2 == 0
    }
    assert 0 < len(peers) < len(used)
    ref = RankLoader(exact.ranks[rank], model_dtype="bf16", backend=select_backend("cpu"))
    ref.load(exact.ranks[rank].reads, source, version=1, staging_budget=budget)
    ldr = RankLoader(rows.ranks[rank], model_dtype="bf16", backend=select_backend("cpu"))
    stats = ldr.load(
        rows.ranks[rank].reads,
        source,
        version=1,
        staging_budget=budget,
        peers=peers,
        peer_get=lambda h: np.frombuffer(store[h], dtype=np.uint8),
    )
    assert ldr.checksums() == ref.checksums()
    assert stats.bytes_read == rows.ranks[rank].bytes_to_read
    assert stats.bytes_from_peers > 0
    predicted = rows.ranks[rank].staging.staging_bytes
    measured = stats.measured_peak_staging_bytes
    assert measured <= predicted <= 1.10 * measured


def test_owner_keeps_several_units_in_flight_within_its_window(ckpt_factory) -> None:
    """An owner fetches its shared units several at a time (not one request latency per
    unit), never holding more staging than the window the driver gives it, and
    publishes the same bytes as a unit-by-unit fetch."""
    import threading
    import time

    from mxload.workers.storage import Storage

    src = ckpt_factory("qwen3-moe-tiny", 3)
    meta = open_checkpoint(src)
    plan = build_plan(meta.config, ParallelLayout(tp=2), checkpoint=meta, remote=True)
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    items = [read_items(rp.reads, lambda r: r.nbytes) for rp in plan.ranks]
    share = plan_sharing(["a", "a"], "cluster", items.__getitem__)
    rp = plan.ranks[0]
    owned = [
        (s.key, rp.units[i], rp.reads[i])
        for s in share.owned_by(0)
        for i in [next(i for r, i in s.users if r == 0)]
    ]
    assert len(owned) > 4
    lock = threading.Lock()
    now = [0]
    most = [0]

    class Slow(Storage):  # a store's time to first byte, and what is in flight
        def read_ranges_into(self, relpath, ranges, out):  # type: ignore[no-untyped-def]
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            time.sleep(0.01)
            try:
                return super().read_ranges_into(relpath, ranges, out)
            finally:
                with lock:
                    now[0] -= 1

    window = max(r.nbytes for r in rp.reads)
    budget = rp.staging.budget_bytes
    got = {}
    for w in (0, window):
        store: dict[int, bytes] = {}

        def publish(arr, store=store) -> int:
            store[len(store)] = arr.tobytes()
            return len(store) - 1

        ldr = RankLoader(
            rp, model_dtype="bf16", backend=select_backend("cpu"), storage_factory=Slow
        )
        most[0] = 0
        res = ldr.fetch_for_peers(
            owned, source, staging_budget=budget, publish=publish, window_bytes=w
        )
        got[w] = (
            most[0],
            res.peak_staging_bytes,
            {k: [store[h] for _, h in v] for k, v in res.handles.items()},
        )
    assert got[0][0] == 1  # one unit at a time
    assert got[window][0] > 1, "several units in flight"
    assert got[window][1] <= window <= rp.staging.staging_bytes
    assert got[window][2] == got[0][2]


def test_any_split_width_reads_whole_rows_once_per_group() -> None:
    """Experts TP-sharded over dp x tp = 32 ranks (wider than a node) without EP: each
    rank keeps 32 of an expert w2's 1024 columns. Its slice is planned as the whole rows,
    the 32 ranks read the same rows (one fetch with sharing), the rows are in each
    rank's staging, and the plan's requests drop from one per row to a few per expert."""
    from mxload.orchestrator.plan.ranges import ROW_REMOTE_POLICY
    from mxload.orchestrator.plan.timemodel import Rates, plan_times

    from tests.unit.test_planner import L, fake_meta, synthetic

    cfg = synthetic("moe", moe_intermediate_size=1024)  # 4 MoE layers of 10 experts
    layout = L(tp=4, dp=8)
    plan = build_plan(cfg, layout, checkpoint=fake_meta(cfg), remote=True)
    keys = set()
    for rp in plan.ranks:
        w2 = [r for u, r in zip(rp.units, rp.reads, strict=True) if u.kind == "moe_w2"]
        assert len(w2) == 4 * 10
        for r in w2:
            (p,) = r.parts
            # hidden 256 rows of 1024 FP8 bytes, 32 of them kept; 2 x 8 F32 scale tiles
            assert (p.weight.nbytes, p.weight_window[0], p.weight_window[2]) == (
                256 * 1024,
                1024,
                32,
            )
            assert p.scale is not None and p.scale.nbytes == 2 * 8 * 4
            keys.add(r.fetch_key)
        assert rp.staging.read_bytes >= 256 * 1024 + 2 * 8 * 4
    assert len(keys) == 4 * 10  # every rank reads the same rows: fetched once per cluster
    # Config-only, from an object store: the slowest rank's w2 requests (a shared read
    # counted for each use) are 2 per expert (weight, scale tiles), against one per row
    # and one per tile row (256 + 2) read as slices.
    config_plan = build_plan(cfg, layout)
    got = {
        name: plan_times(
            config_plan,
            cfg,
            rates=Rates(),
            scope="cluster",
            devices_per_node=16,
            local=False,
            policy=policy,
        )
        for name, policy in (("whole", REMOTE_POLICY), ("rows", ROW_REMOTE_POLICY))
    }
    assert got["whole"]["slowest_rank_requests_by_kind"]["moe_w2"] == 4 * 10 * 2
    assert got["rows"]["slowest_rank_requests_by_kind"]["moe_w2"] == 4 * 10 * (256 + 2)
    # in the cluster: 40 w2 whole-row reads of 2 requests once, against 32 ranks' rows
    drop = got["rows"]["requests_to_storage"] - got["whole"]["requests_to_storage"]
    assert drop >= 32 * 4 * 10 * (256 + 2) - 4 * 10 * 2
