"""The Ascend NPU backend: ``torch_npu.npu_dynamic_mx_quant`` for docs/contract.md §2.2.

Purpose: on an Ascend 950 the MX quantize step runs on the device's own operator,
``torch_npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=0)``
(defaults ``axis=-1``, ``round_mode="rint"``, ``block_size=32``), which returns
``(y, mxscale)``. Resolve (docs/contract.md §2.1) is plain torch on the device.

Why the post-processing:
- ``mxscale`` comes back paired, ``[..., ceil(K/64), 2]`` as ``float8_e8m0fnu``, from
  current builds and ``[..., K/32]`` from older ones; :func:`normalise_mx_scale` turns
  either into ``uint8`` ``[..., K/32]`` (an odd group count drops the pad byte).
- docs/contract.md §2.2 rule 3 pins two kinds of group that the operator's documented formula
  (``P = V / 2**(floor(log2(amax)) - 8)``) does not: a group whose scale byte is 0 is all
  ±0 (``r = 0``; the formula would divide by ``2**-127`` and keep tiny values), and a
  group whose scale byte is 0xFF is all NaN. :func:`apply_group_rules` enforces both from
  the scale bytes, so the NPU result equals the reference however a kernel build treats
  those groups. Every other byte is the operator's own, and ``tests/device`` checks it.
- float32 inputs go through the pure-torch reference on the device: the operator is
  documented for float16/bfloat16 only.

Limits: importing this module does not import torch_npu; constructing
:class:`NpuBackend` does. Nothing here is exercised on a machine without an NPU except
through a stand-in module (``tests/unit/test_numerics_backend.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ...orchestrator.errors import ConversionError, NumericsError
from ...orchestrator.plan.formats import E8M0_NAN, MX_GROUP, MX_PAIR, ceil_div
from . import reference
from .backend import Backend

_NPU_OP_DTYPES = (torch.bfloat16, torch.float16)
_E4M3_NAN_BYTE = 0x7F
_SIGN_SHIFT = 7


def normalise_mx_scale(
    mxscale: torch.Tensor, x_shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """The operator's scale as ``uint8`` ``[..., K/32]`` for an input of shape ``x_shape``.

    Accepts the paired layout ``[..., ceil(g/2), 2]`` and the flat ``[..., g]`` one, in any
    one-byte dtype (``float8_e8m0fnu``, ``uint8``, ``int8``): the bytes are reinterpreted,
    never converted, because an E8M0 -> integer conversion would change them.
    """
    if mxscale.element_size() != 1:
        raise ConversionError(
            f"npu_dynamic_mx_quant returned a scale of dtype {mxscale.dtype}; expected one byte "
            "per group (float8_e8m0fnu or uint8)"
        )
    scale_u8 = mxscale if mxscale.dtype == torch.uint8 else mxscale.view(torch.uint8)
    lead = tuple(x_shape[:-1])
    g = ceil_div(int(x_shape[-1]), MX_GROUP)
    pairs = ceil_div(g, MX_PAIR)
    shape = tuple(scale_u8.shape)
    if shape == (*lead, pairs, MX_PAIR):
        return scale_u8.reshape(*lead, pairs * MX_PAIR)[..., :g].contiguous()
    if shape == (*lead, g):
        return scale_u8.contiguous()
    raise ConversionError(
        f"npu_dynamic_mx_quant returned a scale of shape {shape} for input {tuple(x_shape)}; "
        f"expected {(*lead, pairs, MX_PAIR)} (paired) or {(*lead, g)}"
    )


def apply_group_rules(
    x: torch.Tensor, payload: torch.Tensor, scale_u8: torch.Tensor, zero_at_s0: bool = True
) -> torch.Tensor:
    """Enforce docs/contract.md §2.2 rule 3 on whole groups: scale 0 -> ±0 (sign of x;
    ``scale_alg=0`` only, ``zero_at_s0``), 0xFF -> NaN."""
    groups = scale_u8.shape[-1]
    y_u8 = payload.view(torch.uint8).reshape(*payload.shape[:-1], groups, MX_GROUP)
    s = scale_u8.unsqueeze(-1)
    if zero_at_s0:
        signed_zero = torch.signbit(x).reshape(y_u8.shape).to(torch.uint8) << _SIGN_SHIFT
        y_u8 = torch.where(s == 0, signed_zero, y_u8)
    y_u8 = torch.where(s == E8M0_NAN, torch.full_like(y_u8, _E4M3_NAN_BYTE), y_u8)
    return y_u8.reshape(payload.shape).view(torch.float8_e4m3fn)


class NpuBackend(Backend):
    """docs/contract.md §2 on an Ascend NPU: the device's MX quantize operator, torch for the rest.

    ``torch_npu_module`` exists for tests (a stand-in with the operator's contract); in a
    run it is ``None`` and torch_npu is imported here, which also registers ``torch.npu``.
    """

    def __init__(
        self,
        device: torch.device | None = None,
        note: str = "",
        *,
        torch_npu_module: Any = None,
    ) -> None:
        self._torch_npu = torch_npu_module or importlib.import_module("torch_npu")
        if device is None:
            device = torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        super().__init__("npu", device, note)

    def mx_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``npu_dynamic_mx_quant`` with the scale normalised to ``uint8`` ``[..., K/32]``."""
        x = self.to_device(x)
        if x.dtype not in _NPU_OP_DTYPES:
            return reference.mx_quantize(x, self.scale_alg)
        if x.dim() == 0 or x.shape[-1] % MX_GROUP != 0:
            raise NumericsError(
                f"mx_quantize: last dimension must be a multiple of {MX_GROUP}, got shape "
                f"{tuple(x.shape)} (docs/contract.md §2.2: such a linear stays resolved in the model dtype)"
            )
        y, mxscale = self._torch_npu.npu_dynamic_mx_quant(
            x, dst_type=torch.float8_e4m3fn, scale_alg=self.scale_alg
        )
        if y.element_size() != 1 or tuple(y.shape) != tuple(x.shape):
            raise ConversionError(
                f"npu_dynamic_mx_quant returned y of dtype {y.dtype} shape {tuple(y.shape)} "
                f"for input {tuple(x.shape)}"
            )
        payload = y if y.dtype == torch.float8_e4m3fn else y.view(torch.float8_e4m3fn)
        scale_u8 = normalise_mx_scale(mxscale, x.shape)
        return apply_group_rules(x, payload, scale_u8, zero_at_s0=self.scale_alg == 0), scale_u8

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def memory_allocated(self) -> int | None:
        return int(torch.npu.memory_allocated(self.device))  # type: ignore[attr-defined]

    def max_memory_allocated(self) -> int | None:
        return int(torch.npu.max_memory_allocated(self.device))  # type: ignore[attr-defined]

    def reset_peak_memory(self) -> None:
        torch.npu.reset_peak_memory_stats(self.device)  # type: ignore[attr-defined]
