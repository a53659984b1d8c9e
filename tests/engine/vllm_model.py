"""vLLM's own model classes, imported whole from the ``--no-deps`` wheel and built on CPU:
the engine side of the tests that compare mxload's buffers with vLLM's parameters.

:func:`vllm_models` imports ``vllm.model_executor.models.qwen3_5`` and ``deepseek_v2``
from the unpacked wheel (tests/engine/sources.py) once per process; :meth:`Models.parameters`
builds one rank's model with vLLM's own ``VllmConfig`` (``ModelConfig`` reading the
checkpoint's ``config.json``, ``ParallelConfig`` of the layout), constructs the class the
config names (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``,
``DeepseekV3ForCausalLM``) under ``set_current_vllm_config``, and runs the model's own
``load_weights`` (its ``AutoWeightsLoader``, mapper, ``make_layers``/``PPMissingLayer``,
``FusedMoE``, ``QKVParallelLinear``, ...) on every tensor of the checkpoint. Every parameter's
name, shape, dtype and value is vLLM's; nothing of vLLM is copied into the repository.
With a speculative method (``RankOf.speculative_method``), :meth:`Models.with_drafter`
also builds the drafter: the ``VllmConfig`` carries vLLM's own ``SpeculativeConfig``
(``num_speculative_tokens`` 1, the target's model and parallel configs, as
``EngineArgs.create_speculative_config`` passes them), whose draft model config names
the class (``hf_config_override``: ``Qwen3_5MTP``, ``Qwen3_5MoeMTP`` of
``models/qwen3_5_mtp.py``; ``DeepSeekMTPModel``, vLLM's ``DeepSeekMTP`` of
``models/deepseek_mtp.py``); that class is built under the target's ``VllmConfig`` and
loaded by its own ``load_weights``, as the proposer's ``get_model`` does.

What is not vLLM's, each named:

* the process groups (``Models._groups``): vLLM's ``GroupCoordinator`` objects (``_TP``,
  ``_PP``, ``_DP``, ``_EP``, ``_PCP``, ``_DCP`` of ``vllm.distributed.parallel_state``) are
  made with ``GroupCoordinator.__new__`` and given the rank under test (its properties
  such as ``is_last_rank`` are vLLM's), because ``GroupCoordinator.__init__`` creates
  ``torch.distributed`` process groups; their ``device_group``/``cpu_group`` are
  :class:`_ProcessGroup`, answering ``size()``/``rank()`` only.
* the platform: vLLM finds none here (no installed ``vllm`` distribution to read a version
  from), so ``vllm.platforms._current_platform`` is set, before anything reads it, to
  vLLM's own ``CpuPlatform`` (:class:`_Platform`), except that it names the Triton MLA
  backend for DeepSeek's MLA layers, which ``CpuPlatform.get_attn_backend_cls`` refuses
  (MLA has no CPU kernel). No kernel runs: only parameters are built and loaded.
* ``flash_attn_varlen_func`` of ``v1/attention/backends/mla/prefill/flash_attn.py``: a
  compiled device kernel (vllm_flash_attn's ``.so``), checked for at construction by the
  MLA prefill backend; the stand-in raises if called.
* :data:`ABSENT`: third-party modules imported on the way to the model files, not
  installed, and never run by building or loading parameters (each a placeholder module,
  tests/engine/sources.py's ``Stub``, given only to imports, never to availability probes
  such as ``importlib.util.find_spec``).

Settings, each as vLLM or vllm-ascend would have them: the architectures (and drafters) are
registered with ``ModelRegistry.register_model`` as classes (its lazy entries would
inspect them in a subprocess); ``all2all_backend`` is the rank's
(``RankOf.all2all_backend``: vLLM's own default when empty, :data:`ALL2ALL` where the test
stands for vllm-ascend, which sets it); prefix caching off, as ``CpuPlatform`` would turn it for linear attention; the
cache vLLM keeps of each model's pipeline-missing layers, keyed by ``id(model)``, is
emptied before each build (vLLM runs one model per process; here a freed model's id
comes back).

The installed ones (the ``test`` extra of pyproject.toml) are those whose code runs or
which cannot be placeholders: transformers (the configs subclass ``PretrainedConfig``;
below 5, whose Qwen2-VL processors import torchvision), pillow (transformers' image
utilities), msgspec (vLLM subclasses ``msgspec.Struct``), cachetools (vLLM subclasses
``cachetools.LRUCache[...]``). pydantic comes with the rest of the test extra.

What the context changes is undone after: the environment vLLM's import edits is
restored, and vLLM's modules and the placeholders leave ``sys.modules`` (kept aside, so
the next module's tests reuse the one import). What cannot be undone stays: the operators
vLLM's import registers with torch, and the real third-party modules it imported.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.engine import sources

PIN = "0.23.0"

ABSENT = {
    "torchvision": "transformers' Qwen2-VL image/video processors (preprocessing; its "
    "wheel is a CUDA build)",
    "openai": "entrypoints' MCP tool server",
    "openai_harmony": "entrypoints' MCP tool server",
    "pybase64": "multimodal audio media",
    "compressed_tensors": "the compressed-tensors quantization method (none here)",
    "uvloop": "v1 utils' asyncio loop",
    "cpuinfo": "usage statistics",
    "prometheus_client": "v1 metrics",
    "zmq": "network utilities of the distributed and engine layers",
    "cbor2": "request hashing",
    "gguf": "GGUF checkpoints (none here)",
    "einops": "the GDN layer's forward",
    "cloudpickle": "the model registry's inspection subprocess (the classes are "
    "registered directly here)",
}
"""Modules vLLM imports that are not installed, with what vLLM uses them for."""

ALL2ALL = "flashinfer_all2allv"
"""The all2all backend vllm-ascend 0.23 gives vLLM (without its sequence parallelism)."""

_ARCHS = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "DeepseekV3ForCausalLM": "deepseek_v2",
    # the MTP drafters SpeculativeConfig names for method "mtp" (hf_config_override)
    "Qwen3_5MTP": "qwen3_5_mtp",
    "Qwen3_5MoeMTP": "qwen3_5_mtp",
    "DeepSeekMTPModel": "deepseek_mtp",
}
_CLASS_OF = {"DeepSeekMTPModel": "DeepSeekMTP"}
"""Registry names whose class is named otherwise (vLLM's registry.py: DeepSeekMTPModel ->
deepseek_mtp.DeepSeekMTP, the draft config hf_config_override names for DeepSeek-V3)."""


class _AbsentFinder(importlib.abc.MetaPathFinder):
    """A placeholder module for the names in :data:`ABSENT` when imported; ``None`` (not
    installed) when probed with ``importlib.util.find_spec`` (transformers asks whether
    torchvision is there, and must hear no)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] not in ABSENT:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "find_spec" and code.co_filename.endswith(
                os.path.join("importlib", "util.py")
            ):
                return None
            frame = frame.f_back
        return importlib.machinery.ModuleSpec(name, _AbsentLoader(), is_package=True)


class _AbsentLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return sources.Stub(spec.name, Path("/nonexistent"))

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _ProcessGroup:
    """Stand-in for a ``torch.distributed`` process group: its size and this rank."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.this = world, rank

    def size(self) -> int:
        return self.world

    def rank(self) -> int:
        return self.this


def _device_kernel(*_: Any, **__: Any) -> Any:
    raise AssertionError("a device kernel was called while building parameters")


_PARKED: dict[str, types.ModuleType] = {}
"""vLLM's modules (and the placeholders) between two contexts of one process."""


@dataclass(frozen=True)
class RankOf:
    """Where one mxload rank sits in vLLM's groups."""

    tp: int
    tp_rank: int
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False
    language_model_only: bool = False
    mm_encoder_tp_mode: str = "weights"
    speculative_method: str = ""
    all2all_backend: str = ""
    """vLLM's ``all2all_backend``; empty: vLLM's own default (which runs sequence-parallel
    MoE under EP with tp > 1 and dp > 1, shared experts whole on every TP rank)."""


class Models:
    """vLLM's modules, imported; builds one rank's model and loads a checkpoint into it."""

    def __init__(self) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            LoadConfig,
            ModelConfig,
            ParallelConfig,
            SpeculativeConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed import parallel_state
        from vllm.model_executor.models import utils as model_utils
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.config = types.SimpleNamespace(
            cache=CacheConfig,
            device=DeviceConfig,
            load=LoadConfig,
            model=ModelConfig,
            parallel=ParallelConfig,
            speculative=SpeculativeConfig,
            vllm=VllmConfig,
            current=set_current_vllm_config,
            dtype=set_default_torch_dtype,
        )
        self.parallel_state = parallel_state
        self.model_utils = model_utils

    def _groups(self, at: RankOf) -> None:
        ps = self.parallel_state
        ep_world, ep_rank = at.dp * at.tp, at.dp_rank * at.tp + at.tp_rank
        for name, (world, rank) in {
            "_TP": (at.tp, at.tp_rank),
            "_PP": (at.pp, at.pp_rank),
            "_DP": (at.dp, at.dp_rank),
            "_EP": (ep_world, ep_rank),  # initialize_model_parallel: dp x tp, dp-major
            "_PCP": (1, 0),
            "_DCP": (1, 0),
        }.items():
            g = ps.GroupCoordinator.__new__(ps.GroupCoordinator)
            g.ranks, g.world_size = list(range(world)), world
            g.rank = g.rank_in_group = g.local_rank = rank
            g.unique_name = name.lower().strip("_")
            g.device_group = g.cpu_group = _ProcessGroup(world, rank)
            setattr(ps, name, g)

    def _vllm_config(self, checkpoint: str, at: RankOf) -> Any:
        """vLLM's ``VllmConfig`` of ``checkpoint`` for the rank ``at``; with its
        ``speculative_config`` made as ``EngineArgs.create_speculative_config`` makes it from
        ``--speculative-config '{"method": ..., "num_speculative_tokens": 1}'``."""
        c = self.config
        self._groups(at)
        model_config = c.model(
            model=checkpoint,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            language_model_only=at.language_model_only,
            mm_encoder_tp_mode=at.mm_encoder_tp_mode,
        )
        # vllm-ascend 0.23's NPUPlatform.check_and_update_config sets ALL2ALL
        # (platform.py:659-662) to turn vLLM's sequence-parallel MoE off; vLLM's default
        # (allgather_reducescatter) replicates the shared experts (disable_tp) when tp > 1,
        # dp > 1 and expert parallel
        backend = {"all2all_backend": at.all2all_backend} if at.all2all_backend else {}
        parallel_config = c.parallel(
            tensor_parallel_size=at.tp,
            pipeline_parallel_size=at.pp,
            data_parallel_size=at.dp,
            data_parallel_rank=at.dp_rank,
            enable_expert_parallel=at.expert_parallel,
            **backend,
        )
        speculative = None
        if at.speculative_method:
            speculative = c.speculative(
                method=at.speculative_method,
                num_speculative_tokens=1,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
            )
        return c.vllm(
            model_config=model_config,
            parallel_config=parallel_config,
            speculative_config=speculative,
            device_config=c.device("cpu"),
            load_config=c.load(),
            # CpuPlatform turns prefix caching off for linear attention; said here so
            # that the mamba block size it implies is not set
            cache_config=c.cache(enable_prefix_caching=False),
        )

    def _built(self, checkpoint: str, vllm_config: Any, model_config: Any) -> torch.nn.Module:
        """The class ``model_config`` names, built under ``vllm_config`` as vLLM's
        ``initialize_model`` builds it, after its own ``load_weights`` over every tensor of
        ``checkpoint``."""
        arch = model_config.architectures[0]
        cls = getattr(
            sys.modules[f"vllm.model_executor.models.{_ARCHS[arch]}"], _CLASS_OF.get(arch, arch)
        )
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
            weights.update(load_file(f))
        # each rank of vLLM is its own process: its cache of pipeline-missing layers, keyed
        # by id(model), must not answer for an earlier (freed) model of this process
        self.model_utils._model_to_pp_missing_layer_names.clear()
        c = self.config
        with c.current(vllm_config), c.dtype(model_config.dtype), torch.device("cpu"):
            model: torch.nn.Module = cls(vllm_config=vllm_config)
            loaded = model.load_weights(iter(weights.items()))
        params = dict(model.named_parameters())
        assert set(params) <= set(loaded), set(params) - set(loaded)
        return model

    def meta_parameters(self, folder: str, at: RankOf) -> dict[str, tuple[tuple[int, ...], str]]:
        """One rank's parameters at full size, names -> (shape, dtype name), without their
        bytes: the class ``folder/config.json`` names, built by vLLM under its own
        ``VllmConfig`` on the meta device (no weights loaded). Stood in for: the expert map's
        logging string (``get_compressed_map_string`` reads the map's values, which meta
        tensors do not have), and torch's ``meta_nonzero_assume_all_nonzero`` is on for the
        build (the map's ``torch.where`` on meta), both undone after."""
        import torch.fx.experimental._config as fx_config
        from vllm.model_executor.layers.fused_moe import expert_map_manager

        vllm_config = self._vllm_config(folder, at)
        model_config = vllm_config.model_config
        arch = model_config.architectures[0]
        cls = getattr(sys.modules[f"vllm.model_executor.models.{_ARCHS[arch]}"], arch)
        self.model_utils._model_to_pp_missing_layer_names.clear()
        patched = [
            obj
            for obj in vars(expert_map_manager).values()
            if isinstance(obj, type) and "get_compressed_map_string" in vars(obj)
        ]
        saved = [obj.get_compressed_map_string for obj in patched]
        nonzero = fx_config.meta_nonzero_assume_all_nonzero
        try:
            for obj in patched:
                obj.get_compressed_map_string = lambda self: "(meta)"
            fx_config.meta_nonzero_assume_all_nonzero = True
            c = self.config
            with c.current(vllm_config), c.dtype(model_config.dtype), torch.device("meta"):
                model: torch.nn.Module = cls(vllm_config=vllm_config)
        finally:
            for obj, f in zip(patched, saved, strict=True):
                obj.get_compressed_map_string = f
            fx_config.meta_nonzero_assume_all_nonzero = nonzero
        return {
            k: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for k, p in model.named_parameters()
        }

    def parameters(self, checkpoint: str, at: RankOf) -> dict[str, torch.nn.Parameter]:
        """One rank's parameters: vLLM's model of ``checkpoint``'s config built for ``at``,
        after its own ``load_weights`` over every tensor of ``checkpoint``."""
        vllm_config = self._vllm_config(checkpoint, at)
        model = self._built(checkpoint, vllm_config, vllm_config.model_config)
        return dict(model.named_parameters())

    def with_drafter(self, checkpoint: str, at: RankOf) -> Built:
        """One rank's target model and drafter (``at.speculative_method``), each after its
        own ``load_weights`` over every tensor of ``checkpoint``: the drafter is the class
        of the draft model config ``SpeculativeConfig`` derives (``Qwen3_5MTP``, ...),
        built under the target's ``VllmConfig`` as the proposer's ``get_model`` builds it
        (its ``_create_draft_vllm_config`` changes the attention backend only)."""
        assert at.speculative_method, at
        vllm_config = self._vllm_config(checkpoint, at)
        draft = vllm_config.speculative_config.draft_model_config
        return Built(
            vllm_config,
            self._built(checkpoint, vllm_config, vllm_config.model_config),
            self._built(checkpoint, vllm_config, draft),
        )


@dataclass(frozen=True)
class Built:
    """A rank's ``VllmConfig``, its target model and its drafter, as vLLM built them."""

    vllm_config: Any
    target: torch.nn.Module
    drafter: torch.nn.Module


@contextmanager
def vllm_models() -> Iterator[Models]:
    """vLLM's model modules importable (and imported) for the duration."""
    src = sources.vllm_wheel(PIN)
    env = dict(os.environ)
    finder = _AbsentFinder()
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(src))
    before = set(sys.modules)
    try:
        if _PARKED:
            sys.modules.update(_PARKED)
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # vLLM's handlers: the root's
            import vllm.platforms
            from vllm.platforms.cpu import CpuPlatform

            class _Platform(CpuPlatform):
                @classmethod
                def get_attn_backend_cls(
                    cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
                ) -> str:
                    if attn_selector_config.use_mla:
                        return "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend"
                    return str(
                        super().get_attn_backend_cls(
                            selected_backend, attn_selector_config, num_heads
                        )
                    )

            # before anything reads vllm.platforms.current_platform
            vllm.platforms._current_platform = _Platform()  # type: ignore[attr-defined]
            import vllm.v1.attention.backends.mla.prefill.flash_attn as fa
            from vllm.model_executor.models.registry import ModelRegistry

            fa.flash_attn_varlen_func = _device_kernel  # type: ignore[assignment]
            for module in set(_ARCHS.values()):
                __import__(f"vllm.model_executor.models.{module}")
            for arch, module in _ARCHS.items():
                # the class itself: the registry's lazy entries inspect it in a subprocess
                cls = getattr(
                    sys.modules[f"vllm.model_executor.models.{module}"], _CLASS_OF.get(arch, arch)
                )
                ModelRegistry.register_model(arch, cls)
        yield Models()
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(src))
        for k in set(sys.modules) - before:
            if k.split(".")[0] in {"vllm", *ABSENT}:
                _PARKED[k] = sys.modules.pop(k)
        os.environ.clear()
        os.environ.update(env)
