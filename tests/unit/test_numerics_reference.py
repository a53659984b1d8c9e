"""Tests of workers/numerics/reference.py: the bit-exact contract of docs/contract.md §2.1-2.2.

Expected bytes come from the hand-written table (tests/numerics_cases.py), from
exhaustive enumeration of small domains, and from the independent numpy implementation
(tests/independent_ref.py) - never from the code under test.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mxload.orchestrator.errors import NonFiniteScale, NumericsError
from mxload.workers.numerics import reference as ref

from tests import independent_ref as ir
from tests import numerics_cases as nc

DTYPES = ("bf16", "fp16", "fp32")


def _ref_quantize_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent reference, wrapped to look like mx_quantize (for the table)."""
    payload, scale = ir.mx_quantize_ref(x.to(torch.float64).numpy())
    return torch.from_numpy(payload).view(torch.float8_e4m3fn), torch.from_numpy(scale)


def _assert_same_mx(
    x: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor, label: str
) -> None:
    want_p, want_s = ir.mx_quantize_ref(x.to(torch.float64).numpy())
    got_p = payload.view(torch.uint8).numpy()
    got_s = scale.numpy()
    assert scale.dtype == torch.uint8 and payload.dtype == torch.float8_e4m3fn
    assert got_s.shape == want_s.shape, label
    bad_s = np.argwhere(got_s != want_s)
    assert bad_s.size == 0, f"{label}: scale differs at {bad_s[:5].tolist()}"
    same = ir.same_e4m3_bytes(got_p, want_p)
    bad = np.argwhere(~same)
    assert bad.size == 0, (
        f"{label}: payload differs at {bad[:5].tolist()}: got "
        f"{[hex(got_p[tuple(i)]) for i in bad[:5]]}, want {[hex(want_p[tuple(i)]) for i in bad[:5]]}"
    )


# --- the named table ----------------------------------------------------------------------


@pytest.mark.parametrize("case", nc.MX_CASES, ids=lambda c: c.name)
def test_mx_table_reference(case: nc.MxCase) -> None:
    assert nc.run_mx_cases(ref.mx_quantize, [case]) == []


@pytest.mark.parametrize("case", nc.MX_CASES, ids=lambda c: c.name)
def test_mx_table_agrees_with_independent_ref(case: nc.MxCase) -> None:
    # Cross-checks the hand-written bytes against a second derivation of the SPEC.
    assert nc.run_mx_cases(_ref_quantize_torch, [case]) == []


@pytest.mark.parametrize("case", nc.RESOLVE_CASES, ids=lambda c: c.name)
def test_resolve_table_reference(case: nc.ResolveCase) -> None:
    assert nc.run_resolve_cases(ref.resolve_block, [case]) == []


@pytest.mark.parametrize("case", nc.RESOLVE_CASES, ids=lambda c: c.name)
def test_resolve_table_agrees_with_independent_ref(case: nc.ResolveCase) -> None:
    # Place the slice's tiles into a "whole" scale at their global tile positions.
    tr0, tc0 = case.row0 // case.block_n, case.col0 // case.block_k
    tiles = np.asarray(case.scale, dtype=np.float32)
    full = np.full((tr0 + tiles.shape[0], tc0 + tiles.shape[1]), np.nan, dtype=np.float32)
    full[tr0:, tc0:] = tiles
    got = ir.resolve_ref_bits(
        np.asarray(case.w_codes, dtype=np.uint8),
        full,
        row0=case.row0,
        col0=case.col0,
        block_n=case.block_n,
        block_k=case.block_k,
        dtype=case.dtype,
    )
    for r, row in enumerate(case.expected_bits):
        for c, want in enumerate(row):
            if want != nc.ANY_NAN:
                assert int(got[r, c]) == want, f"{case.name}[{r},{c}]"


# --- exhaustive: all 256 scale bytes -------------------------------------------------------


def test_every_reachable_scale_byte() -> None:
    # S = 1..246: a group whose amax is 2**(S - 119) has biased exponent S + 8, so byte S;
    # its amax scales to 2**8 (0x78) and -1.5 * 2**(S - 120) to -192 (0xF4).
    s_values = list(range(1, 247))
    rows = [nc.group(2.0 ** (s - 119), -1.5 * 2.0 ** (s - 120)) for s in s_values]
    x = torch.tensor(rows, dtype=torch.float64).to(torch.float32)
    payload, scale = ref.mx_quantize(x)
    assert scale[:, 0].tolist() == s_values
    p = payload.view(torch.uint8)
    assert p[:, 0].tolist() == [0x78] * len(s_values)
    assert p[:, 1].tolist() == [0xF4] * len(s_values)
    assert bool((p[:, 2:] == 0).all())
    # Dequantizing gives the inputs back exactly.
    assert torch.equal(ref.mx_dequantize(payload, scale), x)


@pytest.mark.parametrize("emax", range(0, 9))
def test_scale_byte_zero_for_emax_up_to_8(emax: int) -> None:
    # Biased exponent 0..8 (amax < 2**-118) -> S = 0 -> the group is ±0, sign kept.
    # Exponent field 0 is an f32 subnormal: 2**-127.
    amax = 2.0**-127 if emax == 0 else 2.0 ** (emax - 127)
    x = torch.tensor(nc.group(amax, -amax * 0.75, 2.0**-149), dtype=torch.float64).float()
    payload, scale = ref.mx_quantize(x)
    assert scale.tolist() == [0]
    assert payload.view(torch.uint8).tolist() == list(nc.codes(0x00, 0x80))


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_byte_255(special: float, dtype: str) -> None:
    x = nc.values_tensor(nc.group(1.0, special), dtype)
    payload, scale = ref.mx_quantize(x)
    assert scale.tolist() == [0xFF]
    assert bool(torch.isnan(payload.float()).all())


def test_no_finite_input_reaches_bytes_247_to_254() -> None:
    # The largest finite magnitudes of each dtype stop at 246 (fp32/bf16) or below.
    for dtype, top in (("fp32", (2 - 2.0**-23) * 2.0**127), ("bf16", (2 - 2.0**-7) * 2.0**127)):
        _, scale = ref.mx_quantize(nc.values_tensor(nc.group(top), dtype))
        assert scale.tolist() == [246]
    _, scale = ref.mx_quantize(nc.values_tensor(nc.group(65504.0), "fp16"))
    assert scale.tolist() == [134]


def test_dequantize_all_scale_bytes_times_all_payload_codes() -> None:
    # 256 scale bytes x 256 E4M3 codes, against exact float64 ldexp in the test reference.
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # [S, code]
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)  # 8 groups per row
    got = ref.mx_dequantize(
        torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales)
    )
    assert got.dtype == torch.float32
    want = ir.mx_dequantize_ref(codes, scales)
    got_np = got.numpy()
    same = (got_np.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got_np) & np.isnan(want))
    bad = np.argwhere(~same)
    assert bad.size == 0, f"(S, code) pairs differ: {bad[:5].tolist()}"
    # Spot checks spelled out: S = 0 -> 2**-127 (an f32 subnormal), S = 255 -> NaN.
    assert got_np[0, 0x38] == np.float32(2.0**-127)
    assert got_np[127, 0x7E] == np.float32(448.0)
    assert bool(np.isnan(got_np[255]).all())


def test_dequantize_accepts_e8m0_dtype_without_converting() -> None:
    payload = torch.full((32,), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor([130], dtype=torch.uint8)
    as_u8 = ref.mx_dequantize(payload, scale)
    as_e8m0 = ref.mx_dequantize(payload, scale.view(torch.float8_e8m0fnu))
    assert torch.equal(as_u8, as_e8m0)
    assert as_u8.tolist() == [8.0] * 32


# --- property tests against the independent reference ------------------------------------

SHAPES = [(1, 32), (3, 64), (2, 96), (5, 160), (4, 224), (2, 3, 96), (7, 32), (1, 1024)]


def _random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Uniform bit patterns: NaN, Inf, subnormals and huge exponent spreads included."""
    if dtype == "fp32":
        raw = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
        return torch.from_numpy(raw.view(np.int32)).view(torch.float32)
    raw = rng.integers(0, 2**16, size=shape, dtype=np.uint32).astype(np.uint16)
    t = torch.from_numpy(raw.view(np.int16))
    return t.view(torch.bfloat16 if dtype == "bf16" else torch.float16)


def _random_scaled(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Gaussian data, each 32-group scaled by its own power of two over the dtype's range."""
    lo, hi = {"bf16": (-140, 120), "fp16": (-26, 12), "fp32": (-150, 120)}[dtype]
    groups = (*shape[:-1], shape[-1] // 32, 1)
    exps = rng.integers(lo, hi, size=groups)
    x = rng.standard_normal((*shape[:-1], shape[-1] // 32, 32)) * np.ldexp(1.0, exps)
    x[rng.random(x.shape) < 0.05] = 0.0
    return torch.from_numpy(x.reshape(shape)).to(nc.TORCH_DTYPES[dtype])


def _random_ties(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Midpoints between neighbouring E4M3 values, so that RNE ties are common."""
    vals = ir.E4M3_TABLE[:0x7F]
    mids = np.concatenate([vals, (vals[:-1] + vals[1:]) / 2])
    x = rng.choice(mids, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    x = x.reshape(*shape[:-1], shape[-1] // 32, 32)
    x[..., 0] = 448.0  # amax 448 -> S = 127 - 8 + 8 = 127 -> r = 1: midpoints stay midpoints
    exps = rng.integers(-8, 8, size=(*x.shape[:-1], 1))
    return torch.from_numpy(np.ldexp(x, exps).reshape(shape)).to(nc.TORCH_DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gen", [_random_bits, _random_scaled, _random_ties])
def test_quantize_matches_independent_ref(dtype: str, gen) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1234)
    for shape in SHAPES:
        x = gen(rng, shape, dtype)
        payload, scale = ref.mx_quantize(x)
        assert tuple(payload.shape) == shape
        assert tuple(scale.shape) == (*shape[:-1], shape[-1] // 32)
        _assert_same_mx(x, payload, scale, f"{gen.__name__} {dtype} {shape}")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.sampled_from(DTYPES).flatmap(
        lambda d: st.tuples(
            st.just(d),
            st.integers(1, 3).flatmap(
                lambda g: st.lists(
                    st.floats(width=16 if d == "fp16" else 32, allow_nan=True),
                    min_size=32 * g,
                    max_size=32 * g,
                )
            ),
        )
    )
)
def test_quantize_hypothesis(case: tuple[str, list[float]]) -> None:
    dtype, values = case
    # bf16 cannot hold every f32 value: round the input first, then test that input.
    x = torch.tensor(values, dtype=torch.float32).to(nc.TORCH_DTYPES[dtype])
    payload, scale = ref.mx_quantize(x)
    _assert_same_mx(x, payload, scale, f"hypothesis {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_resolve_matches_independent_ref(dtype: str) -> None:
    rng = np.random.default_rng(99)
    for trial in range(25):
        rows_total, cols_total = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        bn, bk = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        codes = rng.integers(0, 256, size=(rows_total, cols_total), dtype=np.uint8)
        tiles = (-(-rows_total // bn), -(-cols_total // bk))
        scale = np.ldexp(rng.random(tiles) + 0.5, rng.integers(-140, 20, size=tiles))
        scale = scale.astype(np.float32)
        r0 = int(rng.integers(0, rows_total))
        r1 = int(rng.integers(r0 + 1, rows_total + 1))
        c0 = int(rng.integers(0, cols_total))
        c1 = int(rng.integers(c0 + 1, cols_total + 1))
        tile_slice = scale[r0 // bn : (r1 - 1) // bn + 1, c0 // bk : (c1 - 1) // bk + 1]
        out = ref.resolve_block(
            torch.from_numpy(np.ascontiguousarray(codes[r0:r1, c0:c1])).view(torch.float8_e4m3fn),
            torch.from_numpy(np.ascontiguousarray(tile_slice)),
            row0=r0,
            col0=c0,
            block_n=bn,
            block_k=bk,
            dtype=nc.TORCH_DTYPES[dtype],
        )
        want = ir.resolve_ref_bits(
            codes[r0:r1, c0:c1], scale, row0=r0, col0=c0, block_n=bn, block_k=bk, dtype=dtype
        )
        got = np.asarray(nc.float_bits(out, dtype), dtype=np.int64)
        got_nan = torch.isnan(out.float()).numpy()
        want_nan = np.isnan(ir.E4M3_TABLE[codes[r0:r1, c0:c1]])
        same = (got == want.astype(np.int64)) | (got_nan & want_nan)
        assert bool(same.all()), f"trial {trial}: differs at {np.argwhere(~same)[:5].tolist()}"


def test_resolve_mx_is_dequantize_then_one_rounding() -> None:
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, size=(4, 64), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(4, 2), dtype=np.uint8)
    want_f32 = ir.mx_dequantize_ref(codes, scales)
    got = ref.resolve_mx(
        torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales), torch.bfloat16
    )
    got_bits = np.asarray(nc.float_bits(got, "bf16"))
    want_bits = ir.f32_to_bf16_bits(want_f32)
    same = (got_bits == want_bits) | (np.isnan(want_f32) & torch.isnan(got.float()).numpy())
    assert bool(same.all())


# --- sharding commutes with resolve and quantize --------------------------------------------


def test_resolve_sharding_commutes() -> None:
    rng = np.random.default_rng(7)
    rows_total, cols_total, bn, bk = 37, 300, 8, 128
    codes = rng.integers(0, 0x7F, size=(rows_total, cols_total), dtype=np.uint8)
    codes |= rng.integers(0, 2, size=codes.shape, dtype=np.uint8) << 7
    tiles = (-(-rows_total // bn), -(-cols_total // bk))
    scale = torch.from_numpy(np.ldexp(rng.random(tiles) + 0.5, rng.integers(-10, 10, tiles)))
    scale = scale.to(torch.float32)
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    whole = ref.resolve_block(
        w, scale, row0=0, col0=0, block_n=bn, block_k=bk, dtype=torch.bfloat16
    )
    # Tile-misaligned row and column ranges, the kind TP sharding of odd sizes produces.
    for r0, r1, c0, c1 in [(0, 37, 0, 300), (3, 21, 5, 133), (9, 10, 127, 129), (31, 37, 250, 300)]:
        part = ref.resolve_block(
            w[r0:r1, c0:c1],
            scale[r0 // bn : (r1 - 1) // bn + 1, c0 // bk : (c1 - 1) // bk + 1],
            row0=r0,
            col0=c0,
            block_n=bn,
            block_k=bk,
            dtype=torch.bfloat16,
        )
        assert torch.equal(part.view(torch.int16), whole[r0:r1, c0:c1].view(torch.int16))


def test_quantize_sharding_commutes() -> None:
    rng = np.random.default_rng(8)
    x = _random_scaled(rng, (24, 320), "bf16")
    payload, scale = ref.mx_quantize(x)
    # Row ranges are arbitrary; column ranges must be 32-aligned (MX groups), not 128-aligned.
    for r0, r1, c0, c1 in [(0, 24, 0, 320), (5, 17, 32, 160), (23, 24, 288, 320), (1, 9, 96, 224)]:
        p_part, s_part = ref.mx_quantize(x[r0:r1, c0:c1])
        assert torch.equal(p_part.view(torch.uint8), payload[r0:r1, c0:c1].view(torch.uint8))
        assert torch.equal(s_part, scale[r0:r1, c0 // 32 : c1 // 32])


def test_quantize_noncontiguous_input_and_no_mutation() -> None:
    rng = np.random.default_rng(9)
    x = _random_scaled(rng, (64, 96), "fp32")
    before = x.clone()
    xt = x.t().contiguous().t()  # same values, column-major strides
    p1, s1 = ref.mx_quantize(x)
    p2, s2 = ref.mx_quantize(xt)
    assert torch.equal(p1.view(torch.uint8), p2.view(torch.uint8)) and torch.equal(s1, s2)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


# --- bad input ------------------------------------------------------------------------------


def test_quantize_refuses_ragged_k_and_bad_dtype() -> None:
    with pytest.raises(NumericsError, match="multiple of 32"):
        ref.mx_quantize(torch.zeros(2, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError):  # NumericsError is also a ValueError
        ref.mx_quantize(torch.zeros(40))
    with pytest.raises(NumericsError, match="dtype"):
        ref.mx_quantize(torch.zeros(32, dtype=torch.float64))


def test_resolve_refuses_wrong_tile_count() -> None:
    w = torch.zeros(5, 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    # rows [3, 8) with block 4 span tiles 0..1; a ceil-based caller would pass only 1 row.
    with pytest.raises(NumericsError, match="2x2 tiles"):
        ref.resolve_block(
            w, torch.ones(1, 2), row0=3, col0=0, block_n=4, block_k=4, dtype=torch.bfloat16
        )
    with pytest.raises(NumericsError, match="dtype"):
        ref.resolve_block(
            w, torch.ones(2, 2), row0=3, col0=0, block_n=4, block_k=4, dtype=torch.int8
        )


@pytest.mark.parametrize(
    ("bad", "allowed_with_flag"),
    [
        (float("nan"), True),
        (float("inf"), True),
        (float("-inf"), False),
        (0.0, False),
        (-0.0, False),
        (-2.0, False),
    ],
)
def test_check_block_scales(bad: float, allowed_with_flag: bool) -> None:
    scale = torch.ones(3, 4)
    scale[2, 1] = bad
    scale[2, 3] = bad
    kwargs = {"tensor": "model.layers.0.mlp.down_proj.weight_scale_inv", "file": "m-1.safetensors"}
    with pytest.raises(NonFiniteScale) as info:
        ref.check_block_scales(scale, tile_row0=10, tile_col0=20, allow_nonfinite=False, **kwargs)
    err = info.value
    # The first bad entry in row-major order, at its GLOBAL tile index.
    assert err.tile == (12, 21)
    assert err.tensor == kwargs["tensor"] and err.file == kwargs["file"]
    assert "(12, 21)" in str(err) and kwargs["tensor"] in str(err) and kwargs["file"] in str(err)
    assert pickle.loads(pickle.dumps(err)).tile == (12, 21)
    if allowed_with_flag:
        ref.check_block_scales(scale, tile_row0=10, tile_col0=20, allow_nonfinite=True, **kwargs)
    else:
        with pytest.raises(NonFiniteScale):
            ref.check_block_scales(
                scale, tile_row0=10, tile_col0=20, allow_nonfinite=True, **kwargs
            )


def test_check_block_scales_accepts_good_and_subnormal_scales() -> None:
    scale = torch.tensor([[1.0, 2.0**-140], [3.0e38, 0.5]], dtype=torch.float32)
    ref.check_block_scales(
        scale, tensor="t", file="f", tile_row0=0, tile_col0=0, allow_nonfinite=False
    )
