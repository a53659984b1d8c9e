"""Sessions: a loaded model that stays resident and is reloaded in place (SPEC §4).

:class:`Session` is the Python API an RL trainer uses in-process::

    from mxload.orchestrator.runtime.session import Session
    from mxload.orchestrator.plan.types import ParallelLayout

    s = Session.load("s3://bucket/step-0", ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
                     storage_options={"endpoint_url": "http://127.0.0.1:9000"})
    for step in range(1, 100):
        ...train, write s3://bucket/step-{step}...
        s.reload(f"s3://bucket/step-{step}")   # every buffer rewritten in place
    s.release()

``--detach`` on the command line keeps the same actors alive as named, detached Ray
actors; ``mxload reload/status/release`` then reach them from other processes through
``mxload.orchestrator.runtime.detached``.

Reload = preflight (the new checkpoint must give every rank exactly the buffers it holds:
names, shapes, dtypes, layouts; otherwise refuse, listing every mismatch, before touching
anything) -> byte ranges planned from the new checkpoint's own headers -> every rank
converts whole units into staging and copies each into its buffer -> every data_ptr
checked against the first load's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mxload.orchestrator.errors import AddressMoved, ReloadMismatch, SessionBusy
from mxload.orchestrator.plan.types import ParallelLayout, Plan
from mxload.orchestrator.runtime.driver import (
    LoadRequest,
    RayRun,
    build_manifest,
    source_info,
    workers_fused,
)
from mxload.orchestrator.runtime.driver import (
    load as driver_load,
)


def _unit_key(u: Any) -> tuple[Any, ...]:
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
        else:
            for uo, un in zip(ro.units, rn.units, strict=True):
                if _unit_key(uo) != _unit_key(un):
                    where = (
                        f"[{uo.expert}]"
                        if uo.expert >= 0
                        else f"[rows {uo.row0}:{uo.row0 + uo.rows}]"
                    )
                    problems.append(f"rank {ro.rank}: unit {uo.buffer}{where} differs")
    return problems


def reload_units(held: Plan, new: Plan, rank: int) -> list[Any]:
    """The held units with the new checkpoint's quantized flags (how to convert)."""
    return [
        replace(uo, quantized=un.quantized)
        for uo, un in zip(held.ranks[rank].units, new.ranks[rank].units, strict=True)
    ]


def reload_budgets(
    held: Plan, new: Plan, config: Any, staging_budget: int | None, fused: bool
) -> list[int]:
    """Staging budget of every rank for a reload: the given one, else the largest whole
    unit of any rank as the reload will convert it (held layouts, new source)."""
    from mxload.orchestrator.errors import StagingBudgetError
    from mxload.orchestrator.plan.memory import ConvertOptions, min_budgets, read_fn_from_reads

    quant = config.quant.kind
    block_n = config.quant.block_n if quant == "block_fp8" else 1
    opts = ConvertOptions(
        model_dtype=held.model["dtype"], source_quant=quant, fused=fused, block_n=block_n
    )
    need = 0
    for rank in range(held.layout.world):
        units = reload_units(held, new, rank)
        reads = list(new.ranks[rank].reads or ())
        read_fn = read_fn_from_reads(units, reads, block_n=block_n, source_quant=quant)
        need = max(need, min_budgets(units, read_fn, opts)[1])
    if staging_budget is not None and staging_budget < need:
        raise StagingBudgetError(
            f"--staging-budget {staging_budget} bytes is below what this reload needs "
            f"({need} bytes: its largest unit, kept whole)",
            key="--staging-budget",
        )
    return [staging_budget if staging_budget is not None else need] * held.layout.world


def plan_reload(held: Plan, req: LoadRequest) -> tuple[Any, Plan]:
    """Plan a reload from ``req.src`` against the held plan; refuse on any mismatch."""
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.runtime.catalog import open_checkpoint

    meta = open_checkpoint(req.src, storage_options=req.storage_options, dtype=held.model["dtype"])
    problems: list[str] = []
    block_old = held.model.get("weight_block_size")
    if meta.config.quant.kind == "block_fp8" and block_old is not None:
        if [meta.config.quant.block_n, meta.config.quant.block_k] != list(block_old):
            problems.append(
                f"weight_block_size {[meta.config.quant.block_n, meta.config.quant.block_k]} "
                f"!= held {block_old}"
            )
    new = build_plan(
        meta.config,
        held.layout,
        checkpoint=meta,
        staging_budget=None,
        device="cpu",
        remote="://" in req.src and not req.src.startswith("file://"),
        fused=workers_fused(req.device),
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
            f"reload from {req.src} refused, nothing was touched; {len(problems)} mismatch(es):\n  "
            + "\n  ".join(shown)
            + more,
            file=req.src,
        )
    return meta, new


class Session:
    """A loaded model held by live workers, reloadable in place."""

    def __init__(self, req: LoadRequest, plan: Plan, run: RayRun, manifest: dict[str, Any]) -> None:
        self.req = req
        self.plan = plan
        self.run = run
        self.manifest = manifest
        self.version = 1
        self.addresses = {
            r["rank"]: {n: t["data_ptr"] for n, t in r["tensors"].items()}
            for r in manifest["ranks"]
        }
        self.pids = {r["rank"]: r["pid"] for r in manifest["ranks"]}
        self._reloading = threading.Lock()
        first = manifest["ranks"][0].get("identity") or [1, ""]
        self.src = req.src
        self.fingerprint: str = first[1]
        """Fingerprint of the checkpoint the session's version came from (SPEC §4)."""
        self.last_reload: dict[str, Any] | None = None
        self.restarted: set[int] = set()

    @classmethod
    def load(
        cls,
        src: str,
        layout: ParallelLayout,
        *,
        storage_options: Mapping[str, Any] | None = None,
        on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
        **kwargs: Any,
    ) -> Session:
        req = LoadRequest(src=src, layout=layout, storage_options=storage_options, **kwargs)
        manifest, run = driver_load(req, keep=True, on_progress=on_progress)
        assert run is not None
        return cls(req, run.plan, run, manifest)

    def reload(
        self,
        src: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        on_progress: Callable[[list[tuple[int, int, int]]], None] | None = None,
    ) -> dict[str, Any]:
        """Rewrite every rank's buffers in place from ``src``; returns the manifest.
        Running it again after a failure completes the interrupted reload (from ``src``)
        or rewrites every unit not at the new checkpoint (from another). One reload at a
        time: a second, from another thread, is refused (SessionBusy)."""
        if not self._reloading.acquire(blocking=False):
            raise SessionBusy("this session is already reloading; nothing was started")
        try:
            return self._reload(src, storage_options, on_progress)
        finally:
            self._reloading.release()

    def _reload(
        self,
        src: str,
        storage_options: Mapping[str, Any] | None,
        on_progress: Callable[[list[tuple[int, int, int]]], None] | None,
    ) -> dict[str, Any]:
        req = replace(
            self.req, src=src, storage_options=storage_options or self.req.storage_options
        )
        meta, new_plan = plan_reload(self.plan, req)
        budgets = reload_budgets(
            self.plan, new_plan, meta.config, req.staging_budget, workers_fused(req.device)
        )
        source = source_info(meta, req.allow_nonfinite, req.src, req.storage_options)
        target = self.version + 1
        t0 = time.perf_counter()
        self.last_reload = {"src": src, "version": target, "ok": False, "error": "running"}
        try:
            reports = self.run.run_all(
                lambda r: (
                    list(new_plan.ranks[r].reads or ()),
                    reload_units(self.plan, new_plan, r),
                ),
                source,
                version=target,
                whole_units=True,
                on_progress=on_progress,
                budgets=budgets,
            )
        except BaseException as err:  # status says so (Session.status -> "notices")
            self.last_reload["error"] = f"{type(err).__name__}: {err}"[:400]
            raise
        for rep in reports:
            # A worker process that died and was restarted (before or during this
            # reload) holds new buffers: its addresses changed, and it says so.
            if rep["pid"] != self.pids[rep["rank"]]:
                rep["restarts"] = max(rep.get("restarts", 0), 1)
                rep["addresses_changed"] = True
        manifest = build_manifest(self.plan, reports)
        manifest["seconds"] = round(time.perf_counter() - t0, 3)
        moved = []
        for r in manifest["ranks"]:
            if r.get("addresses_changed"):
                continue  # a restarted process: reported as such, graph must be recaptured
            for name, t in r["tensors"].items():
                if self.addresses[r["rank"]].get(name) != t["data_ptr"]:
                    moved.append(f"rank {r['rank']}: {name}")
        manifest["addresses_moved"] = moved
        if moved:
            raise AddressMoved("buffers moved during reload: " + ", ".join(moved[:20]))
        for r in manifest["ranks"]:
            if r.get("addresses_changed"):
                self.addresses[r["rank"]] = {n: t["data_ptr"] for n, t in r["tensors"].items()}
        self.restarted |= {r["rank"] for r in manifest["ranks"] if r.get("addresses_changed")}
        self.pids = {rep["rank"]: rep["pid"] for rep in reports}
        self.version = target
        self.fingerprint = meta.fingerprint
        self.src = src
        self.last_reload = {"src": src, "version": target, "ok": True, "error": ""}
        self.manifest = manifest
        return manifest

    def status(self) -> dict[str, Any]:
        """What every rank holds, with the same verdict as ``mxload status``:
        ``consistent`` only when every unit of every rank holds this session's version of
        one checkpoint and replicated buffers agree; ``problems`` and ``notices`` say why
        not and what else happened (a failed reload, a restarted rank)."""
        import ray
        from mxload.orchestrator.runtime.detached import verdict

        reports = ray.get([a.report.remote() for a in self.run.actors])
        for rep in reports:
            rep["addresses_changed"] = (
                rep["rank"] in self.restarted or rep["pid"] != self.pids[rep["rank"]]
            )
        manifest = build_manifest(self.plan, reports)
        state = {
            "plan": self.plan,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "src": self.src,
            "addresses": self.addresses,
            "last_reload": self.last_reload,
        }
        verdict(state, manifest, busy=None)
        manifest["last_reload"] = self.last_reload
        return manifest

    def release(self) -> None:
        self.run.shutdown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class ReloadInputs:
    """Everything a rank loader needs to reload from a new checkpoint, for every rank:
    what an inference engine hosting ``RankLoader`` itself calls (docs/adoption.md)."""

    source: Any
    """mxload.workers.rank.loader.SourceInfo of the new checkpoint."""
    reads: tuple[tuple[Any, ...], ...]
    """Per rank: the new checkpoint's byte ranges for each held unit."""
    units: tuple[tuple[Any, ...], ...]
    """Per rank: the held units with the new source's quantized flags."""
    budgets: tuple[int, ...]
    """Per rank: the staging budget the reload runs under."""


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
    plan its reads for every rank."""
    req = LoadRequest(src=src, layout=held.layout, storage_options=storage_options)
    meta, new = plan_reload(held, req)
    budgets = reload_budgets(held, new, meta.config, staging_budget, fused)
    return ReloadInputs(
        source=source_info(meta, allow_nonfinite, src, storage_options),
        reads=tuple(tuple(new.ranks[r].reads or ()) for r in range(held.layout.world)),
        units=tuple(tuple(reload_units(held, new, r)) for r in range(held.layout.world)),
        budgets=tuple(budgets),
    )
