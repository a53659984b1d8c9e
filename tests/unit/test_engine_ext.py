"""The worker extension and its driver helper, with vLLM's worker faked.

vLLM cannot run here, so the only stand-ins are the worker object (its ``vllm_config``
and ``model_runner.model``), ``vllm.distributed``'s rank functions (in ``sys.modules``)
and ``collective_rpc`` (a loop over the workers). Everything of mxload is real: the
plan, adoption of the model's parameters, reloads from real checkpoints. What the
parameters must hold comes from ``tests/reference_model.py`` (no mxload code).
"""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import AdoptionError, LayoutError
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.workers.engine_ext import EngineReloader, MxloadWorkerExtension

from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank

OVERRIDES = {"moe_intermediate_size": 256}
LAYOUT = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
LAY = Layout(2, 2, 1, True, "linear")


def _set(model: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))


def _engine_model(plan_rank: Any, *, as_engine: bool = True) -> torch.nn.Module:
    """A model whose parameters are laid out as the plan's engine holds them (storage,
    then the view), or row-major in the view's shape (``as_engine=False``)."""
    model = torch.nn.Module()
    for b in plan_rank.buffers:
        dtype = getattr(torch, b.dtype)
        if as_engine:
            t = torch.zeros(b.storage_shape, dtype=dtype)
            if b.storage_order:
                inv = [b.storage_order.index(d) for d in range(len(b.shape))]
                t = t.permute(inv)
        else:
            t = torch.zeros(b.shape, dtype=dtype)
        _set(model, b.name, t)
    return model


class _Worker(MxloadWorkerExtension):
    def __init__(self, layout: ParallelLayout, dp_rank: int, pp_rank: int, tp_rank: int, model):
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(
                tensor_parallel_size=layout.tp,
                data_parallel_size=layout.dp,
                pipeline_parallel_size=layout.pp,
                enable_expert_parallel=layout.enable_expert_parallel,
                expert_placement_strategy=layout.expert_placement,
                data_parallel_rank=dp_rank,
            )
        )
        self.model_runner = SimpleNamespace(model=model)
        self.ranks = (pp_rank, tp_rank)


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm.distributed's rank functions, answering for the worker being called."""
    current: dict[str, Any] = {}
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: current["w"].ranks[1]
    dist.get_pp_group = lambda: SimpleNamespace(rank_in_group=current["w"].ranks[0])
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
    return current


def _llm(workers: list[_Worker], current: dict[str, Any]):
    def collective_rpc(method: str, timeout=None, args=(), kwargs=None) -> list[Any]:
        out = []
        for w in workers:
            current["w"] = w
            out.append(getattr(w, method)(*args, **(kwargs or {})))
        return out

    return collective_rpc


def _workers(src: str, engine: str, layout: ParallelLayout = LAYOUT, **kw) -> list[_Worker]:
    meta = open_checkpoint(src)
    plan = build_plan(meta.config, layout, checkpoint=meta, engine=engine)
    out = []
    for dp in range(layout.dp):
        for pp in range(layout.pp):
            for tp in range(layout.tp):
                rank = dp * layout.pp * layout.tp + pp * layout.tp + tp
                out.append(_Worker(layout, dp, pp, tp, _engine_model(plan.ranks[rank], **kw)))
    return out


def test_attach_reload_status_through_collective_rpc(ckpt_factory, fake_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    src1 = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    src2 = ckpt_factory("qwen3-moe-tiny", seed=2, overrides=OVERRIDES)
    engine = "vllm-ascend-main"
    workers = _workers(src1, engine)
    mx = EngineReloader(_llm(workers, fake_vllm))
    status = mx.attach(src1, engine=engine)
    assert [s["rank"] for s in status] == [0, 1, 2, 3]
    assert {s["engine"] for s in status} == {engine}
    names = set(status[0]["tensors"])
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in names

    # What each rank must hold, from the independent reference: the profile's parameters
    # are the contract's buffers under vLLM's MoE name (routed_experts), their logical
    # views (the transposed MoE views, made contiguous) byte for byte the same.
    def held(w: _Worker) -> dict[str, torch.Tensor]:
        return {
            n.replace(".mlp.experts.routed_experts.", ".mlp.experts."): p.data.contiguous()
            for n, p in w.model_runner.model.named_parameters()
        }

    refs = {src: RefCheckpoint(src) for src in (src1, src2)}
    for i, src in enumerate((src2, src1, src2), start=1):
        reports = mx.reload(src)
        assert {r["version"] for r in reports} == {i}
        assert all(r["addresses_moved"] == [] for r in reports)
        for w, r in zip(workers, reports, strict=True):
            bad = compare_rank(expected_rank(refs[src], LAY, r["rank"]), held(w))
            assert bad == [], f"reload {i} rank {r['rank']}: {bad[:5]}"
    status = mx.status()
    w13 = status[1]["tensors"]["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    _, h, n2 = w13["shape"]
    assert w13["stride"] == [h * n2, 1, h]  # vllm-ascend's transposed view
    assert all(len(t["checksum"]) == 32 for t in status[1]["tensors"].values())


def test_attach_refuses_nz_round_robin_and_foreign_layouts(ckpt_factory, fake_vllm, monkeypatch):
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    engine = "vllm-ascend-0.23"
    # NZ on (vllm-ascend's default when the variable is unset): refused, with the reason.
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    workers = _workers(src, engine)
    with pytest.raises(AdoptionError, match="VLLM_ASCEND_ENABLE_NZ"):
        EngineReloader(_llm(workers, fake_vllm)).attach(src, engine=engine)
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    # The engine's own parallel config asks for round_robin: vLLM would place linearly.
    rr = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True, expert_placement="round_robin")
    workers = _workers(src, "mxload", layout=rr)
    with pytest.raises(LayoutError, match="falls back to linear"):
        EngineReloader(_llm(workers, fake_vllm)).attach(src, engine=engine)
    # Parameters held contiguous where the profile says transposed views: every
    # difference listed, nothing written.
    workers = _workers(src, engine, as_engine=False)
    with pytest.raises(AdoptionError) as err:
        EngineReloader(_llm(workers, fake_vllm)).attach(src, engine=engine)
    msg = str(err.value)
    assert "w13_weight: stride" in msg and "w2_weight_scale: stride" in msg
    assert "qkv_proj.weight:" not in msg  # linears are contiguous in both


def test_module_imports_without_vllm() -> None:
    code = (
        "import sys, mxload.workers.engine_ext as m; "
        "bad = [k for k in sys.modules if k.split('.')[0] in ('vllm', 'vllm_ascend', 'torch_npu')]; "
        "assert not bad, bad; print(m.installed_engine())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mxload"
