"""Read plans (docs/contract.md §2.1, §4 "Streaming", §6): byte ranges of parts and covering tiles.

Hand-computed expectations for misaligned slices (floor-based tile coverage, never ceil
of the offset), compactness (one strided range per row-split part, not one per row), the
fast coalescing count against ``mxload.orchestrator.plan.ranges.requested_bytes`` on random range
sets, and an end-to-end check that the planned ranges of a real synthetic checkpoint hold
exactly the bytes of each part's rectangle.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from mxload.orchestrator.plan.checkpoint import CheckpointMeta
from mxload.orchestrator.plan.config import ModelConfig, parse_config
from mxload.orchestrator.plan.formats import SAFETENSORS_ITEMSIZE
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.ranges import (
    LOCAL_POLICY,
    REMOTE_POLICY,
    ByteRange,
    CoalescePolicy,
    coalesce,
    contiguous,
    requested_bytes,
)
from mxload.orchestrator.plan.readplan import (
    coalesced_fast,
    needed_bytes,
    predicted_read_bytes,
    rect_range,
    requested_bytes_fast,
    tile_span,
    unit_reads,
)
from mxload.orchestrator.plan.safetensors_header import TensorInfo
from mxload.orchestrator.plan.types import ParallelLayout, Part, PartRead, Unit, UnitReads

from tests.unit.test_planner import fake_meta, real, synthetic


def config(quant: dict[str, object]) -> ModelConfig:
    return parse_config(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 512,
            "num_hidden_layers": 1,
            "vocab_size": 1024,
            "quantization_config": quant,
        },
        "hand/config.json",
    )


BLOCK = config({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})  # fmt: skip
MXFP8 = config({"quant_method": "mxfp8"})


def meta(cfg: ModelConfig, *tensors: TensorInfo) -> CheckpointMeta:
    return CheckpointMeta(
        root="hand://", config=cfg, tensors={t.name: t for t in tensors},
        files=tuple(sorted({t.file for t in tensors})), headers={},
    )  # fmt: skip


def unit_of(*parts: Part) -> Unit:
    return Unit(
        buffer="x.weight", kind="linear", layout="dense", rows=sum(p.nrows for p in parts),
        cols=parts[0].ncols, parts=parts, quantized=True,
    )  # fmt: skip


# --- tiles and rectangles ------------------------------------------------------------------


def test_tile_span_is_floor_of_first_and_last() -> None:
    assert tile_span(0, 128, 128) == (0, 1)
    assert tile_span(0, 129, 128) == (0, 2)
    assert tile_span(100, 300, 128) == (0, 3)  # ceil(100/128) = 1 would lose tile 0
    assert tile_span(128, 256, 128) == (1, 2)
    assert tile_span(255, 257, 128) == (1, 3)
    assert tile_span(40, 90, 32) == (1, 3)


def test_rect_range_forms() -> None:
    # whole rows: one contiguous range
    assert rect_range(100, 64, 2, (3, 5), (0, 32)) == contiguous(100 + 3 * 64, 128)
    # one row, part of it: contiguous
    assert rect_range(100, 64, 2, (3, 4), (4, 8)) == contiguous(100 + 3 * 64 + 8, 8)
    # a column window of several rows: one strided range
    assert rect_range(100, 64, 2, (3, 7), (4, 8)) == ByteRange(100 + 3 * 64 + 8, 8, 64, 4)


def test_block_fp8_misaligned_slice_hand_computed() -> None:
    # weight F8 [640, 384] at 1000 in a.safetensors; scale F32 [5, 3] at 500000 in b.
    w = TensorInfo("m.weight", "F8_E4M3", (640, 384), "a.safetensors", 1000, 640 * 384)
    s = TensorInfo("m.weight_scale_inv", "F32", (5, 3), "b.safetensors", 500000, 60)
    ck = meta(BLOCK, w, s)
    whole_tiles = Part("m", (200, 520), (100, 300), 0, "", (640, 384))
    one_tile_col = Part("m", (200, 520), (130, 250), 320, "", (640, 384))
    reads = unit_reads(unit_of(whole_tiles, one_tile_col), ck)
    a, b = reads.parts
    assert a.file == "a.safetensors" and a.scale_file == "b.safetensors"
    assert a.weight == ByteRange(1000 + 200 * 384 + 100, 200, 384, 320)
    # rows 200..519 -> tile rows floor(200/128)=1 .. floor(519/128)=4; cols 100..299 ->
    # tile cols 0..2 = every column: four whole tile rows, contiguous from (1, 0)
    assert (a.tile_rows, a.tile_cols) == ((1, 5), (0, 3))
    assert a.scale == contiguous(500000 + 1 * 3 * 4, 4 * 3 * 4)
    # cols 130..249 -> tile col 1 only: four 4-byte entries at the 12-byte row stride
    assert (b.tile_rows, b.tile_cols) == ((1, 5), (1, 2))
    assert b.scale == ByteRange(500000 + (1 * 3 + 1) * 4, 4, 12, 4)
    assert reads.nbytes == 200 * 320 + 48 + 120 * 320 + 16
    assert a.weight_dtype == "F8_E4M3" and a.scale_dtype == "F32"


def test_mxfp8_scale_rectangle() -> None:
    w = TensorInfo("m.weight", "F8_E4M3", (64, 128), "a.safetensors", 0, 64 * 128)
    s = TensorInfo("m.weight_scale", "U8", (64, 4), "a.safetensors", 10000, 256)
    ck = meta(MXFP8, w, s)
    (p,) = unit_reads(unit_of(Part("m", (8, 24), (32, 96), 0, "", (64, 128))), ck).parts
    assert p.scale == ByteRange(10000 + 8 * 4 + 1, 2, 4, 16)
    assert (p.tile_rows, p.tile_cols) == ((8, 24), (1, 3))
    # a window not on group boundaries still reads the groups covering it
    (p,) = unit_reads(unit_of(Part("m", (0, 64), (40, 90), 0, "", (64, 128))), ck).parts
    assert p.scale == ByteRange(10000 + 1, 2, 4, 64)


def test_unquantized_part_has_no_scale() -> None:
    w = TensorInfo("n.weight", "BF16", (256,), "a.safetensors", 64, 512)
    (p,) = unit_reads(unit_of(Part("n", (0, 1), (0, 256), 0, "", (256,))), meta(BLOCK, w)).parts
    assert p.scale is None and p.weight == contiguous(64, 512) and p.weight_dtype == "BF16"


def test_needed_bytes_from_config_counts_covering_tiles() -> None:
    u = unit_of(Part("m", (200, 520), (100, 300), 0, "", (640, 384)))
    assert needed_bytes(u, BLOCK) == 320 * 200 + 4 * 3 * 4
    u = unit_of(Part("m", (8, 24), (40, 90), 0, "", (64, 128)))
    assert needed_bytes(u, MXFP8) == 16 * 50 + 16 * 2
    plain = Unit("n.weight", "copy", "dense", 1, 256, (Part("n", (0, 1), (0, 256), 0, "", (256,)),), False)  # fmt: skip
    assert needed_bytes(plain, BLOCK) == 512
    assert needed_bytes(plain, BLOCK, source_dtype="F32") == 1024


# --- whole plans ---------------------------------------------------------------------------


def test_row_split_weight_is_one_strided_range() -> None:
    cfg = real("qwen3-32b-fp8")
    plan = build_plan(cfg, ParallelLayout(tp=8), checkpoint=fake_meta(cfg))
    rp = plan.ranks[3]
    assert rp.reads is not None
    for u, r in zip(rp.units, rp.reads, strict=True):
        for p, pr in zip(u.parts, r.parts, strict=True):
            if u.buffer.endswith(("o_proj.weight", "down_proj.weight")):
                # K split: N rows of one column window -> one range, count N
                assert pr.weight.count == p.nrows == 5120 and pr.weight.length == p.ncols
                assert pr.scale is not None and pr.scale.count == 40  # 5120 / 128 tile rows
            elif u.kind != "copy":
                assert pr.weight.count == 1 and pr.weight.length == p.nrows * p.ncols


def test_reads_lie_inside_their_tensors_and_count_the_rectangle() -> None:
    for cfg, layout in [
        (synthetic("awkward"), ParallelLayout(tp=2, dp=2, pp=2, enable_expert_parallel=True)),
        (synthetic("deepseek"), ParallelLayout(tp=4)),
        (synthetic("moe"), ParallelLayout(tp=8)),
    ]:
        ck = fake_meta(cfg)
        plan = build_plan(cfg, layout, checkpoint=ck)
        for rp in plan.ranks:
            assert rp.reads is not None
            for u, r in zip(rp.units, rp.reads, strict=True):
                for p, pr in zip(u.parts, r.parts, strict=True):
                    info = ck.tensors[p.tensor_name]
                    assert pr.file == info.file
                    assert (
                        info.start <= pr.weight.start and pr.weight.end <= info.start + info.nbytes
                    )
                    assert pr.weight.nbytes == p.nrows * p.ncols * SAFETENSORS_ITEMSIZE[info.dtype]
                    if pr.scale is not None:
                        s = ck.tensors[p.module + ".weight_scale_inv"]
                        assert s.start <= pr.scale.start and pr.scale.end <= s.start + s.nbytes


def test_bytes_to_read_under_the_policies() -> None:
    cfg = synthetic("moe")
    ck = fake_meta(cfg)
    local = build_plan(cfg, ParallelLayout(tp=2), checkpoint=ck)
    remote = build_plan(cfg, ParallelLayout(tp=2), checkpoint=ck, remote=True)

    def spanned(r: ByteRange) -> int:  # a K-split slice's rows are under a page apart
        if r.count > 1 and r.stride - r.length < 4096:
            return (r.count - 1) * r.stride + r.length
        return r.nbytes

    for a, b in zip(local.ranks, remote.ranks, strict=True):
        # local: nothing overlaps, no gap between ranges bridged, strided ranges spanned
        want = sum(
            spanned(p.weight) + (spanned(p.scale) if p.scale is not None else 0)
            for ur in a.reads
            for p in ur.parts
        )
        assert a.bytes_to_read == want > a.bytes_needed
        # remote: a K-split slice is its whole rows (shared with the other TP rank);
        # within what the reads bring in, no request reads more than 1.25x
        assert b.bytes_needed == a.bytes_needed
        brought = sum(r.nbytes for r in b.reads)
        assert b.bytes_needed < brought <= b.bytes_to_read <= 1.25 * brought
        assert any(p.weight_window != (0, 0, 0) for ur in b.reads for p in ur.parts)
    assert any(b.bytes_to_read > b.bytes_needed for b in remote.ranks)


def test_a_tensor_two_units_read_is_fetched_twice() -> None:
    # The loader requests each unit's ranges on their own: a tied embedding held as both
    # model.embed_tokens and lm_head on a one-stage rank is fetched once per unit.
    cfg = synthetic("dense")
    plan = build_plan(cfg, ParallelLayout(tp=2), checkpoint=fake_meta(cfg))
    rp = plan.ranks[0]
    assert rp.reads is not None
    reads = {
        name: [
            r.parts[0].weight for u, r in zip(rp.units, rp.reads, strict=True) if u.buffer == name
        ]
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    # rank 0 holds padded rows 0..511 of both (in row blocks): the same 512 x 256 BF16
    # rows, twice
    embed, head = reads.values()
    assert embed == head and sum(r.nbytes for r in embed) == 512 * 256 * 2
    assert rp.bytes_needed == sum(r.nbytes for r in rp.reads)  # counted twice in both


def test_coalescing_is_per_file() -> None:
    def pr(file: str, start: int) -> PartRead:
        return PartRead(file=file, weight=contiguous(start, 100), weight_dtype="BF16")

    same = UnitReads((pr("a", 0), pr("a", 150)))
    apart = UnitReads((pr("a", 0), pr("b", 150)))
    assert predicted_read_bytes([same], REMOTE_POLICY) == 250  # 50-byte gap bridged
    assert predicted_read_bytes([apart], REMOTE_POLICY) == 200


# --- the fast coalescing count ----------------------------------------------------------------

POLICIES = [
    LOCAL_POLICY,
    CoalescePolicy(max_gap_bytes=64, max_overread_ratio=1.5, span_gap_bytes=31),
    REMOTE_POLICY,
    CoalescePolicy(max_gap_bytes=4096, max_overread_ratio=1.1),
    CoalescePolicy(max_gap_bytes=100, max_overread_ratio=1.5),
    CoalescePolicy(max_gap_bytes=10**9, max_overread_ratio=3.0),
    CoalescePolicy(max_gap_bytes=64, max_overread_ratio=1.0),
]


def random_ranges(rng: random.Random) -> list[ByteRange]:
    out: list[ByteRange] = []
    pos = rng.randrange(0, 1000)
    for _ in range(rng.randrange(1, 12)):
        length = rng.choice([1, 4, 16, 100, 128, 1000])
        count = rng.choice([1, 1, 2, 3, 17, 200])
        stride = length + rng.choice([0, 0, 1, 8, 30, 64, 100, 500, 5000])
        if rng.random() < 0.2 and out:  # overlap or interleave with an earlier range
            start = out[-1].start + rng.randrange(0, max(1, out[-1].end - out[-1].start))
        elif rng.random() < 0.1 and out:
            out.append(out[-1])  # a duplicate (two parts reading one scale tile)
            continue
        else:
            start = pos + rng.choice([0, 0, 1, 30, 64, 1000, 10**6])
        r = ByteRange(start, length, stride, count)
        out.append(r)
        pos = max(pos, r.end)
    if rng.random() < 0.3:
        out.append(ByteRange(pos + 5, 0, 0, 0))  # empty ranges are ignored
    rng.shuffle(out)
    return out


@pytest.mark.parametrize(
    "policy",
    POLICIES,
    ids=lambda p: f"gap{p.max_gap_bytes}-x{p.max_overread_ratio}-span{p.span_gap_bytes}",
)
def test_fast_count_equals_coalesce(policy: CoalescePolicy) -> None:
    rng = random.Random(20261129)
    for trial in range(600):
        ranges = random_ranges(rng)
        assert requested_bytes_fast(ranges, policy) == requested_bytes(ranges, policy), (
            trial,
            ranges,
        )
        # and the request count the time model charges latency for, with and without
        # Storage's split of long requests
        reqs = coalesce(ranges, policy)
        assert coalesced_fast(ranges, policy) == (requested_bytes(ranges, policy), len(reqs))
        for cap in (64, 1000):
            split = sum(-(-q.nbytes // cap) for q in reqs)
            assert coalesced_fast(ranges, policy, cap)[1] == split, (trial, cap, ranges)


def test_fast_count_on_long_runs_hand_cases() -> None:
    # 1000 rows of 100 bytes, 20-byte gaps: a run of k segments stays within 1.25x while
    # (k-1)*20 <= 0.25*k*100, i.e. always: one request over the whole extent.
    r = ByteRange(0, 100, 120, 1000)
    assert requested_bytes_fast([r], REMOTE_POLICY) == r.end == requested_bytes([r], REMOTE_POLICY)
    # 28-byte gaps: (k-1)*28 <= 25k -> k <= 9: 111 runs of 9 (1124 bytes) and one row
    r = ByteRange(0, 100, 128, 1000)
    want = 111 * (9 * 100 + 8 * 28) + 100
    assert requested_bytes_fast([r], REMOTE_POLICY) == want == requested_bytes([r], REMOTE_POLICY)
    # 40-byte gaps: (k-1)*40 <= 25k -> k <= 2.67: runs of 2 segments (240 bytes) each
    r = ByteRange(0, 100, 140, 1000)
    assert (
        requested_bytes_fast([r], REMOTE_POLICY) == 500 * 240 == requested_bytes([r], REMOTE_POLICY)
    )
    # the local policy bridges no gap between ranges, but reads a strided range whose
    # gaps are under a page as its span (and a wider-gapped one row by row)
    assert requested_bytes_fast([r], LOCAL_POLICY) == r.end == requested_bytes([r], LOCAL_POLICY)
    wide = ByteRange(0, 100, 100 + 4096, 1000)
    assert requested_bytes_fast([wide], LOCAL_POLICY) == 100_000
    two = [ByteRange(0, 100, 100, 1), ByteRange(150, 100, 100, 1)]
    assert requested_bytes_fast(two, LOCAL_POLICY) == 200 == requested_bytes(two, LOCAL_POLICY)


# --- end to end against a real synthetic checkpoint ---------------------------------------------


def rectangle_bytes(
    blob: bytes, k: int, itemsize: int, rows: tuple[int, int], cols: tuple[int, int]
) -> bytes:
    """The rectangle's bytes, row by row, sliced here from the whole tensor."""
    return b"".join(
        blob[(r * k + cols[0]) * itemsize : (r * k + cols[1]) * itemsize] for r in range(*rows)
    )


def range_bytes(path: Path, rng: ByteRange) -> bytes:
    with open(path, "rb") as f:
        out = b""
        for start, length in rng.segments():
            f.seek(start)
            out += f.read(length)
        return out


@pytest.mark.parametrize(
    "preset,layout",
    [
        ("qwen3-moe-awkward", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True, expert_placement="round_robin")),
        ("qwen3-moe-awkward", ParallelLayout(tp=2)),
        ("qwen3-moe-tiny", ParallelLayout(tp=4, pp=2)),
    ],
)  # fmt: skip
def test_planned_ranges_hold_the_rectangles(
    ckpt_factory, preset: str, layout: ParallelLayout
) -> None:  # type: ignore[no-untyped-def]
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    root = Path(ckpt_factory(preset))
    ck = open_checkpoint(str(root))
    plan = build_plan(ck.config, layout, checkpoint=ck)
    whole: dict[str, bytes] = {}

    def tensor_bytes(name: str) -> tuple[bytes, int, int]:
        info = ck.tensors[name]
        if name not in whole:
            whole[name] = range_bytes(root / info.file, contiguous(info.start, info.nbytes))
        k = info.shape[-1]
        return whole[name], k, SAFETENSORS_ITEMSIZE[info.dtype]

    checked = 0
    for rp in plan.ranks:
        assert rp.reads is not None
        for u, r in zip(rp.units, rp.reads, strict=True):
            for p, pr in zip(u.parts, r.parts, strict=True):
                blob, k, item = tensor_bytes(p.tensor_name)
                want = rectangle_bytes(blob, k, item, p.rows, p.cols)
                assert range_bytes(root / pr.file, pr.weight) == want, (u.buffer, p.module)
                if pr.scale is not None:
                    sblob, sk, sitem = tensor_bytes(p.module + ".weight_scale_inv")
                    b_n, b_k = ck.config.quant.block_n, ck.config.quant.block_k
                    t_rows = (p.rows[0] // b_n, (p.rows[1] - 1) // b_n + 1)
                    t_cols = (p.cols[0] // b_k, (p.cols[1] - 1) // b_k + 1)
                    assert (pr.tile_rows, pr.tile_cols) == (t_rows, t_cols)
                    want_s = rectangle_bytes(sblob, sk, sitem, t_rows, t_cols)
                    assert range_bytes(root / pr.scale_file, pr.scale) == want_s
                checked += 1
    assert checked > 50
