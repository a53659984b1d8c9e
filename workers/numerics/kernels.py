"""The numba kernels of the fast CPU conversion path, on numpy arrays only (no torch).

The byte-exact kernels behind :mod:`.fast` (block-FP8 -> resolve -> MXFP8 in one pass,
docs/contract.md §2), with a numpy API, :func:`convert` and :func:`resolve`, that
``mxload convert`` calls without importing torch. Both are held to the reference and the
named case table by ``tests/unit/test_numerics_fast.py``.

Why numba and tables
    * Rearranged torch ops stay memory-bound (every elementwise op is a pass over
      temporaries; a table gather needs an index tensor per element). A compiled loop
      reads each source byte once and keeps the rest in registers; numba gives threads,
      an on-disk compile cache and GIL-free calls (reads overlap conversion).
    * The source is FP8: a byte, and one scale per tile. So ``R = to_dtype(f32(w) * s)``
      is a 128-entry table per tile (the sign is ``(w & 0x80) ^ sign(s)``: IEEE products
      and RNE are sign-symmetric). MX quantization is monotone: |R| never decreases as
      ``w & 0x7F`` grows (rounding is monotone, e4m3fn bytes 0x00..0x7E are ordered by
      magnitude, 0x7F is NaN, NaN and Inf have exponent field 255), so a group's Emax is
      the table's running-max exponent at the group's largest ``w & 0x7F``: a byte max
      over 32 bytes, done 8 bytes per word (SWAR). The payload then depends only on
      ``(w, S)``: a 256-entry table per (tile, S) that occurs. The hot loop is a
      word-wise max per group and one table lookup per byte.
    * Exactness does not depend on the FPU mode. Table entries come from the hardware
      float32 multiply only where its result is a normal float (then it is the IEEE RNE
      product whatever flush-to-zero / denormals-are-zero say); zero, subnormal and
      non-finite products, and non-normal scales, take an integer routine
      (``_round_pack``), as does every other rounding (bf16/fp16 RNE, e4m3 RNE with
      subnormals and the 448 clamp). No value is ever scaled by 2**(127 - S) in floating
      point, so 2**(127 - 254) being an f32 subnormal cannot matter.
    * ``mx_quantize`` of a bf16/fp32 tensor (a BF16 reload, §4) has too many possible
      inputs for tables: groups whose non-zero elements all land in the e4m3 normal range
      take a branch-free formula (RNE drop of the low mantissa bits, whose carry bumps
      the exponent; rebias; clamp), other groups the exact integer routine. fp16 is
      widened to fp32 first (exact; §2.2 defines fp16's Emax on that value).
    * Loop shapes: work items walk whole source rows in memory order; hot loops index
      with unsigned integers (numba then drops its negative-index fix-up); a work item
      builds all its payload tables before its lookups, so the hot loop has no branch,
      allocation or reference counting; the packed path converts rows into a buffer
      whose row stride is padded off 4 KiB, then transposes 16x16 bytes in vector registers
      (LLVM shuffles through a numba intrinsic: numba has no vector shuffles).

Threads
    Each launch names its thread count (capped by ``NUMBA_NUM_THREADS``): :mod:`.fast`
    passes ``torch.get_num_threads()`` (a Ray worker's share of the cores), ``mxload
    convert`` passes :func:`cpu_share`. Launches are serialized by :data:`LOCK`: numba's
    ``workqueue`` layer aborts the process on concurrent launches, and a launch already
    uses all of the worker's threads. With the OpenMP layer a process must not ``fork``
    after its first launch (Ray starts workers fresh).

Compilation
    ``cache=True``: the first process compiles and writes numba's cache next to this file
    (or under ``NUMBA_CACHE_DIR``); later processes, such as each Ray worker, load it.
    Compilation happens in :func:`available`, which also runs every kernel on a tiny
    input with bytes derived by hand and returns False (never raises) when numba is
    missing or anything fails; callers then use the reference.

Limits: CPU memory only; MX quantization needs ``K % 32 == 0`` (§2.2); a group that
straddles two scale tiles (a slice starting mid-tile) takes a slow per-element path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import numpy as np

from ...orchestrator.errors import NumericsError
from ...orchestrator.plan.formats import MX_GROUP, ceil_div

log = logging.getLogger(__name__)

try:  # numba is a dependency, but the reference must keep working without it.
    import numba
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba import prange, types
    from numba.extending import intrinsic

    _NUMBA_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - exercised by loading a copy without numba
    numba = None  # type: ignore[assignment]
    _NUMBA_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    prange = range  # type: ignore[misc]

_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(
    *, parallel: bool = False, inline: Literal["never", "always"] = "never"
) -> Callable[[_F], _F]:
    """numba's ``njit`` with the on-disk cache and without the GIL; without numba the
    function stays plain Python (never called: :func:`available` says False)."""

    def wrap(f: _F) -> _F:
        if numba is None:
            return f
        return cast(_F, numba.njit(cache=True, nogil=True, parallel=parallel, inline=inline)(f))

    return wrap


# Output-dtype modes shared by the kernels (ints: numba kernels take no dtypes objects).
MODE_BF16 = 0
MODE_FP16 = 1
MODE_FP32 = 2
MODE_OF: dict[str, int] = {"bf16": MODE_BF16, "fp16": MODE_FP16, "fp32": MODE_FP32}
"""Model dtype name (config.json's ``torch_dtype``, as ``mxload.orchestrator.plan.config`` names it)
-> kernel mode."""


# =========================================================================================
# Scalar integer routines (exact, FTZ/DAZ-proof). All values are int64.
# =========================================================================================


@_jit()
def _bitlen(v: int) -> int:
    """Number of significant bits of an int in [0, 2**63) (0 for 0); a binary search,
    since the table builders call it per entry."""
    n = 0
    if v >= np.int64(1) << 32:
        v >>= 32
        n += 32
    if v >= 1 << 16:
        v >>= 16
        n += 16
    if v >= 1 << 8:
        v >>= 8
        n += 8
    if v >= 1 << 4:
        v >>= 4
        n += 4
    if v >= 1 << 2:
        v >>= 2
        n += 2
    if v >= 1 << 1:
        v >>= 1
        n += 1
    return n + v


@_jit()
def _round_pack(sig: int, e2: int, p: int, bias: int, inf_field: int) -> int:
    """Round the non-negative value ``sig * 2**e2`` to nearest-even in a binary format
    with ``p`` significand bits (hidden bit included) and exponent ``bias``, subnormals
    included; return its magnitude bits (exponent field << (p-1) | mantissa). A result
    whose exponent field reaches ``inf_field`` becomes Inf (that field, mantissa 0); pass
    a large ``inf_field`` for a saturating format and clamp afterwards."""
    if sig == 0:
        return 0
    lead = e2 + _bitlen(sig) - 1  # unbiased exponent of the leading bit
    emin = 1 - bias
    lc = lead if lead > emin else emin
    qe = lc - (p - 1)  # exponent of one unit in the last place
    shift = qe - e2
    if shift > 0:
        if shift > 62:
            q = 0  # sig < 2**62 <= half an ulp: rounds to zero
        else:
            q = sig >> shift
            rem = sig - (q << shift)
            half = np.int64(1) << (shift - 1)
            if rem > half or (rem == half and (q & 1) == 1):
                q += 1
    else:
        q = sig << (-shift)
    # Subnormal: field 0 and q is the mantissa; a carry to 2**(p-1) is exactly the
    # smallest normal. Normal: q = 2**(p-1) + mantissa, and a carry to 2**p bumps the
    # exponent. Both are this one sum.
    bits = ((lc + bias - 1) << (p - 1)) + q
    if (bits >> (p - 1)) >= inf_field:
        bits = inf_field << (p - 1)
    return bits


@_jit()
def _f32_split(b: int) -> tuple[int, int]:
    """Finite f32 magnitude bits -> (sig, e2) with value sig * 2**e2, exactly."""
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    if e == 0:
        return m, -149
    return m | 0x800000, e - 150


@_jit()
def _f32_to_bf16(b: int) -> int:
    """f32 bits -> bf16 bits, round-to-nearest-even (overflow to Inf), NaN stays NaN."""
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return ((b >> 16) & 0x8000) | 0x7FC0
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@_jit()
def _f32_to_f16(b: int) -> int:
    """f32 bits -> f16 bits, round-to-nearest-even, overflow to Inf, NaN stays NaN."""
    sign = (b >> 16) & 0x8000
    mag = b & 0x7FFFFFFF
    if mag > 0x7F800000:
        return sign | 0x7E00
    e = mag >> 23
    if 113 <= e <= 142:
        # f16-normal exponent: rebias 127 -> 15 and drop 13 bits with RNE; a carry out
        # of 65504 lands exactly on Inf (0x7C00), which is RNE's overflow.
        return sign | ((mag - (112 << 23) + 0xFFF + ((mag >> 13) & 1)) >> 13)
    if mag == 0x7F800000:
        return sign | 0x7C00
    sig, e2 = _f32_split(mag)
    return sign | _round_pack(sig, e2, 11, 15, 31)


@_jit()
def _f16_to_f32(h: int) -> int:
    """f16 bits -> the f32 bits of the same value (exact)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:
        return sign | 0x7F800000 | (m << 13)
    if e == 0:
        if m == 0:
            return sign
        return sign | _round_pack(m, -24, 24, 127, 255)  # exact: 11 bits fit in 24
    return sign | ((e + 112) << 23) | (m << 13)


@_jit()
def _product_f32(wb: int, sb: int) -> int:
    """f32 bits of ``f32(w) * s`` as IEEE float32 computes it (RNE, gradual underflow),
    in integer arithmetic. ``wb``: e4m3fn byte; ``sb``: f32 bits of the scale."""
    sign = ((wb >> 7) ^ (sb >> 31)) & 1
    se = (sb >> 23) & 0xFF
    w_zero = (wb & 0x7F) == 0
    if (wb & 0x7F) == 0x7F or (se == 255 and ((sb & 0x7FFFFF) != 0 or w_zero)):
        return 0x7FC00000  # NaN operand, or 0 * Inf
    if se == 255:
        return (sign << 31) | 0x7F800000
    we = (wb >> 3) & 0xF
    if we == 0:
        wsig = wb & 0x7
        we2 = -9
    else:
        wsig = (wb & 0x7) | 8
        we2 = we - 10
    ssig, se2 = _f32_split(sb & 0x7FFFFFFF)
    return (sign << 31) | _round_pack(wsig * ssig, we2 + se2, 24, 127, 255)


@_jit()
def _to_mode(r32: int, mode: int) -> int:
    """f32 bits -> model-dtype bits (one RNE rounding, docs/contract.md §2.1)."""
    if mode == 0:
        return _f32_to_bf16(r32)
    if mode == 1:
        return _f32_to_f16(r32)
    return r32


@_jit()
def _as_f32_bits(r: int, mode: int) -> int:
    """Model-dtype bits -> f32 bits of the same value (exact)."""
    if mode == 0:
        return r << 16
    if mode == 1:
        return _f16_to_f32(r)
    return r


@_jit()
def _resolve_table(
    sb: int, s_abs: np.float32, mode: int, w_f32: np.ndarray, prod: np.ndarray, out: np.ndarray
) -> None:
    """``out[b]`` = model-dtype bits of ``to_dtype(f32(w) * |s|)`` for the 128 E4M3
    magnitudes ``b`` (docs/contract.md §2.1; the sign is ``(b & 0x80) ^ sign(s)``, see the module
    docstring). For a normal scale the hardware float32 multiply is used wherever its
    result is a normal float (exact IEEE RNE under any FTZ/DAZ setting); a zero,
    subnormal or non-finite result, or a non-normal scale, goes to the integer routine.
    ``prod`` is float32 scratch of 128 entries; ``w_f32`` the 128 E4M3 values."""
    se = (sb >> 23) & 0xFF
    mag_sb = sb & 0x7FFFFFFF
    pbits = prod.view(np.uint32)
    if 1 <= se <= 254:
        for b in range(128):
            prod[b] = w_f32[b] * s_abs
    for b in range(128):
        x = np.int64(pbits[b]) if 1 <= se <= 254 else 0
        e = (x >> 23) & 0xFF
        if e == 0 or e == 255:
            x = _product_f32(b, mag_sb)
        out[b] = _to_mode(x, mode)  # type: ignore[arg-type]


@_jit()
def _scale_byte(emax: int) -> int:
    """docs/contract.md §2.2 step 2."""
    if emax == 255:
        return 255
    return (emax if emax > 8 else 8) - 8


@_jit()
def _scale_byte_alg1(amag: int) -> int:
    """docs/contract.md §2.2 with ``scale_alg=1`` from the f32 magnitude bits of a group's
    amax: the biased exponent of ``Q = RNE_f32(amax / 448)``, rounded up. For a normal
    ``Q`` (amax >= 1.75 * 2**-118) that is ``e - 8``, plus one when amax's mantissa is above
    1.75's (0x600000); below, 1 when amax exceeds ``448 * (2**23 + 1) * 2**-150`` (``Q``'s
    subnormal mantissa above one half), else 0."""
    e = amag >> 23
    if e == 255:
        return 255
    m = amag & 0x7FFFFF
    if amag >= ((9 << 23) | 0x600000):
        return e - 8 + (1 if m > 0x600000 else 0)
    units = m if e == 0 else (m | 0x800000) << (e - 1)
    return 1 if units > 224 * (0x800000 + 1) else 0


@_jit()
def _quant_e4m3_scaled(xb: int, s: int) -> int:
    """e4m3fn byte of f32 bits ``xb`` times ``2**(127 - s)`` for ``0 <= s <= 254``, RNE,
    subnormals included, saturating at +-448 (``s = 0`` scales by 2**127)."""
    sign = (xb >> 24) & 0x80
    mag = xb & 0x7FFFFFFF
    if mag >= 0x7F800000:  # cannot happen when s < 255 (Emax would be 255); be total
        return 0x7F
    sig, e2 = _f32_split(mag)
    y = _round_pack(sig, e2 + 127 - s, 4, 7, 1 << 30)
    if y > 0x7E:
        y = 0x7E  # clamp to 448 (0x7F is NaN in e4m3fn)
    return sign | y


@_jit()
def _quant_e4m3(xb: int, s: int) -> int:
    """docs/contract.md §2.2 step 3 for one element: f32 bits ``xb`` and scale byte ``s`` -> e4m3fn
    byte of ``xb * 2**(127 - s)``, RNE, subnormals included, saturating at +-448."""
    if s == 255:
        return 0x7F
    if s == 0:
        return (xb >> 24) & 0x80
    return _quant_e4m3_scaled(xb, s)


@_jit()
def _payload_table(r32: np.ndarray, s: int, sflip: int, out: np.ndarray) -> None:
    """``out[b]`` = e4m3 byte for source byte ``b`` (0..255) of a tile whose resolved
    magnitudes are ``r32`` (f32 bits) and whose scale has sign bit ``sflip`` (0 or 0x80),
    under group scale byte ``s``.

    Entries whose exponent lands in the e4m3 normal range take the short formula (RNE
    drop of 20 mantissa bits, whose carry bumps the exponent, then a rebias from
    ``127 - s`` to e4m3's 7, then the 448 clamp); the rest take :func:`_quant_e4m3`.
    The sign is ``(b & 0x80) ^ sflip``: IEEE products and RNE are sign-symmetric."""
    if s == 0 or s == 255:
        v = 0 if s == 0 else 0x7F
        for b in range(128):
            out[b] = v | sflip
            out[b | 128] = v | (sflip ^ 0x80)
        return
    lim = s - 6 if s > 7 else 1
    reb = (s - 7) << 3
    for b in range(128):
        x = r32[b]
        if (x >> 23) >= lim and x < 0x7F800000:
            v = ((x + 0x7FFFF + ((x >> 20) & 1)) >> 20) - reb
            v = v if v < 0x7E else 0x7E
        else:
            v = _quant_e4m3(x, s)
        out[b] = v | sflip
        out[b | 128] = v | (sflip ^ 0x80)


_SWAR_HI = np.uint64(0x8080808080808080)
_SWAR_7F = np.uint64(0x7F7F7F7F7F7F7F7F)


@_jit(inline="always")
def _swar_max7(a: np.uint64, b: np.uint64) -> np.uint64:
    """Byte-wise max of two words whose bytes are all < 0x80 (a guard bit per byte keeps
    the subtraction from borrowing across bytes)."""
    ge = ((a | _SWAR_HI) - b) & _SWAR_HI  # 0x80 in every byte where a >= b
    m = (ge >> np.uint64(7)) * np.uint64(0xFF)
    return (a & m) | (b & ~m)


@_jit(inline="always")
def _group_absmax(w64: np.ndarray, i: int) -> int:
    """max(byte & 0x7F) over the 32 bytes of words ``w64[i : i + 4]``."""
    u = np.uint64(i)
    x = _swar_max7(
        _swar_max7(w64[u] & _SWAR_7F, w64[u + np.uint64(1)] & _SWAR_7F),
        _swar_max7(w64[u + np.uint64(2)] & _SWAR_7F, w64[u + np.uint64(3)] & _SWAR_7F),
    )
    x = _swar_max7(x, x >> np.uint64(32))
    x = _swar_max7(x, x >> np.uint64(16))
    x = _swar_max7(x, x >> np.uint64(8))
    return np.int64(x & np.uint64(0xFF))  # type: ignore[return-value]


@_jit()
def _tile_range(t: int, base: int, block: int, n: int) -> tuple[int, int]:
    """Local ``[lo, hi)`` of the elements of global tile ``t`` in a slice starting at
    global index ``base`` with ``n`` elements."""
    lo = t * block - base
    hi = lo + block
    if lo < 0:
        lo = 0
    if hi > n:
        hi = n
    return lo, hi


@_jit()
def _e4m3_values() -> np.ndarray:
    """float32 values of the E4M3 magnitudes 0..127 (0x7F is NaN)."""
    v = np.empty(128, dtype=np.float32)
    for b in range(128):
        e = b >> 3
        m = b & 7
        if b == 0x7F:
            v[b] = np.float32(np.nan)
        elif e == 0:
            v[b] = np.float32(m * 2.0**-9)
        else:
            v[b] = np.float32((8 + m) * 2.0 ** (e - 10))
    return v


@_jit(parallel=True)
def _tile_tables(
    sbits: np.ndarray, sf: np.ndarray, mode: int, r_bits: np.ndarray, s_tab: np.ndarray
) -> None:
    """Per tile ``t = ti * TJ + tj``: ``r_bits[t, b]`` = model-dtype bits of the resolved
    magnitude ``b`` (0..127) and, when ``s_tab`` has rows, ``r_bits`` is turned into the
    f32 bits of that value and ``s_tab[t, b]`` is the scale byte (docs/contract.md §2.2 step 2) of
    the running max of their exponent fields: a group's Emax is that running max at the
    group's largest magnitude byte (module docstring)."""
    n_tc = sbits.shape[1]
    w_f32 = _e4m3_values()
    with_emax = s_tab.shape[0] > 0
    for t in prange(sbits.shape[0] * n_tc):
        ti = t // n_tc
        tj = t % n_tc
        prod = np.empty(128, dtype=np.float32)
        row = r_bits[t]
        _resolve_table(np.int64(sbits[ti, tj]), abs(sf[ti, tj]), mode, w_f32, prod, row)  # type: ignore[arg-type]
        if with_emax:
            run = 0
            for b in range(128):
                x = _as_f32_bits(row[b], mode)
                row[b] = x
                run = max(run, (x >> 23) & 0xFF)
                s_tab[t, b] = _scale_byte(run)


@_jit()
def _row_chunks(n: int, row0: int, bn: int, rows_per_item: int) -> np.ndarray:
    """Split local rows [0, n) into chunks of at most ``rows_per_item`` rows that never
    cross a tile-row boundary; returns [n_items, 2] of (lo, hi)."""
    t_r0 = row0 // bn
    n_tr = (row0 + n - 1) // bn - t_r0 + 1
    count = 0
    for i in range(n_tr):
        lo, hi = _tile_range(t_r0 + i, row0, bn, n)
        count += (hi - lo + rows_per_item - 1) // rows_per_item
    out = np.empty((count, 2), dtype=np.int64)
    j = 0
    for i in range(n_tr):
        lo, hi = _tile_range(t_r0 + i, row0, bn, n)
        while lo < hi:
            out[j, 0] = lo
            out[j, 1] = min(hi, lo + rows_per_item)
            lo = out[j, 1]
            j += 1
    return out


@_jit(parallel=True)
def _resolve_kernel(
    w: np.ndarray,  # uint8 [n * k], row-major
    n: int,
    k: int,
    sbits: np.ndarray,  # uint32 [TI, TJ], f32 bits of the covering tiles
    sf: np.ndarray,  # float32 view of the same
    row0: int,
    col0: int,
    bn: int,
    bk: int,
    mode: int,
    out: np.ndarray,  # uint16 or uint32 [n * k]
    rows_per_item: int,
) -> None:
    n_tc = sbits.shape[1]
    half = np.empty((sbits.shape[0] * n_tc, 128), dtype=np.int64)
    _tile_tables(sbits, sf, mode, half, np.empty((0, 128), dtype=np.uint8))
    # Full 256-entry tables: the sign of an IEEE product is sign(w) ^ sign(s), and RNE is
    # symmetric, so entry b | 0x80 is entry b with the sign bit flipped.
    neg = 0x80000000 if mode == 2 else 0x8000
    tables = np.empty((half.shape[0], 256), dtype=out.dtype)
    for t in range(half.shape[0]):
        sflip = neg if sbits[t // n_tc, t % n_tc] >> 31 else 0
        for b in range(128):
            tables[t, b] = half[t, b] | sflip
            tables[t, b | 128] = half[t, b] | (sflip ^ neg)
    t_r0 = row0 // bn
    t_c0 = col0 // bk
    chunks = _row_chunks(n, row0, bn, rows_per_item)
    for it in prange(chunks.shape[0]):
        ti = (row0 + chunks[it, 0]) // bn - t_r0
        for r in range(chunks[it, 0], chunks[it, 1]):
            base = r * k
            for tj in range(n_tc):
                c_lo, c_hi = _tile_range(t_c0 + tj, col0, bk, k)
                tab = tables[ti * n_tc + tj]
                for c in range(base + c_lo, base + c_hi):
                    uc = np.uint64(c)  # unsigned: no negative-index fix-up
                    out[uc] = tab[w[uc]]


@_jit()
def _split_group(
    w: np.ndarray,
    base: int,
    c0: int,
    ti: int,
    sbits: np.ndarray,
    col0: int,
    bk: int,
    r32: np.ndarray,
    xs: np.ndarray,
) -> int:
    """A group that straddles two scale tiles (a slice that starts mid-tile, docs/contract.md §2.1):
    the resolved f32 bits of its 32 elements into ``xs``, each from its own tile's
    table; returns the group's scale byte. Rare, so element by element."""
    n_tc = sbits.shape[1]
    t_c0 = col0 // bk
    emax = 0
    for i in range(32):
        tj = (col0 + c0 + i) // bk - t_c0
        b = np.int64(w[base + c0 + i])
        x = r32[ti * n_tc + tj, b & 0x7F]
        # The sign of R is sign(w) ^ sign(s) (module docstring).
        xs[i] = x | ((((b >> 7) ^ (np.int64(sbits[ti, tj]) >> 31)) & 1) << 31)
        emax = max(emax, (x >> 23) & 0xFF)
    return _scale_byte(emax)


@_jit()
def _convert_rows(
    w: np.ndarray,
    w64: np.ndarray,
    k: int,
    r_lo: int,
    r_hi: int,
    ti: int,
    sbits: np.ndarray,
    col0: int,
    bk: int,
    r32: np.ndarray,
    s_tab: np.ndarray,
    g_tile: np.ndarray,
    g_split: np.ndarray,
    dst: np.ndarray,
    d_stride: int,
    s_dst: np.ndarray,
) -> None:
    """Convert local rows ``[r_lo, r_hi)`` (all in tile row ``ti``): payload of (row r,
    column c) to ``dst[(r - r_lo) * d_stride + c]``, scale byte of (r, g) to
    ``s_dst[r - r_lo, g]``.

    Three steps: every group's scale byte (one word-wise max and a table read each);
    the payload tables of the (tile column, S) pairs that occur; then the payload, one
    lookup per byte. Knowing all tables before the lookups keeps the hot loop free of
    branches, allocation and reference counting (a pool grown inside it cost a third of
    the run time). A plain (not parallel) function, so its loops compile like C."""
    ng = k // 32
    n_tc = sbits.shape[1]
    xs = np.empty(32, dtype=np.int64)
    # 1. Scale bytes; mark the (tile column, S) pairs that need a payload table.
    slot = np.full((n_tc, 256), -1, dtype=np.int32)
    for r in range(r_lo, r_hi):
        base = r * k
        srow = s_dst[r - r_lo]
        for g in range(ng):
            if g_split[g]:
                srow[g] = _split_group(w, base, g * 32, ti, sbits, col0, bk, r32, xs)
            else:
                t = ti * n_tc + g_tile[g]
                s = s_tab[t, _group_absmax(w64, (base + g * 32) >> 3)]
                srow[g] = s
                slot[g_tile[g], s] = 0
    # 2. Those tables, 256 bytes each (sign included); slot[tj, S] becomes their offset.
    count = 0
    for tj in range(n_tc):
        for s in range(256):
            if slot[tj, s] == 0:
                slot[tj, s] = 256 * count + 1
                count += 1
    pool = np.empty(256 * count, dtype=np.uint8)
    for tj in range(n_tc):
        sflip = (np.int64(sbits[ti, tj]) >> 24) & 0x80
        for s in range(256):
            off = slot[tj, s] - 1
            if off >= 0:
                _payload_table(r32[ti * n_tc + tj], s, sflip, pool[off : off + 256])  # type: ignore[arg-type]
    # 3. Payload: unsigned indices, so numba skips its negative-index fix-up.
    for r in range(r_lo, r_hi):
        base = r * k
        d_row = (r - r_lo) * d_stride
        srow = s_dst[r - r_lo]
        for g in range(ng):
            c0 = g * 32
            if g_split[g]:
                s = _split_group(w, base, c0, ti, sbits, col0, bk, r32, xs)
                for i in range(32):
                    dst[d_row + c0 + i] = _quant_e4m3(xs[i], s)
            else:
                src = np.uint64(base + c0)
                d = np.uint64(d_row + c0)
                off = np.uint64(slot[g_tile[g], srow[g]] - 1)
                for i in range(32):
                    ui = np.uint64(i)
                    dst[d + ui] = pool[off + np.uint64(w[src + ui])]


def _interleave(width: int, high: bool) -> list[int]:
    """The shuffle mask that interleaves ``width``-byte fields of the low (or high) halves
    of two 16-byte vectors ``a`` and ``b`` (indices 0-15 into ``a``, 16-31 into ``b``)."""
    base = 8 if high else 0
    out: list[int] = []
    for j in range(0, 8, width):
        out += [base + j + i for i in range(width)] + [16 + base + j + i for i in range(width)]
    return out


_ROUNDS = tuple(
    (width, [(a, a + width) for a in range(16) if not a & width]) for width in (1, 2, 4, 8)
)
"""The four rounds of a 16x16 byte transpose: per round, the field width and the pairs of
vectors whose low and high halves interleave (a pair's two results take its places in
order: vectors ``2i`` and ``2i + 1`` of the next round). After the last, vector ``c``
holds column ``c``."""


def _columns16(builder: Any, rows: list[Any]) -> list[Any]:
    """Sixteen 16-byte row vectors -> the sixteen column vectors (the :data:`_ROUNDS`)."""
    for width, pairs in _ROUNDS:
        masks = [ir.Constant(ir.VectorType(ir.IntType(32), 16), _interleave(width, hi))
                 for hi in (False, True)]  # fmt: skip
        rows = [builder.shuffle_vector(rows[a], rows[b], m) for a, b in pairs for m in masks]
    return rows


def _transpose_codegen(
    context: Any, builder: Any, signature: Any, args: Any, *, row_blocks: int
) -> Any:
    """``row_blocks`` = 1: a 16x16 block, sixteen 16-byte stores. ``row_blocks`` = 4: 64
    rows x 16 columns, each output row one whole 64-byte line stored non-temporally."""
    src, s_off, s_stride, dst, d_off, d_stride = args
    i64 = types.int64
    s_off, s_stride, d_off, d_stride = (
        context.cast(builder, v, t, i64)
        for v, t in zip(
            (s_off, s_stride, d_off, d_stride),
            (signature.args[1], signature.args[2], signature.args[4], signature.args[5]),
            strict=True,
        )
    )
    s_data = context.make_array(signature.args[0])(context, builder, src).data
    d_data = context.make_array(signature.args[3])(context, builder, dst).data
    step = ir.IntType(64)

    def at(data: Any, off: Any, stride: Any, i: int, width: int) -> Any:
        where = builder.add(off, builder.mul(stride, ir.Constant(step, i)))
        to = ir.VectorType(ir.IntType(8), width).as_pointer()
        return builder.bitcast(builder.gep(data, [where]), to)

    blocks = [
        _columns16(builder, [builder.load(at(s_data, s_off, s_stride, 16 * q + r, 16), align=1)
                             for r in range(16)])
        for q in range(row_blocks)
    ]  # fmt: skip
    if row_blocks == 1:
        for c in range(16):
            builder.store(blocks[0][c], at(d_data, d_off, d_stride, c, 16), align=1)
        return context.get_dummy_value()
    halves = ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32)))
    whole = ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(64)))
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    for c in range(16):
        lo = builder.shuffle_vector(blocks[0][c], blocks[1][c], halves)
        hi = builder.shuffle_vector(blocks[2][c], blocks[3][c], halves)
        line = builder.shuffle_vector(lo, hi, whole)
        store = builder.store(line, at(d_data, d_off, d_stride, c, 64), align=64)
        store.set_metadata("nontemporal", nontemporal)
    return context.get_dummy_value()


def _transpose_typing(row_blocks: int) -> Callable[..., Any]:
    """The typing function of a transpose intrinsic of ``row_blocks`` 16-row blocks."""

    def typing(
        typingctx: Any, src: Any, s_off: Any, s_stride: Any, dst: Any, d_off: Any, d_stride: Any
    ) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return _transpose_codegen(context, builder, signature, args, row_blocks=row_blocks)

        return types.void(src, s_off, s_stride, dst, d_off, d_stride), codegen

    return typing


def _store_fence_typing(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


_transpose16: Any = intrinsic(_transpose_typing(1)) if numba is not None else None
"""``_transpose16(src, s_off, s_stride, dst, d_off, d_stride)`` in numba code: bytes
``src[s_off + r * s_stride + c]`` (r, c < 16) to ``dst[d_off + c * d_stride + r]`` as
sixteen 16-byte loads, four rounds of interleaving shuffles (``punpck*`` on x86,
``zip1``/``zip2`` on Arm) and sixteen stores. numba has no vector shuffles of its own;
LLVM's ``shufflevector`` is portable IR."""

_transpose64: Any = intrinsic(_transpose_typing(4)) if numba is not None else None
"""``_transpose64(...)``: as :func:`_transpose16` for 64 rows (r < 64), each output row's
64 bytes one aligned non-temporal store (``dst`` + ``d_off`` and ``d_stride`` must be
multiples of 64). Output that bypasses the cache skips reading every line before writing
it: a reload's buffers are gigabytes nobody reads until the engine runs. 1.5-3x the
GB/s of :func:`_transpose16` stores on cold buffers here (docs/numerics.md)."""

_store_fence: Any = intrinsic(_store_fence_typing) if numba is not None else None
"""A sequentially consistent fence (a locked instruction on x86, which drains the
write-combining buffers of non-temporal stores; ``dmb ish`` on Arm): the lines are in
memory before whatever this thread does next, the end of a parallel region included."""


@_jit()
def _transpose_bytes(
    src: np.ndarray, s_off: int, s_stride: int, nr: int, k: int, q: np.ndarray, col: int,
    n_total: int, final: bool,
) -> int:  # fmt: skip
    """Rows ``src[s_off + i * s_stride :][:k]`` (i < nr) as columns ``[col, col + nr)`` of
    the flat ``q [k, n_total]``: blocks in vector registers, the edges a byte at a time.
    ``final``: ``q`` is a buffer nothing reads soon (a reload's destination); where its
    rows are 64-byte aligned at ``col``, 64 rows at a time go out as whole lines,
    non-temporally (:func:`_transpose64`). Otherwise (staging that is copied on at once
    and should stay in cache, or unaligned) 16x16 blocks go down the rows within one
    16-column band. Either way an item's source lines stay in cache for the next band.
    Returns how many rows went out as lines."""
    n16 = nr // 16 * 16
    k16 = k // 16 * 16
    lines = final and n_total % 64 == 0 and (q.ctypes.data + col) % 64 == 0
    n64 = nr // 64 * 64 if lines else 0
    for c in range(0, k16, 16):
        for i in range(0, n64, 64):
            _transpose64(src, s_off + i * s_stride + c, s_stride, q, c * n_total + col + i, n_total)
        for i in range(n64, n16, 16):
            _transpose16(src, s_off + i * s_stride + c, s_stride, q, c * n_total + col + i, n_total)
    if n64 and k16:
        _store_fence()
    for c in range(k16):
        o = c * n_total + col
        for i in range(n16, nr):
            q[o + i] = src[s_off + i * s_stride + c]
    for c in range(k16, k):
        o = c * n_total + col
        for i in range(nr):
            q[o + i] = src[s_off + i * s_stride + c]
    return n64 if k16 else 0


@_jit()
def _pair_columns(
    s: np.ndarray, s_off: int, g: int, nr: int, out: np.ndarray, n_total: int, col: int
) -> None:
    """Scales ``s[s_off + i * g + j]`` (row ``i < nr``, group ``j < g``) as columns
    ``[col, col + nr)`` of the paired layout ``out [ceil(g/2), n_total, 2]`` (flat):
    ``out[j // 2, col + i, j % 2]``, the pad byte of an odd ``g`` written 0."""
    for j in range((g + 1) // 2):
        g0 = 2 * j
        odd = g0 + 1 == g
        base = j * n_total + col
        for i in range(nr):
            o = (base + i) * 2
            at = s_off + i * g + g0
            out[o] = s[at]
            out[o + 1] = 0 if odd else s[at + 1]


@_jit(parallel=True)
def _rows_kernel(
    src: np.ndarray, n: int, k: int, q: np.ndarray, n_total: int, col: int,
    s: np.ndarray, g: int, out: np.ndarray, final: bool,
) -> int:  # fmt: skip
    """Rows ``src [n, k]`` (row-major) as columns ``[col, col + n)`` of ``q [k, n_total]``
    (:func:`_transpose_bytes`), and their scales ``s [n, g]`` as the same columns of the
    paired layout ``out [ceil(g/2), n_total, 2]`` (flat): ``out[j, col + i, p] =
    s[i, 2j + p]``, the pad byte of an odd ``g`` written 0. 64-row items in parallel, both
    parts in one launch (a launch wakes the sleeping OpenMP threads: tens of µs). Returns
    the rows that went out as whole lines (``final``: :func:`_transpose_bytes`)."""
    lines = 0
    for item in prange((n + 63) // 64):
        r0 = item * 64
        r1 = min(n, r0 + 64)
        lines += _transpose_bytes(src, r0 * k, k, r1 - r0, k, q, col + r0, n_total, final)
        _pair_columns(s, r0 * g, g, r1 - r0, out, n_total, col + r0)
    return lines


@_jit()
def _convert_item(
    w: np.ndarray,
    w64: np.ndarray,
    k: int,
    r_lo: int,
    r_hi: int,
    ti: int,
    sbits: np.ndarray,
    col0: int,
    bk: int,
    r32: np.ndarray,
    s_tab: np.ndarray,
    g_tile: np.ndarray,
    g_split: np.ndarray,
    packed: bool,
    q_out: np.ndarray,
    n_total: int,
    out_row0: int,
    s_out: np.ndarray,
) -> None:
    """One parallel work item: local rows ``[r_lo, r_hi)`` of one tile row, all of K."""
    ng = k // 32
    nr = r_hi - r_lo
    if not packed:
        _convert_rows(
            w, w64, k, r_lo, r_hi, ti, sbits, col0, bk, r32, s_tab, g_tile, g_split,
            q_out[r_lo * k : r_hi * k], k, s_out.reshape(-1, ng)[r_lo:r_hi],
        )  # fmt: skip
        return
    # Packed (docs/contract.md §2.3): convert the rows row-major into ``loc``, then write them as
    # columns [col, col + nr) of the kernel layout. The row stride is padded by 64 bytes:
    # rows 4 KiB apart would all map to the same cache sets when read column-wise.
    stride = k + 64
    loc = np.empty(nr * stride, dtype=np.uint8)
    s_loc = np.empty((nr, ng), dtype=np.uint8)
    _convert_rows(
        w, w64, k, r_lo, r_hi, ti, sbits, col0, bk, r32, s_tab, g_tile, g_split,
        loc, stride, s_loc,
    )  # fmt: skip
    col = out_row0 + r_lo
    _transpose_bytes(loc, 0, stride, nr, k, q_out, col, n_total, False)
    _pair_columns(s_loc.reshape(-1), 0, ng, nr, s_out, n_total, col)


PART_FIELDS = 13
"""Columns of a parts table (:func:`run_convert_parts`): payload offset in ``src``,
rows, first source row, first source column, first output column (packed), offset of
the part's tiles in ``sbits``, tile rows, tile columns, K, offset of the part's payload
output in ``q_out``, offset of its scale output in ``s_out``, the output's columns
(packed: ``N_total`` of its ``[K, N_total]``), rows per work item. Parts of different
units (their own K and outputs) run in one launch."""


@_jit(parallel=True)
def _convert_kernel(
    src: np.ndarray,  # uint8 flat: every part's [n, k] payload, row-major, k % 32 == 0
    src64: np.ndarray,  # uint64 view of src (part offsets are multiples of 8)
    parts: np.ndarray,  # int64 [P, PART_FIELDS]
    sbits: np.ndarray,  # uint32 flat: every part's [TI, TJ] covering tiles (f32 bits)
    sf: np.ndarray,  # float32 view of the same
    bn: int,
    bk: int,
    mode: int,
    packed: bool,
    q_out: np.ndarray,  # uint8 flat: each part's [n, k] row-major, or (packed) [k, n_total]
    s_out: np.ndarray,  # uint8 flat: [n, g] row-major, or (packed) [ceil(g/2), n_total, 2]
    n_threads: int,
) -> None:
    """Every part of one or more units in one launch: their tables first (serially, they
    are small), then one parallel loop over the work items of all parts, so a step of
    several small parts (experts' gate, up and down halves at tp = 8) pays one launch.

    Items are dealt to the ``n_threads`` threads by their work (rows x K), largest first,
    each to the least loaded thread: a parallel loop over the items themselves would
    hand each thread an equal count of them, and with parts of different K in one launch
    (a K = 2048 gate/up and a K = 96 down) one thread would get most of the work."""
    n_parts = parts.shape[0]
    max_ng = 0
    tile0 = np.empty(n_parts + 1, dtype=np.int64)
    tile0[0] = 0
    n_items = 0
    for p in range(n_parts):
        tile0[p + 1] = tile0[p] + parts[p, 6] * parts[p, 7]
        n_items += _row_chunks(parts[p, 1], parts[p, 2], bn, parts[p, 12]).shape[0]
        max_ng = max(max_ng, parts[p, 8] // 32)
    r32 = np.empty((tile0[n_parts], 128), dtype=np.int64)
    s_tab = np.empty((tile0[n_parts], 128), dtype=np.uint8)
    # Column tile of each group (by its first column) and whether it straddles two tiles.
    g_tile = np.empty((n_parts, max_ng), dtype=np.int64)
    g_split = np.empty((n_parts, max_ng), dtype=np.bool_)
    items = np.empty((n_items, 3), dtype=np.int64)  # (part, first row, end row)
    j = 0
    for p in range(n_parts):
        n, row0, col0 = parts[p, 1], parts[p, 2], parts[p, 3]
        sb0, ti_n, tj_n = parts[p, 5], parts[p, 6], parts[p, 7]
        _tile_tables(
            sbits[sb0 : sb0 + ti_n * tj_n].reshape((ti_n, tj_n)),
            sf[sb0 : sb0 + ti_n * tj_n].reshape((ti_n, tj_n)),
            mode, r32[tile0[p] : tile0[p + 1]], s_tab[tile0[p] : tile0[p + 1]],
        )  # fmt: skip
        t_c0 = col0 // bk
        for g in range(parts[p, 8] // 32):
            c = col0 + 32 * g
            g_tile[p, g] = c // bk - t_c0
            g_split[p, g] = (c + 31) // bk != c // bk
        chunks = _row_chunks(n, row0, bn, parts[p, 12])
        for c in range(chunks.shape[0]):
            items[j, 0] = p
            items[j, 1] = chunks[c, 0]
            items[j, 2] = chunks[c, 1]
            j += 1
    # Longest-processing-time-first: items by work, descending, each to the least loaded
    # thread; then each thread's items as one slice of ``order``.
    work = np.empty(n_items, dtype=np.int64)
    for it in range(n_items):
        work[it] = (items[it, 2] - items[it, 1]) * parts[items[it, 0], 8]
    by_work = np.argsort(-work, kind="mergesort")
    n_t = max(1, min(n_threads, n_items))
    load = np.zeros(n_t, dtype=np.int64)
    owner = np.empty(n_items, dtype=np.int64)
    count = np.zeros(n_t + 1, dtype=np.int64)
    for it in by_work:
        least = np.argmin(load)
        load[least] += work[it]
        owner[it] = least
        count[least + 1] += 1
    for t in range(n_t):
        count[t + 1] += count[t]
    order = np.empty(n_items, dtype=np.int64)
    fill = count[:n_t].copy()
    for it in by_work:
        order[fill[owner[it]]] = it
        fill[owner[it]] += 1
    for t in prange(n_t):
        for o in range(count[t], count[t + 1]):
            _convert_one(
                parts, items, order[o], src, src64, sbits, bn, bk, packed, q_out, s_out,
                r32, s_tab, tile0, g_tile, g_split,
            )  # fmt: skip


@_jit()
def _convert_one(
    parts: np.ndarray,
    items: np.ndarray,
    it: int,
    src: np.ndarray,
    src64: np.ndarray,
    sbits: np.ndarray,
    bn: int,
    bk: int,
    packed: bool,
    q_out: np.ndarray,
    s_out: np.ndarray,
    r32: np.ndarray,
    s_tab: np.ndarray,
    tile0: np.ndarray,
    g_tile: np.ndarray,
    g_split: np.ndarray,
) -> None:
    """Work item ``it`` of :func:`_convert_kernel`: its part's slices of the inputs,
    tables and outputs, handed to :func:`_convert_item`."""
    p = items[it, 0]
    r_lo = items[it, 1]
    w0, n, row0, col0 = parts[p, 0], parts[p, 1], parts[p, 2], parts[p, 3]
    sb0, ti_n, tj_n, k = parts[p, 5], parts[p, 6], parts[p, 7], parts[p, 8]
    qb, sb, n_total = parts[p, 9], parts[p, 10], parts[p, 11]
    ng = k // 32
    if packed:
        q_len = k * n_total
        s_len = ((ng + 1) // 2) * n_total * 2
    else:
        q_len = n * k
        s_len = n * ng
    _convert_item(
        src[w0 : w0 + n * k], src64[w0 >> 3 : (w0 + n * k) >> 3], k, r_lo, items[it, 2],
        (row0 + r_lo) // bn - row0 // bn,
        sbits[sb0 : sb0 + ti_n * tj_n].reshape((ti_n, tj_n)), col0, bk,
        r32[tile0[p] : tile0[p + 1]], s_tab[tile0[p] : tile0[p + 1]],
        g_tile[p, :ng], g_split[p, :ng], packed, q_out[qb : qb + q_len], n_total,
        parts[p, 4], s_out[sb : sb + s_len],
    )  # fmt: skip


@_jit(inline="always")
def _mx_groups(
    x: np.ndarray,
    g_lo: int,
    g_hi: int,
    ebits: int,
    q_out: np.ndarray,
    s_out: np.ndarray,
    alg: int,
) -> None:
    """MX-quantize groups ``[g_lo, g_hi)`` of ``x`` (bf16 bits: ``ebits`` 7; f32 bits:
    23) under scale rule ``alg`` (0 or 1, docs/contract.md §2.2). Inlined into callers
    that pass ``ebits`` as a constant, so the shifts fold."""
    drop = ebits - 3  # e4m3 keeps 3 mantissa bits; drop the rest with RNE
    mag_mask = (np.int64(1) << (ebits + 8)) - 1
    half = (np.int64(1) << (drop - 1)) - 1
    for g in range(g_lo, g_hi):
        base = np.uint64(g * 32)  # unsigned indices: no negative-index fix-up
        # Exponent fields grow with the magnitude bits, so Emax is the exponent of the
        # largest magnitude; the smallest exponent among non-zero elements decides
        # whether the short formula is exact for the whole group.
        mmax = 0
        emin = 255
        for i in range(32):
            mag = np.int64(x[base + np.uint64(i)]) & mag_mask
            mmax = max(mmax, mag)  # type: ignore[assignment]
            emin = min(emin, (mag >> ebits) if mag != 0 else 255)  # type: ignore[assignment]
        s = _scale_byte_alg1(mmax << (23 - ebits)) if alg == 1 else _scale_byte(mmax >> ebits)
        s_out[g] = s
        if s == 255:
            for i in range(32):
                q_out[base + np.uint64(i)] = 0x7F
        elif s == 0 and alg == 0:
            for i in range(32):
                q_out[base + np.uint64(i)] = (
                    np.int64(x[base + np.uint64(i)]) >> (ebits + 1)
                ) & 0x80
        elif emin >= 1 and emin >= s - 6:
            # Every element is zero or lands in the e4m3 normal range: drop the low
            # mantissa bits with RNE (a carry bumps the exponent, as it should), rebias
            # the exponent from 127 - s to e4m3's 7, clamp to 448.
            reb = (s - 7) << 3
            for i in range(32):
                h = np.int64(x[base + np.uint64(i)])
                mag = h & mag_mask
                v = min(((mag + half + ((mag >> drop) & 1)) >> drop) - reb, 0x7E)
                v = v if mag != 0 else 0
                q_out[base + np.uint64(i)] = ((h >> (ebits + 1)) & 0x80) | v  # type: ignore[operator]
        else:
            for i in range(32):
                h = np.int64(x[base + np.uint64(i)])
                # 1 <= s <= 254 here, or s = 0 under scale_alg 1 (scaled by 2**127)
                q_out[base + np.uint64(i)] = _quant_e4m3_scaled(h << (23 - ebits), s)  # type: ignore[arg-type]


@_jit()
def _mx_groups_bf16(
    x: np.ndarray, g_lo: int, g_hi: int, q_out: np.ndarray, s_out: np.ndarray, alg: int
) -> None:
    _mx_groups(x, g_lo, g_hi, 7, q_out, s_out, alg)


@_jit()
def _mx_groups_f32(
    x: np.ndarray, g_lo: int, g_hi: int, q_out: np.ndarray, s_out: np.ndarray, alg: int
) -> None:
    _mx_groups(x, g_lo, g_hi, 23, q_out, s_out, alg)


@_jit(parallel=True)
def _mx_kernel(
    x: np.ndarray,  # uint16 (bf16 bits) or uint32 (fp32 bits), flat, len % 32 == 0
    is_bf16: bool,
    q_out: np.ndarray,  # uint8, flat, same length
    s_out: np.ndarray,  # uint8, one per group
    alg: int,  # scale rule, docs/contract.md §2.2
) -> None:
    ng = x.shape[0] // 32
    chunk = 1024
    for ch in prange((ng + chunk - 1) // chunk):
        g_hi = min(ng, (ch + 1) * chunk)
        if is_bf16:
            _mx_groups_bf16(x, ch * chunk, g_hi, q_out, s_out, alg)
        else:
            _mx_groups_f32(x, ch * chunk, g_hi, q_out, s_out, alg)


# =========================================================================================
# Availability, threads, launching
# =========================================================================================

LOCK = threading.Lock()
"""Serializes kernel launches (see Threads in the module doc)."""
_INIT_LOCK = threading.Lock()
_AVAILABLE: bool | None = None
_UNAVAILABLE_REASON: str | None = _NUMBA_IMPORT_ERROR
PARALLEL_ROWS_BYTES = 512 * 1024
"""Payload bytes under which :func:`run_rows` runs on one thread: waking a sleeping
OpenMP thread costs about 40 µs here, and two threads save half of one thread's time
only when that is well over it (one thread transposes some 300 KB in 40 µs)."""
_MAX_ROWS_PER_ITEM = 128
"""Rows per parallel work item, at most. An item never crosses a tile row, so with the
usual 128-row tiles it is a whole tile row: it walks source rows in memory order, and
builds the payload tables of its (tile column, S) pairs once for the whole tile row."""
_WIDE_K = 4096
"""Above this K, items stay at :data:`_WIDE_ROWS_PER_ITEM` rows: an item's row buffer is
rows x (K + 64) bytes, and a smaller one stays in cache."""
_WIDE_ROWS_PER_ITEM = 64


def cpu_share() -> int:
    """The cores this process may run on (its affinity mask; the core count elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


_TLS = threading.local()
"""This thread's numba thread count as last set (numba's setting is per thread, and
asking numba for it costs a visible share of a small launch)."""


def rows_per_item(n: int, k: int) -> int:
    """Rows per work item, a multiple of 8 (so the packed path's transposed writes stay
    word-aligned): :data:`_MAX_ROWS_PER_ITEM` (64 above :data:`_WIDE_K`) while that still
    gives every thread an item, else the block split evenly over the threads (at least 8
    rows; smaller items cost more in per-item table building than they gain)."""
    most = _MAX_ROWS_PER_ITEM if k <= _WIDE_K else _WIDE_ROWS_PER_ITEM
    threads = max(1, getattr(_TLS, "threads", 0) or numba.get_num_threads())
    if ceil_div(n, most) >= threads:
        return most
    return min(most, max(8, ceil_div(ceil_div(n, threads), 8) * 8))


def set_threads(want: int) -> None:
    """Launch kernels on ``want`` threads, capped by numba's pool size (call under LOCK)."""
    want = max(1, min(int(want), int(numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    if getattr(_TLS, "threads", 0) != want:
        numba.set_num_threads(want)
        _TLS.threads = want


@dataclass(frozen=True)
class Block:
    """A validated resolve/convert block, as the kernels take it."""

    w: np.ndarray  # uint8 [n * k], row-major
    w64: np.ndarray  # uint64 view of w (the group max reads 8 bytes at a time)
    n: int
    k: int
    sbits: np.ndarray  # uint32 [TI, TJ]: bits of the covering tiles
    sf: np.ndarray  # float32 view of sbits


def make_block(w: np.ndarray, n: int, k: int, sbits: np.ndarray) -> Block:
    """Wrap a C-contiguous uint8 payload ``w`` (``n * k`` bytes, row-major) and the uint32
    bits of its covering tiles. Copies ``w`` only when a word view needs alignment."""
    w = w.reshape(-1)
    if k % 8 == 0 and w.ctypes.data % 8 == 0:
        w64 = w.view(np.uint64)
    else:
        # Only the MX kernel reads words, and it needs k % 32 == 0; keep types uniform.
        w64 = np.zeros(0, dtype=np.uint64)
        if k % 8 == 0:
            w = w.copy()  # numpy allocations are aligned
            w64 = w.view(np.uint64)
    sbits = np.ascontiguousarray(sbits).view(np.uint32)
    return Block(w, w64, n, k, sbits, sbits.view(np.float32))


def run_resolve(
    b: Block, row0: int, col0: int, bn: int, bk: int, mode: int, out: np.ndarray, threads: int
) -> None:
    """Resolve ``b`` into ``out`` (uint16 ``[n * k]`` for bf16/fp16, uint32 for fp32)."""
    if b.n and b.k:
        with LOCK:
            set_threads(threads)
            _resolve_kernel(
                b.w, b.n, b.k, b.sbits, b.sf, row0, col0, bn, bk, mode, out,
                rows_per_item(b.n, b.k),
            )  # fmt: skip


def _flat_output(q: np.ndarray, what: str) -> None:
    """Refuse an output the transposing writes cannot take: they address ``q``'s memory
    as one run of bytes (``_transpose16``), so a strided view would be written past."""
    if not q.flags.c_contiguous:
        raise NumericsError(f"{what}: the output is not one contiguous run of bytes")


def run_convert(
    b: Block,
    row0: int,
    col0: int,
    bn: int,
    bk: int,
    mode: int,
    packed: bool,
    q_np: np.ndarray,
    s_np: np.ndarray,
    n_total: int,
    out_row0: int,
    threads: int,
) -> None:
    """Resolve and MX-quantize ``b``: row-major ``q_np``/``s_np``, or (``packed``) the
    kernel layout of docs/contract.md §2.3 at column ``out_row0`` of ``n_total``."""
    if b.n == 0 or b.k == 0:
        return
    if packed:
        _flat_output(q_np, "run_convert")
    ti, tj = b.sbits.shape
    n_out = n_total if packed else b.n
    with LOCK:
        set_threads(threads)  # before rows_per_item, which splits for this launch's threads
        parts = np.array(
            [[0, b.n, row0, col0, out_row0, 0, ti, tj, b.k, 0, 0, n_out, rows_per_item(b.n, b.k)]],
            dtype=np.int64,
        )
        _convert_kernel(
            b.w, b.w64, parts, b.sbits.reshape(-1), b.sf.reshape(-1), bn, bk, mode,
            packed, q_np, s_np, _TLS.threads,
        )  # fmt: skip


def run_convert_parts(
    src: np.ndarray,
    parts: np.ndarray,
    sbits: np.ndarray,
    bn: int,
    bk: int,
    mode: int,
    q_np: np.ndarray,
    s_np: np.ndarray,
    threads: int,
) -> None:
    """Parts of one or more units into the kernel layout (docs/contract.md §2.3) in one launch.

    ``src``: 8-byte aligned uint8 holding every part's row-major ``[n, k]`` payload at an
    offset that is a multiple of 8; ``parts``: int64 ``[P, PART_FIELDS]`` whose last column
    holds the rows of the part's unit on entry (replaced here by :func:`rows_per_item` of
    them, once the thread count is set); ``sbits``:
    uint32, every part's covering tiles row-major at its offset; ``q_np``/``s_np``: flat
    uint8 outputs (one array may hold both) the part offsets point into. The caller
    validates the geometry (``fast.convert_units_to_mx_packed``)."""
    if parts.shape[0] == 0:
        return
    _flat_output(q_np, "run_convert_parts")
    src64 = src[: src.size - src.size % 8].view(np.uint64)
    if not src64.flags.aligned:
        raise NumericsError("run_convert_parts: src is not 8-byte aligned")
    with LOCK:
        set_threads(threads)
        for p in range(parts.shape[0]):
            parts[p, 12] = rows_per_item(int(parts[p, 12]), int(parts[p, 8]))
        _convert_kernel(
            src, src64, parts, sbits, sbits.view(np.float32), bn, bk, mode,
            True, q_np, s_np, _TLS.threads,
        )  # fmt: skip


def run_rows(
    src: np.ndarray, k: int, q: np.ndarray, s: np.ndarray, g: int, out: np.ndarray,
    col: int, threads: int, *, final: bool = True,
) -> int:  # fmt: skip
    """Write the rows of one MX result as columns ``[col, col + n)`` of the kernel layout
    (docs/contract.md §2.3): the payload ``src`` (uint8 ``[n, k]``, C-contiguous) into the
    flat uint8 ``q`` holding ``[k, n_total]`` (``n_total = q.size // k``), its scales
    ``s`` (uint8 ``[n, g]``, C-contiguous) into the flat uint8 ``out`` holding
    ``[ceil(g/2), n_total, 2]``, the pad byte of an odd ``g`` zeroed (``g = 0``: the
    payload alone). ``final``: ``q`` is the buffer itself, written in whole lines where
    aligned (False: staging that is copied on at once). Under
    :data:`PARALLEL_ROWS_BYTES` of payload it runs on one thread. Returns the rows that
    went out as whole lines. Shapes that do not fit are refused before a byte is written."""
    if src.size == 0:
        return 0
    n_total = q.size // k if k > 0 else 0
    n = src.size // k if k > 0 else 0
    _flat_output(q, "run_rows")
    _flat_output(out, "run_rows")
    if k <= 0 or src.size % k or q.size % k or not 0 <= col <= n_total - n:
        raise NumericsError(
            f"run_rows: {src.size} payload bytes as rows of K = {k} at column {col} do not fit "
            f"a [{k}, {q.size / k:g}] buffer"
        )
    if s.size != n * g or out.size != 2 * ((g + 1) // 2) * n_total:
        raise NumericsError(
            f"run_rows: {n} rows of K = {k} need {n * g} scale bytes (got {s.size}) and a "
            f"paired scale buffer of {2 * ((g + 1) // 2) * n_total} bytes (got {out.size})"
        )
    with LOCK:
        set_threads(threads if src.size >= PARALLEL_ROWS_BYTES else 1)
        return int(
            _rows_kernel(src.reshape(-1), n, k, q, n_total, col, s.reshape(-1), g, out, final)
        )


def run_mx(
    bits: np.ndarray,
    is_bf16: bool,
    q_np: np.ndarray,
    s_np: np.ndarray,
    threads: int,
    scale_alg: int = 0,
) -> None:
    """MX-quantize raw bf16 (uint16) or fp32 (uint32) bits, row-major, under scale rule
    ``scale_alg`` (docs/contract.md §2.2)."""
    if bits.size == 0:
        return
    with LOCK:
        set_threads(threads)
        _mx_kernel(bits, is_bf16, q_np, s_np, scale_alg)


def _self_test() -> None:
    """Compile every kernel on tiny inputs and check bytes derived by hand (docs/contract.md §2)."""
    # w = [1.0 (0x38), -2.0 (0xC0), 448 (0x7E), 2**-9 (0x01)] * 8, one tile, scale 2**-120:
    # products 2**-120, -2**-119, 1.75 * 2**-112 and 2**-129 (an f32 subnormal).
    w = np.array([0x38, 0xC0, 0x7E, 0x01] * 8, dtype=np.uint8)
    b = make_block(w, 1, 32, np.array([[2.0**-120]], dtype=np.float32).view(np.uint32))
    r = np.empty(32, dtype=np.uint16)
    run_resolve(b, 0, 0, 128, 128, MODE_BF16, r, 1)
    # bf16: 2**-120 -> field 7 -> 0x0380; -2**-119 -> 0x8400; 1.75 * 2**-112 -> 0x07E0;
    # 2**-129 is a bf16 subnormal, 2**4 units of 2**-133 -> 0x0010.
    got = [int(v) for v in r[:4]]
    if got != [0x0380, 0x8400, 0x07E0, 0x0010]:
        raise RuntimeError(f"resolve self-test gave {[hex(v) for v in got]}")
    # Emax = 15 (1.75 * 2**-112) -> S = 7; scaled by 2**120: 1, -2, 448 and 2**-9, the
    # e4m3 subnormal 0x01: the input bytes come back.
    want = [0x38, 0xC0, 0x7E, 0x01] * 8
    q = np.empty(32, dtype=np.uint8)
    s = np.empty(1, dtype=np.uint8)
    for packed in (False, True):
        run_convert(b, 0, 0, 128, 128, MODE_BF16, packed, q, s, 1, 0, 1)
        if int(s[0]) != 7 or q.tolist() != want:
            raise RuntimeError(f"convert self-test gave S={int(s[0])}, {q.tolist()}")
    for bits, is_bf16 in ((r.copy(), True), (r.astype(np.uint32) << 16, False)):
        run_mx(bits, is_bf16, q, s, 1)
        if int(s[0]) != 7 or q.tolist() != want:
            raise RuntimeError(f"mx self-test gave S={int(s[0])}, {q.tolist()}")
    r32 = np.empty(32, dtype=np.uint32)
    for mode, out in ((MODE_FP16, r), (MODE_FP32, r32)):
        run_resolve(b, 0, 0, 128, 128, mode, out, 1)
        run_convert(b, 0, 0, 128, 128, mode, False, q, s, 1, 0, 1)
        run_convert(b, 0, 0, 128, 128, mode, True, q, s, 1, 0, 1)
    # 17 rows of 20 bytes as columns 3..19 of [20, 21]: one 16x16 block in vector
    # registers, the 17th row and the last 4 columns by bytes; numpy's transpose is the
    # reference, and the columns around stay 0.
    src = np.arange(17 * 20, dtype=np.uint8).reshape(17, 20)
    q21 = np.zeros(20 * 21, dtype=np.uint8)
    run_rows(src, 20, q21, src[:, :0], 0, q21[:0], 3, 1)
    cols = q21.reshape(20, 21)
    if not (cols[:, 3:20] == src.T).all() or cols[:, :3].any() or cols[:, 20:].any():
        raise RuntimeError("rows self-test: the transpose is wrong")
    # 64 rows of 16 bytes into a 64-byte aligned [16, 128] at column 64: whole lines,
    # stored non-temporally.
    src64 = (np.arange(64 * 16) % 251).astype(np.uint8).reshape(64, 16)
    room = np.zeros(16 * 128 + 64, dtype=np.uint8)
    q128 = room[(-room.ctypes.data) % 64 :][: 16 * 128]
    as_lines = run_rows(src64, 16, q128, src64[:, :0], 0, q128[:0], 64, 1)
    lines = q128.reshape(16, 128)
    if as_lines != 64 or not (lines[:, 64:] == src64.T).all() or lines[:, :64].any():
        raise RuntimeError(f"rows self-test: the transpose in lines is wrong ({as_lines} rows)")
    # Scales of 3 groups (odd) of 2 rows of K = 96 as columns 1..2 of [2 pairs, 4, 2]:
    # pairs, then pad 0, the columns around untouched.
    pairs = np.full(2 * 4 * 2, 9, dtype=np.uint8)
    scales = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8)
    run_rows(np.zeros((2, 96), np.uint8), 96, np.zeros(96 * 4, np.uint8), scales, 3, pairs, 1, 1)
    want_pairs = [9, 9, 1, 2, 4, 5, 9, 9, 9, 9, 3, 0, 6, 0, 9, 9]
    if pairs.tolist() != want_pairs:
        raise RuntimeError(f"rows self-test gave scale pairs {pairs.tolist()}")


def available() -> bool:
    """True when numba imports and every kernel compiles and passes a tiny self-test.

    The first call compiles (or loads numba's cache); the answer is remembered for the
    process. Never raises: on any failure the reason is kept for
    :func:`unavailable_reason` and callers fall back to the reference path.
    """
    global _AVAILABLE, _UNAVAILABLE_REASON
    if _AVAILABLE is not None:
        return _AVAILABLE
    with _INIT_LOCK:  # one thread compiles; the others wait for its answer
        if _AVAILABLE is None:
            if numba is None:
                _AVAILABLE = False
            else:
                try:
                    with _passive_omp():
                        _self_test()
                    _AVAILABLE = True
                    _UNAVAILABLE_REASON = None
                except Exception as exc:  # a broken optional kernel must not stop a load
                    _AVAILABLE = False
                    _UNAVAILABLE_REASON = f"{type(exc).__name__}: {exc}"
                    log.info("fast CPU numerics unavailable: %s", _UNAVAILABLE_REASON)
    return _AVAILABLE


@contextmanager
def _passive_omp() -> Iterator[None]:
    """``OMP_WAIT_POLICY=PASSIVE`` (unless set) while the first launch loads libgomp.

    OpenMP threads that spin after each parallel region (the default) burn a core between
    the many short launches of a conversion, taking it from the reader and writer
    threads; sleeping ones cost a futex wake per launch. libgomp reads the variable once,
    when it is loaded: here, in a process without torch (``mxload convert``); a process
    that imported torch loaded it already (Ray workers get it from
    ``mxload.cluster.local.WORKER_ENV``). The environment is given back afterwards."""
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def unavailable_reason() -> str | None:
    """Why :func:`available` said False (None when it said True or was not asked)."""
    return _UNAVAILABLE_REASON


def require() -> None:
    """Raise :class:`NumericsError` unless :func:`available`."""
    if not available():
        raise NumericsError(
            f"the fast CPU numerics path is unavailable ({_UNAVAILABLE_REASON}); "
            "use workers.numerics.reference"
        )


# =========================================================================================
# numpy API (what ``mxload convert`` calls): whole tensors, tile-aligned (row0 = col0 = 0)
# =========================================================================================


def convert(
    w: np.ndarray,
    scale_inv: np.ndarray,
    *,
    block_n: int,
    block_k: int,
    mode: int,
    threads: int,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A whole block-FP8 weight (uint8 ``[n, k]`` payload, float32 ``[ceil(n/bn),
    ceil(k/bk)]`` scales) -> (uint8 e4m3 payload ``[n, k]``, uint8 E8M0 ``[n, k/32]``).

    Equals ``reference.mx_quantize(reference.resolve_block(...))`` byte for byte (NaN
    payload bytes 0x7F and 0xFF count as equal). ``k`` must be a multiple of 32; the
    caller checks the scales (``scales.check_block_scales``) and their shape. ``out``:
    C-contiguous uint8 arrays of ``n * k`` and ``n * k / 32`` bytes to write into (and
    return, reshaped), e.g. reused buffers."""
    require()
    n, k = w.shape
    if k % MX_GROUP:
        raise NumericsError(
            f"convert: K = {k} is not a multiple of {MX_GROUP} (docs/contract.md §2.2)"
        )
    b = make_block(np.ascontiguousarray(w), n, k, scale_inv.view(np.uint32))
    if out is None:
        q = np.empty(n * k, dtype=np.uint8)
        s = np.empty(n * (k // MX_GROUP), dtype=np.uint8)
    else:
        q, s = (a.reshape(-1) for a in out)
        if q.size != n * k or s.size != n * (k // MX_GROUP) or q.dtype != np.uint8:
            raise NumericsError(f"convert: out arrays do not fit a [{n}, {k}] weight")
    run_convert(b, 0, 0, block_n, block_k, mode, False, q, s, 0, 0, threads)
    return q.reshape(n, k), s.reshape(n, k // MX_GROUP)


def resolve(
    w: np.ndarray, scale_inv: np.ndarray, *, block_n: int, block_k: int, mode: int, threads: int
) -> np.ndarray:
    """A whole block-FP8 weight resolved to the model dtype's raw bits (uint16 ``[n, k]``
    for bf16/fp16, uint32 for fp32): ``reference.resolve_block`` byte for byte."""
    require()
    n, k = w.shape
    b = make_block(np.ascontiguousarray(w), n, k, scale_inv.view(np.uint32))
    out = np.empty((n, k), dtype=np.uint32 if mode == MODE_FP32 else np.uint16)
    run_resolve(b, 0, 0, block_n, block_k, mode, out.reshape(-1), threads)
    return out
