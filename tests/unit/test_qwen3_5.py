"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) from its packaged config: exact bytes.

The persistent bytes of ``plan --model qwen3.8-27b-fp8`` are counted here by hand from the
config's numbers (the issue's: hidden 5120, 64 layers of which every fourth is full
attention, MLP 17408, vocab 248320, 24 heads / 4 kv heads of 256 with an output gate, GDN
16 key heads and 48 value heads of 128, conv kernel 4; the vision tower's depth 27, hidden
1152 of 16 heads, MLP 4304, 3 x 2 x 16 x 16 patches, 2304 positions, merge 2), with the
sharding vLLM 0.23's Qwen3.5 code gives (see ``tests/engine/test_vllm_qwen3_5.py`` for that
code run for real).
"""

from __future__ import annotations

import pytest
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan, plan_rank
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import model_config

H, LAYERS, MLP, V = 5120, 64, 17408, 248320
HEADS, KV, HD = 24, 4, 256
NK, NV, DK, DV, CONV = 16, 48, 128, 128, 4
BF16, F32 = 2, 4


def mx(n: int, k: int) -> int:
    """An MXFP8 linear [N, K]: K*N payload bytes + [ceil(K/64), N, 2] scale bytes."""
    return n * k + -(-k // 64) * n * 2


VD, VH, VI, VPOS, VM = 27, 1152, 4304, 2304, 1152 * 2 * 2


def vision_count(tp: int, out_hidden: int) -> int:
    """The vision tower on every rank (vLLM's default mm_encoder_tp_mode "weights"), all BF16:
    LayerNorms and patch/position embeddings whole, qkv / linear_fc1 split by rows with
    their biases, proj / linear_fc2 by columns with their biases whole."""
    tower = (
        VH * 3 * 2 * 16 * 16 + VH  # patch_embed.proj: Conv3d weight and bias
        + VPOS * VH  # pos_embed
        + 2 * VH  # merger.norm weight, bias
        + VM // tp * VM + VM // tp  # merger.linear_fc1
        + out_hidden * VM // tp + out_hidden  # merger.linear_fc2
    )  # fmt: skip
    block = (
        4 * VH  # norm1, norm2: weight and bias
        + 3 * VH // tp * VH + 3 * VH // tp  # attn.qkv
        + VH * VH // tp + VH  # attn.proj
        + VI // tp * VH + VI // tp  # mlp.linear_fc1
        + VH * VI // tp + VH  # mlp.linear_fc2
    )  # fmt: skip
    return (tower + VD * block) * BF16


def hand_count(tp: int) -> int:
    """Every rank's bytes at tp (all ranks are alike), from the numbers above."""
    norms = 2 * H * BF16
    mlp = mx(2 * MLP // tp, H) + mx(H, MLP // tp)
    gdn = (
        mx((2 * NK * DK + 2 * NV * DV) // tp, H)  # in_proj_qkvz: q, k, v, z, each / tp
        + (2 * NV // tp) * H * BF16  # in_proj_ba: in_proj_a/b are in modules_to_not_convert
        + (2 * NK * DK + NV * DV) // tp * CONV * BF16  # conv1d [conv_dim/tp, 1, 4]
        + NV // tp * BF16  # dt_bias
        + NV // tp * F32  # A_log (vLLM's parameter is float32)
        + DV * BF16  # the gated RMSNorm
        + mx(H, NV * DV // tp)  # out_proj
    )
    kv_rows = KV * HD // tp if KV >= tp else HD  # kv heads replicated past tp = 4
    attn = (
        mx((HEADS * 2 * HD) // tp + 2 * kv_rows, H)  # q_proj carries the gate: 2 * head_dim
        + 2 * HD * BF16  # q_norm, k_norm
        + mx(H, HEADS * HD // tp)  # o_proj
    )
    n_full = LAYERS // 4
    layers = (LAYERS - n_full) * gdn + n_full * attn + LAYERS * (norms + mlp)
    vocab = V // tp * H * BF16  # 248320 is a multiple of 64: no padding
    return layers + 2 * vocab + H * BF16  # embed, lm_head, final norm


def mtp_count(tp: int) -> int:
    """The MTP drafter (vLLM's Qwen3_5MTP) on every rank, all BF16 ("mtp" is in the
    release's modules_to_not_convert): fc [H, 2H] split by rows; pre_fc_norm_embedding,
    pre_fc_norm_hidden and norm whole; one full-attention decoder layer with the MLP,
    sharded as the model's. embed_tokens and lm_head are the target's (vLLM shares them)."""
    kv_rows = KV * HD // tp if KV >= tp else HD
    layer = (
        2 * H  # input_layernorm, post_attention_layernorm
        + ((HEADS * 2 * HD) // tp + 2 * kv_rows) * H + 2 * HD  # qkv_proj, q_norm, k_norm
        + H * (HEADS * HD // tp)  # o_proj
        + 2 * MLP // tp * H + H * (MLP // tp)  # gate_up_proj, down_proj
    )  # fmt: skip
    return (H // tp * 2 * H + 3 * H + layer) * BF16


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_8_27b_persistent_bytes_equal_a_hand_count(tp: int) -> None:
    cfg = parse_config(model_config("qwen3.8-27b-fp8"), "qwen3.8-27b-fp8.json")
    buffers, _ = plan_rank(cfg, ParallelLayout(tp=tp), tp - 1)
    assert sum(b.nbytes for b in buffers) == hand_count(tp) + vision_count(tp, H)
    lm_only, _ = plan_rank(cfg, ParallelLayout(tp=tp, language_model_only=True), tp - 1)
    assert sum(b.nbytes for b in lm_only) == hand_count(tp)
    # vLLM's --mm-encoder-tp-mode data: the whole tower on every TP rank
    data, _ = plan_rank(cfg, ParallelLayout(tp=tp, mm_encoder_tp_mode="data"), tp - 1)
    assert sum(b.nbytes for b in data) == hand_count(tp) + vision_count(1, H)
    # speculative_config method "mtp": the drafter's rows besides the target's
    mtp = ParallelLayout(tp=tp, language_model_only=True, speculative_method="mtp")
    assert sum(b.nbytes for b in plan_rank(cfg, mtp, tp - 1)[0]) == hand_count(tp) + mtp_count(tp)
    # vllm-ascend keeps the drafter's own lm_head (V / tp rows of H, BF16)
    ascend, _ = plan_rank(cfg, mtp, tp - 1, engine="vllm-ascend-0.23")
    assert sum(b.nbytes for b in ascend) == hand_count(tp) + mtp_count(tp) + V // tp * H * BF16


def test_the_vision_tower_in_data_mode_is_whole_and_alike_on_every_tp_rank() -> None:
    """--mm-encoder-tp-mode data (vLLM: every vision linear disable_tp): each tp-4 rank's
    vision buffers are the tp-1 rank's, same names, shapes and source rectangles."""
    from mxload.orchestrator.errors import LayoutError
    from mxload.orchestrator.tools.synth import preset_config

    # a tower of 2 heads: tp 4 cannot split it ("weights"), and holds it whole ("data")
    raw = preset_config("qwen3.5-tiny")
    raw["vision_config"]["num_heads"] = 2
    cfg = parse_config(raw, "qwen3.5-tiny")
    whole_b, whole_u = plan_rank(cfg, ParallelLayout(tp=1), 0)
    want_b = [b for b in whole_b if b.name.startswith("visual.")]
    want_u = [u for u in whole_u if u.buffer.startswith("visual.")]
    assert len(want_b) == 9 + 2 * 12
    for rank in (0, 3):
        got_b, got_u = plan_rank(cfg, ParallelLayout(tp=4, mm_encoder_tp_mode="data"), rank)
        assert [b for b in got_b if b.name.startswith("visual.")] == want_b
        assert [u for u in got_u if u.buffer.startswith("visual.")] == want_u
    with pytest.raises(LayoutError, match=r"vision_config.num_heads \(2\) is not divisible"):
        plan_rank(cfg, ParallelLayout(tp=4), 0)
    # "weights" mode splits the same tower (qkv rows by heads) at tp 2
    split = plan_rank(cfg, ParallelLayout(tp=2), 1)[0]
    qkv = {b.name: b.shape for b in split}["visual.blocks.0.attn.qkv.weight"]
    assert qkv == (3 * 64 // 2, 64)


def test_the_mtp_drafter_is_on_the_last_tp_ranks_only_and_named_as_vllm_holds_it() -> None:
    from mxload.orchestrator.tools.synth import preset_config

    cfg = parse_config(preset_config("qwen3.5-moe-tiny"), "qwen3.5-moe-tiny")
    layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True, speculative_method="mtp")
    names = [b.name for b in plan_rank(cfg, layout, 3)[0] if b.name.startswith("drafter.")]
    assert names == [
        "drafter.model.fc.weight",
        "drafter.model.pre_fc_norm_embedding.weight",
        "drafter.model.pre_fc_norm_hidden.weight",
        "drafter.model.norm.weight",
        *(
            f"drafter.model.layers.0.{n}.weight"
            for n in (
                "input_layernorm",
                "self_attn.qkv_proj",
                "self_attn.q_norm",
                "self_attn.k_norm",
                "self_attn.o_proj",
                "post_attention_layernorm",
                "mlp.gate",
                "mlp.shared_expert_gate",
                "mlp.shared_expert.gate_up_proj",
                "mlp.shared_expert.down_proj",
            )
        ),
        "drafter.model.layers.0.mlp.experts.w13_weight",
        "drafter.model.layers.0.mlp.experts.w2_weight",
    ]
    # the MTP layer's experts are placed as the model's: 8 experts over EP 4
    _, units = plan_rank(cfg, layout, 3)
    drafter = [u for u in units if u.buffer.startswith("drafter.") and u.global_expert >= 0]
    assert {u.global_expert for u in drafter} == {6, 7}
    summary_mtp = build_plan(cfg, layout).model
    assert "not_planned" not in summary_mtp
    assert [
        s.split(" ")[0] for s in build_plan(cfg, ParallelLayout(tp=2)).model["not_planned"]
    ] == ["mtp.*"]


@pytest.mark.parametrize(
    ("preset", "layout", "says"),
    [
        (
            "qwen3.5-tiny",
            ParallelLayout(pp=2, speculative_method="mtp"),
            "method 'mtp' with --pp 2: vLLM 0.23 builds the MTP drafter on the last pipeline "
            "stage only",
        ),
        (
            "qwen3-dense-tiny",
            ParallelLayout(speculative_method="mtp"),
            "method 'mtp' needs the checkpoint's MTP layers, and the config declares none",
        ),
        (
            "deepseek-v3-tiny",
            ParallelLayout(pp=2, speculative_method="mtp"),
            "method 'mtp' with --pp 2: vLLM 0.23 builds the MTP drafter on the last pipeline "
            "stage only",
        ),
    ],
)
def test_mtp_layouts_vllm_cannot_serve_are_refused_with_the_reason(
    preset: str, layout: ParallelLayout, says: str
) -> None:
    from mxload.orchestrator.errors import LayoutError
    from mxload.orchestrator.tools.synth import preset_config

    cfg = parse_config(preset_config(preset), preset)
    with pytest.raises(LayoutError) as err:
        plan_rank(cfg, layout, 0)
    assert says in str(err.value) and err.value.key == "--speculative-config"


def test_the_vision_tower_is_on_every_pipeline_stage_unless_language_model_only() -> None:
    cfg = parse_config(model_config("qwen3.8-27b-fp8"), "qwen3.8-27b-fp8.json")
    for rank in (0, 1):  # tp 1 x pp 2: one rank per stage
        names = [b.name for b in plan_rank(cfg, ParallelLayout(pp=2), rank)[0]]
        assert sum(n.startswith("visual.") for n in names) == 9 + VD * 12
        lm_only = plan_rank(cfg, ParallelLayout(pp=2, language_model_only=True), rank)[0]
        assert not any(b.name.startswith("visual.") for b in lm_only)


def test_a_tp_the_vision_tower_cannot_take_is_refused_naming_the_way_out() -> None:
    from mxload.orchestrator.errors import LayoutError
    from mxload.orchestrator.tools.synth import preset_config

    # among the reasons: the vision tower's 4 heads, with the flag that avoids them
    cfg = parse_config(preset_config("qwen3.5-tiny"), "qwen3.5-tiny")
    with pytest.raises(LayoutError) as err:
        plan_rank(cfg, ParallelLayout(tp=8), 0)
    assert "vision_config.num_heads (4) is not divisible by --tp (8) (--language-model-only" in str(
        err.value
    )


def test_qwen3_8_27b_config_reads_the_nested_text_config() -> None:
    cfg = parse_config(model_config("qwen3.8-27b-fp8"), "qwen3.8-27b-fp8.json")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (H, LAYERS, V)
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.quant.kind == "block_fp8" and cfg.attn_output_gate
    assert [s.split(" ")[0] for s in cfg.not_planned()] == ["mtp.*"]
    assert cfg.vision is not None and (cfg.vision.depth, cfg.vision.out_hidden_size) == (27, H)


def test_a_qwen3_5_session_reloads_a_bf16_trainer_checkpoint_in_place(tmp_path) -> None:
    """Load the block-FP8 qwen3.5-tiny on a tp-2 rank, reload a BF16 checkpoint of the
    same model (another seed, as a trainer writes it) into the same buffers: no address
    moves, and every buffer then holds what a fresh load of that BF16 checkpoint into the
    same plan holds."""
    import torch
    from mxload.orchestrator.plan.message import SourceInfo
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.orchestrator.runtime.reload import reload_inputs
    from mxload.orchestrator.tools.synth import make_checkpoint
    from mxload.workers.rank.loader import RankLoader

    fp8, bf16 = str(tmp_path / "fp8"), str(tmp_path / "bf16")
    make_checkpoint(fp8, "qwen3.5-tiny", seed=1)
    make_checkpoint(bf16, "qwen3.5-tiny", seed=2, bf16=True)
    meta = open_checkpoint(fp8)
    held = build_plan(meta.config, ParallelLayout(tp=2), checkpoint=meta)
    rp = held.ranks[1]
    assert any(b.layout == "mx_linear" for b in rp.buffers)
    q = meta.config.quant
    loader = RankLoader(rp, model_dtype="bf16")
    loader.load(
        list(rp.reads or ()),
        SourceInfo(root=fp8, quant=q.kind, block_n=q.block_n, block_k=q.block_k),
        version=1,
        staging_budget=held.min_staging_reload,
    )
    before = {n: t.data_ptr() for n, t in loader.buffers.items()}
    first = {n: t.clone() for n, t in loader.buffers.items()}
    inp = reload_inputs(held, bf16)
    loader.reload(
        list(inp.reads[1]),
        inp.source,
        version=2,
        staging_budget=inp.budgets[1],
        units=list(inp.units[1]),
    )
    assert {n: t.data_ptr() for n, t in loader.buffers.items()} == before
    fresh = RankLoader(rp, model_dtype="bf16")
    fresh.load(
        list(inp.reads[1]),
        inp.source,
        version=1,
        staging_budget=inp.budgets[1],
        units=list(inp.units[1]),
    )
    for name, t in loader.buffers.items():
        assert torch.equal(t.view(torch.uint8), fresh.buffers[name].view(torch.uint8)), name
    changed = [n for n, t in loader.buffers.items() if not torch.equal(t, first[n])]
    assert len(changed) == len(first)  # another seed: every buffer was rewritten


def test_qwen3_5_397b_moe_persistent_bytes_with_expert_parallel_equal_a_hand_count() -> None:
    """Qwen3.5-397B-A17B-FP8 (packaged) at tp 8 x dp 4 with EP, counted by hand: hidden
    4096, 60 layers (45 GDN, 15 full), 32 heads / 2 kv heads of 256 with the gate, GDN 16
    key / 64 value heads of 128, 512 experts of 1024 (16 per rank), a shared expert of 1024
    with its own gate, vocab 248320. Every layer is MoE; the router and shared_expert_gate
    are in modules_to_not_convert (model dtype)."""
    h, layers, v, tp, e_local, mi, si = 4096, 60, 248320, 8, 512 // 32, 1024, 1024
    gdn = (
        mx((2 * 16 * 128 + 2 * 64 * 128) // tp, h)
        + (2 * 64 // tp) * h * BF16
        + (2 * 16 * 128 + 64 * 128) // tp * 4 * BF16
        + 64 // tp * (BF16 + F32)
        + 128 * BF16
        + mx(h, 64 * 128 // tp)
    )
    attn = mx(32 * 2 * 256 // tp + 2 * 256, h) + 2 * 256 * BF16 + mx(h, 32 * 256 // tp)
    experts = (
        e_local * h * 2 * mi + e_local * -(-h // 64) * 2 * mi * 2  # w13 [E, H, 2I] + scale
        + e_local * mi * h + e_local * -(-mi // 64) * h * 2  # w2 [E, I, H] + scale
    )  # fmt: skip
    cfg = parse_config(model_config("qwen3.5-397b-a17b-fp8"), "qwen3.5-397b-a17b-fp8.json")
    layout = ParallelLayout(tp=8, dp=4, enable_expert_parallel=True)
    # plain vLLM (tp > 1, dp > 1, EP: sequence-parallel MoE) holds the shared expert whole;
    # vllm-ascend splits it over tp
    for engine, shared in (("mxload", 1), ("vllm-ascend-0.23", tp)):
        moe = 512 * h * BF16 + h * BF16 + mx(2 * si // shared, h) + mx(h, si // shared) + experts
        per_layer = 2 * h * BF16 + moe
        want = 45 * gdn + 15 * attn + layers * per_layer + 2 * (v // tp) * h * BF16 + h * BF16
        want += vision_count(tp, h)
        for rank in (0, 31):
            buffers, _ = plan_rank(cfg, layout, rank, engine=engine)
            assert sum(b.nbytes for b in buffers) == want, (engine, rank)
