"""Which experts each EP rank holds under vllm-ascend, from each release's own code.

vllm-ascend replaces vLLM's expert map with its own: ``AscendFusedMoE.__init__`` calls
``init_eplb_config`` (``vllm_ascend/eplb/core/eplb_utils.py``), which, without EPLB or an
expert-map file, returns vLLM's ``determine_expert_map(ep_size, ep_rank, n_experts)`` with
no placement argument. So whatever ``--expert-placement`` the engine is given, and whatever
the model (DeepSeek-V3's expert groups included), the ranks hold contiguous runs. mxload
plans the vllm-ascend profiles linear and refuses ``round_robin`` for them; this test runs
the releases' ``init_eplb_config`` on top of vLLM's real ``expert_map_manager.py`` and holds
the result to mxload's plan, and the refusal's reason to what the code does.

Stand-ins, each an empty named module unless said: ``vllm.logger`` (a quiet logger),
``vllm.config.parallel`` (only the ``ExpertPlacementStrategy`` type alias is imported),
``vllm.model_executor.layers.fused_moe.config`` and ``...experts.rocm_aiter_moe`` (imported
by ``expert_map_manager.py`` for other functions).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import LayoutError
from mxload.orchestrator.plan.engines import engine_profile
from mxload.orchestrator.plan.layout import experts_for_rank
from mxload.orchestrator.plan.releases import RELEASES

from tests.engine import sources
from tests.engine.sources import QuietLogger, Stub, load_module, modules, package

DOWNLOADED = [r for r in RELEASES.values() if r.versions]
VLLM_OF = {"0.23.0": "0.23.0"}


def _init_eplb_config(release_version: str, vllm_version: str) -> Any:
    va = sources.vllm_ascend_sdist(release_version) / "vllm_ascend"
    vllm = sources.vllm_wheel(vllm_version) / "vllm"
    fused = "vllm.model_executor.layers.fused_moe"
    stubs = {
        "vllm": package("vllm", vllm),
        "vllm.logger": Stub(
            "vllm.logger", init_logger=lambda name: QuietLogger(), logger=QuietLogger()
        ),
        "vllm.config": Stub("vllm.config"),
        "vllm.config.parallel": Stub("vllm.config.parallel", ExpertPlacementStrategy=str),
        "vllm.model_executor": Stub("vllm.model_executor"),
        "vllm.model_executor.layers": Stub("vllm.model_executor.layers"),
        fused: package(fused, vllm / "model_executor" / "layers" / "fused_moe"),
        f"{fused}.config": Stub(f"{fused}.config", FusedMoEParallelConfig=object),
        f"{fused}.experts": Stub(f"{fused}.experts"),
        f"{fused}.experts.rocm_aiter_moe": Stub(
            f"{fused}.experts.rocm_aiter_moe", init_aiter_topK_meta_data=None
        ),
        "vllm_ascend": package("vllm_ascend", va),
    }
    with modules(stubs):
        load_module(
            f"{fused}.expert_map_manager",
            vllm / "model_executor" / "layers" / "fused_moe" / "expert_map_manager.py",
        )
        utils = load_module(
            "vllm_ascend.eplb.core.eplb_utils", va / "eplb" / "core" / "eplb_utils.py"
        )
        return utils.init_eplb_config


@pytest.fixture(scope="module")
def init_eplb_configs() -> dict[str, Any]:
    return {
        r.name: _init_eplb_config(r.versions[-1], VLLM_OF.get(r.vllm, "0.30.0")) for r in DOWNLOADED
    }


@pytest.mark.parametrize("name", [r.name for r in DOWNLOADED])
@pytest.mark.parametrize("experts,ep", [(256, 8), (10, 4)])  # DeepSeek-V3's count; a remainder
def test_vllm_ascend_places_experts_linearly(
    name: str, experts: int, ep: int, init_eplb_configs: dict[str, Any]
) -> None:
    init = init_eplb_configs[name]
    eplb = SimpleNamespace(expert_map_path=None, dynamic_eplb=False, num_redundant_experts=0)
    for rank in range(ep):
        moe = SimpleNamespace(num_experts=experts, ep_size=ep, ep_rank=rank)
        out = init(eplb, 0, moe)
        expert_map = out[1]
        held = tuple(int(e) for e in torch.nonzero(expert_map >= 0).flatten())
        assert held == experts_for_rank(experts, ep, rank, "linear"), (name, rank)
        assert held != experts_for_rank(experts, ep, rank, "round_robin"), (name, rank)


def test_round_robin_refusal_names_what_the_engine_does() -> None:
    # The refusal applies to every vllm-ascend profile and every model, DeepSeek-V3 included.
    from mxload.orchestrator.plan.engines import check_expert_placement

    for profile_name in ("vllm-ascend-0.23", "vllm-ascend-main"):
        with pytest.raises(LayoutError) as err:
            check_expert_placement(engine_profile(profile_name), "round_robin", uses_ep=True)
        msg = str(err.value)
        assert "init_eplb_config" in msg and "linear" in msg and "Qwen3-MoE" not in msg
