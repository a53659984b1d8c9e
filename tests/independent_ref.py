"""A second, test-side implementation of docs/contract.md §2, written from the SPEC in numpy.

It shares no code with ``mxload.workers.numerics`` and takes a different route on purpose:
- E4M3 rounding searches the table of all 256 E4M3 values (decoded from the format's
  definition: bias 7, 3 mantissa bits, ``S.1111.111`` is NaN, no infinities) for the
  nearest one, breaking ties towards the even code;
- exponents come from ``math.frexp``-style decomposition of exact float64 values
  (``np.frexp``), not from float32 bit fields;
- scaling is exact float64 ``ldexp`` (the SPEC's f32 product is exact wherever the E4M3
  result is not ±0);
- bf16 rounding is done on float32 bit patterns by hand (round half to even);
- ``scale_alg=1`` scales follow the operator's documented steps on exact rationals
  (``fractions.Fraction``: ``amax / 448`` rounded to float32 by hand, then its exponent and
  mantissa), not the production code's closed form on bit fields.

Inputs are numpy float64 arrays holding the exact values of the bf16/fp16/fp32 tensors
(tests convert with ``tensor.to(torch.float64).numpy()``, which is exact), so this module
needs no torch.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

GROUP = 32
E4M3_NAN_CODE = 0x7F


def e4m3_value(code: int) -> float:
    """The value of one E4M3 (``float8_e4m3fn``) byte, from the format's definition."""
    sign = -1.0 if code & 0x80 else 1.0
    exp_field = (code >> 3) & 0xF
    mant = code & 0x7
    if exp_field == 0xF and mant == 0x7:
        return float("nan")
    if exp_field == 0:
        return sign * (mant / 8.0) * 2.0**-6
    return sign * (1.0 + mant / 8.0) * 2.0 ** (exp_field - 7)


E4M3_TABLE: np.ndarray = np.array([e4m3_value(c) for c in range(256)], dtype=np.float64)
"""Value of every byte 0..255."""

_POS_CODES = np.arange(0, 0x7F)  # 0x00 .. 0x7E: +0 .. +448, increasing
_POS_VALUES = E4M3_TABLE[_POS_CODES]
if not np.all(np.diff(_POS_VALUES) > 0):  # sanity of the table itself
    raise RuntimeError("E4M3 table is not increasing over codes 0x00..0x7E")


def e4m3_rne_saturating(v: np.ndarray) -> np.ndarray:
    """Nearest E4M3 byte to each float64 in ``v``, ties to even code, |v| >= 448 -> ±448.

    NaN -> 0x7F. The sign of zero (and of values that round to zero) is kept.
    """
    v = np.asarray(v, dtype=np.float64)
    out = np.empty(v.shape, dtype=np.uint8)
    a = np.abs(v)
    nan = np.isnan(v)
    a_clean = np.where(nan, 0.0, np.minimum(a, 448.0))
    hi = np.searchsorted(_POS_VALUES, a_clean, side="left")  # first table value >= a
    hi = np.minimum(hi, len(_POS_VALUES) - 1)
    lo = np.maximum(hi - 1, 0)
    d_hi = _POS_VALUES[hi] - a_clean
    d_lo = a_clean - _POS_VALUES[lo]
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (_POS_CODES[lo] % 2 == 0))
    code = np.where(d_hi == 0, _POS_CODES[hi], np.where(pick_lo, _POS_CODES[lo], _POS_CODES[hi]))
    code = code | np.where(np.signbit(v), 0x80, 0)
    out[...] = np.where(nan, E4M3_NAN_CODE, code)
    return out


def biased_exponent(x: np.ndarray) -> np.ndarray:
    """Biased float32 exponent field of each (exactly f32-representable) float64 value.

    Inf/NaN -> 255; zero and f32 subnormals (|x| < 2**-126) -> 0; otherwise
    ``floor(log2|x|) + 127`` obtained exactly from ``frexp`` (|x| = m * 2**e, m in [0.5, 1)).
    """
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    a = np.where(finite, np.abs(x), 0.0)
    _, e = np.frexp(a)
    biased = np.where(a >= 2.0**-126, e - 1 + 127, 0)
    return np.where(finite, biased, 255).astype(np.int64)


def _f32_rne(q: Fraction) -> Fraction:
    """The float32 nearest to the positive rational ``q`` (ties to even), exactly; ``q`` is
    far below the float32 maximum here."""
    if q == 0:
        return q
    e = q.numerator.bit_length() - q.denominator.bit_length()  # 2**e <= q < 2**(e + 2)
    if Fraction(2) ** e > q:
        e -= 1
    ulp_exp = max(e, -126) - 23  # 24 significant bits, subnormals below 2**-126
    units = q / Fraction(2) ** ulp_exp
    n = math.floor(units)
    rest = units - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return n * Fraction(2) ** ulp_exp


def scale_byte_alg1(amax: float) -> int:
    """``npu_dynamic_mx_quant``'s ``scale_alg=1`` for one group, from its documented steps:
    ``S = Amax / 448`` rounded to float32; take its biased exponent ``E`` and mantissa
    ``M``; ``E + 1`` if ``S`` is normal, ``E < 254`` and ``M > 0``, or ``S`` is subnormal
    and ``M > 0.5``; else ``E``. Inf/NaN: 255."""
    if not math.isfinite(amax):
        return 255
    s = _f32_rne(Fraction(amax) / 448)
    if s >= Fraction(2) ** -126:
        e = s.numerator.bit_length() - s.denominator.bit_length()
        if Fraction(2) ** e > s:
            e -= 1
        biased = e + 127
        mantissa_nonzero = s != Fraction(2) ** e
        return biased + 1 if biased < 254 and mantissa_nonzero else biased
    fraction = s / Fraction(2) ** -126  # the subnormal's mantissa, in [0, 1)
    return 1 if fraction > Fraction(1, 2) else 0


def mx_quantize_ref(x: np.ndarray, scale_alg: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """docs/contract.md §2.2 for the exact values ``x`` ``[..., K]``: (payload bytes, scale
    bytes). ``scale_alg`` 1: the scale of :func:`scale_byte_alg1`, every group scaled by
    ``2**(127 - S)`` (no zero group at ``S = 0``)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] % GROUP:
        raise ValueError("K must be a multiple of 32")
    lead = x.shape[:-1]
    groups = x.reshape(*lead, x.shape[-1] // GROUP, GROUP)
    if scale_alg == 1:
        amax = np.abs(groups).max(axis=-1)  # NaN propagates
        s = np.vectorize(lambda a: scale_byte_alg1(float(a)), otypes=[np.int64])(amax)
    else:
        emax = biased_exponent(groups).max(axis=-1)
        s = np.where(emax == 255, 255, np.maximum(emax, 8) - 8)
    scaled = np.ldexp(
        np.where(np.isfinite(groups), groups, 0.0), (127 - np.where(s == 255, 0, s))[..., None]
    )
    payload = e4m3_rne_saturating(scaled)
    zero_group = ((s == 0) & (scale_alg == 0))[..., None]
    signed_zero = np.where(np.signbit(groups), 0x80, 0x00).astype(np.uint8)
    payload = np.where(zero_group, signed_zero, payload)
    payload = np.where((s == 255)[..., None], E4M3_NAN_CODE, payload).astype(np.uint8)
    return payload.reshape(x.shape), s.astype(np.uint8)


def mx_dequantize_ref(payload: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``f32(y) * 2**(S - 127)`` as float32; S = 255 -> NaN."""
    payload = np.asarray(payload, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.int64)
    y = E4M3_TABLE[payload].reshape(*payload.shape[:-1], -1, GROUP)
    exact = np.ldexp(y, (scale - 127)[..., None])
    exact = np.where((scale == 255)[..., None], np.nan, exact)
    with np.errstate(over="ignore"):
        return exact.astype(np.float32).reshape(payload.shape)


def f32_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (half to even) and return the 16-bit patterns."""
    u = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(v, dtype=np.float32))
    lsb = (u >> 16) & 1
    rounded = ((u + 0x7FFF + lsb) >> 16) & 0xFFFF
    quiet_nan = ((u >> 16) | 0x0040) & 0xFFFF
    return np.where(nan, quiet_nan, rounded).astype(np.uint16)


def resolve_ref_bits(
    w_codes: np.ndarray,
    scale_full: np.ndarray,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: str,
) -> np.ndarray:
    """docs/contract.md §2.1 for rows/cols starting at (row0, col0), as bit patterns of ``dtype``.

    ``scale_full`` is the WHOLE scale tensor of the source (tiles indexed globally), so
    this never depends on how a caller slices it. Returns uint16 for bf16/fp16, uint32
    for fp32.
    """
    w_codes = np.asarray(w_codes, dtype=np.uint8)
    rows = np.arange(row0, row0 + w_codes.shape[0]) // block_n
    cols = np.arange(col0, col0 + w_codes.shape[1]) // block_k
    s = np.asarray(scale_full, dtype=np.float32).astype(np.float64)[np.ix_(rows, cols)]
    with np.errstate(over="ignore", invalid="ignore"):
        exact = E4M3_TABLE[w_codes] * s  # exact in float64: 4 x 24 significant bits
        product_f32 = exact.astype(np.float32)  # the SPEC's f32 product (one RNE)
        if dtype == "fp32":
            return product_f32.view(np.uint32)
        if dtype == "fp16":
            return product_f32.astype(np.float16).view(np.uint16)
    if dtype == "bf16":
        return f32_to_bf16_bits(product_f32)
    raise ValueError(dtype)


def same_e4m3_bytes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise byte equality where the two E4M3 NaN bytes 0x7F and 0xFF are equal."""
    a = np.asarray(a, dtype=np.uint8)
    b = np.asarray(b, dtype=np.uint8)
    a_nan = (a & 0x7F) == 0x7F
    b_nan = (b & 0x7F) == 0x7F
    return (a == b) | (a_nan & b_nan)
