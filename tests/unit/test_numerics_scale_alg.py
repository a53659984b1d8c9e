"""``npu_dynamic_mx_quant``'s second scale rule (``scale_alg=1``: the scale from
``amax / 448``, its exponent rounded up) on every numerics path, through the same named
table (tests/numerics_cases.py ``MX_ALG1_CASES``, derived by hand) and the independent
reference (tests/independent_ref.py: the operator's documented steps on exact rationals).
"""

from __future__ import annotations

import functools
import glob
import os
import types
from typing import Any

import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import NumericsError
from mxload.orchestrator.tools.convert import convert_checkpoint
from mxload.workers.numerics import reference, select_backend
from mxload.workers.numerics.npu import NpuBackend
from safetensors.torch import load_file

from tests import independent_ref as ir
from tests import numerics_cases as nc
from tests.reference_model import RefCheckpoint


def _independent(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p, s = ir.mx_quantize_ref(x.to(torch.float64).numpy(), scale_alg=1)
    return torch.from_numpy(p).view(torch.float8_e4m3fn), torch.from_numpy(s.astype(np.uint8))


def test_the_table_agrees_with_the_independent_reference() -> None:
    assert nc.run_mx_cases(_independent, nc.MX_ALG1_CASES) == []


def test_the_table_tells_the_two_rules_apart() -> None:
    # under rule 0 most cases must fail: the table would not catch a path that ignores the rule
    wrong = nc.run_mx_cases(reference.mx_quantize, nc.MX_ALG1_CASES)
    assert len({p.split(":")[0] for p in wrong}) >= 6, wrong


def test_reference_passes_the_table() -> None:
    quantize = functools.partial(reference.mx_quantize, scale_alg=1)
    assert nc.run_mx_cases(quantize, nc.MX_ALG1_CASES) == []
    assert nc.run_mx_cases(functools.partial(reference.mx_quantize, scale_alg=0)) == []


@pytest.mark.parametrize("prefer_fast", [True, False])
def test_cpu_backends_pass_the_table_and_match_the_reference(prefer_fast: bool) -> None:
    b = select_backend("cpu", prefer_fast=prefer_fast)
    assert nc.run_mx_cases(b.with_scale_alg(1).mx_quantize, nc.MX_ALG1_CASES) == []
    assert nc.run_mx_cases(b.mx_quantize) == []  # the backend itself keeps rule 0
    assert nc.random_conformance(b, scale_alg=1) == []


def test_fast_kernel_passes_the_table_when_available() -> None:
    fast = pytest.importorskip("mxload.workers.numerics.fast")
    if not fast.fast_available():
        pytest.skip(f"fast path unavailable: {fast.unavailable_reason()}")
    quantize = functools.partial(fast.mx_quantize, scale_alg=1)
    assert nc.run_mx_cases(quantize, nc.MX_ALG1_CASES) == []


def test_reference_equals_the_independent_reference_on_random_data() -> None:
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        info = torch.iinfo(bits)
        raw = torch.randint(info.min, info.max, (8, 256), generator=g, dtype=torch.int64)
        for x in (raw.to(bits).view(dtype), torch.randn(8, 256, generator=g).to(dtype)):
            p, s = reference.mx_quantize(x, 1)
            wp, ws = ir.mx_quantize_ref(x.to(torch.float64).numpy(), scale_alg=1)
            assert np.array_equal(s.numpy(), ws), dtype
            assert ir.same_e4m3_bytes(p.view(torch.uint8).numpy(), wp).all(), dtype


def test_npu_backend_asks_the_operator_for_the_rule() -> None:
    asked: list[int] = []

    def op(x: torch.Tensor, *, dst_type: torch.dtype, scale_alg: int) -> Any:
        asked.append(scale_alg)
        p, s = ir.mx_quantize_ref(x.to(torch.float64).numpy(), scale_alg)
        g = s.shape[-1]
        paired = np.zeros((*s.shape[:-1], -(-g // 2) * 2), dtype=np.uint8)
        paired[..., :g] = s
        paired = paired.reshape(*s.shape[:-1], -1, 2)
        return (
            torch.from_numpy(p).view(torch.float8_e4m3fn),
            torch.from_numpy(paired).view(torch.float8_e8m0fnu),
        )

    b = NpuBackend(
        torch.device("cpu"), torch_npu_module=types.SimpleNamespace(npu_dynamic_mx_quant=op)
    )
    assert nc.run_mx_cases(b.with_scale_alg(1).mx_quantize, nc.MX_ALG1_CASES) == []
    assert set(asked) == {1}


def test_an_unknown_rule_is_refused() -> None:
    x = torch.zeros(32, dtype=torch.bfloat16)
    with pytest.raises(NumericsError, match="scale_alg"):
        reference.mx_quantize(x, 2)
    with pytest.raises(NumericsError, match="scale_alg"):
        select_backend("cpu").with_scale_alg(2)


# --- chosen per model, carried by the plan to every rank, and by convert --------------------


def test_the_engine_chooses_the_rule_per_model() -> None:
    from mxload.orchestrator.errors import UsageError
    from mxload.orchestrator.plan.engines import engine_profile, scale_alg_for

    main, old, own = (engine_profile(n) for n in ("vllm-ascend-main", "vllm-ascend-0.23", "mxload"))
    # vllm-ascend 0.27+ get_dynamic_mx_quant_scale_alg: 1 for MiniMaxM3*, else 0; 0.23 has no rule 1
    assert scale_alg_for(main, "MiniMaxM3ForCausalLM") == 1
    assert scale_alg_for(main, "DeepseekV3ForCausalLM") == 0
    assert scale_alg_for(old, "MiniMaxM3ForCausalLM") == 0
    assert scale_alg_for(own, "Qwen3MoeForCausalLM") == 0
    assert scale_alg_for(main, "MiniMaxM3ForCausalLM", 0) == 0  # a trainer's own rule wins
    with pytest.raises(UsageError, match="--scale-alg 3"):
        scale_alg_for(own, "Qwen3MoeForCausalLM", 3)


@pytest.mark.parametrize("fast", [False, True])
def test_a_rank_loads_under_the_plan_s_rule(ckpt_factory, fast: bool) -> None:
    from mxload.orchestrator.plan.planner import build_plan, plan_to_json
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank
    from tests.unit.test_loader import backend, source_of

    src = ckpt_factory("qwen3-moe-tiny", 3)
    meta = open_checkpoint(src)
    layout = ParallelLayout(tp=2, enable_expert_parallel=True, scale_alg=1)
    plan = build_plan(meta.config, layout, checkpoint=meta)
    assert plan_to_json(plan)["scale_alg"] == 1 and plan.ranks[1].scale_alg == 1
    from mxload.workers.rank.loader import RankLoader

    rp = plan.ranks[1]
    loader = RankLoader(rp, model_dtype=meta.config.model_dtype, backend=backend(fast))
    assert loader.backend.scale_alg == 1
    loader.load(
        list(rp.reads), source_of(src, meta), version=1, staging_budget=rp.staging.budget_bytes
    )
    got = loader.host_tensors()
    want = expected_rank(RefCheckpoint(src, scale_alg=1), Layout(2, 1, 1, True), 1)
    assert compare_rank(want, got) == []
    # and not what rule 0 gives: the checkpoint has groups the rules tell apart
    assert compare_rank(expected_rank(RefCheckpoint(src), Layout(2, 1, 1, True), 1), got) != []


@pytest.mark.parametrize("numerics", ["reference", "auto"])
def test_convert_writes_the_rule_asked_for(ckpt_factory, tmp_path, numerics: str) -> None:
    src = ckpt_factory("qwen3-dense-tiny", 4)
    dst = str(tmp_path / "out")
    convert_checkpoint(src, dst, numerics=numerics, scale_alg=1)
    ref = RefCheckpoint(src)
    out: dict[str, torch.Tensor] = {}
    for f in glob.glob(os.path.join(dst, "*.safetensors")):
        out.update(load_file(f))
    module = "model.layers.0.self_attn.o_proj"
    payload, scale = ir.mx_quantize_ref(ref.values(module), scale_alg=1)
    got_s = out[f"{module}.weight_scale"].view(torch.uint8).numpy().reshape(scale.shape)
    got_p = out[f"{module}.weight"].view(torch.uint8).numpy().reshape(payload.shape)
    assert np.array_equal(got_s, scale)
    assert ir.same_e4m3_bytes(got_p, payload).all()
    _, scale0 = ir.mx_quantize_ref(ref.values(module))
    assert not np.array_equal(scale, scale0)
