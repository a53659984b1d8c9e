"""Per-unit read plans: the byte ranges of each part and of the scale tiles covering it. Pure.

A part is a rectangle ``rows x cols`` of a row-major ``[N, K]`` checkpoint tensor (1-D
tensors are ``[1, n]``). Its weight bytes are one :class:`ByteRange`: contiguous when the
rectangle spans whole rows, else ``rows`` segments at the row stride (docs/contract.md §4 "Plans
describe row-strided ranges compactly"), never one entry per row.

Scales (docs/contract.md §2.1): a block-FP8 part needs the ``weight_scale_inv`` tiles that *cover* it,
tile rows ``floor(r0 / B_N) .. floor((r1 - 1) / B_N)`` and tile columns likewise, never
``ceil`` of the offset: a shard that starts inside a tile still needs that tile. An MXFP8
source (docs/contract.md §1.2) is the same with tiles of ``1 x 32``: the ``U8`` scale rectangle
``rows x [c0 / 32, ceil(c1 / 32))``.

Which parts carry scales is read from the checkpoint itself (an ``F8_E4M3`` weight), not
from ``Unit.quantized``, so the reads of a new checkpoint version (a BF16 RL checkpoint,
docs/contract.md §4) can be planned against the units of the session that loaded the first one.

``bytes_needed`` (docs/contract.md §6) is the sum of these ranges; the bytes actually requested are
the ranges coalesced per file under a :class:`CoalescePolicy` (the planner coalesces each
unit's reads on their own, as the loader requests them unit by unit). :func:`requested_bytes_fast`
computes exactly what ``mxload.orchestrator.plan.ranges.requested_bytes`` computes, but walks a
strided range by whole runs of merged segments instead of row by row, so a 256-rank plan
of DeepSeek-V3 (hundreds of thousands of row segments per rank) stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import replace

from ..errors import CheckpointError, MissingTensor
from .checkpoint import CheckpointMeta
from .config import ModelConfig
from .formats import (
    BLOCK_SCALE_DTYPES,
    MODEL_DTYPES,
    MX_GROUP,
    MX_SCALE_DTYPE,
    QUANT_WEIGHT_DTYPE,
    SAFETENSORS_ITEMSIZE,
)
from .ranges import PAGE_BYTES, ByteRange, CoalescePolicy, contiguous
from .safetensors_header import TensorInfo
from .types import Part, PartRead, Unit, UnitReads


def tile_span(lo: int, hi: int, block: int) -> tuple[int, int]:
    """Tiles ``[t0, t1)`` of height ``block`` covering elements ``[lo, hi)``: floor of the
    first and of the last index (docs/contract.md §2.1)."""
    if hi <= lo:
        return lo // block, lo // block
    return lo // block, (hi - 1) // block + 1


def rect_range(
    start: int, row_bytes: int, itemsize: int, rows: tuple[int, int], cols: tuple[int, int]
) -> ByteRange:
    """Bytes of ``rows x cols`` of a row-major tensor at ``start`` whose rows are
    ``row_bytes`` long: one contiguous range when the rectangle is whole rows or a single
    row, else one strided range (one segment per row)."""
    r0, r1 = rows
    c0, c1 = cols
    nrows, width = r1 - r0, (c1 - c0) * itemsize
    if nrows <= 0 or width <= 0:
        return ByteRange(start, 0, 0, 0)
    first = start + r0 * row_bytes + c0 * itemsize
    if width == row_bytes or nrows == 1:
        return contiguous(first, nrows * width if width == row_bytes else width)
    return ByteRange(first, width, row_bytes, nrows)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``[N, K]`` of a tensor as parts address it: 1-D tensors are ``[1, n]``, tensors of
    more dims ``[N, prod(rest)]`` (the same row-major bytes; Qwen3.5's ``conv1d`` is
    ``[conv_dim, 1, kernel]``). A checkpoint's and a trainer's tensors alike."""
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def _matrix_shape(info: TensorInfo) -> tuple[int, int]:
    """:func:`matrix_shape` of a checkpoint tensor, which must have a dim."""
    if info.shape:
        return matrix_shape(info.shape)
    raise CheckpointError(
        f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}; mxload reads "
        "tensors of one or more dims only",
        file=info.file,
        tensor=info.name,
    )


def _tensor(checkpoint: CheckpointMeta, name: str, unit: Unit) -> TensorInfo:
    info = checkpoint.tensors.get(name)
    if info is None:
        raise MissingTensor(
            f"{checkpoint.root}: tensor {name!r} (for {unit.buffer}) is not in the checkpoint",
            tensor=name,
            file=checkpoint.root,
        )
    return info


def whole_rows(
    start: int,
    row_bytes: int,
    itemsize: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    whole: bool,
) -> tuple[ByteRange, tuple[int, int, int]]:
    """The range and window of ``rows x cols`` of a row-major tensor: its whole rows and
    (row bytes, offset, width) when ``whole`` (``CoalescePolicy.whole_rows``) and it is
    a column window of several rows, else the rectangle itself and no window."""
    width = (cols[1] - cols[0]) * itemsize
    nrows = rows[1] - rows[0]
    if whole and nrows > 1 and 0 < width < row_bytes:
        rng = contiguous(start + rows[0] * row_bytes, nrows * row_bytes)
        return rng, (row_bytes, cols[0] * itemsize, width)
    return rect_range(start, row_bytes, itemsize, rows, cols), (0, 0, 0)


def part_read(
    part: Part, checkpoint: CheckpointMeta, unit: Unit, *, whole: bool = False
) -> PartRead:
    """The reads of one part: its weight rectangle and, for a quantized weight, the scale
    tiles covering it; whole rows with a window when ``whole`` (see :func:`whole_rows`)."""
    info = _tensor(checkpoint, part.tensor_name, unit)
    n, k = _matrix_shape(info)
    if not (0 <= part.rows[0] <= part.rows[1] <= n and 0 <= part.cols[0] <= part.cols[1] <= k):
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, too small for "
            f"rows {part.rows} x cols {part.cols} of {unit.buffer}",
            file=info.file,
            tensor=info.name,
        )
    itemsize = SAFETENSORS_ITEMSIZE[info.dtype]
    weight, window = whole_rows(info.start, k * itemsize, itemsize, part.rows, part.cols, whole)
    if info.dtype != QUANT_WEIGHT_DTYPE:
        return PartRead(
            file=info.file, weight=weight, weight_dtype=info.dtype, weight_window=window
        )
    if info.name != f"{part.module}.weight":
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} is {QUANT_WEIGHT_DTYPE}, but only a module's "
            "'.weight' can be quantized (with a scale beside it)",
            file=info.file,
            tensor=info.name,
        )
    mw = checkpoint.module_weights(part.module)
    scale = mw.scale
    if scale is None:
        raise CheckpointError(
            f"{info.file}: {info.name!r} is {QUANT_WEIGHT_DTYPE} but the checkpoint's config "
            f"({checkpoint.config.source}) declares no quantization",
            file=info.file,
            tensor=info.name,
        )
    if mw.quant == "block_fp8":
        block_n, block_k = checkpoint.config.quant.block_n, checkpoint.config.quant.block_k
        want_dtypes: tuple[str, ...] = BLOCK_SCALE_DTYPES
    else:  # MXFP8: one U8 per 32 columns, i.e. tiles of 1 x 32
        block_n, block_k = 1, MX_GROUP
        want_dtypes = (MX_SCALE_DTYPE,)
    tn, tk = _matrix_shape(scale)
    t_rows = tile_span(part.rows[0], part.rows[1], block_n)
    t_cols = tile_span(part.cols[0], part.cols[1], block_k)
    if scale.dtype not in want_dtypes or t_rows[1] > tn or t_cols[1] > tk:
        raise CheckpointError(
            f"{scale.file}: scale {scale.name!r} ({scale.dtype} {list(scale.shape)}) does not "
            f"cover weight {info.name!r} {list(info.shape)}: mismatched or unpaired scale",
            file=scale.file,
            tensor=scale.name,
        )
    s_item = SAFETENSORS_ITEMSIZE[scale.dtype]
    # The scale tiles of a windowed weight are read as whole tile rows too, however
    # narrow their window: they are shared with the weight's rows.
    s_whole = window != (0, 0, 0)
    s_range, s_window = whole_rows(scale.start, tk * s_item, s_item, t_rows, t_cols, s_whole)
    return PartRead(
        file=info.file,
        weight=weight,
        weight_dtype=info.dtype,
        scale_file=scale.file,
        scale=s_range,
        scale_dtype=scale.dtype,
        tile_rows=t_rows,
        tile_cols=t_cols,
        weight_window=window,
        scale_window=s_window,
    )


def unit_reads(unit: Unit, checkpoint: CheckpointMeta, *, whole: bool = False) -> UnitReads:
    """Byte ranges of every part of ``unit`` (same order as ``unit.parts``); ``whole``:
    the policy's ``whole_rows`` (False: the rectangles themselves)."""
    return UnitReads(parts=tuple(part_read(p, checkpoint, unit, whole=whole) for p in unit.parts))


def needed_bytes(
    unit: Unit,
    source: CheckpointMeta | ModelConfig,
    *,
    source_dtype: str | None = None,
) -> int:
    """Checkpoint bytes of the unit's elements plus the scale tiles covering them (docs/contract.md §6).

    With a checkpoint this is what :func:`unit_reads` reads. With a config alone it is
    predicted: a quantized unit (``unit.quantized``) is ``F8_E4M3`` plus its scales
    (block-FP8 F32 tiles, or MXFP8 U8 per 32 columns); any other is ``source_dtype``
    (a safetensors dtype string; default the model dtype).
    """
    if isinstance(source, CheckpointMeta):
        return unit_reads(unit, source).nbytes
    config = source
    total = 0
    if not unit.quantized:
        dtype = source_dtype or MODEL_DTYPES[config.model_dtype]
        itemsize = SAFETENSORS_ITEMSIZE[dtype]
        for p in unit.parts:
            total += p.nrows * p.ncols * itemsize
        return total
    if config.quant.kind == "block_fp8":
        block_n, block_k, s_item = config.quant.block_n, config.quant.block_k, 4
    else:
        block_n, block_k, s_item = 1, MX_GROUP, 1
    for p in unit.parts:
        t0, t1 = tile_span(p.rows[0], p.rows[1], block_n)
        u0, u1 = tile_span(p.cols[0], p.cols[1], block_k)
        total += p.nrows * p.ncols + (t1 - t0) * (u1 - u0) * s_item
    return total


def _windowed(part: Part, whole: bool) -> bool:
    """Whether a config-only part is read as whole rows when ``whole``
    (``CoalescePolicy.whole_rows``; :func:`whole_rows` for a checkpoint)."""
    full_k = part.source_shape[-1] if part.source_shape else part.ncols
    return whole and part.nrows > 1 and 0 < part.ncols < full_k


def estimated_fetch(unit: Unit, config: ModelConfig, *, whole: bool = False) -> int:
    """Bytes a config-only unit's reads bring in: :func:`needed_bytes`, with a part read
    as whole rows (``whole``) counting its whole rows and whole tile rows."""
    if not any(_windowed(p, whole) for p in unit.parts):
        return needed_bytes(unit, config)
    rows_unit = Unit(
        unit.buffer,
        unit.kind,
        unit.layout,
        unit.rows,
        unit.cols,
        tuple(
            replace(p, cols=(0, p.source_shape[-1])) if _windowed(p, whole) else p
            for p in unit.parts
        ),
        unit.quantized,
    )
    return needed_bytes(rows_unit, config)


def share_key(unit: Unit, *, whole: bool = False) -> Hashable:
    """Read-once sharing's key of a config-only unit: the unit itself (equal units read
    equal slices), or, when a part is read as whole rows, what is fetched: the tensors
    and rows, whichever columns each rank keeps."""
    if not any(_windowed(p, whole) for p in unit.parts):
        return unit
    return tuple(
        (p.tensor_name, p.rows, None if _windowed(p, whole) else p.cols) for p in unit.parts
    )


def estimated_requests(
    unit: Unit, config: ModelConfig, *, remote: bool = True, whole: bool = False
) -> int:
    """Storage requests for one unit of a config-only plan (no headers, so no offsets):
    per part, its weight and its scale. A slice narrower than its source tensor's K
    (K-split) is read as whole rows when ``whole`` (a few requests of 32 MiB),
    else one request per row from an object store, whose coalescing bridges no gap of a
    row's other columns; a local read takes the span (gaps under a page) or preads row
    by row. Anything else is one request (split at 32 MiB when remote)."""
    cap = 32 << 20
    total = 0
    quant = config.quant.kind
    for p in unit.parts:
        full_k = p.source_shape[-1] if p.source_shape else p.ncols
        windowed = remote and _windowed(p, whole)
        k_split = p.ncols < full_k and p.nrows > 1 and not windowed
        item = 1 if unit.quantized else 2
        nbytes = p.nrows * (full_k if windowed else p.ncols) * item
        if k_split and (remote or (full_k - p.ncols) * item >= PAGE_BYTES):
            total += p.nrows
        else:
            total += max(1, -(-nbytes // cap)) if remote else 1
        if unit.quantized and quant == "block_fp8":
            t0, t1 = tile_span(p.rows[0], p.rows[1], config.quant.block_n)
            total += (t1 - t0) if k_split and remote else 1
        elif unit.quantized:
            total += p.nrows if k_split and remote else 1
    return total


# --- coalesced request bytes ---------------------------------------------------------------


class _Runs:
    """The state of ``mxload.orchestrator.plan.ranges.coalesce`` over segments fed in sorted order."""

    __slots__ = (
        "active",
        "c",
        "gaps",
        "max_gap",
        "max_request",
        "needed",
        "requests",
        "run_end",
        "run_start",
        "total",
    )

    def __init__(self, policy: CoalescePolicy, max_request_bytes: int = 0) -> None:
        self.max_gap = policy.max_gap_bytes
        self.c = policy.max_overread_ratio - 1.0
        self.max_request = max_request_bytes
        self.active = False
        self.run_start = self.run_end = self.needed = self.gaps = self.total = 0
        self.requests = 0

    def _close(self, length: int, runs: int = 1) -> None:
        """``runs`` finished runs of ``length`` bytes each: their bytes and requests (a
        run longer than ``max_request`` is sent as several requests, as ``Storage`` does)."""
        self.total += runs * length
        per = -(-length // self.max_request) if self.max_request and length else 1
        self.requests += runs * per

    def step(self, s: int, e: int) -> None:
        """One segment, exactly as ``coalesce`` treats it."""
        if not self.active:
            self.active = True
            self.run_start, self.run_end, self.needed, self.gaps = s, e, e - s, 0
            return
        if s <= self.run_end:
            if e > self.run_end:
                self.needed += e - self.run_end
                self.run_end = e
            return
        gap, seg = s - self.run_end, e - s
        if gap <= self.max_gap and self.gaps + gap <= self.c * (self.needed + seg):
            self.gaps += gap
            self.needed += seg
            self.run_end = e
            return
        self._close(self.run_end - self.run_start)
        self.run_start, self.run_end, self.needed, self.gaps = s, e, seg, 0

    def _merges(self, needed: int, gaps: int, gap: int, seg: int, limit: int) -> int:
        """How many of the next ``limit`` equal segments (``gap`` apart, ``seg`` long)
        merge one after another into a run at (needed, gaps). The merge test is linear
        in the count, so it is solved in closed form and then confirmed with the exact
        expression ``coalesce`` evaluates."""
        c = self.c

        def ok(k: int) -> bool:
            return gaps + k * gap <= c * (needed + k * seg)

        slope = gap - c * seg
        if slope <= 0:
            k = limit
        else:
            k = max(0, min(limit, int((c * needed - gaps) // slope)))
        while k > 0 and not ok(k):
            k -= 1
        while k < limit and ok(k + 1):
            k += 1
        return k

    def strided(self, r: ByteRange) -> None:
        """All segments of ``r`` (no other range's segments interleave with them)."""
        self.step(r.start, r.start + r.length)
        rest = r.count - 1
        if rest <= 0:
            return
        length, stride = r.length, r.stride
        gap = stride - length
        last = r.start + rest * stride
        if gap == 0:  # touching segments: one run
            self.needed += rest * length
            self.run_end = last + length
            return
        if gap > self.max_gap:  # no two segments merge: every one is its own request
            self._close(self.run_end - self.run_start)
            self._close(length, rest - 1)
            self.run_start, self.run_end, self.needed, self.gaps = last, last + length, length, 0
            return
        k = self._merges(self.needed, self.gaps, gap, length, rest)
        self.needed += k * length
        self.gaps += k * gap
        self.run_end += k * stride
        rest -= k
        if rest == 0:
            return
        self._close(self.run_end - self.run_start)
        # From here every run starts afresh at one segment and takes the same number of
        # merges, so the remaining segments fall into equal runs plus a last one.
        first = r.count - rest
        per_run = 1 + self._merges(length, 0, gap, length, rest - 1)
        runs = -(-rest // per_run)
        self._close((per_run - 1) * stride + length, runs - 1)
        tail = rest - (runs - 1) * per_run
        self.run_start = r.start + (first + (runs - 1) * per_run) * stride
        self.run_end = self.run_start + (tail - 1) * stride + length
        self.needed = tail * length
        self.gaps = (tail - 1) * gap

    def finish(self) -> int:
        """Bytes requested; ``requests`` then holds how many requests carry them."""
        if self.active:
            self._close(self.run_end - self.run_start)
            self.active = False
        return self.total


def coalesced_fast(
    ranges: Iterable[ByteRange], policy: CoalescePolicy, max_request_bytes: int = 0
) -> tuple[int, int]:
    """(bytes, requests) of ``mxload.orchestrator.plan.ranges.coalesce(ranges, policy)`` for
    the ranges of ONE file, exactly, without visiting strided ranges row by row. A
    request longer than ``max_request_bytes`` (0: no limit) counts as the pieces
    ``Storage`` sends it in."""
    uniq = sorted(
        {policy.as_read(r) for r in ranges if r.nbytes > 0},
        key=lambda r: (r.start, r.end, r.length),
    )
    runs = _Runs(policy, max_request_bytes)
    i = 0
    while i < len(uniq):
        # A cluster: ranges whose extents overlap, so their segments may interleave.
        j, end = i + 1, uniq[i].end
        while j < len(uniq) and uniq[j].start < end:
            end = max(end, uniq[j].end)
            j += 1
        if j == i + 1:
            runs.strided(uniq[i])
        else:
            for s, n in sorted(seg for r in uniq[i:j] for seg in r.segments()):
                runs.step(s, s + n)
        i = j
    nbytes = runs.finish()
    return nbytes, runs.requests


def requested_bytes_fast(ranges: Iterable[ByteRange], policy: CoalescePolicy) -> int:
    """Exactly ``mxload.orchestrator.plan.ranges.requested_bytes(ranges, policy)`` for the ranges of
    ONE file, without visiting strided ranges row by row."""
    return coalesced_fast(ranges, policy)[0]


def _ranges_by_file(reads: Sequence[UnitReads]) -> dict[str, list[ByteRange]]:
    """Every weight and scale range of ``reads``, grouped by the file it is read from."""
    by_file: dict[str, list[ByteRange]] = {}
    for ur in reads:
        for p in ur.parts:
            by_file.setdefault(p.file, []).append(p.weight)
            if p.scale is not None:
                by_file.setdefault(p.scale_file or p.file, []).append(p.scale)
    return by_file


def predicted_read_bytes(reads: Sequence[UnitReads], policy: CoalescePolicy) -> int:
    """Bytes a rank requests for ``reads``: every weight and scale range, coalesced per
    file across all of the rank's units under ``policy`` (its ``bytes_to_read``)."""
    return predicted_reads(reads, policy)[0]


def predicted_reads(
    reads: Sequence[UnitReads], policy: CoalescePolicy, max_request_bytes: int = 0
) -> tuple[int, int]:
    """(bytes, requests) a rank sends storage for ``reads`` coalesced per file under
    ``policy``, as :func:`predicted_read_bytes` counts bytes. The time model charges
    each request its latency: a K-split slice read from an object store is one request
    per row (``REMOTE_POLICY`` bridges no gap that would read 1.25x what it needs)."""
    nbytes = requests = 0
    for rs in _ranges_by_file(reads).values():
        b, n = coalesced_fast(rs, policy, max_request_bytes)
        nbytes += b
        requests += n
    return nbytes, requests
