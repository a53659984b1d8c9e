"""A rank's persistent buffers: allocated once with their final shapes, or adopted from a
host that already owns them (docs/contract.md §4 "Persistent buffers"), and the
canonical views units write through.

An engine profile may hold a buffer as a permuted view of the row-major storage mxload
plans; units write canonical rows (source orientation, docs/contract.md §2.3), through
the canonical view of the engine's tensor: same storage, no copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...orchestrator.errors import AdoptionError
from ...orchestrator.plan.types import BufferSpec, RankPlan, Unit

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def allocate(plan: RankPlan, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every buffer as the engine profile holds it: row-major storage of
    ``spec.storage_shape``, then the view of ``spec.shape`` over it (a permutation,
    so ``stride`` and ``storage_offset`` are the planned ones)."""
    out = {}
    for spec in plan.buffers:
        if spec.dtype == "float8_e4m3fn":
            storage = torch.zeros(spec.storage_shape, dtype=torch.uint8, device=device)
            storage = storage.view(torch.float8_e4m3fn)
        else:
            storage = torch.zeros(spec.storage_shape, dtype=TORCH_DTYPES[spec.dtype], device=device)
        out[spec.name] = _view_of_storage(storage, spec)
    return out


def adopt(
    plan: RankPlan, given: Mapping[str, torch.Tensor], device: str | torch.device
) -> dict[str, torch.Tensor]:
    """The host's tensors as the rank's buffers, once each matches its planned shape,
    dtype, device and layout exactly (AdoptionError listing every mismatch)."""
    problems = []
    want_device = torch.device(device)
    for spec in plan.buffers:
        t = given.get(spec.name)
        if t is None:
            problems.append(f"{spec.name}: missing")
            continue
        if tuple(t.shape) != spec.shape:
            problems.append(f"{spec.name}: shape {tuple(t.shape)} != planned {spec.shape}")
        if t.dtype != TORCH_DTYPES[spec.dtype]:
            problems.append(f"{spec.name}: dtype {t.dtype} != planned {spec.dtype}")
        if t.device.type != want_device.type:
            problems.append(f"{spec.name}: device {t.device} != compute device {want_device}")
        problems.extend(_layout_problems(spec, t))
    for name in sorted(set(given) - {b.name for b in plan.buffers}):
        problems.append(f"{name}: not a buffer of rank {plan.rank}'s plan")
    if problems:
        raise AdoptionError(
            f"rank {plan.rank}: cannot adopt the host's buffers: " + "; ".join(problems),
            rank=plan.rank,
        )
    return {spec.name: given[spec.name] for spec in plan.buffers}


def canonical_views(plan: RankPlan, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each buffer seen in mxload's canonical dimension order."""
    out = {}
    for spec in plan.buffers:
        t = buffers[spec.name]
        out[spec.name] = (
            t.permute(_inverse(spec.canonical_of_view)) if spec.canonical_of_view else t
        )
    return out


def unit_buffers(
    canonical: Mapping[str, torch.Tensor], unit: Unit
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (2-D) and scale buffers ``unit`` writes: its expert's, if it has one."""
    w = canonical[unit.buffer]
    s = canonical.get(unit.buffer + "_scale")
    if unit.expert >= 0:
        w = w[unit.expert]
        s = s[unit.expert] if s is not None else None
    if w.dim() == 1:
        w = w.view(unit.rows, -1)  # merged 1-D parts (a qkv bias): one row each
    elif w.dim() > 2 and unit.expert < 0:
        w = w.view(w.shape[0], -1)  # [N, 1, kernel] (conv1d) as the [N, K] parts address
    return w, s


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv


def _view_of_storage(storage: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
    """The view ``spec`` describes over row-major ``storage`` of ``spec.storage_shape``."""
    if not spec.storage_order:
        return storage
    return storage.permute(_inverse(spec.storage_order))


def _layout_problems(spec: BufferSpec, t: torch.Tensor) -> list[str]:
    """How a tensor handed in for ``spec`` differs from the planned view: its stride, and
    whether the memory it spans is exactly the planned storage (``numel`` elements, no gap,
    no overlap) inside the tensor's storage. The storage offset is free: a host may carve
    its parameters out of one arena. An engine's own parameters must match the profile
    exactly, or writes would land elsewhere than its kernels read."""
    problems = []
    # A dimension of size 1 has no meaningful stride (torch may report any value).
    significant = [d for d, n in enumerate(spec.shape) if n > 1]
    if [t.stride()[d] for d in significant] != [spec.stride[d] for d in significant]:
        problems.append(
            f"{spec.name}: stride {tuple(t.stride())} != planned {spec.stride} "
            f"(a view of storage {list(spec.storage_shape)}; is --engine right?)"
        )
    elif spec.numel:
        span = spec.numel * t.element_size()
        end = (t.storage_offset() + spec.numel) * t.element_size()
        have = t.untyped_storage().nbytes()
        if end > have:
            problems.append(
                f"{spec.name}: its storage holds {have} bytes, the view needs {span} bytes "
                f"from element {t.storage_offset()}"
            )
    return problems
