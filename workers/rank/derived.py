"""Tensors an engine derives from a loaded parameter, recomputed in place on the rank.

An engine profile (``mxload.orchestrator.plan.engines``, ``derived``) names, per
architecture, the tensors the engine computes from a parameter in its own post-load and
reads instead of it (vllm-ascend's MLA: ``W_UK_T`` and ``W_UV`` from ``kv_b_proj``). The
plan holds them as buffers and gives the source's unit a :class:`Derived` per tensor; the
write stage (:mod:`.writes`) runs the op of this table after the unit's own writes, into
the same tensor, so an engine's captured graph keeps reading the right values
(docs/contract.md §2.4). The math is the engine's, read from its source (cited in the
profile), never imported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...orchestrator.plan.types import Derived


def _heads(source: torch.Tensor, d: Derived) -> torch.Tensor:
    """The source ``[heads * sum(split), K]`` as ``[heads, width, K]``: each head's rows of
    the group ``d.part`` (a view: nothing is allocated beside the staging pool)."""
    per_head = source.view(-1, sum(d.split), source.shape[-1])
    lo = sum(d.split[: d.part])
    return per_head[:, lo : lo + d.split[d.part], :]


def _mla_uk_t(source: torch.Tensor, d: Derived) -> torch.Tensor:
    """``W_UK_T [heads, P, K]``: the nope rows of every head, K last."""
    return _heads(source, d)


def _mla_uv(source: torch.Tensor, d: Derived) -> torch.Tensor:
    """``W_UV [heads, K, V]``: the value rows of every head, K in the middle."""
    return _heads(source, d).transpose(1, 2)


OPS: dict[str, Callable[[torch.Tensor, Derived], torch.Tensor]] = {
    "mla_uk_t": _mla_uk_t,
    "mla_uv": _mla_uv,
}
"""Every derived op a profile may name (``DerivedRule.op``), as a view of the source
that the write stage copies into the derived buffer."""


def compute(source: torch.Tensor, d: Derived) -> torch.Tensor:
    """The values of ``d`` from the unit's whole source buffer (a view, not a copy)."""
    return OPS[d.op](source, d)
