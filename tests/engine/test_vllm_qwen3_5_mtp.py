"""mxload's Qwen3.5 MTP drafter (``drafter.*``) against vLLM 0.23.0's own MTP loading code.

With ``speculative_config={"method": "mtp", ...}`` vLLM builds ``Qwen3_5MTP`` (or
``Qwen3_5MoeMTP``, models/qwen3_5_mtp.py) from the target's own checkpoint on the last
pipeline stage, with the target's parallel layout, and its proposer then replaces the
drafter's ``embed_tokens`` and ``lm_head`` by the target's (v1/spec_decode/
llm_base_proposer.py ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``); vllm-ascend
0.23.0.post1 keeps the drafter's own ``lm_head`` (the ``vllm-ascend-0.23`` profile).

As in tests/engine/test_vllm_qwen3_5.py (whose helpers this reuses), vLLM's functions are
taken out of its files by name and run unmodified on CPU:

* ``Qwen3_5MTP.load_weights``: its ``remap_weight_names`` (``mtp.`` -> ``model.``, the
  target's ``embed_tokens`` and ``lm_head`` taken too, everything else dropped), run with
  a named stand-in for ``AutoWeightsLoader`` (``_Router``: ``model.*`` to the predictor's
  ``load_weights``, ``lm_head.*`` to the head's ``weight_loader``, as AutoWeightsLoader
  routes a child module with and without its own ``load_weights``);
* ``Qwen3_5MultiTokenPredictor.load_weights`` with ``fused_moe_make_expert_params_mapping``
  (fused_moe/layer.py) over the same ``FusedMoE.make_expert_params_mapping``;
* the layers' weight loaders (column, merged, QKV, row, replicated, FusedMoE, vocab).

Reproduced here from ``Qwen3_5MultiTokenPredictor.__init__`` and the layers it builds: the
drafter's parameters' shapes and dtypes (``fc`` a ColumnParallelLinear [H/tp, 2H], three
Qwen3_5RMSNorms, the full-attention ``Qwen3_5DecoderLayer`` with the model's MLP).

Which of the drafter's rows each engine then replaces by the target's is read by running
the engines' own ``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` (vLLM 0.23.0's
``SpecDecodeBaseProposer``, vllm-ascend 0.23.0.post1's ``AscendSpecDecodeBaseProposer``)
and compared with the profiles' ``drafter_own``.

Each rank's target and drafter parameters after vLLM's loaders must equal, byte for byte,
the buffers mxload loads for that rank, for tp 1, 2 and 4 (and the MoE drafter's experts
under expert parallelism), from the BF16 twin of a ``qwen3.5-tiny`` whose block-FP8
checkpoint quantizes the MTP module too (the releases leave it BF16: ``mtp`` in
modules_to_not_convert), so that the MX session's drafter units are checked against the
independent reference's MXFP8 of vLLM's values. One layout runs the vision tower in
``--mm-encoder-tp-mode data``: every vision linear is built ``disable_tp`` (tp_size 1,
tp_rank 0: layers/linear.py ``LinearBase.__init__``), so each rank's tower is
``vision_params`` of tp 1, filled by the same loaders.
"""

from __future__ import annotations

import ast
import functools
import textwrap
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from mxload.orchestrator.plan.planner import plan_rank
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.workers.tools.synth import make_checkpoint, preset_config

from tests.engine import sources
from tests.engine.test_vllm_qwen3_5 import (
    PIN,
    _param,
    _Vllm,
    check_against_vllm,
    vision_params,
    vllm_params,
)
from tests.engine.vllm_code import _exec, _node, _parsed

MTP_FILE = "vllm/model_executor/models/qwen3_5_mtp.py"
MOE_FILE = "vllm/model_executor/layers/fused_moe/layer.py"


@pytest.fixture(scope="module")
def vllm_src() -> Path:
    src = sources.vllm_wheel(PIN)
    assert (src / MTP_FILE).is_file()
    return src


@functools.cache
def _mtp_source(src: Path, file: str, *path: str) -> str:
    """A def (or Class.method) of vLLM's ``file``, dedented, decorators dropped."""
    text, tree = _parsed(src / file)
    node = _node(tree, path)
    assert isinstance(node, ast.FunctionDef)
    return textwrap.dedent("\n".join(text.splitlines()[node.lineno - 1 : node.end_lineno]))


class _Router:
    """Named stand-in for vLLM's ``AutoWeightsLoader`` (models/utils.py) over ``Qwen3_5MTP``:
    ``model.*`` goes to the predictor's own ``load_weights`` (prefix stripped), ``lm_head.*``
    to the head's parameter ``weight_loader``; the loaded names come back prefixed."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        to_model: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, w in weights:
            if name.startswith("model."):
                to_model.append((name[len("model.") :], w))
            else:
                head = self.module.lm_head[name[len("lm_head.") :]]
                head.weight_loader(head, w)
                loaded.add(name)
        predictor = self.module.model
        loaded |= {f"model.{n}" for n in predictor.load_weights(predictor, to_model)}
        return loaded


def _layer_params(v: _Vllm, t: dict[str, Any], params: dict[str, Any], p: str) -> None:
    """``Qwen3_5DecoderLayer(layer_type="full_attention")``'s parameters under ``p``:
    Qwen3NextAttention's QKVParallelLinear (the gate doubles the q heads) and row o_proj,
    the norms, and the model's MLP (Qwen3NextMLP, or Qwen3NextSparseMoeBlock)."""
    tp, dt, h = v.tp, torch.bfloat16, t["hidden_size"]
    heads, kvh, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]

    def plain(*shape: int) -> Any:
        return _param(shape, dt, v.ns["default_weight_loader"])

    def merged(sizes: list[int]) -> Any:
        layer = v.layer(v.merged, output_sizes=sizes)
        return _param((sum(sizes) // tp, h), dt, layer.weight_loader, output_dim=0)

    def row(k: int) -> Any:
        return _param((h, k // tp), dt, v.layer(v.row).weight_loader, input_dim=1)

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
    params[f"{p}.input_layernorm.weight"] = plain(h)
    params[f"{p}.post_attention_layernorm.weight"] = plain(h)
    rows = (qkv.num_heads + 2 * qkv.num_kv_heads) * hd
    params[f"{p}.self_attn.qkv_proj.weight"] = _param(
        (rows, h), dt, qkv.weight_loader, output_dim=0
    )
    params[f"{p}.self_attn.q_norm.weight"] = plain(hd)
    params[f"{p}.self_attn.k_norm.weight"] = plain(hd)
    params[f"{p}.self_attn.o_proj.weight"] = row(heads * hd)
    if "num_experts" not in t:
        inter = t["intermediate_size"]
        params[f"{p}.mlp.gate_up_proj.weight"] = merged([inter, inter])
        params[f"{p}.mlp.down_proj.weight"] = row(inter)
        return
    rep = v.layer(v.replicated).weight_loader
    params[f"{p}.mlp.gate.weight"] = _param((t["num_experts"], h), dt, rep)
    params[f"{p}.mlp.shared_expert_gate.weight"] = _param((1, h), dt, rep)
    si = t["shared_expert_intermediate_size"]
    params[f"{p}.mlp.shared_expert.gate_up_proj.weight"] = merged([si, si])
    params[f"{p}.mlp.shared_expert.down_proj.weight"] = row(si)
    n_local, expert_map, _ = v.ns["determine_expert_map"](v.ep, v.ep_rank, t["num_experts"])
    moe = v.layer(
        v.fused_moe,
        tp_size=v.moe_tp,
        tp_rank=v.moe_tp_rank,
        quant_config=None,
        quant_method=type("UnquantizedFusedMoEMethod", (), {})(),
        expert_map_manager=v.layer(v.expert_map, _expert_map=expert_map),
        moe_config=types.SimpleNamespace(
            is_act_and_mul=True, moe_parallel_config=types.SimpleNamespace(tp_size=v.moe_tp)
        ),
    )
    mi = t["moe_intermediate_size"] // v.moe_tp
    params[f"{p}.mlp.experts.w13_weight"] = _param((n_local, 2 * mi, h), dt, moe.weight_loader)
    params[f"{p}.mlp.experts.w2_weight"] = _param((n_local, h, mi), dt, moe.weight_loader)


def drafter_params(
    v: _Vllm, cfg: dict[str, Any], weights: dict[str, torch.Tensor], own_lm_head: bool
) -> dict[str, Any]:
    """The drafter's parameters on one rank after vLLM's ``Qwen3_5MTP.load_weights``,
    named as mxload names them (``drafter.`` + the drafter's own parameter name), its
    lm_head only where the engine keeps it (``own_lm_head``). ``drafter.model.embed_tokens``
    is what the proposer then replaces by the target's."""
    t = cfg["text_config"]
    tp, dt, h = v.tp, torch.bfloat16, t["hidden_size"]
    vocab = t["vocab_size"]
    padded = v.ns["pad_vocab_size"](vocab)
    indices = v.vocab._get_indices(v.vocab, padded, padded, vocab, vocab, v.rank, tp)
    emb = v.layer(v.vocab, shard_indices=indices, org_vocab_size=vocab)
    column = v.layer(v.column)
    params: dict[str, Any] = {
        "embed_tokens.weight": _param((padded // tp, h), dt, emb.weight_loader, output_dim=0),
        "fc.weight": _param((h // tp, 2 * h), dt, column.weight_loader, output_dim=0),
    }
    for j in range(t["mtp_num_hidden_layers"]):
        _layer_params(v, t, params, f"layers.{j}")
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        params[f"{norm}.weight"] = _param((h,), dt, v.ns["default_weight_loader"])
    head = _param((padded // tp, h), dt, emb.weight_loader, output_dim=0)

    # fused_moe_make_expert_params_mapping calls the classmethod on FusedMoE: the test's
    # FusedMoE methods are plain functions taking cls first
    v.ns["FusedMoE"] = types.SimpleNamespace(
        make_expert_params_mapping=functools.partial(v.fused_moe.make_expert_params_mapping, None)
    )
    _exec(
        v.ns,
        _mtp_source(v.src, MOE_FILE, "fused_moe_make_expert_params_mapping"),
        "fused_moe_make_expert_params_mapping",
    )
    v.ns["AutoWeightsLoader"] = _Router
    predictor = types.SimpleNamespace(
        params=params,
        named_parameters=lambda: list(params.items()),
        config=types.SimpleNamespace(
            **({"num_experts": t["num_experts"]} if "num_experts" in t else {})
        ),
        load_weights=_exec(
            v.ns,
            _mtp_source(v.src, MTP_FILE, "Qwen3_5MultiTokenPredictor", "load_weights"),
            "load_weights",
        ),
    )
    mtp = types.SimpleNamespace(model=predictor, lm_head={"weight": head})
    mtp_load = _exec(
        v.ns, _mtp_source(v.src, MTP_FILE, "Qwen3_5MTP", "load_weights"), "load_weights"
    )
    loaded = mtp_load(mtp, list(weights.items()))
    assert loaded == {f"model.{n}" for n in params} | {"lm_head.weight"}, loaded

    out = {f"drafter.model.{n}": p for n, p in params.items()}
    if own_lm_head:
        out["drafter.lm_head.weight"] = head
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Per preset: a block-FP8 checkpoint whose MTP module is quantized too, and its BF16
    twin (the same values resolved). The target keeps one (full-attention) layer: its
    Gated DeltaNet layers are compared by tests/engine/test_vllm_qwen3_5.py, and the
    drafter does not depend on them."""
    out = {}
    for preset in ("qwen3.5-tiny", "qwen3.5-moe-tiny"):
        raw = preset_config(preset)
        q = raw["quantization_config"]
        keep = [m for m in q["modules_to_not_convert"] if m != "mtp"]
        text = {**raw["text_config"], "num_hidden_layers": 1, "layer_types": ["full_attention"]}
        over = {
            "quantization_config": {**q, "modules_to_not_convert": keep},
            "text_config": text,
        }
        OVERRIDES[preset] = over
        root = tmp_path_factory.mktemp(preset)
        fp8, bf16 = str(root / "fp8"), str(root / "bf16")
        make_checkpoint(fp8, preset, seed=5, overrides=over)
        make_checkpoint(bf16, preset, seed=5, bf16=True, overrides=over)
        out[preset] = (fp8, bf16)
    return out


OVERRIDES: dict[str, dict[str, Any]] = {}
"""The checkpoints' config overrides, by preset (check_against_vllm reads the preset's)."""

MTP = {"speculative_method": "mtp", "language_model_only": True}
CASES = {
    # vLLM 0.23 shares embed_tokens and lm_head with the target
    "tp1": ("qwen3.5-tiny", ParallelLayout(tp=1, **MTP), "mxload"),
    "tp4": ("qwen3.5-tiny", ParallelLayout(tp=4, **MTP), "mxload"),
    # vllm-ascend 0.23.0.post1 keeps the drafter's own lm_head; with the vision tower in
    # --mm-encoder-tp-mode data (whole on every TP rank)
    "tp2-ascend-vision-data": (
        "qwen3.5-tiny",
        ParallelLayout(tp=2, speculative_method="mtp", mm_encoder_tp_mode="data"),
        "vllm-ascend-0.23",
    ),
    # the MTP layer's experts placed as the model's: whole under EP over dp*tp = 2
    "moe-tp2-ep": (
        "qwen3.5-moe-tiny",
        ParallelLayout(tp=2, enable_expert_parallel=True, **MTP),
        "mxload",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_drafter_equals_vllm_0_23_qwen3_5_mtp_parameters(
    vllm_src: Path, checkpoints: dict[str, tuple[str, str]], case: str
) -> None:
    preset, layout, engine = CASES[case]
    own = engine != "mxload"
    seen: list[str] = []

    data = layout.mm_encoder_tp_mode == "data"
    whole: list[_Vllm] = []

    def params_of(v: _Vllm, _: dict[str, Any], weights: dict[str, torch.Tensor]) -> Any:
        cfg = preset_config(preset, OVERRIDES[preset])  # the checkpoints' config
        if data:
            v.language_model_only = True  # the tower is built below, whole
        target = vllm_params(v, cfg, weights)
        if data:
            # every vision linear built with disable_tp: tp_size 1, tp_rank 0 whatever the
            # rank (layers/linear.py LinearBase.__init__), i.e. the tp-1 tower
            whole[:] = whole or [_Vllm(v.src, 1, 0)]
            to_visual = []
            for name, w in weights.items():
                for old, new in v.prefixes.items():
                    if name.startswith(old):
                        name = new + name[len(old) :]
                        break
                if name.startswith("visual."):
                    to_visual.append((name[len("visual.") :], w))
            target.update(vision_params(whole[0], cfg["vision_config"], to_visual))
        drafter = drafter_params(v, cfg, weights, own)
        # the proposer replaces the drafter's embedding by the target's, which holds the
        # same values: mxload writes the target's only
        emb = drafter.pop("drafter.model.embed_tokens.weight")
        assert torch.equal(emb, target["language_model.model.embed_tokens.weight"])
        assert drafter.keys().isdisjoint(target)
        seen.extend(drafter)
        return {**target, **drafter}

    fp8, _ = checkpoints[preset]
    meta = open_checkpoint(fp8)
    mx_drafter = [
        b.name
        for b in plan_rank(meta.config, layout, layout.world - 1, checkpoint=meta, engine=engine)[0]
        if b.name.startswith("drafter.") and b.layout != "dense"
    ]
    assert "drafter.model.fc.weight" in mx_drafter  # the MX session's drafter is compared
    check_against_vllm(vllm_src, preset, checkpoints[preset], layout, engine, params_of)
    ranks = layout.world
    assert len([n for n in seen if n == "drafter.model.fc.weight"]) == ranks
    assert ("drafter.lm_head.weight" in seen) == own


# --- which drafter rows each engine shares with the target --------------------------------

VLLM_PROPOSER = ("vllm/v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer")
ASCEND_PIN = "0.23.0.post1"
ASCEND_PROPOSER = ("vllm_ascend/spec_decode/llm_base_proposer.py", "AscendSpecDecodeBaseProposer")


def _shared_by(root: Path, file: str, cls: str) -> set[str]:
    """Run the engine's own ``_maybe_share_embeddings`` and ``_maybe_share_lm_head`` on a
    Qwen3.5 MTP drafter (method "mtp", not MLA, pp 1) and say which of the drafter's
    ``embed_tokens`` / ``lm_head`` became the target's."""
    target_lm = types.SimpleNamespace(
        model=types.SimpleNamespace(embed_tokens=torch.nn.Embedding(4, 2)),
        lm_head=torch.nn.Linear(2, 4),
    )
    drafter = types.SimpleNamespace(
        model=types.SimpleNamespace(embed_tokens=torch.nn.Embedding(4, 2)),
        lm_head=torch.nn.Linear(2, 4),
    )
    ns: dict[str, Any] = {
        "torch": torch,
        "nn": torch.nn,
        "logger": types.SimpleNamespace(info=lambda *a: None, warning=lambda *a: None),
        "get_pp_group": lambda: types.SimpleNamespace(world_size=1),
    }
    # the proposer's own state these methods read: a Qwen3.5 MTP drafter, no graph capture
    me = types.SimpleNamespace(
        model=drafter,
        method="mtp",
        use_compress=False,
        use_cuda_graph=False,
        use_local_argmax_reduction=False,
        vllm_config=types.SimpleNamespace(
            speculative_config=None,
            model_config=types.SimpleNamespace(is_deepseek_mla=False),
            compilation_config=types.SimpleNamespace(
                cudagraph_mode=types.SimpleNamespace(has_full_cudagraphs=lambda: False)
            ),
        ),
    )
    for meth in ("_maybe_share_embeddings", "_maybe_share_lm_head"):
        fn = _exec(ns, _mtp_source(root, file, cls, meth), meth)
        # vLLM passes the target's language model to both; vllm-ascend the whole
        # multimodal model to _maybe_share_lm_head, whose lm_head is the language model's
        fn(me, target_lm)
    return {
        name
        for name, mine, theirs in (
            ("embed_tokens", drafter.model.embed_tokens, target_lm.model.embed_tokens),
            ("lm_head", drafter.lm_head, target_lm.lm_head),
        )
        if mine is theirs
    }


def test_the_engines_share_what_their_profiles_say(vllm_src: Path) -> None:
    """vLLM 0.23 shares the drafter's embedding and lm_head with the target (the mxload
    profile plans neither); vllm-ascend 0.23.0.post1 shares the embedding only (its
    profile plans ``drafter.lm_head``)."""
    from mxload.orchestrator.plan.engines import engine_profile

    ascend = sources.vllm_ascend_sdist(ASCEND_PIN)
    arch = "Qwen3_5ForConditionalGeneration"
    for root, (file, cls), profile in (
        (vllm_src, VLLM_PROPOSER, "mxload"),
        (ascend, ASCEND_PROPOSER, "vllm-ascend-0.23"),
    ):
        shared = _shared_by(root, file, cls)
        assert "embed_tokens" in shared, (profile, shared)
        own = engine_profile(profile).drafter_own.get(arch, ())
        assert ("drafter.lm_head" in own) == ("lm_head" not in shared), (profile, shared)
