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
from mxload.orchestrator.errors import AddressMoved, AdoptionError, LayoutError, RunError
from mxload.orchestrator.hosts.engine_ext import EngineReloader, MxloadWorkerExtension
from mxload.orchestrator.plan.engines import engine_profile
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint

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
    with pytest.raises(LayoutError, match="init_eplb_config"):
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
        "import sys, mxload.orchestrator.hosts.engine_ext as m; "
        "bad = [k for k in sys.modules if k.split('.')[0] in ('vllm', 'vllm_ascend', 'torch_npu')]; "
        "assert not bad, bad; print(m.installed_engine())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mxload"


ONE = ParallelLayout(tp=1)


def _one(src: str, engine: str, fake_vllm) -> tuple[list[_Worker], EngineReloader]:
    workers = _workers(src, engine, layout=ONE)
    return workers, EngineReloader(_llm(workers, fake_vllm))


def test_a_parameter_the_engine_rebinds_after_attach_is_refused(
    ckpt_factory, fake_vllm, ascend_config
):
    src1 = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    src2 = ckpt_factory("qwen3-moe-tiny", seed=2, overrides=OVERRIDES)
    engine = "vllm-ascend-0.30.0rc2"
    workers, mx = _one(src1, engine, fake_vllm)
    ascend_config.weight_nz_mode = 0
    mx.attach(src1, engine=engine)
    model = workers[0].model_runner.model
    name = "model.layers.1.self_attn.o_proj.weight"
    param = model.get_parameter(name)
    old = param.data
    # What an engine's post-load run again, or an NZ cast, does: a new tensor behind the
    # same Parameter. mxload's buffer (the old tensor) is no longer what the kernels read.
    param.data = old.clone()
    before = param.data.clone()
    with pytest.raises(AddressMoved) as err:
        mx.reload(src2)
    msg = str(err.value)
    assert "\n" not in msg and name in msg and "data_ptr" in msg, msg
    assert torch.equal(param.data, before) and torch.equal(old, before)  # nothing written
    with pytest.raises(AddressMoved, match=name.replace(".", r"\.")):
        mx.status()
    # The same tensor again, but re-viewed with other strides: also refused.
    param.data = old
    mx.reload(src2)
    param.data = old.t()
    with pytest.raises(AddressMoved, match="stride"):
        mx.status()


def _configure(workers: list[_Worker], config: dict[str, Any]) -> None:
    """What vllm-ascend's get_ascend_config() answers in these workers (a named stub of
    vllm_ascend.ascend_config, installed by the caller's monkeypatch)."""
    for w in workers:
        pc = w.vllm_config.parallel_config
        pc.enable_eplb = config.get("enable_eplb", False)
        pc.eplb_config = SimpleNamespace(num_redundant_experts=config.get("redundant", 0))
        w.vllm_config.speculative_config = config.get("speculative")


@pytest.fixture
def ascend_config(monkeypatch):
    """vllm_ascend.ascend_config.get_ascend_config(), answering what the test sets."""
    cfg = SimpleNamespace(
        weight_nz_mode=1,
        enable_fused_mc2=0,
        eplb_config=SimpleNamespace(
            dynamic_eplb=False, expert_map_path=None, num_redundant_experts=0
        ),
    )
    mod = types.ModuleType("vllm_ascend.ascend_config")
    mod.get_ascend_config = lambda: cfg
    monkeypatch.setitem(sys.modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_config", mod)
    return cfg


@pytest.mark.parametrize(
    ("engine", "change", "setting", "fix"),
    [
        (
            "vllm-ascend-0.30.0rc2",
            {},
            "weight_nz_mode='1'",
            "additional_config={'weight_nz_mode': 0}",
        ),
        ("vllm-ascend-0.23.0.post1", {}, "weight_nz_mode='1'", "VLLM_ASCEND_ENABLE_NZ=0"),
        (
            "vllm-ascend-0.30.0rc2",
            {"enable_fused_mc2": 1},
            "enable_fused_mc2='1'",
            "'enable_fused_mc2': 0",
        ),
        ("vllm-ascend-0.28.0rc1", {"enable_eplb": True}, "enable_eplb='1'", "--enable-eplb"),
        (
            "vllm-ascend-0.27.1rc1",
            {"dynamic_eplb": True},
            "eplb_config.dynamic_eplb='1'",
            "dynamic_eplb",
        ),
        (
            "vllm-ascend-main",
            {"expert_map_path": "/m.json"},
            "expert_map_path='/m.json'",
            "expert_map_path",
        ),
        (
            "vllm-ascend-0.30.0rc2",
            {"redundant": 2},
            "num_redundant_experts='2'",
            "num_redundant_experts 0",
        ),
        (
            "vllm-ascend-0.23.0.post1",
            {"speculative": SimpleNamespace(method="eagle")},
            "speculative_config='eagle'",
            "without speculative_config",
        ),
    ],
)
def test_engine_settings_are_refused_naming_the_setting(
    engine, change, setting, fix, ckpt_factory, fake_vllm, ascend_config
):
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    workers, mx = _one(src, engine, fake_vllm)
    ascend_config.weight_nz_mode = 0 if change else 1
    ascend_config.enable_fused_mc2 = change.get("enable_fused_mc2", 0)
    ascend_config.eplb_config.dynamic_eplb = change.get("dynamic_eplb", False)
    ascend_config.eplb_config.expert_map_path = change.get("expert_map_path")
    _configure(workers, change)
    with pytest.raises(AdoptionError) as err:
        mx.attach(src, engine=engine)
    msg = str(err.value)
    assert "\n" not in msg and setting in msg and fix in msg, msg
    if change:
        return
    # With every setting as the release needs it, the same engine attaches.
    ascend_config.weight_nz_mode = 0
    ascend_config.enable_fused_mc2 = 0
    ascend_config.eplb_config.dynamic_eplb = False
    ascend_config.eplb_config.expert_map_path = None
    _configure(workers, {})
    assert mx.attach(src, engine=engine)[0]["engine"] == engine_profile(engine).name


@pytest.mark.parametrize(
    ("change", "setting"),
    [
        ({"speculative": SimpleNamespace(method="eagle")}, "speculative_config='eagle'"),
        ({"enable_eplb": True}, "enable_eplb='1'"),
        ({"redundant": 2}, "num_redundant_experts='2'"),
    ],
)
def test_vllm_settings_are_refused_without_vllm_ascend(change, setting, ckpt_factory, fake_vllm):
    # Plain vLLM (--engine mxload, no vllm-ascend installed): an EAGLE drafter or EPLB
    # would leave weights mxload never writes, as under any release.
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    workers, mx = _one(src, "mxload", fake_vllm)
    _configure(workers, change)
    with pytest.raises(AdoptionError) as err:
        mx.attach(src, engine="mxload")
    msg = str(err.value)
    assert "\n" not in msg and setting in msg and "--engine mxload" in msg, msg
    _configure(workers, {})
    assert mx.attach(src, engine="mxload")[0]["engine"] == "mxload"


def test_one_llm_per_dp_rank_reloads_as_one_engine(ckpt_factory, fake_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    src1 = ckpt_factory("qwen3-moe-tiny", seed=1)
    src2 = ckpt_factory("qwen3-moe-tiny", seed=2)
    layout = ParallelLayout(tp=1, dp=2, enable_expert_parallel=True)
    engine = "vllm-ascend-0.23.0.post1"
    workers = _workers(src1, engine, layout=layout)
    # Two LLM instances, one per DP rank, each with its own collective_rpc.
    rpcs = [_llm([w], fake_vllm) for w in workers]
    calls: list[str] = []

    class Llm:  # what an RL loop holds: the engines whose cache must be reset
        def __init__(self, i: int) -> None:
            self.i = i

        def pause_generation(self) -> None:
            calls.append(f"pause {self.i}")

        def reset_prefix_cache(self) -> None:
            calls.append(f"reset {self.i}")

        def resume_generation(self) -> None:
            calls.append(f"resume {self.i}")

    mx = EngineReloader(rpcs)
    assert [s["rank"] for s in mx.attach(src1, engine=engine)] == [0, 1]
    original = rpcs[1]

    def reloading(method, **kw):
        if method == "mxload_reload":
            calls.append("reload")
        return original(method, **kw)

    mx._rpcs[1] = reloading
    ident = mx.update(src2, engines=[Llm(0), Llm(1)])
    assert calls == ["pause 0", "pause 1", "reload", "reset 0", "reset 1", "resume 0", "resume 1"]
    assert {s["identity"] for s in mx.status()} == {ident}
    assert ident.startswith("1:") and len(ident) > 10
    # Ranks that do not hold one identity are refused: one rank reloaded alone.
    rpcs[0]("mxload_reload", args=(src1,))
    with pytest.raises(RunError, match="ranks disagree"):
        EngineReloader(rpcs).reload(src2)
    # The same LLM's workers twice (a missing data_parallel_rank) are refused.
    with pytest.raises(RunError, match="not each of"):
        EngineReloader([rpcs[0], rpcs[0]]).status()


def test_the_extension_composes_with_another(ckpt_factory, fake_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)

    class Other:  # another stack's worker extension (verl ships its own)
        def other_method(self) -> str:
            return "other"

    class Both(_Worker, Other):
        pass

    w = _workers(src, "mxload", layout=ONE)[0]
    both = Both.__new__(Both)
    both.__dict__.update(w.__dict__)
    rpc = _llm([both], fake_vllm)
    assert rpc("other_method") == ["other"]
    assert EngineReloader(rpc).attach(src)[0]["rank"] == 0
    extra = {n for n in vars(MxloadWorkerExtension) if not n.startswith("__")}
    assert all(n.startswith(("mxload_", "_mxload", "_attached")) for n in extra), extra


def test_expert_maps_are_read_at_attach_and_before_every_reload(
    ckpt_factory, fake_vllm, monkeypatch
):
    """vLLM's FusedMoE keeps its placement in ``expert_map_manager.expert_map`` (global
    expert -> local slot, -1 elsewhere); the maps here follow vLLM's linear placement
    (tests/reference_model.py), then one is changed as EPLB would."""
    from tests.reference_model import experts_of

    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    engine = "vllm-ascend-0.23.0.post1"
    workers = _workers(src, engine)
    n_e = open_checkpoint(src).config.num_experts
    moe = []
    for w in workers:
        dp, (_, tp) = w.vllm_config.parallel_config.data_parallel_rank, w.ranks
        held = experts_of(n_e, LAYOUT.dp * LAYOUT.tp, dp * LAYOUT.tp + tp, "linear")
        emap = torch.full((n_e,), -1, dtype=torch.int32)
        emap[held] = torch.arange(len(held), dtype=torch.int32)
        for name, mod in w.model_runner.model.named_modules():
            if name.endswith("mlp.experts"):
                mod.expert_map_manager = SimpleNamespace(expert_map=emap.clone())
                moe.append((w, name, mod))
    assert moe
    mx = EngineReloader(_llm(workers, fake_vllm))
    mx.attach(src, engine=engine)  # the maps agree with the plan
    # Two slots swapped (what EPLB does while serving): refused before anything is written.
    _, name, mod = moe[-1]
    emap = mod.expert_map_manager.expert_map
    a, b = (emap >= 0).nonzero().flatten()[:2].tolist()
    emap[a], emap[b] = emap[b].item(), emap[a].item()
    with pytest.raises(AdoptionError, match=rf"{name.replace('.', '[.]')}: slots hold experts"):
        mx.reload(src)
    with pytest.raises(AdoptionError, match="expert placement is not the plan's"):
        mx.attach(src, engine=engine)


def test_the_installed_release_is_matched_by_exact_version(monkeypatch) -> None:
    import importlib.metadata as md

    from mxload.orchestrator.errors import UsageError
    from mxload.orchestrator.hosts.engine_ext import installed_engine

    def installed(v: str):
        def version(name: str) -> str:
            if name in ("vllm-ascend", "vllm_ascend"):
                return v
            raise md.PackageNotFoundError(name)

        return version

    monkeypatch.setattr(md, "version", installed("0.30.0rc2"))
    assert installed_engine() == "vllm-ascend-0.30.0rc2"
    monkeypatch.setattr(md, "version", installed("0.23.0.post1"))
    assert installed_engine() == "vllm-ascend-0.23.0.post1"
    # Not "not 0.23, so main": a release nobody read is refused, listing the known ones.
    monkeypatch.setattr(md, "version", installed("0.25.1rc1"))
    with pytest.raises(UsageError, match=r"0\.25\.1rc1.*known: 0\.23\.0\.post1, 0\.27\.1rc1"):
        installed_engine()


def test_parameters_the_engine_stored_as_fractal_nz_are_refused(
    ckpt_factory, fake_vllm, monkeypatch
):
    """On an NPU the storage format is read through torch_npu (``get_npu_format``); here
    that one function is stood in for, answering FRACTAL_NZ (29) for one parameter."""
    import mxload.orchestrator.hosts.engine_ext as ext

    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    engine = "vllm-ascend-0.23.0.post1"
    workers, mx = _one(src, engine, fake_vllm)
    cast_one = workers[0].model_runner.model.get_parameter("model.layers.0.self_attn.o_proj.weight")
    monkeypatch.setattr(
        ext, "_npu_format", lambda t: 29 if t.data_ptr() == cast_one.data_ptr() else None
    )
    with pytest.raises(
        AdoptionError,
        match=r"FRACTAL_NZ \(model\.layers\.0\.self_attn\.o_proj\.weight\).*weight_nz_mode",
    ):
        mx.attach(src, engine=engine)


def test_a_linear_the_engine_would_hold_quantized_is_refused_at_attach(
    ckpt_factory, fake_vllm, monkeypatch
):
    """A dense MLP's down_proj with K = 80 (not a multiple of 32): mxload plans it in the
    model dtype (and loads it so, under any profile); vllm-ascend holds it MXFP8, so
    writing into the engine is refused, naming it."""
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    over = {"intermediate_size": 80, "mlp_only_layers": [0], "moe_intermediate_size": 256}
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=over)
    engine = "vllm-ascend-0.23.0.post1"
    _, mx = _one(src, engine, fake_vllm)  # the plan itself is made
    with pytest.raises(LayoutError, match=r"layers\.0\.mlp\.down_proj\.weight: its local K = 80"):
        mx.attach(src, engine=engine)


def test_a_language_model_only_engine_is_planned_without_its_vision_tower(fake_vllm) -> None:
    """vLLM's MultiModalConfig: ``language_model_only``, or every image/video limit 0, skips
    the tower (SupportsMultiModal._mark_tower_model); a text model has no such config."""
    from mxload.orchestrator.hosts.engine_ext import vllm_facts

    w = _Worker(LAYOUT, 0, 0, 0, None)
    fake_vllm["w"] = w
    limits = {"image": 0, "video": 0}
    cases = [
        (None, False),
        (SimpleNamespace(language_model_only=True), True),
        (SimpleNamespace(language_model_only=False, get_limit_per_prompt=limits.get), True),
        (SimpleNamespace(language_model_only=False, get_limit_per_prompt=lambda m: 999), False),
    ]
    for mm, want in cases:
        w.vllm_config.model_config = SimpleNamespace(multimodal_config=mm)
        assert vllm_facts(w.vllm_config).layout.language_model_only is want, mm


def _drafter_worker(plan_rank: Any, layout: ParallelLayout) -> _Worker:
    """A worker whose model runner holds the target model and, as vLLM's MTP proposer
    does, the drafter at ``model_runner.drafter.model`` (its parameters named without
    mxload's ``drafter.`` prefix)."""
    from dataclasses import replace

    target = [b for b in plan_rank.buffers if not b.name.startswith("drafter.")]
    own = [
        replace(b, name=b.name[len("drafter.") :])
        for b in plan_rank.buffers
        if b.name.startswith("drafter.")
    ]
    w = _Worker(layout, 0, 0, plan_rank.tp_rank, _engine_model(SimpleNamespace(buffers=target)))
    w.model_runner.drafter = SimpleNamespace(model=_engine_model(SimpleNamespace(buffers=own)))
    w.vllm_config.speculative_config = SimpleNamespace(method="mtp")
    return w


def test_an_mtp_engine_attaches_and_reloads_the_drafter_in_place(
    ckpt_factory, fake_vllm, ascend_config
):
    """speculative_config method "mtp" on Qwen3.5: the drafter's parameters (vLLM's
    model_runner.drafter.model) are adopted and rewritten in place; each holds the BF16
    checkpoint's mtp.* tensors (tp 1: whole), the drafter's own lm_head (vllm-ascend
    keeps it) the lm_head's rows."""
    from safetensors.torch import load_file

    src1 = ckpt_factory("qwen3.5-tiny", seed=1)
    src2 = ckpt_factory("qwen3.5-tiny", seed=2, bf16=True)
    engine = "vllm-ascend-0.23.0.post1"
    ascend_config.weight_nz_mode = 0
    layout = ParallelLayout(tp=1, speculative_method="mtp")
    meta = open_checkpoint(src1)
    plan = build_plan(meta.config, layout, checkpoint=meta, engine=engine)
    worker = _drafter_worker(plan.ranks[0], layout)
    mx = EngineReloader(_llm([worker], fake_vllm))
    status = mx.attach(src1, engine=engine)
    assert status[0]["parallel"]["speculative_config"] == {"method": "mtp"}
    drafter = worker.model_runner.drafter.model
    before = {n: p.data_ptr() for n, p in drafter.named_parameters()}
    assert "model.fc.weight" in before and "lm_head.weight" in before
    mx.reload(src2)
    assert {n: p.data_ptr() for n, p in drafter.named_parameters()} == before
    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted(__import__("pathlib").Path(src2).glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    got = dict(drafter.named_parameters())
    for name in ("fc", "norm", "pre_fc_norm_hidden", "layers.0.mlp.down_proj"):
        assert torch.equal(got[f"model.{name}.weight"], ckpt[f"mtp.{name}.weight"]), name
    qkv = [ckpt[f"mtp.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]
    assert torch.equal(got["model.layers.0.self_attn.qkv_proj.weight"], torch.cat(qkv))
    vocab = ckpt["lm_head.weight"].shape[0]
    assert torch.equal(got["lm_head.weight"][:vocab], ckpt["lm_head.weight"])


def test_mtp_on_a_model_without_an_mtp_module_is_refused(ckpt_factory, fake_vllm):
    src = ckpt_factory("qwen3-moe-tiny", seed=1, overrides=OVERRIDES)
    workers, mx = _one(src, "mxload", fake_vllm)
    _configure(workers, {"speculative": SimpleNamespace(method="mtp")})
    with pytest.raises(LayoutError) as err:
        mx.attach(src, engine="mxload")
    assert "--speculative-config method 'mtp' needs the checkpoint's MTP layers" in str(err.value)


def test_the_engine_s_all2all_backend_is_the_layout_s(fake_vllm) -> None:
    """The backend the engine runs with (after its platform's config step) is planned: vLLM's
    default runs sequence-parallel MoE and holds the shared experts whole."""
    from mxload.orchestrator.hosts.engine_ext import vllm_facts

    w = _Worker(LAYOUT, 0, 0, 0, None)
    fake_vllm["w"] = w
    assert vllm_facts(w.vllm_config).layout.all2all_backend == ""  # none given: the profile's
    for backend in ("allgather_reducescatter", "flashinfer_all2allv"):
        w.vllm_config.parallel_config.all2all_backend = backend
        layout = vllm_facts(w.vllm_config).layout
        assert (layout.all2all_backend, layout.shared_expert_dp) == (backend, False)


class _Impl:
    """An attention layer's ``impl``: a plain object (not a module) holding the tensors
    the engine derives in its post-load as attributes, as vllm-ascend's MLA impl does."""


def _impls_as_objects(model: torch.nn.Module) -> list[_Impl]:
    """Each ``impl`` submodule ``_engine_model`` made, replaced by an :class:`_Impl` that
    holds the same tensors (same storage) as plain attributes."""
    out = []
    for name, mod in list(model.named_modules()):
        if name.endswith(".impl"):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            impl = _Impl()
            impl.__dict__.update({k: p.data for k, p in mod.named_parameters()})
            del parent._modules["impl"]
            parent.impl = impl
            out.append(impl)
    return out


@pytest.mark.slow
def test_deepseek_attaches_with_mlapo_off_and_its_derived_tensors_follow_each_reload(
    ckpt_factory, fake_vllm, ascend_config
):
    """DeepSeek-V3 under vllm-ascend: refused while MLAPO is on (its NZ copies are out of
    reach), naming the setting; with it off, attach adopts W_UK_T / W_UV from the MLA
    impls, and three reloads rewrite them in place, each equal to kv_b_proj per head
    (the engine's math, written out here from docs/contract.md §2.4: W_UK_T[h, p, l] =
    kv_b_proj[h * (P + V) + p, l], W_UV[h, l, v] = kv_b_proj[h * (P + V) + P + v, l])."""
    srcs = [ckpt_factory("deepseek-v3-tiny", seed=s) for s in (1, 2, 3)]
    engine = "vllm-ascend-0.30.0rc2"
    layout = ParallelLayout(tp=2, enable_expert_parallel=True)
    workers = _workers(srcs[0], engine, layout=layout)
    impls = [_impls_as_objects(w.model_runner.model) for w in workers]
    assert all(len(i) == 3 for i in impls)  # the preset's three MLA layers
    ascend_config.weight_nz_mode = 0
    ascend_config.enable_mlapo = True
    _configure(workers, {})
    mx = EngineReloader(_llm(workers, fake_vllm))
    with pytest.raises(AdoptionError, match=r"enable_mlapo='1'.*'enable_mlapo': False"):
        mx.attach(srcs[0], engine=engine)
    ascend_config.enable_mlapo = False
    mx.attach(srcs[0], engine=engine)
    ptrs = [[(i.W_UK_T.data_ptr(), i.W_UV.data_ptr()) for i in ws] for ws in impls]
    cfg = open_checkpoint(srcs[0]).config
    p, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    for n, src in enumerate((srcs[1], srcs[2], srcs[0]), start=1):
        reports = mx.reload(src)
        assert {r["version"] for r in reports} == {n}
        assert all(r["addresses_moved"] == [] for r in reports)
        for w, ws, was in zip(workers, impls, ptrs, strict=True):
            assert [(i.W_UK_T.data_ptr(), i.W_UV.data_ptr()) for i in ws] == was
            model = w.model_runner.model
            for layer, impl in enumerate(ws):
                kvb = model.get_parameter(f"model.layers.{layer}.self_attn.kv_b_proj.weight")
                heads = kvb.shape[0] // (p + v)
                per_head = kvb.data.view(heads, p + v, -1)
                assert torch.equal(impl.W_UK_T, per_head[:, :p, :])
                assert torch.equal(impl.W_UV, per_head[:, p:, :].transpose(1, 2))


def test_a_deepseek_drafter_keeping_its_own_mtp_head_is_refused(
    ckpt_factory, fake_vllm, ascend_config
):
    """DeepSeek-V3 with MTP: the plan takes the drafter's shared_head.head from the target's
    lm_head (vLLM shares it; vllm-ascend only where the two are equal at start). A drafter
    holding its own copy is refused by name (a reload would leave it stale); holding the
    target's lm_head itself, it attaches and the MTP layer's derived MLA tensors are adopted
    too."""
    src = ckpt_factory("deepseek-v3-tiny", seed=1)
    engine = "vllm-ascend-0.30.0rc2"
    ascend_config.weight_nz_mode = 0
    ascend_config.enable_mlapo = False
    layout = ParallelLayout(tp=1, speculative_method="mtp")
    meta = open_checkpoint(src)
    plan = build_plan(meta.config, layout, checkpoint=meta, engine=engine)
    head = "model.layers.3.shared_head.head"

    def worker(shared: bool) -> _Worker:
        w = _drafter_worker(plan.ranks[0], layout)
        _impls_as_objects(w.model_runner.model)
        drafter = w.model_runner.drafter.model
        _impls_as_objects(drafter)
        if shared:  # what the proposer does: the target's module itself
            _set(drafter, head + ".weight", torch.zeros(1))
            parent = drafter.get_submodule("model.layers.3.shared_head")
            parent.head = w.model_runner.model.get_submodule("lm_head")
        else:  # its own copy, loaded from the checkpoint's MTP head
            lm_head = w.model_runner.model.get_parameter("lm_head.weight")
            _set(drafter, head + ".weight", lm_head.data.clone())
        return w

    with pytest.raises(AdoptionError, match=rf"holds its own drafter\.{head}\.weight"):
        EngineReloader(_llm([worker(shared=False)], fake_vllm)).attach(src, engine=engine)
    w = worker(shared=True)
    status = EngineReloader(_llm([w], fake_vllm)).attach(src, engine=engine)
    tensors = status[0]["tensors"]
    assert "drafter.model.layers.3.eh_proj.weight" in tensors
    assert "drafter.model.layers.3.mtp_block.self_attn.mla_attn.mla_attn.impl.W_UK_T" in tensors


def test_deepseek_in_plain_vllm_is_refused_with_the_reason(ckpt_factory, fake_vllm):
    """Without vllm-ascend (--engine mxload), vLLM's own MLA post-load keeps W_UK_T / W_UV
    that no profile of plain vLLM describes: refused at attach, one line, naming --engine."""
    src = ckpt_factory("deepseek-v3-tiny", seed=1)
    workers = _workers(src, "mxload", layout=ParallelLayout(tp=2, enable_expert_parallel=True))
    with pytest.raises(AdoptionError) as err:
        EngineReloader(_llm(workers, fake_vllm)).attach(src, engine="mxload")
    msg = str(err.value)
    assert "\n" not in msg and err.value.key == "--engine"
    assert "DeepseekV3ForCausalLM cannot be reloaded in place: vLLM's MLAAttention" in msg
