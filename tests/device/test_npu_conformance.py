"""The NPU backend (torch_npu.npu_dynamic_mx_quant) against the docs/contract.md §2 table, byte for byte.

Skipped unless torch_npu imports and an NPU is visible. Runs the SAME named case table as
the CPU reference (tests/numerics_cases.py) plus seeded random data compared with the CPU
reference; NaN bytes 0x7F and 0xFF count as equal; mismatches are reported by name.
"""

from __future__ import annotations

import pytest
import torch

from tests import numerics_cases as nc


def _npu_usable() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not _npu_usable(), reason="needs torch_npu and a visible NPU"),
]


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    from mxload.workers.numerics import select_backend

    b = select_backend("npu")
    assert b.name == "npu"
    return b


def test_named_mx_table(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.run_mx_cases(backend.mx_quantize) == []


def test_named_mx_table_scale_alg_1(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.run_mx_cases(backend.with_scale_alg(1).mx_quantize, nc.MX_ALG1_CASES) == []


def test_named_resolve_table(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.run_resolve_cases(backend.resolve_block) == []


def test_random_data_matches_cpu_reference(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.random_conformance(backend) == []
    assert nc.random_conformance(backend, scale_alg=1) == []


def test_memory_queries(backend) -> None:  # type: ignore[no-untyped-def]
    backend.reset_peak_memory()
    x = backend.to_device(torch.zeros(1024, 1024, dtype=torch.bfloat16))
    backend.mx_quantize(x)
    backend.synchronize()
    assert isinstance(backend.memory_allocated(), int)
    assert backend.max_memory_allocated() >= x.numel() * 2
