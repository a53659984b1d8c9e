"""mxload inside an inference engine: a vLLM / vllm-ascend worker extension.

Why: a graph the engine captured (ACL graph on Ascend, CUDA graph) points at the engine's
own parameters. The only reload that keeps it valid writes into those tensors, laid out
as the engine holds them after its post-load. This module lets the engine host mxload:

* :class:`MxloadWorkerExtension` is what vLLM mixes into each of its workers when started
  with ``worker_extension_cls="mxload.orchestrator.hosts.engine_ext.MxloadWorkerExtension"``; its
  methods run on every worker through ``LLM.collective_rpc``:

  - ``mxload_attach(src)``: plan the checkpoint for the engine's own parallel layout (read
    from the worker's ``vllm_config.parallel_config`` and vLLM's process groups, never
    from arguments), pick the engine profile (the installed vllm-ascend's, unless named),
    refuse what the engine would not honour (FRACTAL_NZ on, round_robin placement that
    falls back), and adopt the worker's own parameters (``RankLoader(buffers=...)``: shape,
    dtype, device, stride and storage are checked, every difference listed), with an MTP
    drafter's (``speculative_config`` method ``mtp``: ``model_runner.drafter.model``,
    named ``drafter.*`` in the plan);
  - ``mxload_reload(src)``: preflight, then rewrite the adopted tensors in place from a new
    checkpoint (block-FP8, MXFP8 or the BF16 an RL trainer writes); verifies no address
    moved (the reload of every session host: ``mxload.orchestrator.runtime.reload``);
  - ``mxload_status()``: rank coordinates, engine, version, consistency, per-tensor
    addresses, strides and checksums;
  - ``mxload_attach(src, trainer={...})`` then ``mxload_refit(step, manifest_hash)``: the
    same writes from a trainer's ranks instead of a checkpoint
    (``mxload.orchestrator.runtime.refit``).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch

from ...workers.rank.loader import RankLoader, RunStats
from ..errors import AddressMoved, AdoptionError, RunError
from ..plan.arch import DRAFTER_PREFIX
from ..plan.engines import check_mx_k, engine_profile
from ..plan.releases import (
    ACL_FORMAT_FRACTAL_NZ,
    VLLM_ARCHITECTURES,
    check_architecture,
    check_settings,
    engine_release,
    release_of_version,
)
from ..plan.types import ParallelLayout, Plan
from ..runtime.refit import RefitRank, RefitSetup, TrainerSource, refit, refit_setup
from ..runtime.reload import ReloadInputs, reload
from ..runtime.state import Progress, Report, SessionState

ExpertPlacement = Literal["linear", "round_robin"]


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's own configuration says about this worker."""

    layout: ParallelLayout
    tp_rank: int
    pp_rank: int
    dp_rank: int
    engine: str
    """Engine release or profile name (``--engine``)."""
    settings: Mapping[str, str]
    """The engine settings a release may refuse (``weight_nz_mode``, ``enable_eplb``, ...;
    :class:`mxload.orchestrator.plan.releases.Refusal`), as the engine resolved them."""

    @property
    def rank(self) -> int:
        """vLLM's global rank order: dp_rank * (pp * tp) + pp_rank * tp + tp_rank."""
        lay = self.layout
        return self.dp_rank * (lay.pp * lay.tp) + self.pp_rank * lay.tp + self.tp_rank


def check_engine_settings(engine: str, settings: Mapping[str, str]) -> None:
    """Refuse engine settings the release cannot be reloaded under (AdoptionError, one
    line: the setting, why, and what to change)."""
    release = engine_release(engine)
    bad = check_settings(release, settings)
    if bad:
        raise AdoptionError(
            f"--engine {engine}: cannot write into this engine's parameters: " + " | ".join(bad),
            key=bad[0].split("=", 1)[0],
        )


@dataclass(frozen=True)
class Held:
    """Where the engine keeps one adopted tensor, and what it was at attach."""

    module: Any
    """The module holding it (``getattr(module, attr)`` is the live object)."""
    attr: str
    data_ptr: int
    storage_ptr: int
    stride: tuple[int, ...]
    storage_offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    npu_format: int | None

    @staticmethod
    def of(module: Any, attr: str, t: torch.Tensor) -> Held:
        return Held(
            module,
            attr,
            t.data_ptr(),
            t.untyped_storage().data_ptr(),
            tuple(t.stride()),
            int(t.storage_offset()),
            tuple(t.shape),
            t.dtype,
            _npu_format(t),
        )

    def live(self) -> torch.Tensor | None:
        obj = getattr(self.module, self.attr, None)
        return obj.data if isinstance(obj, torch.Tensor) else None

    def drift(self) -> str:
        """What changed since attach ('' = nothing)."""
        t = self.live()
        if t is None:
            return "no longer a tensor on its module"
        now = Held.of(self.module, self.attr, t)
        diffs = [
            f"{what} {getattr(self, what)} -> {getattr(now, what)}"
            for what in (
                "data_ptr",
                "storage_ptr",
                "stride",
                "storage_offset",
                "shape",
                "dtype",
                "npu_format",
            )
            if getattr(self, what) != getattr(now, what)
        ]
        return ", ".join(diffs)


def _npu_format(t: torch.Tensor) -> int | None:
    """The storage format (ND, FRACTAL_NZ, ...) of an NPU tensor; None elsewhere."""
    if t.device.type != "npu":
        return None
    import torch_npu  # type: ignore[import-not-found]

    return int(torch_npu.get_npu_format(t))


def expert_maps(model: torch.nn.Module) -> dict[str, Any]:
    """Every MoE module's expert-map holder by module name: vLLM's ``ExpertMapManager``
    (``expert_map``: global expert id -> local slot, -1 elsewhere; None without EP)."""
    out = {}
    for name, mod in model.named_modules():
        manager = getattr(mod, "expert_map_manager", None)
        if manager is not None and hasattr(manager, "expert_map"):
            out[name] = manager
    return out


def _local_experts(expert_map: Any) -> tuple[int, ...] | None:
    """Global expert ids in local slot order, from an expert map (None: no map)."""
    if expert_map is None:
        return None
    slots = [int(x) for x in expert_map.tolist()]
    held = sorted((slot, g) for g, slot in enumerate(slots) if slot >= 0)
    return tuple(g for _, g in held)


def engine_params(model: torch.nn.Module) -> dict[str, tuple[Any, str]]:
    """Every parameter and buffer of ``model`` by name, as (module, attribute): where the
    engine keeps it, so that a rebinding is seen; and the tensors an attention layer's
    ``impl`` (not a module) holds, named ``LAYER.impl.ATTR``: what an engine derives in
    its post-load (vllm-ascend's MLA ``W_UK_T``/``W_UV``, docs/contract.md §2.4)."""
    out: dict[str, tuple[Any, str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr in (*mod._parameters, *mod._buffers):
            if getattr(mod, attr, None) is not None:
                out.setdefault(prefix + attr, (mod, attr))
        impl = mod.__dict__.get("impl")
        if impl is not None and not isinstance(impl, torch.nn.Module):
            for attr, value in vars(impl).items():
                if isinstance(value, torch.Tensor):
                    out.setdefault(f"{prefix}impl.{attr}", (impl, attr))
    return out


def unplanned_drafter_weights(
    params: Mapping[str, tuple[Any, str]], planned: set[str]
) -> list[str]:
    """The MTP drafter's parameters that the plan does not hold and that are not the
    target model's own tensors (the proposer's sharing, docs/contract.md §3): what an
    in-place reload would never reach."""

    def param(name: str) -> torch.Tensor | None:
        mod, attr = params[name]
        t = getattr(mod, attr, None)
        return t if isinstance(t, torch.nn.Parameter) else None

    target = {
        t.untyped_storage().data_ptr()
        for n in params
        if not n.startswith(DRAFTER_PREFIX) and (t := param(n)) is not None
    }
    return [
        n
        for n in params
        if n.startswith(DRAFTER_PREFIX)
        and n not in planned
        and (t := param(n)) is not None
        and t.untyped_storage().data_ptr() not in target
    ]


class _OneRank:
    """How an :class:`Attachment` runs its ranks: the one rank this worker hosts, with
    its own loader, in this process (:class:`mxload.orchestrator.runtime.reload.Ranks`)."""

    def __init__(
        self,
        rank: int,
        loader: RankLoader,
        held: Mapping[str, Held],
        maps: Mapping[str, Any],
    ) -> None:
        self.rank = rank
        self.loader = loader
        self.held = held
        self.maps = maps
        self.last_stats: RunStats | None = None
        self.refit: RefitRank | None = None
        """This rank's receiver once a trainer source is attached (a refit's bytes)."""

    def check_experts(self) -> None:
        """AdoptionError unless every MoE module's expert map (read now) places exactly
        the planned experts in the planned slots."""
        want = self.loader.plan.experts
        bad = []
        for name, manager in self.maps.items():
            got = _local_experts(manager.expert_map)
            if got is not None and got != tuple(want):
                bad.append(f"{name}: slots hold experts {list(got)[:16]}")
        if bad:
            raise AdoptionError(
                f"rank {self.rank}: the engine's expert placement is not the plan's (experts "
                f"{list(want)[:16]} in slot order): " + "; ".join(bad[:4]) + "; mxload writes "
                "expert weights by the plan's placement, so other experts would land in "
                "these slots",
                rank=self.rank,
            )

    def check(self, when: str) -> None:
        """AddressMoved naming every engine tensor that is no longer mxload's buffer;
        AdoptionError if the engine's expert maps no longer match the plan."""
        self.check_experts()
        moved = [f"{n}: {d}" for n, h in self.held.items() if (d := h.drift())]
        if moved:
            raise AddressMoved(
                f"rank {self.rank}: the engine rebound {len(moved)} parameter(s) {when}; "
                "mxload's buffers are no longer what its kernels read (attach again after "
                "the engine's own reload or cast): " + "; ".join(moved[:8])
            )

    @property
    def fused(self) -> bool:
        return bool(getattr(self.loader.backend, "fused", False))

    def run_ranks(
        self, inputs: ReloadInputs, version: int, on_progress: Progress | None
    ) -> list[Report]:
        r = self.rank
        storage = None
        if self.refit is not None and self.refit.update is not None:
            storage = self.refit.prepare(inputs, version, self.loader)
        self.last_stats = self.loader.run(inputs.job(r, version), storage=storage)
        self.loader.backend.synchronize()
        self.check("while mxload wrote")
        tensors = {
            n: {"data_ptr": t.data_ptr() if (t := h.live()) is not None else 0}
            for n, h in self.held.items()
        }
        return [{"rank": r, "pid": os.getpid(), "tensors": tensors}]


class Attachment:
    """One worker's plan, its adopted parameters and the loader that writes them."""

    def __init__(
        self,
        src: str,
        facts: EngineFacts,
        params: Mapping[str, tuple[Any, str]],
        *,
        storage_options: Mapping[str, Any] | None = None,
        device: str | None = None,
        maps: Mapping[str, Any] | None = None,
    ) -> None:
        """``params``: name -> (module, attribute) of every engine tensor
        (:func:`engine_params`); ``maps``: the MoE modules' expert-map holders
        (:func:`expert_maps`), read at attach and before every reload and status."""
        from ..plan.planner import build_plan
        from ..runtime.catalog import open_checkpoint

        self.profile = engine_profile(facts.engine)
        check_engine_settings(facts.engine, facts.settings)
        self.facts = facts
        meta = open_checkpoint(src, storage_options=storage_options)
        release = engine_release(facts.engine)
        arch = meta.config.architecture
        if release is None and arch in VLLM_ARCHITECTURES:
            raise AdoptionError(
                f"--engine {facts.engine}: {arch} cannot be reloaded in place: "
                + VLLM_ARCHITECTURES[arch],
                key="--engine",
            )
        bad = check_architecture(release, arch, facts.settings) if release else []
        if bad:
            raise AdoptionError(
                f"--engine {facts.engine}: {arch} cannot be reloaded in place: " + " | ".join(bad),
                key=bad[0].split("=", 1)[0],
            )
        plan: Plan = build_plan(meta.config, facts.layout, checkpoint=meta, engine=self.profile)
        rp = plan.ranks[facts.rank]
        check_mx_k(self.profile, rp)
        missing = [b.name for b in rp.buffers if b.name not in params]
        if missing:
            raise AdoptionError(
                f"rank {facts.rank} ({self.profile.name}): the engine has no parameter "
                f"{', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
                rank=facts.rank,
                tensor=missing[0],
            )
        stale = unplanned_drafter_weights(params, {b.name for b in rp.buffers})
        if stale:
            raise AdoptionError(
                f"rank {facts.rank}: the engine's MTP drafter holds its own "
                f"{', '.join(stale[:4])}, which the plan takes from the target model (vLLM "
                "shares them; vllm-ascend shares DeepSeek's shared_head.head only where it "
                "equals lm_head when the engine starts): a reload would leave it stale; "
                "start the engine from a checkpoint whose MTP head equals lm_head",
                rank=facts.rank,
                tensor=stale[0],
            )
        held: dict[str, Held] = {}
        for b in rp.buffers:
            mod, attr = params[b.name]
            t = getattr(mod, attr)
            t = t.data if isinstance(t, torch.Tensor) else t
            held[b.name] = Held.of(mod, attr, t)
        nz = [n for n, h in held.items() if h.npu_format == ACL_FORMAT_FRACTAL_NZ]
        if nz:
            raise AdoptionError(
                f"rank {facts.rank}: {len(nz)} engine parameter(s) are stored FRACTAL_NZ "
                f"({', '.join(nz[:4])}): the engine cast them (weight_nz_mode), so no "
                "in-place write in mxload's layout reaches what its kernels read; start "
                "the engine with additional_config={'weight_nz_mode': 0}",
                rank=facts.rank,
                tensor=nz[0],
            )
        mine = {n: cast(torch.Tensor, h.live()) for n, h in held.items()}
        if device is None:
            device = next(iter(mine.values())).device.type if mine else "cpu"
        self.loader = RankLoader(
            rp, model_dtype=meta.config.model_dtype, device=device, buffers=mine
        )
        self.config = meta.config
        self._ranks = _OneRank(facts.rank, self.loader, held, maps or {})
        self._ranks.check_experts()
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
        """Check the engine still holds the adopted tensors and preflight ``src`` against
        the plan (AddressMoved / ReloadMismatch, nothing touched), rewrite every adopted
        tensor in place; AddressMoved if any engine tensor changed meanwhile."""
        self._ranks.check("since attach; nothing was written")
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
            "identity": self.identity,
            "consistent": self.loader.consistent,
            "seconds": stats.seconds,
            "convert_seconds": round(stats.convert_seconds, 6),
            "bytes_read": stats.bytes_read,
            "bytes_needed": stats.bytes_needed,
            "measured_peak_staging_bytes": stats.measured_peak_staging_bytes,
            "predicted_peak_staging_bytes": stats.predicted_peak_staging_bytes,
            "addresses_moved": [],
        }

    def attach_trainer(self, trainer: Mapping[str, Any] | TrainerSource) -> RefitSetup:
        """Take updates from a trainer's ranks (the trainer form, docs/adoption.md): plan
        the refit (ReloadMismatch, nothing touched, when the trainer's tensors do not give
        this engine what it holds) and join the refit group (waits for the others)."""
        source = TrainerSource.from_json(trainer)
        setup = refit_setup(self.plan, self.config, source, fused=self._ranks.fused)
        # this engine rank keeps the buckets landing on it, not the whole plan
        setup = replace(setup, refit=setup.refit.only(receiver=self.facts.rank))
        if self._ranks.refit is not None:
            self._ranks.refit.close()
            self._ranks.refit = None
        self._ranks.refit = RefitRank(setup, self.facts.rank)
        return setup

    def refit(
        self,
        step: int,
        manifest_hash: str,
        *,
        delta_of: int | None = None,
        staging_budget: int | None = None,
    ) -> dict[str, Any]:
        """Receive trainer step ``step`` and write it in place (docs/contract.md §4
        "Refit"): the same checks as :meth:`reload`; refused, nothing touched, for another
        manifest or a delta of a step this engine does not hold."""
        rr = self._ranks.refit
        if rr is None:
            raise RunError(
                "this engine takes no trainer updates: initialise it with the trainer form "
                "({'src': ..., 'trainer': {...}})"
            )
        self._ranks.check("since attach; nothing was written")
        refit(
            self._ranks,
            self.state,
            lambda _: None,  # the state is this object's attribute
            rr.setup,
            [rr],
            step=step,
            manifest_hash=manifest_hash,
            delta_of=delta_of,
            staging_budget=staging_budget,
        )
        stats = self._ranks.last_stats
        got = rr.last
        assert stats is not None and got is not None
        return {
            "rank": self.facts.rank,
            "step": step,
            "version": self.loader.version,
            "identity": self.identity,
            "consistent": self.loader.consistent,
            "seconds": stats.seconds,
            # its own work: converting (or repacking) and writing, not reading or waiting
            "convert_seconds": round(stats.convert_seconds, 6),
            "receive_seconds": round(got.seconds, 6),
            "bytes_received": got.bytes_received,
            "bytes_received_in_place": got.in_place_bytes,
            # whole buffers from another rank of its node (the node fan-out)
            "bytes_copied": rr.receiver.copied_bytes,
            "tensors_unchanged": sum(not c for c in got.changed.values()),
            "units_written": stats.units,
            "measured_peak_staging_bytes": stats.measured_peak_staging_bytes,
            "predicted_staging_bytes": rr.setup.refit.summary.receiver_staging[self.facts.rank],
            "receive_area_bytes": stats.extra.get("receive_area_bytes", 0),
            # the loader's seconds waiting for the trainer's bytes to land
            "waited_for_bytes_seconds": round(stats.extra.get("waited_for_bytes_seconds", 0.0), 6),
            "addresses_moved": [],
        }

    def close(self) -> None:
        """Leave the refit group (if any)."""
        if self._ranks.refit is not None:
            self._ranks.refit.close()
            self._ranks.refit = None

    @property
    def identity(self) -> str:
        """The checkpoint the parameters hold: version and fingerprint (``weight_version``
        of vLLM's weight-transfer API; after a refit, the trainer step and
        ``trainer-<manifest hash>``)."""
        return f"{self.state.version}:{self.state.fingerprint}"

    @property
    def consistent(self) -> bool:
        """Every unit holds one identity, the one the latest update was writing: a refit
        whose bytes did not all arrive leaves this False until an update completes."""
        units = self.loader.unit_status()
        return bool(units["consistent"]) and not units["stale_count"]

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        """This rank's state; AddressMoved if the engine rebound an adopted tensor."""
        self._ranks.check("since attach")
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
            "identity": self.identity,
            "consistent": self.consistent,
            "units": self.loader.unit_status(),
            "tensors": self.loader.tensor_report(with_checksums=checksums),
        }


# --- the vLLM side ------------------------------------------------------------------------------


def installed_engine() -> str:
    """The release of the installed vllm-ascend (matched by exact version; UsageError
    listing the known ones otherwise), or ``mxload`` without vllm-ascend."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("vllm-ascend")
    except PackageNotFoundError:
        try:
            v = version("vllm_ascend")
        except PackageNotFoundError:
            return "mxload"
    return release_of_version(v).name


def _flag(value: Any) -> str:
    """An engine setting as the release tables spell it (booleans as 0/1, None as '')."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def engine_settings(vllm_config: Any) -> dict[str, str]:
    """The settings releases may refuse, as this engine resolved them: vLLM's parallel
    config, then vllm-ascend's own config (which folds in additional_config, rl_config
    and the environment variables of its release)."""
    out: dict[str, str] = {}
    pc = vllm_config.parallel_config
    out["enable_eplb"] = _flag(getattr(pc, "enable_eplb", False))
    spec = getattr(vllm_config, "speculative_config", None)
    out["speculative_config"] = str(getattr(spec, "method", None) or "draft") if spec else ""
    eplb = getattr(pc, "eplb_config", None)
    if eplb is not None:
        out["num_redundant_experts"] = _flag(getattr(eplb, "num_redundant_experts", 0))
    if "VLLM_ASCEND_ENABLE_NZ" in os.environ:  # what 0.23 falls back to without a config
        out["weight_nz_mode"] = os.environ["VLLM_ASCEND_ENABLE_NZ"]
    try:
        from vllm_ascend.ascend_config import (  # type: ignore[import-not-found]
            get_ascend_config,
        )

        ac = get_ascend_config()
    except Exception:  # not vllm-ascend, or its config is not initialised
        return out
    out["weight_nz_mode"] = _flag(getattr(ac, "weight_nz_mode", 1))
    out["enable_fused_mc2"] = _flag(getattr(ac, "enable_fused_mc2", 0))
    out["enable_mlapo"] = _flag(getattr(ac, "enable_mlapo", False))
    ae = getattr(ac, "eplb_config", None)
    if ae is not None:
        out["eplb_config.dynamic_eplb"] = _flag(getattr(ae, "dynamic_eplb", False))
        out["eplb_config.expert_map_path"] = _flag(getattr(ae, "expert_map_path", None))
        redundant = int(getattr(ae, "num_redundant_experts", 0) or 0)
        if redundant:
            out["num_redundant_experts"] = str(redundant)
    return out


def _language_model_only(vllm_config: Any) -> bool:
    """vLLM skips the vision tower when ``language_model_only`` is set or every modality's
    ``limit_mm_per_prompt`` is 0 (``SupportsMultiModal._mark_tower_model``)."""
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if mm is None:
        return False
    if bool(getattr(mm, "language_model_only", False)):
        return True
    limit = getattr(mm, "get_limit_per_prompt", None)
    return limit is not None and all(limit(m) == 0 for m in ("image", "video"))


def _mm_encoder_tp_mode(vllm_config: Any) -> Literal["weights", "data"]:
    """vLLM's ``--mm-encoder-tp-mode`` as the engine resolved it (``data``: the vision
    tower whole on every TP rank)."""
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    return "data" if getattr(mm, "mm_encoder_tp_mode", "weights") == "data" else "weights"


def _speculative_method(vllm_config: Any) -> Literal["", "mtp"]:
    """``mtp`` when the engine runs the checkpoint's own MTP module as its drafter (vLLM
    renames the per-model MTP methods to ``mtp``); any other method is refused by the
    release's ``speculative_config`` refusal, or by the planner for a model without one."""
    spec = getattr(vllm_config, "speculative_config", None)
    return "mtp" if getattr(spec, "method", None) == "mtp" else ""


def _shared_expert_dp() -> bool:
    """vllm-ascend's own switch that holds the shared experts whole on every TP rank, as
    the engine resolved it (``vllm_ascend.utils.shared_expert_dp_enabled``: 0.23 also
    counts flashcomm1 and SP by pass); False without vllm-ascend."""
    try:
        from vllm_ascend.utils import (  # type: ignore[import-not-found]
            shared_expert_dp_enabled,
        )

        return bool(shared_expert_dp_enabled())
    except Exception:  # not vllm-ascend, or its config is not initialised
        return False


def _engine_scale_alg(vllm_config: Any) -> int | None:
    """The MX scale rule vllm-ascend quantizes this model's activations with
    (``vllm_ascend.quantization.utils.get_dynamic_mx_quant_scale_alg``, 0.27+: 1 for
    MiniMax M3 where the hardware has it); None where there is no such choice (the
    profile's rule then)."""
    try:
        from vllm_ascend.quantization.utils import (  # type: ignore[import-not-found]
            get_dynamic_mx_quant_scale_alg,
        )

        return int(get_dynamic_mx_quant_scale_alg(vllm_config))
    except Exception:  # not vllm-ascend, a release without the rule, or no hardware profile
        return None


def drafter_model(model_runner: Any) -> torch.nn.Module | None:
    """The speculative drafter's model (vLLM's ``model_runner.drafter.model``: on the last
    pipeline stage only), or None."""
    found = getattr(getattr(model_runner, "drafter", None), "model", None)
    return found if isinstance(found, torch.nn.Module) else None


def vllm_facts(vllm_config: Any, engine: str | None = None) -> EngineFacts:
    """Layout and ranks from the worker's own vLLM configuration and process groups."""
    from vllm.distributed import (  # type: ignore[import-not-found]
        get_pp_group,
        get_tensor_model_parallel_rank,
    )

    pc = vllm_config.parallel_config
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
        language_model_only=_language_model_only(vllm_config),
        speculative_method=_speculative_method(vllm_config),
        mm_encoder_tp_mode=_mm_encoder_tp_mode(vllm_config),
        # the backend the engine runs with (vllm-ascend replaces vLLM's default at config)
        all2all_backend=str(getattr(pc, "all2all_backend", "") or ""),
        shared_expert_dp=_shared_expert_dp(),
        scale_alg=_engine_scale_alg(vllm_config),
    )
    return EngineFacts(
        layout=layout,
        tp_rank=int(get_tensor_model_parallel_rank()),
        pp_rank=int(get_pp_group().rank_in_group),
        dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
        engine=engine or installed_engine(),
        settings=engine_settings(vllm_config),
    )


class MxloadWorkerExtension:
    """Methods vLLM adds to each worker (``self`` is the worker).

    ``LLM(..., worker_extension_cls="mxload.orchestrator.hosts.engine_ext.MxloadWorkerExtension")``,
    then ``llm.collective_rpc("mxload_attach", args=(src,))`` etc., or
    :class:`EngineReloader`."""

    _mxload: Attachment | None = None

    def mxload_attach(
        self,
        src: str,
        engine: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        load: bool = False,
        trainer: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        facts = vllm_facts(self.vllm_config, engine)  # type: ignore[attr-defined]
        runner = self.model_runner  # type: ignore[attr-defined]
        params = engine_params(runner.model)
        maps = expert_maps(runner.model)
        drafter = drafter_model(runner)
        if drafter is not None:  # the plan names its parameters DRAFTER_PREFIX + name
            params.update({DRAFTER_PREFIX + n: p for n, p in engine_params(drafter).items()})
            maps.update({DRAFTER_PREFIX + n: m for n, m in expert_maps(drafter).items()})
        self._mxload = Attachment(src, facts, params, storage_options=storage_options, maps=maps)
        if load:  # an engine started with load_format="dummy" gets its weights from mxload
            self._mxload.load(storage_options=storage_options)
        if trainer is not None:  # updates come from the trainer's ranks (refit)
            self._mxload.attach_trainer(trainer)
        return self._mxload.status(checksums=False)

    def mxload_refit(
        self,
        step: int,
        manifest_hash: str,
        delta_of: int | None = None,
        staging_budget: int | None = None,
    ) -> dict[str, Any]:
        return self._attached().refit(
            step, manifest_hash, delta_of=delta_of, staging_budget=staging_budget
        )

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
    """Driver side of an RL loop over engines hosting :class:`MxloadWorkerExtension`.

    ``rpc`` is ``llm.collective_rpc``, or a list of them: one ``LLM`` per DP rank (vLLM
    runs ``LLM(..., data_parallel_size=N)`` only as N instances, one per rank, each
    with its ``data_parallel_rank``). Every call goes to the workers of all of them, and
    their answers are checked as one engine's: every rank once, at one identity."""

    def __init__(self, rpc: Callable[..., list[Any]] | Sequence[Callable[..., list[Any]]]) -> None:
        self._rpcs = [rpc] if callable(rpc) else list(rpc)
        self.addresses: dict[int, dict[str, int]] = {}

    def _call(self, method: str, **kw: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for rpc in self._rpcs:
            out += rpc(method, **kw)
        ranks = [r["rank"] for r in out]
        if sorted(ranks) != list(range(len(ranks))):
            raise RunError(
                f"{method}: the engines' workers report ranks {sorted(ranks)}, not each of "
                f"0..{len(ranks) - 1} once; give one collective_rpc per DP rank's LLM, each "
                "started with its own data_parallel_rank"
            )
        return sorted(out, key=lambda r: int(r["rank"]))

    def attach(self, src: str, **kwargs: Any) -> list[dict[str, Any]]:
        status = self._call("mxload_attach", args=(src,), kwargs=kwargs)
        self.addresses = {
            s["rank"]: {n: t["data_ptr"] for n, t in s["tensors"].items()} for s in status
        }
        return status

    def reload(self, src: str, **kwargs: Any) -> list[dict[str, Any]]:
        """Reload every worker; RunError unless all ranks end at one consistent identity."""
        reports = self._call("mxload_reload", args=(src,), kwargs=kwargs)
        idents = {r["identity"] for r in reports}
        if len(idents) != 1 or not all(r["consistent"] for r in reports):
            raise RunError(
                f"reload from {src}: ranks disagree: identities {sorted(idents)}, "
                f"inconsistent ranks {[r['rank'] for r in reports if not r['consistent']]}; "
                "run the reload again to complete it"
            )
        return reports

    def refit(self, step: int, manifest_hash: str, **kwargs: Any) -> list[dict[str, Any]]:
        """Every worker receives trainer step ``step`` (the trainer's ranks send it with
        ``MxloadSender.send_weights`` meanwhile); RunError unless all ranks end at it."""
        reports = self._call("mxload_refit", args=(step, manifest_hash), kwargs=kwargs)
        idents = {r["identity"] for r in reports}
        if len(idents) != 1 or not all(r["consistent"] for r in reports):
            raise RunError(
                f"refit to step {step}: ranks disagree: identities {sorted(idents)}; send "
                "the next step to complete it"
            )
        return reports

    def update(self, src: str, engines: Sequence[Any] = (), **kwargs: Any) -> str:
        """The RL step on live engines, in the order vLLM documents for weight updates:
        pause generation (engines that have ``pause_generation``), reload in place, reset
        the prefix cache (its KV was computed with the old weights), resume; returns the
        identity every rank now holds, to tag as ``weight_version``. ``engines``: the
        ``LLM`` instances behind the rpcs (a plain ``LLM`` generates only when called, so
        it has nothing to pause)."""
        paused = [e for e in engines if callable(getattr(e, "pause_generation", None))]
        for e in paused:
            e.pause_generation()
        try:
            reports = self.reload(src, **kwargs)
            for e in engines:
                e.reset_prefix_cache()
        finally:
            for e in paused:
                e.resume_generation()
        return str(reports[0]["identity"])

    def status(self, checksums: bool = True) -> list[dict[str, Any]]:
        """Every worker's status; AddressMoved if any tensor moved since attach."""
        status = self._call("mxload_status", kwargs={"checksums": checksums})
        moved = [
            f"rank {s['rank']}: {n}"
            for s in status
            for n, t in s["tensors"].items()
            if self.addresses.get(s["rank"], {}).get(n, t["data_ptr"]) != t["data_ptr"]
        ]
        if moved:
            raise AddressMoved("parameters moved since attach: " + ", ".join(moved[:20]))
        return status


def register_weight_transfer() -> None:
    """Register mxload's backend (``"mxload"``) with vLLM's WeightTransferEngineFactory,
    by module path (imported only when an engine is configured with it); a no-op where
    vLLM has no weight-transfer API or the backend is already registered. vLLM calls it
    in every process as mxload's ``vllm.general_plugins`` entry point."""
    try:
        from vllm.distributed.weight_transfer.factory import (  # type: ignore[import-not-found]
            WeightTransferEngineFactory,
        )
    except ImportError:
        return
    if "mxload" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "mxload", "mxload.orchestrator.hosts.weight_transfer", "MxloadWeightTransferEngine"
        )
