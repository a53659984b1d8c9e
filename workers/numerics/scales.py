"""Block-scale validation (docs/contract.md §1.1), on numpy arrays so torch-free callers can use it.

:func:`check_block_scales` is the one implementation: ``reference.check_block_scales``
(torch tensors: the loader's path) hands it a numpy view, and ``mxload convert`` calls it
directly.
"""

from __future__ import annotations

import numpy as np

from ...orchestrator.errors import NonFiniteScale


def check_block_scales(
    values: np.ndarray,
    *,
    tensor: str,
    file: str,
    tile_row0: int,
    tile_col0: int,
    allow_nonfinite: bool,
) -> None:
    """Refuse NaN, Inf, zero or negative float32 block scales.

    Raises :class:`NonFiniteScale` naming ``tensor``, ``file`` and the global tile index
    ``(tile_row0 + i, tile_col0 + j)`` of the first bad entry in row-major order. With
    ``allow_nonfinite`` (``--allow-nonfinite``), NaN and +Inf pass and follow the NaN
    semantics of docs/contract.md §2.2 downstream; zero, negative values and -Inf are still refused,
    since no reading of the format gives them a meaning.
    """
    flat = values.reshape(-1)
    if flat.size == 0:
        return
    # The common case in two reductions: all positive (a NaN makes min NaN, failing the
    # test) and, unless allowed, all finite. Anything else is located below.
    if flat.min() > 0 and (allow_nonfinite or flat.max() < np.inf):
        return
    bad = flat <= 0  # NaN compares False; -0.0 and -Inf are caught here
    if not allow_nonfinite:
        bad |= ~np.isfinite(flat)
    if not bad.any():
        return
    first = int(np.flatnonzero(bad)[0])
    tc = values.shape[1] if values.ndim == 2 else 1
    tile = (tile_row0 + first // tc, tile_col0 + first % tc)
    value = float(flat[first])
    hint = "" if allow_nonfinite else "; --allow-nonfinite lets NaN/Inf through"
    raise NonFiniteScale(
        f"{file}: {tensor}: block scale of tile {tile} is {value!r}; scales must be finite "
        f"and positive (docs/contract.md §1.1){hint}",
        file=file,
        tensor=tensor,
        tile=tile,
    )
