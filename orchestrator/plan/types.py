"""The plan's data types: what each rank holds, converts and reads. Pure.

These frozen dataclasses are the contract between the planner (``mxload.orchestrator.plan.planner``),
the memory model (``mxload.orchestrator.plan.memory``) and the rank loader (``mxload.workers.rank.loader``). They
are plain data: picklable for shipping to Ray workers and JSON-able through ``to_json``.

Vocabulary (docs/contract.md §6):

* a **buffer** is one persistent device tensor (``BufferSpec``), allocated once;
* a **unit** is what is converted and written as one piece: one (merged) linear, one
  expert's w13 or w2, or one non-quantized tensor copied as is (``Unit``);
* a **part** is one checkpoint module's rectangle inside a unit (``Part``): q, k and v
  are three parts of the qkv unit, gate and up two parts of a w13 unit.

Shapes inside units are the *source orientation* ``[N, K]`` (rows = output features),
before the kernel transpose of docs/contract.md §2.3. 1-D tensors (norms, biases) are viewed as
``[1, n]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .formats import BUFFER_ITEMSIZE
from .ranges import ByteRange

UnitKind = Literal["linear", "moe_w13", "moe_w2", "copy"]
"""linear: a (merged) quantized-or-not linear; moe_w13/moe_w2: one expert's half;
copy: a non-quantized tensor (norm, embedding, router) copied in its checkpoint dtype."""


@dataclass(frozen=True)
class BufferSpec:
    """One persistent buffer a rank holds (names of docs/contract.md §3, layouts of §2.3)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name: float8_e4m3fn, uint8, bfloat16, float16, float32."""
    layout: str
    """mx_linear | mx_moe | dense."""
    storage_order: tuple[int, ...] = ()
    """Dims of ``shape`` from the outermost in memory to the innermost; () = row-major.
    An engine profile (``mxload.orchestrator.plan.engines``) may hold a buffer as a transposed
    view of its storage; ``shape`` is always the view's (what the engine reads)."""
    canonical_of_view: tuple[int, ...] = ()
    """``canonical_of_view[i]`` = mxload's canonical dim that view dim ``i`` is (the units
    write canonical rows); () = the view is canonical."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """Shape of the row-major storage the view is taken from."""
        order = self.storage_order or tuple(range(len(self.shape)))
        return tuple(self.shape[d] for d in order)

    @property
    def stride(self) -> tuple[int, ...]:
        """Strides (elements) of the view over its storage."""
        order = self.storage_order or tuple(range(len(self.shape)))
        stride = [0] * len(self.shape)
        step = 1
        for d in reversed(order):
            stride[d] = step
            step *= max(self.shape[d], 1)
        return tuple(stride)

    @property
    def storage_offset(self) -> int:
        """Offset (elements) of the view into its storage: 0, every buffer owns its storage."""
        return 0

    @property
    def nbytes(self) -> int:
        return self.numel * BUFFER_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Part:
    """One checkpoint module's rectangle inside a unit.

    ``rows``/``cols`` are half-open ranges of the module's source ``[N, K]`` weight; the
    rectangle lands at output rows ``[dst_row, dst_row + rows[1] - rows[0])`` of the unit.
    Rows of the unit covered by no part (vocab padding) stay zero.
    """

    module: str
    """Checkpoint module name; the tensor is ``module + '.weight'`` (or ``tensor``)."""
    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_row: int
    tensor: str = ""
    """Checkpoint tensor name when it is not ``module.weight`` (norms: ``X.weight`` too;
    the DeepSeek router bias: ``X.e_score_correction_bias``). Empty means ``module.weight``."""
    source_shape: tuple[int, ...] = ()
    """Full shape of the source tensor as the config predicts it (checked against headers)."""

    @property
    def tensor_name(self) -> str:
        return self.tensor or f"{self.module}.weight"

    @property
    def nrows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def ncols(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True)
class Derived:
    """A buffer the engine computes from a unit's buffer after loading, recomputed in place
    after every write of that unit (docs/contract.md §2.4): MLA's ``W_UK_T`` and ``W_UV``
    from ``kv_b_proj`` under vllm-ascend. ``op`` names the computation in the rank's
    table (``mxload.workers.rank.derived``); ``split`` are the per-head row counts the
    source holds in order (``qk_nope_head_dim``, ``v_head_dim``) and ``part`` which of
    them this buffer takes."""

    buffer: str
    op: str
    split: tuple[int, ...]
    part: int


@dataclass(frozen=True)
class Unit:
    """What is converted and written as one piece (docs/contract.md §6)."""

    buffer: str
    """Name of the weight buffer written (its scale buffer, if any, is ``buffer + '_scale'``)."""
    kind: UnitKind
    layout: str
    """Layout of the buffer written: mx_linear | mx_moe | dense."""
    rows: int
    """N of the unit in source orientation (sum of parts' rows, plus padding)."""
    cols: int
    """K of the unit (every part has the same column count)."""
    parts: tuple[Part, ...]
    quantized: bool
    """Whether the source parts are quantized (F8_E4M3 with a scale)."""
    expert: int = -1
    """Local expert index for moe_w13/moe_w2 (position in the rank's expert list)."""
    global_expert: int = -1
    """Global expert id for moe units."""
    row0: int = 0
    """First row of the buffer this unit writes (source orientation). Non-zero only for
    the row blocks a vocab-parallel buffer is cut into (``_Planner.copy_unit_bytes``)."""
    derived: tuple[Derived, ...] = ()
    """Buffers recomputed from this unit's buffer after each of its writes."""

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class PartRead:
    """Where one part's bytes are: the weight rectangle and the scale tiles covering it."""

    file: str
    """Shard file (relative to the checkpoint root) holding the weight."""
    weight: ByteRange
    """Segments concatenated = the rectangle, row-major."""
    weight_dtype: str
    """safetensors dtype string of the source weight (F8_E4M3, BF16, ...)."""
    scale_file: str = ""
    scale: ByteRange | None = None
    """Block-FP8: the F32 tiles ``[t0, t1) x [u0, u1)`` covering the rectangle; MXFP8: the
    U8 scale rectangle ``rows x cols/32``. None for non-quantized parts."""
    scale_dtype: str = ""
    tile_rows: tuple[int, int] = (0, 0)
    """Block-FP8: tile-row range of ``scale`` (floor of first and last row / B_N)."""
    tile_cols: tuple[int, int] = (0, 0)
    weight_window: tuple[int, int, int] = (0, 0, 0)
    """(row bytes, offset, width): ``weight`` is whole rows, read in a few large requests
    and shared by the ranks that need other columns of them (a K-split slice from an
    object store), and the part's bytes are ``width`` bytes at ``offset`` of each row.
    (0, 0, 0): ``weight`` is the part's bytes."""
    scale_window: tuple[int, int, int] = (0, 0, 0)
    """The same for ``scale``."""

    @property
    def needed_bytes(self) -> int:
        """The part's own bytes (docs/contract.md §6 ``bytes_needed``): the rectangle and
        its covering scale tiles, without the rest of whole rows read for it."""
        return _windowed(self.weight, self.weight_window) + (
            0 if self.scale is None else _windowed(self.scale, self.scale_window)
        )


def _windowed(rng: ByteRange, window: tuple[int, int, int]) -> int:
    row, _, width = window
    return rng.nbytes if row == 0 else rng.nbytes // row * width


@dataclass(frozen=True)
class UnitReads:
    """The reads of one unit, part by part (same order as ``Unit.parts``)."""

    parts: tuple[PartRead, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the reads bring in (what a staging lease holds)."""
        total = 0
        for p in self.parts:
            total += p.weight.nbytes + (p.scale.nbytes if p.scale is not None else 0)
        return total

    @property
    def needed_bytes(self) -> int:
        """The parts' own bytes (equal to ``nbytes`` unless whole rows are read)."""
        return sum(p.needed_bytes for p in self.parts)

    @property
    def fetch_key(self) -> tuple[tuple[str, ByteRange, str, ByteRange | None], ...]:
        """What is fetched, per part: equal keys are the same bytes, whichever columns
        of them each rank keeps (read-once sharing's key)."""
        return tuple((p.file, p.weight, p.scale_file, p.scale) for p in self.parts)


@dataclass(frozen=True)
class StagingEstimate:
    """Staging memory of one rank, itemised (docs/contract.md §6)."""

    budget_bytes: int
    """The staging budget the rank runs under."""
    read_bytes: int
    """Peak bytes of read buffers held at once."""
    scratch_bytes: int
    """Peak conversion scratch (resolved tensor, MX payload and scales of one unit/chunk)."""
    staging_bytes: int
    """Peak of read + scratch at the same moment (not the sum of the two peaks)."""
    device_bytes: int
    """Part of staging_bytes that lives on the device (scratch on npu/cuda; 0 on cpu)."""
    host_bytes: int
    """Part of staging_bytes that lives in host memory (read buffers; all of it on cpu)."""
    chunk_rows: int
    """Rows per conversion chunk of the largest unit (its full N when it fits)."""
    prefetch: bool
    """Whether the next unit's reads are issued while the current unit converts."""
    read_ahead: float = 1.0
    """Steps whose reads are in flight per request latency waited, over the run: its
    steps over the sum of 1/depth, a step's depth being the steps it keeps in flight
    ahead of itself (at least 1). The time model divides a rank's per-unit waits by it."""


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank holds and does."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    layers: tuple[int, ...]
    experts: tuple[int, ...]
    """Global expert ids held, in local order; all of them without EP; () on dense models."""
    buffers: tuple[BufferSpec, ...]
    units: tuple[Unit, ...]
    bytes_needed: int
    """Checkpoint bytes of the held elements plus covering scale tiles (docs/contract.md §6)."""
    bytes_to_read: int
    """Bytes the coalesced requests fetch (predicted)."""
    reads: tuple[UnitReads, ...] | None = None
    """Byte ranges per unit, same order as ``units``; None for a config-only plan."""
    staging: StagingEstimate | None = None
    scale_alg: int = 0
    """The MX scale rule the rank quantizes with (docs/contract.md §2.2)."""

    @property
    def persistent_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def peak_bytes(self) -> int:
        return self.persistent_bytes + (self.staging.staging_bytes if self.staging else 0)


@dataclass(frozen=True)
class ReadGroup:
    """Some of a rank's units as the time model and read-once sharing see them.

    Either units each read on their own (``repeat`` 1: any other rank needing equal
    reads may share them), or the rank's ``own`` units: ``repeat`` copies of the
    geometry of ``units`` (one MoE rank's experts of one layer, whose reads are only
    counted, never built), which ranks of one class hold different ones of."""

    units: tuple[Unit, ...]
    reads: tuple[UnitReads, ...] | None
    """Per unit, with a checkpoint; None for a config-only plan."""
    needed: tuple[int, ...]
    """Checkpoint bytes each unit needs (docs/contract.md §6)."""
    repeat: int = 1
    expand: Callable[[int], tuple[Unit, ...]] | None = field(default=None, compare=False)
    """Every unit of the group on a given rank (each of its experts'), for a policy under
    which other ranks read the same bytes (whole rows of a K-split slice)."""
    own: bool = False
    """The units stand for each rank's own (its experts), whatever ``repeat``."""

    @property
    def private(self) -> bool:
        return self.repeat > 1 or self.own


@dataclass(frozen=True)
class RankClass:
    """What every rank of one class holds and reads: ranks at the same pipeline stage,
    TP rank and MoE rank hold the same buffers and read the same bytes (data-parallel
    replicas of a dense model, for one), so they are planned once. In a plan from a
    config alone, ranks whose experts (or slices of them) differ but have the same
    shapes are one class too: their ``own`` groups stand for each rank's experts."""

    buffers: tuple[BufferSpec, ...]
    unit_count: int
    """How many units (each rank's ``RankPlan.units`` has this length)."""
    bytes_needed: int
    bytes_to_read: int
    staging: StagingEstimate | None
    groups: tuple[ReadGroup, ...]
    """Every unit, in plan order, grouped for the time model."""
    persistent_bytes: int
    """Sum of the buffers' bytes."""

    @property
    def peak_bytes(self) -> int:
        return self.persistent_bytes + (self.staging.staging_bytes if self.staging else 0)


@dataclass(frozen=True)
class RankSummary:
    """One rank's place in the layout and its class (``Plan.classes``)."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    layers: tuple[int, ...]
    experts: tuple[int, ...]
    rank_class: int


@dataclass(frozen=True)
class ParallelLayout:
    """tp x dp x pp with vLLM's expert-parallel switches (docs/contract.md §3)."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    enable_expert_parallel: bool = False
    expert_placement: Literal["linear", "round_robin"] = "linear"
    language_model_only: bool = False
    """vLLM's ``--language-model-only``: the engine builds no vision tower, so none is planned
    (a model without one is unaffected)."""
    speculative_method: Literal["", "mtp"] = ""
    """vLLM's ``speculative_config`` method: ``mtp`` plans the checkpoint's own MTP module
    as the engine's drafter holds it (``mxload.orchestrator.plan.arch``); ``""`` none."""
    mm_encoder_tp_mode: Literal["weights", "data"] = "weights"
    """vLLM's ``--mm-encoder-tp-mode``: ``weights`` TP-shards the vision tower, ``data``
    holds it whole on every TP rank."""
    all2all_backend: str = ""
    """vLLM's ``--all2all-backend`` as the engine runs it; ``""``: the engine profile's
    (``EngineProfile.moe``). Under sequence-parallel MoE vLLM holds shared experts whole."""
    shared_expert_dp: bool = False
    """The engine's own switch that holds the shared experts whole on every TP rank is on
    (vllm-ascend's ``enable_shared_expert_dp``; ``MoEMode.shared_dp_setting``)."""
    scale_alg: int | None = None
    """The MX scale rule (docs/contract.md §2.2: 0 OCP, 1 from the E4M3 maximum, rounded
    up); ``None``: the engine profile's choice for the model (``engines.scale_alg_for``)."""

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tp": self.tp,
            "dp": self.dp,
            "pp": self.pp,
            "enable_expert_parallel": self.enable_expert_parallel,
            "expert_placement": self.expert_placement,
            "world": self.world,
        }
        # only when set: plans of other layouts read as before
        if self.language_model_only:
            out["language_model_only"] = True
        if self.speculative_method:
            out["speculative_config"] = {"method": self.speculative_method}
        if self.mm_encoder_tp_mode != "weights":
            out["mm_encoder_tp_mode"] = self.mm_encoder_tp_mode
        if self.all2all_backend:
            out["all2all_backend"] = self.all2all_backend
        if self.shared_expert_dp:
            out["shared_expert_dp"] = True
        if self.scale_alg is not None:
            out["scale_alg"] = self.scale_alg
        return out


@dataclass(frozen=True)
class Plan:
    """A whole plan: every rank of a layout for one model.

    ``summaries`` and ``classes`` say everything per rank that ``mxload plan`` prints,
    at a cost that follows the distinct rank classes; ``ranks`` gives each rank's full
    plan (units, reads), built when asked for in a config-only plan."""

    model: dict[str, Any]
    """ModelConfig.summary()."""
    layout: ParallelLayout
    ranks: Sequence[RankPlan]
    min_staging_load: int
    """Smallest staging budget a load can run under (row-chunked conversion)."""
    min_staging_reload: int
    """Smallest staging budget a reload can run under (whole units, docs/contract.md §6)."""
    device_memory_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    engine: str = "mxload"
    """Engine profile the buffers are laid out for (``mxload.orchestrator.plan.engines``)."""
    scale_alg: int = 0
    """The MX scale rule every rank quantizes with (docs/contract.md §2.2)."""
    moe_mode: Mapping[str, Any] = field(default_factory=dict)
    """The engine's MoE mode the plan assumed (``ResolvedMoE.to_json``); empty for a
    dense model."""
    summaries: tuple[RankSummary, ...] = ()
    classes: tuple[RankClass, ...] = ()

    @property
    def fits(self) -> bool:
        if self.device_memory_bytes is None:
            return True
        return all(c.peak_bytes <= self.device_memory_bytes for c in self.classes)
