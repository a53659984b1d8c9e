"""What ``mxload convert`` writes, through each engine's own quantization dispatch.

Which method the engine gives each layer decides whether it can load the checkpoint at all:
a layer given an MXFP8 method expects an FP8 weight and a scale; a layer kept in the model
dtype expects the BF16 tensor. Both are run from the engines' real sources (downloaded
at test time, ``tests/engine/sources.py``):

* ``--format modelopt`` through vllm-ascend 0.30.0rc2's ``AscendModelOptMxFp8Config``
  (``quantization/configs/modelopt_mxfp8_config.py``), a subclass of vLLM 0.30.0's own
  ``ModelOptMxFp8Config`` (``model_executor/layers/quantization/modelopt.py``, with its
  ``base_config.py`` and ``utils/quant_utils.py``): ``from_config`` reads the kept modules,
  ``get_quant_method`` dispatches per layer;
* ``--format ascend`` through vllm-ascend 0.23.0.post1's ``AscendModelSlimConfig``
  (``quantization/modelslim_config.py``): ``maybe_update_config`` reads
  ``quant_model_description.json`` from the output folder (with ``quantization/utils.py``'s
  ``get_model_file``), ``get_quant_method`` dispatches per layer and
  ``create_scheme_for_layer`` builds the scheme through the real registry
  (``methods/registry.py``, ``methods/__init__.py``) into the real
  ``AscendW8A8MXFP8Dynamic*Method`` (``methods/w8a8_mxfp8.py``);
* both formats of the Qwen3.5 dense and MoE and DeepSeek-V3 presets through the same two
  dispatches, after vLLM's own ``WeightsMapper`` (``models/utils.py``) has renamed the
  kept modules with the model's ``hf_to_vllm_mapper`` and its ``packed_modules_mapping``
  is set (both run from the model classes' bodies in ``qwen3_vl.py`` / ``qwen3_5.py`` /
  ``deepseek_v2.py``), as vLLM's loader does: every linear, embedding and fused MoE of a rank
  gets an MXFP8 method exactly where mxload holds it MX (merged ``in_proj_qkvz`` /
  ``in_proj_ba`` / ``fused_qkv_a_proj`` judged shard by shard by the engine; the vision
  tower, routers and ``kv_b_proj`` kept).

Stand-ins: every other ``vllm`` / ``vllm_ascend`` / ``transformers`` / ``torch_npu``
module is a named :class:`tests.engine.sources.Stub` (its names are placeholder classes
that compute nothing); the layer classes the dispatch tests with ``isinstance``
(``LinearBase``, ``VocabParallelEmbedding``, ``ParallelLMHead`` its subclass,
``FusedMoE``) are those placeholders; ``get_current_vllm_config`` answers the model type
(``qwen3_moe``, or the family's) and ``group_size``; ``vllm_ascend.utils.vllm_version_is`` answers the
release's own vLLM (0.23.0).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.tools.convert import convert_checkpoint
from safetensors.torch import load_file

from tests.engine import sources
from tests.engine.sources import Stub, stubbed_packages

OVERRIDES = {"moe_intermediate_size": 256}
ROOTS = {"vllm", "vllm_ascend", "transformers", "torch_npu"}

# (vLLM prefix, layer class, kept in the model dtype)
LAYERS = [
    ("model.embed_tokens", "VocabParallelEmbedding", True),
    ("lm_head", "ParallelLMHead", True),
    ("model.layers.0.self_attn.qkv_proj", "LinearBase", False),
    ("model.layers.0.self_attn.o_proj", "LinearBase", False),
    ("model.layers.1.mlp.gate", "LinearBase", True),  # the MoE router
    ("model.layers.1.mlp.experts", "FusedMoE", False),
]
# The method each engine gives those layers when the checkpoint is described right: its
# unquantized methods for what is kept, its MXFP8 adapters for the rest (class names
# from the engines' sources).
WANT = {
    "model.embed_tokens": "UnquantizedEmbeddingMethod",
    "lm_head": "UnquantizedEmbeddingMethod",
    "model.layers.0.self_attn.qkv_proj": "AscendLinearMethod",
    "model.layers.0.self_attn.o_proj": "AscendLinearMethod",
    "model.layers.1.mlp.gate": "AscendUnquantizedLinearMethod",
    "model.layers.1.mlp.experts": "AscendFusedMoEMethod",
}


@pytest.fixture(scope="module")
def outputs(ckpt_factory, tmp_path_factory) -> dict[str, str]:
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    out = {}
    for fmt in ("modelopt", "ascend"):
        out[fmt] = str(tmp_path_factory.mktemp(f"convert-{fmt}"))
        convert_checkpoint(src, out[fmt], fmt=fmt)
    return out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_the_two_formats_hold_the_same_tensors(outputs: dict[str, str]) -> None:
    a, b = _tensors(outputs["modelopt"]), _tensors(outputs["ascend"])
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    with open(os.path.join(outputs["ascend"], "config.json")) as f:
        assert "quantization_config" not in json.load(f)  # vLLM would dispatch by it
    # mxload reads its own ascend output back as the same MXFP8 checkpoint
    ma, mb = open_checkpoint(outputs["modelopt"]), open_checkpoint(outputs["ascend"])
    assert ma.config.quant.kind == mb.config.quant.kind == "mxfp8"


def _layer(classes: dict[str, type], kind: str) -> Any:
    layer = classes[kind]()
    layer.moe_config = None
    return layer


def _vllm_layers(given: dict[str, Any]) -> dict[str, type]:
    """The layer classes the dispatch tests against, as placeholders in their modules."""
    linear = Stub("vllm.model_executor.layers.linear", Path("/nonexistent"))
    vocab = Stub("vllm.model_executor.layers.vocab_parallel_embedding", Path("/nonexistent"))
    moe = Stub("vllm.model_executor.layers.fused_moe", Path("/nonexistent"))
    vocab.ParallelLMHead = type("ParallelLMHead", (vocab.VocabParallelEmbedding,), {})
    given.update({m.__name__: m for m in (linear, vocab, moe)})
    return {
        "LinearBase": linear.LinearBase,
        "VocabParallelEmbedding": vocab.VocabParallelEmbedding,
        "ParallelLMHead": vocab.ParallelLMHead,
        "FusedMoE": moe.FusedMoE,
        "RoutedExperts": moe.RoutedExperts,
        "MoERunner": moe.MoERunner,
    }


def _real(root: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for n in names:
        p = root / n.replace(".", "/")
        out[n] = p / "__init__.py" if p.is_dir() else p.with_suffix(".py")
    return out


@contextmanager
def _modelopt_0_30() -> Iterator[SimpleNamespace]:
    """vllm-ascend 0.30.0rc2's ModelOpt MXFP8 config on vLLM 0.30.0's real modelopt.py, and
    vLLM's ``models/utils.py`` (``WeightsMapper``), with the layer placeholders."""
    va = sources.vllm_ascend_sdist("0.30.0rc2")
    vllm = sources.vllm_wheel("0.30.0")
    real = {
        **_real(
            vllm,
            [
                "vllm.model_executor.layers.quantization.modelopt",
                "vllm.model_executor.layers.quantization.base_config",
                "vllm.model_executor.layers.quantization.utils.quant_utils",
                "vllm.model_executor.models.utils",
            ],
        ),
        **_real(
            va,
            [
                "vllm_ascend.quantization.configs.modelopt_mxfp8_config",
                "vllm_ascend.quantization.utils",
            ],
        ),
    }
    given: dict[str, Any] = {}
    classes = _vllm_layers(given)
    with stubbed_packages(ROOTS, real, given):
        m = importlib.import_module("vllm_ascend.quantization.configs.modelopt_mxfp8_config")
        # vLLM 0.30's MoE layer: is_fused_moe_layer asks for RoutedExperts / MoERunner
        classes["FusedMoE"] = classes["RoutedExperts"]
        yield SimpleNamespace(
            config=m.AscendModelOptMxFp8Config,
            classes=classes,
            utils=importlib.import_module("vllm.model_executor.models.utils"),
            vllm=vllm,
        )


@contextmanager
def _modelslim_0_23(model_type: str) -> Iterator[SimpleNamespace]:
    """vllm-ascend 0.23.0.post1's ModelSlim config and MXFP8 schemes, and vLLM 0.23.0's
    ``models/utils.py``, under a current vLLM config of ``model_type``."""
    va = sources.vllm_ascend_sdist("0.23.0.post1")
    vllm = sources.vllm_wheel("0.23.0")
    q = "vllm_ascend.quantization"
    real = {
        **_real(
            va,
            [
                f"{q}.modelslim_config",
                f"{q}.utils",
                f"{q}.quant_type",
                f"{q}.methods",
                f"{q}.methods.base",
                f"{q}.methods.registry",
                f"{q}.methods.w8a8_mxfp8",
            ],
        ),
        **_real(vllm, ["vllm.model_executor.models.utils"]),
    }
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)),
        quant_config=SimpleNamespace(quant_description={"group_size": 32}),
        compilation_config=SimpleNamespace(mode=0),
        use_v2_model_runner=False,
    )
    given: dict[str, Any] = {
        "vllm.config": Stub(
            "vllm.config",
            Path("/nonexistent"),
            get_current_vllm_config=lambda: vllm_config,
            get_current_vllm_config_or_none=lambda: vllm_config,
        ),
        "vllm_ascend.utils": Stub(
            "vllm_ascend.utils",
            ASCEND_QUANTIZATION_METHOD="ascend",
            vllm_version_is=lambda v: v == "0.23.0",
        ),
        "vllm.logger": Stub("vllm.logger", logger=sources.QuietLogger()),
    }
    classes = _vllm_layers(given)
    with stubbed_packages(ROOTS, real, given):
        yield SimpleNamespace(
            ms=importlib.import_module(f"{q}.modelslim_config"),
            mx=importlib.import_module(f"{q}.methods.w8a8_mxfp8"),
            classes=classes,
            utils=importlib.import_module("vllm.model_executor.models.utils"),
            vllm=vllm,
        )


def test_modelopt_output_through_vllm_ascend_0_30(outputs: dict[str, str]) -> None:
    with open(os.path.join(outputs["modelopt"], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    with _modelopt_0_30() as eng:

        def dispatch(config: dict[str, Any]) -> dict[str, str]:
            cfg = eng.config.from_config(config)
            return {
                prefix: type(cfg.get_quant_method(_layer(eng.classes, kind), prefix)).__name__
                for prefix, kind, _ in LAYERS
            }

        got = dispatch(qc)
        # What convert wrote under the key vLLM reads in config.json ("exclude_modules"
        # in this flat form is not read: everything would be quantized).
        old = {k: v for k, v in qc.items() if k != "ignore"} | {"exclude_modules": qc["ignore"]}
        before = dispatch(old)
    assert got == WANT
    # Under "exclude_modules" the engine gives lm_head and the router MXFP8 methods, whose
    # FP8 weight and scale do not fit the checkpoint's BF16 tensors.
    assert before["lm_head"] == before["model.layers.1.mlp.gate"] == "AscendLinearMethod"


def test_ascend_output_through_vllm_ascend_0_23(outputs: dict[str, str]) -> None:
    with _modelslim_0_23("qwen3_moe") as eng:
        ms = eng.ms
        cfg = ms.AscendModelSlimConfig()
        cfg.maybe_update_config(outputs["ascend"])
        assert cfg.quant_description["group_size"] == 32
        methods = {
            prefix: type(cfg.get_quant_method(_layer(eng.classes, kind), prefix)).__name__
            for prefix, kind, _ in LAYERS
        }
        mapping = ms.get_packed_modules_mapping("qwen3_moe")
        schemes = {
            prefix: type(
                ms.create_scheme_for_layer(
                    cfg.quant_description,
                    prefix,
                    "moe" if kind == "FusedMoE" else "linear",
                    mapping,
                )
            )
            for prefix, kind, kept in LAYERS
            if not kept
        }
        mx = eng.mx
    assert methods == WANT
    assert schemes["model.layers.0.self_attn.qkv_proj"] is mx.AscendW8A8MXFP8DynamicLinearMethod
    assert schemes["model.layers.1.mlp.experts"] is mx.AscendW8A8MXFP8DynamicFusedMoEMethod


# --- the Qwen3.5 and DeepSeek-V3 families through vllm-ascend 0.23's ModelSlim dispatch ------

FAMILIES = {
    # preset: (hf model_type, vLLM's model class: file and name, its bases' first)
    "qwen3.5-tiny": (
        "qwen3_5",
        [("qwen3_vl.py", "Qwen3VLForConditionalGeneration"), ("qwen3_5.py", "Qwen3_5ForConditionalGeneration")],
    ),
    "qwen3.5-moe-tiny": (
        "qwen3_5_moe",
        [
            ("qwen3_vl.py", "Qwen3VLForConditionalGeneration"),
            ("qwen3_5.py", "Qwen3_5ForConditionalGeneration"),
            ("qwen3_5.py", "Qwen3_5MoeForConditionalGeneration"),
        ],
    ),
    "deepseek-v3-tiny": ("deepseek_v3", [("deepseek_v2.py", "DeepseekV2ForCausalLM")]),
}  # fmt: skip

# DeepseekV2ForCausalLM.__init__ adds this entry when q_lora_rank is set (DeepSeek-V3's is):
# code in a constructor, not a class attribute, so it is the one fact written here.
_INIT_PACKED = {"deepseek_v3": {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}}


def _model_class_attrs(vllm_root: Path, chain: list[tuple[str, str]], weights_mapper: type) -> Any:
    """``hf_to_vllm_mapper`` and ``packed_modules_mapping`` of the last class of ``chain``:
    the assignments of each class body, run as vLLM wrote them (``Base.attr | {...}``),
    each class seeing its bases' values; a class without one inherits its base's."""
    import ast

    attrs: dict[str, Any] = {"hf_to_vllm_mapper": None, "packed_modules_mapping": {}}
    ns: dict[str, Any] = {"WeightsMapper": weights_mapper}
    for file, cls in chain:
        tree = ast.parse((vllm_root / "vllm" / "model_executor" / "models" / file).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        for stmt in node.body:
            target = (
                stmt.targets[0]
                if isinstance(stmt, ast.Assign)
                else stmt.target
                if isinstance(stmt, ast.AnnAssign)
                else None
            )
            if isinstance(target, ast.Name) and target.id in attrs and stmt.value is not None:
                expr = ast.Expression(stmt.value)
                attrs[target.id] = eval(compile(expr, f"<vllm {file}:{cls}>", "eval"), ns)
        ns[cls] = SimpleNamespace(**attrs)
    return SimpleNamespace(**attrs)


def _layers_of(names: list[str]) -> list[tuple[str, str, bool]]:
    """(vLLM layer prefix, layer class, held MX by mxload) for every quantizable layer among
    a rank's buffers: linears, embeddings and the fused MoE. Norms, ``A_log``/``dt_bias``,
    the vision tower's patch conv and position embedding are not layers vLLM gives a
    quantization method (plain parameters, ``Conv3d``, ``nn.Embedding``)."""
    out = []
    held = set(names)
    for name in names:
        if name.endswith(".w13_weight"):
            prefix = name.removesuffix(".w13_weight")
            out.append((prefix, "FusedMoE", f"{prefix}.w13_weight_scale" in held))
            continue
        if not name.endswith(".weight"):
            continue
        prefix = name.removesuffix(".weight")
        leaf = prefix.rsplit(".", 1)[-1]
        if "norm" in leaf or leaf in ("pos_embed",) or prefix.endswith("patch_embed.proj"):
            continue
        kind = (
            "ParallelLMHead"
            if leaf == "lm_head"
            else "VocabParallelEmbedding"
            if leaf == "embed_tokens"
            else "LinearBase"
        )
        out.append((prefix, kind, f"{prefix}.weight_scale" in held))
    return out


def _want(layers: list[tuple[str, str, bool]]) -> dict[str, str]:
    """The method each layer needs for what mxload holds there (an MXFP8 weight and scale,
    or the model-dtype tensor): the engines' class names, as in ``WANT``."""
    out = {}
    for prefix, kind, mx in layers:
        if kind == "FusedMoE":
            out[prefix] = "AscendFusedMoEMethod" if mx else "AscendUnquantizedFusedMoEMethod"
        elif kind == "LinearBase":
            out[prefix] = "AscendLinearMethod" if mx else "AscendUnquantizedLinearMethod"
        else:
            out[prefix] = "AscendLinearMethod" if mx else "UnquantizedEmbeddingMethod"
    return out


def _family(
    preset: str, fmt: str, engine: str, ckpt_factory, tmp_path_factory
) -> tuple[str, list, str]:
    """(hf model_type, the layers of one tp 1 rank with mxload's MX decision for ``engine``,
    convert's DST for that engine: DeepSeek's kv_b_proj stays in the model dtype for
    vllm-ascend, whose MLA asserts it unquantized)."""
    from mxload import ParallelLayout, build_plan

    src = ckpt_factory(preset, seed=1)
    out = str(tmp_path_factory.mktemp(f"convert-{fmt}-{preset}"))
    convert_checkpoint(src, out, fmt=fmt, engine=engine)
    config = open_checkpoint(src).config
    plan = build_plan(config, ParallelLayout(), engine=engine)
    layers = _layers_of([b.name for b in plan.ranks[0].buffers])
    assert {k for _, k, _ in layers} >= {"LinearBase", "VocabParallelEmbedding", "ParallelLMHead"}
    assert any(mx for _, _, mx in layers) and any(not mx for _, _, mx in layers)
    return FAMILIES[preset][0], layers, out


def _dispatch(cfg: Any, model: Any, classes: dict[str, type], layers: list) -> dict[str, str]:
    """What vLLM's loader does before building the model (``configure_quant_config``:
    the model's mapper over the kept modules), then the method each layer gets."""
    if model.hf_to_vllm_mapper is not None:
        cfg.apply_vllm_mapper(model.hf_to_vllm_mapper)
    return {
        prefix: type(cfg.get_quant_method(_layer(classes, kind), prefix)).__name__
        for prefix, kind, _ in layers
    }


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_family_modelopt_output_through_vllm_ascend_0_30(
    preset: str, ckpt_factory, tmp_path_factory
) -> None:
    model_type, layers, out = _family(
        preset, "modelopt", "vllm-ascend-0.30.0rc2", ckpt_factory, tmp_path_factory
    )
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    with _modelopt_0_30() as eng:
        model = _model_class_attrs(eng.vllm, FAMILIES[preset][1], eng.utils.WeightsMapper)
        cfg = eng.config.from_config(qc)
        # The model's packed modules, as vLLM's loader sets them.
        cfg.packed_modules_mapping = model.packed_modules_mapping | _INIT_PACKED.get(model_type, {})
        got = _dispatch(cfg, model, eng.classes, layers)
    assert got == _want(layers)


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_family_ascend_output_through_vllm_ascend_0_23(
    preset: str, ckpt_factory, tmp_path_factory
) -> None:
    model_type, layers, out = _family(
        preset, "ascend", "vllm-ascend-0.23.0.post1", ckpt_factory, tmp_path_factory
    )
    with _modelslim_0_23(model_type) as eng:
        model = _model_class_attrs(eng.vllm, FAMILIES[preset][1], eng.utils.WeightsMapper)
        cfg = eng.ms.AscendModelSlimConfig()
        cfg.maybe_update_config(out)
        # The packed modules are vllm-ascend's own table for the model type.
        got = _dispatch(cfg, model, eng.classes, layers)
    assert got == _want(layers)
