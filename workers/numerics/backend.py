"""Where a worker computes: one interface over the CPU reference, a fast CPU path, CUDA
and the NPU (docs/contract.md §4 "Devices vs placement").

The conversion loop calls :meth:`Backend.convert` and never asks which device it is on.
:func:`mxload.workers.numerics.select.select_backend` turns ``--device`` into one of
these; torch_npu, the CUDA runtime and the fused CPU kernel (:mod:`.fast`) are imported
only there, so the planner, the CLI and CPU-only tests import this module on any machine.

Every backend must match the reference byte for byte (NaN bytes 0x7F and 0xFF equal);
``tests/device/`` checks the device backends with the named case table. Memory queries
return ``None`` on CPU, where the staging pool's high-water mark is the measure (§6).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from ...orchestrator.errors import NumericsError
from . import reference

ResolveFn = Callable[..., torch.Tensor]
QuantizeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
QuantizeIntoFn = Callable[..., None]

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
        quantize_into_fn: QuantizeIntoFn | None = None,
        convert_fn: ConvertFn | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.note = note
        self._resolve_fn: ResolveFn = resolve_fn or reference.resolve_block
        self._quantize_fn: QuantizeFn = quantize_fn or reference.mx_quantize
        self._quantize_into_fn = quantize_into_fn
        self._convert_fn = convert_fn
        self._on_cpu = device.type == "cpu"
        self.scale_alg = 0
        """The MX scale rule of every quantize (docs/contract.md §2.2; :meth:`with_scale_alg`)."""

    def with_scale_alg(self, scale_alg: int) -> Backend:
        """This backend quantizing under ``scale_alg`` (0: OCP, 1: from the E4M3 maximum,
        rounded up; docs/contract.md §2.2). The fused convert kernel implements rule 0
        only: under rule 1 a part is resolved, then quantized, on the same device paths."""
        from ...orchestrator.plan.formats import SCALE_ALGS

        if scale_alg not in SCALE_ALGS:
            raise NumericsError(f"scale_alg must be one of {SCALE_ALGS}, got {scale_alg!r}")
        if scale_alg == self.scale_alg:
            return self
        other = copy.copy(self)
        other.scale_alg = scale_alg
        if scale_alg != 0:
            other._convert_fn = None
        return other

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
        """docs/contract.md §2.2 under :attr:`scale_alg`; the scale comes back as ``uint8``
        ``[..., K/32]``."""
        if self.scale_alg:
            return self._quantize_fn(self.to_device(x), scale_alg=self.scale_alg)
        return self._quantize_fn(self.to_device(x))

    def mx_quantize_into(self, x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
        """:meth:`mx_quantize` written into the uint8 tensors ``q_out`` ``[..., K]`` and
        ``s_out`` ``[..., K/32]`` (views of a message buffer, say): straight there where
        the backend can (nothing allocated), else through its own results."""
        if self._quantize_into_fn is not None and q_out.is_contiguous() and s_out.is_contiguous():
            self._quantize_into_fn(self.to_device(x), q_out, s_out, self.scale_alg)
            return
        q, s = self.mx_quantize(x)
        q_out.copy_(q.view(torch.uint8))
        s_out.copy_(s)

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
        from .repack import write_rows

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
                # staging, copied into the buffer at once: kept in cache
                write_rows(into[i].weight, into[i].scale, payload, scale, p.out_row0, final=False)
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
