"""Reload in place, once for every host of a session (docs/contract.md §4 "Reload").

Reload = preflight (the new checkpoint must give every rank exactly the buffers it holds:
names, shapes, dtypes, layouts; otherwise refuse, listing every mismatch, before touching
anything) -> byte ranges planned from the new checkpoint's own headers -> every rank
converts whole units into staging and copies each into its buffer -> every data_ptr
checked against the recorded one -> the new identity (version, fingerprint) recorded.

:func:`reload` is that sequence. A host supplies only how its ranks run (:class:`Ranks`:
Ray actors for ``Session`` and detached sessions, one in-process loader for the engine
extension) and where the :class:`SessionState` lives (``save``: an attribute, the
detached session's keeper actor).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from ...workers.storage.urls import absolute, is_remote
from ..errors import (
    AddressMoved,
    HeadDown,
    HeadStopped,
    ReloadMismatch,
    StagingBudgetError,
)
from ..plan.checkpoint import CheckpointMeta
from ..plan.config import ModelConfig
from ..plan.message import RankJob, SourceInfo
from ..plan.types import Plan, Unit, UnitReads
from .request import (
    source_info,
    staging_budget_of,
    workers_fused,
)
from .state import Progress, ReloadRecord, Report, SessionState

if TYPE_CHECKING:
    from .ray_run import RayRun

log = logging.getLogger(__name__)


# --- planning and preflight ---------------------------------------------------------------


def _unit_key(u: Unit) -> tuple[Any, ...]:
    parts = tuple((p.tensor_name, p.rows, p.cols, p.dst_row) for p in u.parts)
    return (u.buffer, u.kind, u.expert, u.global_expert, u.row0, u.rows, u.cols, parts)


_GEOMETRY = (
    "architecture",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "vocab_size",
    "tie_word_embeddings",
)
"""Keys of a plan's ``model`` whose difference is the root cause of a refused reload."""


def preflight(held: Plan, new: Plan) -> list[str]:
    """Every difference between the buffers the held plan has and those the new
    checkpoint would give each rank (empty = reloadable).

    Buffers must agree in name, shape, dtype and layout. One difference is not a
    mismatch: a linear the new checkpoint stores unquantized (a BF16 checkpoint from an
    RL trainer) where the session holds MX buffers: its units are quantized straight
    into the same buffers, so for those only the unit geometry must agree."""
    problems: list[str] = []
    if held.layout != new.layout:
        return [f"layout {new.layout} != held {held.layout}"]
    for ro, rn in zip(held.ranks, new.ranks, strict=True):
        a = {b.name: b for b in ro.buffers}
        b = {x.name: x for x in rn.buffers}
        relaid = {u.buffer for u in rn.units if not u.quantized and u.layout == "dense"}
        for name in sorted(set(a) - set(b)):
            if name.endswith("_scale") and name[: -len("_scale")] in relaid:
                continue
            problems.append(f"rank {ro.rank}: {name}: held but not in the new checkpoint")
        for name in sorted(set(b) - set(a)):
            problems.append(f"rank {ro.rank}: {name}: in the new checkpoint but not held")
        for name in sorted(set(a) & set(b)):
            x, y = a[name], b[name]
            if name in relaid and x.layout != y.layout:
                continue
            for attr in ("shape", "stride", "dtype", "layout"):
                if getattr(x, attr) != getattr(y, attr):
                    problems.append(
                        f"rank {ro.rank}: {name}: {attr} {getattr(y, attr)} in the new "
                        f"checkpoint, {getattr(x, attr)} held"
                    )
        if ro.experts != rn.experts:
            problems.append(f"rank {ro.rank}: experts {rn.experts} != held {ro.experts}")
        if len(ro.units) != len(rn.units):
            problems.append(f"rank {ro.rank}: {len(rn.units)} units != held {len(ro.units)}")
            continue
        for uo, un in zip(ro.units, rn.units, strict=True):
            if _unit_key(uo) != _unit_key(un):
                where = (
                    f"[{uo.expert}]" if uo.expert >= 0 else f"[rows {uo.row0}:{uo.row0 + uo.rows}]"
                )
                problems.append(f"rank {ro.rank}: unit {uo.buffer}{where} differs")
    return problems


def reload_units(held: Plan, new: Plan, rank: int) -> list[Unit]:
    """The held units with the new checkpoint's quantized flags (how to convert)."""
    return [
        replace(uo, quantized=un.quantized)
        for uo, un in zip(held.ranks[rank].units, new.ranks[rank].units, strict=True)
    ]


def reload_budgets(
    held: Plan,
    new: Plan,
    units: Sequence[Sequence[Unit]],
    config: ModelConfig,
    staging_budget: int | None,
    fused: bool,
) -> list[int]:
    """Staging budget of every rank for a reload: the given one, else the largest whole
    unit of any rank as the reload will convert it (``units``: per rank, its
    :func:`reload_units`)."""
    from ..plan.memory import ConvertOptions, read_fn_from_reads, reload_min_budget

    quant = config.quant.kind
    block_n = config.quant.block_n if quant == "block_fp8" else 1
    opts = ConvertOptions.for_source(held.model["dtype"], quant, config.quant.block_n, fused=fused)
    need = 0
    for rank in range(held.layout.world):
        reads = list(new.ranks[rank].reads or ())
        read_fn = read_fn_from_reads(units[rank], reads, block_n=block_n, source_quant=quant)
        need = max(need, reload_min_budget(units[rank], read_fn, opts))
    if staging_budget is not None and staging_budget < need:
        raise StagingBudgetError(
            f"--staging-budget {staging_budget} bytes is below what this reload needs "
            f"({need} bytes: its largest unit, kept whole)",
            key="--staging-budget",
        )
    return [staging_budget if staging_budget is not None else need] * held.layout.world


def plan_for(held: Plan, meta: Any, src: str, *, fused: bool, remote: bool = False) -> Plan:
    """The plan of the new source ``meta`` (a checkpoint, or a trainer's memory as the
    wire carries it) for the held layout; ReloadMismatch (nothing touched) listing every
    difference from what the ranks hold."""
    from ..plan.planner import build_plan

    problems: list[str] = []
    block_old = held.model.get("weight_block_size")
    q = meta.config.quant
    if (
        q.kind == "block_fp8"
        and block_old is not None
        and [q.block_n, q.block_k] != list(block_old)
    ):
        problems.append(f"weight_block_size {[q.block_n, q.block_k]} != held {block_old}")
    new = build_plan(
        meta.config,
        held.layout,
        checkpoint=meta,
        staging_budget=None,
        device="cpu",
        remote=remote,
        fused=fused,
        engine=held.engine,
    )
    problems += preflight(held, new)
    if problems:
        # The model's own geometry first: one changed hidden_size explains every buffer.
        problems[:0] = [
            f"{key} {new.model.get(key)} in the new checkpoint, {held.model.get(key)} held"
            for key in _GEOMETRY
            if held.model.get(key) != new.model.get(key)
        ]
        shown = problems[:60]
        more = f"\n  ... and {len(problems) - 60} more" if len(problems) > 60 else ""
        raise ReloadMismatch(
            f"reload from {src} refused, nothing was touched; {len(problems)} mismatch(es):\n  "
            + "\n  ".join(shown)
            + more,
            file=src,
        )
    return new


@dataclass(frozen=True)
class ReloadInputs:
    """Everything a rank loader needs to reload from a new checkpoint, for every rank:
    what an inference engine hosting ``RankLoader`` itself calls (docs/adoption.md)."""

    source: SourceInfo
    """The new checkpoint as the loaders read it."""
    reads: tuple[tuple[UnitReads, ...], ...]
    """Per rank: the new checkpoint's byte ranges for each held unit."""
    units: tuple[tuple[Unit, ...], ...]
    """Per rank: the held units with the new source's quantized flags."""
    budgets: tuple[int, ...]
    """Per rank: the staging budget the reload runs under."""
    identity: str = ""
    """How the new checkpoint's fingerprint was established (``CheckpointMeta.identity``)."""

    def job(self, rank: int, version: int) -> RankJob:
        """Rank ``rank``'s reload to ``version``."""
        return RankJob(
            reads=self.reads[rank],
            source=self.source,
            version=version,
            staging_budget=self.budgets[rank],
            whole_units=True,
            units=self.units[rank],
        )


def header_layout(meta: CheckpointMeta) -> tuple[Any, ...]:
    """Everything of a checkpoint a plan depends on: its config and, per shard, its size
    and every tensor's name, dtype, shape and place (not the bytes, not where the
    checkpoint is, not the header's ``__metadata__``, which a trainer may stamp with its
    step). Two checkpoints with one layout get one plan."""
    shards = tuple(
        (
            h.file,
            h.file_size,
            tuple((t.name, t.dtype, t.shape, t.start, t.nbytes) for t in h.tensors.values()),
        )
        for _, h in sorted(meta.headers.items())
    )
    return (meta.config, shards)


class _LastReload:
    """The inputs of the last reload planned in this process, reused while new
    checkpoints keep its header layout (:func:`header_layout`) for the same held plan:
    an RL run reloading every step from storage writes one layout again and again, and
    planning it is the reload's largest fixed cost (a 48-layer, 128-expert model at tp 4:
    3.3 of 5 s). One entry, so a process keeps at most one extra plan's reads, and only
    while the held plan lives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[weakref.ref[Plan], tuple[Any, ...], ReloadInputs] | None = None

    def get(self, held: Plan, key: tuple[Any, ...]) -> ReloadInputs | None:
        with self._lock:
            entry = self._entry
        if entry is None or entry[0]() is not held or entry[1] != key:
            return None
        return entry[2]

    def put(self, held: Plan, key: tuple[Any, ...], inputs: ReloadInputs) -> None:
        with self._lock:
            entry = self._entry
            same = entry is not None and entry[0]() is held
            ref = entry[0] if same and entry is not None else weakref.ref(held)
            self._entry = (ref, key, inputs)
        if not same:
            # held weakly: the entry goes with the session's plan, not with the next
            # reload; one finalizer per held plan, not one per reload
            weakref.finalize(held, self._forget, ref)

    def _forget(self, ref: weakref.ref[Plan]) -> None:
        with self._lock:
            if self._entry is not None and self._entry[0] is ref:
                self._entry = None

    def clear(self) -> None:
        with self._lock:
            self._entry = None


LAST_RELOAD = _LastReload()


def reload_inputs(
    held: Plan,
    src: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    staging_budget: int | None = None,
    fused: bool = True,
    allow_nonfinite: bool = False,
) -> ReloadInputs:
    """Preflight ``src`` against ``held`` (raises ReloadMismatch, touching nothing) and
    plan its reads for every rank; the plan of the last reload is reused where ``src``
    has its header layout (:class:`_LastReload`)."""
    from .catalog import open_checkpoint

    src = absolute(src)
    meta = open_checkpoint(src, storage_options=storage_options, dtype=held.model["dtype"])
    remote = is_remote(src)
    key = (header_layout(meta), remote, staging_budget, fused)
    cached = LAST_RELOAD.get(held, key)
    if cached is not None:
        log.debug("reload from %s: the last reload's plan (same header layout)", src)
        return replace(
            cached,
            source=source_info(meta, allow_nonfinite, src, storage_options),
            identity=meta.identity,
        )
    new = plan_for(held, meta, src, fused=fused, remote=remote)
    inputs = inputs_for(
        held,
        meta,
        new,
        src,
        storage_options=storage_options,
        staging_budget=staging_budget,
        fused=fused,
        allow_nonfinite=allow_nonfinite,
    )
    LAST_RELOAD.put(held, key, inputs)
    return inputs


def inputs_for(
    held: Plan,
    meta: Any,
    new: Plan,
    src: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    staging_budget: int | None = None,
    fused: bool = True,
    allow_nonfinite: bool = False,
) -> ReloadInputs:
    """What every rank runs to bring ``held`` to the new source ``meta`` planned as ``new``
    (:func:`plan_for`)."""
    world = held.layout.world
    units = tuple(tuple(reload_units(held, new, r)) for r in range(world))
    budgets = reload_budgets(held, new, units, meta.config, staging_budget, fused)
    return ReloadInputs(
        source=source_info(meta, allow_nonfinite, src, storage_options),
        reads=tuple(tuple(new.ranks[r].reads or ()) for r in range(world)),
        units=units,
        budgets=tuple(budgets),
        identity=meta.identity,
    )


# --- running ------------------------------------------------------------------------------


class Ranks(Protocol):
    """How a host runs its ranks."""

    @property
    def fused(self) -> bool:
        """Whether the ranks convert with the fused CPU kernel (it sizes the budgets)."""
        ...

    def run_ranks(
        self, inputs: ReloadInputs, version: int, on_progress: Progress | None
    ) -> list[Report]:
        """Every rank the host runs writes ``inputs`` whole unit by whole unit, as
        ``version``; a unit already at (version, the source's fingerprint) is skipped.
        Returns their reports (raises what the first failed rank raised)."""
        ...


@dataclass(frozen=True)
class ReloadResult:
    """What a reload that ended well did."""

    reports: list[Report]
    """The ranks' reports, marked by :meth:`SessionState.observe`."""
    restarted: list[int]
    """Ranks whose process was found restarted by this reload."""
    seconds: float


def reload(
    ranks: Ranks,
    state: SessionState,
    save: Callable[[SessionState], None],
    src: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    staging_budget: int | None = None,
    allow_nonfinite: bool = False,
    on_progress: Progress | None = None,
    fence: int = 0,
) -> ReloadResult:
    """Reload ``state``'s session from ``src`` in place; ``save`` is called with the
    state once the reload ended, failed or not (a failure is recorded for ``status``).

    The caller serialises reloads of one session. Running it again after a failure
    completes the interrupted reload (from ``src``) or rewrites every unit not at the new
    checkpoint (from another). ``storage_options`` default to the session's. ``fence``:
    the fencing token of the caller's lease (ranks write nothing for an older one)."""
    src = absolute(src)  # in the process that names it: workers start elsewhere
    options = storage_options if storage_options is not None else state.storage_options
    inputs = reload_inputs(
        state.plan,
        src,
        storage_options=options,
        staging_budget=staging_budget,
        fused=ranks.fused,
        allow_nonfinite=allow_nonfinite,
    )
    return apply(
        ranks,
        state,
        save,
        inputs,
        src,
        target=state.version + 1,
        storage_options=options,
        on_progress=on_progress,
        fence=fence,
    )


def apply(
    ranks: Ranks,
    state: SessionState,
    save: Callable[[SessionState], None],
    inputs: ReloadInputs,
    src: str,
    *,
    target: int,
    storage_options: Mapping[str, Any] | None = None,
    on_progress: Progress | None = None,
    fence: int = 0,
) -> ReloadResult:
    """Run ``inputs`` on every rank as version ``target`` of ``src`` and record the
    outcome in ``state`` (a failure too, for ``status``), then ``save`` it: the one
    sequence of every reload and refit."""
    options = storage_options
    inputs = replace(inputs, source=replace(inputs.source, fence=fence))
    fingerprint = inputs.source.fingerprint
    t0 = time.perf_counter()
    try:
        reports = ranks.run_ranks(inputs, target, on_progress)
        restarted = state.observe(reports)
        moved = state.moved(reports)
        if moved:
            raise AddressMoved("buffers moved during reload: " + ", ".join(moved[:20]))
    except BaseException as err:
        state.last_reload = ReloadRecord(
            src, target, fingerprint, ok=False, error=f"{type(err).__name__}: {err}"[:400]
        )
        if isinstance(err, HeadDown | HeadStopped):
            raise  # nowhere to record it: the head holds the session's state
        try:
            save(state)
        except Exception as why:  # the reload's own error is the one to raise
            log.info("the failed reload from %s was not recorded: %s", src, why)
        raise
    state.version = target
    state.fingerprint = fingerprint
    state.identity_basis = inputs.identity
    state.src = src
    state.storage_options = options
    state.last_reload = ReloadRecord(src, target, fingerprint, ok=True)
    save(state)
    return ReloadResult(reports, restarted, round(time.perf_counter() - t0, 3))


class RayRanks:
    """:class:`Ranks` of a session whose ranks are Ray actors (``RayRun``)."""

    def __init__(self, run: RayRun) -> None:
        self.ray_run = run

    @property
    def fused(self) -> bool:
        return workers_fused(self.ray_run.req.device)

    def run_ranks(
        self, inputs: ReloadInputs, version: int, on_progress: Progress | None
    ) -> list[Report]:
        jobs = [inputs.job(rank, version) for rank in range(len(inputs.reads))]
        return self.ray_run.run_all(jobs, on_progress=on_progress)


def repair(
    run: RayRun, state: SessionState, save: Callable[[SessionState], None], fence: int = 0
) -> list[int]:
    """Reload every rank whose worker was restarted (a fresh process, empty buffers) to
    the session's version from its current source; returns those ranks. They run as a
    reload's ranks do (``RayRun.run_all``: restarts handled, a silent rank named) and
    their buffers are checked where they were recorded. ``fence``: as for
    :func:`reload`."""
    pids = run.pids()
    lost = [r for r, pid in enumerate(pids) if state.lost(r, pid)]
    if not lost:
        return []
    inputs = reload_inputs(
        state.plan,
        state.src,
        storage_options=state.storage_options,
        fused=workers_fused(run.req.device),
        allow_nonfinite=run.req.allow_nonfinite,
    )
    source = replace(inputs.source, fence=fence)
    jobs = [
        RankJob(
            reads=inputs.reads[rank],
            source=source,
            version=state.version,
            staging_budget=staging_budget_of(state.plan, rp),
            units=inputs.units[rank],
        )
        for rank, rp in enumerate(state.plan.ranks)
    ]
    reports = run.run_all(jobs, only=lost)
    state.observe(reports)
    moved = state.moved(reports)
    if moved:
        raise AddressMoved("buffers moved during repair: " + ", ".join(moved[:20]))
    save(state)
    return lost
