"""The planner (docs/contract.md §3, §5, §6): every rank of a layout simulated in one process.

Invariants, in the spirit of vLLM's ``ep_weight_filter`` and Run:ai's partition tests:

* every element of every checkpoint tensor is held exactly as many times as the layout
  replicates it (dp for tp-sharded tensors, dp*tp for replicated ones, dp*tp/kv for kv
  heads when tp > kv, once for a routed expert), and the gathered parts rebuild the
  tensor's whole index space;
* the checkpoint tensors the plan reads are exactly those docs/contract.md §3 lists for the model
  (enumerated here independently of ``mxload.orchestrator.plan.arch``);
* each rank's persistent bytes equal a count made here from the docs/contract.md §2.3 formulas;
* buffers and units agree with each other (names, shapes, layouts, expert indices).
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from mxload.orchestrator.errors import (
    CheckpointError,
    LayoutError,
    MissingTensor,
    MixedQuantization,
    StagingBudgetError,
)
from mxload.orchestrator.plan.checkpoint import CheckpointMeta
from mxload.orchestrator.plan.config import ModelConfig, parse_config
from mxload.orchestrator.plan.formats import SAFETENSORS_ITEMSIZE
from mxload.orchestrator.plan.planner import build_plan, plan_rank, plan_to_json
from mxload.orchestrator.plan.safetensors_header import TensorInfo
from mxload.orchestrator.plan.types import ParallelLayout, Plan, RankPlan
from mxload.orchestrator.runtime.models import model_config_path

CONFIGS = model_config_path("deepseek-v3").parent  # the packaged configs
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}  # fmt: skip


def real(name: str) -> ModelConfig:
    return parse_config(json.loads((CONFIGS / f"{name}.json").read_text()), f"{name}.json")


SYNTHETIC: dict[str, dict[str, Any]] = {
    # Dense, tied embeddings, vocab not a multiple of 64.
    "dense": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "quantization_config": FP8,
    },
    # MoE with a dense layer, 10 experts (uneven over 4 EP ranks), 8 heads, 2 kv heads.
    "moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_experts": 10,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [2],
        "num_hidden_layers": 5,
        "vocab_size": 997,
        "torch_dtype": "bfloat16",
        "quantization_config": FP8,
    },
    # Awkward sizes: odd MX group counts, MoE on every second layer, K not a multiple of 32
    # once split (dense MLP 224 over tp 2 -> 112), experts 96 wide (48 on tp 2 -> fallback).
    "awkward": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "intermediate_size": 224,
        "moe_intermediate_size": 96,
        "num_experts": 6,
        "decoder_sparse_step": 2,
        "num_hidden_layers": 4,
        "vocab_size": 997,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "quantization_config": FP8,
    },
    # DeepSeek-V3 in miniature: one dense layer, then MoE with a shared expert.
    "deepseek": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "vocab_size": 1000,
        "torch_dtype": "bfloat16",
        "quantization_config": FP8,
    },
}


def synthetic(name: str, **kw: Any) -> ModelConfig:
    cfg = dict(SYNTHETIC[name])
    cfg.update(kw)
    return parse_config(cfg, f"{name}/config.json")


def L(tp: int = 1, dp: int = 1, pp: int = 1, ep: bool = False, rr: bool = False) -> ParallelLayout:
    return ParallelLayout(
        tp=tp,
        dp=dp,
        pp=pp,
        enable_expert_parallel=ep,
        expert_placement="round_robin" if rr else "linear",
    )


# --- what docs/contract.md §3 says a model has (independent of orchestrator.arch) -----------


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    if cfg.num_experts == 0:
        return False
    if cfg.architecture == "DeepseekV3ForCausalLM":
        return i >= cfg.first_k_dense_replace
    return i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0


def spec_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """name -> (shape, sharding role, is a linear weight) of every tensor the model loads.

    Roles: col, row (tp-sharded), kv (kv heads), rep (replicated), vocab, expert."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[tuple[int, ...], str, bool]] = {
        "model.embed_tokens.weight": ((v, h), "vocab", False),
        "model.norm.weight": ((h,), "rep", False),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), "vocab", False)
    ds = cfg.architecture == "DeepseekV3ForCausalLM"
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((h,), "rep", False)
        out[p + "post_attention_layernorm.weight"] = ((h,), "rep", False)
        if ds:
            nh = cfg.num_attention_heads
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            out[p + "self_attn.q_a_proj.weight"] = ((cfg.q_lora_rank, h), "rep", True)
            out[p + "self_attn.q_a_layernorm.weight"] = ((cfg.q_lora_rank,), "rep", False)
            out[p + "self_attn.q_b_proj.weight"] = ((nh * qk, cfg.q_lora_rank), "col", True)
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (
                (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                "rep",
                True,
            )
            out[p + "self_attn.kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), "rep", False)
            out[p + "self_attn.kv_b_proj.weight"] = (
                (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                "col",
                True,
            )
            out[p + "self_attn.o_proj.weight"] = ((h, nh * cfg.v_head_dim), "row", True)
        else:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            out[p + "self_attn.q_proj.weight"] = ((q, h), "col", True)
            out[p + "self_attn.k_proj.weight"] = ((kv, h), "kv", True)
            out[p + "self_attn.v_proj.weight"] = ((kv, h), "kv", True)
            out[p + "self_attn.o_proj.weight"] = ((h, q), "row", True)
            out[p + "self_attn.q_norm.weight"] = ((cfg.head_dim,), "rep", False)
            out[p + "self_attn.k_norm.weight"] = ((cfg.head_dim,), "rep", False)
        if is_moe_layer(cfg, i):
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            out[p + "mlp.gate.weight"] = ((e, h), "rep", False)
            if ds:
                out[p + "mlp.gate.e_score_correction_bias"] = ((e,), "rep", False)
                si = mi * cfg.n_shared_experts
                out[p + "mlp.shared_experts.gate_proj.weight"] = ((si, h), "col", True)
                out[p + "mlp.shared_experts.up_proj.weight"] = ((si, h), "col", True)
                out[p + "mlp.shared_experts.down_proj.weight"] = ((h, si), "row", True)
            for x in range(e):
                out[p + f"mlp.experts.{x}.gate_proj.weight"] = ((mi, h), "expert", True)
                out[p + f"mlp.experts.{x}.up_proj.weight"] = ((mi, h), "expert", True)
                out[p + f"mlp.experts.{x}.down_proj.weight"] = ((h, mi), "expert", True)
        else:
            it = cfg.intermediate_size
            out[p + "mlp.gate_proj.weight"] = ((it, h), "col", True)
            out[p + "mlp.up_proj.weight"] = ((it, h), "col", True)
            out[p + "mlp.down_proj.weight"] = ((h, it), "row", True)
    return out


def shared_experts_whole(layout: ParallelLayout) -> bool:
    """Plain vLLM (the default profile) runs sequence-parallel MoE under its default
    all2all backend with EP, tp > 1 and dp > 1, and then holds the shared experts whole on
    every TP rank (vLLM's ParallelConfig.use_sequence_parallel_moe, disable_tp)."""
    return layout.enable_expert_parallel and layout.tp > 1 and layout.dp > 1


def multiplicity(cfg: ModelConfig, layout: ParallelLayout, name: str, role: str) -> int:
    """How many ranks hold each element of tensor ``name`` (docs/contract.md §3 replication)."""
    dp, tp = layout.dp, layout.tp
    if ".mlp.shared_experts." in name and shared_experts_whole(layout):
        return dp * tp
    if role == "expert":
        return 1  # TP-sharded over the whole dp*tp group, or whole experts under EP
    if role == "rep":
        return dp * tp
    if role == "kv":
        return dp * max(1, tp // cfg.num_key_value_heads)
    if name == "model.embed_tokens.weight" and cfg.tie_word_embeddings:
        return 2 * dp  # stage 0's embedding and the last stage's lm_head
    return dp


# --- a checkpoint's metadata without its bytes ----------------------------------------------------


def fake_meta(
    cfg: ModelConfig,
    *,
    dtypes: dict[str, str] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    drop: tuple[str, ...] = (),
    extra: dict[str, tuple[tuple[int, ...], str]] | None = None,
    files: int = 3,
) -> CheckpointMeta:
    """The headers a block-FP8 checkpoint of ``cfg`` would have: linears F8_E4M3 with F32
    tile scales, the rest BF16 (the DeepSeek router bias F32). ``dtypes``/``shapes``
    override single tensors; a linear overridden to a float dtype loses its scale."""
    dtypes = dtypes or {}
    shapes = shapes or {}
    b_n, b_k = cfg.quant.block_n, cfg.quant.block_k
    entries: list[tuple[str, tuple[int, ...], str]] = []
    for name, (shape, _role, linear) in spec_tensors(cfg).items():
        if name in drop:
            continue
        default = "F8_E4M3" if linear else ("F32" if name.endswith("bias") else "BF16")
        dtype = dtypes.get(name, default)
        shape = shapes.get(name, shape)
        entries.append((name, shape, dtype))
        if dtype == "F8_E4M3":
            module = name[: -len(".weight")]
            entries.append(
                (f"{module}.weight_scale_inv", (ceil(shape[0], b_n), ceil(shape[1], b_k)), "F32")
            )
    for name, (shape, dtype) in (extra or {}).items():
        entries.append((name, shape, dtype))
    tensors: dict[str, TensorInfo] = {}
    offsets = [4096] * files
    for k, (name, shape, dtype) in enumerate(entries):
        f = k * files // len(entries)
        nbytes = SAFETENSORS_ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        tensors[name] = TensorInfo(
            name=name, dtype=dtype, shape=shape, file=f"s{f}.safetensors", start=offsets[f],
            nbytes=nbytes,
        )  # fmt: skip
        offsets[f] += nbytes
    return CheckpointMeta(
        root="fake://ckpt",
        config=cfg,
        tensors=dict(sorted(tensors.items())),
        files=tuple(f"s{f}.safetensors" for f in range(files)),
        headers={},
    )


# --- invariant checks ----------------------------------------------------------------------


def check_coverage(cfg: ModelConfig, plan: Plan) -> None:
    """Every element of every tensor is held multiplicity(...) times, all over its index
    space, and the plan reads no tensor docs/contract.md §3 does not list."""
    expected = spec_tensors(cfg)
    rects: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    for r in plan.ranks:
        for u in r.units:
            for p in u.parts:
                rects[p.tensor_name].append((*p.rows, *p.cols))
    assert set(rects) == set(expected), set(rects) ^ set(expected)
    for name, (shape, role, _) in expected.items():
        n, k = (1, shape[0]) if len(shape) == 1 else shape
        want = multiplicity(cfg, plan.layout, name, role)
        r0, r1, c0, c1 = np.array(rects[name], dtype=np.int64).T
        outside = (r0 < 0) | (r0 >= r1) | (r1 > n) | (c0 < 0) | (c0 >= c1) | (c1 > k)
        assert not outside.any(), (name, np.array(rects[name])[outside][:5].tolist())
        rb = np.unique(np.concatenate([[0, n], r0, r1]))
        cb = np.unique(np.concatenate([[0, k], c0, c1]))
        i0, i1 = np.searchsorted(rb, r0), np.searchsorted(rb, r1)
        j0, j1 = np.searchsorted(cb, c0), np.searchsorted(cb, c1)
        # how often each grid cell is held: +1 at a rectangle's corner, -1 past its ends,
        # summed along both axes
        diff = np.zeros((len(rb), len(cb)), dtype=np.int64)
        np.add.at(diff, (i0, j0), 1)
        np.add.at(diff, (i0, j1), -1)
        np.add.at(diff, (i1, j0), -1)
        np.add.at(diff, (i1, j1), 1)
        counts = diff.cumsum(0).cumsum(1)[:-1, :-1]
        bad = {(int(i), int(j)): int(counts[i, j]) for i, j in np.argwhere(counts != want)}
        assert not bad, (name, want, bad)


def largest_unit(plan: Plan) -> int:
    """Elements of the plan's largest converted unit."""
    return max(u.rows * u.cols for r in plan.ranks for u in r.units if u.kind != "copy")


def check_rank_structure(cfg: ModelConfig, rp: RankPlan, largest: int) -> None:
    buffers = {b.name: b for b in rp.buffers}
    assert len(buffers) == len(rp.buffers), "buffer names repeat"
    written: dict[str, list[int]] = defaultdict(list)
    blocks: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for u in rp.units:
        assert u.buffer in buffers
        b = buffers[u.buffer]
        assert b.layout == u.layout
        mx = u.layout in ("mx_linear", "mx_moe")
        assert (u.buffer + "_scale" in buffers) == mx
        # parts: same width, disjoint destination rows inside the unit
        spans = sorted((p.dst_row, p.dst_row + p.nrows) for p in u.parts)
        for p in u.parts:
            assert p.ncols == u.cols and p.nrows > 0
        for (_, a1), (b0, _) in itertools.pairwise(spans):
            assert a1 <= b0
        assert all(0 <= s and e <= u.rows for s, e in spans)
        if u.kind != "copy" or not u.buffer.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert sum(p.nrows for p in u.parts) == u.rows
        if u.kind in ("moe_w13", "moe_w2"):
            written[u.buffer].append(u.expert)
            assert rp.experts[u.expert] == u.global_expert
            e_l = len(rp.experts)
            if mx:
                # docs/contract.md §2.3: w13 [E_l, H, 2I_l],
                # scale [E_l, ceil(H/64), 2I_l, 2]; w2 likewise
                assert b.shape == (e_l, u.cols, u.rows) and b.dtype == "float8_e4m3fn"
                sb = buffers[u.buffer + "_scale"]
                assert sb.shape == (e_l, ceil(u.cols, 64), u.rows, 2) and sb.dtype == "uint8"
            else:
                assert b.shape == (e_l, u.rows, u.cols)
        else:
            written[u.buffer].append(-1)
            if mx:
                assert b.shape == (u.cols, u.rows) and b.dtype == "float8_e4m3fn"
                sb = buffers[u.buffer + "_scale"]
                assert sb.shape == (ceil(u.cols // 32, 2), u.rows, 2) and sb.dtype == "uint8"
            elif len(b.shape) == 1:
                assert u.rows == 1 and b.shape == (u.cols,)
            else:
                assert b.shape[1] == u.cols and u.row0 + u.rows <= b.shape[0]
                blocks[u.buffer].append((u.row0, u.row0 + u.rows))
        if u.row0:
            assert u.kind == "copy" and u.buffer.endswith(("embed_tokens.weight", "lm_head.weight"))
    # Vocab buffers are cut into row blocks no larger (in bytes) than the largest linear
    # or expert-half unit's FP8 payload in the plan, so they never set the default
    # budget, which is plan-wide (docs/contract.md §6).
    for name, b in buffers.items():
        if name.endswith("_scale"):
            continue
        if b.layout == "mx_moe" or name.endswith(("w13_weight", "w2_weight")):
            e_l = len(rp.experts)
            # every local expert exactly once, in local order
            assert written[name] == list(range(e_l)), name
        elif name in blocks:
            spans = sorted(blocks[name])
            assert spans[0][0] == 0 and spans[-1][1] == b.shape[0], name
            assert all(a1 == b0 for (_, a1), (b0, _) in itertools.pairwise(spans)), name
            if len(spans) > 1:
                itemsize = 4 if b.dtype == "float32" else 2
                assert all((e - s) * b.shape[1] * itemsize <= largest for s, e in spans), name
        else:
            assert written[name] == [-1], name


def expected_persistent(cfg: ModelConfig, layout: ParallelLayout, rank: int) -> int:
    """docs/contract.md §2.3 buffer sizes, counted directly (bf16 model dtype, block-FP8 source)."""
    tp, dp, pp = layout.tp, layout.dp, layout.pp
    tp_rank, pp_rank, dp_rank = rank % tp, rank // tp % pp, rank // (tp * pp)
    sizes = [cfg.num_hidden_layers // pp] * pp
    for i in range(2, cfg.num_hidden_layers % pp + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    layers = range(start, start + sizes[pp_rank])
    h, m = cfg.hidden_size, 2

    def lin(n: int, k: int) -> int:  # a quantized linear, local [n, k]
        if k % 32 == 0:
            return k * n + ceil(k // 32, 2) * n * 2
        return n * k * m

    total = 0
    vp = ceil(cfg.vocab_size, 64) * 64
    if pp_rank == 0:
        total += vp // tp * h * m
    if pp_rank == pp - 1:
        total += vp // tp * h * m + h * m
    ds = cfg.architecture == "DeepseekV3ForCausalLM"
    for i in layers:
        total += 2 * h * m
        if ds:
            nh = cfg.num_attention_heads // tp
            total += lin(cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
            total += (cfg.q_lora_rank + cfg.kv_lora_rank) * m
            total += lin(nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank)
            # plain vLLM quantizes kv_b_proj like every other linear
            total += lin(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            total += lin(h, nh * cfg.v_head_dim)
        else:
            kv = cfg.num_key_value_heads
            kv_l = (kv // tp if kv >= tp else 1) * cfg.head_dim
            q_l = cfg.num_attention_heads // tp * cfg.head_dim
            total += lin(q_l + 2 * kv_l, h) + lin(h, q_l) + 2 * cfg.head_dim * m
        if is_moe_layer(cfg, i):
            e = cfg.num_experts
            total += e * h * m + (e * 4 if ds else 0)
            if ds:
                si = cfg.moe_intermediate_size * cfg.n_shared_experts
                si //= 1 if shared_experts_whole(layout) else tp
                total += lin(2 * si, h) + lin(h, si)
            if layout.enable_expert_parallel:
                ep, r = dp * tp, dp_rank * tp + tp_rank
                e_l = e // ep + (1 if r < e % ep else 0)
                i_l = cfg.moe_intermediate_size
            else:
                e_l, i_l = e, cfg.moe_intermediate_size // (dp * tp)
            if h % 32 == 0 and i_l % 32 == 0:
                total += e_l * (h * 2 * i_l + ceil(h, 64) * 2 * i_l * 2)
                total += e_l * (i_l * h + ceil(i_l, 64) * h * 2)
            else:
                total += e_l * 3 * i_l * h * m
        else:
            it = cfg.intermediate_size // tp
            total += lin(2 * it, h) + lin(h, it)
    return total


# --- the layouts -------------------------------------------------------------------------------

CASES: list[tuple[str, ParallelLayout]] = [
    ("dense", L()),
    ("dense", L(tp=2)),
    ("dense", L(tp=4)),  # tp > kv heads: each kv head on 2 ranks
    ("dense", L(tp=2, dp=2)),
    ("dense", L(tp=2, pp=2)),  # tied embeddings across stages
    ("dense", L(pp=3)),
    ("moe", L()),
    ("moe", L(tp=2, dp=2)),
    ("moe", L(tp=4)),
    ("moe", L(tp=8)),  # tp > kv (2): kv heads replicated 4x
    ("moe", L(tp=2, dp=2, ep=True)),  # 10 experts on 4 EP ranks: 3, 3, 2, 2
    ("moe", L(tp=2, dp=2, ep=True, rr=True)),
    ("moe", L(tp=2, pp=2, ep=True)),
    ("moe", L(tp=1, dp=2, pp=3, ep=True, rr=True)),  # uneven: 5 layers over 3 stages
    ("moe", L(tp=2, dp=2, pp=2)),
    ("awkward", L()),
    ("awkward", L(tp=2)),
    ("awkward", L(tp=2, ep=True)),
    ("awkward", L(tp=2, dp=2, pp=2, ep=True, rr=True)),
    ("deepseek", L()),
    ("deepseek", L(tp=2, dp=2)),
    ("deepseek", L(tp=4, ep=True)),
    ("deepseek", L(tp=2, dp=2, pp=3, ep=True, rr=True)),
]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-{lay.tp}x{lay.dp}x{lay.pp}{'-ep' if lay.enable_expert_parallel else ''}{'-rr' if lay.expert_placement == 'round_robin' else ''}" for n, lay in CASES])  # fmt: skip
def test_synthetic_layouts(name: str, layout: ParallelLayout) -> None:
    cfg = synthetic(name)
    plan = build_plan(cfg, layout)
    assert len(plan.ranks) == layout.world
    check_coverage(cfg, plan)
    largest = largest_unit(plan)
    for rp in plan.ranks:
        check_rank_structure(cfg, rp, largest)
        assert rp.persistent_bytes == expected_persistent(cfg, layout, rp.rank), rp.rank
        # config-only: predicted reads are the needed bytes
        assert rp.bytes_to_read == rp.bytes_needed > 0
    # the same plan from the checkpoint's headers
    meta = fake_meta(cfg)
    from_ckpt = build_plan(cfg, layout, checkpoint=meta)
    for a, b in zip(plan.ranks, from_ckpt.ranks, strict=True):
        assert a.buffers == b.buffers
        assert a.units == b.units
        assert a.bytes_needed == b.bytes_needed
        assert b.reads is not None and len(b.reads) == len(b.units)


REAL_CASES = [
    ("qwen3-32b-fp8", L(tp=8)),
    ("qwen3-32b-fp8", L(tp=4, dp=2, pp=3)),
    ("qwen3-30b-a3b-fp8", L(tp=4, dp=2, ep=True)),  # 128 experts, EP=8
    ("qwen3-30b-a3b-fp8", L(tp=8, ep=True, rr=True)),
    ("qwen3-30b-a3b-fp8", L(tp=8)),  # tp 8 > 4 kv heads; experts I_l 96
    ("qwen3-30b-a3b-fp8", L(tp=8, dp=4)),  # experts I_l 24: the whole MoE falls back
    ("deepseek-v3", L(tp=8, dp=32, ep=True)),  # 256 experts, EP=256
    ("deepseek-v3", L(tp=8, pp=4, ep=True, rr=True)),
]


@pytest.mark.parametrize("name,layout", REAL_CASES)
def test_real_configs(name: str, layout: ParallelLayout) -> None:
    cfg = real(name)
    plan = build_plan(cfg, layout)
    check_coverage(cfg, plan)
    largest = largest_unit(plan)
    seen_structures: set[int] = set()
    for rp in plan.ranks:
        assert rp.persistent_bytes == expected_persistent(cfg, layout, rp.rank), rp.rank
        key = id(rp.units[-1])
        if key not in seen_structures:  # ranks sharing their last unit share most blocks
            seen_structures.add(key)
            check_rank_structure(cfg, rp, largest)


def test_deepseek_256_ranks_hold_one_expert_each() -> None:
    plan = build_plan(real("deepseek-v3"), L(tp=8, dp=32, ep=True))
    assert [rp.experts for rp in plan.ranks] == [(r,) for r in range(256)]
    assert [rp.ep_rank for rp in plan.ranks] == list(range(256))
    rp = plan.ranks[17]
    names = {b.name for b in rp.buffers}
    assert "model.layers.3.mlp.experts.w13_weight" in names
    assert "model.layers.2.mlp.gate_up_proj.weight" in names  # first_k_dense_replace = 3
    assert "model.layers.3.mlp.gate_up_proj.weight" not in names
    moe_units = [
        u for u in rp.units if u.kind == "moe_w13" and u.buffer.startswith("model.layers.3.")
    ]
    assert [(u.expert, u.global_expert) for u in moe_units] == [(0, 17)]
    assert moe_units[0].parts[0].module == "model.layers.3.mlp.experts.17.gate_proj"


def test_qwen3_30b_ep8_placements() -> None:
    cfg = real("qwen3-30b-a3b-fp8")
    lin = build_plan(cfg, L(tp=4, dp=2, ep=True))
    rr = build_plan(cfg, L(tp=4, dp=2, ep=True, rr=True))
    for r in range(8):
        assert lin.ranks[r].experts == tuple(range(16 * r, 16 * r + 16))
        assert rr.ranks[r].experts == tuple(range(r, 128, 8))
        units = [u for u in rr.ranks[r].units if u.kind == "moe_w2" and ".layers.0." in u.buffer]
        assert [u.global_expert for u in units] == list(range(r, 128, 8))
        assert [u.expert for u in units] == list(range(16))


def test_without_ep_every_rank_holds_every_expert_sliced() -> None:
    cfg = synthetic("moe")  # moe_intermediate 256 over dp*tp = 4 -> 64 rows each
    plan = build_plan(cfg, L(tp=2, dp=2))
    for rp in plan.ranks:
        assert rp.experts == tuple(range(10))
        assert rp.ep_rank == 0
        m = rp.dp_rank * 2 + rp.tp_rank
        w13 = next(u for u in rp.units if u.kind == "moe_w13")
        w2 = next(u for u in rp.units if u.kind == "moe_w2")
        assert [(p.rows, p.dst_row) for p in w13.parts] == [((64 * m, 64 * m + 64), 0), ((64 * m, 64 * m + 64), 64)]  # fmt: skip
        assert w2.parts[0].cols == (64 * m, 64 * m + 64) and w2.parts[0].rows == (0, 256)


def test_qkv_parts_in_order_with_replicated_kv_heads() -> None:
    cfg = synthetic("moe")  # 8 heads of 32, 2 kv heads
    for tp_rank in range(8):
        _, units = plan_rank(cfg, L(tp=8), tp_rank)
        qkv = next(u for u in units if u.buffer == "model.layers.0.self_attn.qkv_proj.weight")
        q, k, v = qkv.parts
        assert (
            q.module.endswith("q_proj")
            and k.module.endswith("k_proj")
            and v.module.endswith("v_proj")
        )
        assert q.rows == (32 * tp_rank, 32 * tp_rank + 32)
        head = tp_rank // 4  # tp / kv = 4 ranks per kv head
        assert k.rows == v.rows == (32 * head, 32 * head + 32)
        assert (q.dst_row, k.dst_row, v.dst_row) == (0, 32, 64)
        assert qkv.rows == 96 and qkv.cols == 256


def test_vocab_parallel_padding_and_tied_lm_head() -> None:
    cfg = synthetic("dense")  # vocab 1000 -> padded 1024, tied
    plan = build_plan(cfg, L(tp=4, pp=2))
    first = plan.ranks[3]  # pp_rank 0, tp_rank 3
    last = plan.ranks[7]  # pp_rank 1, tp_rank 3
    # The rank's 256 rows come as row blocks (units of their own, docs/contract.md §6 note in
    # planner.copy_unit_bytes); together they read rows 768..999, rows 1000..1023 stay zero.
    embs = [u for u in first.units if u.buffer == "model.embed_tokens.weight"]
    assert len(embs) > 1 and sum(u.rows for u in embs) == 256
    assert [u.row0 for u in embs] == list(itertools.accumulate([0] + [u.rows for u in embs[:-1]]))
    src_rows = [p.rows for u in embs for p in u.parts]
    assert src_rows[0][0] == 768 and src_rows[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(src_rows))
    assert all(u.parts[0].rows[0] - 768 == u.row0 for u in embs if u.parts)
    assert not any(b.name == "lm_head.weight" for b in first.buffers)
    heads = [u for u in last.units if u.buffer == "lm_head.weight"]
    assert all(p.tensor_name == "model.embed_tokens.weight" for u in heads for p in u.parts)
    assert [p.rows for u in heads for p in u.parts] == src_rows
    assert {b.name for b in last.buffers} >= {"lm_head.weight", "model.norm.weight"}
    assert not any(b.name == "model.embed_tokens.weight" for b in last.buffers)
    # a rank whose vocab slice is all padding (vocab 40 -> 64 over tp 4: rank 3 holds 48..63)
    small = synthetic("dense", vocab_size=40)
    _, units = plan_rank(small, L(tp=4), 3)
    embs = [u for u in units if u.buffer == "model.embed_tokens.weight"]
    assert sum(u.rows for u in embs) == 16 and all(u.parts == () for u in embs)


def test_fallback_when_local_k_is_not_a_multiple_of_32() -> None:
    cfg = synthetic("awkward")
    buffers, units = plan_rank(cfg, L(tp=2), 0)
    by_name = {b.name: b for b in buffers}
    # dense MLP of layer 0: intermediate 224 over tp 2 -> K 112, not a multiple of 32
    down = by_name["model.layers.0.mlp.down_proj.weight"]
    assert (down.shape, down.dtype, down.layout) == ((160, 112), "bfloat16", "dense")
    assert "model.layers.0.mlp.down_proj.weight_scale" not in by_name
    u = next(u for u in units if u.buffer == down.name)
    assert u.quantized and u.layout == "dense"
    # gate_up keeps K = hidden 160 (5 groups, odd): MX with 3 scale pairs
    gu = by_name["model.layers.0.mlp.gate_up_proj.weight_scale"]
    assert gu.shape == (3, 224, 2)
    # experts 96 wide over tp 2 -> I_l 48: the whole MoE layer falls back
    w13 = by_name["model.layers.1.mlp.experts.w13_weight"]
    assert (w13.shape, w13.dtype, w13.layout) == ((6, 96, 160), "bfloat16", "dense")
    assert by_name["model.layers.1.mlp.experts.w2_weight"].shape == (6, 160, 48)
    # with EP the experts are whole (I 96 = 3 groups): MX
    buffers, _ = plan_rank(cfg, L(tp=2, ep=True), 1)
    by_name = {b.name: b for b in buffers}
    assert by_name["model.layers.1.mlp.experts.w13_weight"].shape == (3, 160, 192)
    assert by_name["model.layers.1.mlp.experts.w13_weight_scale"].shape == (3, 3, 192, 2)
    assert by_name["model.layers.1.mlp.experts.w2_weight_scale"].shape == (3, 2, 160, 2)


def test_deepseek_tensors() -> None:
    cfg = real("deepseek-v3")
    buffers, units = plan_rank(cfg, L(tp=8, dp=32, ep=True), 9)
    by_name = {b.name: b for b in buffers}
    p = "model.layers.5."
    kvb = by_name[p + "self_attn.kv_b_proj.weight"]  # plain vLLM: MXFP8, [K, N]
    assert (kvb.shape, kvb.dtype, kvb.layout) == (
        (512, 128 * 256 // 8),
        "float8_e4m3fn",
        "mx_linear",
    )
    assert by_name[p + "self_attn.kv_b_proj.weight_scale"].shape == (8, 128 * 256 // 8, 2)
    # vllm-ascend's MLA asserts an unquantized kv_b_proj: dense in the model dtype
    held, _ = plan_rank(cfg, L(tp=8, dp=32, ep=True), 9, engine="vllm-ascend-0.23")
    kvb = {b.name: b for b in held}[p + "self_attn.kv_b_proj.weight"]
    assert (kvb.shape, kvb.dtype, kvb.layout) == ((128 * 256 // 8, 512), "bfloat16", "dense")
    assert p + "self_attn.kv_b_proj.weight_scale" not in {b.name for b in held}
    assert next(u for u in units if u.buffer == kvb.name).quantized
    fused = next(u for u in units if u.buffer == p + "self_attn.fused_qkv_a_proj.weight")
    assert [(x.module, x.rows, x.dst_row) for x in fused.parts] == [
        (p + "self_attn.q_a_proj", (0, 1536), 0),
        (p + "self_attn.kv_a_proj_with_mqa", (0, 576), 1536),
    ]
    assert by_name[p + "self_attn.fused_qkv_a_proj.weight"].shape == (7168, 2112)
    assert by_name[p + "mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert by_name[p + "mlp.gate.weight"].shape == (256, 7168)
    # tp 8 x dp 32 + EP: plain vLLM runs sequence-parallel MoE, the shared expert (2048
    # wide) whole on every rank; vllm-ascend splits it over tp
    assert by_name[p + "mlp.shared_experts.gate_up_proj.weight"].shape == (7168, 4096)
    assert by_name[p + "mlp.shared_experts.down_proj.weight"].shape == (2048, 7168)
    held_by = {b.name: b for b in held}
    assert held_by[p + "mlp.shared_experts.gate_up_proj.weight"].shape == (7168, 512)
    assert held_by[p + "mlp.shared_experts.down_proj.weight"].shape == (256, 7168)
    assert by_name[p + "self_attn.q_b_proj.weight"].shape == (1536, 16 * 192)
    assert by_name[p + "self_attn.o_proj.weight"].shape == (16 * 128, 7168)
    assert not any(".layers.61." in b.name for b in buffers)  # MTP layer


def test_deepseek_mtp_layer_is_never_read() -> None:
    cfg = synthetic("deepseek")
    extra = {"model.layers.3.input_layernorm.weight": ((256,), "BF16"),
             "model.layers.3.eh_proj.weight": ((256, 512), "BF16")}  # fmt: skip
    plan = build_plan(cfg, L(tp=2), checkpoint=fake_meta(cfg, extra=extra))
    read = {p.tensor_name for rp in plan.ranks for u in rp.units for p in u.parts}
    assert not any(".layers.3." in n for n in read)


# --- what the checkpoint says ----------------------------------------------------------------


def test_checkpoint_dtypes_decide_quantization_and_buffer_dtype() -> None:
    cfg = synthetic("dense")
    p = "model.layers.1."
    meta = fake_meta(
        cfg,
        dtypes={
            p + "self_attn.q_proj.weight": "BF16",
            p + "self_attn.k_proj.weight": "BF16",
            p + "self_attn.v_proj.weight": "BF16",
            p + "input_layernorm.weight": "F32",
        },
    )
    buffers, units = plan_rank(cfg, L(tp=2), 0, checkpoint=meta)
    by_name = {b.name: b for b in buffers}
    qkv = by_name[p + "self_attn.qkv_proj.weight"]
    assert (qkv.dtype, qkv.layout, qkv.shape) == ("bfloat16", "dense", (128 + 64 + 64, 256))
    assert p + "self_attn.qkv_proj.weight_scale" not in by_name
    assert not next(u for u in units if u.buffer == qkv.name).quantized
    assert by_name[p + "input_layernorm.weight"].dtype == "float32"
    assert by_name["model.layers.0.self_attn.qkv_proj.weight"].layout == "mx_linear"


def test_config_exclusions_plan_unquantized_without_a_checkpoint() -> None:
    qc = dict(FP8, modules_to_not_convert=["model.layers.1.self_attn"])
    cfg = synthetic("dense", quantization_config=qc)
    buffers, _ = plan_rank(cfg, L(tp=2), 0)
    by_name = {b.name: b for b in buffers}
    assert by_name["model.layers.1.self_attn.o_proj.weight"].layout == "dense"
    assert by_name["model.layers.0.self_attn.o_proj.weight"].layout == "mx_linear"


def test_merged_parts_that_disagree_on_quantization() -> None:
    cfg = synthetic("dense")
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(MixedQuantization) as info:
        plan_rank(cfg, L(tp=2), 0, checkpoint=fake_meta(cfg, dtypes={name: "BF16"}))
    assert "k_proj" in str(info.value) and "q_proj" in str(info.value)
    # config-only: an exclusion that splits a merged tensor
    qc = dict(FP8, modules_to_not_convert=["model.layers.0.mlp.up_proj"])
    with pytest.raises(MixedQuantization, match="gate_proj"):
        plan_rank(synthetic("dense", quantization_config=qc), L(), 0)


def test_one_unquantized_expert_is_mixed_quantization() -> None:
    cfg = synthetic("moe")
    name = "model.layers.3.mlp.experts.7.down_proj.weight"
    with pytest.raises(MixedQuantization, match=r"experts\.7\.down_proj"):
        build_plan(cfg, L(tp=2, dp=2, ep=True), checkpoint=fake_meta(cfg, dtypes={name: "BF16"}))


def test_shape_disagreeing_with_the_config_names_the_tensor() -> None:
    cfg = synthetic("moe")
    name = "model.layers.1.self_attn.o_proj.weight"
    with pytest.raises(CheckpointError) as info:
        plan_rank(cfg, L(tp=2), 0, checkpoint=fake_meta(cfg, shapes={name: (256, 384)}))
    assert info.value.tensor == name and "[256, 384]" in str(info.value)


def test_missing_tensor_is_named() -> None:
    cfg = synthetic("moe")
    name = "model.layers.4.mlp.experts.9.up_proj.weight"
    meta = fake_meta(cfg, drop=(name,))
    with pytest.raises(MissingTensor) as info:
        build_plan(cfg, L(tp=2, dp=2, ep=True), checkpoint=meta)
    assert info.value.tensor == name


def test_quantized_norm_is_refused() -> None:
    cfg = synthetic("dense")
    name = "model.layers.0.input_layernorm.weight"
    meta = fake_meta(cfg, dtypes={name: "F8_E4M3"}, shapes={name: (1, 256)})
    with pytest.raises(CheckpointError):
        plan_rank(cfg, L(), 0, checkpoint=meta)


def test_refused_layout_from_the_planner() -> None:
    with pytest.raises(LayoutError, match="num_attention_heads"):
        build_plan(synthetic("dense"), L(tp=3))


# --- plan JSON and memory --------------------------------------------------------------------------

RANK_KEYS = {"rank", "tp_rank", "dp_rank", "pp_rank", "ep_rank", "layers", "experts",
             "persistent_bytes", "staging_bytes", "peak_bytes", "bytes_needed", "bytes_to_read"}  # fmt: skip


def test_plan_json_has_exactly_the_spec_fields() -> None:
    cfg = synthetic("moe")
    plan = build_plan(cfg, L(tp=2, dp=2, ep=True), device_memory=10**12)
    doc = plan_to_json(plan)
    json.dumps(doc)
    required = {"format", "model", "parallel", "ranks", "min_staging_bytes", "device_memory_bytes", "fits"}  # fmt: skip
    assert required <= set(doc)
    assert doc["format"] == "mxload-plan/1"
    assert set(doc["parallel"]) == {"tp", "dp", "pp", "enable_expert_parallel", "expert_placement", "world"}  # fmt: skip
    assert doc["parallel"]["world"] == 4
    assert set(doc["min_staging_bytes"]) == {"load", "reload"}
    assert doc["device_memory_bytes"] == 10**12 and doc["fits"] is True
    assert len(doc["ranks"]) == 4
    for r in doc["ranks"]:
        assert RANK_KEYS <= set(r)
        for k in (
            "persistent_bytes",
            "staging_bytes",
            "peak_bytes",
            "bytes_needed",
            "bytes_to_read",
        ):
            assert type(r[k]) is int and r[k] > 0
        assert r["peak_bytes"] == r["persistent_bytes"] + r["staging_bytes"]
    assert [r["experts"] for r in doc["ranks"]] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [r["ep_rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert doc["ranks"][0]["layers"] == [0, 1, 2, 3, 4]


def test_fits_and_device_memory() -> None:
    cfg = synthetic("dense")
    plan = build_plan(cfg, L(tp=2))
    assert plan_to_json(plan)["device_memory_bytes"] is None and plan.fits
    peak = max(r.peak_bytes for r in plan.ranks)
    assert build_plan(cfg, L(tp=2), device_memory=peak).fits
    tight = build_plan(cfg, L(tp=2), device_memory=peak - 1)
    assert not tight.fits and plan_to_json(tight)["fits"] is False


def test_dense_model_lists_no_experts() -> None:
    plan = build_plan(synthetic("dense"), L(tp=2, ep=True))
    assert all(r.experts == () and r.ep_rank == 0 for r in plan.ranks)


def test_staging_budget_default_and_minimum() -> None:
    cfg = synthetic("moe")
    plan = build_plan(cfg, L(tp=2))
    assert plan.min_staging_load <= plan.min_staging_reload
    assert all(r.staging is not None and r.staging.budget_bytes == plan.min_staging_reload for r in plan.ranks)  # fmt: skip
    chunked = build_plan(cfg, L(tp=2), staging_budget=plan.min_staging_load)
    assert all(r.staging is not None and r.staging.staging_bytes <= plan.min_staging_load for r in chunked.ranks)  # fmt: skip
    with pytest.raises(StagingBudgetError, match="--staging-budget"):
        build_plan(cfg, L(tp=2), staging_budget=plan.min_staging_load - 1)


def test_bytes_needed_counts_slices_and_covering_tiles() -> None:
    cfg = synthetic("dense")  # hidden 256, heads 4 x 64, kv 2 x 64
    plan = build_plan(cfg, L(tp=4))
    rp = plan.ranks[1]
    o = next(u for u in rp.units if u.buffer == "model.layers.0.self_attn.o_proj.weight")
    assert o.parts[0].cols == (64, 128)
    # o_proj [256, 256] F8: 256 x 64 bytes, plus tile rows 0..1 x tile column 0: 2 x 4 bytes
    from mxload.orchestrator.plan.readplan import needed_bytes

    assert needed_bytes(o, cfg) == 256 * 64 + 2 * 4


def iter_units(plan: Plan) -> Iterator[Any]:
    for rp in plan.ranks:
        yield from rp.units


def test_ranks_sharing_a_shard_share_unit_objects() -> None:
    # The speed trick (orchestrator.planner "Speed") must not leak state between ranks.
    cfg = synthetic("moe")
    plan = build_plan(cfg, L(tp=2, dp=2))
    a, b = plan.ranks[0], plan.ranks[2]  # same tp_rank, different dp_rank
    qa = next(u for u in a.units if u.kind == "linear")
    qb = next(u for u in b.units if u.kind == "linear")
    assert qa is qb
    ea = next(u for u in a.units if u.kind == "moe_w13")
    eb = next(u for u in b.units if u.kind == "moe_w13")
    assert ea != eb  # different MoE ranks hold different expert slices
    assert replace(ea, parts=eb.parts) == eb


def _mx_unit_staging(n: int, k: int, block: int = 128) -> int:
    """docs/contract.md §6 staging of one whole block-FP8 linear unit ``[n, k]`` on the
    fused CPU path, counted from the formats: read = FP8 payload + F32 tiles covering
    it; out = the kernel-layout payload + paired E8M0 scales ``[ceil(g/2), n, 2]``."""
    tiles = -(-n // block) * -(-k // block)
    read = n * k + 4 * tiles
    out = n * k + n * 2 * -(-(k // 32) // 2)
    return read + out


@pytest.mark.parametrize(
    "layout,largest",
    [
        # tp=1: the merged qkv (32 + 4 + 4 heads of 128 rows, K 2048) is the largest unit.
        (L(tp=1), (40 * 128, 2048)),
        # EP at tp 4: the largest unit is one expert's w13 (2 x 768 rows, K 2048).
        (L(tp=4, dp=2, ep=True), (2 * 768, 2048)),
        (L(tp=8, ep=True), (2 * 768, 2048)),
    ],
    ids=["tp1", "tp4-dp2-ep", "tp8-ep"],
)
def test_default_budget_is_the_largest_converted_unit_not_a_vocab_shard(
    layout: ParallelLayout, largest: tuple[int, int]
) -> None:
    """Qwen3-30B-A3B's vocab shard (151936 x 2048 BF16 = 622 MB at tp=1) is cut into row
    blocks, so the default staging budget (the reload minimum, docs/contract.md §6) is one converted
    unit: the qkv at tp=1 (21 MB), one expert's w13 under EP (6.4 MB)."""
    cfg = real("qwen3-30b-a3b-fp8")
    plan = build_plan(cfg, layout)
    want = _mx_unit_staging(*largest)
    assert plan.min_staging_reload == want
    assert {rp.staging.staging_bytes for rp in plan.ranks if rp.staging} == {want}
    vocab_shard = 151936 // layout.tp * 2048 * 2
    assert vocab_shard > 10 * want  # what the default was while the shard was one unit
