"""Tests of workers/numerics/backend.py and npu.py that run without any accelerator.

The NPU backend's own logic (scale normalisation, the docs/contract.md §2.2 rule-3 group fix-ups,
the float32 route) is exercised through a stand-in ``torch_npu`` whose
``npu_dynamic_mx_quant`` follows the operator's documented formula
(``P = V / 2**(floor(log2 amax) - 8)``, exponent floored at -127, scale returned paired
as ``float8_e8m0fnu`` ``[..., ceil(g/2), 2]``); the real operator is checked by
tests/device/test_npu_conformance.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import ConversionError, MxloadError, UsageError
from mxload.workers.numerics import Backend, reference, select_backend
from mxload.workers.numerics.backend import ConvertPart, PackedOut
from mxload.workers.numerics.npu import NpuBackend, apply_group_rules, normalise_mx_scale

from tests import independent_ref as ir
from tests import numerics_cases as nc

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
HAS_CUDA = torch.cuda.is_available()
FAST_MODULE = "mxload.workers.numerics.fast"


# --- select_backend -------------------------------------------------------------------------


def test_cpu_backend_basics() -> None:
    b = select_backend("cpu")
    assert b.name in ("cpu-reference", "cpu-fast")
    assert b.device == torch.device("cpu")
    assert b.note.startswith("cpu: --device cpu")
    assert b.memory_allocated() is None and b.max_memory_allocated() is None
    b.reset_peak_memory()
    b.synchronize()


def test_cpu_backend_without_fast_is_reference() -> None:
    b = select_backend("cpu", prefer_fast=False)
    assert b.name == "cpu-reference"
    assert "fast path not requested" in b.note


@pytest.mark.parametrize("prefer_fast", [True, False])
def test_cpu_backend_passes_the_named_table(prefer_fast: bool) -> None:
    # Whatever the CPU backend is (the fused kernel once it exists), it must match the table.
    b = select_backend("cpu", prefer_fast=prefer_fast)
    assert nc.run_mx_cases(b.mx_quantize) == []
    assert nc.run_resolve_cases(b.resolve_block) == []


@pytest.mark.parametrize("prefer_fast", [True, False])
def test_cpu_backend_convert_matches_reference(prefer_fast: bool) -> None:
    b = select_backend("cpu", prefer_fast=prefer_fast)
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, size=(40, 320), dtype=np.uint8)
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    # Slice rows [5, 40) and columns [64, 320) of a source with 16 x 128 tiles.
    scale_full = torch.from_numpy(np.ldexp(rng.random((3, 3)) + 0.5, rng.integers(-8, 8, (3, 3))))
    scale_full = scale_full.float()
    kwargs: dict[str, Any] = {"row0": 5, "col0": 64, "block_n": 16, "block_k": 128}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        [(payload, scale)] = b.convert(
            [ConvertPart(w[5:, 64:], scale_full[0:3, 0:3], 5, 64)],
            block_n=16,
            block_k=128,
            dtype=dtype,
        )
        resolved = reference.resolve_block(w[5:, 64:], scale_full, dtype=dtype, **kwargs)
        want_p, want_s = ir.mx_quantize_ref(resolved.to(torch.float64).numpy())
        assert torch.equal(scale, torch.from_numpy(want_s))
        assert bool(ir.same_e4m3_bytes(payload.view(torch.uint8).numpy(), want_p).all())


@pytest.mark.skipif(HAS_TORCH_NPU or HAS_CUDA, reason="an accelerator stack is installed here")
def test_auto_falls_back_to_cpu_with_a_note() -> None:
    b = select_backend("auto")
    assert b.device == torch.device("cpu")
    assert b.note.startswith("cpu: torch_npu is not installed")
    assert "CUDA is not available" in b.note


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_a_clear_error() -> None:
    with pytest.raises(MxloadError) as info:
        select_backend("npu", visible_devices="3")
    err = info.value
    assert isinstance(err, UsageError) and err.exit_code == 2
    assert err.key == "--device"
    assert "torch_npu is not installed" in str(err) and "--device cpu" in str(err)
    assert "visible devices: 3" in str(err)


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
def test_cuda_unavailable_is_a_clear_error() -> None:
    with pytest.raises(UsageError, match="CUDA is not available"):
        select_backend("cuda")


def test_unknown_device_is_refused() -> None:
    with pytest.raises(UsageError, match="'tpu'"):
        select_backend("tpu")


# --- the optional fast CPU module ---------------------------------------------------------


def _fake_fast(available: Any) -> tuple[types.ModuleType, list[str]]:
    calls: list[str] = []
    mod = types.ModuleType(FAST_MODULE)

    def fast_available() -> bool:
        if isinstance(available, Exception):
            raise available
        return bool(available)

    def resolve_block(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("resolve_block")
        return reference.resolve_block(*args, **kwargs)

    def mx_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("mx_quantize")
        return reference.mx_quantize(x)

    def mx_quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, alg: int) -> None:
        calls.append("mx_quantize_into")
        got_q, got_s = reference.mx_quantize(x)
        q.copy_(got_q.view(torch.uint8))
        s.copy_(got_s)

    def convert(parts: Any, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        calls.append("convert")
        return [(torch.zeros(0), torch.zeros(0))]

    mod.fast_available = fast_available  # type: ignore[attr-defined]
    mod.resolve_block = resolve_block  # type: ignore[attr-defined]
    mod.mx_quantize = mx_quantize  # type: ignore[attr-defined]
    mod.mx_quantize_into = mx_quantize_into  # type: ignore[attr-defined]
    mod.convert = convert  # type: ignore[attr-defined]
    return mod, calls


def test_fast_module_used_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    mod, calls = _fake_fast(True)
    monkeypatch.setitem(sys.modules, FAST_MODULE, mod)
    b = select_backend("cpu")
    assert b.name == "cpu-fast"
    w = torch.full((4, 64), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.ones(1, 1)
    b.resolve_block(w, s, row0=0, col0=0, block_n=128, block_k=128, dtype=torch.bfloat16)
    b.mx_quantize(torch.zeros(32))
    b.mx_quantize_into(
        torch.zeros(32), torch.empty(32, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
    )
    got = b.convert([ConvertPart(w, s)], block_n=128, block_k=128, dtype=torch.bfloat16)
    assert calls == ["resolve_block", "mx_quantize", "mx_quantize_into", "convert"]
    assert b.fused and len(got) == 1 and got[0][0].numel() == 0  # the fast module's answer
    assert select_backend("cpu", prefer_fast=False).name == "cpu-reference"


@pytest.mark.parametrize("available", [False, RuntimeError("no AVX-512")])
def test_fast_module_not_available(monkeypatch: pytest.MonkeyPatch, available: Any) -> None:
    mod, calls = _fake_fast(available)
    monkeypatch.setitem(sys.modules, FAST_MODULE, mod)
    b = select_backend("cpu")
    assert b.name == "cpu-reference"
    assert "fast CPU path" in b.note
    b.mx_quantize(torch.zeros(32))
    assert calls == []


def test_fast_module_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, FAST_MODULE, None)  # makes the import raise ImportError
    b = select_backend("cpu")
    assert b.name == "cpu-reference" and "no fast CPU path" in b.note


def test_backend_module_imports_no_accelerator_stack(tmp_path: Any) -> None:
    # Importing the backend selector (and with it backend.py and npu.py) must import
    # neither torch_npu nor the fast CPU path (numba): they are looked up when a backend
    # is selected. A stand-in torch_npu on the
    # path makes an eager import visible even where the real one is not installed.
    import subprocess

    (tmp_path / "torch_npu.py").write_text("")
    code = (
        "import sys, mxload.workers.numerics.select\n"
        "print(sorted(m for m in ('mxload.workers.numerics.select', 'torch_npu', "
        "'mxload.workers.numerics.fast', 'numba') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "['mxload.workers.numerics.select']"


# --- the NPU backend through a stand-in torch_npu ----------------------------------------


def _op_like_dynamic_mx_quant(x: torch.Tensor, *, dst_type: torch.dtype, scale_alg: int) -> Any:
    """What the documented operator computes, written with the test-side reference:
    S as in the SPEC, but P = V / 2**(S - 127) even when S = 0 (the formula's exponent is
    floored at -127, so tiny groups keep non-zero bytes) and arbitrary bytes for S = 0xFF;
    the scale comes back paired as float8_e8m0fnu with a garbage pad byte."""
    if dst_type != torch.float8_e4m3fn or scale_alg not in (0, 1):
        raise AssertionError("NpuBackend must ask for E4M3 with scale_alg 0 or 1")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise AssertionError("the operator is documented for fp16/bf16 only")
    v = x.to(torch.float64).numpy()
    _, s = ir.mx_quantize_ref(v, scale_alg)
    grouped = v.reshape(*v.shape[:-1], -1, 32)
    shift = np.where(s == 255, 0, 127 - s.astype(np.int64))[..., None]
    raw = ir.e4m3_rne_saturating(np.ldexp(np.where(np.isfinite(grouped), grouped, 0.0), shift))
    raw = np.where((s == 255)[..., None], 0x00, raw).reshape(v.shape).astype(np.uint8)
    g = s.shape[-1]
    pairs = -(-g // 2)
    paired = np.full((*s.shape[:-1], 2 * pairs), 0xEE, dtype=np.uint8)
    paired[..., :g] = s
    paired = paired.reshape(*s.shape[:-1], pairs, 2)
    y = torch.from_numpy(raw).view(torch.float8_e4m3fn)
    return y, torch.from_numpy(paired).view(torch.float8_e8m0fnu)


def _fake_npu_backend() -> tuple[NpuBackend, list[tuple[int, ...]]]:
    seen: list[tuple[int, ...]] = []
    fake = types.SimpleNamespace()

    def op(x: torch.Tensor, **kwargs: Any) -> Any:
        seen.append(tuple(x.shape))
        return _op_like_dynamic_mx_quant(x, **kwargs)

    fake.npu_dynamic_mx_quant = op
    return NpuBackend(device=torch.device("cpu"), torch_npu_module=fake), seen


def test_npu_backend_with_op_like_stand_in_passes_the_table() -> None:
    b, seen = _fake_npu_backend()
    assert b.name == "npu"
    assert nc.run_mx_cases(b.mx_quantize) == []
    fp32_cases = sum(c.dtype == "fp32" for c in nc.MX_CASES)
    assert len(seen) == len(nc.MX_CASES) - fp32_cases  # fp32 goes to the reference
    assert nc.run_resolve_cases(b.resolve_block) == []


def test_npu_group_rules_are_needed_for_tiny_groups() -> None:
    # Without the fix-up the operator's formula keeps 1.5 * 2**-119 as 384 = 0x7C (SPEC: 0x00).
    x = nc.values_tensor(nc.group(1.5 * 2.0**-119, -(2.0**-125)), "bf16")
    raw_y, _ = _op_like_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=0)
    assert raw_y.view(torch.uint8)[0].item() == 0x7C
    b, _ = _fake_npu_backend()
    payload, scale = b.mx_quantize(x)
    assert scale.tolist() == [0]
    assert payload.view(torch.uint8).tolist() == list(nc.codes(0x00, 0x80))


def test_normalise_mx_scale_layouts() -> None:
    x_shape = (2, 96)  # g = 3 -> pairs 2, pad byte dropped
    paired = torch.tensor([[[1, 2], [3, 99]], [[4, 5], [6, 99]]], dtype=torch.uint8)
    want = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8)
    assert torch.equal(normalise_mx_scale(paired, x_shape), want)
    assert torch.equal(normalise_mx_scale(paired.view(torch.float8_e8m0fnu), x_shape), want)
    assert torch.equal(normalise_mx_scale(want, x_shape), want)  # older builds: flat
    out = normalise_mx_scale(paired.view(torch.float8_e8m0fnu), x_shape)
    assert out.dtype == torch.uint8 and out.is_contiguous()
    with pytest.raises(ConversionError, match="shape"):
        normalise_mx_scale(torch.zeros((2, 4), dtype=torch.uint8), x_shape)
    with pytest.raises(ConversionError, match="dtype"):
        normalise_mx_scale(torch.zeros((2, 3), dtype=torch.float32), x_shape)


def test_apply_group_rules_bytes() -> None:
    x = nc.values_tensor(nc.group(-1.0, 1.0) + nc.group(-1.0, 2.0) + nc.group(3.0), "bf16")
    payload = torch.full((96,), 0x33, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = apply_group_rules(x, payload, torch.tensor([0, 0xFF, 120], dtype=torch.uint8))
    got = out.view(torch.uint8).tolist()
    assert got[:32] == list(nc.codes(0x80, 0x00))  # S = 0: ±0 with x's sign
    assert got[32:64] == [0x7F] * 32  # S = 0xFF: NaN
    assert got[64:] == [0x33] * 32  # other groups untouched


def test_backend_base_is_the_reference() -> None:
    b = Backend("cpu-reference", torch.device("cpu"))
    assert nc.run_mx_cases(b.mx_quantize) == []


def test_random_conformance_helper_on_cpu_and_stand_in_npu() -> None:
    # The helper the device tests use must pass on the reference itself and on the NPU
    # backend's logic (stand-in operator), and must catch a wrong backend.
    assert nc.random_conformance(select_backend("cpu")) == []
    b, _ = _fake_npu_backend()
    assert nc.random_conformance(b) == []

    class Broken(Backend):
        def mx_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            p, s = super().mx_quantize(x)
            return p, torch.where(s == 0, s, s - 1)  # off by one in the scale byte

    assert nc.random_conformance(Broken("broken", torch.device("cpu"))) != []


@pytest.mark.parametrize("prefer_fast", [True, False])
def test_convert_refuses_outputs_that_do_not_match_the_parts(prefer_fast: bool) -> None:
    b = select_backend("cpu", prefer_fast=prefer_fast)
    w = torch.zeros((4, 64), dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = PackedOut(
        torch.zeros((64, 4), dtype=torch.uint8), torch.zeros((1, 4, 2), dtype=torch.uint8)
    )
    with pytest.raises(MxloadError, match="2 parts but 1 outputs"):
        b.convert(
            [ConvertPart(w, torch.ones(1, 1))] * 2,
            block_n=128,
            block_k=128,
            dtype=torch.bfloat16,
            into=[out],
        )


def test_packed_conversion_off_the_fused_path_writes_staging_without_line_stores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under scale rule 1 the CPU backend converts packed parts without its fused kernel:
    each part is quantized and written into the unit's staging by ``write_rows``, which
    the loader copies into the buffer at once, so it must not be stored past the cache."""
    from mxload.workers.numerics import kernels

    assert kernels.available(), kernels.unavailable_reason()
    calls: list[bool] = []
    run_rows = kernels.run_rows

    def spy(*args: Any, final: bool = True, **kw: Any) -> int:
        calls.append(final)
        return run_rows(*args, final=final, **kw)

    monkeypatch.setattr(kernels, "run_rows", spy)
    b = select_backend("cpu").with_scale_alg(1)
    w = torch.zeros((128, 256), dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = PackedOut(
        torch.zeros((256, 128), dtype=torch.uint8).view(torch.float8_e4m3fn),
        torch.zeros((4, 128, 2), dtype=torch.uint8),
    )
    b.convert(
        [ConvertPart(w, torch.ones(1, 2))],
        block_n=128,
        block_k=128,
        dtype=torch.bfloat16,
        into=[out],
    )
    assert calls == [False]
