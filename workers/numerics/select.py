"""Which backend a worker converts on: ``--device`` turned into a
:class:`~mxload.workers.numerics.backend.Backend`, with ``note`` saying why it chose what it
chose (``"cpu: torch_npu is not installed"``; docs/contract.md §4 "Devices vs placement").

torch_npu, the CUDA runtime and the fused CPU kernel (:mod:`.fast`) are imported only when
a backend is selected; where the fast path is missing or unavailable, the reference is used.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ...orchestrator.errors import UsageError
from .backend import DEVICE_CHOICES, Backend, CudaBackend
from .npu import NpuBackend


def _cpu_backend(prefer_fast: bool, why: str) -> Backend:
    """The CPU backend: the fused kernel of ``mxload.workers.numerics.fast`` when it is there and
    says it can run, else the reference. ``note`` reads ``"cpu: <why>; <which CPU path>"``."""
    cpu = torch.device("cpu")
    if not prefer_fast:
        return Backend(
            "cpu-reference", cpu, f"cpu: {why}; reference path (fast path not requested)"
        )
    try:
        fast: ModuleType | None = importlib.import_module("mxload.workers.numerics.fast")
    except ImportError as exc:
        fast = None
        fast_why = f"no fast CPU path ({exc})"
    if fast is not None:
        try:
            available = bool(fast.fast_available())
        except Exception as exc:  # a broken optional kernel must not stop a load
            available = False
            fast_why = f"fast CPU path unusable ({type(exc).__name__}: {exc})"
        else:
            fast_why = "fast CPU path reports it is not available"
        if available:
            return Backend(
                "cpu-fast",
                cpu,
                f"cpu: {why}; fast path",
                resolve_fn=fast.resolve_block,
                quantize_fn=fast.mx_quantize,
                quantize_into_fn=fast.mx_quantize_into,
                convert_fn=fast.convert,
            )
    return Backend("cpu-reference", cpu, f"cpu: {why}; reference path, {fast_why}")


def _import_torch_npu() -> tuple[Any, str]:
    """(torch_npu module or None, reason it is unusable)."""
    try:
        module = importlib.import_module("torch_npu")
    except ImportError as exc:
        return None, f"torch_npu is not installed ({exc})"
    except Exception as exc:  # torch_npu raises RuntimeError when CANN is broken
        return None, f"torch_npu failed to import ({type(exc).__name__}: {exc})"
    return module, ""


def _npu_visible(visible_devices: str | None) -> tuple[bool, str]:
    if visible_devices is not None and visible_devices.strip() == "":
        return False, "no NPU is visible (ASCEND_RT_VISIBLE_DEVICES is empty)"
    npu = getattr(torch, "npu", None)
    try:
        count = int(npu.device_count()) if npu is not None and npu.is_available() else 0
    except Exception as exc:
        return False, f"torch.npu is unusable ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "torch_npu is installed but no NPU is visible"
    return True, ""


def select_backend(
    device: str = "auto", *, visible_devices: str | None = None, prefer_fast: bool = True
) -> Backend:
    """Turn ``--device`` into a :class:`Backend` (docs/contract.md §4).

    - ``"cpu"``: the CPU backend (``"cpu-fast"`` if ``mxload.workers.numerics.fast`` is there and
      available and ``prefer_fast``, else ``"cpu-reference"``).
    - ``"npu"``: :class:`mxload.workers.numerics.npu.NpuBackend`; a :class:`UsageError` naming
      ``--device`` if torch_npu cannot be imported or no NPU is visible.
    - ``"cuda"``: :class:`CudaBackend`; a :class:`UsageError` if CUDA is unavailable.
    - ``"auto"``: npu if torch_npu imports and an NPU is visible, else cuda if available,
      else cpu; ``note`` says why.

    ``visible_devices`` is the rank's recorded ``ASCEND_RT_VISIBLE_DEVICES`` /
    ``CUDA_VISIBLE_DEVICES`` (``None`` when unknown); Ray has already restricted the
    process to it, so the chosen device is always index 0 of what the process sees.
    """
    if device not in DEVICE_CHOICES:
        raise UsageError(
            f"--device {device!r} is not one of {', '.join(DEVICE_CHOICES)}", key="--device"
        )
    where = f" (visible devices: {visible_devices})" if visible_devices else ""
    if device == "cpu":
        return _cpu_backend(prefer_fast, "--device cpu")

    if device in ("npu", "auto"):
        torch_npu, npu_why = _import_torch_npu()
        if torch_npu is not None:
            visible, npu_why = _npu_visible(visible_devices)
            if visible:
                return NpuBackend(note=f"npu: --device {device}{where}")
        if device == "npu":
            raise UsageError(
                f"--device npu: {npu_why}{where}; install torch_npu with CANN on an Ascend host, "
                "or pass --device cpu",
                key="--device",
            )
    else:
        npu_why = ""

    if torch.cuda.is_available():
        label = f"cuda: --device {device}" + (f"; {npu_why}" if npu_why else "")
        return CudaBackend(note=label + where)
    cuda_why = "CUDA is not available"
    if device == "cuda":
        raise UsageError(
            f"--device cuda: {cuda_why}{where}; pass --device cpu or run on a CUDA host",
            key="--device",
        )
    return _cpu_backend(prefer_fast, f"{npu_why}; {cuda_why}")
