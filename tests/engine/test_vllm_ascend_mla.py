"""DeepSeek-V3's derived MLA tensors against vllm-ascend's own MLA post-load, on CPU.

vllm-ascend's MLA attention does not read ``kv_b_proj`` on its decode path: its
``AscendMLAImpl.process_weights_after_loading`` (``vllm_ascend/attention/mla_v1.py``)
derives ``W_UK_T`` and ``W_UV`` from it and keeps them on the impl. mxload plans them as
buffers under a vllm-ascend profile and recomputes them in place after every write of
``kv_b_proj`` (docs/contract.md §2.4). This test runs the release's own
``mla_v1.py`` (downloaded by tests/engine/sources.py, imported under its own module
name) on an impl holding mxload's ``kv_b_proj`` buffer, and asks that mxload's derived
buffers equal the engine's byte for byte, in shape, dtype and contiguity, after a load
and after each of three in-place reloads from other checkpoints, with no buffer's address
moved. 0.23.0.post1 (profile ``vllm-ascend-0.23``: its own second post-load ``copy_``s into
the tensors of the first) and 0.30.0rc2 (profile ``vllm-ascend-main``: vLLM 0.30's real
``replace_parameter(prefer_copy=True)``) both run.

Stand-ins, each named (every other vllm / vllm_ascend / torch_npu module is a placeholder
module of tests/engine/sources.py, imported by ``mla_v1.py`` for its forward paths and
never run here):

* ``torch_npu.npu_format_cast``: the identity. The post-load casts ``kv_b_proj`` to ND,
  which an ND tensor already is (mxload refuses NZ weights, docs/contract.md §2.3).
* ``vllm_ascend.utils.maybe_trans_nz``: the identity, what it is with
  ``weight_nz_mode`` 0 (the only mode mxload reloads into).
* vLLM's ``MLAAttentionImpl``, the impl's abstract base: a plain class (a placeholder base
  would answer the post-load's ``hasattr(self, "W_UV")``); ``MLACommonMetadataBuilder``, a
  base the file subscripts: a plain generic class.
* the file is compiled with annotations deferred: its class bodies annotate with
  ``torch.npu`` types, which CPU torch lacks; no annotation is ever evaluated.
* the impl is made with ``__new__`` and given the attributes its ``__init__`` would set
  from the layer (``kv_b_proj``: a module whose ``quant_method`` is an instance of the
  ``UnquantizedLinearMethod`` the file imported, as the engine asserts; ``num_heads``
  the local heads; the head dims; MLAPO and FA-quant off, which mxload requires).
"""

from __future__ import annotations
import __future__

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest
import torch
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.reload import reload_inputs
from mxload.orchestrator.tools.synth import make_checkpoint
from mxload.workers.rank.loader import RankLoader

from tests.engine import sources
from tests.engine.sources import Stub, stubbed_packages

PRESET = "deepseek-v3-tiny"
RELEASES = {"0.23.0.post1": "vllm-ascend-0.23", "0.30.0rc2": "vllm-ascend-0.30.0rc2"}
"""Release whose ``mla_v1.py`` runs -> the ``--engine`` planned with."""
VLLM_OF = {"0.30.0rc2": "0.30.0"}
"""Releases whose post-load calls vLLM's ``replace_parameter``: the wheel it comes from."""
LAYOUTS = {
    "tp2-ep": ParallelLayout(tp=2, enable_expert_parallel=True),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
    "tp4-ep": ParallelLayout(tp=4, enable_expert_parallel=True),
}
CASES = [("0.23.0.post1", "tp2xdp2-ep"), ("0.23.0.post1", "tp4-ep"), ("0.30.0rc2", "tp2xdp2-ep")]
"""Two and one local heads (of the preset's 4), each release; 4 loads of one rank each."""
IMPL = "self_attn.mla_attn.mla_attn.impl"
_ANNOTATIONS = __future__.annotations.compiler_flag
_M = TypeVar("_M")


class _ImplBase:
    """Stands in for vLLM's ``MLAAttentionImpl`` (an abstract interface)."""


class _MetadataBuilder(Generic[_M]):
    """Stands in for vLLM's ``MLACommonMetadataBuilder``: a generic base class."""


def _post_load(version: str) -> Callable[..., Any]:
    """A maker of the release's own ``AscendMLAImpl`` over a given ``kv_b_proj`` weight
    (``make(weight, local_heads, config)``)."""
    pkg = sources.vllm_ascend_sdist(version) / "vllm_ascend"
    real: dict[str, Path] = {}
    if version in VLLM_OF:
        real["vllm.model_executor.utils"] = (
            sources.vllm_wheel(VLLM_OF[version]) / "vllm" / "model_executor" / "utils.py"
        )
    given = {
        "torch_npu": Stub("torch_npu", npu_format_cast=lambda t, fmt: t),
        "vllm_ascend.utils": Stub(
            "vllm_ascend.utils", Path("/nonexistent"), maybe_trans_nz=lambda w: w
        ),
        "vllm.logger": Stub("vllm.logger", logger=sources.QuietLogger()),
        # the impl's base: a plain class, so that the post-load's hasattr(self, "W_UV")
        # sees only what the impl holds (a placeholder base answers every attribute)
        "vllm.v1.attention.backend": Stub("vllm.v1.attention.backend", MLAAttentionImpl=_ImplBase),
        # a generic base the metadata builder subscripts (placeholders cannot be)
        "vllm.model_executor.layers.attention.mla_attention": Stub(
            "vllm.model_executor.layers.attention.mla_attention",
            MLACommonMetadataBuilder=_MetadataBuilder,
        ),
    }
    path = pkg / "attention" / "mla_v1.py"
    with stubbed_packages({"vllm", "vllm_ascend", "torch_npu"}, real, given):
        # its class bodies annotate with torch.npu types, which CPU torch lacks: compiled
        # with annotations deferred (never evaluated), the code is otherwise as shipped
        mla = types.ModuleType("vllm_ascend.attention.mla_v1")
        mla.__file__ = str(path)
        sys.modules[mla.__name__] = mla
        exec(compile(path.read_text(), str(path), "exec", flags=_ANNOTATIONS), mla.__dict__)

    def make(weight: torch.Tensor, heads: int, cfg: Any) -> Any:
        impl = mla.AscendMLAImpl.__new__(mla.AscendMLAImpl)
        kv_b_proj = torch.nn.Module()
        kv_b_proj.weight = torch.nn.Parameter(weight, requires_grad=False)
        kv_b_proj.quant_method = mla.UnquantizedLinearMethod()
        impl.__dict__.update(
            kv_b_proj=kv_b_proj,
            num_heads=heads,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            v_head_dim=cfg.v_head_dim,
            enable_mlapo=False,
            fa_quant_layer=False,
            layer_sharding_kwargs=[],
        )
        return impl

    return make


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The load's checkpoint and three others of the same model (the reloads)."""
    out = []
    for seed in range(1, 5):
        path = str(tmp_path_factory.mktemp(f"{PRESET}-{seed}"))
        make_checkpoint(path, PRESET, seed=seed, bf16=seed == 3)
        out.append(path)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("release", "layout"), CASES)
def test_derived_mla_tensors_equal_vllm_ascend_post_load_through_three_reloads(
    checkpoints: list[str], release: str, layout: str
) -> None:
    make_impl = _post_load(release)
    lay = LAYOUTS[layout]
    meta = open_checkpoint(checkpoints[0])
    cfg = meta.config
    rank = lay.world - 1
    held = build_plan(cfg, lay, checkpoint=meta, engine=RELEASES[release])
    rp = held.ranks[rank]
    names = {b.name for b in rp.buffers}
    loader = RankLoader(rp, model_dtype=cfg.model_dtype)
    addresses = {n: t.data_ptr() for n, t in loader.buffers.items()}
    impls: dict[int, Any] = {}
    for v, src in enumerate(checkpoints, 1):
        # the reload of every session host: preflight against the held plan, its reads
        inputs = reload_inputs(held, src)
        run = loader.load if v == 1 else loader.reload
        run(
            list(inputs.reads[rank]),
            inputs.source,
            version=v,
            staging_budget=inputs.budgets[rank],
            units=list(inputs.units[rank]),
        )
        assert {n: t.data_ptr() for n, t in loader.buffers.items()} == addresses, v
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            kvb = loader.buffers[p + "self_attn.kv_b_proj.weight"]
            heads = kvb.shape[0] // (cfg.qk_nope_head_dim + cfg.v_head_dim)
            assert heads == cfg.num_attention_heads // lay.tp
            impl = impls.get(layer)
            if impl is None:  # the engine's first post-load makes its tensors
                impl = impls[layer] = make_impl(kvb.clone(), heads, cfg)
            else:  # a later one: its loaders wrote kv_b_proj in place
                impl.kv_b_proj.weight.data.copy_(kvb)
            impl.process_weights_after_loading(kvb.dtype)
            for attr in ("W_UK_T", "W_UV"):
                name = f"{p}{IMPL}.{attr}"
                assert name in names, name
                ours, theirs = loader.buffers[name], getattr(impl, attr)
                assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype), name
                assert ours.is_contiguous() and theirs.is_contiguous(), name
                assert torch.equal(ours.view(torch.uint8), theirs.data.view(torch.uint8)), (
                    f"{name} after version {v}"
                )
        assert loader.version == v and loader.consistent


def test_derived_buffers_are_counted_in_the_plan(checkpoints: list[str]) -> None:
    """Under a vllm-ascend profile every rank holds W_UK_T and W_UV per layer, in the
    model dtype, and persistent bytes grow by exactly their size (here worked by hand:
    per layer heads_l * (P + V) * L elements of 2 bytes); the mxload profile holds none."""
    meta = open_checkpoint(checkpoints[0])
    cfg = meta.config
    lay = LAYOUTS["tp2-ep"]
    mine = build_plan(cfg, lay, checkpoint=meta)
    ascend = build_plan(cfg, lay, checkpoint=meta, engine="vllm-ascend-main")
    heads = cfg.num_attention_heads // lay.tp
    per_layer = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * 2
    for a, b in zip(mine.ranks, ascend.ranks, strict=True):
        derived = [x for x in b.buffers if x.name.endswith(("W_UK_T", "W_UV"))]
        assert not [x for x in a.buffers if x.name.endswith(("W_UK_T", "W_UV"))]
        assert len(derived) == 2 * cfg.num_hidden_layers
        assert {x.dtype for x in derived} == {"bfloat16"}
        assert b.persistent_bytes - a.persistent_bytes == per_layer * cfg.num_hidden_layers
