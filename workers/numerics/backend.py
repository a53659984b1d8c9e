"""Where a worker computes: one interface over the CPU reference, a fast CPU path, CUDA
and the NPU (docs/contract.md §4 "Devices vs placement").

The conversion loop calls :meth:`Backend.convert` and never asks which device it is on.
:func:`select_backend` turns ``--device`` into a backend and says in ``note`` why it chose
what it chose (``"cpu: torch_npu is not installed"``). torch_npu, the CUDA runtime and
the fused CPU kernel (:mod:`.fast`) are imported only when a backend is selected, so the
planner, the CLI and CPU-only tests import this module on any machine; where the fast
path is missing or unavailable, the reference is used.

Every backend must match the reference byte for byte (NaN bytes 0x7F and 0xFF equal);
``tests/device/`` checks the device backends with the named case table. Memory queries
return ``None`` on CPU, where the staging pool's high-water mark is the measure (§6).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch
from mxload.orchestrator.errors import NumericsError, UsageError
from mxload.workers.numerics import reference

ResolveFn = Callable[..., torch.Tensor]
QuantizeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

DEVICE_CHOICES: tuple[str, ...] = ("auto", "npu", "cuda", "cpu")
"""Values of ``--device`` (docs/contract.md §5)."""


class ConvertPart(NamedTuple):
    """One slice of a block-FP8 weight for :meth:`Backend.convert`: rows
    ``[row0, row0 + n)`` and columns ``[col0, col0 + k)`` of the source in ``w_fp8``
    ``[n, k]``, exactly the tiles covering them in ``scale_inv_f32`` (docs/contract.md
    §2.1), and the output column its first row becomes when packed."""

    w_fp8: torch.Tensor
    scale_inv_f32: torch.Tensor
    row0: int = 0
    col0: int = 0
    out_row0: int = 0


class PackedOut(NamedTuple):
    """Kernel-layout outputs (docs/contract.md §2.3) a part is written into: payload
    ``weight [K, N]`` (float8_e4m3fn or its uint8 view) and ``scale [ceil(g/2), N, 2]``
    uint8. The parts of one unit share one."""

    weight: torch.Tensor
    scale: torch.Tensor


class ConvertFn(Protocol):
    """The signature of :meth:`Backend.convert` (what a fused path provides)."""

    def __call__(
        self,
        parts: Sequence[ConvertPart],
        *,
        block_n: int,
        block_k: int,
        dtype: torch.dtype,
        into: Sequence[PackedOut] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class Backend:
    """A place to compute, with the numerics of docs/contract.md §2 bound to it.

    Attributes: ``name`` (``"cpu-reference"``, ``"cpu-fast"``, ``"npu"``, ``"cuda"``),
    ``device`` (where results live), ``note`` (why this backend was chosen). The base
    class is the pure-torch reference on ``device``; subclasses swap in device kernels.
    """

    def __init__(
        self,
        name: str,
        device: torch.device,
        note: str = "",
        *,
        resolve_fn: ResolveFn | None = None,
        quantize_fn: QuantizeFn | None = None,
        convert_fn: ConvertFn | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.note = note
        self._resolve_fn: ResolveFn = resolve_fn or reference.resolve_block
        self._quantize_fn: QuantizeFn = quantize_fn or reference.mx_quantize
        self._convert_fn = convert_fn
        self._on_cpu = device.type == "cpu"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, device={self.device!s}, note={self.note!r})"
        )

    # --- numerics -------------------------------------------------------------------

    def resolve_block(
        self,
        w_fp8: torch.Tensor,
        scale_inv_f32: torch.Tensor,
        *,
        row0: int,
        col0: int,
        block_n: int,
        block_k: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """docs/contract.md §2.1 on this backend's device (see ``reference.resolve_block``)."""
        return self._resolve_fn(
            self.to_device(w_fp8),
            self.to_device(scale_inv_f32),
            row0=row0,
            col0=col0,
            block_n=block_n,
            block_k=block_k,
            dtype=dtype,
        )

    def mx_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """docs/contract.md §2.2; the scale comes back as ``uint8`` ``[..., K/32]``."""
        return self._quantize_fn(self.to_device(x))

    def convert(
        self,
        parts: Sequence[ConvertPart],
        *,
        block_n: int,
        block_k: int,
        dtype: torch.dtype,
        into: Sequence[PackedOut] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Resolve then MX-quantize every part (docs/contract.md §2.1-2.2).

        Without ``into``: each part's ``(payload [n, k] float8_e4m3fn, scale [n, k/32]
        uint8)``. With ``into`` (one :class:`PackedOut` per part): each part's rows are
        written as columns ``out_row0 ..`` of its output's kernel layout (§2.3) and ``[]``
        is returned. The fused CPU path does it all in one kernel launch; elsewhere each
        part is resolved, quantized and, when packed, put in place by
        ``repack.write_rows``. Byte-identical either way."""
        if into is not None and len(into) != len(parts):
            raise NumericsError(f"convert: {len(parts)} parts but {len(into)} outputs")
        if self._convert_fn is not None:
            on_device = [
                p._replace(
                    w_fp8=self.to_device(p.w_fp8), scale_inv_f32=self.to_device(p.scale_inv_f32)
                )
                for p in parts
            ]
            return self._convert_fn(
                on_device, block_n=block_n, block_k=block_k, dtype=dtype, into=into
            )
        from mxload.workers.numerics.repack import write_rows

        results: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, p in enumerate(parts):
            resolved = self.resolve_block(
                p.w_fp8,
                p.scale_inv_f32,
                row0=p.row0,
                col0=p.col0,
                block_n=block_n,
                block_k=block_k,
                dtype=dtype,
            )
            payload, scale = self.mx_quantize(resolved)
            if into is None:
                results.append((payload, scale))
            else:
                write_rows(into[i].weight, into[i].scale, payload, scale, p.out_row0)
        return results

    # --- device plumbing ----------------------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether resolve and quantize run as one kernel with no model-dtype
        intermediate (the memory model then plans no resolve scratch)."""
        return self._convert_fn is not None

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this backend's device (no copy when it is already there)."""
        if self._on_cpu and t.is_cpu:
            return t
        return t.to(self.device)

    def synchronize(self) -> None:
        """Wait for queued device work; a no-op on CPU."""

    def memory_allocated(self) -> int | None:
        """Bytes held by the device allocator now; ``None`` where there is none (CPU)."""
        return None

    def max_memory_allocated(self) -> int | None:
        """Allocator high-water mark since the last reset; ``None`` on CPU."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new high-water mark; a no-op on CPU."""


class CudaBackend(Backend):
    """The reference numerics run as torch ops on a CUDA device.

    The reference is pure torch and device-agnostic; the CUDA test in ``tests/device``
    proves the device's casts agree with the CPU byte for byte.
    """

    def __init__(self, device: torch.device | None = None, note: str = "") -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__("cuda", device, note)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def max_memory_allocated(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


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
                from mxload.workers.numerics.npu import NpuBackend

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
