"""mxload's DeepSeek-V3 MTP drafter (``drafter.*``) against vLLM 0.23.0's own DeepSeekMTP, on CPU.

With ``--speculative-config '{"method": "mtp", ...}'`` on a DeepSeek-V3 checkpoint, vLLM's
``SpeculativeConfig`` makes the draft model config ``DeepSeekMTPModel``
(``hf_config_override``), and the proposer builds ``DeepSeekMTP`` (models/deepseek_mtp.py)
under the target's ``VllmConfig`` and runs its ``load_weights`` over the checkpoint: the
layer ``model.layers.{num_hidden_layers}`` becomes ``enorm``, ``hnorm``, ``eh_proj`` (a
plain ``nn.Linear``), ``shared_head`` and ``mtp_block`` (a ``DeepseekV2DecoderLayer``: MLA
attention and the MoE block with its shared and routed experts, sharded as the model's).
The proposer then replaces its ``embed_tokens`` and ``shared_head.head`` by the target's
(``_maybe_share_embeddings`` / ``_maybe_share_lm_head``), so mxload holds neither.
tests/engine/vllm_model.py (``Models.with_drafter``) builds both models with vLLM's own
classes and loaders; each rank's target and drafter parameters must equal, byte for byte,
the buffers mxload loads for that rank (tests/engine/test_vllm_qwen3_5.py's
``check_against_vllm``: the BF16 twin, and the block-FP8 checkpoint's MX units against the
independent reference), for tp 1 and tp 2 x dp 2 with expert parallelism (the MTP layer's
experts placed as the model's).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from mxload.orchestrator.plan.types import ParallelLayout

from tests.engine import test_vllm_qwen3_5 as q35
from tests.engine.vllm_model import Models, RankOf, vllm_models

PRESET = "deepseek-v3-tiny"
MTP = {"speculative_method": "mtp"}
LAYOUTS = {
    "tp1": ParallelLayout(tp=1, **MTP),
    "tp2xdp2-ep": ParallelLayout(tp=2, dp=2, enable_expert_parallel=True, **MTP),
}
SHARED = ("model.embed_tokens.weight", "model.layers.3.shared_head.head.weight")
"""The drafter's rows the proposer replaces by the target's (pp 1)."""


@pytest.fixture(scope="module")
def vllm() -> Iterator[Models]:
    with vllm_models() as models:
        yield models


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp(PRESET)
    fp8, bf16 = str(root / "fp8"), str(root / "bf16")
    q35.make_checkpoint(fp8, PRESET, seed=4)
    q35.make_checkpoint(bf16, PRESET, seed=4, bf16=True)
    return fp8, bf16


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_rank_drafter_equals_vllm_0_23_deepseek_mtp_parameters(
    vllm: Models, checkpoints: tuple[str, str], name: str
) -> None:
    seen: list[str] = []

    def with_drafter(checkpoint: str, at: RankOf) -> dict[str, torch.Tensor]:
        built = vllm.with_drafter(checkpoint, at)
        assert type(built.drafter).__name__ == "DeepSeekMTP"
        target = dict(built.target.named_parameters())
        drafter = dict(built.drafter.named_parameters())
        for n in SHARED:
            assert n in drafter, n
            del drafter[n]
        drafter = {f"drafter.{n}": p for n, p in drafter.items()}
        assert drafter.keys().isdisjoint(target)
        seen.extend(drafter)
        return {**target, **drafter}

    n_mx = q35.check_against_vllm(vllm, checkpoints, LAYOUTS[name], "mxload", with_drafter)
    assert n_mx > 0
    layout = LAYOUTS[name]
    block = "drafter.model.layers.3.mtp_block."
    assert seen.count("drafter.model.layers.3.eh_proj.weight") == layout.world
    assert seen.count(block + "mlp.experts.w13_weight") == layout.world
    assert seen.count(block + "self_attn.kv_b_proj.weight") == layout.world
