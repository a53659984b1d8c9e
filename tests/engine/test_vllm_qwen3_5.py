"""mxload's Qwen3.5 and Qwen3.5-MoE sharding against vLLM 0.23.0's own models, on CPU.

vllm-ascend 0.23.0.post1 builds on vLLM 0.23.0, whose ``models/qwen3_5.py`` loads Qwen3.5.
tests/engine/vllm_model.py imports it whole from the ``--no-deps`` wheel (the test cache;
skipped, saying so, when the index cannot be reached) and, for every rank of a layout,
builds ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` with
vLLM's own ``VllmConfig`` and runs the model's own ``load_weights`` on the BF16 twin of
the preset. So the parameters (names, shapes, dtypes: ``A_log`` float32, QKV head
bookkeeping, the vision tower built by default, ``make_layers``'s stage split with
``PPMissingLayer`` for the rest, FusedMoE's local experts) and their values (the
``AutoWeightsLoader`` routing with ``hf_to_vllm_mapper``, ``mtp.*`` skipped, every weight
loader) are vLLM's. What is stubbed, and why, is listed in that module's docstring: the
process groups (given the rank under test), the MLA attention backend choice and one
device kernel (DeepSeek only), and third-party modules imported but never run.

Each rank's parameters must equal, byte for byte, the buffers mxload loads for that rank
(names, shapes, dtypes, bytes); and the same plan made for the block-FP8 checkpoint
(loaded from the BF16 twin, as a reload does) must hold, for every MX unit, the
independent reference's MXFP8 (tests/independent_ref.py) of vLLM's value. BF16 because
vLLM's block-FP8 loaders require shards aligned to 128-row tiles, which a tiny model does
not have at tp 2 and 4.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout, Plan
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.runtime.reload import reload_inputs
from mxload.orchestrator.tools.synth import make_checkpoint
from mxload.workers.numerics.select import select_backend
from mxload.workers.rank.loader import RankLoader

from tests.engine.vllm_model import ALL2ALL, Models, RankOf, vllm_models
from tests.independent_ref import mx_quantize_ref, same_e4m3_bytes


@pytest.fixture(scope="module")
def vllm() -> Iterator[Models]:
    """vLLM 0.23.0's model modules, imported once (tests/engine/vllm_model.py)."""
    with vllm_models() as models:
        yield models


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
    models: Models,
    ckpts: tuple[str, str],
    layout: ParallelLayout,
    engine: str,
    parameters: Callable[[str, RankOf], dict[str, torch.Tensor]] | None = None,
) -> int:
    """Every rank of ``layout``: the plain session equals vLLM's parameters byte for byte;
    the MX session's MX units are the independent reference's MXFP8 of them. Returns how
    many MX buffers were compared. ``parameters`` gives a rank's engine parameters by
    mxload's names (default: the model's, ``Models.parameters``)."""
    parameters = parameters or models.parameters
    # plain vLLM (mxload's profile) runs its own default backend; vllm-ascend sets ALL2ALL
    # unless told otherwise (the layout's backend then stands for what the engine runs)
    backend = layout.all2all_backend or ("" if engine == "mxload" else ALL2ALL)
    fp8, bf16 = ckpts
    plain_meta, mx_meta = open_checkpoint(bf16), open_checkpoint(fp8)
    plain_plan = build_plan(plain_meta.config, layout, checkpoint=plain_meta, engine=engine)
    mx_plan = build_plan(mx_meta.config, layout, checkpoint=mx_meta, engine=engine)
    plain, mx = mxload_ranks(plain_plan, bf16), mxload_ranks(mx_plan, bf16)
    n_mx = 0
    for r, rp in enumerate(plain_plan.ranks):
        engine_params = parameters(
            bf16,
            RankOf(
                tp=layout.tp,
                tp_rank=rp.tp_rank,
                pp=layout.pp,
                pp_rank=rp.pp_rank,
                dp=layout.dp,
                dp_rank=rp.dp_rank,
                expert_parallel=layout.enable_expert_parallel,
                language_model_only=layout.language_model_only,
                mm_encoder_tp_mode=layout.mm_encoder_tp_mode,
                speculative_method=layout.speculative_method,
                all2all_backend=backend,
            ),
        )
        # 1. the plain session: every buffer is the engine's parameter, byte for byte, but
        #    the tensors the engine derives in its post-load (not parameters; §2.4, checked
        #    against the engine's own post-load in test_vllm_ascend_mla.py)
        derived = {d.buffer for u in rp.units for d in u.derived}
        held = sorted(n for n in plain[r] if n not in derived)
        assert held == sorted(engine_params), (r, set(held) ^ set(engine_params))
        plain_specs = {b.name: b for b in plain_plan.ranks[r].buffers}
        for pname, p in engine_params.items():
            b = plain[r][pname]
            if plain_specs[pname].canonical_of_view:
                # the profile's post-load view (vllm-ascend's, tests/engine/test_vllm_ascend.py)
                # of what vLLM's loaders fill: back to the loaders' dims
                b = b.permute(*np.argsort(plain_specs[pname].canonical_of_view)).contiguous()
            assert (tuple(b.shape), b.dtype) == (tuple(p.shape), p.dtype), (r, pname)
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
    vllm: Models, checkpoints: dict[str, tuple[str, str]], name: str
) -> None:
    # the profile of the engine built on vLLM 0.23
    n_mx = check_against_vllm(vllm, checkpoints["qwen3.5-tiny"], LAYOUTS[name], ENGINE)
    assert n_mx > 0  # in_proj_qkvz, out_proj, qkv_proj, o_proj, the MLP where K allows


MOE_LAYOUTS = {
    "tp1": ParallelLayout(tp=1),
    "tp4": ParallelLayout(tp=4),
    "tp4-ep": ParallelLayout(tp=4, enable_expert_parallel=True),
    # experts over dp*tp = 4: TP-sharded (I / 4 = 32) or whole (2 per rank)
    "tp2xdp2": ParallelLayout(tp=2, dp=2),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True),
    # plain vLLM's backend named: sequence-parallel MoE, the shared expert whole on every
    # TP rank (mxload's profile), also under vllm-ascend 0.23 (it honours disable_tp)
    "tp2xdp2-ep-sp": ParallelLayout(
        tp=2, dp=2, enable_expert_parallel=True, all2all_backend="allgather_reducescatter"
    ),
    # make_layers/get_pp_indices: layers 0-1 and 2-3, PPMissingLayer elsewhere;
    # embed_tokens on both stages, which the engine's profile knows
    "tp2-pp2": ParallelLayout(tp=2, pp=2),
}


@pytest.mark.parametrize("name", sorted(MOE_LAYOUTS))
def test_every_rank_equals_vllm_0_23_qwen3_5_moe_parameters(
    vllm: Models, checkpoints: dict[str, tuple[str, str]], name: str
) -> None:
    # mxload's profile: FusedMoE's parameters as vLLM's loaders leave them, [E, 2I, H] and
    # [E, H, I] (vllm-ascend's post-load re-views them; tests/engine/test_vllm_ascend.py).
    # On two stages, the engine's profile: vLLM 0.23 builds embed_tokens on every stage,
    # which the mxload profile does not hold
    layout = MOE_LAYOUTS[name]
    engine = ENGINE if layout.pp > 1 else "mxload"
    n_mx = check_against_vllm(vllm, checkpoints["qwen3.5-moe-tiny"], layout, engine)
    assert n_mx > 0


@pytest.mark.parametrize("name", ["tp2xdp2-ep", "tp2xdp2-ep-sp"])
def test_tp2xdp2_ep_qwen3_5_moe_under_vllm_ascend_0_23(
    vllm: Models, checkpoints: dict[str, tuple[str, str]], name: str
) -> None:
    """vllm-ascend 0.23's MoE mode: no sequence-parallel MoE (its backend), the shared
    expert TP-split; with vLLM's SP backend (pass_config.enable_sp) whole, as vLLM's model
    builds it."""
    layout = MOE_LAYOUTS[name]
    assert check_against_vllm(vllm, checkpoints["qwen3.5-moe-tiny"], layout, ENGINE) > 0


def test_a_config_without_vision_config_plans_the_tower_vllm_fills_in() -> None:
    """vLLM's own ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` (from the wheel, on CPU) build
    a default vision tower when config.json has no ``vision_config``: mxload plans that
    tower, field for field, so a checkpoint holding a tower is never left unloaded; the
    tiny preset's own tower then differs from it and the plan is refused naming a
    vision tensor (a checkpoint without the tower loads with --language-model-only)."""
    from mxload.orchestrator.errors import InputError
    from mxload.orchestrator.plan.config import parse_config
    from mxload.orchestrator.tools.synth import preset_config

    from tests.engine import sources

    version = "0.23.0"  # what this module tests (later releases' config code needs transformers 5)
    path = sources.vllm_wheel(version) / "vllm" / "transformers_utils" / "configs"
    for preset, module, cls in (
        ("qwen3.5-tiny", "qwen3_5", "Qwen3_5Config"),
        ("qwen3.5-moe-tiny", "qwen3_5_moe", "Qwen3_5MoeConfig"),
    ):
        mod = sources.load_module(f"mxload_test_vllm_{module}_{version}", path / f"{module}.py")
        raw = dict(preset_config(preset))
        del raw["vision_config"]
        engine = getattr(mod, cls)(text_config=raw["text_config"]).vision_config
        planned = parse_config(raw, preset).vision
        assert planned is not None, f"{preset}: vLLM {version} builds a tower, none planned"
        for field in dataclasses.fields(planned):
            assert getattr(planned, field.name) == getattr(engine, field.name), field.name
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/ck"
        make_checkpoint(src, "qwen3.5-tiny", seed=1)
        cfg_path = f"{src}/config.json"
        with open(cfg_path) as f:
            raw = json.load(f)
        del raw["vision_config"]
        with open(cfg_path, "w") as f:
            json.dump(raw, f)
        meta = open_checkpoint(src)
        with pytest.raises(InputError, match=r"model\.visual\."):
            build_plan(meta.config, ParallelLayout(tp=1), checkpoint=meta)
        lm_only = ParallelLayout(tp=1, language_model_only=True)
        assert build_plan(meta.config, lm_only, checkpoint=meta).ranks
