"""The convert stage of the rank loader: a step's read bytes into staged results.

Each unit's parts are viewed as typed tensors (block scales checked, docs/contract.md
§1.1), then converted on the backend: resolve then MX-quantize, or repack
(already-MXFP8), or quantize (a BF16 checkpoint into MX buffers), or resolve / copy into
the model dtype. MX units the fused kernel can write in their kernel layout go through
one backend call for the whole step, into one staging lease. The results are accounted
in the staging pool as the memory model plans them (``memory.unit_cost``), and handed
back as writes (:mod:`.writes`) for the loader to run once the whole step is converted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...orchestrator.plan.formats import MX_GROUP, ceil_div
from ...orchestrator.plan.memory import ConvertOptions, unit_cost
from ...orchestrator.plan.message import SourceInfo
from ...orchestrator.plan.types import Part, PartRead, Unit, UnitReads
from ..numerics.backend import ConvertPart, PackedOut
from ..numerics.reference import MODEL_TORCH_DTYPE
from ..safetensors_io import SAFETENSORS_TO_TORCH
from . import writes
from .reads import PartBytes
from .staging import Lease, StagingPool
from .writes import Write

Member = tuple[Unit, UnitReads, list[PartBytes], int]
"""One unit of a step as converted: the unit (or a row chunk of it), its reads, its
per-part (weight bytes, scale bytes) views, and the buffer row it starts at."""

UnitBuffers = Callable[[Unit], tuple[torch.Tensor, "torch.Tensor | None"]]
"""The (weight, scale) buffers a unit writes, in canonical orientation."""


@dataclass
class _Packed:
    """An MX unit the fused kernel converts into its kernel layout in staging."""

    unit: Unit
    row_base: int
    w_buf: torch.Tensor
    s_buf: torch.Tensor
    parts: list[ConvertPart] = field(default_factory=list)


@dataclass
class Converted:
    """A step's conversion: the pool leases that account for its results, and the
    writes that put them in the units' buffers."""

    reservations: list[Lease] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)


class Converter:
    """Converts units for one rank on ``backend`` into the model dtype ``model_dtype``."""

    def __init__(
        self,
        backend: Any,
        model_dtype: str,
        unit_buffers: UnitBuffers,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``buffers``: the rank's buffers by name, where units' derived tensors are."""
        self.backend = backend  # a numerics Backend, or any object with its methods
        self.dtype = MODEL_TORCH_DTYPE[model_dtype]
        self._unit_buffers = unit_buffers
        self._buffers = buffers or {}

    def convert(
        self,
        members: Sequence[Member],
        source: SourceInfo,
        pool: StagingPool,
        opts: ConvertOptions,
    ) -> Converted:
        """Convert the units (or a unit's row chunk) of one step. Units the fused kernel
        converts into their kernel layout go through one backend call together
        (:meth:`_convert_packed`); any other part on its own (:meth:`_convert_part`).
        The reservations are released here on error."""
        out = Converted()
        packed: list[_Packed] = []
        try:
            for member in members:
                staged = self._convert_unit(member, source, pool, opts, out)
                if staged is not None:
                    packed.append(staged)
            if packed:
                lease, packed_writes = self._convert_packed(packed, source, pool)
                out.reservations.append(lease)
                out.writes.extend(packed_writes)
        except BaseException:
            for lease in out.reservations:
                pool.release(lease)
            raise
        return out

    def _convert_unit(
        self,
        member: Member,
        source: SourceInfo,
        pool: StagingPool,
        opts: ConvertOptions,
        out: Converted,
    ) -> _Packed | None:
        """One unit of a step: its staging accounted and its parts converted (writes
        added to ``out``), or, when the fused kernel writes it packed, collected for
        :meth:`_convert_packed` (returned)."""
        unit, reads, raw, row_base = member
        cost = unit_cost(unit, unit.rows, reads.nbytes, opts)
        mx = unit.layout in ("mx_linear", "mx_moe")
        w_buf, s_buf = self._unit_buffers(unit)
        # The packed stage is [K, rows]: right when the buffer's storage is K-major (the
        # mxload layout). An engine holding [N, K]-ordered storage (vllm-ascend's MoE) gets
        # the row-major MX result instead, whose write is then a copy in storage order.
        pack = mx and unit.quantized and source.quant == "block_fp8"
        staged = None
        if pack and w_buf.is_contiguous() and s_buf is not None:
            staged = _Packed(unit, row_base, w_buf, s_buf)
        if cost.out and staged is None:
            out.reservations.append(pool.reserve(cost.out, tag=f"out {unit.buffer}"))
        if cost.scratch:
            out.reservations.append(pool.reserve(cost.scratch, tag=f"resolve {unit.buffer}"))
        for part, pr, (wb, sb) in zip(unit.parts, reads.parts, raw, strict=True):
            w, scale = source_part(unit, part, pr, wb, sb, source)
            if staged is not None:
                assert scale is not None
                staged.parts.append(ConvertPart(w, scale, part.rows[0], part.cols[0], part.dst_row))
            else:
                row = row_base + part.dst_row
                out.writes.append(
                    self._convert_part(unit, part, w, scale, row, w_buf, s_buf, source)
                )
        if not mx:
            out.writes.extend(writes.zero_uncovered(unit, row_base, w_buf))
        # after the unit's rows: what the engine derives from them (docs/contract.md §2.4)
        out.writes.extend(writes.derived(w_buf, self._buffers[d.buffer], d) for d in unit.derived)
        return staged

    def _convert_part(
        self,
        unit: Unit,
        part: Part,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        row: int,
        w_buf: torch.Tensor,
        s_buf: torch.Tensor | None,
        source: SourceInfo,
    ) -> Write:
        """Convert one part on its own; returns the write of its rows at buffer row
        ``row``: MX payload and scales, or the resolved (or plain) rows in the model
        dtype."""
        if unit.layout in ("mx_linear", "mx_moe"):
            assert s_buf is not None
            payload, mx_scale = self._to_mx(unit, part, w, scale, source)
            return writes.mx_rows(w_buf, s_buf, payload, mx_scale, row)
        return writes.rows(
            w_buf, row, part.nrows, self._to_model_dtype(unit, part, w, scale, source)
        )

    def _to_mx(
        self,
        unit: Unit,
        part: Part,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        source: SourceInfo,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One part of an MX unit as row-major MX payload and scales."""
        be = self.backend
        if unit.quantized and source.quant == "block_fp8":
            assert scale is not None
            [(payload, mx_scale)] = be.convert(
                [ConvertPart(w, scale, part.rows[0], part.cols[0])],
                block_n=source.block_n,
                block_k=source.block_k,
                dtype=self.dtype,
            )
            return payload, mx_scale
        if unit.quantized:  # already MXFP8: repack only (docs/contract.md §1.2)
            assert scale is not None
            return be.to_device(w), be.to_device(scale)
        # a BF16 (RL trainer) checkpoint into MX buffers: quantize directly
        result: tuple[torch.Tensor, torch.Tensor] = be.mx_quantize(be.to_device(w))
        return result

    def _to_model_dtype(
        self,
        unit: Unit,
        part: Part,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        source: SourceInfo,
    ) -> torch.Tensor:
        """One part of a plain unit in the model dtype: resolved when quantized."""
        from ..numerics.reference import resolve_mx

        be = self.backend
        if unit.quantized and source.quant == "block_fp8":
            x: torch.Tensor = be.resolve_block(
                be.to_device(w),
                be.to_device(scale),
                row0=part.rows[0],
                col0=part.cols[0],
                block_n=source.block_n,
                block_k=source.block_k,
                dtype=self.dtype,
            )
            return x
        if unit.quantized:
            return resolve_mx(be.to_device(w), be.to_device(scale), self.dtype)
        x = be.to_device(w)
        return x

    def _convert_packed(
        self, packed: Sequence[_Packed], source: SourceInfo, pool: StagingPool
    ) -> tuple[Lease, list[Write]]:
        """The units of a step that the fused kernel writes in their kernel layout: every
        one converted into one staging lease by one backend call (one kernel launch on
        cpu-fast), then each copied into its buffer's columns. Returns the lease and the
        writes."""
        lease, stages = self._packed_stages([p.unit for p in packed], pool)
        try:
            pairs = [
                (part, PackedOut(q, sc))
                for p, (q, sc) in zip(packed, stages, strict=True)
                for part in p.parts
            ]
            self.backend.convert(
                [part for part, _ in pairs],
                into=[o for _, o in pairs],
                block_n=source.block_n,
                block_k=source.block_k,
                dtype=self.dtype,
            )
        except BaseException:
            pool.release(lease)
            raise
        return lease, [
            writes.packed_columns(p.w_buf, p.s_buf, q, sc, p.row_base)
            for p, (q, sc) in zip(packed, stages, strict=True)
        ]

    def _packed_stages(
        self, units: Sequence[Unit], pool: StagingPool
    ) -> tuple[Lease, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Staging for MX units in their kernel layout, carved from one pool lease: per
        unit a payload ``[K, rows]`` and paired scales ``[ceil(g/2), rows, 2]``. Payloads
        first (each a multiple of 32 bytes, so every one starts 8-byte aligned for the
        kernel's word writes), then the scales."""
        pairs = [ceil_div(u.cols // MX_GROUP, 2) for u in units]
        q_total = sum(u.cols * u.rows for u in units)
        s_total = sum(g2 * u.rows * 2 for u, g2 in zip(units, pairs, strict=True))
        tag = units[0].buffer if len(units) == 1 else f"{units[0].buffer} +{len(units) - 1}"
        device = self.backend.device
        lease = pool.take(q_total + s_total, device=device, tag=f"out {tag}")
        out = []
        q_at, s_at = 0, q_total
        for u, g2 in zip(units, pairs, strict=True):
            k, n = u.cols, u.rows
            stage_w = lease.tensor[q_at : q_at + k * n].view(torch.float8_e4m3fn).view(k, n)
            stage_s = lease.tensor[s_at : s_at + g2 * n * 2].view(g2, n, 2)
            if (k // MX_GROUP) % 2:
                stage_s[-1, :, 1].zero_()
            out.append((stage_w, stage_s))
            q_at += k * n
            s_at += g2 * n * 2
        return lease, out


def source_part(
    unit: Unit,
    part: Part,
    pr: PartRead,
    wb: torch.Tensor,
    sb: torch.Tensor | None,
    source: SourceInfo,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One part's read bytes as its weight ``[rows, cols]`` and scale tensors (block
    scales checked, docs/contract.md §1.1)."""
    from ..numerics.reference import check_block_scales

    nr, nc = part.nrows, part.ncols
    w = _typed(wb, SAFETENSORS_TO_TORCH[pr.weight_dtype], (nr, nc))
    if not unit.quantized or sb is None:
        return w, None
    if source.quant != "block_fp8":
        return w, _typed(sb, torch.uint8, (nr, nc // MX_GROUP))
    tr = pr.tile_rows[1] - pr.tile_rows[0]
    tc = pr.tile_cols[1] - pr.tile_cols[0]
    # float32 or bfloat16 tiles (third-party Qwen3.5 copies); resolved in float32 either way
    scale = _typed(sb, SAFETENSORS_TO_TORCH[pr.scale_dtype], (tr, tc)).float()
    check_block_scales(
        scale,
        tensor=f"{part.module}.weight_scale_inv",
        file=pr.scale_file or pr.file,
        tile_row0=pr.tile_rows[0],
        tile_col0=pr.tile_cols[0],
        allow_nonfinite=source.allow_nonfinite,
    )
    return w, scale


def _typed(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View raw little-endian bytes as ``dtype`` of ``shape``; copies only when the
    offset is not aligned for the dtype (tiny scale tensors, rare)."""
    try:
        return flat.view(dtype).view(shape)
    except RuntimeError:
        return flat.clone().view(dtype).view(shape)
