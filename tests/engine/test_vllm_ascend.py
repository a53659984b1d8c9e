"""mxload against vllm-ascend's own MXFP8 code: names, views, values, addresses.

The engine's graphs point at the parameters vllm-ascend holds *after its own post-load*,
so this test runs vllm-ascend's real code, downloaded at test time, on CPU:

1. ``pip download --no-deps`` of the pinned sdist into a cache (skipped, with the reason,
   when the package index cannot be reached); nothing of it is copied into the project.
2. Its real ``vllm_ascend/quantization/methods/w8a8_mxfp8.py`` is imported with torch_npu,
   vLLM and the vllm-ascend modules it needs only for ``apply`` replaced by stubs in
   ``sys.modules`` (nothing real can run there on CPU); ``quant_type.py``, ``base.py`` and
   ``registry.py`` are vllm-ascend's own.
3. Per rank of each layout, the engine's MX parameters are created by the schemes' real
   ``get_weight`` / ``get_pergroup_param`` / ``get_dynamic_quant_param``, each carrying the
   weight loader of its vLLM layer, then filled from the ModelOpt-MXFP8 checkpoint that
   ``mxload convert`` writes by vLLM's own loading code, taken unmodified out of the vLLM
   wheel the release builds on (``pip download --no-deps``; :data:`VLLM_OF`, :data:`VLLM_TAKEN`):
   ``Qwen3MoeModel.load_weights`` and ``get_expert_mapping`` (which checkpoint tensor goes
   to which parameter with which shard id: q/k/v, gate/up, w1/w2/w3 per expert),
   ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` (with ``validate_shard_id``) /
   ``RowParallelLinear.weight_loader``, the FusedMoE's ``weight_loader``, ``_load_w13``,
   ``_load_w2``, ``_load_model_weight_or_group_weight_scale`` and the local-expert lookup
   (``ExpertMapManager.map_global_to_local`` over ``determine_expert_map``'s placement),
   the expert mapping (``make_expert_params_mapping``, ``EplbState``'s initial
   physical-to-logical map) and the ``FusedMoeWeightScaleSupported`` kinds. vLLM 0.23.0
   under 0.23.0.post1; vLLM 0.30.0 (its ``RoutedExperts`` loaders and its expert mapping,
   which names the experts ``mlp.experts.routed_experts.*``) under 0.30.0rc2 and for the
   main profile. Every parameter is filled with 0xFF first, so a byte no loader writes
   cannot pass. Then the real ``process_weights_after_loading`` runs.
4. mxload plans with ``--engine vllm-ascend-0.23`` and must give exactly those names,
   shapes, strides and dtypes; it adopts the engine's parameters and reloads the block-FP8
   checkpoint into them three times; each time, the parameters read through their views
   equal what vllm-ascend's RL path gives (``restore_weights_for_rl_loading``, vLLM's
   loaders with the new ModelOpt checkpoint, post-load again), and no ``data_ptr``
   moves. A standalone mxload load (its own allocation, what ``--dump`` writes) holds the
   same views and bytes.

vllm-ascend main has no release to download. Its MXFP8 file (read at 182b75ea) creates
and post-loads the same parameters as 0.23's; what differs is where vLLM main registers
a FusedMoE's routed experts (:data:`MAIN_MOE_PREFIX`). So ``--engine vllm-ascend-main``
runs the same check with 0.23's real schemes, the engine's parameters named under that
prefix: the main profile is held against vllm-ascend's own code for shapes, strides,
dtypes, post-load views and values, and against the reading of vLLM main for the names.

The newest pre-release (:data:`NEWEST`, 0.30.0rc2, on vLLM 0.30) runs too, every layout,
planned with ``--engine vllm-ascend-0.30.0rc2`` (the main profile): its own
``methods/w8a8/w8a8_mxfp8.py`` with NZ off (``weight_nz_mode`` 0, its own
``maybe_trans_nz*`` deciding) and its row-parallel K padding run on ``o_proj`` /
``down_proj`` (stubs: :func:`schemes_newest`).

Still stood in for (:data:`VLLM_STUBS`): what the loaders read from vLLM's distributed
state, config and layer constructors (the tp rank, the QKV head bookkeeping of
``QKVParallelLinear.__init__``, ``output_sizes``, FusedMoE's ``moe_config``, ``quant_config``
None, ``quant_method`` an object named ``AscendFusedMoEMethod``), ``is_pp_missing_parameter``
(the checkpoint's plain tensors are not MX parameters here), ``maybe_remap_kv_scale_name``
and ``default_weight_loader`` (never reached), and under vLLM 0.30 the routing of names,
which 0.30 does through ``AutoWeightsLoader`` over a real module tree: 0.23's hand-rolled
``Qwen3MoeModel.load_weights`` routes there too (:data:`ROUTING`), with 0.30's mapping and
loaders. Not covered for real (nothing of them imports without vLLM/torch_npu):
``method_adapters.create_weights`` (its attributes set here: ``output_dim`` 0 and
``input_dim`` 1 on linear weights and MX scales, the MoE scales GROUP-quantized), the
unquantized (fallback) MoE post-load, vllm-ascend main's own file and vLLM main's own
MoE naming (0.30's is used).
"""

from __future__ import annotations
import __future__

import ast
import enum
import functools
import importlib
import logging
import os
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.reload import reload_inputs
from mxload.orchestrator.tools.convert import convert_checkpoint
from mxload.workers.rank.loader import RankLoader
from safetensors.torch import load_file

from tests.engine import sources
from tests.engine.vllm_code import _namespace, _node, _parsed
from tests.reference_model import Layout, coords

_ANNOTATIONS = __future__.annotations.compiler_flag

PIN = "0.23.0.post1"
MOE_PREFIX = "mlp.experts"
"""Where vLLM 0.23 registers a FusedMoE's parameters (``model.layers.N.mlp.experts.w13_weight``)."""
MAIN_MOE_PREFIX = "mlp.experts.routed_experts"
"""Where vLLM main registers them: its FusedMoE hands the routed experts to a MoERunner
module named ``routed_experts`` (vllm 0.33.0 model_executor/layers/fused_moe/layer.py
415-470, vllm-ascend main vllm_ascend/ops/fused_moe/fused_moe.py 39-71)."""
NEWEST = "0.30.0rc2"
"""The newest pre-release on the index: its ``methods/w8a8/w8a8_mxfp8.py`` runs too."""
MX_FILE = "vllm_ascend/quantization/methods/w8a8_mxfp8.py"

# H = 256 (8 groups), moe I = 256: I_l = 128 / 256 / 64 at tp2, EP, tp2 x dp2 without EP
# (even group counts everywhere: vllm-ascend's MoE post-load cannot take odd ones).
OVERRIDES = {"moe_intermediate_size": 256}
LAYOUTS = {
    "tp2": ParallelLayout(tp=2),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
    "tp2xdp2": ParallelLayout(tp=2, dp=2),
}
# (layout, --engine, where the engine's MoE parameters live): every layout for 0.23, whose
# code runs here; the expert-parallel one for main, which differs from 0.23 in names only.
CASES = {
    **{name: (name, "vllm-ascend-0.23", MOE_PREFIX) for name in LAYOUTS},
    "tp2xdp2-ep-main": ("tp2xdp2-ep", "vllm-ascend-main", MAIN_MOE_PREFIX),
    # the newest pre-release's own MXFP8 file (on vLLM 0.30, experts under routed_experts)
    **{f"{name}@{NEWEST}": (name, f"vllm-ascend-{NEWEST}", MAIN_MOE_PREFIX) for name in LAYOUTS},
}


@pytest.fixture(scope="module")
def vllm_ascend_root() -> Path:
    """The unpacked pinned sdist, downloaded once into the cache (tests/engine/sources.py)."""
    root = sources.vllm_ascend_sdist(PIN)
    assert (root / MX_FILE).is_file()
    return root


# --- vllm-ascend's MXFP8 schemes, imported for real with stubs around them ------------------


class _CompilationMode(enum.IntEnum):
    NONE = 0
    VLLM_COMPILE = 3


def _module(name: str, path: Path | None = None, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    if path is not None:
        m.__path__ = [str(path)]  # a package whose submodules load from the real sources
    m.__dict__.update(attrs)
    return m


@pytest.fixture(scope="module")
def schemes(vllm_ascend_root: Path) -> Iterator[SimpleNamespace]:
    pkg = vllm_ascend_root / "vllm_ascend"
    vllm_config = SimpleNamespace(
        quant_config=SimpleNamespace(quant_description={"group_size": 32}),
        compilation_config=SimpleNamespace(mode=_CompilationMode.NONE),
        model_config=SimpleNamespace(enforce_eager=True),
        use_v2_model_runner=False,
    )
    ascend_config = SimpleNamespace(
        eplb_config=SimpleNamespace(dynamic_eplb=False), multistream_overlap_gate=False
    )
    stubs = {
        # what nothing real can stand in for on CPU: torch_npu and vLLM
        "torch_npu": _module("torch_npu"),
        "vllm": _module("vllm", Path("/nonexistent")),
        "vllm.config": _module(
            "vllm.config",
            CompilationMode=_CompilationMode,
            get_current_vllm_config=lambda: vllm_config,
        ),
        "vllm.logger": _module("vllm.logger", logger=logging.getLogger("vllm-stub")),
        "vllm.utils": _module("vllm.utils", Path("/nonexistent")),
        "vllm.utils.math_utils": _module("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b)),
        # vllm-ascend's packages without their __init__ (which import all of vLLM)
        "vllm_ascend": _module("vllm_ascend", pkg),
        "vllm_ascend.quantization": _module("vllm_ascend.quantization", pkg / "quantization"),
        "vllm_ascend.quantization.methods": _module(
            "vllm_ascend.quantization.methods", pkg / "quantization" / "methods"
        ),
        # vllm-ascend modules the MXFP8 file uses only at run time (apply) or to read
        # configuration that the stubs above provide
        "vllm_ascend.ascend_config": _module(
            "vllm_ascend.ascend_config", get_ascend_config=lambda: ascend_config
        ),
        "vllm_ascend.ascend_forward_context": _module(
            "vllm_ascend.ascend_forward_context", _EXTRA_CTX=None
        ),
        "vllm_ascend.device": _module("vllm_ascend.device", Path("/nonexistent")),
        "vllm_ascend.device.mxfp_compat": _module(
            "vllm_ascend.device.mxfp_compat",
            FLOAT8_E8M0FNU_DTYPE=torch.uint8,
            ensure_mxfp8_linear_available=lambda *a: None,
            ensure_mxfp8_moe_available=lambda *a: None,
        ),
        "vllm_ascend.flash_common3_context": _module(
            "vllm_ascend.flash_common3_context", get_flash_common3_context=lambda: None
        ),
        "vllm_ascend.ops": _module("vllm_ascend.ops", Path("/nonexistent")),
        "vllm_ascend.ops.fused_moe": _module("vllm_ascend.ops.fused_moe", Path("/nonexistent")),
        "vllm_ascend.ops.fused_moe.experts_selector": _module(
            "vllm_ascend.ops.fused_moe.experts_selector", select_experts=None
        ),
        "vllm_ascend.ops.fused_moe.moe_runtime_args": _module(
            "vllm_ascend.ops.fused_moe.moe_runtime_args", build_fused_experts_input=None
        ),
    }
    # only the stubs' packages are dropped after: torch's submodules imported meanwhile
    # must stay (their TORCH_LIBRARY registrations do, and cannot be made twice)
    with sources.modules(stubs):
        mx = importlib.import_module("vllm_ascend.quantization.methods.w8a8_mxfp8")
        assert Path(mx.__file__).resolve() == (vllm_ascend_root / MX_FILE).resolve()
        yield SimpleNamespace(
            linear=mx.AscendW8A8MXFP8DynamicLinearMethod,
            moe=mx.AscendW8A8MXFP8DynamicFusedMoEMethod,
        )


@pytest.fixture(scope="module")
def schemes_newest() -> SimpleNamespace:
    """0.30.0rc2's MXFP8 schemes, imported for real. Its ``methods/w8a8/w8a8_mxfp8.py``,
    ``methods/base.py``, ``methods/registry.py``, ``quant_type.py`` and ``vllm_ascend/utils.py``
    (``maybe_trans_nz``, ``maybe_trans_nz_with_scale``: whether weights are cast to NZ) and
    vLLM 0.30.0's ``utils/math_utils.py`` are the real files; every other vllm / vllm_ascend
    / torch_npu module is a named stub (tests/engine/sources.py), with these answers:
    ``get_current_vllm_config`` (group_size 32, v1 model runner), ``get_ascend_config``
    (``weight_nz_mode`` 0, no dynamic EPLB), ``use_cann_megamoe`` False (``enable_fused_mc2``
    0), ``get_current_hardware_profile`` (not a FORCE_NZ device). The classes keep working
    after the stubs are gone: nothing they run imports at call time."""
    from tests.engine.sources import Stub, stubbed_packages

    pkg = sources.vllm_ascend_sdist(NEWEST) / "vllm_ascend"
    vllm = sources.vllm_wheel("0.30.0")
    q = "vllm_ascend.quantization"
    real = {
        f"{q}.methods.w8a8.w8a8_mxfp8": pkg / "quantization/methods/w8a8/w8a8_mxfp8.py",
        f"{q}.methods.base": pkg / "quantization/methods/base.py",
        f"{q}.methods.registry": pkg / "quantization/methods/registry.py",
        f"{q}.quant_type": pkg / "quantization/quant_type.py",
        "vllm_ascend.utils": pkg / "utils.py",
        "vllm.utils.math_utils": vllm / "vllm/utils/math_utils.py",
    }
    cfg = SimpleNamespace(
        quant_config=SimpleNamespace(quant_description={"group_size": 32}),
        use_v2_model_runner=False,
    )
    ascend = SimpleNamespace(weight_nz_mode=0, eplb_config=SimpleNamespace(dynamic_eplb=False))
    quiet = sources.QuietLogger()
    given = {
        "vllm.config": Stub(
            "vllm.config", Path("/nonexistent"), get_current_vllm_config=lambda: cfg
        ),
        "vllm.logger": Stub("vllm.logger", logger=quiet, init_logger=lambda name: quiet),
        "vllm_ascend.ascend_config": Stub(
            "vllm_ascend.ascend_config",
            get_ascend_config=lambda: ascend,
            is_mega_moe_supported=lambda: False,
        ),
        "vllm_ascend.ascend_forward_context": Stub(
            "vllm_ascend.ascend_forward_context", use_cann_megamoe=lambda config: False
        ),
        "vllm_ascend.device.hardware_profile": Stub(
            "vllm_ascend.device.hardware_profile",
            get_current_hardware_profile=lambda: SimpleNamespace(weight_layout_policy=None),
        ),
    }
    with stubbed_packages({"vllm", "vllm_ascend", "torch_npu"}, real, given):
        mx = importlib.import_module(f"{q}.methods.w8a8.w8a8_mxfp8")
    assert Path(mx.__file__).resolve() == real[mx.__name__].resolve()
    return SimpleNamespace(
        linear=mx.AscendW8A8MXFP8DynamicLinearMethod,
        moe=mx.AscendW8A8MXFP8DynamicFusedMoEMethod,
        # vLLM's RowParallelLinear as this file imported it: o_proj / down_proj are made
        # instances, so its row-parallel K padding runs
        row=type("RowLayer", (torch.nn.Module, mx.RowParallelLinear), {}),
    )


# --- the engine side: vllm-ascend's parameters, filled as vLLM's loaders would --------------


class _Engine:
    """One rank's MX layers as vllm-ascend holds them (name -> module with Parameters),
    each parameter carrying the weight loader of the vLLM layer it belongs to."""

    def __init__(
        self,
        schemes: SimpleNamespace,
        plan_rank: Any,
        dtype: torch.dtype,
        vllm: _VllmLoaders,
        cfg: dict,
        layout: Layout,
    ) -> None:
        self.layers: dict[str, tuple[Any, torch.nn.Module]] = {}
        self.vllm, self.cfg = vllm, cfg
        bufs = {b.name: b for b in plan_rank.buffers}
        _, _, tp_rank = coords(layout, plan_rank.rank)
        tp = layout.tp
        nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        group = layout.dp * tp  # vLLM flattens dp x tp for the MoE
        moe_rank = plan_rank.dp_rank * tp + tp_rank
        n_local, expert_map, *_ = vllm.ns["determine_expert_map"](
            group if layout.ep else 1, moe_rank if layout.ep else 0, cfg["num_experts"]
        )
        scale_kinds = vllm.ns["FusedMoeWeightScaleSupported"]
        for b in plan_rank.buffers:
            if b.layout == "mx_linear" and b.name.endswith(".weight"):
                k, n = b.shape
                scheme = schemes.linear()
                row = b.name.endswith(("o_proj.weight", "down_proj.weight"))
                layer = schemes.row() if row and hasattr(schemes, "row") else torch.nn.Module()
                if row:  # what vLLM's RowParallelLinear sets (K split over tp)
                    layer.tp_rank, layer.input_size_per_partition = plan_rank.tp_rank, k
                # the vLLM layer whose weight_loader the parameters carry (its __init__'s
                # attributes as QKVParallelLinear / MergedColumnParallelLinear set them)
                if b.name.endswith("qkv_proj.weight"):
                    owner = vllm.layer(
                        "qkv",
                        tp_size=tp,
                        tp_rank=tp_rank,
                        total_num_heads=nq,
                        total_num_kv_heads=nkv,
                        head_size=hd,
                        v_head_size=hd,
                        num_heads=nq // tp,
                        num_kv_heads=max(1, nkv // tp),
                        num_kv_head_replicas=max(1, tp // nkv),
                    )
                elif b.name.endswith("gate_up_proj.weight"):
                    inter = cfg["intermediate_size"]
                    owner = vllm.layer(
                        "merged", tp_size=tp, tp_rank=tp_rank, output_sizes=[inter] * 2
                    )
                else:
                    owner = vllm.layer("row", tp_size=tp, tp_rank=tp_rank)
                # method_adapters.AscendLinearMethod.create_weights: each tensor a Parameter
                # with output_dim 0, input_dim 1 (MX scales too) and the layer's loader
                for d in (
                    scheme.get_weight(k, n, dtype),
                    scheme.get_pergroup_param(k, n, dtype, layer_type="others"),
                ):
                    for pname, t in d.items():
                        param = torch.nn.Parameter(t, requires_grad=False)
                        param.output_dim, param.input_dim = 0, 1
                        param.weight_loader = owner.weight_loader
                        layer.register_parameter(pname, param)
                self.layers[b.name[: -len(".weight")]] = (scheme, layer)
            elif b.layout == "mx_moe" and b.name.endswith(".w13_weight"):
                e_l, h, two_i = b.shape
                assert e_l == n_local, (b.name, e_l, n_local)
                w2 = bufs[b.name.replace("w13_weight", "w2_weight")]
                assert w2.shape == (e_l, two_i // 2, h)
                scheme = schemes.moe()
                layer = torch.nn.Module()
                moe = vllm.layer(
                    "moe",
                    tp_size=1 if layout.ep else group,
                    tp_rank=0 if layout.ep else moe_rank,
                    quant_config=None,
                    quant_method=type("AscendFusedMoEMethod", (), {})(),
                    expert_map_manager=vllm.layer("expert_map", _expert_map=expert_map),
                    moe_config=SimpleNamespace(
                        is_act_and_mul=True,
                        tp_rank=0 if layout.ep else moe_rank,
                        moe_parallel_config=SimpleNamespace(tp_size=1 if layout.ep else group),
                    ),
                )
                # method_adapters.AscendFusedMoEMethod.create_weights: the FusedMoE's loader
                # on every parameter; the MX scales (group_size > 0) GROUP-quantized
                for d, kind in (
                    (scheme.get_weight(e_l, two_i // 2, h, dtype), None),
                    (scheme.get_dynamic_quant_param(e_l, two_i // 2, h, dtype), "scale"),
                ):
                    for pname, t in d.items():
                        param = torch.nn.Parameter(t, requires_grad=False)
                        param.weight_loader = moe.weight_loader
                        if kind:
                            assert "weight_scale" in pname and scheme.group_size > 0, pname
                            param.quant_method = scale_kinds.GROUP.value
                        layer.register_parameter(pname, param)
                self.layers[b.name[: -len(".w13_weight")]] = (scheme, layer)

    def load(self, checkpoint: dict[str, torch.Tensor]) -> set[str]:
        """vLLM's own loading of a ModelOpt-MXFP8 checkpoint into the parameters (before
        post-load): Qwen3MoeModel.load_weights routing each tensor to a parameter with its
        shard id, the parameters' weight loaders sharding it. Returns what it loaded."""
        params = self.params()
        for p in params.values():  # what no loader writes cannot pass for a value
            p.data.view(torch.uint8).fill_(0xFF)
        inner = {n.removeprefix("model."): p for n, p in params.items()}
        model = self.vllm.layer(
            "model",
            params=inner,
            named_parameters=lambda: list(inner.items()),
            config=SimpleNamespace(num_experts=self.cfg["num_experts"]),
            num_redundant_experts=0,
        )
        # AutoWeightsLoader (Qwen3MoeForCausalLM.load_weights): model.* to the model
        weights = [
            (n.removeprefix("model."), t) for n, t in checkpoint.items() if n.startswith("model.")
        ]
        return {f"model.{n}" for n in model.load_weights(weights)}

    def post_load(self) -> None:
        for scheme, layer in self.layers.values():
            scheme.process_weights_after_loading(layer)

    def restore(self) -> None:
        for scheme, layer in self.layers.values():
            scheme.restore_weights_for_rl_loading(layer)

    def params(self) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.{pname}": p
            for prefix, (_, layer) in self.layers.items()
            for pname, p in layer.named_parameters()
        }


VLLM_OF = {
    "vllm-ascend-0.23": "0.23.0",
    "vllm-ascend-main": "0.30.0",
    f"vllm-ascend-{NEWEST}": "0.30.0",
}
"""The vLLM wheel whose weight loaders fill each engine's parameters: 0.23.0 under
vllm-ascend 0.23.0.post1; 0.30.0 under 0.30.0rc2, and for main's names (vLLM 0.30 already
registers a FusedMoE's experts under ``routed_experts``)."""
_MOE = "vllm/model_executor/layers/fused_moe"
VLLM_TAKEN: dict[str, dict[str, tuple[str, str, tuple[str, ...]]]] = {
    v: {
        # what: (file, class or "", names taken from it)
        "qkv": (
            "vllm/model_executor/layers/linear.py",
            "QKVParallelLinear",
            ("validate_shard_id", "weight_loader"),
        ),
        "merged": (
            "vllm/model_executor/layers/linear.py",
            "MergedColumnParallelLinear",
            ("validate_shard_id", "weight_loader"),
        ),
        "row": ("vllm/model_executor/layers/linear.py", "RowParallelLinear", ("weight_loader",)),
        "moe": (
            f"{_MOE}/layer.py" if v == "0.23.0" else f"{_MOE}/routed_experts.py",
            "FusedMoE" if v == "0.23.0" else "RoutedExperts",
            (
                "weight_loader",
                "_load_w13",
                "_load_w2",
                "_get_hidden_dim",
                "_narrow_expert_data_for_padding",
                "_map_global_expert_id_to_local_expert_id",
                "_load_model_weight_or_group_weight_scale",
                "make_expert_params_mapping",
                *(() if v == "0.23.0" else ("build_expert_params_mapping",)),
            ),
        ),
        "scale_kinds": (
            f"{_MOE}/layer.py" if v == "0.23.0" else f"{_MOE}/routed_experts.py",
            "",
            ("FusedMoeWeightScaleSupported",),
        ),
        "mapping": (f"{_MOE}/layer.py", "", ("fused_moe_make_expert_params_mapping",)),
        "placement": (f"{_MOE}/expert_map_manager.py", "", ("determine_expert_map",)),
        "expert_map": (
            f"{_MOE}/expert_map_manager.py",
            "ExpertMapManager",
            ("map_global_to_local",),
        ),
        "eplb": (
            "vllm/distributed/eplb/eplb_state.py",
            "EplbState",
            ("build_initial_global_physical_to_logical_map",),
        ),
        # the model's checkpoint -> parameter routing: always vLLM 0.23's (ROUTING)
        "model": (
            "vllm/model_executor/models/qwen3_moe.py",
            "Qwen3MoeModel",
            ("get_expert_mapping", "load_weights"),
        ),
    }
    for v in ("0.23.0", "0.30.0")
}
"""The functions of vLLM's own files that run here, unmodified, per wheel."""
ROUTING = "0.23.0"
"""The wheel whose ``Qwen3MoeModel.load_weights`` routes checkpoint tensors to parameters
(0.30's routes through ``AutoWeightsLoader`` over a real module tree: see VLLM_STUBS)."""
VLLM_STUBS = {
    "get_tensor_model_parallel_rank, tp_size/tp_rank": "the rank under test (vllm.distributed)",
    "is_pp_missing_parameter": "models/utils.py: not a parameter of this engine (the plain "
    "tensors: norms, embeddings, router, lm_head are not vllm-ascend's MX parameters)",
    "maybe_remap_kv_scale_name": "weight_utils.py: no kv-cache scales in the checkpoint",
    "default_weight_loader": "weight_utils.py: never reached (every MX parameter has a loader)",
    "quant_config": "None (its get_name() is only compared with gpt_oss_mxfp4)",
    "quant_method": "an object named AscendFusedMoEMethod (vllm-ascend's adapter's name)",
    "moe_config": "FusedMoEConfig: is_act_and_mul, tp_rank, moe_parallel_config.tp_size",
    "logger": "Python logging",
    "the rest of _namespace": "tests/engine/vllm_code.py's _STUBS (quantization-only "
    "helpers that raise if reached, parameter classes no isinstance here may match)",
    "model routing under vLLM 0.30": "0.30's Qwen3MoeModel routes through AutoWeightsLoader "
    "over its module tree; 0.23's hand-rolled Qwen3MoeModel.load_weights runs instead, with "
    "0.30's expert mapping (fused_moe_make_expert_params_mapping, its legacy entry point) "
    "and 0.30's per-parameter loaders",
}
"""What vLLM's functions reach that is stood in for here, and what stands in."""


@functools.cache
def _take(root: Path, file: str, cls: str, name: str) -> tuple[types.CodeType, str]:
    """``cls.name`` (or top-level ``name``) of vLLM's ``file``, its source dedented and
    decorators dropped, compiled with annotations left unevaluated (they name vLLM types
    this test does not import); and how it was declared (staticmethod/classmethod/"")."""
    text, tree = _parsed(root / file)
    node = _node(tree, (cls, name) if cls else (name,))
    assert isinstance(node, ast.FunctionDef | ast.ClassDef)
    kind = next(
        (
            d.id
            for d in getattr(node, "decorator_list", [])
            if isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod")
        ),
        "",
    )
    source = textwrap.dedent("\n".join(text.splitlines()[node.lineno - 1 : node.end_lineno]))
    code = compile(source, f"<vllm {name}>", "exec", flags=_ANNOTATIONS, dont_inherit=True)
    return code, kind


def _default_weight_loader(*_: Any) -> None:
    raise AssertionError("vLLM's default_weight_loader reached: an MX parameter has no loader")


class _VllmLoaders:
    """vLLM's weight loaders of one wheel, for one rank (``tp_rank`` of the attention/MLP
    group): classes holding vLLM's methods, their globals the names in ``VLLM_STUBS``."""

    def __init__(self, root: Path, version: str, tp_rank: int) -> None:
        ns = self.ns = _namespace(tp_rank)
        ns.update(
            Enum=enum.Enum,
            logger=sources.QuietLogger(),
            default_weight_loader=_default_weight_loader,
        )
        self.classes: dict[str, type] = {}
        for what, (file, cls, names) in VLLM_TAKEN[version].items():
            body: dict[str, Any] = {}
            src = sources.vllm_wheel(ROUTING) if what == "model" else root
            for name in names:
                code, kind = _take(src, file, cls, name)
                exec(code, ns)
                fn = ns[name]
                body[name] = {"staticmethod": staticmethod, "classmethod": classmethod}.get(
                    kind, lambda f: f
                )(fn)
            if cls:
                self.classes[what] = type(cls, (), body)
        # what the functions call by their vLLM names
        ns["FusedMoE"] = ns["RoutedExperts"] = self.classes["moe"]
        ns["EplbState"] = self.classes["eplb"]

    def layer(self, what: str, **attrs: Any) -> Any:
        obj = self.classes[what]()
        obj.__dict__.update(attrs)
        return obj


def _read_mx(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Logical values (what the view reads), as bytes in the view's row-major order."""
    return t.detach().contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def checkpoints(ckpt_factory, tmp_path_factory):
    """Two block-FP8 versions and their ModelOpt-MXFP8 forms (mxload convert)."""
    out = {}
    for seed in (1, 2):
        src = ckpt_factory("qwen3-moe-tiny", seed=seed, overrides=OVERRIDES)
        dst = str(tmp_path_factory.mktemp(f"modelopt-{seed}"))
        convert_checkpoint(src, dst)
        out[seed] = (src, _read_mx(dst))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_adopts_vllm_ascend_parameters_and_reloads_to_its_own_values(
    name, request, checkpoints
) -> None:
    import json

    layout_name, engine_name, moe_prefix = CASES[name]
    schemes = request.getfixturevalue("schemes_newest" if NEWEST in name else "schemes")
    layout = LAYOUTS[layout_name]
    ref_layout = Layout(tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.enable_expert_parallel)
    src1, mx1 = checkpoints[1]
    src2, mx2 = checkpoints[2]
    with open(os.path.join(src1, "config.json")) as f:
        cfg = json.load(f)
    meta = open_checkpoint(src1)
    held = build_plan(meta.config, layout, checkpoint=meta, engine=engine_name)
    # What the engine holds as plain tensors (norms, embeddings, the router) is planned
    # row-major under the same names as mxload's own layout.
    own = build_plan(meta.config, layout, checkpoint=meta, engine="mxload")
    for rp, mine in zip(held.ranks, own.ranks, strict=True):
        plain = [(b.name, b.shape, b.stride, b.dtype) for b in rp.buffers if b.layout == "dense"]
        assert plain == [
            (b.name, b.shape, b.stride, b.dtype) for b in mine.buffers if b.layout == "dense"
        ]
    dtype = torch.bfloat16
    inputs = {1: reload_inputs(held, src1), 2: reload_inputs(held, src2)}
    vllm_root = sources.vllm_wheel(VLLM_OF[engine_name])
    for rank, rp in enumerate(held.ranks):
        _, _, tp_rank = coords(ref_layout, rank)
        vllm = _VllmLoaders(vllm_root, VLLM_OF[engine_name], tp_rank)
        # What vllm-ascend holds after loading version 1 (its engine start-up).
        engine = _Engine(schemes, rp, dtype, vllm, cfg, ref_layout)
        # 0. The plan names every MX parameter as the engine does: vLLM's own loading
        #    (its name routing and expert mapping) finds and fills every one of them.
        names = set(engine.params())
        loaded = engine.load(mx1)
        assert loaded == names, f"rank {rank}: {sorted(loaded ^ names)}"
        assert any(f".{moe_prefix}.w13_weight_scale" in n for n in names), sorted(names)
        engine.post_load()
        params = engine.params()
        if NEWEST in name:  # its row-parallel K padding ran (and found the shards aligned)
            pads = {p: vars(m).get("mxfp8_tp_padding") for p, (_, m) in engine.layers.items()}
            rows = {p: v for p, v in pads.items() if p.endswith(("o_proj", "down_proj"))}
            assert rows and set(rows.values()) == {(0, 0)}, pads

        # 1. mxload's plan names exactly those views: shape, stride, dtype, storage offset.
        specs = {b.name: b for b in rp.buffers}
        for pname, t in params.items():
            spec = specs[pname]
            got = (spec.shape, spec.stride, spec.dtype, spec.storage_offset)
            want = (tuple(t.shape), tuple(t.stride()), str(t.dtype).split(".")[1], 0)
            assert got == want, f"rank {rank} {pname}: planned {got}, vllm-ascend holds {want}"
        mx_specs = {n for n, b in specs.items() if b.layout in ("mx_linear", "mx_moe")}
        assert mx_specs == set(params), f"rank {rank}: {sorted(mx_specs ^ set(params))}"

        # vllm-ascend's RL path to version 2 on a second engine: restore, load, post-load.
        ref2 = _Engine(schemes, rp, dtype, vllm, cfg, ref_layout)
        assert ref2.load(mx1) == names
        ref2.post_load()
        ref2.restore()
        assert ref2.load(mx2) == names
        ref2.post_load()
        want = {1: {n: _bytes(t).clone() for n, t in params.items()}}
        want[2] = {n: _bytes(t) for n, t in ref2.params().items()}

        # 2. mxload adopts the engine's own parameters (the rest: host tensors) and
        #    reloads three times, from the block-FP8 checkpoints.
        host = {n: p for n, p in params.items()}
        for b in rp.buffers:
            if b.name not in host:
                host[b.name] = torch.zeros(b.shape, dtype=getattr(torch, b.dtype))
        ptrs = {n: t.data_ptr() for n, t in host.items()}
        loader = RankLoader(rp, model_dtype=held.model["dtype"], device="cpu", buffers=host)
        for version, v in enumerate((2, 1, 2), start=1):
            inp = inputs[v]
            loader.reload(
                list(inp.reads[rank]),
                inp.source,
                version=version,
                staging_budget=inp.budgets[rank],
                units=list(inp.units[rank]),
            )
            bad = [n for n, t in params.items() if not torch.equal(_bytes(t), want[v][n])]
            assert bad == [], f"{name} rank {rank} reload {version} (v{v}): {bad}"
            moved = [n for n, t in host.items() if t.data_ptr() != ptrs[n]]
            assert moved == [], f"{name} rank {rank} reload {version}: moved {moved}"

        # 3. A standalone load (what `mxload load --engine vllm-ascend-0.23 --dump` holds):
        #    the same views and bytes as vllm-ascend's own parameters.
        alone = RankLoader(rp, model_dtype=held.model["dtype"], device="cpu")
        inp = inputs[2]
        alone.load(list(inp.reads[rank]), inp.source, version=1, staging_budget=inp.budgets[rank])
        report = alone.tensor_report()
        dumped = alone.host_tensors()
        for pname, t in ref2.params().items():
            r = report[pname]
            assert (tuple(r["shape"]), tuple(r["stride"]), r["storage_offset"]) == (
                tuple(t.shape),
                tuple(t.stride()),
                0,
            ), pname
            assert torch.equal(_bytes(dumped[pname]), want[2][pname]), f"rank {rank} {pname}"
