"""mxload inside an inference engine: a vLLM / vllm-ascend worker extension.

Why: a graph the engine captured (ACL graph on Ascend, CUDA graph) points at the engine's
own parameters. The only reload that keeps it valid writes into those tensors, laid out
as the engine holds them after its post-load. This module lets the engine host mxload:

* :class:`MxloadWorkerExtension` is what vLLM mixes into each of its workers when started
  with ``worker_extension_cls="mxload.workers.engine_ext.MxloadWorkerExtension"``; its
  methods run on every worker through ``LLM.collective_rpc``:

  - ``mxload_attach(src)``: plan the checkpoint for the engine's own parallel layout (read
    from the worker's ``vllm_config.parallel_config`` and vLLM's process groups, never
    from arguments), pick the engine profile (the installed vllm-ascend's, unless named),
    refuse what the engine would not honour (FRACTAL_NZ on, round_robin placement that
    falls back), and adopt the worker's own parameters (``RankLoader(buffers=...)``: shape,
    dtype, device, stride and storage are checked, every difference listed);
  - ``mxload_reload(src)``: preflight, then rewrite the adopted tensors in place from a new
    checkpoint (block-FP8, MXFP8 or the BF16 an RL trainer writes); verifies no address
    moved (the reload of every session host: ``mxload.orchestrator.runtime.reload``);
  - ``mxload_status()``: rank coordinates, engine, version, consistency, per-tensor
    addresses, strides and checksums.

* :class:`EngineReloader` is the driver side for an RL loop: it calls those methods on
  every worker and checks the answers (all ranks at one version, no address moved since
  attach).

The core, :class:`Attachment`, is a plain class with no vLLM import: the extension only
gathers the engine's facts (:class:`EngineFacts`) and its parameters.

Limits: the worker must not rebind its parameters while attached (vllm-ascend's
``restore_weights_for_rl_loading`` and its own weight-update path re-view ``.data``;
use one reload path, not both). Every worker plans the whole layout (pure, seconds for
the largest models) and reads only its own bytes. Imports of vLLM, vllm-ascend and
torch_npu are lazy: this module imports without them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from mxload.orchestrator.errors import AddressMoved, AdoptionError, RunError
from mxload.orchestrator.plan.engines import EngineProfile, engine_profile
from mxload.orchestrator.plan.types import ParallelLayout, Plan
from mxload.orchestrator.runtime.reload import ReloadInputs, reload
from mxload.orchestrator.runtime.state import Progress, Report, SessionState
from mxload.workers.rank.loader import RankLoader, RunStats

ExpertPlacement = Literal["linear", "round_robin"]


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's own configuration says about this worker."""

    layout: ParallelLayout
    tp_rank: int
    pp_rank: int
    dp_rank: int
    engine: str
    """Engine profile name (``mxload.orchestrator.plan.engines.ENGINES``)."""
    env: Mapping[str, str]
    """The engine settings a profile may refuse (e.g. VLLM_ASCEND_ENABLE_NZ), as strings."""

    @property
    def rank(self) -> int:
        """vLLM's global rank order: dp_rank * (pp * tp) + pp_rank * tp + tp_rank."""
        lay = self.layout
        return self.dp_rank * (lay.pp * lay.tp) + self.pp_rank * lay.tp + self.tp_rank


def check_engine_settings(profile: EngineProfile, env: Mapping[str, str]) -> None:
    """Refuse engine settings the profile cannot honour (AdoptionError with the reason)."""
    bad = [f"{var}={env.get(var)!r}: {why}" for var, why in profile.refuse_env.items()
           if env.get(var, "1") != "0"]  # fmt: skip
    if bad:
        raise AdoptionError(
            f"--engine {profile.name}: cannot write into this engine's parameters: "
            + "; ".join(bad),
            key="--engine",
        )


class _OneRank:
    """How an :class:`Attachment` runs its ranks: the one rank this worker hosts, with
    its own loader, in this process (:class:`mxload.orchestrator.runtime.reload.Ranks`)."""

    def __init__(self, rank: int, loader: RankLoader) -> None:
        self.rank = rank
        self.loader = loader
        self.last_stats: RunStats | None = None

    @property
    def fused(self) -> bool:
        return bool(getattr(self.loader.backend, "fused", False))

    def run_ranks(
        self, inputs: ReloadInputs, version: int, on_progress: Progress | None
    ) -> list[Report]:
        r = self.rank
        self.last_stats = self.loader.reload(
            list(inputs.reads[r]),
            inputs.source,
            version=version,
            staging_budget=inputs.budgets[r],
            units=list(inputs.units[r]),
        )
        self.loader.backend.synchronize()
        tensors = {n: {"data_ptr": t.data_ptr()} for n, t in self.loader.buffers.items()}
        return [{"rank": r, "pid": os.getpid(), "tensors": tensors}]


class Attachment:
    """One worker's plan, its adopted parameters and the loader that writes them."""

    def __init__(
        self,
        src: str,
        facts: EngineFacts,
        params: Mapping[str, torch.Tensor],
        *,
        storage_options: Mapping[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        from mxload.orchestrator.plan.planner import build_plan
        from mxload.orchestrator.runtime.catalog import open_checkpoint

        self.profile = engine_profile(facts.engine)
        check_engine_settings(self.profile, facts.env)
        self.facts = facts
        meta = open_checkpoint(src, storage_options=storage_options)
        plan: Plan = build_plan(meta.config, facts.layout, checkpoint=meta, engine=self.profile)
        rp = plan.ranks[facts.rank]
        missing = [b.name for b in rp.buffers if b.name not in params]
        if missing:
            raise AdoptionError(
                f"rank {facts.rank} ({self.profile.name}): the engine has no parameter "
                f"{', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
                rank=facts.rank,
                tensor=missing[0],
            )
        mine = {b.name: params[b.name] for b in rp.buffers}
        if device is None:
            device = next(iter(mine.values())).device.type if mine else "cpu"
        self.loader = RankLoader(
            rp, model_dtype=meta.config.model_dtype, device=device, buffers=mine
        )
        self._ranks = _OneRank(facts.rank, self.loader)
        # Version 0 of the attached checkpoint: the parameters hold what the engine
        # loaded (or nothing yet); the first reload (or ``load``) writes version 1.
        self.state = SessionState(
            plan=plan,
            src=src,
            fingerprint="",
            addresses={facts.rank: dict(self.loader.addresses)},
            pids={facts.rank: os.getpid()},
            version=0,
            storage_options=storage_options,
        )

    @property
    def plan(self) -> Plan:
        return self.state.plan

    @property
    def src(self) -> str:
        return self.state.src

    def load(self, src: str | None = None, **kw: Any) -> dict[str, Any]:
        """Fill the adopted parameters from ``src`` (default: the attached checkpoint)."""
        return self.reload(src or self.src, **kw)

    def reload(
        self,
        src: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        staging_budget: int | None = None,
        allow_nonfinite: bool = False,
    ) -> dict[str, Any]:
        """Preflight ``src`` against the plan (ReloadMismatch, nothing touched) and rewrite
        every adopted tensor in place; raises AddressMoved if any address changed."""
        reload(
            self._ranks,
            self.state,
            lambda _: None,  # the state is this object's attribute
            src,
            storage_options=storage_options,
            staging_budget=staging_budget,
            allow_nonfinite=allow_nonfinite,
        )
        stats = self._ranks.last_stats
        assert stats is not None
        return {
            "rank": self.facts.rank,
            "src": src,
            "version": self.loader.version,
            "consistent": self.loader.consistent,
            "seconds": stats.seconds,
            "bytes_read": stats.bytes_read,
            "bytes_needed": stats.bytes_needed,
            "measured_peak_staging_bytes": stats.measured_peak_staging_bytes,
            "predicted_peak_staging_bytes": stats.predicted_peak_staging_bytes,
            "addresses_moved": [],
        }

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        f = self.facts
        return {
            "rank": f.rank,
            "tp_rank": f.tp_rank,
            "pp_rank": f.pp_rank,
            "dp_rank": f.dp_rank,
            "parallel": f.layout.to_json(),
            "engine": self.profile.name,
            "src": self.src,
            "version": self.loader.version,
            "consistent": self.loader.consistent,
            "units": self.loader.unit_status(),
            "tensors": self.loader.tensor_report(with_checksums=checksums),
        }


# --- the vLLM side ------------------------------------------------------------------------------


def installed_engine() -> str:
    """The profile of the installed engine: vllm-ascend's release, else mxload's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("vllm-ascend")
    except PackageNotFoundError:
        try:
            v = version("vllm_ascend")
        except PackageNotFoundError:
            return "mxload"
    return "vllm-ascend-0.23" if v.startswith("0.23.") else "vllm-ascend-main"


def _engine_env() -> dict[str, str]:
    """The settings engine profiles may refuse, as the engine resolved them."""
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_ASCEND_")}
    try:  # vllm-ascend resolves NZ from additional_config / rl_config / the environment
        from vllm_ascend.ascend_config import (  # type: ignore[import-not-found]
            get_ascend_config,
        )

        env["VLLM_ASCEND_ENABLE_NZ"] = str(int(get_ascend_config().weight_nz_mode))
    except Exception:  # not vllm-ascend, or its config is not initialised: the env decides
        pass
    return env


def vllm_facts(worker: Any, engine: str | None = None) -> EngineFacts:
    """Layout and ranks from the worker's own vLLM configuration and process groups."""
    from vllm.distributed import (  # type: ignore[import-not-found]
        get_pp_group,
        get_tensor_model_parallel_rank,
    )

    pc = worker.vllm_config.parallel_config
    # Any other name vLLM may grow is refused by the planner (LayoutError), naming it.
    placement = cast(
        ExpertPlacement, str(getattr(pc, "expert_placement_strategy", "linear") or "linear")
    )
    layout = ParallelLayout(
        tp=int(pc.tensor_parallel_size),
        dp=int(pc.data_parallel_size),
        pp=int(pc.pipeline_parallel_size),
        enable_expert_parallel=bool(pc.enable_expert_parallel),
        expert_placement=placement,
    )
    return EngineFacts(
        layout=layout,
        tp_rank=int(get_tensor_model_parallel_rank()),
        pp_rank=int(get_pp_group().rank_in_group),
        dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
        engine=engine or installed_engine(),
        env=_engine_env(),
    )


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name, as the tensors its kernels read."""
    out = {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in model.named_buffers()})
    return out


class MxloadWorkerExtension:
    """Methods vLLM adds to each worker (``self`` is the worker).

    ``LLM(..., worker_extension_cls="mxload.workers.engine_ext.MxloadWorkerExtension")``,
    then ``llm.collective_rpc("mxload_attach", args=(src,))`` etc., or
    :class:`EngineReloader`."""

    _mxload: Attachment | None = None

    def mxload_attach(
        self,
        src: str,
        engine: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        load: bool = False,
    ) -> dict[str, Any]:
        facts = vllm_facts(self, engine)
        model = self.model_runner.model  # type: ignore[attr-defined]
        self._mxload = Attachment(src, facts, model_tensors(model), storage_options=storage_options)
        if load:  # an engine started with load_format="dummy" gets its weights from mxload
            self._mxload.load(storage_options=storage_options)
        return self._mxload.status(checksums=False)

    def mxload_reload(
        self,
        src: str,
        storage_options: Mapping[str, Any] | None = None,
        staging_budget: int | None = None,
    ) -> dict[str, Any]:
        return self._attached().reload(
            src, storage_options=storage_options, staging_budget=staging_budget
        )

    def mxload_status(self, checksums: bool = True) -> dict[str, Any]:
        return self._attached().status(checksums=checksums)

    def _attached(self) -> Attachment:
        if self._mxload is None:
            raise RunError("mxload is not attached to this worker: call mxload_attach first")
        return self._mxload


class EngineReloader:
    """Driver side of an RL loop over an engine hosting :class:`MxloadWorkerExtension`.

    ``rpc`` is ``llm.collective_rpc`` (or any callable with its signature)."""

    def __init__(self, rpc: Callable[..., list[Any]]) -> None:
        self._rpc = rpc
        self.addresses: dict[int, dict[str, int]] = {}

    def attach(self, src: str, **kwargs: Any) -> list[dict[str, Any]]:
        status = self._rpc("mxload_attach", args=(src,), kwargs=kwargs)
        self.addresses = {
            s["rank"]: {n: t["data_ptr"] for n, t in s["tensors"].items()} for s in status
        }
        return status

    def reload(self, src: str, **kwargs: Any) -> list[dict[str, Any]]:
        """Reload every worker; RunError unless all ranks end at one consistent version."""
        reports = self._rpc("mxload_reload", args=(src,), kwargs=kwargs)
        versions = {r["version"] for r in reports}
        if len(versions) != 1 or not all(r["consistent"] for r in reports):
            raise RunError(
                f"reload from {src}: ranks disagree: versions {sorted(versions)}, "
                f"inconsistent ranks {[r['rank'] for r in reports if not r['consistent']]}; "
                "run the reload again to complete it"
            )
        return reports

    def status(self, checksums: bool = True) -> list[dict[str, Any]]:
        """Every worker's status; AddressMoved if any tensor moved since attach."""
        status = self._rpc("mxload_status", kwargs={"checksums": checksums})
        moved = [
            f"rank {s['rank']}: {n}"
            for s in status
            for n, t in s["tensors"].items()
            if self.addresses.get(s["rank"], {}).get(n, t["data_ptr"]) != t["data_ptr"]
        ]
        if moved:
            raise AddressMoved("parameters moved since attach: " + ", ".join(moved[:20]))
        return status
