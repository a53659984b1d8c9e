"""Read once per cluster, counted by the storage server itself.

A tp 2 x dp 2 load over HTTP (the loopback Range server of ``tests/servers.py``): the
server's own log of the byte ranges it answered shows every byte some rank needs served
exactly once with ``--share cluster`` (but for the scale tiles two TP slices both cover,
fetched once per slice), and twice (once per data-parallel replica) for the
replicated tensors with ``--share none``. Every rank's buffers are compared with the
independent reference either way, and the manifest's per-rank ``bytes_from_storage`` /
``bytes_from_peers`` are held against the server's count and the plan's prediction.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import numpy as np
import pytest
from mxload.orchestrator.plan.ranges import REMOTE_POLICY, coalesce
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.driver import load, plan_load
from mxload.orchestrator.runtime.request import LoadRequest
from safetensors.torch import load_file

from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def served_counts(server, root: str) -> dict[str, np.ndarray]:
    """How many times the server sent each byte of each shard (successful GETs)."""
    counts: dict[str, np.ndarray] = {}
    for rec in server.requests("GET"):
        if not rec.path.endswith(".safetensors") or rec.outcome != "ok":
            continue
        path = os.path.join(root, rec.path)
        c = counts.setdefault(rec.path, np.zeros(os.path.getsize(path), dtype=np.int32))
        first, _, last = rec.range.removeprefix("bytes=").partition("-")
        c[int(first) : int(last) + 1] += 1
    return counts


def distinct_cover(plan, root: str, prefix: str) -> dict[str, np.ndarray]:
    """Per byte of each shard: how many *distinct* unit reads (by what they fetch) need
    it. 0: not needed; 1: needed by one unit read however many ranks need it (TP ranks
    keeping different columns of the same whole rows included); 2: a scale tile that two
    TP slices' units both need (qkv's k/v tile when a slice is under a tile tall), which
    sharing by unit fetches once per slice."""
    by_file: dict[str, list] = {}
    distinct = {ur.fetch_key: ur for rp in plan.ranks for ur in rp.reads if ur.nbytes}
    for ur in distinct.values():
        mine: dict[str, list] = {}
        for p in ur.parts:
            mine.setdefault(p.file, []).append(p.weight)
            if p.scale is not None:
                mine.setdefault(p.scale_file or p.file, []).append(p.scale)
        for f, rs in mine.items():
            by_file.setdefault(f, []).append(rs)
    cover: dict[str, np.ndarray] = {}
    for f, groups in by_file.items():
        c = cover[prefix + f] = np.zeros(os.path.getsize(os.path.join(root, f)), dtype=np.int32)
        for rs in groups:
            mask = np.zeros(c.size, dtype=bool)
            for r in rs:
                for a, n in r.segments():
                    mask[a : a + n] = True
            c += mask
    return cover


def check_reference(src: str, layout: ParallelLayout, dump: str) -> None:
    ref = RefCheckpoint(src)
    lay = Layout(layout.tp, layout.dp, layout.pp, layout.enable_expert_parallel, "linear")
    for rank in range(layout.world):
        got = load_file(os.path.join(dump, f"rank-{rank:05d}.safetensors"))
        problems = compare_rank(expected_rank(ref, lay, rank), got)
        assert problems == [], f"rank {rank}: {problems[:5]}"


@pytest.mark.parametrize("share", ["cluster", "none"])
def test_http_dp2_serves_each_needed_byte_once(
    local_ray, ckpt_factory, http_server, tmp_path, share: str
) -> None:
    local = ckpt_factory("qwen3-moe-tiny", 7)
    root = tmp_path / "srv"
    shutil.copytree(local, root / "ck")
    server = http_server(str(root))
    url = server.url + "/ck"
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
    req = LoadRequest(src=url, layout=layout, device="cpu", share=share)
    _, plan = plan_load(req)
    server.clear_log()  # planning read config, index and headers; count the load only
    dump = str(tmp_path / "dump")
    manifest, _ = load(req, dump=dump)
    check_reference(str(root / "ck"), layout, dump)

    counts = served_counts(server, str(root))
    cover = distinct_cover(plan, str(root / "ck"), "ck/")
    assert set(cover) <= set(counts)
    needed_served = np.concatenate([counts[f][c > 0] for f, c in cover.items()])
    assert needed_served.min() >= 1, "every needed byte was served"

    # Which rank fetched which unit, as the manifest's sharing plan says; the server's
    # log must hold exactly those units' coalesced requests (remote coalescing may
    # bridge a gap holding bytes another request needs: over-read, not a second fetch
    # of what that request needs), and the bytes each request was *for* must cover every
    # needed byte once.
    fetched_units = fetched_reads(plan, manifest, share)
    want = Counter()
    needed_by_requests: dict[str, np.ndarray] = {f: np.zeros_like(c) for f, c in cover.items()}
    for ur in fetched_units:
        by_file: dict[str, list] = {}
        for p in ur.parts:
            by_file.setdefault(p.file, []).append(p.weight)
            if p.scale is not None:
                by_file.setdefault(p.scale_file or p.file, []).append(p.scale)
        for f, rs in by_file.items():
            for q in coalesce(rs, REMOTE_POLICY):
                want[("ck/" + f, f"bytes={q.start}-{q.end - 1}")] += 1
            mask = np.zeros_like(cover["ck/" + f], dtype=bool)
            for r in rs:
                for a, n in r.segments():
                    mask[a : a + n] = True
            needed_by_requests["ck/" + f] += mask
    got = Counter(
        (rec.path, rec.range)
        for rec in server.requests("GET")
        if rec.outcome == "ok" and rec.path.endswith(".safetensors") and not is_planning(rec)
    )
    assert got == want
    # the time model's request count (plan side, per rank) is what the server answered
    predicted = manifest["sharing"]["predicted_requests"]
    assert len(predicted) == layout.world
    assert sum(own + owned for own, owned in predicted) == sum(got.values())
    single = np.concatenate([needed_by_requests[f][c == 1] for f, c in cover.items()])
    overlap = np.concatenate([needed_by_requests[f][c > 1] for f, c in cover.items()])
    assert single.min() == 1 and overlap.size < 1e-3 * needed_served.size

    sharing = manifest["sharing"]
    ranks = manifest["ranks"]
    server_bytes = sum(
        range_bytes(rec.range) for rec in server.requests("GET") if rec.outcome == "ok"
    )
    planning = sum(range_bytes(rec.range) for rec in server.requests("GET") if is_planning(rec))
    # what the workers counted is what the server sent, but for the load's planning pass
    assert sum(r["bytes_from_storage"] for r in ranks) == server_bytes - planning
    for r in ranks:
        assert r["bytes_from_storage"] == r["predicted_bytes_from_storage"], r["rank"]
        assert r["bytes_from_peers"] == r["predicted_bytes_from_peers"], r["rank"]
        assert r["bytes_read"] == plan.ranks[r["rank"]].bytes_to_read
        meas, pred = r["measured_peak_staging_bytes"], r["predicted_peak_staging_bytes"]
        assert 0 < meas <= pred <= 1.10 * meas
    if share == "cluster":
        assert single.max() == 1, "a needed byte was fetched twice"
        # a tile two TP slices both cover is fetched once per slice (a documented limit)
        assert overlap.max(initial=0) <= 2
        assert sharing["scope"] == "cluster" and sharing["shared_reads"] > 0
        assert sum(r["bytes_from_peers"] for r in ranks) > 0
        assert sharing["bytes_from_storage"] <= 1.25 * sharing["unique_bytes_needed"]
    else:
        # attention and embeddings are read by both dp replicas, norms by every rank
        assert single.max() == layout.world
        replicated = np.concatenate([needed_by_requests[f][c == 1] for f, c in cover.items()])
        assert (replicated >= layout.dp).mean() > 0.2
        assert all(r["bytes_from_peers"] == 0 for r in ranks)


def fetched_reads(plan, manifest, share: str) -> list:
    """The unit reads storage was asked for: each rank's own unshared reads, and each
    shared read once (the plan of ``mxload.orchestrator.plan.sharing`` rebuilt from the
    manifest's node ids, which is what the driver did)."""
    from mxload.orchestrator.plan.readplan import predicted_read_bytes
    from mxload.orchestrator.plan.sharing import plan_sharing, read_items

    nodes = [r["node_id"] for r in manifest["ranks"]]
    items = [
        read_items(rp.reads, lambda r: predicted_read_bytes((r,), REMOTE_POLICY))
        for rp in plan.ranks
    ]
    sp = plan_sharing(nodes, share, items.__getitem__)
    out = [s for s in sp.shared]
    reads = [plan.ranks[s.owner].reads[next(i for r, i in s.users if r == s.owner)] for s in out]
    for rp in plan.ranks:
        used = sp.used_by(rp.rank)
        reads += [ur for i, ur in enumerate(rp.reads) if i not in used and ur.nbytes]
    return reads


def range_bytes(header: str | None) -> int:
    if header is None:
        return 0
    first, _, last = header.removeprefix("bytes=").partition("-")
    return int(last) + 1 - int(first)


def is_planning(rec) -> bool:
    """A GET of the load's own planning pass (load() plans again: the 8-byte prefix and
    the header of each shard), which no rank counts."""
    if rec.range is None or not rec.path.endswith(".safetensors"):
        return rec.outcome == "ok"
    return rec.range.removeprefix("bytes=").split("-", 1)[0] in ("0", "8")
