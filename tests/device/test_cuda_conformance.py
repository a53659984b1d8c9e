"""The CUDA backend (the pure-torch reference on a CUDA device) against docs/contract.md §2, byte for byte.

Skipped unless torch.cuda.is_available(). The reference is device-agnostic torch; this
proves the device's casts and arithmetic agree with the CPU on the SAME named case table
(tests/numerics_cases.py) and on seeded random data. NaN bytes 0x7F and 0xFF count as
equal; mismatches are reported by name.
"""

from __future__ import annotations

import pytest
import torch

from tests import numerics_cases as nc

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    from mxload.workers.numerics import select_backend

    b = select_backend("cuda")
    assert b.name == "cuda"
    return b


def test_named_mx_table(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.run_mx_cases(backend.mx_quantize) == []


def test_named_resolve_table(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.run_resolve_cases(backend.resolve_block) == []


def test_random_data_matches_cpu_reference(backend) -> None:  # type: ignore[no-untyped-def]
    assert nc.random_conformance(backend) == []


def test_memory_queries(backend) -> None:  # type: ignore[no-untyped-def]
    backend.reset_peak_memory()
    x = backend.to_device(torch.zeros(1024, 1024, dtype=torch.bfloat16))
    backend.mx_quantize(x)
    backend.synchronize()
    assert isinstance(backend.memory_allocated(), int)
    assert backend.max_memory_allocated() >= x.numel() * 2
