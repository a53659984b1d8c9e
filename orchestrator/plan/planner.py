"""The planner: per rank, the persistent buffers, the units that fill them, the reads. Pure.

From a :class:`ModelConfig` (and, when there are weights, the checkpoint's headers) and a
:class:`ParallelLayout`, it says for every rank (docs/contract.md §3, §5, §6):

* which buffers it holds (names of docs/contract.md §3, shapes and dtypes of docs/contract.md §2.3), exactly, so
  ``persistent_bytes`` is their sum and not an estimate;
* which units it converts, each with its parts' rectangles in the source tensors;
* with a checkpoint, the byte ranges of each unit (``mxload.orchestrator.plan.readplan``);
* its staging (``mxload.orchestrator.plan.memory``) and whether it fits a device.

How a tensor is sharded comes from the architecture table (``mxload.orchestrator.plan.arch``); how a
layout maps ranks to shards from ``mxload.orchestrator.plan.layout``. The planner only composes them.

Which buffers are MXFP8 (docs/contract.md §2.2/§2.3):

* with a checkpoint, a part is quantized iff its weight is ``F8_E4M3`` (with its scale);
  without one, iff the config declares a quantization, the table says the tensor is a
  linear, and the config does not exclude the module;
* a quantized (merged) linear whose local K is a multiple of 32, and whose table row
  allows MX, is held ``mx_linear``; else resolved in the model dtype, ``dense``;
* a MoE layer is ``mx_moe`` when its experts are quantized and both H and I_local are
  multiples of 32; else the whole layer is ``dense`` (docs/contract.md §2.2);
* everything else keeps its checkpoint dtype (the model dtype from a config alone; the
  table may say float32 instead).

Speed: ranks that share a shard share the objects that describe it. A block (one table
row in one layer for one shard) is built once and cached by ``(row, layer, shard key)``,
where the shard key is what the row depends on: the tp rank for column/row/vocab styles,
the MoE rank for experts, nothing for replicated rows. Ranks at the same pipeline stage,
TP rank and MoE rank hold the same blocks. In a plan from a config alone ranks go
further into one **kind** (``Plan.classes``; ``Plan.summaries`` says each rank's kind and
coordinates): the same stage and TP rank, as many experts, and a slice of each expert
covering as many scale tiles and MX groups. Such ranks hold equal buffers, need equal
bytes and stage alike; only which experts, or which rows of them, differ, and a config
alone gives no offsets for that to change. A kind is planned once, from its first rank;
its routed experts are ``own`` read groups (a sample unit pair and a repeat count), which
the time model counts per rank and expands (once per layer and set of experts held)
only where other ranks read the same whole rows. No rank's expert units are built until ``Plan.ranks[i]`` is asked for.
The memory model is run once per distinct unit geometry (and once per distinct sequence
of them, for a kind's staging), and the cyclic garbage collector is paused while the
(acyclic) plan objects are built. Kinds are at most a handful per (stage, TP rank), so
the planning of 4,096 ranks costs about what 8 do; what still grows with ranks is the
per-rank arithmetic of the time model and the per-rank JSON (docs/time-model.md, "How
the planner scales").

Limits: with a checkpoint every unit's reads are planned (each expert's tensors sit at
their own offsets), so a checkpoint plan is made once per stage, TP rank and MoE rank,
and one of a very large MoE world without EP still builds every rank's unit list.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, overload

from ..errors import (
    CheckpointError,
    LayoutError,
    MissingTensor,
    MixedQuantization,
    StagingBudgetError,
)
from .arch import (
    EXPERT_PLACEHOLDER,
    SCALE_SUFFIX,
    W2_BUFFER,
    W13_BUFFER,
    Architecture,
    TensorRule,
    architecture_for,
    device_name,
    source_module,
)
from .checkpoint import CheckpointMeta
from .config import ModelConfig
from .engines import (
    DEFAULT_ENGINE,
    DERIVED_SHAPES,
    EngineProfile,
    check_expert_placement,
    check_moe_groups,
    derived_rules,
    engine_profile,
    held_as,
    resolve_moe,
    scale_alg_for,
)
from .formats import (
    LAYOUT_DENSE,
    LAYOUT_MX_LINEAR,
    LAYOUT_MX_MOE,
    MODEL_DTYPES,
    MX_GROUP,
    MX_PAIR,
    PLAN_FORMAT,
    QUANT_WEIGHT_DTYPE,
    SAFETENSORS_ITEMSIZE,
    SAFETENSORS_TO_BUFFER,
    ceil_div,
)
from .layout import (
    ep_rank_of,
    ep_size,
    even_split,
    experts_for_rank,
    kv_head_rows,
    padded_vocab,
    pipeline_layers,
    rank_coords,
    uses_expert_parallel,
    validate_layout,
)
from .ranges import LOCAL_POLICY, REMOTE_POLICY
from .readplan import (
    needed_bytes,
    predicted_read_bytes,
    tile_span,
    unit_reads,
)
from .types import (
    BufferSpec,
    Derived,
    ParallelLayout,
    Part,
    Plan,
    RankClass,
    RankPlan,
    RankSummary,
    ReadGroup,
    StagingEstimate,
    Unit,
    UnitKind,
    UnitReads,
)

FP8_BUFFER = SAFETENSORS_TO_BUFFER[QUANT_WEIGHT_DTYPE]
SCALE_BUFFER = "uint8"

COPY_UNIT_FALLBACK_BYTES = 64 << 20
"""Row-block size of vocab-parallel buffers in a model with no linear units at all."""


@dataclass(frozen=True)
class _Facts:
    """What one table row's sources are in one layer (the same on every rank)."""

    quantized: bool
    """Source weights are F8_E4M3 with scales."""
    dtype: str
    """safetensors dtype of the sources when not quantized (what a copy keeps)."""


@dataclass(frozen=True)
class _Block:
    """One table row in one layer for one shard: its buffers and units.

    A routed-expert block of a config-only plan keeps only its first expert's pair
    (``sample``): every local expert has the same geometry and needed bytes, and a
    512-rank plan of a 128-expert model would otherwise build tens of millions of units
    nobody reads. ``units()`` builds them all when a rank's plan is asked for."""

    buffers: tuple[BufferSpec, ...]
    sample: tuple[Unit, ...]
    """The units, or the first of ``repeat`` equal-geometry groups of them."""
    needed: tuple[int, ...]
    """Config-only needed bytes per sample unit (empty when planning from a checkpoint)."""
    repeat: int = 1
    expand: Callable[[], tuple[Unit, ...]] | None = None
    """Builds every unit when only a sample is kept."""

    def units(self) -> tuple[Unit, ...]:
        return self.sample if self.expand is None else self.expand()

    @property
    def count(self) -> int:
        return len(self.sample) * self.repeat

    @property
    def needed_bytes(self) -> int:
        return sum(self.needed) * self.repeat


@dataclass(frozen=True)
class RankCoords:
    """Where a rank sits in the layout, and what that gives it."""

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    ep_rank: int
    """dp_rank*tp + tp_rank with expert parallel on a MoE model, else 0 (vLLM)."""
    moe_rank: int
    """Position in the dp*tp MoE group: whose expert slice (no EP) or which experts (EP)."""
    layers: tuple[int, ...]
    experts: tuple[int, ...]


def _held(
    engine: EngineProfile, kind: str, name: str, canonical: tuple[int, ...], dtype: str, layout: str
) -> BufferSpec:
    """A buffer of ``kind`` as ``engine`` holds it (view shape, storage order)."""
    h = held_as(engine, kind, canonical)
    return BufferSpec(name, h.shape, dtype, layout, h.storage_order, h.canonical_of_view)


def _mx_linear_buffers(engine: EngineProfile, name: str, n: int, k: int) -> tuple[BufferSpec, ...]:
    # docs/contract.md §2.3: weight [K, N] fp8; scale [ceil(g/2), N, 2] u8 with g = K/32.
    g = k // MX_GROUP
    return (
        _held(engine, "mx_linear", name, (k, n), FP8_BUFFER, LAYOUT_MX_LINEAR),
        _held(
            engine,
            "mx_linear_scale",
            name + SCALE_SUFFIX,
            (ceil_div(g, MX_PAIR), n, MX_PAIR),
            SCALE_BUFFER,
            LAYOUT_MX_LINEAR,
        ),
    )


class _Planner:
    """Builds rank plans for one (config, layout, checkpoint), sharing blocks across ranks."""

    def __init__(
        self,
        config: ModelConfig,
        layout: ParallelLayout,
        checkpoint: CheckpointMeta | None,
        engine: str | EngineProfile = DEFAULT_ENGINE,
    ) -> None:
        self.engine = engine_profile(engine)
        self.moe_mode = resolve_moe(self.engine, layout)
        self.scale_alg = scale_alg_for(self.engine, config.architecture, layout.scale_alg)
        validate_layout(config, layout, self.moe_mode.shared_experts_whole)
        self.config = config
        self.layout = layout
        self.checkpoint = checkpoint
        self.arch: Architecture = (
            architecture_for(config)
            .for_layout(layout.mm_encoder_tp_mode)
            .for_engine(
                self.moe_mode.shared_experts_whole,
                self.engine.dense_linears.get(config.architecture, ()),
            )
        )
        self.size = {name: dim.size(config) for name, dim in self.arch.dims.items()}
        self.ep = uses_expert_parallel(config, layout)
        self.model_st = MODEL_DTYPES[config.model_dtype]
        self.model_buffer_dtype = SAFETENSORS_TO_BUFFER[self.model_st]
        self.layer_rules = [
            self.arch.layer_rules(config, i) for i in range(config.num_hidden_layers)
        ]
        self.first_rules = self.arch.rules_at("first")
        self.last_rules = self.arch.rules_at("last")
        self.vision_rules = self.arch.vision_rules(config, layout.language_model_only)
        self.mtp_rules = self.arch.mtp_rules(
            config,
            layout.speculative_method == "mtp",
            self.engine.drafter_own.get(self.arch.name, ()),
        )
        # Rows the engine builds (and loads) on every pipeline stage, not only on the
        # first or last one (vLLM's Qwen3-MoE: embed_tokens, norm, lm_head).
        every = set(self.engine.every_stage.get(self.arch.name, ()))
        self.every_stage = {i for i, r in enumerate(self.arch.rules) if r.name in every}
        self._all_experts = tuple(range(config.num_experts))
        self.moe_rules = [r for r in self.arch.rules if r.style == "moe"] if config.is_moe else []
        check_expert_placement(self.engine, layout.expert_placement, self.ep)
        self._facts: dict[tuple[int, int], _Facts] = {}
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._moe_buffers: dict[tuple[int, int, int], tuple[BufferSpec, ...]] = {}
        self._moe_samples: dict[tuple[Any, ...], tuple[tuple[Unit, ...], tuple[int, ...]]] = {}
        self._copy_cap: int | None = None
        self._expanders: dict[tuple[int, int], Callable[[int], tuple[Unit, ...]]] = {}

    # --- coordinates ---------------------------------------------------------------------

    def coords(self, rank: int) -> RankCoords:
        layout, config = self.layout, self.config
        dp_rank, pp_rank, tp_rank = rank_coords(layout, rank)
        moe_rank = ep_rank_of(layout, dp_rank, tp_rank)
        if not config.is_moe:
            experts: tuple[int, ...] = ()
        elif self.ep:
            experts = experts_for_rank(
                config.num_experts, ep_size(layout), moe_rank, layout.expert_placement
            )
        else:
            experts = self._all_experts
        return RankCoords(
            rank=rank,
            dp_rank=dp_rank,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            ep_rank=moe_rank if self.ep else 0,
            moe_rank=moe_rank,
            layers=pipeline_layers(config.num_hidden_layers, layout.pp, pp_rank),
            experts=experts,
        )

    def placed(self, c: RankCoords) -> list[tuple[int, int]]:
        """(table row, layer) of the rank's blocks in plan order: the vision tower's rows
        (every stage), stage-0 rows, each layer's rows, last-stage rows, the MTP drafter's
        rows (last stage)."""
        out: list[tuple[int, int]] = list(self.vision_rules)
        first, last = c.pp_rank == 0, c.pp_rank == self.layout.pp - 1
        out.extend((i, -1) for i in self.first_rules if first or i in self.every_stage)
        for layer in c.layers:
            out.extend((i, layer) for i in self.layer_rules[layer])
        out.extend((i, -1) for i in self.last_rules if last or i in self.every_stage)
        if last:
            out.extend(self.mtp_rules)
        return out

    def blocks(self, c: RankCoords) -> list[_Block]:
        """The rank's blocks in plan order (:meth:`placed`)."""
        return [self._block(i, layer, c) for i, layer in self.placed(c)]

    def kind_key(self, c: RankCoords) -> tuple[int, ...]:
        """What a plan from a config alone of the rank depends on: its stage, its TP rank
        and the shape of its MoE blocks: how many experts, and how many scale tiles and
        MX groups its slice of each expert covers (a config-only plan has no offsets:
        its needed bytes, staging and predicted requests follow those counts). Ranks of
        one kind hold equal buffers and units of equal geometry; only which experts, or
        which rows of them, differ."""
        q = self.config.quant
        blocks = sorted({q.block_n or 1, q.block_k or 1, MX_GROUP})
        covered = []
        for rule in self.moe_rules:
            i_local, lo = self._moe_slice(c, rule)
            for b in blocks:
                t0, t1 = tile_span(lo, lo + i_local, b)
                covered.append(t1 - t0)
        return (c.pp_rank, c.tp_rank, len(c.experts), *covered)

    def class_key(self, c: RankCoords) -> tuple[int, int, int]:
        """What a plan with byte ranges depends on: the stage, the TP rank and the MoE rank
        (each expert's bytes sit at their own offsets)."""
        return (c.pp_rank, c.tp_rank, c.moe_rank if self.config.is_moe else 0)

    def expand_on(self, idx: int, layer: int) -> Callable[[int], tuple[Unit, ...]]:
        """Every unit of the MoE block of table row ``idx`` in ``layer``, on a given rank
        (one function per block, whichever kind asks)."""
        found = self._expanders.get((idx, layer))
        if found is None:
            found = self._expanders[(idx, layer)] = lambda rank: self._block(
                idx, layer, self.coords(rank)
            ).units()
        return found

    def _moe_slice(self, c: RankCoords, rule: TensorRule) -> tuple[int, int]:
        """(I_local, first row) of the rank's slice of each expert's intermediate dim."""
        inter = self.size[rule.sources[0].dims[0]]
        if self.ep:
            return inter, 0
        i_local = inter // ep_size(self.layout)
        return i_local, c.moe_rank * i_local

    def _moe_tile(self) -> int:
        """Rows after which a slice's position within scale tiles and MX groups repeats."""
        q = self.config.quant
        return math.lcm(q.block_n or 1, q.block_k or 1, MX_GROUP)

    def _block(self, idx: int, layer: int, c: RankCoords) -> _Block:
        rule = self.arch.rules[idx]
        if rule.style == "moe":
            shard = c.moe_rank
        elif rule.style == "replicated":
            shard = 0
        else:
            shard = c.tp_rank
        key = (idx, layer, shard)
        block = self._blocks.get(key)
        if block is None:
            if rule.style == "moe":
                block = self._moe_block(idx, layer, c)
            elif rule.style == "vocab":
                block = self._vocab_block(idx, c.tp_rank)
            else:
                block = self._dense_block(idx, layer, c.tp_rank)
            self._blocks[key] = block
        return block

    # --- what the sources are ---------------------------------------------------------------

    def _source_modules(self, rule: TensorRule, layer: int) -> list[list[str]]:
        """Per source of ``rule``: the checkpoint modules it reads (every expert for MoE)."""
        if rule.tied_source and self.config.tie_word_embeddings:
            return [[rule.tied_source]]
        experts = range(self.config.num_experts) if rule.style == "moe" else (-1,)
        return [
            [source_module(rule, src, layer, e, self.arch) for e in experts] for src in rule.sources
        ]

    def facts(self, idx: int, layer: int) -> _Facts:
        key = (idx, layer)
        found = self._facts.get(key)
        if found is None:
            found = self._compute_facts(self.arch.rules[idx], layer)
            self._facts[key] = found
        return found

    def _compute_facts(self, rule: TensorRule, layer: int) -> _Facts:
        modules = self._source_modules(rule, layer)
        specs = rule.sources[:1] if len(modules) == 1 and rule.tied_source else rule.sources
        quantized: dict[bool, list[str]] = {True: [], False: []}
        dtypes: dict[str, str] = {}
        ckpt = self.checkpoint
        for src, names in zip(specs, modules, strict=True):
            shape = tuple(self.size[d] for d in src.tensor_dims)
            for module in names:
                tensor = f"{module}.{src.tensor}"
                if ckpt is None:
                    q = (
                        rule.linear
                        and self.config.quant.kind != "none"
                        and not self.config.quant.is_excluded(module)
                    )
                    quantized[q].append(module)
                    continue
                info = ckpt.tensors.get(tensor)
                if info is None:
                    raise MissingTensor(
                        f"{ckpt.root}: tensor {tensor!r} is not in the checkpoint, but "
                        f"{self.config.architecture} needs it for {device_name(rule, layer, self.arch)}",
                        tensor=tensor,
                        file=ckpt.root,
                    )
                if tuple(info.shape) != shape:
                    raise CheckpointError(
                        f"{info.file}: tensor {tensor!r} has shape {list(info.shape)}, but "
                        f"{self.config.source} gives {list(shape)} "
                        f"({', '.join(self.arch.dims[d].key for d in src.tensor_dims)})",
                        tensor=tensor,
                        file=info.file,
                    )
                q = info.dtype == QUANT_WEIGHT_DTYPE
                if q and not rule.linear:
                    raise CheckpointError(
                        f"{info.file}: tensor {tensor!r} is {QUANT_WEIGHT_DTYPE}; mxload expects "
                        f"{device_name(rule, layer, self.arch)} unquantized (it is not a linear)",
                        tensor=tensor,
                        file=info.file,
                    )
                quantized[q].append(tensor)
                if not q:
                    dtypes.setdefault(info.dtype, tensor)
        if quantized[True] and quantized[False]:
            q_names, plain = quantized[True], quantized[False]
            raise MixedQuantization(
                f"parts of {device_name(rule, layer, self.arch)} disagree on being quantized: "
                f"{_few(q_names)} quantized, {_few(plain)} not (docs/contract.md §1.4)",
                tensor=plain[0],
            )
        if len(dtypes) > 1:
            listed = ", ".join(f"{t} is {d}" for d, t in dtypes.items())
            raise CheckpointError(
                f"parts of {device_name(rule, layer, self.arch)} disagree on dtype: {listed}",
                tensor=next(iter(dtypes.values())),
            )
        if dtypes:
            dtype = next(iter(dtypes))
            if dtype not in SAFETENSORS_TO_BUFFER:
                tensor = dtypes[dtype]
                raise CheckpointError(
                    f"tensor {tensor!r} is {dtype}; mxload holds tensors as "
                    + ", ".join(SAFETENSORS_TO_BUFFER),
                    tensor=tensor,
                )
        else:
            dtype = "F32" if rule.float32 or rule.held == "float32" else self.model_st
        return _Facts(quantized=bool(quantized[True]), dtype=dtype)

    def _needed(self, units: Sequence[Unit], facts: _Facts) -> tuple[int, ...]:
        if self.checkpoint is not None:
            return ()
        return tuple(needed_bytes(u, self.config, source_dtype=facts.dtype) for u in units)

    # --- blocks --------------------------------------------------------------------------------

    def _dense_block(self, idx: int, layer: int, tp_rank: int) -> _Block:
        """A column, row or replicated row: one unit, one (or two, MX) buffers.

        A source is addressed as a matrix ``[N, K]`` (1-D: ``[1, n]``; more dims: ``[N,
        prod(rest)]``, the same row-major bytes). A 1-D column row splits its only dim."""
        rule = self.arch.rules[idx]
        facts = self.facts(idx, layer)
        tp = self.layout.tp
        tied = bool(rule.tied_source and self.config.tie_word_embeddings)
        parts: list[Part] = []
        n_local = 0
        k_local = 0
        one_d = False
        tail: tuple[int, ...] = ()
        for src in rule.sources:
            shape = tuple(self.size[d] for d in src.tensor_dims)
            part = tuple(self.size[d] for d in src.dims)
            one_d = len(part) == 1
            off = sum(self.size[d] for d in src.before)
            tail = part[1:]
            n, k = (1, part[0]) if one_d else (part[0], math.prod(tail))
            rows, cols = (off, off + n), (0, k)
            if one_d:
                rows, cols = (0, 1), (off, off + k)
            if rule.style == "column":
                dim = self.arch.dims[src.dims[0]]
                count, per = dim.count(self.config), dim.per_unit(self.config)
                if src.split == "kv_heads":
                    lo, hi = kv_head_rows(count, per, tp, tp_rank)
                else:
                    lo, hi = even_split(count, per, tp, tp_rank)
                if one_d:
                    cols = (off + lo, off + hi)
                else:
                    rows = (off + lo, off + hi)
            elif rule.style == "row":
                dim = self.arch.dims[src.dims[1]]
                cols = even_split(dim.count(self.config), dim.per_unit(self.config), tp, tp_rank)
            module = rule.tied_source if tied else source_module(rule, src, layer, -1, self.arch)
            tensor = "" if src.tensor == "weight" else f"{module}.{src.tensor}"
            parts.append(Part(module, rows, cols, n_local, tensor, shape))
            n_local += rows[1] - rows[0]
            k_local = cols[1] - cols[0]
        name = f"{device_name(rule, layer, self.arch)}.{rule.sources[0].tensor}"
        kind: UnitKind = "linear" if rule.linear else "copy"
        if facts.quantized and rule.mx and k_local % MX_GROUP == 0:
            layout = LAYOUT_MX_LINEAR
            buffers = _mx_linear_buffers(self.engine, name, n_local, k_local)
        else:
            layout = LAYOUT_DENSE
            if rule.held == "float32":
                dtype = SAFETENSORS_TO_BUFFER["F32"]
            elif rule.held == "model" or facts.quantized:
                dtype = self.model_buffer_dtype
            else:
                dtype = SAFETENSORS_TO_BUFFER[facts.dtype]
            if one_d:
                # merged 1-D parts (a qkv bias) of equal width: row j of [parts, k] is part j
                shape_l: tuple[int, ...] = (n_local * k_local,)
            elif len(tail) > 1:
                shape_l = (n_local, *tail)
            else:
                shape_l = (n_local, k_local)
            buffers = (BufferSpec(name, shape_l, dtype, layout),)
        derived, extra = self._derived(rule, layer, buffers[0], n_local, k_local)
        unit = Unit(
            buffer=name,
            kind=kind,
            layout=layout,
            rows=n_local,
            cols=k_local,
            parts=tuple(parts),
            quantized=facts.quantized,
            derived=derived,
        )
        return _Block((*buffers, *extra), (unit,), self._needed((unit,), facts))

    def _derived(
        self, rule: TensorRule, layer: int, source: BufferSpec, n: int, k: int
    ) -> tuple[tuple[Derived, ...], tuple[BufferSpec, ...]]:
        """The tensors the engine derives from ``source`` after loading (its profile's
        ``derived``), as buffers of this rank recomputed after each write of the unit
        (docs/contract.md §2.4)."""
        rules = derived_rules(self.engine, self.arch.name, rule.name)
        if not rules:
            return (), ()
        if source.layout != LAYOUT_DENSE:
            raise LayoutError(
                f"--engine {self.engine.name} derives {rules[0].name} from {source.name}, "
                f"which this plan holds {source.layout}: the engine reads it in the model "
                "dtype",
                key="--engine",
                tensor=source.name,
            )
        derived: list[Derived] = []
        buffers: list[BufferSpec] = []
        for d in rules:
            split = tuple(int(getattr(self.config, key)) for key in d.split)
            heads = n // sum(split)
            # beside the source, under the same prefix (an MTP layer's mtp_block.)
            where = rule.name[: len(rule.name) - len(d.source)] + d.name
            name = device_name(replace(rule, name=where), layer, self.arch)
            shape = DERIVED_SHAPES[d.op](heads, split[d.part], k)
            derived.append(Derived(name, d.op, split, d.part))
            buffers.append(BufferSpec(name, shape, source.dtype, LAYOUT_DENSE))
        return tuple(derived), tuple(buffers)

    def copy_unit_bytes(self) -> int:
        """Largest row block of a vocab-parallel buffer (embedding, lm_head): the FP8
        payload bytes (rows x K) of the largest linear or expert-half unit any rank holds.

        Why: a unit is written atomically from staging (docs/contract.md §4, §6), and the default
        staging budget is the largest unit. Whole, a vocab shard (622 MB of Qwen3-30B-A3B
        at tp=1) would set that budget, 30-100x an expert's. Cut into blocks no larger
        than the largest converted unit's source, it never does; each block is a unit
        with its own version, so a reload stays atomic per block. The size depends on
        geometry only (not on the source dtype), so a BF16 or MXFP8 checkpoint of the same
        model gets the same units and passes reload preflight."""
        if self._copy_cap is None:
            cap = 0
            seen_stages: set[int] = set()
            for rank in range(self.layout.world):
                c = self.coords(rank)
                if c.pp_rank in seen_stages:
                    continue
                seen_stages.add(c.pp_rank)
                for layer in c.layers:
                    for i in self.layer_rules[layer]:
                        for u in self._block(i, layer, c).sample:
                            if u.kind != "copy":
                                cap = max(cap, u.rows * u.cols)
                if len(seen_stages) == self.layout.pp:
                    break
            self._copy_cap = cap or COPY_UNIT_FALLBACK_BYTES
        return self._copy_cap

    def _vocab_block(self, idx: int, tp_rank: int) -> _Block:
        """Vocab-parallel rows (docs/contract.md §3): the rank's slice of V padded to 64; rows past V
        are covered by no part and stay zero. The slice is written as row blocks of at most
        :meth:`copy_unit_bytes`, each a unit of its own (see there)."""
        rule = self.arch.rules[idx]
        facts = self.facts(idx, -1)
        src = rule.sources[0]
        vocab, hidden = self.size[src.dims[0]], self.size[src.dims[1]]
        per = padded_vocab(vocab) // self.layout.tp
        lo = tp_rank * per
        tied = bool(rule.tied_source and self.config.tie_word_embeddings)
        module = rule.tied_source if tied else src.module
        # A tied lm_head names the embedding tensor it is built from (docs/contract.md §3).
        tensor = f"{module}.{src.tensor}" if tied else ""
        name = f"{rule.name}.{src.tensor}"
        buffer = BufferSpec(name, (per, hidden), SAFETENSORS_TO_BUFFER[facts.dtype], LAYOUT_DENSE)
        itemsize = SAFETENSORS_ITEMSIZE[facts.dtype]
        step = max(1, self.copy_unit_bytes() // max(1, hidden * itemsize))
        units = []
        for b0 in range(0, per, step):
            b1 = min(b0 + step, per)
            s0, s1 = lo + b0, min(lo + b1, vocab)  # source rows; none past V (padding)
            parts: tuple[Part, ...] = ()
            if s0 < s1:
                parts = (Part(module, (s0, s1), (0, hidden), 0, tensor, (vocab, hidden)),)
            units.append(
                Unit(
                    buffer=name,
                    kind="copy",
                    layout=LAYOUT_DENSE,
                    rows=b1 - b0,
                    cols=hidden,
                    parts=parts,
                    quantized=False,
                    row0=b0,
                )
            )
        return _Block((buffer,), tuple(units), self._needed(tuple(units), facts))

    def _moe_block(self, idx: int, layer: int, c: RankCoords) -> _Block:
        """Routed experts of one layer on one MoE rank: four (MX) or two (dense) fused
        buffers and two units per local expert, in local order (docs/contract.md §2.3, §3)."""
        rule = self.arch.rules[idx]
        facts = self.facts(idx, layer)
        gate, up, down = rule.sources
        inter = self.size[gate.dims[0]]
        hidden = self.size[gate.dims[1]]
        i_local, lo = self._moe_slice(c, rule)
        mx = facts.quantized and rule.mx and hidden % MX_GROUP == 0 and i_local % MX_GROUP == 0
        layout = LAYOUT_MX_MOE if mx else LAYOUT_DENSE
        prefix = device_name(rule, layer, self.arch) + self.engine.moe_infix
        w13, w2 = f"{prefix}.{W13_BUFFER}", f"{prefix}.{W2_BUFFER}"
        e_local = len(c.experts)
        bkey = (idx, layer, e_local)
        buffers = self._moe_buffers.get(bkey)
        if buffers is None:
            eng = self.engine
            if mx:
                check_moe_groups(eng, w13, hidden, MX_GROUP)
                check_moe_groups(eng, w2, i_local, MX_GROUP)
                g13, g2 = hidden // MX_GROUP, i_local // MX_GROUP
                buffers = (
                    _held(eng, "mx_moe", w13, (e_local, hidden, 2 * i_local), FP8_BUFFER, layout),
                    _held(
                        eng,
                        "mx_moe_scale",
                        w13 + SCALE_SUFFIX,
                        (e_local, ceil_div(g13, MX_PAIR), 2 * i_local, MX_PAIR),
                        SCALE_BUFFER,
                        layout,
                    ),
                    _held(eng, "mx_moe", w2, (e_local, i_local, hidden), FP8_BUFFER, layout),
                    _held(
                        eng,
                        "mx_moe_scale",
                        w2 + SCALE_SUFFIX,
                        (e_local, ceil_div(g2, MX_PAIR), hidden, MX_PAIR),
                        SCALE_BUFFER,
                        layout,
                    ),
                )
            else:
                dtype = (
                    self.model_buffer_dtype
                    if facts.quantized
                    else SAFETENSORS_TO_BUFFER[facts.dtype]
                )
                buffers = (
                    _held(eng, "dense_moe", w13, (e_local, 2 * i_local, hidden), dtype, layout),
                    _held(eng, "dense_moe", w2, (e_local, hidden, i_local), dtype, layout),
                )
            self._moe_buffers[bkey] = buffers
        rows13 = (lo, lo + i_local)
        all_cols = (0, hidden)
        shape13, shape2 = (inter, hidden), (hidden, inter)
        quantized = facts.quantized
        # Module names are built by concatenation around the expert id: this loop runs
        # once per local expert per layer per MoE rank, the planner's hottest path.
        names = [
            source_module(rule, src, layer, -1, self.arch).split(EXPERT_PLACEHOLDER, 1)
            for src in (gate, up, down)
        ]
        (g0, g1), (u0, u1), (d0, d1) = names

        def build(experts: Sequence[int]) -> tuple[Unit, ...]:
            units: list[Unit] = []
            for j, e in enumerate(experts):
                tag = str(e)
                units.append(
                    Unit(
                        w13,
                        "moe_w13",
                        layout,
                        2 * i_local,
                        hidden,
                        (
                            Part(g0 + tag + g1, rows13, all_cols, 0, "", shape13),
                            Part(u0 + tag + u1, rows13, all_cols, i_local, "", shape13),
                        ),
                        quantized,
                        j,
                        e,
                    )
                )
                units.append(
                    Unit(
                        w2,
                        "moe_w2",
                        layout,
                        hidden,
                        i_local,
                        (Part(d0 + tag + d1, all_cols, rows13, 0, "", shape2),),
                        quantized,
                        j,
                        e,
                    )
                )
            return tuple(units)

        experts = c.experts
        if self.checkpoint is not None:
            # Reads are planned per unit (each expert's tensors sit at their own offsets).
            return _Block(buffers, build(experts), ())
        # Every expert's halves have the same geometry, hence the same needed bytes.
        if len(experts) <= 1:
            pair = build(experts)
            return _Block(buffers, pair, self._needed(pair, facts))
        # The sample stands for the geometry only: blocks of other layers and MoE ranks
        # whose halves cover the same tiles (the slice's offset within a scale tile)
        # share one, so sizing and the time model see each shape once.
        skey = (idx, facts, layout, i_local, lo % self._moe_tile())
        found = self._moe_samples.get(skey)
        if found is None:
            pair = build(experts[:1])
            found = self._moe_samples[skey] = (pair, self._needed(pair, facts))
        return _Block(buffers, found[0], found[1], len(experts), lambda: build(experts))


@dataclass(frozen=True)
class _Staged:
    """One rank class between the two passes of build_plan (sizes first, then staging)."""

    coords: RankCoords
    """Its first rank's."""
    blocks: tuple[_Block, ...]
    buffers: tuple[BufferSpec, ...]
    units: tuple[Unit, ...] | None
    """Every unit with a checkpoint; None for a config-only plan (built when asked)."""
    read_fn: Callable[[Unit, int, int], int] | None
    needed: int
    to_read: int
    reads: tuple[UnitReads, ...] | None
    signature: tuple[tuple[tuple[int, ...], int], ...]
    """Per block, the geometry ids of its sample units and how often they repeat: equal
    signatures, equal staging."""
    groups: tuple[ReadGroup, ...]


class _LazyRanks(Sequence[RankPlan]):
    """``Plan.ranks`` of a config-only plan: each rank's full plan is built when asked
    for (a 512-rank plan of a 128-expert model holds millions of units), and its units
    kept for the ranks that hold the same ones (same stage, TP rank and MoE rank)."""

    def __init__(
        self, summaries: tuple[RankSummary, ...], classes: tuple[RankClass, ...], planner: _Planner
    ) -> None:
        self._summaries = summaries
        self._classes = classes
        self._planner = planner
        self._units: dict[tuple[int, int, int], tuple[Unit, ...]] = {}

    def __len__(self) -> int:
        return len(self._summaries)

    @overload
    def __getitem__(self, index: int) -> RankPlan: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RankPlan]: ...

    def __getitem__(self, index: int | slice) -> RankPlan | Sequence[RankPlan]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        s = self._summaries[index]
        planner = self._planner
        c = planner.coords(s.rank)
        key = planner.class_key(c)
        units = self._units.get(key)
        if units is None:
            with no_cycle_collection():
                units = self._units[key] = _flatten(planner.blocks(c))[1]
        return _rank_plan(s, self._classes[s.rank_class], units, None, planner.scale_alg)


def _rank_plan(
    s: RankSummary,
    k: RankClass,
    units: tuple[Unit, ...],
    reads: tuple[UnitReads, ...] | None,
    scale_alg: int,
) -> RankPlan:
    return RankPlan(
        rank=s.rank,
        tp_rank=s.tp_rank,
        dp_rank=s.dp_rank,
        pp_rank=s.pp_rank,
        ep_rank=s.ep_rank,
        layers=s.layers,
        experts=s.experts,
        buffers=k.buffers,
        units=units,
        bytes_needed=k.bytes_needed,
        bytes_to_read=k.bytes_to_read,
        reads=reads,
        staging=k.staging,
        scale_alg=scale_alg,
    )


def _geometry(unit: Unit, reads: UnitReads | int, align: int) -> tuple[Any, ...]:
    """Everything the memory model sees of a unit: its shape, layout, quantization, and
    its parts' rectangles with the sizes of their reads (not names, files or offsets)."""
    # Absolute offsets matter only through tile alignment (a chunk's covering tiles).
    parts = tuple((p.nrows, p.ncols, p.dst_row, p.rows[0] % align) for p in unit.parts)
    if isinstance(reads, int):
        read_shape: Any = reads
    else:
        read_shape = tuple(
            (
                r.weight.length,
                r.weight.count,
                r.weight_dtype,
                None if r.scale is None else (r.scale.length, r.scale.count),
                r.tile_rows[1] - r.tile_rows[0],
                r.tile_cols[1] - r.tile_cols[0],
            )
            for r in reads.parts
        )
    return (unit.kind, unit.layout, unit.quantized, unit.rows, unit.cols, parts, read_shape)


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off while a plan builds its many small objects (none of
    them in a cycle): each of its full passes walks every object built so far, half the
    time of a large plan. Back as it was after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _few(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _flatten(blocks: Sequence[_Block]) -> tuple[tuple[BufferSpec, ...], tuple[Unit, ...]]:
    buffers: list[BufferSpec] = []
    units: list[Unit] = []
    for b in blocks:
        buffers.extend(b.buffers)
        units.extend(b.units())
    return tuple(buffers), tuple(units)


# --- public API -----------------------------------------------------------------------------


def plan_rank(
    config: ModelConfig,
    layout: ParallelLayout,
    rank: int,
    *,
    checkpoint: CheckpointMeta | None = None,
    engine: str | EngineProfile = DEFAULT_ENGINE,
) -> tuple[tuple[BufferSpec, ...], tuple[Unit, ...]]:
    """The buffers and units of one rank, in plan order (docs/contract.md §3).

    Refuses a layout the model cannot take (LayoutError), a checkpoint that disagrees
    with the config (CheckpointError naming the tensor) and merged parts that disagree on
    being quantized (MixedQuantization)."""
    planner = _Planner(config, layout, checkpoint, engine)
    return _flatten(planner.blocks(planner.coords(rank)))


def check_checkpoint(checkpoint: CheckpointMeta) -> None:
    """Every check a plan makes of a checkpoint that does not depend on the layout: each
    tensor the architecture needs is there with the config's shape, merged parts agree on
    being quantized and on dtype, and non-linears are not FP8 (raises what
    :func:`build_plan` raises).

    ``mxload convert`` runs it, so that no command writes a checkpoint that ``plan`` and
    ``load`` refuse; the planner runs the same code for every layout (at tp=dp=pp=1 every
    block of the model is visited once)."""
    planner = _Planner(checkpoint.config, ParallelLayout(), checkpoint)
    with no_cycle_collection():
        planner.blocks(planner.coords(0))


def quantization_groups(config: ModelConfig) -> list[tuple[str, ...]]:
    """Checkpoint modules that must agree on being quantized, because they fill one
    device tensor (merged q/k/v, gate/up) or one MoE block whose buffers share a layout
    (every expert's gate, up and down of a layer). ``mxload convert`` falls back to the
    model dtype for a whole group when one member must (K not a multiple of 32), so that
    what it writes plans and loads."""
    planner = _Planner(config, ParallelLayout(), None)
    groups: list[tuple[str, ...]] = []
    placed = [(i, -1) for i in (*planner.first_rules, *planner.last_rules)]
    placed += [
        (i, layer) for layer in range(config.num_hidden_layers) for i in planner.layer_rules[layer]
    ]
    for idx, layer in placed:
        rule = planner.arch.rules[idx]
        if rule.linear:
            modules = planner._source_modules(rule, layer)
            groups.append(tuple(m for names in modules for m in names))
    return groups


def dense_linear_modules(
    config: ModelConfig, engine: str | EngineProfile = DEFAULT_ENGINE
) -> set[str]:
    """Checkpoint modules of linears ``engine`` holds in the model dtype even when quantized
    (``EngineProfile.dense_linears``: DeepSeek's ``kv_b_proj``, which vllm-ascend's MLA
    requires unquantized; and the table's ``mx=False`` linears, such as DeepSeek's MTP
    ``eh_proj``, a plain ``nn.Linear`` in vLLM), in the decoder layers and in the MTP layers
    a speculative layout plans. ``mxload convert`` writes them resolved and lists them in
    ``exclude_modules``."""
    has_mtp = config.mtp_layers > 0 and bool(architecture_for(config).rules_at("mtp_layer"))
    layout = ParallelLayout(speculative_method="mtp" if has_mtp else "")
    planner = _Planner(config, layout, None, engine)
    placed = [
        (i, layer) for layer in range(config.num_hidden_layers) for i in planner.layer_rules[layer]
    ]
    out: set[str] = set()
    for idx, layer in [*placed, *planner.mtp_rules]:
        rule = planner.arch.rules[idx]
        if rule.linear and not rule.mx:
            out.update(m for names in planner._source_modules(rule, layer) for m in names)
    return out


def build_plan(
    config: ModelConfig,
    layout: ParallelLayout,
    *,
    checkpoint: CheckpointMeta | None = None,
    staging_budget: int | None = None,
    device_memory: int | None = None,
    device: str = "cpu",
    remote: bool = False,
    fused: bool = True,
    engine: str | EngineProfile = DEFAULT_ENGINE,
    read_ahead: bool | None = None,
) -> Plan:
    """Every rank's plan, with reads (when there is a checkpoint) and staging (docs/contract.md §6).

    ``staging_budget`` None means the default of docs/contract.md §6: the reload minimum of the whole
    plan (the largest unit of any rank), the same budget on every rank; a budget below
    the load minimum is refused (StagingBudgetError stating the minimum). ``fused``: the
    workers convert with the fused CPU kernel (no resolve scratch). ``remote``
    picks the coalescing policy the predicted ``bytes_to_read`` assumes; it sums each
    unit's coalesced requests, as the loader issues them unit by unit. A config-only plan
    has no byte ranges: it predicts ``bytes_to_read`` = ``bytes_needed``. ``read_ahead``:
    whether the ranks read from an object store, keeping several steps' reads in flight
    (their staging counts them); default ``remote``."""
    # A large plan creates hundreds of thousands of small acyclic objects; the cyclic
    # collector would rescan the growing heap over and over while they are built.
    with no_cycle_collection():
        return _build_plan(
            config,
            layout,
            checkpoint=checkpoint,
            staging_budget=staging_budget,
            device_memory=device_memory,
            device=device,
            remote=remote,
            fused=fused,
            engine=engine,
            read_ahead=remote if read_ahead is None else read_ahead,
        )


def _model_summary(config: ModelConfig, layout: ParallelLayout) -> dict[str, Any]:
    """``config.summary()``, with the vision tower among the scopes not planned when the
    layout is language-model-only, and the MTP module planned when it plans MTP."""
    out = config.summary()
    not_planned = list(config.not_planned(mtp=layout.speculative_method == "mtp"))
    if config.vision is not None:
        out["vision_depth"] = config.vision.depth
        if layout.language_model_only:
            not_planned.insert(
                0, "model.visual.* (vision tower): the engine runs --language-model-only"
            )
    out.pop("not_planned", None)
    if not_planned:
        out["not_planned"] = not_planned
    return out


def _build_plan(
    config: ModelConfig,
    layout: ParallelLayout,
    *,
    checkpoint: CheckpointMeta | None,
    staging_budget: int | None,
    device_memory: int | None,
    device: str,
    remote: bool,
    fused: bool = True,
    engine: str | EngineProfile = DEFAULT_ENGINE,
    by_kind: bool = True,
    read_ahead: bool = False,
) -> Plan:
    """``by_kind`` False plans a config alone once per stage, TP rank and MoE rank, as a
    plan with byte ranges is (the reference the kinds are checked against).

    In two passes: which ranks are planned alike and what each such class holds and
    reads (:func:`_rank_classes`, sizing the staging minimums on the way), then the
    staging budget (:func:`_budget`) and each class's staging under it
    (:func:`_class_staging`)."""
    from .memory import ConvertOptions

    planner = _Planner(config, layout, checkpoint, engine)
    policy = REMOTE_POLICY if remote else LOCAL_POLICY
    opts = ConvertOptions.for_source(
        config.model_dtype,
        config.quant.kind,
        config.quant.block_n,
        fused=fused,
        device=device,
        remote=read_ahead,
    )
    stager = _Stager(planner, checkpoint, policy, opts)
    staged, summaries = _rank_classes(planner, stager, by_kind=checkpoint is None and by_kind)
    budget = _budget(staging_budget, stager.load_min, stager.reload_min)
    classes = _class_staging(staged, opts, budget)
    ranks: Sequence[RankPlan]
    if checkpoint is not None:
        ranks = tuple(
            _rank_plan(
                s,
                classes[s.rank_class],
                staged[s.rank_class].units or (),
                staged[s.rank_class].reads,
                planner.scale_alg,
            )
            for s in summaries
        )
    else:
        ranks = _LazyRanks(summaries, classes, planner)
    return Plan(
        model=_model_summary(config, layout),
        layout=layout,
        ranks=ranks,
        min_staging_load=stager.load_min,
        min_staging_reload=stager.reload_min,
        device_memory_bytes=device_memory,
        extra={
            "staging_budget_bytes": budget,
            "device": device,
            "coalescing": {
                "remote": remote,
                "max_gap_bytes": policy.max_gap_bytes,
                "max_overread_ratio": policy.max_overread_ratio,
            },
            "from_checkpoint": checkpoint is not None,
        },
        engine=planner.engine.name,
        moe_mode=planner.moe_mode.to_json() if config.is_moe else {},
        scale_alg=planner.scale_alg,
        summaries=summaries,
        classes=classes,
    )


class _Stager:
    """The first pass over one rank class: its blocks, what it reads (with a checkpoint:
    each unit's byte ranges, the fetches they cost), and the staging minimums of its
    units' geometries, gathered over every class (``load_min``, ``reload_min``)."""

    def __init__(
        self,
        planner: _Planner,
        checkpoint: CheckpointMeta | None,
        policy: Any,
        opts: Any,
    ) -> None:
        self.planner = planner
        self.checkpoint = checkpoint
        self.policy = policy
        self.opts = opts
        self.quant = planner.config.quant.kind
        self.block_n = opts.block_n
        self.reads_of: dict[int, UnitReads] = {}
        # The loader requests each unit's ranges on their own (per file, coalesced under
        # the policy), so a rank fetches the sum of its units' requests: a tensor two
        # units share (a tied embedding on a one-stage rank) is fetched twice, and no gap
        # between two units' ranges is ever bridged.
        self.fetch_of: dict[int, int] = {}
        # Sizing is the slow part (min_budgets walks every 16-row chunk of a unit), and
        # it depends only on a unit's geometry and read sizes, never on its name or
        # layer: units of equal geometry are sized once, and classes whose units have
        # equal geometries, in the same order, share one staging estimate.
        self.geometry_ids: dict[tuple[Any, ...], int] = {}
        self.mins_of_geometry: list[tuple[int, int]] = []
        self.gids_of_block: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
        self.load_min = 0
        self.reload_min = 0

    def stage(self, c: RankCoords) -> _Staged:
        from .memory import read_fn_from_reads

        blocks = tuple(self.planner.blocks(c))
        buffers = tuple(b for block in blocks for b in block.buffers)
        units: tuple[Unit, ...] | None = None
        reads: tuple[UnitReads, ...] | None = None
        read_fn: Callable[[Unit, int, int], int] | None = None
        if self.checkpoint is not None:
            units = tuple(u for block in blocks for u in block.units())
            reads, to_read = self._reads(units)
            needed = sum(r.needed_bytes for r in reads)
            read_fn = read_fn_from_reads(
                units, reads, block_n=self.block_n, source_quant=self.quant
            )
            groups = self._groups_of_reads(blocks, units, reads)
        else:
            needed = to_read = sum(block.needed_bytes for block in blocks)
            groups = self._groups_of_config(c, blocks)
        return _Staged(
            c,
            blocks,
            buffers,
            units,
            read_fn,
            needed,
            to_read,
            reads,
            self._signature(blocks, reads),
            groups,
        )

    def _reads(self, units: Sequence[Unit]) -> tuple[tuple[UnitReads, ...], int]:
        """Each unit's byte ranges (planned once per unit) and the bytes the rank fetches."""
        assert self.checkpoint is not None
        rank_reads: list[UnitReads] = []
        to_read = 0
        for u in units:
            r = self.reads_of.get(id(u))
            if r is None:
                r = self.reads_of[id(u)] = unit_reads(
                    u, self.checkpoint, whole=self.policy.whole_rows
                )
                self.fetch_of[id(u)] = predicted_read_bytes((r,), self.policy)
            rank_reads.append(r)
            to_read += self.fetch_of[id(u)]
        return tuple(rank_reads), to_read

    @staticmethod
    def _groups_of_reads(
        blocks: Sequence[_Block], units: Sequence[Unit], reads: Sequence[UnitReads]
    ) -> tuple[ReadGroup, ...]:
        groups = []
        pos = 0
        for block in blocks:
            n = block.count
            br = tuple(reads[pos : pos + n])
            needs = tuple(r.needed_bytes for r in br)
            groups.append(ReadGroup(tuple(units[pos : pos + n]), br, needs))
            pos += n
        return tuple(groups)

    def _groups_of_config(self, c: RankCoords, blocks: Sequence[_Block]) -> tuple[ReadGroup, ...]:
        # Routed experts are the rank's own (no other rank holds the same ones, or the
        # same rows of them): the kind's ranks differ in them, so they are counted,
        # and expanded per rank only where other ranks read the same whole rows.
        groups = []
        for (idx, layer), b in zip(self.planner.placed(c), blocks, strict=True):
            if self.planner.arch.rules[idx].style == "moe":
                expand = self.planner.expand_on(idx, layer)
                groups.append(ReadGroup(b.sample, None, b.needed, b.repeat, expand, own=True))
            else:
                groups.append(ReadGroup(b.sample, None, b.needed, b.repeat))
        return tuple(groups)

    def _signature(
        self, blocks: Sequence[_Block], reads: Sequence[UnitReads] | None
    ) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Per block, the geometry ids of its sample units and their repeat, sizing each
        new geometry's staging minimums."""
        from .memory import min_budgets, proportional_read_fn, read_fn_from_reads

        signature: list[tuple[tuple[int, ...], int]] = []
        pos = 0
        for block in blocks:
            # Blocks sharing a sample (other layers' and MoE ranks' experts of one shape)
            # share their geometry ids.
            bkey = (id(block.sample), block.repeat)
            gkey = self.gids_of_block.get(bkey)
            if gkey is None:
                sample, repeat = block.sample, block.repeat
                # Every expert of a MoE block has the same geometry: size its first pair.
                if sample and sample[0].kind == "moe_w13" and repeat == 1 and len(sample) > 2:
                    sample, repeat = sample[:2], len(sample) // 2
                sizes: list[UnitReads | int]
                if reads is not None:
                    sample_reads = reads[pos : pos + len(sample)]
                    sizes = list(sample_reads)
                    sample_fn = read_fn_from_reads(
                        sample, sample_reads, block_n=self.block_n, source_quant=self.quant
                    )
                else:
                    sizes = list(block.needed)
                    sample_fn = proportional_read_fn(sample, block.needed)
                ids = []
                for u, size in zip(sample, sizes, strict=True):
                    # A proportional read size does not depend on tile alignment.
                    key = _geometry(u, size, self.block_n if reads is not None else 1)
                    gid = self.geometry_ids.get(key)
                    if gid is None:
                        gid = self.geometry_ids[key] = len(self.mins_of_geometry)
                        self.mins_of_geometry.append(min_budgets((u,), sample_fn, self.opts))
                        self.load_min = max(self.load_min, self.mins_of_geometry[gid][0])
                        self.reload_min = max(self.reload_min, self.mins_of_geometry[gid][1])
                    ids.append(gid)
                gkey = self.gids_of_block[bkey] = (tuple(ids), repeat)
            signature.append(gkey)
            pos += block.count
        return tuple(signature)


def _rank_classes(
    planner: _Planner, stager: _Stager, *, by_kind: bool
) -> tuple[list[_Staged], tuple[RankSummary, ...]]:
    """Which ranks are planned alike, each class staged once, and every rank's summary.

    Blocks depend on the stage, the TP rank and the MoE rank only (docs/contract.md §3);
    ``by_kind`` (a config-only plan): ranks whose MoE blocks differ only in which experts
    (or rows of them) they hold are one kind, planned once."""
    key_of = planner.kind_key if by_kind else planner.class_key
    class_of_key: dict[tuple[int, ...], int] = {}
    staged: list[_Staged] = []
    summaries: list[RankSummary] = []
    for rank in range(planner.layout.world):
        c = planner.coords(rank)
        ckey = key_of(c)
        k = class_of_key.get(ckey)
        if k is None:
            k = class_of_key[ckey] = len(staged)
            staged.append(stager.stage(c))
        summaries.append(
            RankSummary(
                rank=c.rank,
                tp_rank=c.tp_rank,
                dp_rank=c.dp_rank,
                pp_rank=c.pp_rank,
                ep_rank=c.ep_rank,
                layers=c.layers,
                experts=c.experts,
                rank_class=k,
            )
        )
    return staged, tuple(summaries)


def _budget(staging_budget: int | None, load_min: int, reload_min: int) -> int:
    """The staging budget: the one given, or the reload minimum (docs/contract.md §6);
    refused below the load minimum."""
    budget = staging_budget if staging_budget is not None else reload_min
    if budget < load_min:
        raise StagingBudgetError(
            f"--staging-budget {budget} bytes is below the minimum a load can run under "
            f"({load_min} bytes; a reload needs {reload_min}); raise --staging-budget",
            key="--staging-budget",
        )
    return budget


def _class_staging(staged: Sequence[_Staged], opts: Any, budget: int) -> tuple[RankClass, ...]:
    """Each class's staging under ``budget`` (classes of equal signature share one
    estimate) and its persistent bytes."""
    from .memory import rank_staging

    classes: list[RankClass] = []
    staging_of: dict[tuple[tuple[tuple[int, ...], int], ...], StagingEstimate] = {}
    bytes_of: dict[int, int] = {}
    for st in staged:
        staging = staging_of.get(st.signature)
        if staging is None:
            if st.units is not None and st.read_fn is not None:
                staging = rank_staging(st.units, st.read_fn, opts, budget)
            else:
                every = tuple(u for b in st.blocks for u in b.units())
                sizes = [n for b in st.blocks for _ in range(b.repeat) for n in b.needed]
                staging = rank_staging(every, sizes, opts, budget)
            staging_of[st.signature] = staging
        count = sum(b.count for b in st.blocks)
        persistent = 0
        for b in st.blocks:
            nbytes = bytes_of.get(id(b.buffers))
            if nbytes is None:
                nbytes = bytes_of[id(b.buffers)] = sum(x.nbytes for x in b.buffers)
            persistent += nbytes
        classes.append(
            RankClass(st.buffers, count, st.needed, st.to_read, staging, st.groups, persistent)
        )
    return tuple(classes)


def _derived_of(k: RankClass) -> tuple[list[str], int]:
    """Names and bytes of the buffers the engine derives (docs/contract.md §2.4) a rank
    class holds."""
    names = [d.buffer for g in k.groups for u in g.units for d in u.derived]
    size = {b.name: b.nbytes for b in k.buffers}
    return names, sum(size[n] for n in names)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The ``mxload plan --json`` object of docs/contract.md §5, plus itemised staging and headroom."""
    ranks = []
    derived_names: dict[str, None] = {}
    for r in plan.summaries:
        k = plan.classes[r.rank_class]
        names, derived_bytes = _derived_of(k)
        staging = k.staging
        entry: dict[str, Any] = {
            "rank": r.rank,
            "tp_rank": r.tp_rank,
            "dp_rank": r.dp_rank,
            "pp_rank": r.pp_rank,
            "ep_rank": r.ep_rank,
            "layers": list(r.layers),
            "experts": list(r.experts),
            "persistent_bytes": k.persistent_bytes,
            "staging_bytes": staging.staging_bytes if staging else 0,
            "peak_bytes": k.peak_bytes,
            "bytes_needed": k.bytes_needed,
            "bytes_to_read": k.bytes_to_read,
            # extras
            "buffers": len(k.buffers),
            "units": k.unit_count,
            "read_amplification": (k.bytes_to_read / k.bytes_needed) if k.bytes_needed else 1.0,
        }
        if names:  # only for a profile whose engine derives tensors after loading
            entry["derived_buffers"] = len(names)
            entry["derived_bytes"] = derived_bytes
            derived_names.update((n.rsplit(".", 1)[-1], None) for n in names)
        if staging is not None:
            entry["staging"] = {
                "budget_bytes": staging.budget_bytes,
                "read_bytes": staging.read_bytes,
                "scratch_bytes": staging.scratch_bytes,
                "device_bytes": staging.device_bytes,
                "host_bytes": staging.host_bytes,
                "chunk_rows": staging.chunk_rows,
                "prefetch": staging.prefetch,
            }
        if plan.device_memory_bytes is not None:
            entry["headroom_bytes"] = plan.device_memory_bytes - k.peak_bytes
        ranks.append(entry)
    out: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "model": dict(plan.model),
        "parallel": plan.layout.to_json(),
        "engine": plan.engine,
        **({"moe_mode": dict(plan.moe_mode)} if plan.moe_mode else {}),
        "scale_alg": plan.scale_alg,
        "ranks": ranks,
        "min_staging_bytes": {"load": plan.min_staging_load, "reload": plan.min_staging_reload},
        "device_memory_bytes": plan.device_memory_bytes,
        "fits": plan.fits,
    }
    if derived_names:
        out["derived"] = list(derived_names)
    if "staging_budget_bytes" in plan.extra:
        out["staging_budget_bytes"] = plan.extra["staging_budget_bytes"]
    return out
