"""Fast CPU conversion for torch tensors: block-FP8 -> resolve -> MXFP8 in one pass.

:func:`convert` is the CPU backend's ``Backend.convert`` (:mod:`.backend`): the same
arguments and, byte for byte, the reference's results (docs/contract.md §2; NaN payload
bytes 0x7F and 0xFF count as equal), writing the kernel layout of §2.3 in place when asked.
:func:`resolve_block` and :func:`mx_quantize` mirror :mod:`.reference`. The kernels are
in :mod:`.kernels` (numpy only, so ``mxload convert`` can skip the torch import); this
module validates torch arguments and launches them with ``torch.get_num_threads()``
threads.

Limits: CPU tensors only; non-contiguous inputs are copied first. MX quantization needs
``K % 32 == 0`` (§2.2: such a linear is never MX-quantized). A group that straddles two
scale tiles (a slice starting mid-tile) takes a slow per-element path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...orchestrator.errors import NumericsError
from ...orchestrator.plan.formats import MX_GROUP, MX_PAIR, SCALE_ALGS, ceil_div
from . import kernels
from .backend import ConvertPart, PackedOut
from .kernels import MODE_FP32
from .reference import MODEL_TORCH_DTYPE

__all__ = [
    "convert",
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
    ``(row0 // block_n, col0 // block_k)`` (docs/contract.md §2.1: floor of the first index).
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
    """docs/contract.md §2.1, as ``reference.resolve_block``: ``w_fp8`` ``[n, k]`` holds rows
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


def mx_quantize(x: torch.Tensor, scale_alg: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/contract.md §2.2, as ``reference.mx_quantize``: ``[..., K]`` bf16/fp16/fp32 ->
    (float8_e4m3fn ``[..., K]``, uint8 ``[..., K // 32]``); K must be a multiple of 32;
    ``scale_alg`` 0 or 1 picks the scale rule."""
    shape = tuple(x.shape)
    q = torch.empty(shape, dtype=torch.uint8)
    s = torch.empty((*shape[:-1], shape[-1] // MX_GROUP if shape else 0), dtype=torch.uint8)
    mx_quantize_into(x, q, s, scale_alg)
    return q.view(torch.float8_e4m3fn), s


def mx_quantize_into(
    x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, scale_alg: int = 0
) -> None:
    """:func:`mx_quantize` written into ``q_out`` and ``s_out`` (uint8, C-contiguous, of
    ``x``'s shape and ``[..., K // 32]``), which may be views of a larger buffer."""
    kernels.require()
    if scale_alg not in SCALE_ALGS:
        raise NumericsError(
            f"mx_quantize: scale_alg must be one of {SCALE_ALGS}, got {scale_alg!r}"
        )
    if x.dtype not in _MODES:
        raise NumericsError(f"mx_quantize: x has dtype {x.dtype}; expected bf16, fp16 or fp32")
    if x.dim() == 0 or x.shape[-1] % MX_GROUP != 0:
        raise NumericsError(
            f"mx_quantize: last dimension must be a multiple of {MX_GROUP}, got shape "
            f"{tuple(x.shape)} (docs/contract.md §2.2: such a linear stays resolved in the model dtype)"
        )
    if x.device.type != "cpu":
        raise NumericsError("mx_quantize: the fast CPU path takes CPU tensors only")
    shape = tuple(x.shape)
    for out, want in ((q_out, shape), (s_out, (*shape[:-1], shape[-1] // MX_GROUP))):
        if (
            out.dtype != torch.uint8
            or tuple(out.shape) != want
            or not out.is_contiguous()
            or out.device.type != "cpu"
        ):
            raise NumericsError(
                f"mx_quantize: an output must be a contiguous CPU uint8 tensor of shape {want}, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
    if x.dtype == torch.bfloat16:
        bits = x.contiguous().view(torch.int16).reshape(-1).numpy().view(np.uint16)
        is_bf16 = True
    else:
        # fp16 widens exactly to fp32, and docs/contract.md §2.2 takes fp16's Emax from that f32.
        bits = x.contiguous().float().view(torch.int32).reshape(-1).numpy().view(np.uint32)
        is_bf16 = False
    q_np, s_np = q_out.view(-1).numpy(), s_out.view(-1).numpy()
    kernels.run_mx(bits, is_bf16, q_np, s_np, _threads(), scale_alg)


def convert(
    parts: Sequence[ConvertPart],
    *,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
    into: Sequence[PackedOut] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`mxload.workers.numerics.backend.Backend.convert` on the CPU: resolve and
    MX-quantize every part in one pass over its source, byte for byte the reference.

    Without ``into``: each part's (float8_e4m3fn ``[n, k]``, uint8 ``[n, k // 32]``).
    With ``into`` (one :class:`PackedOut` per part): row ``i`` of a part becomes column
    ``out_row0 + i`` of its ``weight [K, N]`` and ``scale [ceil(g/2), N, 2]``
    (docs/contract.md §2.3; an odd ``g`` writes the last pair's second byte 0); nothing
    else is touched, so the outputs may be views of persistent buffers. All parts go in
    one kernel launch when every output is a view of one storage (the loader's staging
    lease for a step: a launch and its checks cost as much as converting a small expert
    half), else one launch per output pair. Returns ``[]`` then.

    The payloads are read in place when they are views of one buffer at offsets that are
    multiples of 8 (a staging lease split per part); otherwise they are copied once into
    an aligned buffer first."""
    kernels.require()
    mode = _mode(dtype, "convert")
    if into is None:
        return [_convert_rows(p, block_n, block_k, mode) for p in parts]
    if len(into) != len(parts):
        raise NumericsError(f"convert: {len(parts)} parts but {len(into)} outputs")
    pairs: dict[tuple[int, int], PackedOut] = {}
    for o in into:
        pairs.setdefault(_key(o), o)
    for o in pairs.values():
        _check_out(o.weight, o.scale)
    if not parts:
        return []
    storages = {t.untyped_storage().data_ptr() for o in pairs.values() for t in o}
    if len(pairs) > 1 and len(storages) > 1:  # outputs in separate storages: one launch each
        for key in pairs:
            mine = [i for i, o in enumerate(into) if _key(o) == key]
            _convert_packed(
                [parts[i] for i in mine], [into[i] for i in mine], block_n, block_k, mode
            )
        return []
    _convert_packed(parts, into, block_n, block_k, mode)
    return []


def _key(o: PackedOut) -> tuple[int, int]:
    return o.weight.data_ptr(), o.scale.data_ptr()


def _convert_rows(
    part: ConvertPart, block_n: int, block_k: int, mode: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One part, row-major."""
    w_fp8, scale_inv_f32, row0, col0, _ = part
    _check_slice(w_fp8, scale_inv_f32, row0, col0, block_n, block_k, "convert")
    b = _as_block(w_fp8, scale_inv_f32)
    if b.k % MX_GROUP != 0:
        raise NumericsError(
            f"convert: K = {b.k} is not a multiple of {MX_GROUP} (docs/contract.md §2.2: "
            "such a linear stays resolved in the model dtype)"
        )
    q = torch.empty((b.n, b.k), dtype=torch.uint8)
    s = torch.empty((b.n, b.k // MX_GROUP), dtype=torch.uint8)
    q_np, s_np = q.view(-1).numpy(), s.view(-1).numpy()
    kernels.run_convert(b, row0, col0, block_n, block_k, mode, False, q_np, s_np, 0, 0, _threads())
    return q.view(torch.float8_e4m3fn), s


def _convert_packed(
    parts: Sequence[ConvertPart],
    into: Sequence[PackedOut],
    block_n: int,
    block_k: int,
    mode: int,
) -> None:
    """Every part into its output pair in one launch; the outputs are one pair, or all
    views of one storage."""
    first = into[0]
    if all(_key(o) == _key(first) for o in into):  # one pair: its own two arrays
        q_np = first.weight.view(torch.uint8).view(-1).numpy()
        s_np = first.scale.view(-1).numpy()
        out_base = _key(first)
    else:  # one array over the storage every output is a view of
        q_np = s_np = _whole(first.weight)
        base = first.weight.untyped_storage().data_ptr()
        out_base = (base, base)
    table = np.empty((len(parts), kernels.PART_FIELDS), dtype=np.int64)
    payloads: list[torch.Tensor] = []
    scales: list[np.ndarray] = []
    sb0 = 0
    for p, ((w, sc, row0, col0, out_row0), o) in enumerate(zip(parts, into, strict=True)):
        k, n_total = o.weight.shape
        ti, tj = _check_slice(w, sc, row0, col0, block_n, block_k, f"convert: part {p}")
        n = w.shape[0]
        if w.shape[1] != k:
            raise NumericsError(
                f"convert: part {p}: w_fp8 has {w.shape[1]} columns, its output's K is {k}"
            )
        if out_row0 < 0 or out_row0 + n > n_total:
            raise NumericsError(
                f"convert: a [{n}, {k}] block at column {out_row0} does not fit the output "
                f"{tuple(o.weight.shape)} ([K, N_total])"
            )
        q_off = o.weight.data_ptr() - out_base[0]
        s_off = o.scale.data_ptr() - out_base[1]
        # the last column holds the output's columns: run_convert_parts turns it into
        # the rows per work item
        table[p] = (0, n, row0, col0, out_row0, sb0, ti, tj, k, q_off, s_off, n_total, n_total)
        sb0 += ti * tj
        payloads.append(w if w.is_contiguous() else w.contiguous())
        scales.append(sc.contiguous().view(torch.int32).numpy().reshape(-1))
    src = _payload_source(payloads, table)
    sbits = (scales[0] if len(scales) == 1 else np.concatenate(scales)).view(np.uint32)
    kernels.run_convert_parts(src, table, sbits, block_n, block_k, mode, q_np, s_np, _threads())
    for (w, *_, out_row0), o in zip(parts, into, strict=True):
        if (o.weight.shape[0] // MX_GROUP) % MX_PAIR:
            # docs/contract.md §2.3: an odd g pads the last pair with 0
            o.scale.numpy()[-1, out_row0 : out_row0 + w.shape[0], 1] = 0


def _check_out(out_weight: torch.Tensor, out_scale: torch.Tensor) -> None:
    """A packed output pair: ``[K, N]`` fp8/uint8 payload, ``[ceil(g/2), N, 2]`` uint8
    scales, both contiguous CPU tensors, K a multiple of 32."""
    if out_weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or out_weight.dim() != 2:
        raise NumericsError(
            f"convert: out_weight must be a 2-D float8_e4m3fn or uint8 tensor, got "
            f"{out_weight.dtype} {tuple(out_weight.shape)}"
        )
    k, n_total = out_weight.shape
    if k % MX_GROUP != 0:
        raise NumericsError(
            f"convert: K = {k} is not a multiple of {MX_GROUP} (docs/contract.md §2.2)"
        )
    want_scale = (ceil_div(k // MX_GROUP, MX_PAIR), n_total, MX_PAIR)
    if out_scale.dtype != torch.uint8 or tuple(out_scale.shape) != want_scale:
        raise NumericsError(
            f"convert: out_scale must be uint8 {want_scale}, got {out_scale.dtype} "
            f"{tuple(out_scale.shape)}"
        )
    for name, t in (("out_weight", out_weight), ("out_scale", out_scale)):
        if not t.is_cpu or not t.is_contiguous():
            raise NumericsError(f"convert: {name} must be a contiguous CPU tensor")


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
