"""The write stage of the rank loader: converted rows into a unit's persistent buffer.

Conversion returns writes instead of writing: the loader runs them only once every unit
of a step is converted, so a buffer never holds a half-converted unit (docs/contract.md
§4 "Reload"). Every write is an in-place ``copy_`` (or ``zero_``): buffers never move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...orchestrator.plan.types import Derived, Unit

Write = Callable[[], None]


def rows(w_buf: torch.Tensor, row: int, n: int, x: torch.Tensor) -> Write:
    """The ``n`` rows ``x`` (model dtype, or the source's plain rows) at buffer row ``row``."""

    def write() -> None:
        w_buf[row : row + n].copy_(x)

    return write


def mx_rows(
    w_buf: torch.Tensor, s_buf: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor, row: int
) -> Write:
    """Row-major MX ``payload`` and ``scale`` as rows ``row..`` of an MX unit's buffers,
    in whatever layout they hold (``repack.write_rows``)."""

    from ..numerics.repack import write_rows

    def write() -> None:
        write_rows(w_buf, s_buf, payload, scale, row)

    return write


def packed_columns(
    w_buf: torch.Tensor, s_buf: torch.Tensor, q: torch.Tensor, sc: torch.Tensor, a: int
) -> Write:
    """A unit converted straight into its kernel layout in staging (payload ``q [K,
    rows]``, paired scales ``sc``) as columns ``a..`` of its buffers, each in one copy
    (contiguous when the unit is whole)."""
    b = a + q.shape[1]

    def write() -> None:
        w_buf.view(torch.uint8)[:, a:b].copy_(q.view(torch.uint8))
        s_buf[:, a:b, :].copy_(sc)

    return write


def derived(source: torch.Tensor, dst: torch.Tensor, d: Derived) -> Write:
    """Recompute the derived tensor ``d`` (``.derived``) from the unit's whole ``source``
    buffer into ``dst``, in place. Runs after the unit's own writes (a row-chunked unit:
    after each chunk, the last one leaving the final values)."""
    from .derived import compute

    def write() -> None:
        dst.copy_(compute(source, d))

    return write


def zero_uncovered(unit: Unit, row_base: int, w_buf: torch.Tensor) -> list[Write]:
    """Writes that zero the rows of a plain unit no part covers (vocab padding past V,
    docs/contract.md §3), also in a buffer the host handed in with other contents."""
    covered = sorted((p.dst_row, p.dst_row + p.nrows) for p in unit.parts)
    writes: list[Write] = []
    start = 0
    for lo, hi in [*covered, (unit.rows, unit.rows)]:
        if lo > start:
            writes.append(_zero(w_buf, row_base + start, row_base + lo))
        start = max(start, hi)
    return writes


def _zero(w_buf: torch.Tensor, a: int, b: int) -> Write:
    def write() -> None:
        w_buf[a:b].zero_()

    return write
