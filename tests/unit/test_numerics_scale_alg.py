"""``npu_dynamic_mx_quant``'s second scale rule (``scale_alg=1``: the scale from
``amax / 448``, its exponent rounded up) on every numerics path, through the same named
table (tests/numerics_cases.py ``MX_ALG1_CASES``, derived by hand) and the independent
reference (tests/independent_ref.py: the operator's documented steps on exact rationals).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import NumericsError
from mxload.workers.numerics import reference, select_backend
from mxload.workers.numerics.npu import NpuBackend

from tests import independent_ref as ir
from tests import numerics_cases as nc


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
