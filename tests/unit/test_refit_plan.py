"""The transfer plan of a refit (``mxload.orchestrator.plan.refit``), checked rank by rank.

Every engine rank's parts are marked element by element (the independent reference:
what the plan's units say each rank holds, less the buffers it copies from a rank of
its node); the transfers the refit plan lists are marked per rank on another map. The
two must be equal (complete, disjoint coverage), every transfer must be held by its
sender, every copy must be of buffers alike on both ranks (equal specs and units), no
buffer alike on two ranks of a node may cross to it twice, and the bytes over all
links must be what the ranks take: 1.00 x BF16 converted on the receiver, 33/32 bytes
per MX element (0.516 x BF16) converted on the sender.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
from mxload.orchestrator.errors import InputError
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.refit import (
    MX_LAYOUTS,
    Bucket,
    Link,
    ReceiveLayout,
    RefitPlan,
    RefitSummary,
    Transfer,
    link_digest,
    messages,
    needed_shapes,
    open_share,
    placements,
    receive_layout,
    refit_plan,
    refit_summary,
    send_order,
    sender_layout,
    sender_share,
)
from mxload.orchestrator.plan.timemodel import Rates, RefitRates, refit_times, save_seconds
from mxload.orchestrator.plan.trainer import (
    TrainerManifest,
    TrainerSlice,
    TrainerTensor,
    fsdp_manifest,
    manifest_from_json,
    manifest_to_json,
    megatron_manifest,
)
from mxload.orchestrator.plan.types import ParallelLayout, Plan
from mxload.orchestrator.runtime.models import model_config
from mxload.orchestrator.tools.synth import preset_config

LAYOUT = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)


def preset_plan(name: str) -> Plan:
    """The engine's plan of a preset (MXFP8 buffers: the FP8 model's), which the trainer
    refits from the preset's BF16 twin (the same tensors, unquantized)."""
    return build_plan(parse_config(preset_config(name), name), LAYOUT)


def matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    # [N, K] of docs/contract.md §6, written out here rather than taken from the module
    return (1, shape[0]) if len(shape) == 1 else (shape[0], _prod(shape[1:]))


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class Marks:
    """Per (node, tensor) a byte per element of the [N, K] view: marked or not."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        self.shapes = shapes
        self.maps: dict[tuple[int, str], bytearray] = {}

    def mark(self, node: int, tensor: str, rows: tuple[int, int], cols: tuple[int, int]) -> int:
        """Mark a rectangle; how many of its elements were marked before."""
        n, k = self.shapes[tensor]
        arr = self.maps.setdefault((node, tensor), bytearray(n * k))
        width = cols[1] - cols[0]
        ones = b"\x01" * width
        before = 0
        for r in range(*rows):
            off = r * k + cols[0]
            before += width - arr[off : off + width].count(0)
            arr[off : off + width] = ones
        return before

    def ones(self) -> dict[tuple[int, str], bytes]:
        return {key: bytes(arr) for key, arr in self.maps.items()}


def views(plan: Plan) -> dict[str, tuple[int, int]]:
    return {t: matrix(s) for t, s in needed_shapes(plan).items()}


def alike(plan: Plan, a: int, b: int) -> set[str]:
    """The weight buffers ranks ``a`` and ``b`` both hold with equal specs (and scale
    specs) and equal units writing them, none deriving another buffer: written from the
    same pieces, they hold the same bytes."""
    out = set()
    ra, rb = plan.ranks[a], plan.ranks[b]
    spec_a = {x.name: x for x in ra.buffers}
    spec_b = {x.name: x for x in rb.buffers}
    for name in {u.buffer for u in ra.units} & {u.buffer for u in rb.units}:
        ua = [u for u in ra.units if u.buffer == name]
        ub = [u for u in rb.units if u.buffer == name]
        if ua != ub or any(u.derived for u in ua) or ra.scale_alg != rb.scale_alg:
            continue
        if all(spec_a.get(n) == spec_b.get(n) for n in (name, name + "_scale")):
            out.add(name)
    return out


def check_refit(
    plan: Plan, manifest: TrainerManifest, got: RefitPlan, nodes: list[int], bucket: int
) -> None:
    world = len(plan.summaries)
    shapes_ = views(plan)
    # what lands on each rank, element by element
    to_rank: dict[int, Marks] = {r: Marks(shapes_) for r in range(world)}
    held = {
        (t.name, s.rank): s for t in manifest.tensors for s in t.placement
    }  # what each sender holds
    shapes = {t.name: t.shape for t in manifest.tensors}
    wire = source = 0
    for b in got.buckets:
        assert b.nbytes <= bucket
        for t in b.transfers:
            assert t.sender == b.sender and t.receiver == b.receiver
            assert to_rank[t.receiver].mark(0, t.tensor, t.rows, t.cols) == 0, (t, "twice")
            s = held[(t.tensor, t.sender)]
            n, k = matrix(shapes[t.tensor])
            if s.dim is None:
                box = ((0, n), (0, k))
            elif s.dim == 0 and len(shapes[t.tensor]) > 1:
                box = ((s.start, s.stop), (0, k))
            else:
                inner = _prod(shapes[t.tensor][s.dim + 1 :])
                box = ((0, n), (s.start * inner, s.stop * inner))
            assert box[0][0] <= t.rows[0] < t.rows[1] <= box[0][1], (t, s)
            assert box[1][0] <= t.cols[0] < t.cols[1] <= box[1][1], (t, s)
            assert t.shard_origin == (box[0][0], box[1][0])
            wire += t.nbytes
            source += (t.rows[1] - t.rows[0]) * (t.cols[1] - t.cols[0]) * 2
    # The copies: between two ranks of one node, of buffers alike on both, from a rank
    # that lands them itself.
    copied: dict[int, set[str]] = {r: set() for r in range(world)}
    for c in got.copies:
        assert nodes[c.source] == nodes[c.receiver] and c.source < c.receiver, c
        assert set(c.buffers) <= alike(plan, c.source, c.receiver), c
        assert not copied[c.receiver] & set(c.buffers), c
        copied[c.receiver].update(c.buffers)
        units = plan.ranks[c.receiver].units
        assert c.units == tuple(i for i, u in enumerate(units) if u.buffer in c.buffers)
        specs = {x.name: x.nbytes for x in plan.ranks[c.receiver].buffers}
        assert c.nbytes == sum(specs.get(n, 0) + specs.get(n + "_scale", 0) for n in c.buffers)
    for c in got.copies:
        assert not copied[c.source] & set(c.buffers), (c, "copied from a copy")
    # none missed: a buffer alike on two ranks of a node crosses to the node once
    for a in range(world):
        for b in range(a + 1, world):
            if nodes[a] == nodes[b]:
                assert alike(plan, a, b) <= copied[b], (a, b)
    # every rank gets exactly its own parts: those of its copied buffers from its node,
    # the rest over the links
    for rank in range(world):
        mine = Marks(shapes_)
        for unit in plan.ranks[rank].units:
            if unit.buffer not in copied[rank]:
                for part in unit.parts:
                    mine.mark(0, part.tensor_name, part.rows, part.cols)
        assert to_rank[rank].ones() == mine.ones(), rank
    s = got.summary
    assert sum(link.nbytes for link in s.links) == wire == s.wire_bytes
    assert s.needed_bytes == source
    for node in set(nodes):
        fan = sum(c.nbytes for c in got.copies if nodes[c.receiver] == node)
        assert s.fanout_bytes[node] == fan
    # the senders' staging: its largest bucket, half as much again to convert in, from
    # the list itself
    for sender in range(manifest.world):
        sizes = [b.nbytes for b in got.buckets_of(sender)]
        assert [b.index for b in got.buckets_of(sender)] == list(range(len(sizes)))
        converts = any(t.on_sender for b in got.buckets_of(sender) for t in b.transfers)
        largest = max(sizes, default=0)
        assert s.sender_staging[sender] == largest + (largest // 2 if converts else 0)
        assert s.sender_staging[sender] <= 2 * bucket
        assert s.sender_buckets[sender] == len(sizes)
        assert s.sender_bytes[sender] == sum(sizes)
    assert s.transfers == sum(len(b.transfers) for b in got.buckets)


def cases() -> Iterator[tuple[str, str, int, str, int]]:
    for preset in ("qwen3-moe-tiny", "qwen3-dense-tiny"):
        for how, per_node in (("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("megatron", 2)):
            yield preset, how, per_node, "receiver", 48 << 10
        yield preset, "fsdp", 2, "sender", 20 << 10
        yield preset, "megatron", 1, "sender", 1 << 20
    # odd widths, a tied embedding (one rank holds the same rows for two buffers)
    yield "qwen3-moe-awkward", "fsdp", 2, "receiver", 48 << 10
    yield "qwen3-moe-awkward", "fsdp", 1, "sender", 48 << 10


@pytest.mark.parametrize(("preset", "how", "per_node", "convert_on", "bucket"), list(cases()))
def test_every_rank_gets_its_parts_once_per_node(
    preset: str, how: str, per_node: int, convert_on: str, bucket: int
) -> None:
    plan = preset_plan(preset)
    shapes = needed_shapes(plan)
    if how == "fsdp":
        manifest = fsdp_manifest(shapes, 2, devices_per_node=per_node)
    else:
        manifest = megatron_manifest(shapes, 2, devices_per_node=per_node)
    nodes = [r // per_node for r in range(len(plan.summaries))]
    got = refit_plan(
        plan, manifest, convert_on=convert_on, bucket_bytes=bucket, devices_per_node=per_node
    )
    check_refit(plan, manifest, got, nodes, bucket)
    assert (
        refit_summary(
            plan, manifest, convert_on=convert_on, bucket_bytes=bucket, devices_per_node=per_node
        )
        == got.summary
    )
    s = got.summary
    if convert_on == "sender":
        assert 0.51 <= s.mx_wire_bytes / s.mx_needed_bytes <= 0.53
    else:
        assert s.wire_bytes == s.needed_bytes
    # KV heads (2) are not fewer than tp (2) here, but data-parallel replicas share a
    # node at 2 and 4 ranks per node: their pieces cross once, the rest fan out.
    if per_node >= 2:
        assert all(b > 0 for b in s.fanout_bytes)
    else:
        assert s.fanout_bytes == (0,) * 4


def test_a_k_split_layer_is_cut_where_both_sides_cut_it() -> None:
    # o_proj at tp 2 is K-split on the engine; Megatron splits it along K as well: each
    # engine rank's half comes from exactly one trainer rank, whole.
    plan = preset_plan("qwen3-dense-tiny")
    got = refit_plan(plan, megatron_manifest(needed_shapes(plan), 2), devices_per_node=1)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    pieces = [(t.sender, t.receiver, t.cols) for t in got.transfers_to(1) if t.tensor == o_proj]
    assert pieces == [(1, 1, (128, 256))]
    # FSDP cuts rows instead: both trainer ranks send half the rows of the engine's half
    got = refit_plan(plan, fsdp_manifest(needed_shapes(plan), 2), devices_per_node=1)
    pieces = [(t.sender, t.rows, t.cols) for t in got.transfers_to(1) if t.tensor == o_proj]
    assert sorted(pieces) == [(0, (0, 128), (128, 256)), (1, (128, 256), (128, 256))]


def _split_at(plan: Plan, tensor: str, col: int) -> TrainerManifest:
    """FSDP's manifest, with ``tensor`` split along K at ``col`` instead."""
    base = fsdp_manifest(needed_shapes(plan), 2)
    out = []
    for t in base.tensors:
        if t.name == tensor:
            k = t.shape[1]
            t = TrainerTensor(
                t.name, t.shape, t.dtype, (TrainerSlice(0, 1, 0, col), TrainerSlice(1, 1, col, k))
            )
        out.append(t)
    return TrainerManifest(world=2, tensors=tuple(out))


@pytest.mark.parametrize("col", [48, 144, 200])
def test_a_cut_inside_an_mx_group_is_refused_with_sender_side_conversion(col: int) -> None:
    plan = preset_plan("qwen3-dense-tiny")
    tensor = "model.layers.1.self_attn.o_proj.weight"
    manifest = _split_at(plan, tensor, col)
    with pytest.raises(InputError) as err:
        refit_plan(plan, manifest, convert_on="sender")
    msg = str(err.value)
    assert tensor in msg and "engine rank" in msg and "trainer rank" in msg
    assert "\n" not in msg and err.value.tensor == tensor
    # on the receiver the same cut converts: BF16 on the wire, every group whole there
    got = refit_plan(plan, manifest, convert_on="receiver")
    check_refit(plan, manifest, got, [r // 16 for r in range(4)], got.summary.bucket_bytes)


def test_a_cut_on_a_group_converts_on_the_sender() -> None:
    plan = preset_plan("qwen3-dense-tiny")
    manifest = _split_at(plan, "model.layers.1.self_attn.o_proj.weight", 160)
    got = refit_plan(plan, manifest, convert_on="sender")
    check_refit(plan, manifest, got, [0] * 4, got.summary.bucket_bytes)


def test_megatron_k_cuts_off_the_engines_groups_are_refused_on_the_sender() -> None:
    # A trainer at tp 4, an engine at tp 2: qwen3.5-tiny's 448-wide down_proj is 224
    # columns (7 MX groups) per engine rank, 112 (3.5 groups) per trainer rank, so
    # trainer rank 0's slice ends inside engine rank 0's fourth group.
    plan = preset_plan("qwen3.5-tiny")
    manifest = megatron_manifest(needed_shapes(plan), 4)
    tensor = "model.language_model.layers.0.mlp.down_proj.weight"
    assert [(s.dim, s.start) for s in manifest.by_name()[tensor].placement][:2] == [
        (1, 0),
        (1, 112),
    ]
    with pytest.raises(InputError) as err:
        refit_plan(plan, manifest, convert_on="sender")
    msg = str(err.value)
    assert (err.value.tensor, err.value.rank) == (tensor, 0)
    assert f"{tensor!r}: trainer rank 0 holds cols [0, 112]" in msg and "engine rank 0" in msg
    assert "\n" not in msg
    got = refit_plan(plan, manifest, convert_on="receiver")
    check_refit(plan, manifest, got, [r // 16 for r in range(4)], got.summary.bucket_bytes)
    # Megatron at tp 8 of qwen3-dense-tiny cuts K every 32 or 64 columns, on the groups:
    # each engine part's columns come from several trainer ranks, converted on the sender.
    plan = preset_plan("qwen3-dense-tiny")
    manifest = megatron_manifest(needed_shapes(plan), 8)
    got = refit_plan(plan, manifest, convert_on="sender")
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert [t.cols for t in got.transfers_to(0) if t.tensor == o_proj] == [
        (c, c + 32) for c in range(0, 128, 32)
    ]
    check_refit(plan, manifest, got, [0] * 4, got.summary.bucket_bytes)


def test_manifest_mismatches_are_refused_naming_tensor_and_rank() -> None:
    plan = preset_plan("qwen3-moe-tiny")
    shapes = needed_shapes(plan)
    name = "model.layers.3.mlp.experts.7.down_proj.weight"
    missing = {k: v for k, v in shapes.items() if k != name}
    with pytest.raises(InputError, match=r"'model.layers.3.mlp.experts.7.down_proj.weight'") as e:
        refit_plan(plan, fsdp_manifest(missing, 2))
    assert e.value.tensor == name and e.value.rank in (1, 3)  # expert 7: the last EP rank
    wrong = {**shapes, name: (shapes[name][0], shapes[name][1] * 2)}
    with pytest.raises(InputError, match="has shape") as e:
        refit_plan(plan, fsdp_manifest(wrong, 2))
    assert e.value.tensor == name
    # the same [N, K] view in another shape (contract §1.5: a tensor shaped otherwise)
    n_, k_ = shapes[name]
    other = {**shapes, name: (n_, 2, k_ // 2)}
    with pytest.raises(InputError, match="has shape") as e:
        refit_plan(plan, fsdp_manifest(other, 2))
    assert e.value.tensor == name
    three = "model.layers.0.self_attn.q_proj.weight"
    n, k = shapes[three]
    t = TrainerTensor(
        three, (n, 2, k // 2), "bfloat16", (TrainerSlice(0, 2, 0, 64), TrainerSlice(1, 2, 64, 128))
    )
    rest = fsdp_manifest({a: b for a, b in shapes.items() if a != three}, 2)
    with pytest.raises(InputError, match="dim 2"):
        refit_plan(plan, TrainerManifest(2, (*rest.tensors, t)))
    with pytest.raises(InputError, match="below one row"):
        refit_plan(plan, fsdp_manifest(shapes, 2), bucket_bytes=100)
    with pytest.raises(InputError, match="convert_on"):
        refit_plan(plan, fsdp_manifest(shapes, 2), convert_on="both")


def test_replicas_are_sent_from_the_receivers_node() -> None:
    # Megatron holds norms whole on both ranks; each engine node takes them from the
    # trainer rank on it (trainer rank 0 on node 1, rank 1 on node 0), into its first
    # rank, and its second rank (the other TP rank) copies the buffer from the first.
    plan = preset_plan("qwen3-dense-tiny")
    manifest = replace(megatron_manifest(needed_shapes(plan), 2), nodes=(1, 0))
    got = refit_plan(plan, manifest, devices_per_node=2)
    norm = "model.norm.weight"
    sent = {(t.sender, t.receiver) for b in got.buckets for t in b.transfers if t.tensor == norm}
    assert sent == {(1, 0), (0, 2)}
    holder = [u.buffer for u in plan.ranks[0].units if u.parts[0].tensor_name == norm]
    assert len(holder) == 1
    copies = {(c.source, c.receiver) for c in got.copies if holder[0] in c.buffers}
    assert copies == {(0, 1), (2, 3)}


def test_the_digest_is_the_hash_of_the_manifest_json() -> None:
    plan = preset_plan("qwen3-moe-tiny")
    m = megatron_manifest(needed_shapes(plan), 2, devices_per_node=1)
    text = json.dumps(manifest_to_json(m), sort_keys=True, separators=(",", ":"))
    assert m.digest() == hashlib.sha256(text.encode()).hexdigest()[:16]
    again = manifest_from_json(json.loads(json.dumps(manifest_to_json(m))))
    assert again == m and again.digest() == m.digest()
    assert fsdp_manifest(needed_shapes(plan), 2).digest() != m.digest()


def test_megatron_refuses_an_uneven_split() -> None:
    with pytest.raises(InputError, match=r"'x\.o_proj\.weight'.*tp 3"):
        megatron_manifest({"x.o_proj.weight": (6, 8)}, 3)


@pytest.mark.parametrize(
    ("model", "layout", "world", "per_node"),
    [
        ("qwen3-30b-a3b-fp8", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True), 8, 2),
        ("qwen3-32b-fp8", ParallelLayout(tp=4, dp=2), 4, 4),
    ],
)
def test_real_models_bytes_over_links_are_what_the_nodes_need(
    model: str, layout: ParallelLayout, world: int, per_node: int
) -> None:
    plan = build_plan(parse_config(model_config(model), model), layout)
    manifest = fsdp_manifest(needed_shapes(plan), world, devices_per_node=per_node)
    # per node, the distinct rectangles its ranks hold (equal rectangles counted once)
    rects: dict[int, set[tuple[str, tuple[int, int], tuple[int, int], bool]]] = {}
    for rank in range(layout.world):
        for unit in plan.ranks[rank].units:
            for p in unit.parts:
                rects.setdefault(rank // per_node, set()).add(
                    (p.tensor_name, p.rows, p.cols, unit.layout in MX_LAYOUTS)
                )
    need = {
        n: sum((r[1] - r[0]) * (c[1] - c[0]) * 2 for _, r, c, _ in rs) for n, rs in rects.items()
    }
    mx = {
        n: sum((r[1] - r[0]) * (c[1] - c[0]) * 2 for _, r, c, m in rs if m)
        for n, rs in rects.items()
    }
    bf16 = refit_summary(plan, manifest, devices_per_node=per_node)
    assert bf16.receiver_node_bytes == need
    assert bf16.wire_bytes == bf16.needed_bytes == sum(need.values())
    mxfp8 = refit_summary(plan, manifest, convert_on="sender", devices_per_node=per_node)
    assert mxfp8.mx_needed_bytes == sum(mx.values())
    assert mxfp8.wire_bytes == sum(need.values()) - sum(mx.values()) * 31 // 64
    assert 0.51 <= mxfp8.mx_wire_bytes / mxfp8.mx_needed_bytes <= 0.53
    # what the engine holds in BF16 (norms, embeddings, routers) stays BF16 on the wire
    assert mxfp8.wire_ratio < 0.55
    assert max(mxfp8.sender_staging) <= 2 * mxfp8.bucket_bytes


def _summary(**over: object) -> RefitSummary:
    base: dict[str, object] = {
        "convert_on": "receiver",
        "bucket_bytes": 10,
        "manifest_digest": "x",
        "links": (),
        "needed_bytes": 0,
        "wire_bytes": 0,
        "mx_needed_bytes": 0,
        "mx_wire_bytes": 0,
        "fanout_bytes": (),
        "receiver_nodes": (),
        "receiver_bytes": (),
        "receiver_staging": (),
        "sender_bytes": (),
        "sender_staging": (),
        "sender_buckets": (),
        "sender_convert_bytes": (),
        "receiver_mx_bytes": (),
        "transfers": 0,
    }
    base.update(over)
    return RefitSummary(**base)  # type: ignore[arg-type]


def test_refit_time_by_hand() -> None:
    # node 0 sends 300 to node 1 and 100 to itself; node 1 sends 200 to node 0, and a
    # second rank of node 1 copies 50 from the first as it is written: node 0 sends 300
    # and takes in 200 (network 300/100 = 3 s), node 1 has 50 within (0.5 s at 100);
    # receivers convert 400 at 200/s (2 s).
    s = _summary(
        links=(Link(0, 0, 100), Link(0, 1, 300), Link(1, 0, 200)),
        fanout_bytes=(0, 50),
        sender_bytes=(400, 200),
        receiver_mx_bytes=(400, 100),
        sender_convert_bytes=(0, 0),
    )
    rates = RefitRates(link="x", network=100.0, same_node=100.0, convert=200.0, repack=1000.0)
    t = refit_times(s, rates)
    assert (t.network_seconds, t.receiver_seconds, t.sender_convert_seconds) == (3.0, 2.0, 0.0)
    assert t.same_node_seconds == 1.0  # node 0: its own 100 bytes
    # fill: one bucket (10 bytes) through the other stages: same node 0.1 + receiver 0.05
    assert t.copy_seconds == 0.5
    assert t.seconds == pytest.approx(3.0 + 0.1 + 0.05)
    assert t.slowest_node == 0
    # copies heavier than the network: the same-node stage is the slowest
    t = refit_times(replace(s, fanout_bytes=(0, 450)), rates)
    assert (t.same_node_seconds, t.copy_seconds) == (4.5, 4.5)
    assert t.seconds == pytest.approx(4.5 + 0.1 + 0.05) and t.slowest_node == 1
    # converted on the sender, the receiver repacks its MX bytes at the repack rate
    t = refit_times(replace(s, convert_on="sender", sender_convert_bytes=(800, 0)), rates)
    assert (t.sender_convert_seconds, t.receiver_seconds) == (4.0, 0.4)
    assert t.seconds == pytest.approx(4.0 + 0.1 + 0.1 + 0.01)
    with pytest.raises(ValueError, match="within a node only"):
        refit_times(s, RefitRates.for_link("shm", device="cpu"))
    only_here = replace(s, links=(Link(0, 0, 100),), fanout_bytes=(0, 0))
    assert refit_times(only_here, RefitRates.for_link("shm", device="cpu")).seconds > 0


def test_storage_save_by_hand() -> None:
    rates = Rates(storage_node=10.0, storage_aggregate=25.0)
    assert save_seconds({0: 100, 1: 50}, rates) == 10.0  # node 0's link
    assert save_seconds({0: 100, 1: 100, 2: 100}, rates) == 12.0  # the aggregate


@pytest.mark.parametrize("how", ["fsdp", "megatron"])
def test_placements_fill_every_unit_once(how: str) -> None:
    # Each rank's pieces, placed into its units, cover every unit's parts' rows x cols
    # exactly once (a map per unit, marked at the rows and cols the placements name),
    # but for the units it copies from the other rank of its node.
    plan = preset_plan("qwen3-moe-tiny")
    make = fsdp_manifest if how == "fsdp" else megatron_manifest
    got = refit_plan(plan, make(needed_shapes(plan), 2), devices_per_node=2, bucket_bytes=32 << 10)
    for rank in range(4):
        units = plan.ranks[rank].units
        marks = [bytearray(u.rows * u.cols) for u in units]
        for t in got.transfers_to(rank):
            for p in placements(units, t):
                u = units[p.unit]
                part = u.parts[p.part]
                assert part.tensor_name == t.tensor
                assert p.rows[1] - p.rows[0] == p.piece_rows[1] - p.piece_rows[0]
                assert p.cols[1] - p.cols[0] == p.piece_cols[1] - p.piece_cols[0]
                # the piece's own row r is row rows[0] + r of the tensor's view
                assert t.rows[0] + p.piece_rows[0] - part.rows[0] + part.dst_row == p.rows[0]
                for r in range(*p.rows):
                    seg = marks[p.unit][r * u.cols + p.cols[0] : r * u.cols + p.cols[1]]
                    assert seg.count(0) == len(seg), (rank, p)
                    marks[p.unit][r * u.cols + p.cols[0] : r * u.cols + p.cols[1]] = b"\x01" * len(
                        seg
                    )
        copied = got.copied_units(rank)
        assert copied or rank % 2 == 0  # a norm, at least, from the node's other TP rank
        for i, (u, m) in enumerate(zip(units, marks, strict=True)):
            want = bytearray(u.rows * u.cols)
            if i in copied:  # copied whole from a rank of the node: no piece lands
                assert m == want, (rank, u.buffer)
                continue
            for part in u.parts:
                for r in range(part.dst_row, part.dst_row + part.nrows):
                    want[r * u.cols : r * u.cols + part.ncols] = b"\x01" * part.ncols
            assert m == want, (rank, u.buffer)


# --- the receive ring ---------------------------------------------------------------------


def simulate_ring(layout: ReceiveLayout, buckets: list[list[int]], units: int, skip: set[int]):
    """The receive protocol played out by hand: each link lands its buckets in order, a
    bucket only once every ring byte it lands on was released by the loader (the
    sequence position ``at + n - capacity`` is behind the first transfer not yet
    released), the loader reads units in order once their pieces have landed and then
    releases every ring piece whose last reader it has read. ``buckets``: per link, its
    buckets as transfer indices; ``skip``: transfers never sent (a delta). Returns the
    units read before it stopped, and the most ring bytes held at once; asserts no piece
    lands on ring bytes another piece still holds."""
    cap = layout.capacity
    held = bytearray(cap)
    landed: set[int] = set()
    released: set[int] = set(skip)
    readers: dict[int, list[int]] = {}
    for i, u in enumerate(layout.unit):
        if i not in skip:
            readers.setdefault(u, []).append(i)
    pos = [0] * len(buckets)
    done = 0
    peak = in_ring = 0

    def front() -> float:
        for i in layout.order:
            if i not in released:
                return layout.at[i]
        return float("inf")

    progress = True
    while progress:
        progress = False
        for k, link in enumerate(buckets):
            while pos[k] < len(link):
                ring = [i for i in link[pos[k]] if not layout.pinned[i]]
                f = front()
                if any(layout.at[i] + layout.transfers[i].nbytes - cap > f for i in ring):
                    break
                for i in ring:
                    a = layout.at[i] % cap
                    n = layout.transfers[i].nbytes
                    assert a + n <= cap, "a piece wraps the ring's end"
                    assert held[a : a + n].count(0) == n, "landed on bytes still held"
                    held[a : a + n] = b"\x01" * n
                    in_ring += n
                landed.update(link[pos[k]])
                peak = max(peak, in_ring)
                pos[k] += 1
                progress = True
        while done < units and all(i in landed for i in readers.get(done, ())):
            for i in layout.order:
                if i not in released and i not in skip and layout.last_unit[i] <= done:
                    released.add(i)
                    a, n = layout.at[i] % cap, layout.transfers[i].nbytes
                    held[a : a + n] = bytes(n)
                    in_ring -= n
            done += 1
            progress = True
    return done, peak


def ring_case(plan: Plan, manifest: TrainerManifest, bucket: int, skip_tensors=frozenset()):
    got = refit_plan(plan, manifest, bucket_bytes=bucket, devices_per_node=1)
    s = got.summary
    assert refit_summary(plan, manifest, bucket_bytes=bucket, devices_per_node=1) == s
    for rank in range(len(plan.ranks)):
        units = plan.ranks[rank].units
        layout = receive_layout(units, got, rank)
        # the walk's prediction is the layout's need, and what the area allocates
        assert layout.needed == s.receiver_ring[rank] == layout.capacity
        assert layout.pinned_bytes == s.receiver_pinned[rank]
        # one landing buffer per link, of the link's largest bucket, from the list itself
        largest: dict[int, int] = {}
        for b in got.buckets:
            if b.receiver == rank:
                largest[b.sender] = max(largest.get(b.sender, 0), b.nbytes)
        assert s.receiver_scratch[rank] == sum(largest.values())
        index = {id(t): i for i, t in enumerate(layout.transfers)}
        links: dict[int, list[list[int]]] = {}
        skip = {i for i, t in enumerate(layout.transfers) if t.tensor in skip_tensors}
        for b in got.buckets:
            if b.receiver == rank:
                kept = [index[id(t)] for t in b.transfers if index[id(t)] not in skip]
                if kept:
                    links.setdefault(b.sender, []).append(kept)
        # every unit a delta leaves to be read still has all its pieces sent
        wanted = {layout.unit[i] for i in skip} & {
            layout.unit[i] for i in range(len(layout.transfers)) if i not in skip
        }
        assert not wanted, "a unit reads both a sent and an unsent tensor"
        done, peak = simulate_ring(layout, list(links.values()), len(units), skip)
        assert done == len(units), f"rank {rank}: the ring stalled at unit {done}"
        assert 0 < peak <= layout.capacity
        yield rank, layout, s


@pytest.mark.parametrize(
    ("preset", "senders", "bucket"),
    [
        ("qwen3-moe-tiny", 2, 4 << 10),  # a tiny bucket: most units span many buckets
        ("qwen3-moe-tiny", 8, 256 << 10),  # thin slices of every unit on each link
        ("qwen3-dense-tiny", 8, 48 << 10),
        ("qwen3-dense-tiny", 1, 16 << 10),  # one sender, units larger than a bucket
        ("qwen3-moe-awkward", 3, 48 << 10),  # a tied embedding: read by two units
    ],
)
def test_the_receive_ring_never_stalls_and_is_bounded_by_a_bucket_span(
    preset: str, senders: int, bucket: int
) -> None:
    plan = preset_plan(preset)
    manifest = fsdp_manifest(needed_shapes(plan), senders)
    for rank, layout, s in ring_case(plan, manifest, bucket):
        units = plan.ranks[rank].units
        unit_bytes = [0] * len(units)
        for i, t in enumerate(layout.transfers):
            if not layout.pinned[i]:
                unit_bytes[layout.unit[i]] += t.nbytes
        window = max(bucket, *unit_bytes)
        biggest = max(t.nbytes for i, t in enumerate(layout.transfers) if not layout.pinned[i])
        assert layout.capacity <= window + biggest
        # bounded by a span of units, not by everything the rank needs
        assert layout.capacity + layout.pinned_bytes < s.receiver_bytes[rank]
        if preset == "qwen3-moe-awkward":
            assert layout.pinned_bytes > 0
            tied = {layout.transfers[i].tensor for i, p in enumerate(layout.pinned) if p}
            assert tied == {"model.embed_tokens.weight"}


def test_a_delta_leaves_no_unit_waiting_for_an_unsent_piece() -> None:
    plan = preset_plan("qwen3-moe-tiny")
    shapes = needed_shapes(plan)
    manifest = fsdp_manifest(shapes, 2)
    skip = frozenset(n for n in shapes if ".layers.1." not in n)
    assert list(ring_case(plan, manifest, 8 << 10, skip))


def simulate_update(plan: Plan, rp: RefitPlan, order: dict[int, list[Bucket]]) -> list[int]:
    """Every sender and every receiver of one update played out together: a sender
    sends ``order[s]`` one bucket at a time and a send completes only when the
    receiver's link takes it (a rendezvous: what gloo does), a link takes its next
    bucket once the ring bytes it lands on are released, each receiver's loader reads
    its units in order once every piece a unit reads has landed and releases the ring
    pieces of the units it has read. Returns, per receiver, the units read when
    nothing more could move; asserts each link's buckets are sent in link order."""
    world = len(plan.ranks)
    lays = {r: receive_layout(plan.ranks[r].units, rp, r) for r in range(world)}
    index = {r: {id(t): i for i, t in enumerate(lays[r].transfers)} for r in range(world)}
    links: dict[tuple[int, int], list[Bucket]] = {}
    for b in rp.buckets:
        links.setdefault((b.sender, b.receiver), []).append(b)
    at_link = dict.fromkeys(links, 0)
    landed: dict[int, set[int]] = {r: set() for r in range(world)}
    released: dict[int, set[int]] = {r: set() for r in range(world)}
    done = [0] * world
    nxt = dict.fromkeys(order, 0)

    def front(r: int) -> float:
        for i in lays[r].order:
            if i not in released[r]:
                return lays[r].at[i]
        return float("inf")

    progress = True
    while progress:
        progress = False
        for s, mine in order.items():
            while nxt[s] < len(mine):
                b = mine[nxt[s]]
                r, lay = b.receiver, lays[b.receiver]
                assert links[(s, r)][at_link[(s, r)]] is b, "a link's buckets out of order"
                items = [index[r][id(t)] for t in b.transfers]
                f = front(r)
                ring = [i for i in items if not lay.pinned[i]]
                if any(lay.at[i] + lay.transfers[i].nbytes - lay.capacity > f for i in ring):
                    break  # the link waits for room: the sender waits with it
                landed[r].update(items)
                at_link[(s, r)] += 1
                nxt[s] += 1
                progress = True
        for r in range(world):
            lay = lays[r]
            n = len(plan.ranks[r].units)
            while done[r] < n:
                u = done[r]
                reads = [
                    i for i in range(len(lay.transfers)) if lay.unit[i] <= u <= lay.last_unit[i]
                ]
                if not all(i in landed[r] for i in reads):
                    break
                released[r].update(i for i in lay.order if lay.unit[i] <= u)
                done[r] += 1
                progress = True
    return done


@pytest.mark.parametrize(
    ("preset", "senders", "bucket"),
    [
        ("qwen3-moe-tiny", 3, 4 << 10),  # tiny buckets: many per unit, rings far below need
        ("qwen3-dense-tiny", 8, 16 << 10),
        ("qwen3-moe-awkward", 2, 8 << 10),  # a tied embedding (pinned)
    ],
)
def test_interleaved_sends_to_ring_bound_receivers_never_wait_in_a_cycle(
    preset: str, senders: int, bucket: int
) -> None:
    """Several senders, one thread each, feeding every engine rank through rings smaller
    than its need: in ``send_order`` every rank reads every unit; in an order that is
    also per-link (each sender one link after another) but not one order for all
    senders, the update stops short."""
    plan = preset_plan(preset)
    manifest = fsdp_manifest(needed_shapes(plan), senders)
    rp = refit_plan(plan, manifest, bucket_bytes=bucket, devices_per_node=1)
    world = len(plan.ranks)
    assert all(rp.summary.receiver_ring[r] < rp.summary.receiver_bytes[r] for r in range(world))
    ours = {s: list(send_order(rp, s)) for s in range(senders)}
    for s, mine in ours.items():
        assert sorted(mine, key=lambda b: b.index) == list(rp.buckets_of(s))
        # the receivers are fed together: no receiver's stream is sent whole before
        # another's begins
        firsts = {b.receiver: k for k, b in reversed(list(enumerate(mine)))}
        lasts = {b.receiver: k for k, b in enumerate(mine)}
        assert max(firsts.values()) < min(lasts.values())
    assert simulate_update(plan, rp, ours) == [len(plan.ranks[r].units) for r in range(world)]
    # Odd senders feed the receivers in the other order: a cycle of waits.
    crossed = {
        s: sorted(rp.buckets_of(s), key=lambda b: ((-1) ** s * b.receiver, b.index))
        for s in range(senders)
    }
    assert simulate_update(plan, rp, crossed) != [len(plan.ranks[r].units) for r in range(world)]


def _piece(sender: int, nbytes: int) -> Transfer:
    return Transfer(sender, (0,), "w", (0, 1), (0, nbytes), (0, 0), nbytes, nbytes, False, False)


def test_a_bucket_goes_as_messages_of_runs_lying_side_by_side_where_it_lands() -> None:
    """Runs of pieces adjacent in the receive area are one message each from
    ``min_direct`` bytes on (received in place); shorter runs go together (through the
    landing buffer). Not adjacent: a gap, the other region, a piece that starts the
    ring's next lap. Worked by hand on a ring of 100 bytes."""
    sizes = [10, 10, 10, 5, 5, 10, 10]
    at = [0, 10, 30, 0, 5, 90, 100]
    pinned = [False, False, False, True, True, False, False]
    lay = ReceiveLayout(
        rank=0,
        capacity=100,
        pinned_bytes=10,
        transfers=tuple(_piece(0, n) for n in sizes),
        unit=(0,) * 7,
        last_unit=(0,) * 7,
        pinned=tuple(pinned),
        at=tuple(at),
        order=(0, 1, 2, 5, 6),
        needed=100,
    )
    items = list(range(7))
    assert messages(lay, items, 15) == ((0, 2, True), (2, 5, False), (5, 7, False))
    assert messages(lay, items, 1) == (
        (0, 2, True), (2, 3, True), (3, 5, True), (5, 6, True), (6, 7, True),
    )  # fmt: skip
    assert messages(lay, items, 1000) == ((0, 7, False),)
    assert messages(lay, [0, 1], 1000) == ((0, 2, True),)
    # a delta that leaves piece 1 out: 0 and 2 are no run
    assert messages(lay, [0, 2], 1) == ((0, 1, True), (1, 2, True))
    # both ends check they place the link's pieces alike
    moved = replace(lay, at=(0, 10, 40, 0, 5, 90, 100))
    assert link_digest(moved, 0) != link_digest(lay, 0)
    assert link_digest(lay, 1) != link_digest(lay, 0)
    # no linear collision: one piece a byte on, the next a multiplier's worth back
    skewed = replace(lay, at=(1, 10 - 1_000_003, 30, 0, 5, 90, 100))
    assert link_digest(skewed, 0) != link_digest(lay, 0)


def test_a_ranks_share_cuts_and_checks_its_links_as_the_whole_plan_does() -> None:
    """What a rank keeps once set up: a trainer rank its own buckets and, per engine rank
    it feeds, the layout of its own pieces there (``sender_layout``); an engine rank the
    buckets landing on it (``RefitPlan.only``). Both cut every bucket into the same
    messages (a delta's too, every other piece left out) and hash the same link and plan
    digests as the whole plan gives; a share holds only its own buckets."""
    plan = preset_plan("qwen3-moe-tiny")
    shapes = needed_shapes(plan)
    whole = refit_plan(plan, fsdp_manifest(shapes, 3), bucket_bytes=4096, devices_per_node=1)
    assert whole.digest and whole.tensors == tuple(sorted(shapes))
    senders = range(len(whole.summary.sender_bytes))
    for rank in range(len(plan.ranks)):
        units = plan.ranks[rank].units
        full = receive_layout(units, whole, rank)
        share = whole.only(receiver=rank)
        assert {b.receiver for b in share.buckets} == {rank}
        assert len(share.buckets) == sum(b.receiver == rank for b in whole.buckets)
        assert (share.digest, share.tensors, share.summary) == (
            whole.digest, whole.tensors, whole.summary,
        )  # fmt: skip
        assert receive_layout(units, share, rank) == full
        index = {id(t): i for i, t in enumerate(full.transfers)}
        for s in senders:
            mine = sender_layout(full, s)
            assert mine.transfers == tuple(t for t in full.transfers if t.sender == s)
            assert link_digest(mine, s) == link_digest(full, s)
            own = {id(t): i for i, t in enumerate(mine.transfers)}
            for b in whole.only(sender=s, receiver=rank).buckets:
                for keep in (b.transfers, b.transfers[::2]):  # all, and a delta's
                    want = messages(full, [index[id(t)] for t in keep], 64)
                    assert messages(mine, [own[id(t)] for t in keep], 64) == want
    # what a trainer rank keeps, opened from its pickle: the same, as new objects
    units = {r: ranked.units for r, ranked in enumerate(plan.ranks)}
    for s in senders:
        share, layouts = open_share(sender_share(whole, s, units))
        assert share == whole.only(sender=s) and share.buckets
        assert share.buckets[0] is not whole.only(sender=s).buckets[0]
        assert layouts == {
            r: sender_layout(receive_layout(plan.ranks[r].units, whole, r), s)
            for r in {b.receiver for b in share.buckets}
        }


def test_a_refit_of_more_pieces_than_any_trainer_cuts_is_refused(monkeypatch) -> None:
    """A trainer world of one row a slice (fsdp:65536 over a 27B model) ran for minutes
    and gigabytes: past MAX_PIECES the walk stops with one line naming where."""
    from mxload.orchestrator.plan import refit as refit_mod

    plan = preset_plan("qwen3-moe-tiny")
    manifest = fsdp_manifest(needed_shapes(plan), 2)
    pieces = refit_plan(plan, manifest).summary.transfers
    monkeypatch.setattr(refit_mod, "MAX_PIECES", pieces // 2)
    with pytest.raises(InputError, match=f"more than {pieces // 2:,} pieces") as e:
        refit_plan(plan, manifest)
    assert e.value.tensor and e.value.rank is not None


def test_node_bytes_counts_each_tensor_once_on_the_nodes_holding_it() -> None:
    # Two tensors of one shape share FSDP's placement (3 rows a rank over 4 ranks, two
    # ranks a node); a third is held whole by ranks 2 and 3, counted once, at rank 2.
    row = (TrainerSlice(0, 0, 0, 3), TrainerSlice(1, 0, 3, 6))
    row += (TrainerSlice(2, 0, 6, 9), TrainerSlice(3, 0, 9, 10))
    manifest = TrainerManifest(
        world=4,
        tensors=(
            TrainerTensor("a", (10, 4), "bfloat16", row),
            TrainerTensor("b", (10, 4), "bfloat16", row),
            TrainerTensor("c", (5,), "float32", (TrainerSlice(2), TrainerSlice(3))),
        ),
        nodes=(0, 0, 1, 1),
    )
    # node 0: rows 0..6 of a and b, 6 rows x 4 x 2 bytes each; node 1: rows 6..10 of
    # both, and c's 5 x 4 bytes
    assert manifest.node_bytes() == {0: 2 * 48, 1: 2 * 32 + 20}
