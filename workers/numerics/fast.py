"""Fast CPU conversion path for torch tensors: block-FP8 -> resolve -> MXFP8 in one pass.

Purpose
    The functions of :mod:`mxload.workers.numerics.reference` with the same signatures and
    byte-identical results (SPEC §2; NaN payload bytes 0x7F and 0xFF count as equal), fast
    enough that CPU conversion stops being the bottleneck of a load, plus
    :func:`convert_block_to_mx_packed`, which writes the kernel layout of SPEC §2.3 in
    place (what ``repack.write_rows`` does after the reference, without the transpose
    pass). The kernels, and why they are numba and tables, are in
    :mod:`mxload.workers.numerics.kernels` (torch-free, so ``mxload convert`` can skip the torch
    import); this module validates torch arguments and launches them with
    ``torch.get_num_threads()`` threads. ``tests/unit/test_numerics_fast.py`` holds it to
    the reference and to the named case table; ``bench/bench_convert.py`` measures it.

Limits
    CPU tensors only; non-contiguous inputs are copied first. ``mx_quantize`` and the
    convert functions need ``K % 32 == 0`` (SPEC §2.2: such a linear is never
    MX-quantized). A group that straddles two scale tiles (a slice starting mid-tile)
    takes a slow per-element path; tile-aligned slices never have one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from mxload.orchestrator.errors import NumericsError
from mxload.orchestrator.plan.formats import MX_GROUP, MX_PAIR, ceil_div
from mxload.workers.numerics import kernels
from mxload.workers.numerics.kernels import MODE_FP32
from mxload.workers.numerics.reference import MODEL_TORCH_DTYPE

__all__ = [
    "convert_block_to_mx",
    "convert_block_to_mx_packed",
    "convert_parts_to_mx_packed",
    "convert_units_to_mx_packed",
    "fast_available",
    "mx_quantize",
    "resolve_block",
]

_MODES: dict[torch.dtype, int] = {t: kernels.MODE_OF[name] for name, t in MODEL_TORCH_DTYPE.items()}
"""torch dtype -> kernel mode, from the one name -> dtype table."""


def fast_available() -> bool:
    """True when numba imports and every kernel compiles and passes a tiny self-test
    (:func:`mxload.workers.numerics.kernels.available`; remembered for the process, never
    raises)."""
    return kernels.available()


def unavailable_reason() -> str | None:
    """Why :func:`fast_available` said False (None when it said True or was not asked)."""
    return kernels.unavailable_reason()


def _threads() -> int:
    """The worker's share of cores: torch's setting (a Ray worker sets it)."""
    return torch.get_num_threads()


def _check_slice(
    w_fp8: torch.Tensor,
    scale_inv_f32: torch.Tensor,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    what: str,
) -> tuple[int, int]:
    """Validate a slice exactly as ``reference.resolve_block`` does: ``scale_inv_f32``
    holds the tiles covering the slice, its ``[0, 0]`` being tile
    ``(row0 // block_n, col0 // block_k)`` (SPEC §2.1: floor of the first index).
    Returns the covering tiles' (rows, columns)."""
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2:
        raise NumericsError(
            f"{what}: w_fp8 must be a 2-D float8_e4m3fn tensor, got {w_fp8.dtype} "
            f"{tuple(w_fp8.shape)}"
        )
    if scale_inv_f32.dtype != torch.float32 or scale_inv_f32.dim() != 2:
        raise NumericsError(
            f"{what}: scale_inv_f32 must be a 2-D float32 tensor, got "
            f"{scale_inv_f32.dtype} {tuple(scale_inv_f32.shape)}"
        )
    if not (w_fp8.is_cpu and scale_inv_f32.is_cpu):
        raise NumericsError(f"{what}: the fast CPU path takes CPU tensors only")
    if block_n <= 0 or block_k <= 0 or row0 < 0 or col0 < 0:
        raise NumericsError(
            f"{what}: bad geometry row0={row0} col0={col0} block=({block_n}, {block_k})"
        )
    n, k = w_fp8.shape
    tile_r0, tile_c0 = row0 // block_n, col0 // block_k
    want_tr = (row0 + n - 1) // block_n - tile_r0 + 1 if n else 0
    want_tc = (col0 + k - 1) // block_k - tile_c0 + 1 if k else 0
    if tuple(scale_inv_f32.shape) != (want_tr, want_tc):
        raise NumericsError(
            f"{what}: weight slice rows [{row0}, {row0 + n}) cols [{col0}, {col0 + k}) with "
            f"block ({block_n}, {block_k}) is covered by {want_tr}x{want_tc} tiles starting at "
            f"tile ({tile_r0}, {tile_c0}); got a scale of shape {tuple(scale_inv_f32.shape)}"
        )
    return want_tr, want_tc


def _as_block(w_fp8: torch.Tensor, scale_inv_f32: torch.Tensor) -> kernels.Block:
    """A slice :func:`_check_slice` accepted, as the kernels take it."""
    n, k = w_fp8.shape
    w = w_fp8.contiguous().view(torch.uint8).reshape(-1).numpy()
    sbits = scale_inv_f32.contiguous().view(torch.int32).numpy().view(np.uint32)
    return kernels.make_block(w, n, k, sbits)


def _mode(dtype: torch.dtype, what: str) -> int:
    if dtype not in _MODES:
        raise NumericsError(f"{what}: dtype must be bfloat16, float16 or float32, got {dtype}")
    return _MODES[dtype]


# =========================================================================================
# Public API (same signatures and semantics as workers.numerics.reference)
# =========================================================================================


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
    """SPEC §2.1, as ``reference.resolve_block``: ``w_fp8`` ``[n, k]`` holds rows
    ``[row0, row0 + n)`` and cols ``[col0, col0 + k)`` of the source weight and
    ``scale_inv_f32`` exactly the tiles covering them; returns ``[n, k]`` in ``dtype``."""
    kernels.require()
    mode = _mode(dtype, "resolve_block")
    _check_slice(w_fp8, scale_inv_f32, row0, col0, block_n, block_k, "resolve_block")
    b = _as_block(w_fp8, scale_inv_f32)
    out = torch.empty((b.n, b.k), dtype=torch.int32 if mode == MODE_FP32 else torch.int16)
    out_np = out.view(-1).numpy().view(np.uint32 if mode == MODE_FP32 else np.uint16)
    kernels.run_resolve(b, row0, col0, block_n, block_k, mode, out_np, _threads())
    return out.view(dtype)


def mx_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §2.2, as ``reference.mx_quantize``: ``[..., K]`` bf16/fp16/fp32 ->
    (float8_e4m3fn ``[..., K]``, uint8 ``[..., K // 32]``); K must be a multiple of 32."""
    kernels.require()
    if x.dtype not in _MODES:
        raise NumericsError(f"mx_quantize: x has dtype {x.dtype}; expected bf16, fp16 or fp32")
    if x.dim() == 0 or x.shape[-1] % MX_GROUP != 0:
        raise NumericsError(
            f"mx_quantize: last dimension must be a multiple of {MX_GROUP}, got shape "
            f"{tuple(x.shape)} (SPEC §2.2: such a linear stays resolved in the model dtype)"
        )
    if x.device.type != "cpu":
        raise NumericsError("mx_quantize: the fast CPU path takes CPU tensors only")
    shape = tuple(x.shape)
    q = torch.empty(shape, dtype=torch.uint8)
    s = torch.empty((*shape[:-1], shape[-1] // MX_GROUP), dtype=torch.uint8)
    if x.dtype == torch.bfloat16:
        bits = x.contiguous().view(torch.int16).reshape(-1).numpy().view(np.uint16)
        is_bf16 = True
    else:
        # fp16 widens exactly to fp32, and SPEC §2.2 takes fp16's Emax from that f32.
        bits = x.contiguous().float().view(torch.int32).reshape(-1).numpy().view(np.uint32)
        is_bf16 = False
    kernels.run_mx(bits, is_bf16, q.view(-1).numpy(), s.view(-1).numpy(), _threads())
    return q.view(torch.float8_e4m3fn), s


def convert_block_to_mx(
    w_fp8: torch.Tensor,
    scale_inv_f32: torch.Tensor,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mx_quantize(resolve_block(...))`` fused in one pass over the source:
    (float8_e4m3fn ``[n, k]``, uint8 ``[n, k // 32]``); k must be a multiple of 32."""
    kernels.require()
    mode = _mode(dtype, "convert_block_to_mx")
    _check_slice(w_fp8, scale_inv_f32, row0, col0, block_n, block_k, "convert_block_to_mx")
    b = _as_block(w_fp8, scale_inv_f32)
    if b.k % MX_GROUP != 0:
        raise NumericsError(
            f"convert_block_to_mx: K = {b.k} is not a multiple of {MX_GROUP} (SPEC §2.2: "
            "such a linear stays resolved in the model dtype)"
        )
    q = torch.empty((b.n, b.k), dtype=torch.uint8)
    s = torch.empty((b.n, b.k // MX_GROUP), dtype=torch.uint8)
    q_np, s_np = q.view(-1).numpy(), s.view(-1).numpy()
    kernels.run_convert(b, row0, col0, block_n, block_k, mode, False, q_np, s_np, 0, 0, _threads())
    return q.view(torch.float8_e4m3fn), s


def convert_block_to_mx_packed(
    w_fp8: torch.Tensor,
    scale_inv_f32: torch.Tensor,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
    out_weight: torch.Tensor,
    out_scale: torch.Tensor,
    out_row0: int,
) -> None:
    """The fused conversion written in place into the kernel layout (SPEC §2.3).

    Row ``i`` of the block becomes column ``out_row0 + i`` of ``out_weight`` ``[K, N_total]``
    (float8_e4m3fn, or its uint8 view) and of ``out_scale`` ``[ceil(g/2), N_total, 2]``
    uint8; with an odd ``g`` the last pair's second byte of those columns is written 0.
    Nothing else is touched, so the buffers can be persistent (views of a MoE stack
    included, as long as they are contiguous). Equals ``repack.write_rows`` of
    :func:`convert_block_to_mx`'s result, byte for byte.
    """
    convert_parts_to_mx_packed(
        [(w_fp8, scale_inv_f32, row0, col0, out_row0)],
        block_n=block_n,
        block_k=block_k,
        dtype=dtype,
        out_weight=out_weight,
        out_scale=out_scale,
        what="convert_block_to_mx_packed",
    )


Part = tuple[torch.Tensor, torch.Tensor, int, int, int]
"""``(w_fp8, scale_inv_f32, row0, col0, out_row0)``: one slice of a unit."""


def convert_parts_to_mx_packed(
    parts: Sequence[Part],
    *,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
    out_weight: torch.Tensor,
    out_scale: torch.Tensor,
    what: str = "convert_parts_to_mx_packed",
) -> None:
    """:func:`convert_block_to_mx_packed` of every ``(w_fp8, scale_inv_f32, row0, col0,
    out_row0)`` part of one unit (one K) in one kernel launch, such as an expert's gate
    and up. Byte for byte the same as one call per part."""
    convert_units_to_mx_packed(
        [(parts, out_weight, out_scale)], block_n=block_n, block_k=block_k, dtype=dtype, what=what
    )


def convert_units_to_mx_packed(
    units: Sequence[tuple[Sequence[Part], torch.Tensor, torch.Tensor]],
    *,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
    what: str = "convert_units_to_mx_packed",
) -> None:
    """:func:`convert_parts_to_mx_packed` of several units, each ``(parts, out_weight,
    out_scale)`` with its own K, in one kernel launch when every output is a view of one
    storage (the loader's staging lease for a step), else one launch per unit. Byte for
    byte the same as one call per unit: what the loader calls for a step of small units
    (a tp = 8 expert's halves are 0.2-0.4 MB; a launch and its checks cost ~0.2 ms).
    The units' outputs must not overlap (each is written only in its parts' columns).

    The payloads are read in place when they are views of one buffer at offsets that are
    multiples of 8 (a staging lease split per part); otherwise they are copied once into
    an aligned buffer first."""
    kernels.require()
    mode = _mode(dtype, what)
    outs: list[torch.Tensor] = []
    for _, out_weight, out_scale in units:
        _check_out(out_weight, out_scale, what)
        outs += (out_weight, out_scale)
    if not units:
        return
    base = outs[0].untyped_storage().data_ptr()
    if len(units) > 1 and any(t.untyped_storage().data_ptr() != base for t in outs):
        for u in units:  # outputs in separate storages: one launch each
            convert_units_to_mx_packed(
                [u], block_n=block_n, block_k=block_k, dtype=dtype, what=what
            )
        return
    n_parts = sum(len(u[0]) for u in units)
    table = np.empty((n_parts, kernels.PART_FIELDS), dtype=np.int64)
    payloads: list[torch.Tensor] = []
    scales: list[np.ndarray] = []
    sb0 = 0
    p = 0
    if len(units) == 1:  # its own two arrays, wherever they live
        q_np = units[0][1].view(torch.uint8).view(-1).numpy()
        s_np = units[0][2].view(-1).numpy()
        out_base = (units[0][1].data_ptr(), units[0][2].data_ptr())
    else:  # one array over the storage all outputs are views of
        q_np = s_np = _whole(outs[0])
        out_base = (base, base)
    for parts, out_weight, out_scale in units:
        k, n_total = out_weight.shape
        q_off = out_weight.data_ptr() - out_base[0]
        s_off = out_scale.data_ptr() - out_base[1]
        for w, sc, row0, col0, out_row0 in parts:
            ti, tj = _check_slice(w, sc, row0, col0, block_n, block_k, f"{what}: part {p}")
            n = w.shape[0]
            if w.shape[1] != k:
                raise NumericsError(
                    f"{what}: part {p}: w_fp8 has {w.shape[1]} columns, out_weight's K is {k}"
                )
            if out_row0 < 0 or out_row0 + n > n_total:
                raise NumericsError(
                    f"{what}: a [{n}, {k}] block at column {out_row0} does not fit out_weight "
                    f"{tuple(out_weight.shape)} ([K, N_total])"
                )
            # the last column holds the unit's rows: run_convert_parts makes it the rows
            # per work item
            table[p] = (0, n, row0, col0, out_row0, sb0, ti, tj, k, q_off, s_off, n_total, n_total)
            sb0 += ti * tj
            payloads.append(w if w.is_contiguous() else w.contiguous())
            scales.append(sc.contiguous().view(torch.int32).numpy().reshape(-1))
            p += 1
    if not n_parts:
        return
    src = _payload_source(payloads, table)
    sbits = (scales[0] if len(scales) == 1 else np.concatenate(scales)).view(np.uint32)
    kernels.run_convert_parts(src, table, sbits, block_n, block_k, mode, q_np, s_np, _threads())
    for parts, out_weight, out_scale in units:
        g = out_weight.shape[0] // MX_GROUP
        if g % MX_PAIR:
            s3 = out_scale.numpy()
            for w, *_, out_row0 in parts:
                s3[-1, out_row0 : out_row0 + w.shape[0], 1] = 0  # SPEC §2.3: odd g pads with 0


def _check_out(out_weight: torch.Tensor, out_scale: torch.Tensor, what: str) -> None:
    """A packed output pair: ``[K, N]`` fp8/uint8 payload, ``[ceil(g/2), N, 2]`` uint8
    scales, both contiguous CPU tensors, K a multiple of 32."""
    if out_weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or out_weight.dim() != 2:
        raise NumericsError(
            f"{what}: out_weight must be a 2-D float8_e4m3fn or uint8 tensor, got "
            f"{out_weight.dtype} {tuple(out_weight.shape)}"
        )
    k, n_total = out_weight.shape
    if k % MX_GROUP != 0:
        raise NumericsError(f"{what}: K = {k} is not a multiple of {MX_GROUP} (SPEC §2.2)")
    want_scale = (ceil_div(k // MX_GROUP, MX_PAIR), n_total, MX_PAIR)
    if out_scale.dtype != torch.uint8 or tuple(out_scale.shape) != want_scale:
        raise NumericsError(
            f"{what}: out_scale must be uint8 {want_scale}, got {out_scale.dtype} "
            f"{tuple(out_scale.shape)}"
        )
    for name, t in (("out_weight", out_weight), ("out_scale", out_scale)):
        if not t.is_cpu or not t.is_contiguous():
            raise NumericsError(f"{what}: {name} must be a contiguous CPU tensor")


def _whole(t: torch.Tensor) -> np.ndarray:
    """The whole storage ``t`` is a view of, as a flat uint8 numpy array."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()


def _payload_source(payloads: Sequence[torch.Tensor], table: np.ndarray) -> np.ndarray:
    """One 8-byte aligned uint8 array holding every part's payload; fills the offsets
    column of ``table``. No copy when the payloads are views of one storage at offsets
    that are multiples of 8 (the loader's lease); else one copy into a fresh array."""
    storage = payloads[0].untyped_storage()
    base = storage.data_ptr()
    offsets = [w.data_ptr() - base for w in payloads]
    same = all(w.untyped_storage().data_ptr() == base for w in payloads[1:])
    if same and base % 8 == 0 and all(o % 8 == 0 for o in offsets):
        end = max(o + w.numel() for o, w in zip(offsets, payloads, strict=True))
        table[:, 0] = offsets
        return _whole(payloads[0])[:end]
    # K is a multiple of 32, so back-to-back payloads keep 8-byte offsets
    src = np.empty(sum(w.numel() for w in payloads), dtype=np.uint64).view(np.uint8)
    at = 0
    for p, w in enumerate(payloads):
        nbytes = w.numel()
        src[at : at + nbytes] = w.view(torch.uint8).reshape(-1).numpy()
        table[p, 0] = at
        at += nbytes
    return src
