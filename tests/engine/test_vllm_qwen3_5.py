"""mxload's Qwen3.5 sharding against vLLM 0.23.0's own Qwen3.5 loading code, on CPU.

vllm-ascend 0.23.0.post1 builds on vLLM 0.23.0, whose ``models/qwen3_5.py`` (with
``qwen3_next.py`` and ``layers/mamba/gdn/qwen_gdn_linear_attn.py``) loads Qwen3.5. The wheel
is downloaded with ``pip download --no-deps`` into the test cache (skipped, with the reason,
when the index cannot be reached); nothing of it is copied into the project.

Why not import ``vllm.model_executor.models.qwen3_5`` whole: the module imports vLLM's
config, distributed, compilation, platform and triton layers and their dependencies
(pydantic, msgspec, triton, vLLM's compiled ``_C``), none of which a ``--no-deps``
download brings and none of which install on this CPU-only image within the test's budget.
So the test takes the functions that decide the layout out of vLLM's own files by name
(``ast``) and runs them, unmodified, with the names they reach stubbed (listed in
``_STUBS`` of tests/engine/vllm_code.py):

* ``Qwen3_5Model.load_weights`` (qwen3_5.py): which checkpoint tensor goes to which
  parameter with which shard id (``in_proj_qkv`` -> ``in_proj_qkvz`` shards (0, 1, 2),
  ``in_proj_b``/``in_proj_a`` -> ``in_proj_ba`` 0/1, q/k/v, gate/up);
* the weight loaders it calls: ``MergedColumnParallelLinear.weight_loader`` and
  ``validate_shard_id``, ``QKVParallelLinear.weight_loader``,
  ``RowParallelLinear.weight_loader``, ``ColumnParallelLinear.weight_loader``
  (linear.py), ``mamba_v2_sharded_weight_loader`` (conv1d, mamba_mixer2.py),
  ``sharded_weight_loader`` / ``default_weight_loader`` (A_log, dt_bias, norms;
  weight_utils.py), ``VocabParallelEmbedding.weight_loader`` with ``_get_indices`` and the
  vocab helpers (vocab_parallel_embedding.py);
* ``QwenGatedDeltaNetAttention.create_qkvz_proj`` / ``create_ba_proj``: the output sizes of
  the merged GDN projections, as the layer asks for them;
* the checkpoint -> engine name mapping: ``hf_to_vllm_mapper`` of qwen3_vl.py, read as data.

Reproduced here (each from the vLLM constructor named beside it): the parameters' shapes
and dtypes (``A_log`` float32, the rest the model dtype; the loaders' shape asserts check
every shard against them), the QKV head bookkeeping of ``QKVParallelLinear.__init__``, and
the routing of ``AutoWeightsLoader`` (``language_model.model.*`` to the model,
``language_model.lm_head`` to the head, ``visual.*`` to the vision tower, ``mtp.*``
skipped).

The vision tower (built by default, as vLLM does) runs ``Qwen3_VisionTransformer.load_weights``
(qwen3_vl.py) with the same linear loaders (``attn.qkv`` through
``QKVParallelLinear.weight_loader`` with no shard id: the fused q/k/v split by it); its
parameters' shapes are reproduced from ``Qwen3_VisionTransformer.__init__`` and the layers
it builds (``vision_params``).

Each rank's parameters after vLLM's loaders must equal, byte for byte, the buffers mxload
loads for that rank (names, shapes, dtypes, bytes), for tp 1, 2 and 4, from the BF16 twin
of the ``qwen3.5-tiny`` preset (BF16 because vLLM's block-FP8 loaders require shards
aligned to 128-row tiles, which a tiny model does not have at tp 2 and 4). The MX path is
the same rectangles (the planner's parts), checked for the block-FP8 checkpoint by the
load tests.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout, Plan
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.reload import reload_inputs
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import RankLoader
from mxload.workers.tools.synth import make_checkpoint, preset_config
from safetensors.torch import load_file

from tests.engine import sources
from tests.engine.vllm_code import _exec, _namespace, _node, _parsed, _Stub
from tests.independent_ref import mx_quantize_ref, same_e4m3_bytes

PIN = "0.23.0"
FILES = {
    "qwen3_5": "vllm/model_executor/models/qwen3_5.py",
    "qwen3_vl": "vllm/model_executor/models/qwen3_vl.py",  # mapper, vision tower
    "gdn": "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
    "linear": "vllm/model_executor/layers/linear.py",
    "mamba2": "vllm/model_executor/layers/mamba/mamba_mixer2.py",
    "wutils": "vllm/model_executor/model_loader/weight_utils.py",
    "vocab": "vllm/model_executor/layers/vocab_parallel_embedding.py",
    "dutils": "vllm/distributed/utils.py",
    "moe": "vllm/model_executor/layers/fused_moe/layer.py",
    "expert_map": "vllm/model_executor/layers/fused_moe/expert_map_manager.py",
    "eplb": "vllm/distributed/eplb/eplb_state.py",
    "deepseek": "vllm/model_executor/models/deepseek_v2.py",
}


@pytest.fixture(scope="module")
def vllm_src() -> Path:
    """The pinned wheel's Python files, unpacked once into the cache (tests/engine/sources.py)."""
    src = sources.vllm_wheel(PIN)
    assert all((src / f).is_file() for f in FILES.values())
    return src


# --- taking vLLM's functions out of its files ---------------------------------------------------


@functools.cache
def _source(src: Path, key: str, *path: str) -> str:
    """The source of ``path`` (a top-level def/class, or Class.method) in vLLM's file
    ``key``, dedented; a function's decorators dropped (methods are called with ``self``/``cls``
    given), a class's kept."""
    text, tree = _parsed(src / FILES[key])
    node = _node(tree, path)
    assert isinstance(node, ast.FunctionDef | ast.ClassDef)
    start = node.lineno
    if isinstance(node, ast.ClassDef) and node.decorator_list:  # keep @dataclass
        start = min(d.lineno for d in node.decorator_list)
    lines = text.splitlines()[start - 1 : node.end_lineno]
    return textwrap.dedent("\n".join(lines))


_STATIC = {
    "_get_hidden_dim",
    "_narrow_expert_data_for_padding",
    "build_initial_global_physical_to_logical_map",
}
"""Methods vLLM declares ``@staticmethod``."""


@dataclass
class _Vllm:
    """vLLM's functions for one tp rank."""

    src: Path
    tp: int
    rank: int
    pp: int = 1
    pp_rank: int = 0
    moe_tp: int = 1
    """FusedMoE's tp: dp*tp without expert parallel, 1 with it."""
    moe_tp_rank: int = 0
    ep: int = 1
    """FusedMoE's ep: dp*tp with expert parallel, 1 without."""
    ep_rank: int = 0
    language_model_only: bool = False
    """vLLM's --language-model-only: the vision tower is not built."""

    def __post_init__(self) -> None:
        ns = self.ns = _namespace(self.rank)
        _, vocab_tree = _parsed(self.src / FILES["vocab"])
        ns["DEFAULT_VOCAB_PADDING_SIZE"] = next(
            ast.literal_eval(n.value)
            for n in vocab_tree.body
            if isinstance(n, ast.Assign)
            and getattr(n.targets[0], "id", "") == "DEFAULT_VOCAB_PADDING_SIZE"
        )
        for key, name in (
            ("dutils", "ensure_divisibility"),
            ("dutils", "divide"),
            ("dutils", "get_pp_indices"),
            ("vocab", "pad_vocab_size"),
            ("vocab", "vocab_range_from_per_partition_vocab_size"),
            ("vocab", "vocab_range_from_global_vocab_size"),
            ("vocab", "VocabParallelEmbeddingShardIndices"),
            ("wutils", "default_weight_loader"),
            ("wutils", "sharded_weight_loader"),
            ("mamba2", "mamba_v2_sharded_weight_loader"),
            ("expert_map", "determine_expert_map"),
        ):
            _exec(ns, _source(self.src, key, name), name)
        self.merged = self._layer_cls(
            [
                ("linear", "MergedColumnParallelLinear", "validate_shard_id"),
                ("linear", "MergedColumnParallelLinear", "weight_loader"),
            ]
        )
        self.qkv = self._layer_cls(
            [
                ("linear", "QKVParallelLinear", "validate_shard_id"),
                ("linear", "QKVParallelLinear", "weight_loader"),
            ]
        )
        self.row = self._layer_cls([("linear", "RowParallelLinear", "weight_loader")])
        self.column = self._layer_cls([("linear", "ColumnParallelLinear", "weight_loader")])
        self.replicated = self._layer_cls([("linear", "ReplicatedLinear", "weight_loader")])
        self.fused_moe = self._layer_cls(
            [
                ("moe", "FusedMoE", m)
                for m in (
                    "weight_loader",
                    "_load_w13",
                    "_load_w2",
                    "_get_hidden_dim",
                    "_narrow_expert_data_for_padding",
                    "_map_global_expert_id_to_local_expert_id",
                    "_load_model_weight_or_group_weight_scale",
                    "make_expert_params_mapping",
                )
            ]
        )
        self.expert_map = self._layer_cls(
            [("expert_map", "ExpertMapManager", "map_global_to_local")]
        )
        eplb = self._layer_cls(
            [("eplb", "EplbState", "build_initial_global_physical_to_logical_map")]
        )
        ns["EplbState"] = types.SimpleNamespace(
            build_initial_global_physical_to_logical_map=eplb.build_initial_global_physical_to_logical_map
        )
        self.vocab = self._layer_cls(
            [
                ("vocab", "VocabParallelEmbedding", "weight_loader"),
                ("vocab", "VocabParallelEmbedding", "_get_indices"),
            ]
        )
        self.gdn = self._layer_cls(
            [
                ("gdn", "QwenGatedDeltaNetAttention", m)
                for m in ("create_qkvz_proj", "create_ba_proj", "maybe_disable_tp")
            ]
        )
        self.load_weights = _exec(
            ns, _source(self.src, "qwen3_5", "Qwen3_5Model", "load_weights"), "load_weights"
        )
        self.vision_load_weights = _exec(
            ns,
            _source(self.src, "qwen3_vl", "Qwen3_VisionTransformer", "load_weights"),
            "load_weights",
        )
        mapper = ast.parse(_source(self.src, "qwen3_vl", "Qwen3VLForConditionalGeneration"))
        call = next(
            n.value
            for n in ast.walk(mapper)
            if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "hf_to_vllm_mapper" for t in n.targets)
        )
        assert isinstance(call, ast.Call)
        self.prefixes: dict[str, str] = ast.literal_eval(call.keywords[0].value)

    def _layer_cls(self, methods: list[tuple[str, str, str]]) -> type:
        body: dict[str, Any] = {}
        for key, cls, meth in methods:
            fn = _exec(self.ns, _source(self.src, key, cls, meth), meth)
            # vLLM's @staticmethods take no self (their decorators are dropped above)
            body[meth] = staticmethod(fn) if meth in _STATIC else fn
        return type(methods[0][1], (), body)

    def layer(self, cls: type, **attrs: Any) -> Any:
        obj = cls()
        obj.tp_size, obj.tp_rank = self.tp, self.rank
        obj.__dict__.update(attrs)
        return obj


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader: Any, **attrs: Any) -> Any:
    p = torch.nn.Parameter(torch.full(shape, float("nan")).to(dtype), requires_grad=False)
    p.weight_loader = loader
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def vllm_params(v: _Vllm, cfg: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every parameter of one rank, built as vLLM's layers build them and filled by
    vLLM's own ``load_weights`` and weight loaders. Names are the engine's."""
    t = cfg["text_config"]
    tp = v.tp
    dt = torch.bfloat16
    h, nk, nv = t["hidden_size"], t["linear_num_key_heads"], t["linear_num_value_heads"]
    key, value = nk * t["linear_key_head_dim"], nv * t["linear_value_head_dim"]
    heads, kvh, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]

    captured: dict[str, list[int]] = {}

    def merged_factory(**kw: Any) -> Any:  # what the GDN layer asks MergedColumnParallel for
        captured[kw["prefix"]] = list(kw["output_sizes"])
        return kw["prefix"]

    v.ns["MergedColumnParallelLinear"] = merged_factory
    v.ns["current_platform"] = types.SimpleNamespace(is_cuda=lambda: False)
    v.ns["AWQMarlinConfig"] = v.ns["AutoGPTQConfig"] = v.ns["INCConfig"] = _Stub
    gdn = v.layer(v.gdn, gqa_interleaved_layout=False)
    gdn.create_qkvz_proj(h, key, value, None, "qkvz")
    gdn.create_ba_proj(h, nv, None, "ba")
    qkvz_sizes, ba_sizes = captured["qkvz"], captured["ba"]

    def merged(sizes: list[int]) -> Any:
        layer = v.layer(v.merged, output_sizes=sizes)
        return _param((sum(sizes) // tp, h), dt, layer.weight_loader, output_dim=0)

    def row(k: int) -> Any:
        layer = v.layer(v.row)
        return _param((h, k // tp), dt, layer.weight_loader, input_dim=1)

    def plain(shape: tuple[int, ...], dtype: torch.dtype = dt) -> Any:
        return _param(shape, dtype, v.ns["default_weight_loader"])

    # QKVParallelLinear.__init__ (linear.py): heads * (1 + attn_output_gate) "heads"
    total_q = heads * (1 + bool(t.get("attn_output_gate", True)))
    qkv = v.layer(
        v.qkv,
        total_num_heads=total_q,
        total_num_kv_heads=kvh,
        head_size=hd,
        v_head_size=hd,
        num_heads=total_q // tp,
        num_kv_heads=max(1, kvh // tp) if kvh >= tp else 1,
        num_kv_head_replicas=max(1, tp // kvh),
    )
    params: dict[str, Any] = {}
    # make_layers (models/utils.py): this stage's layers from get_pp_indices
    start, end = v.ns["get_pp_indices"](len(t["layer_types"]), v.pp_rank, v.pp)
    last = v.pp_rank == v.pp - 1
    for i, kind in enumerate(t["layer_types"]):
        if not start <= i < end:
            continue
        p = f"layers.{i}"
        params[f"{p}.input_layernorm.weight"] = plain((h,))
        params[f"{p}.post_attention_layernorm.weight"] = plain((h,))
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            params[f"{a}.in_proj_qkvz.weight"] = merged(qkvz_sizes)
            params[f"{a}.in_proj_ba.weight"] = merged(ba_sizes)
            conv_loader = v.ns["mamba_v2_sharded_weight_loader"](
                [(key, 0, False), (key, 0, False), (value, 0, False)], tp, v.rank
            )
            conv_dim = 2 * key + value
            params[f"{a}.conv1d.weight"] = _param(
                (conv_dim // tp, 1, t["linear_conv_kernel_dim"]), dt, conv_loader
            )
            shard0 = v.ns["sharded_weight_loader"](0)
            params[f"{a}.dt_bias"] = _param((nv // tp,), dt, shard0)
            params[f"{a}.A_log"] = _param((nv // tp,), torch.float32, shard0)
            params[f"{a}.norm.weight"] = plain((t["linear_value_head_dim"],))
            params[f"{a}.out_proj.weight"] = row(value)
        else:
            a = f"{p}.self_attn"
            rows = (qkv.num_heads + 2 * qkv.num_kv_heads) * hd
            params[f"{a}.qkv_proj.weight"] = _param((rows, h), dt, qkv.weight_loader, output_dim=0)
            params[f"{a}.q_norm.weight"] = plain((hd,))
            params[f"{a}.k_norm.weight"] = plain((hd,))
            params[f"{a}.o_proj.weight"] = row(heads * hd)
        if "num_experts" not in t:
            inter = t["intermediate_size"]
            params[f"{p}.mlp.gate_up_proj.weight"] = merged([inter, inter])
            params[f"{p}.mlp.down_proj.weight"] = row(inter)
            continue
        # Qwen3NextSparseMoeBlock (qwen3_next.py): gate and shared_expert_gate
        # ReplicatedLinear (quant_config=None), shared_expert a Qwen2MoeMLP, experts FusedMoE
        rep = v.layer(v.replicated).weight_loader
        params[f"{p}.mlp.gate.weight"] = _param((t["num_experts"], h), dt, rep)
        params[f"{p}.mlp.shared_expert_gate.weight"] = _param((1, h), dt, rep)
        si = t["shared_expert_intermediate_size"]
        params[f"{p}.mlp.shared_expert.gate_up_proj.weight"] = merged([si, si])
        params[f"{p}.mlp.shared_expert.down_proj.weight"] = row(si)
        n_local, expert_map, _ = v.ns["determine_expert_map"](v.ep, v.ep_rank, t["num_experts"])
        manager = v.layer(v.expert_map, _expert_map=expert_map)
        moe = v.layer(
            v.fused_moe,
            tp_size=v.moe_tp,
            tp_rank=v.moe_tp_rank,
            quant_config=None,
            quant_method=type("UnquantizedFusedMoEMethod", (), {})(),
            expert_map_manager=manager,
            moe_config=types.SimpleNamespace(
                is_act_and_mul=True,
                moe_parallel_config=types.SimpleNamespace(tp_size=v.moe_tp),
            ),
        )
        mi = t["moe_intermediate_size"] // v.moe_tp  # UnquantizedFusedMoEMethod.create_weights
        params[f"{p}.mlp.experts.w13_weight"] = _param((n_local, 2 * mi, h), dt, moe.weight_loader)
        params[f"{p}.mlp.experts.w2_weight"] = _param((n_local, h, mi), dt, moe.weight_loader)
        expert_mapping = v.fused_moe.make_expert_params_mapping(
            None,
            types.SimpleNamespace(named_parameters=lambda: list(params.items())),
            "gate_proj",
            "down_proj",
            "up_proj",
            t["num_experts"],
        )
    if last:  # Qwen3_5Model: norm on the last stage only; embed_tokens on every stage
        params["norm.weight"] = plain((h,))

    vocab = t["vocab_size"]
    padded = v.ns["pad_vocab_size"](vocab)
    indices = v.vocab._get_indices(v.vocab, padded, padded, vocab, vocab, v.rank, tp)
    emb = v.layer(v.vocab, shard_indices=indices, org_vocab_size=vocab)
    params["embed_tokens.weight"] = _param((padded // tp, h), dt, emb.weight_loader, output_dim=0)
    head = _param((padded // tp, h), dt, emb.weight_loader, output_dim=0)

    if "num_experts" not in t:
        expert_mapping = []
    model = types.SimpleNamespace(
        params=params,
        named_parameters=lambda: list(params.items()),
        get_expert_mapping=lambda: expert_mapping,
        config=types.SimpleNamespace(
            **({"num_experts": t["num_experts"]} if "num_experts" in t else {})
        ),
    )
    # AutoWeightsLoader with hf_to_vllm_mapper: rename by prefix, skip mtp.* (skip_prefixes);
    # route visual.* to the vision tower's load_weights (when built), language_model.model.*
    # to the model's load_weights and language_model.lm_head to the head.
    to_model: list[tuple[str, torch.Tensor]] = []
    to_visual: list[tuple[str, torch.Tensor]] = []
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue
        for old, new in v.prefixes.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if name.startswith("visual."):
            to_visual.append((name[len("visual.") :], w))
            continue
        if name.startswith("language_model.model."):
            to_model.append((name[len("language_model.model.") :], w))
        else:
            assert name == "language_model.lm_head.weight", name
            if last:  # the lm_head is a PPMissingLayer before the last stage
                head.weight_loader(head, w)
    loaded = v.load_weights(model, to_model)
    assert set(params) <= loaded, set(params) - loaded
    out = {f"language_model.model.{k}": p for k, p in params.items()}
    if "vision_config" in cfg and not v.language_model_only:
        out.update(vision_params(v, cfg["vision_config"], to_visual))
    if last:
        out["language_model.lm_head.weight"] = head
    return out


def vision_params(
    v: _Vllm, vc: dict[str, Any], weights: list[tuple[str, torch.Tensor]]
) -> dict[str, Any]:
    """The vision tower's parameters on one rank, as ``Qwen3_VisionTransformer.__init__``
    (qwen3_vl.py, mm_encoder_tp_mode "weights") builds them, filled by its own
    ``load_weights`` and the linear layers' loaders. Names are the engine's (``visual.*``)."""
    tp, dt = v.tp, torch.bfloat16
    vh, nh, inter = vc["hidden_size"], vc["num_heads"], vc["intermediate_size"]
    m = vh * vc["spatial_merge_size"] ** 2
    out_h = vc["out_hidden_size"]
    hd = vh // nh
    default = v.ns["default_weight_loader"]

    def plain(*shape: int) -> Any:  # LayerNorm, Conv3dLayer, nn.Embedding: no weight_loader
        return _param(shape, dt, default)

    def column(p: dict[str, Any], name: str, n: int, k: int) -> None:
        loader = v.layer(v.column).weight_loader
        p[f"{name}.weight"] = _param((n // tp, k), dt, loader, output_dim=0)
        p[f"{name}.bias"] = _param((n // tp,), dt, loader, output_dim=0)

    def row(p: dict[str, Any], name: str, n: int, k: int) -> None:
        loader = v.layer(v.row).weight_loader
        p[f"{name}.weight"] = _param((n, k // tp), dt, loader, input_dim=1)
        p[f"{name}.bias"] = _param((n,), dt, loader, output_dim=0)

    p: dict[str, Any] = {
        "patch_embed.proj.weight": plain(
            vh, vc["in_channels"], vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"]
        ),
        "patch_embed.proj.bias": plain(vh),
        "pos_embed.weight": plain(vc["num_position_embeddings"], vh),
        "merger.norm.weight": plain(vh),
        "merger.norm.bias": plain(vh),
    }
    column(p, "merger.linear_fc1", m, m)
    row(p, "merger.linear_fc2", out_h, m)
    # Qwen2_5_VisionAttention: QKVParallelLinear(total_num_heads = total_num_kv_heads = nh)
    qkv = v.layer(
        v.qkv,
        total_num_heads=nh,
        total_num_kv_heads=nh,
        head_size=hd,
        v_head_size=hd,
        num_heads=nh // tp,
        num_kv_heads=nh // tp,
        num_kv_head_replicas=1,
    )
    for b in range(vc["depth"]):
        q = f"blocks.{b}"
        for norm in ("norm1", "norm2"):
            p[f"{q}.{norm}.weight"], p[f"{q}.{norm}.bias"] = plain(vh), plain(vh)
        rows = 3 * (nh // tp) * hd
        p[f"{q}.attn.qkv.weight"] = _param((rows, vh), dt, qkv.weight_loader, output_dim=0)
        p[f"{q}.attn.qkv.bias"] = _param((rows,), dt, qkv.weight_loader, output_dim=0)
        row(p, f"{q}.attn.proj", vh, vh)
        column(p, f"{q}.mlp.linear_fc1", inter, vh)
        row(p, f"{q}.mlp.linear_fc2", vh, inter)
    tower = types.SimpleNamespace(named_parameters=lambda remove_duplicate=True: list(p.items()))
    loaded = v.vision_load_weights(tower, weights)
    assert loaded == set(p), set(p) ^ loaded
    return {f"visual.{k}": t for k, t in p.items()}


ENGINE = "vllm-ascend-0.23"
LAYOUTS = {
    "tp1": ParallelLayout(tp=1),
    "tp4": ParallelLayout(tp=4),
    # tp 2: every layer's tp-2 shards, on two pipeline stages
    "tp2-pp2": ParallelLayout(tp=2, pp=2),
}


def mxload_ranks(held: Plan, src: str) -> list[dict[str, torch.Tensor]]:
    """Every rank's buffers of the plan ``held`` (of the block-FP8 checkpoint: MX units
    where the weights are quantized) loaded from ``src`` (its BF16 twin), as a reload into
    that session does."""
    inp = reload_inputs(held, src)
    out = []
    for rank, rp in enumerate(held.ranks):
        loader = RankLoader(rp, model_dtype="bf16", backend=select_backend("cpu", prefer_fast=True))
        loader.load(
            list(inp.reads[rank]),
            inp.source,
            version=1,
            staging_budget=inp.budgets[rank],
            units=list(inp.units[rank]),
        )
        out.append(dict(loader.buffers))
    return out


_MX_SEEN: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
"""expected_mx by value: ranks that hold the same slice (dp replicas) convert it once."""


def expected_mx(value: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    key = hashlib.sha256(value.contiguous().view(torch.uint8).numpy().tobytes()).digest()
    if key not in _MX_SEEN:
        _MX_SEEN[key] = _expected_mx(value)
    return _MX_SEEN[key]


def _expected_mx(value: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """docs/contract.md §2.3 kernel layout of the independent reference's MX conversion of
    an engine value ``[N, K]``: payload ``[K, N]``, scales ``[ceil(g/2), N, 2]`` (odd g's
    last pair padded with 0)."""
    payload, scale = mx_quantize_ref(value.to(torch.float64).numpy())
    n, g = scale.shape
    paired = np.zeros((-(-g // 2), n, 2), dtype=np.uint8)
    for j in range(g):
        paired[j // 2, :, j % 2] = scale[:, j]
    return payload.T, paired


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Per preset: its block-FP8 checkpoint and its BF16 twin (the same values resolved)."""
    out = {}
    for preset in ("qwen3.5-tiny", "qwen3.5-moe-tiny"):
        root = tmp_path_factory.mktemp(preset)
        fp8, bf16 = str(root / "fp8"), str(root / "bf16")
        make_checkpoint(fp8, preset, seed=3)
        make_checkpoint(bf16, preset, seed=3, bf16=True)
        out[preset] = (fp8, bf16)
    return out


def _mx_of(engine_value: torch.Tensor, held: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    want_w, want_s = expected_mx(engine_value)
    assert same_e4m3_bytes(held.view(torch.uint8).numpy(), want_w).all(), what
    assert np.array_equal(scale.numpy(), want_s), what


def check_against_vllm(
    src: Path,
    preset: str,
    ckpts: tuple[str, str],
    layout: ParallelLayout,
    engine: str,
    params_of: Callable[[_Vllm, dict[str, Any], dict[str, torch.Tensor]], dict[str, Any]]
    | None = None,
) -> int:
    """Every rank of ``layout``: the plain session equals vLLM's parameters byte for byte;
    the MX session's MX units are the independent reference's MXFP8 of them. Returns how
    many MX buffers were compared."""
    fp8, bf16 = ckpts
    cfg = preset_config(preset)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(bf16).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    plain_meta, mx_meta = open_checkpoint(bf16), open_checkpoint(fp8)
    plain_plan = build_plan(plain_meta.config, layout, checkpoint=plain_meta, engine=engine)
    mx_plan = build_plan(mx_meta.config, layout, checkpoint=mx_meta, engine=engine)
    plain, mx = mxload_ranks(plain_plan, bf16), mxload_ranks(mx_plan, bf16)
    ep = layout.enable_expert_parallel
    group, moe_rank = layout.dp * layout.tp, 0
    n_mx = 0
    for r, rp in enumerate(plain_plan.ranks):
        moe_rank = rp.dp_rank * layout.tp + rp.tp_rank  # vLLM flattens dp x tp for MoE
        v = _Vllm(
            src,
            layout.tp,
            rp.tp_rank,
            layout.pp,
            rp.pp_rank,
            moe_tp=1 if ep else group,
            moe_tp_rank=0 if ep else moe_rank,
            ep=group if ep else 1,
            ep_rank=moe_rank if ep else 0,
            language_model_only=layout.language_model_only,
        )
        engine_params = (params_of or vllm_params)(v, cfg, weights)
        # 1. the plain session: every buffer is the engine's parameter, byte for byte
        assert sorted(plain[r]) == sorted(engine_params), set(plain[r]) ^ set(engine_params)
        for pname, p in engine_params.items():
            b = plain[r][pname]
            assert (tuple(b.shape), b.dtype) == (tuple(p.shape), p.dtype), pname
            assert torch.equal(b.view(torch.uint8), p.data.view(torch.uint8)), (r, pname)
        # 2. the MX session: MX units are the independent reference's MX of the engine's
        #    values (per expert for the MoE); the rest is the engine's bytes
        specs = {b.name: b for b in mx_plan.ranks[r].buffers}
        for pname, p in engine_params.items():
            got, layout_of = mx[r][pname], specs[pname].layout
            if layout_of == "mx_linear":
                _mx_of(p.data, got, mx[r][pname + "_scale"], f"{r} {pname}")
            elif layout_of == "mx_moe":
                for e in range(p.shape[0]):
                    _mx_of(p.data[e], got[e], mx[r][pname + "_scale"][e], f"{r} {pname} {e}")
            else:
                assert torch.equal(got.view(torch.uint8), p.data.view(torch.uint8)), pname
                continue
            n_mx += 1
    return n_mx


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_rank_equals_vllm_0_23_qwen3_5_parameters(
    vllm_src: Path, checkpoints: dict[str, tuple[str, str]], name: str
) -> None:
    # the profile of the engine built on vLLM 0.23 (embed_tokens on every stage)
    n_mx = check_against_vllm(
        vllm_src, "qwen3.5-tiny", checkpoints["qwen3.5-tiny"], LAYOUTS[name], ENGINE
    )
    assert n_mx > 0  # in_proj_qkvz, out_proj, qkv_proj, o_proj, the MLP where K allows


MOE_LAYOUTS = {
    "tp1": ParallelLayout(tp=1),
    "tp4": ParallelLayout(tp=4),
    "tp4-ep": ParallelLayout(tp=4, enable_expert_parallel=True),
    # experts over dp*tp = 4: TP-sharded (I / 4 = 32) or whole (2 per rank)
    "tp2xdp2": ParallelLayout(tp=2, dp=2),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
}


@pytest.mark.parametrize("name", sorted(MOE_LAYOUTS))
def test_every_rank_equals_vllm_0_23_qwen3_5_moe_parameters(
    vllm_src: Path, checkpoints: dict[str, tuple[str, str]], name: str
) -> None:
    # mxload's profile: FusedMoE's parameters as vLLM's loaders leave them, [E, 2I, H] and
    # [E, H, I] (vllm-ascend's post-load re-views them; tests/engine/test_vllm_ascend.py)
    n_mx = check_against_vllm(
        vllm_src,
        "qwen3.5-moe-tiny",
        checkpoints["qwen3.5-moe-tiny"],
        MOE_LAYOUTS[name],
        "mxload",
    )
    assert n_mx > 0
