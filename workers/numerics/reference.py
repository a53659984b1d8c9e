"""The CPU reference for every numeric step of docs/contract.md §2 (resolve, MX
quantize, dequantize).

One plain-torch implementation of the bit-exact contract, readable against §2 line by
line. Every other path (the fused CPU kernel in ``fast.py``, torch_npu, CUDA)
is tested against it byte for byte through the named case table in
``tests/numerics_cases.py``.

Why it is written this way:
- Exponents are read from float32 bit patterns and scale bytes are built as integers; no
  ``log2`` and no float -> ``float8_e8m0fnu`` cast (that cast rounds; §2.2 floors).
- Powers of two are built from their bit patterns, so ``2**-127`` (an f32 subnormal) is
  exact whatever the platform's ``exp2`` does.
- Scaled values are clamped to ±448 before the E4M3 cast because torch versions differ on
  what an overflowing cast gives (NaN or saturation).

Limits: pure torch, so it runs on any device the tensors are on; it favours clarity over
memory but stays bounded: ``mx_quantize`` needs at most 8 scratch bytes per element and
``resolve_block`` only per-tile-row temporaries besides its output. Nothing here
pads a ragged K; callers decide the K % 32 fallback (docs/contract.md §2.2) before calling.
"""

from __future__ import annotations

import torch

from ...orchestrator.errors import NumericsError
from ...orchestrator.plan.formats import (
    E4M3_EMAX,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_NAN,
    MX_GROUP,
    SCALE_ALG_E4M3_CEIL,
    SCALE_ALGS,
)
from . import scales as _scales

MODEL_TORCH_DTYPE: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""Model dtype name (``mxload.orchestrator.plan.config``'s ``model_dtype``) -> torch dtype."""

MODEL_TORCH_DTYPES: tuple[torch.dtype, ...] = tuple(MODEL_TORCH_DTYPE.values())
"""Dtypes a resolved tensor can have, and that mx_quantize accepts (docs/contract.md §1.4, §2.2)."""

_F32_EXP_SHIFT = 23
_F32_EXP_MASK = 0xFF
_F32_TWO_POW_M127_BITS = 0x00400000
"""2**-127 is the f32 subnormal with only mantissa bit 22 set; (0 << 23) would be zero."""


def _pow2_f32_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, built from bits, for integer ``e`` in [-127, 127].

    Normal powers have biased exponent field e + 127 and zero mantissa; e = -127 is the
    one subnormal power needed (docs/contract.md §2.2 note: 2**(127 - 254), 2**(0 - 127)).
    """
    e32 = e.to(torch.int32)
    bits = torch.where(
        e32 == -127,
        torch.full_like(e32, _F32_TWO_POW_M127_BITS),
        (e32 + 127) << _F32_EXP_SHIFT,
    )
    return bits.view(torch.float32)


def _check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise NumericsError(f"{what} has dtype {t.dtype}; expected one of {names}")


# --- docs/contract.md §2.1: resolve ---------------------------------------------------------------


def resolve_block(
    w_fp8: torch.Tensor,
    scale_inv_f32: torch.Tensor,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantize a slice of a block-FP8 weight into the model dtype (docs/contract.md §2.1).

    ``w_fp8`` ``[r, c]`` holds rows ``[row0, row0 + r)`` and columns ``[col0, col0 + c)`` of
    the source weight. ``scale_inv_f32`` ``[tr, tc]`` holds exactly the tiles covering that
    slice: its ``[0, 0]`` is tile ``(row0 // block_n, col0 // block_k)`` (floor of the first
    index, never ceil of the offset) and ``tr = (row0 + r - 1) // block_n - row0 // block_n + 1``.

    Each element is ``f32(w) * s`` computed in float32 and rounded once (RNE) to ``dtype``,
    so the result depends only on the element's global position: chunking and sharding
    commute with it.
    """
    _check_dtype(w_fp8, (torch.float8_e4m3fn,), "resolve_block: w_fp8")
    _check_dtype(scale_inv_f32, (torch.float32,), "resolve_block: scale_inv_f32")
    _check_dtype(torch.empty(0, dtype=dtype), MODEL_TORCH_DTYPES, "resolve_block: dtype")
    if w_fp8.dim() != 2 or scale_inv_f32.dim() != 2:
        raise NumericsError(
            f"resolve_block: expected 2-D weight and scale, got {tuple(w_fp8.shape)} and "
            f"{tuple(scale_inv_f32.shape)}"
        )
    if block_n <= 0 or block_k <= 0 or row0 < 0 or col0 < 0:
        raise NumericsError(
            f"resolve_block: bad geometry row0={row0} col0={col0} block=({block_n}, {block_k})"
        )
    rows, cols = w_fp8.shape
    tile_r0, tile_c0 = row0 // block_n, col0 // block_k
    want_tr = (row0 + rows - 1) // block_n - tile_r0 + 1 if rows else 0
    want_tc = (col0 + cols - 1) // block_k - tile_c0 + 1 if cols else 0
    if tuple(scale_inv_f32.shape) != (want_tr, want_tc):
        raise NumericsError(
            f"resolve_block: weight slice rows [{row0}, {row0 + rows}) cols [{col0}, {col0 + cols}) "
            f"with block ({block_n}, {block_k}) is covered by {want_tr}x{want_tc} tiles starting at "
            f"tile ({tile_r0}, {tile_c0}); got a scale of shape {tuple(scale_inv_f32.shape)}"
        )
    out = torch.empty((rows, cols), dtype=dtype, device=w_fp8.device)
    if rows == 0 or cols == 0:
        return out
    scale = scale_inv_f32.to(w_fp8.device)
    # Column tile of every local column, relative to the slice's first tile.
    col_tile = (
        torch.arange(col0, col0 + cols, device=w_fp8.device, dtype=torch.int64) // block_k - tile_c0
    )
    # One tile row at a time: the scale row is broadcast over the tile's rows, so no
    # [r, c] float32 scale is ever materialised.
    for i in range(want_tr):
        r_start = max((tile_r0 + i) * block_n, row0) - row0
        r_end = min((tile_r0 + i + 1) * block_n, row0 + rows) - row0
        scale_row = scale[i].index_select(0, col_tile)
        product_f32 = w_fp8[r_start:r_end].to(torch.float32) * scale_row
        out[r_start:r_end].copy_(product_f32.to(dtype))
    return out


def check_block_scales(
    scale_inv_f32: torch.Tensor,
    *,
    tensor: str,
    file: str,
    tile_row0: int,
    tile_col0: int,
    allow_nonfinite: bool,
) -> None:
    """Refuse NaN, Inf, zero or negative float32 block scales (docs/contract.md §1.1): the torch
    face of :func:`mxload.workers.numerics.scales.check_block_scales`, which says what passes and
    what the :class:`~orchestrator.errors.NonFiniteScale` it raises names."""
    if scale_inv_f32.dtype != torch.float32:
        raise NumericsError(
            f"{file}: {tensor}: block scale has dtype {scale_inv_f32.dtype}; expected float32",
            file=file,
            tensor=tensor,
        )
    _scales.check_block_scales(
        scale_inv_f32.detach().cpu().contiguous().numpy(),
        tensor=tensor,
        file=file,
        tile_row0=tile_row0,
        tile_col0=tile_col0,
        allow_nonfinite=allow_nonfinite,
    )


# --- docs/contract.md §2.2: MX quantize ------------------------------------------------------------


def _scale_bytes_of_groups(x32: torch.Tensor) -> torch.Tensor:
    """Steps 1-2 of docs/contract.md §2.2 on float32 groups ``[..., g, 32]``: int32 ``[..., g]``."""
    exp_field = x32.view(torch.int32) >> _F32_EXP_SHIFT
    exp_field.bitwise_and_(_F32_EXP_MASK)
    emax = exp_field.amax(dim=-1)
    return torch.where(
        emax == _F32_EXP_MASK,
        torch.full_like(emax, E8M0_NAN),
        torch.clamp(emax, min=E4M3_EMAX) - E4M3_EMAX,
    )


_ALG1_MANT_CUT = 0x600000
"""1.75 = 448 / 2**8 as a float32 mantissa field: an amax significand above it makes
``amax / 448`` exceed a power of two (docs/contract.md §2.2, ``scale_alg=1``)."""
_ALG1_NORMAL_MIN = (9 << _F32_EXP_SHIFT) | _ALG1_MANT_CUT
"""f32 magnitude bits of ``448 * 2**-126``: from here ``amax / 448`` is a normal float32."""
_ALG1_SUB_CUT = 224 * ((1 << 23) + 1)
"""``amax`` in units of 2**-149 above which ``RNE(amax / 448)`` has a subnormal mantissa
above one half (or is 2**-126 itself): scale byte 1, else 0."""


def _scale_bytes_alg1(x32: torch.Tensor) -> torch.Tensor:
    """docs/contract.md §2.2 with ``scale_alg=1`` on float32 groups ``[..., g, 32]``: int32
    ``[..., g]``. ``S`` is the biased exponent of ``Q = RNE_f32(amax / 448)``, plus one if
    ``Q`` has a non-zero mantissa (normal ``Q``) or a mantissa above one half (subnormal
    ``Q``). Exactly, from the bits of ``amax = 1.m * 2**(e - 127)``: for a normal ``Q``,
    ``S = e - 8 + (m > 0x600000)`` (1.75 = 448 / 2**8; a float32 amax cannot fall inside
    Q's rounding tie band); below, ``S = 1`` iff ``amax > 448 * (2**23 + 1) * 2**-150``."""
    mag = x32.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    amag = mag.amax(dim=-1)  # NaN bits > Inf bits > any finite magnitude
    e = amag >> _F32_EXP_SHIFT
    m = amag & 0x7FFFFF
    normal_s = e - E4M3_EMAX + (m > _ALG1_MANT_CUT).to(torch.int64)
    # amax in units of 2**-149 (only where it is below 448 * 2**-126: e <= 9)
    small_e = e.clamp(max=9)
    units = torch.where(small_e == 0, m, (m | (1 << 23)) << (small_e - 1).clamp(min=0))
    small_s = (units > _ALG1_SUB_CUT).to(torch.int64)
    out = torch.where(amag >= _ALG1_NORMAL_MIN, normal_s, small_s)
    return torch.where(e == _F32_EXP_MASK, torch.full_like(out, E8M0_NAN), out).to(torch.int32)


def _check_scale_alg(scale_alg: int, what: str) -> None:
    if scale_alg not in SCALE_ALGS:
        raise NumericsError(f"{what}: scale_alg must be one of {SCALE_ALGS}, got {scale_alg!r}")


def mx_scale_bytes(x: torch.Tensor, scale_alg: int = 0) -> torch.Tensor:
    """The E8M0 scale byte of every 32-group of ``x`` ``[..., K]`` as int32 ``[..., K/32]``.

    Step 1-2 of docs/contract.md §2.2: ``Emax`` is the largest biased exponent field of the exact
    float32 values (bf16/fp32 subnormals have field 0; fp16 values, subnormals included,
    become normal float32 with their true exponent); ``S = 0xFF`` if ``Emax == 255`` else
    ``max(Emax, 8) - 8``. With ``scale_alg=1`` the scale byte is :func:`_scale_bytes_alg1`'s.
    """
    _check_dtype(x, MODEL_TORCH_DTYPES, "mx_scale_bytes: x")
    _check_scale_alg(scale_alg, "mx_scale_bytes")
    x32 = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // MX_GROUP, MX_GROUP)
    if scale_alg == SCALE_ALG_E4M3_CEIL:
        return _scale_bytes_alg1(x32)
    return _scale_bytes_of_groups(x32)


def mx_quantize(x: torch.Tensor, scale_alg: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``x`` ``[..., K]`` along K in groups of 32 (docs/contract.md §2.2).

    Returns ``(payload, scale)``: ``payload`` ``float8_e4m3fn`` ``[..., K]`` and ``scale``
    ``uint8`` ``[..., K/32]`` (E8M0 biased exponents). ``y = e4m3_rne_saturating(x * r)``
    with ``r = 2**(127 - S)`` for ``1 <= S <= 254`` and ``r = NaN`` for ``S = 0xFF`` (the
    group is NaN); for ``S = 0``, ``scale_alg=0`` takes ``r = 0`` (the group is ±0, sign
    kept) and ``scale_alg=1`` ``r = 2**127`` (its rule scales every group by
    ``1 / 2**(S - 127)``).

    Scratch beyond the input and the outputs: at most 8 bytes per element for bf16/fp16
    input (a float32 copy, then float32 exponents or scaled values), 4 for float32.
    """
    _check_dtype(x, MODEL_TORCH_DTYPES, "mx_quantize: x")
    _check_scale_alg(scale_alg, "mx_quantize")
    if x.dim() == 0 or x.shape[-1] % MX_GROUP != 0:
        raise NumericsError(
            f"mx_quantize: last dimension must be a multiple of {MX_GROUP}, got shape "
            f"{tuple(x.shape)} (docs/contract.md §2.2: such a linear stays resolved in the model dtype)"
        )
    x32 = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // MX_GROUP, MX_GROUP)
    ceil_alg = scale_alg == SCALE_ALG_E4M3_CEIL
    scale_s = _scale_bytes_alg1(x32) if ceil_alg else _scale_bytes_of_groups(x32)
    r = _pow2_f32_from_exponent((E8M0_BIAS - scale_s).clamp(min=-127))
    if not ceil_alg:
        r = torch.where(scale_s == 0, torch.zeros_like(r), r)
    r = torch.where(scale_s == E8M0_NAN, torch.full_like(r, float("nan")), r)
    scaled = x32 * r.unsqueeze(-1)  # a new tensor: x32 may alias a float32 input
    del x32
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)  # NaN stays NaN; ±0 keeps its sign
    payload = scaled.to(torch.float8_e4m3fn).reshape(x.shape)
    return payload, scale_s.to(torch.uint8)


def _check_mx_pair(payload: torch.Tensor, scale: torch.Tensor, what: str) -> torch.Tensor:
    """Validate an MX (payload, scale) pair; return the scale viewed as uint8."""
    _check_dtype(payload, (torch.float8_e4m3fn,), f"{what}: payload")
    _check_dtype(scale, (torch.uint8, torch.float8_e8m0fnu), f"{what}: scale")
    scale_u8 = scale.view(torch.uint8)
    if (
        payload.dim() == 0
        or payload.shape[-1] % MX_GROUP != 0
        or tuple(scale_u8.shape) != (*payload.shape[:-1], payload.shape[-1] // MX_GROUP)
    ):
        raise NumericsError(
            f"{what}: payload {tuple(payload.shape)} and scale {tuple(scale_u8.shape)} do not "
            f"pair up: expected scale [..., K/{MX_GROUP}] for payload [..., K], K % {MX_GROUP} == 0"
        )
    return scale_u8


def mx_dequantize(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x' = f32(y) * 2**(S - 127)`` in float32; ``S = 0xFF`` gives NaN (docs/contract.md §2.2).

    The product is exact in float32 except where it overflows (``S`` near 254) or
    underflows below the f32 subnormal range, neither of which a quantized group produces.
    """
    scale_u8 = _check_mx_pair(payload, scale, "mx_dequantize")
    s = scale_u8.to(torch.int32)
    factor = _pow2_f32_from_exponent((s - E8M0_BIAS).clamp(max=127))
    factor = torch.where(s == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    y32 = payload.to(torch.float32).reshape(*payload.shape[:-1], -1, MX_GROUP)
    return (y32 * factor.unsqueeze(-1)).reshape(payload.shape)


def resolve_mx(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP8 source weight in the model dtype: dequantize, then one RNE rounding.

    Used where an MXFP8 checkpoint's linear must fall back to the model dtype (its local K
    is not a multiple of 32 after sharding, docs/contract.md §2.2).
    """
    _check_dtype(torch.empty(0, dtype=dtype), MODEL_TORCH_DTYPES, "resolve_mx: dtype")
    return mx_dequantize(payload, scale).to(dtype)
