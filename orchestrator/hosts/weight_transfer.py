"""mxload as a backend of vLLM's weight-transfer API (the RL-native update path).

RL stacks update a live vLLM engine through ``LLM.init_weight_transfer_engine`` ->
``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update(weight_version)``;
the worker hands each call to the backend named by ``weight_transfer_config.backend``,
which vLLM builds with ``WeightTransferEngineFactory.create_engine``. mxload's backend,
registered as ``"mxload"``, reads each update from a checkpoint (local path or URL) and
writes it in place into the engine's own parameters (:class:`Attachment`: plan, adopt,
the live-tensor check, reload):

* init info ``{"src": URL, "engine": None, "storage_options": None, "load": False}``:
  plan ``src`` for the engine's layout and adopt its parameters (``load=True`` also fills
  them, for an engine started with ``load_format="dummy"``);
* update info ``{"src": URL, "storage_options": None, "staging_budget": None}``: one
  whole checkpoint per update (several calls between start and finish each reload);
* the trainer form (refit, docs/adoption.md "Refit from the trainer"): init info
  ``{"src": URL, "trainer": {"transport", "addresses", "world", "manifest", "convert_on",
  "bucket_bytes"}}`` plans the refit and joins the refit group; each update
  ``{"step": N, "manifest_hash": H, "delta_of": None}`` receives trainer step N from the
  trainer's ranks (``MxloadSender.send_weights``) and writes it in place;
* :func:`weight_identity`, run on the workers with ``collective_rpc``, gives the identity
  every rank holds (version:fingerprint), to pass as ``finish_weight_update``'s
  ``weight_version``.

It needs no worker extension, so it composes with any other (verl's, one's own); the
worker extension (:class:`mxload.orchestrator.hosts.engine_ext.MxloadWorkerExtension`) is the path
for vLLM releases without this API (before 0.30). The speculative draft model is not
planned here, even an MTP one the worker extension reloads: ``supports_draft_weight_update``
is False, so vLLM refuses draft updates.

This module imports vLLM (it subclasses vLLM's base class); register it from a process
that has vLLM with :func:`mxload.orchestrator.hosts.engine_ext.register_weight_transfer`, which vLLM
runs in every process as a ``vllm.general_plugins`` entry point of mxload.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found]
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..errors import InputError, RunError
from .engine_ext import Attachment, engine_params, expert_maps, vllm_facts

BACKEND = "mxload"


@dataclass
class MxloadInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """What ``init_weight_transfer_engine`` passes: the checkpoint to plan and adopt for."""

    src: str
    engine: str | None = None
    storage_options: dict[str, Any] | None = None
    load: bool = False
    trainer: dict[str, Any] | None = None
    """The trainer form: updates come from the trainer's ranks (``TrainerSource``)."""


@dataclass
class MxloadUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One update: the checkpoint (``src``) or the trainer step (``step``, with the
    manifest's hash and the step a delta is taken against) the parameters hold after it."""

    src: str = ""
    storage_options: dict[str, Any] | None = None
    staging_budget: int | None = None
    step: int | None = None
    manifest_hash: str | None = None
    delta_of: int | None = None


class MxloadWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """vLLM weight-transfer backend writing checkpoints in place through mxload."""

    init_info_cls = MxloadInitInfo
    update_info_cls = MxloadUpdateInfo
    supports_draft_weight_update = False

    attachment: Attachment | None = None

    def init_transfer_engine(self, init_info: MxloadInitInfo) -> None:
        facts = vllm_facts(self.vllm_config, init_info.engine)
        # The API hands this backend the target model only (supports_draft_weight_update
        # is False): an MTP drafter is not planned here.
        facts = replace(facts, layout=replace(facts.layout, speculative_method=""))
        self.attachment = Attachment(
            init_info.src,
            facts,
            engine_params(self.model),
            storage_options=init_info.storage_options,
            maps=expert_maps(self.model),
        )
        if init_info.load:
            self.attachment.load(storage_options=init_info.storage_options)
        if init_info.trainer is not None:
            self.attachment.attach_trainer(init_info.trainer)

    def _attached(self) -> Attachment:
        if self.attachment is None:
            raise RunError(
                "the mxload weight-transfer backend is not initialised: call "
                "init_weight_transfer_engine({'init_info': {'src': ...}}) first"
            )
        return self.attachment

    def start_weight_update(self) -> None:
        # Writes go straight into the adopted parameters: nothing to prepare, but an
        # engine that rebound a parameter is refused before the update, not after.
        self._attached().status(checksums=False)

    def receive_weights(self, update_info: MxloadUpdateInfo) -> None:
        u = update_info
        if (u.step is None) == (not u.src):
            raise InputError(
                "mxload update info: give either 'src' (a checkpoint) or 'step' with "
                "'manifest_hash' (a trainer update), not " + ("both" if u.src else "neither"),
                key="update_info",
            )
        if u.step is not None:
            self._attached().refit(
                u.step,
                u.manifest_hash or "",
                delta_of=u.delta_of,
                staging_budget=u.staging_budget,
            )
            return
        self._attached().reload(
            u.src,
            storage_options=u.storage_options,
            staging_budget=u.staging_budget,
        )

    def finish_weight_update(self) -> None:
        """Every update was written in place and checked by ``receive_weights``."""

    def shutdown(self) -> None:
        if self.attachment is not None:
            self.attachment.close()
        self.attachment = None


def weight_identity(worker: Any) -> str:
    """The identity this worker's parameters hold (``llm.collective_rpc(weight_identity)``)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, MxloadWeightTransferEngine):
        raise RunError("this worker's weight_transfer_config.backend is not 'mxload'")
    return engine._attached().identity
