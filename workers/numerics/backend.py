"""Where a worker computes: one interface over the CPU reference, a fast CPU path, CUDA
and the NPU (SPEC §4 "Devices vs placement", STYLE practice 3).

Purpose: the conversion loop calls ``backend.convert_block_to_mx`` and friends and never
asks which device it is on. ``select_backend`` turns ``--device`` into a backend and says
in ``note`` why it chose what it chose (``"cpu: torch_npu is not installed"``).

Why lazy imports: torch_npu and the CUDA runtime are imported only inside
``select_backend`` and the device backends, never at module import, so the planner, the
CLI and CPU-only tests import this module on any machine. The optional fused CPU kernel
(``mxload.workers.numerics.fast``) is also looked up lazily; if it is missing or says it is not
available, the reference is used.

Limits: every backend must match the reference byte for byte (NaN bytes 0x7F and 0xFF
equal); the device tests in ``tests/device/`` check that with the named case table.
Memory queries return ``None`` on CPU: there the staging pool's high-water mark is the
measure (SPEC §6).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch
from mxload.orchestrator.errors import UsageError
from mxload.workers.numerics import reference

ResolveFn = Callable[..., torch.Tensor]
QuantizeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ConvertFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

DEVICE_CHOICES: tuple[str, ...] = ("auto", "npu", "cuda", "cpu")
"""Values of ``--device`` (SPEC §5)."""


class PackedPart(NamedTuple):
    """One part of a unit for :meth:`Backend.convert_parts_to_mx_packed`: the arguments
    :meth:`Backend.convert_block_to_mx_packed` takes per part."""

    w_fp8: torch.Tensor
    scale_inv_f32: torch.Tensor
    row0: int
    col0: int
    out_row0: int


class PackedUnit(NamedTuple):
    """One unit for :meth:`Backend.convert_units_to_mx_packed`: its parts (one K) and
    the kernel-layout outputs they are written into."""

    parts: Sequence[PackedPart]
    out_weight: torch.Tensor
    out_scale: torch.Tensor


class Backend:
    """A place to compute, with the numerics of SPEC §2 bound to it.

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
        packed_fn: Callable[..., None] | None = None,
        units_fn: Callable[..., None] | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.note = note
        self._resolve_fn: ResolveFn = resolve_fn or reference.resolve_block
        self._quantize_fn: QuantizeFn = quantize_fn or reference.mx_quantize
        self._convert_fn: ConvertFn | None = convert_fn
        self._packed_fn = packed_fn
        self._units_fn = units_fn
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
        """SPEC §2.1 on this backend's device (see ``reference.resolve_block``)."""
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
        """SPEC §2.2; the scale comes back as ``uint8`` ``[..., K/32]`` on every backend."""
        return self._quantize_fn(self.to_device(x))

    def convert_block_to_mx(
        self,
        w_fp8: torch.Tensor,
        scale_inv_f32: torch.Tensor,
        *,
        row0: int,
        col0: int,
        block_n: int,
        block_k: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve then MX-quantize one block slice: ``(payload [r, c], scale [r, c/32])``."""
        if self._convert_fn is not None:
            return self._convert_fn(
                self.to_device(w_fp8),
                self.to_device(scale_inv_f32),
                row0=row0,
                col0=col0,
                block_n=block_n,
                block_k=block_k,
                dtype=dtype,
            )
        resolved = self.resolve_block(
            w_fp8,
            scale_inv_f32,
            row0=row0,
            col0=col0,
            block_n=block_n,
            block_k=block_k,
            dtype=dtype,
        )
        return self.mx_quantize(resolved)

    def convert_block_to_mx_packed(
        self,
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
        """Resolve, quantize and write the kernel layout (SPEC §2.3) in one step: rows of
        the slice become columns ``out_row0 + i`` of ``out_weight [K, N]`` and
        ``out_scale [ceil(g/2), N, 2]``. Fused on ``cpu-fast``; elsewhere convert then
        ``repack.write_rows``. Byte-identical either way."""
        kwargs = dict(row0=row0, col0=col0, block_n=block_n, block_k=block_k, dtype=dtype)
        if self._packed_fn is not None:
            self._packed_fn(
                self.to_device(w_fp8),
                self.to_device(scale_inv_f32),
                out_weight=out_weight,
                out_scale=out_scale,
                out_row0=out_row0,
                **kwargs,
            )
            return
        from mxload.workers.numerics.repack import write_rows

        payload, scale = self.convert_block_to_mx(w_fp8, scale_inv_f32, **kwargs)  # type: ignore[arg-type]
        write_rows(out_weight, out_scale, payload, scale, out_row0)

    def convert_parts_to_mx_packed(
        self,
        parts: Sequence[PackedPart],
        *,
        block_n: int,
        block_k: int,
        dtype: torch.dtype,
        out_weight: torch.Tensor,
        out_scale: torch.Tensor,
    ) -> None:
        """:meth:`convert_block_to_mx_packed` of every part of one unit (one K), byte
        for byte: :meth:`convert_units_to_mx_packed` of that one unit."""
        self.convert_units_to_mx_packed(
            [PackedUnit(parts, out_weight, out_scale)],
            block_n=block_n,
            block_k=block_k,
            dtype=dtype,
        )

    def convert_units_to_mx_packed(
        self,
        units: Sequence[PackedUnit],
        *,
        block_n: int,
        block_k: int,
        dtype: torch.dtype,
    ) -> None:
        """:meth:`convert_block_to_mx_packed` of every part of every unit (each its own
        K and outputs), byte for byte. One kernel launch on ``cpu-fast`` when the
        outputs are views of one storage (a launch and its argument checks cost about
        0.2 ms on 2 cores, as much as converting a tp = 8 expert half); one call per
        part elsewhere."""
        if self._units_fn is not None:
            self._units_fn(
                [
                    (
                        [
                            (self.to_device(p.w_fp8), self.to_device(p.scale_inv_f32), *p[2:])
                            for p in u.parts
                        ],
                        u.out_weight,
                        u.out_scale,
                    )
                    for u in units
                ],
                block_n=block_n,
                block_k=block_k,
                dtype=dtype,
            )
            return
        for u in units:
            for p in u.parts:
                self.convert_block_to_mx_packed(
                    p.w_fp8,
                    p.scale_inv_f32,
                    row0=p.row0,
                    col0=p.col0,
                    block_n=block_n,
                    block_k=block_k,
                    dtype=dtype,
                    out_weight=u.out_weight,
                    out_scale=u.out_scale,
                    out_row0=p.out_row0,
                )

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
                convert_fn=fast.convert_block_to_mx,
                packed_fn=getattr(fast, "convert_block_to_mx_packed", None),
                units_fn=getattr(fast, "convert_units_to_mx_packed", None),
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
    """Turn ``--device`` into a :class:`Backend` (SPEC §4).

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
