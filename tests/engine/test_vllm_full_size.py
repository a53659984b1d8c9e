"""Full-size plans against vLLM 0.23.0's own model classes built on the meta device.

For tp 8 x dp 4 + EP, Qwen3.5-397B-A17B (vision tower included) and DeepSeek-V3 (the
packaged configs, their quantization dropped: the BF16 parameters vLLM builds) are built by
vLLM for a few ranks (tests/engine/vllm_model.py ``Models.meta_parameters``: no bytes, so
a 397B-parameter rank costs seconds), under the all2all backend each engine runs: vLLM's
own default for mxload's profile (plain vLLM: sequence-parallel MoE, the shared experts
whole on every TP rank), ``flashinfer_all2allv`` for vllm-ascend 0.23 (set by its
platform: TP-split). Every parameter's name, shape (through the profile's view back to
the loaders' dims), dtype and the rank's total bytes must equal the plan's buffers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
import pytest
from mxload.orchestrator.plan.config import parse_config
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import model_config

from tests.engine.vllm_model import ALL2ALL, Models, RankOf, vllm_models

pytestmark = pytest.mark.slow

ITEMSIZE = {"bfloat16": 2, "float32": 4, "float16": 2}


@pytest.fixture(scope="module")
def vllm() -> Iterator[Models]:
    with vllm_models() as models:
        yield models


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for name in ("qwen3.5-397b-a17b-fp8", "deepseek-v3"):
        cfg = model_config(name)
        cfg.pop("quantization_config", None)
        cfg.get("text_config", {}).pop("quantization_config", None)
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.json").write_text(json.dumps(cfg))
        out[name] = str(folder)
    return out


@pytest.mark.parametrize("engine", ["mxload", "vllm-ascend-0.23"])
@pytest.mark.parametrize("model", ["qwen3.5-397b-a17b-fp8", "deepseek-v3"])
def test_tp8_dp4_ep_ranks_equal_vllm_at_full_size(
    vllm: Models, folders: dict[str, str], model: str, engine: str
) -> None:
    layout = ParallelLayout(tp=8, dp=4, enable_expert_parallel=True)
    with open(os.path.join(folders[model], "config.json")) as f:
        config = parse_config(json.load(f))
    plan = build_plan(config, layout, engine=engine)
    backend = "" if engine == "mxload" else ALL2ALL
    for rank in (0, 31):
        rp = plan.ranks[rank]
        at = RankOf(
            tp=8, tp_rank=rp.tp_rank, dp=4, dp_rank=rp.dp_rank, expert_parallel=True,
            all2all_backend=backend,
        )  # fmt: skip
        params = vllm.meta_parameters(folders[model], at)
        held = {}
        # the tensors the engine derives in its post-load are no parameters (§2.4)
        derived = {d.buffer for u in rp.units for d in u.derived}
        for b in (b for b in rp.buffers if b.name not in derived):
            shape = b.shape
            if b.canonical_of_view:  # the profile's post-load view, back to the loaders' dims
                shape = tuple(shape[i] for i in np.argsort(b.canonical_of_view))
            held[b.name] = (tuple(shape), b.dtype)
        assert sorted(held) == sorted(params), (rank, set(held) ^ set(params))
        wrong = {k: (held[k], params[k]) for k in params if held[k] != params[k]}
        assert not wrong, (rank, list(wrong.items())[:4])
        engine_bytes = sum(int(np.prod(s)) * ITEMSIZE[d] for s, d in params.values())
        derived_bytes = sum(b.nbytes for b in rp.buffers if b.name in derived)
        assert rp.persistent_bytes - derived_bytes == engine_bytes, rank
