"""The engine's MoE mode per profile: all2all backend, sequence-parallel MoE, and whether
the shared experts are whole on every TP rank; kv_b_proj's dtype per profile.

The expected values are the engines' rules as read in their code (cited in
orchestrator/plan/engines.py), restated here on their own; the full-size byte figures are
counted from the packaged configs by the MXFP8 sizes of docs/contract.md §2.3, and equal
the per-rank shortfall measured against vLLM 0.33's own model code at full size.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from mxload.orchestrator.cli import main
from mxload.orchestrator.errors import UsageError
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.engines import engine_profile, resolve_moe
from mxload.orchestrator.plan.planner import build_plan, plan_rank
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import model_config


@pytest.fixture
def mxload(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """``mxload(*argv)`` -> (exit status, stdout, stderr), in this process (plan only:
    nothing is started)."""

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def L(tp: int = 1, dp: int = 1, ep: bool = False, **kw: object) -> ParallelLayout:
    return ParallelLayout(tp=tp, dp=dp, enable_expert_parallel=ep, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "engine,layout,backend,sp,whole",
    [
        # plain vLLM: allgather_reducescatter by default, SP MoE with EP, tp > 1, dp > 1
        ("mxload", L(2, 2, True), "allgather_reducescatter", True, True),
        ("mxload", L(2, 2), "allgather_reducescatter", False, False),
        ("mxload", L(4, 1, True), "allgather_reducescatter", False, False),
        ("mxload", L(1, 4, True), "allgather_reducescatter", False, False),
        (
            "mxload",
            L(2, 2, True, all2all_backend="flashinfer_all2allv"),
            "flashinfer_all2allv",
            False,
            False,
        ),
        # removed backends fall back to allgather_reducescatter in vLLM
        ("mxload", L(2, 2, True, all2all_backend="naive"), "allgather_reducescatter", True, True),
        # vllm-ascend: flashinfer_all2allv unless SP is asked for
        ("vllm-ascend-0.23", L(2, 2, True), "flashinfer_all2allv", False, False),
        (
            "vllm-ascend-0.23",
            L(2, 2, True, all2all_backend="allgather_reducescatter"),
            "allgather_reducescatter",
            True,
            True,
        ),
        ("vllm-ascend-0.23", L(2, 1, shared_expert_dp=True), "flashinfer_all2allv", False, True),
        # 0.27+: the shared experts decoupled from SP; only enable_shared_expert_dp
        (
            "vllm-ascend-main",
            L(2, 2, True, all2all_backend="allgather_reducescatter"),
            "allgather_reducescatter",
            True,
            False,
        ),
        (
            "vllm-ascend-main",
            L(2, 2, True, shared_expert_dp=True),
            "flashinfer_all2allv",
            False,
            True,
        ),
        ("vllm-ascend-0.30.0rc2", L(2, 2, True), "flashinfer_all2allv", False, False),
    ],
)
def test_each_engine_runs_its_own_moe_mode(
    engine: str, layout: ParallelLayout, backend: str, sp: bool, whole: bool
) -> None:
    mode = resolve_moe(engine_profile(engine), layout)
    assert (mode.all2all_backend, mode.sequence_parallel, mode.shared_experts_whole) == (
        backend,
        sp,
        whole,
    )


def test_a_switch_or_backend_the_engine_lacks_is_refused() -> None:
    with pytest.raises(UsageError, match=r"--enable-shared-expert-dp.*mxload") as err:
        resolve_moe(engine_profile("mxload"), L(2, 2, True, shared_expert_dp=True))
    assert err.value.key == "--enable-shared-expert-dp"
    with pytest.raises(UsageError, match="--all2all-backend 'nccl' is not one of") as err:
        resolve_moe(engine_profile("mxload"), L(2, 2, True, all2all_backend="nccl"))
    assert err.value.key == "--all2all-backend"


def _mx(n: int, k: int) -> int:
    """Bytes of an MXFP8 linear [N, K]: payload, paired E8M0 scales (docs/contract.md §2.3)."""
    return n * k + -(-k // 64) * n * 2


def _shared_gain(h: int, si: int, tp: int) -> int:
    """Per MoE layer: a whole shared expert's MXFP8 bytes minus its TP-split slice."""
    whole = _mx(2 * si, h) + _mx(h, si)
    split = _mx(2 * si // tp, h) + _mx(h, si // tp)
    return whole - split


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,measured", [("qwen3.5-397b-a17b-fp8", 681_246_720), ("deepseek-v3", 2_304_884_736)]
)
def test_full_size_tp8_dp4_ep_plain_vllm_against_vllm_ascend(model: str, measured: int) -> None:
    """tp 8 x dp 4 + EP at full size: plain vLLM holds every MoE layer's shared expert
    whole (and DeepSeek's kv_b_proj MXFP8); vllm-ascend splits them (and holds kv_b_proj in
    BF16). The per-rank difference is counted from the config; its shared-expert part
    equals what the plan was short by against vLLM 0.33's own model at full size."""
    cfg = parse_config(model_config(model))
    layout = L(8, 4, True)
    plain = build_plan(cfg, layout)
    ascend = build_plan(cfg, layout, engine="vllm-ascend-0.23")
    h = cfg.hidden_size
    if cfg.architecture == "DeepseekV3ForCausalLM":
        si, moe_layers = cfg.moe_intermediate_size * cfg.n_shared_experts, 61 - 3
        kvb_n = cfg.num_attention_heads // 8 * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        kvb = cfg.num_hidden_layers * (kvb_n * cfg.kv_lora_rank * 2 - _mx(kvb_n, cfg.kv_lora_rank))
    else:
        si, moe_layers, kvb = cfg.shared_expert_intermediate_size, cfg.num_hidden_layers, 0
        kvb_n = 0
    # the shortfall measured against vLLM's model (a checkpoint whose kv_b_proj is BF16)
    assert moe_layers * _shared_gain(h, si, 8) == measured
    # vllm-ascend also holds W_UK_T / W_UV per MLA layer (kv_b_proj's size, BF16; §2.4)
    derived = kvb_n * cfg.kv_lora_rank * 2 * cfg.num_hidden_layers if kvb else 0
    want = measured - kvb - derived
    for a, b in zip(plain.ranks, ascend.ranks, strict=True):
        assert a.persistent_bytes - b.persistent_bytes == want, a.rank
    assert json.loads(json.dumps(plain.moe_mode))["shared_experts"] == "whole"
    assert ascend.moe_mode["shared_experts"] == "tp-split"


def test_shared_expert_buffers_follow_the_mode() -> None:
    cfg = parse_config(model_config("deepseek-v3"))
    p = "model.layers.5.mlp.shared_experts."
    for engine, layout, n in [
        ("mxload", L(8, 4, True), 2048),
        ("mxload", L(8, 4), 256),  # no EP: no sequence-parallel MoE
        ("vllm-ascend-0.23", L(8, 4, True), 256),
        ("vllm-ascend-main", L(8, 4, True, shared_expert_dp=True), 2048),
    ]:
        buffers, _ = plan_rank(cfg, layout, 3, engine=engine)
        by = {b.name: b for b in buffers}
        assert by[p + "gate_up_proj.weight"].shape == (7168, 2 * n), (engine, layout)
        assert by[p + "down_proj.weight"].shape == (n, 7168), (engine, layout)


def test_plan_says_the_mode_it_assumed(mxload: Callable[..., tuple[int, str, str]]) -> None:
    base = ["plan", "--model", "deepseek-v3", "--tp", "8", "--dp", "4", "--enable-expert-parallel"]
    rc, out, _ = mxload(*base)
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("MoE mode"))
    assert "MoE mode (mxload): all2all backend allgather_reducescatter" in line
    assert "sequence-parallel MoE on; shared experts whole" in line
    rc, out, _ = mxload(*base, "--engine", "vllm-ascend-0.23", "--json")
    assert rc == 0
    mode = json.loads(out)["moe_mode"]
    assert mode["all2all_backend"] == "flashinfer_all2allv"
    assert (mode["sequence_parallel_moe"], mode["shared_experts"]) == (False, "tp-split")
    rc, out, err = mxload(*base, "--enable-shared-expert-dp")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--enable-shared-expert-dp" in err
    rc, out, _ = mxload(*base, "--all2all-backend", "naive", "--scale-alg", "1", "--json")
    assert rc == 0
    obj = json.loads(out)
    assert obj["parallel"]["all2all_backend"] == "naive" and obj["scale_alg"] == 1
    # vLLM replaces the removed backend by allgather_reducescatter
    assert obj["moe_mode"]["all2all_backend"] == "allgather_reducescatter"
    rc, out, _ = mxload(*base, "--all2all-backend", "flashinfer_all2allv")
    layout = next(x for x in out.splitlines() if x.startswith("layout:"))
    assert "all2all-backend=flashinfer_all2allv" in layout
    rc, out, _ = mxload("plan", "--model", "qwen3-32b-fp8", "--tp", "2")
    assert rc == 0 and "MoE mode" not in out  # a dense model has none
