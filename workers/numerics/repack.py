"""Kernel layouts of MX weights (docs/contract.md §2.3): pack, unpack, and in-place row writes.

Purpose: turn the row-major MX result of a linear (payload ``[N, K]``, scale ``[N, g]``,
``g = K/32``) into what the Ascend 950 quantized matmul reads, and back (for dumps and
tests):
- ``weight``: ``float8_e4m3fn`` ``[K, N]`` contiguous, the transpose of the payload;
- ``weight_scale``: ``uint8`` ``[ceil(g/2), N, 2]`` contiguous, element ``[j, n, p]`` is
  the scale byte of row ``n``, group ``2j + p``; an odd ``g`` pads the last pair with 0.
Fused MoE stacks those per expert: ``[E, K, N]`` and ``[E, ceil(g/2), N, 2]``.

Why ``write_rows``: conversion runs in row chunks when the staging budget is smaller than
a unit (docs/contract.md §6), and reloads must write persistent buffers in place (graph stability,
docs/contract.md §4). Output rows are columns of the transposed buffers, so a chunk's write is a
strided ``copy_`` into a view; nothing is ever rebound.

Limits: the pack functions allocate their results (they are for whole tensors and
tests); the conversion loop writes buffers through ``write_rows``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...orchestrator.errors import NumericsError
from ...orchestrator.plan.formats import MX_GROUP, MX_PAIR, ceil_div

_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def _as_scale_u8(scale: torch.Tensor, what: str) -> torch.Tensor:
    if scale.dtype not in _SCALE_DTYPES:
        raise NumericsError(f"{what}: scale has dtype {scale.dtype}; expected uint8 (E8M0 bytes)")
    return scale.view(torch.uint8)


def _check_payload(payload: torch.Tensor, what: str) -> None:
    if payload.dtype != torch.float8_e4m3fn:
        raise NumericsError(f"{what}: payload has dtype {payload.dtype}; expected float8_e4m3fn")


def _check_groups(k: int, g: int, what: str) -> None:
    if k % MX_GROUP != 0 or g != k // MX_GROUP:
        raise NumericsError(
            f"{what}: K = {k} needs K % {MX_GROUP} == 0 and {k // MX_GROUP} scale groups, got {g}"
        )


def pack_scale(scale_u8: torch.Tensor) -> torch.Tensor:
    """``[N, g]`` scale bytes -> ``[ceil(g/2), N, 2]`` contiguous; odd ``g`` pads with byte 0."""
    scale_u8 = _as_scale_u8(scale_u8, "pack_scale")
    if scale_u8.dim() != 2:
        raise NumericsError(f"pack_scale: expected [N, g], got {tuple(scale_u8.shape)}")
    n, g = scale_u8.shape
    pairs = ceil_div(g, MX_PAIR)
    padded = torch.zeros((n, pairs * MX_PAIR), dtype=torch.uint8, device=scale_u8.device)
    padded[:, :g].copy_(scale_u8)
    return padded.view(n, pairs, MX_PAIR).permute(1, 0, 2).contiguous()


def unpack_scale(packed: torch.Tensor, g: int) -> torch.Tensor:
    """Inverse of :func:`pack_scale`: ``[ceil(g/2), N, 2]`` -> ``[N, g]`` contiguous."""
    packed = _as_scale_u8(packed, "unpack_scale")
    if packed.dim() != 3 or packed.shape[2] != MX_PAIR or packed.shape[0] != ceil_div(g, MX_PAIR):
        raise NumericsError(
            f"unpack_scale: expected [ceil({g}/2), N, 2], got {tuple(packed.shape)}"
        )
    pairs, n, _ = packed.shape
    return packed.permute(1, 0, 2).reshape(n, pairs * MX_PAIR)[:, :g].contiguous()


def pack_linear(payload: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, K] e4m3, [N, g] u8)`` -> ``(weight [K, N], weight_scale [ceil(g/2), N, 2])``."""
    _check_payload(payload, "pack_linear")
    scale_u8 = _as_scale_u8(scale, "pack_linear")
    if payload.dim() != 2 or scale_u8.dim() != 2 or scale_u8.shape[0] != payload.shape[0]:
        raise NumericsError(
            f"pack_linear: expected payload [N, K] and scale [N, K/32], got "
            f"{tuple(payload.shape)} and {tuple(scale_u8.shape)}"
        )
    _check_groups(payload.shape[1], scale_u8.shape[1], "pack_linear")
    return payload.t().contiguous(), pack_scale(scale_u8)


def unpack_linear(
    weight: torch.Tensor, scale_packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_linear`: back to ``(payload [N, K], scale [N, g])``."""
    _check_payload(weight, "unpack_linear")
    if weight.dim() != 2:
        raise NumericsError(f"unpack_linear: expected weight [K, N], got {tuple(weight.shape)}")
    k, n = weight.shape
    _check_groups(k, k // MX_GROUP, "unpack_linear")
    scale = unpack_scale(scale_packed, k // MX_GROUP)
    if scale.shape[0] != n:
        raise NumericsError(
            f"unpack_linear: weight [K={k}, N={n}] but scale for N = {scale.shape[0]}"
        )
    return weight.t().contiguous(), scale


def _stack(parts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    return parts if isinstance(parts, torch.Tensor) else torch.stack(list(parts))


def pack_moe(
    payloads: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]``, ``[E, N, g]`` (or per-expert lists) -> ``[E, K, N]``, ``[E, ceil(g/2), N, 2]``.

    Expert ``e`` of the result is exactly :func:`pack_linear` of expert ``e``.
    """
    payload = _stack(payloads)
    scale_u8 = _as_scale_u8(_stack(scales), "pack_moe")
    _check_payload(payload, "pack_moe")
    if payload.dim() != 3 or scale_u8.dim() != 3 or scale_u8.shape[:2] != payload.shape[:2]:
        raise NumericsError(
            f"pack_moe: expected payloads [E, N, K] and scales [E, N, K/32], got "
            f"{tuple(payload.shape)} and {tuple(scale_u8.shape)}"
        )
    e, n, k = payload.shape
    g = scale_u8.shape[2]
    _check_groups(k, g, "pack_moe")
    pairs = ceil_div(g, MX_PAIR)
    padded = torch.zeros((e, n, pairs * MX_PAIR), dtype=torch.uint8, device=scale_u8.device)
    padded[:, :, :g].copy_(scale_u8)
    scale_packed = padded.view(e, n, pairs, MX_PAIR).permute(0, 2, 1, 3).contiguous()
    return payload.transpose(1, 2).contiguous(), scale_packed


def unpack_moe(
    weight: torch.Tensor, scale_packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_moe`: back to ``([E, N, K], [E, N, g])``."""
    _check_payload(weight, "unpack_moe")
    packed = _as_scale_u8(scale_packed, "unpack_moe")
    if weight.dim() != 3 or packed.dim() != 4 or packed.shape[0] != weight.shape[0]:
        raise NumericsError(
            f"unpack_moe: expected weight [E, K, N] and scale [E, ceil(g/2), N, 2], got "
            f"{tuple(weight.shape)} and {tuple(packed.shape)}"
        )
    e, k, n = weight.shape
    _check_groups(k, k // MX_GROUP, "unpack_moe")
    g = k // MX_GROUP
    if tuple(packed.shape[1:]) != (ceil_div(g, MX_PAIR), n, MX_PAIR):
        raise NumericsError(
            f"unpack_moe: weight [E={e}, K={k}, N={n}] needs scale [{e}, {ceil_div(g, MX_PAIR)}, "
            f"{n}, 2], got {tuple(packed.shape)}"
        )
    pairs = packed.shape[1]
    scale = packed.permute(0, 2, 1, 3).reshape(e, n, pairs * MX_PAIR)[:, :, :g].contiguous()
    return weight.transpose(1, 2).contiguous(), scale


def _kernels_take(*tensors: torch.Tensor) -> bool:
    """Whether the numba kernels can write into these tensors: contiguous, on the CPU,
    and the kernels compiled here."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return False
    from . import kernels

    return kernels.available()


def _put_rows(
    weight_buf: torch.Tensor, buf_u8: torch.Tensor, payload: torch.Tensor, scale_u8: torch.Tensor,
    row0: int, final: bool,
) -> bool:  # fmt: skip
    """The chunk's columns of both buffers by the numba kernel (``kernels.run_rows``): 16x16
    bytes at a time in vector registers, on the worker's threads, in one launch. torch's
    transposing copy goes a byte at a time (0.1-1 GB/s), so a strided chunk is made
    contiguous first. False where it does not run."""
    on_cpu = payload.device.type == "cpu" and scale_u8.device.type == "cpu"
    if not (on_cpu and _kernels_take(weight_buf, buf_u8)):
        return False
    from . import kernels

    payload, scale_u8 = payload.contiguous(), scale_u8.contiguous()
    kernels.run_rows(
        payload.view(torch.uint8).numpy(),
        payload.shape[1],
        weight_buf.view(torch.uint8).view(-1).numpy(),
        scale_u8.numpy(),
        scale_u8.shape[1],
        buf_u8.view(-1).numpy(),
        row0,
        torch.get_num_threads(),
        final=final,
    )
    return True


def write_rows(
    weight_buf: torch.Tensor,
    scale_buf: torch.Tensor,
    payload: torch.Tensor,
    scale: torch.Tensor,
    row0: int,
    *,
    final: bool = True,
) -> None:
    """Write output rows ``[row0, row0 + n)`` of one linear (or one expert) in place.

    ``weight_buf`` ``[K, N_total]`` and ``scale_buf`` ``[ceil(g/2), N_total, 2]`` are the
    kernel-layout buffers (or views of them, e.g. ``buffer[e]`` of a MoE stack);
    ``payload`` ``[n, K]`` and ``scale`` ``[n, g]`` are the chunk's MX result. Only the
    chunk's columns of the transposed buffers are touched, including the pad byte of an
    odd ``g`` (written 0). Writes are ``copy_``/``zero_`` into views: buffers never move.
    ``final``: the buffers are the ones the engine reads, nothing reads them soon, and the
    kernel may store whole lines past the cache; False for staging copied on at once.
    """
    _check_payload(payload, "write_rows")
    _check_payload(weight_buf, "write_rows: weight_buf")
    scale_u8 = _as_scale_u8(scale, "write_rows")
    buf_u8 = _as_scale_u8(scale_buf, "write_rows: scale_buf")
    if payload.dim() != 2 or scale_u8.dim() != 2 or weight_buf.dim() != 2 or buf_u8.dim() != 3:
        raise NumericsError(
            f"write_rows: expected weight_buf [K, N], scale_buf [ceil(g/2), N, 2], payload "
            f"[n, K], scale [n, g]; got {tuple(weight_buf.shape)}, {tuple(buf_u8.shape)}, "
            f"{tuple(payload.shape)}, {tuple(scale_u8.shape)}"
        )
    n, k = payload.shape
    g = scale_u8.shape[1]
    _check_groups(k, g, "write_rows")
    pairs = ceil_div(g, MX_PAIR)
    k_buf, n_total = weight_buf.shape
    if (
        k_buf != k
        or scale_u8.shape[0] != n
        or tuple(buf_u8.shape) != (pairs, n_total, MX_PAIR)
        or row0 < 0
        or row0 + n > n_total
    ):
        raise NumericsError(
            f"write_rows: rows [{row0}, {row0 + n}) with payload {tuple(payload.shape)} and "
            f"scale {tuple(scale_u8.shape)} do not fit weight_buf {tuple(weight_buf.shape)} / "
            f"scale_buf {tuple(buf_u8.shape)}"
        )
    if n == 0 or _put_rows(weight_buf, buf_u8, payload, scale_u8, row0, final):
        return
    weight_buf[:, row0 : row0 + n].copy_(payload.t())
    # [n, pairs, 2] view of the chunk's slots: [j, r, p] of the buffer <- scale[r, 2j + p].
    slots = buf_u8[:, row0 : row0 + n, :].permute(1, 0, 2)
    full = g // MX_PAIR
    if full:
        slots[:, :full, :].copy_(scale_u8[:, : full * MX_PAIR].reshape(n, full, MX_PAIR))
    if g % MX_PAIR:
        slots[:, full, 0].copy_(scale_u8[:, g - 1])
        slots[:, full, 1].zero_()
