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


def _with_head(src: str, dst: str, equal: bool) -> str:
    """A copy of checkpoint ``src`` whose MTP ``shared_head.head`` is (``equal``) or is not
    the model's ``lm_head``, as DeepSeek-V3's release ships it and a trainer may not."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    files = sorted(Path(dst).glob("*.safetensors"))
    tensors = {f: load_file(str(f)) for f in files}
    lm_head = next(t["lm_head.weight"] for t in tensors.values() if "lm_head.weight" in t)
    for f, t in tensors.items():
        if "model.layers.3.shared_head.head.weight" in t:
            t["model.layers.3.shared_head.head.weight"] = (
                lm_head.clone() if equal else lm_head.clone() * 2
            )
            save_file(t, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_which_engine_shares_the_mtp_head_with_lm_head(
    vllm: Models, checkpoints: tuple[str, str], tmp_path
) -> None:
    """vLLM 0.23's proposer replaces the drafter's shared_head.head by the target's lm_head
    whatever it holds (mxload plans it shared); vllm-ascend 0.23.0.post1's only where the two
    are equal at start, else the drafter keeps its own (the worker extension refuses that,
    tests/unit/test_engine_ext.py). Both engines' own ``_maybe_share_*`` methods run on the
    models vLLM built (tests/engine/test_vllm_qwen3_5_mtp.py's ``_ascend_methods``)."""
    import types

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from tests.engine import sources
    from tests.engine.test_vllm_qwen3_5_mtp import ASCEND_PIN, SHARE, _ascend_methods

    _, bf16 = checkpoints
    at = RankOf(tp=1, tp_rank=0, speculative_method="mtp")
    ascend = _ascend_methods(sources.vllm_ascend_sdist(ASCEND_PIN), vllm)
    plain = {n: getattr(SpecDecodeBaseProposer, n) for n in SHARE}
    shared = {}
    for equal in (True, False):
        src = _with_head(bf16, str(tmp_path / f"equal-{equal}"), equal)
        for name, methods in (("vllm", plain), ("vllm-ascend", ascend)):
            built = vllm.with_drafter(src, at)
            me = types.SimpleNamespace(
                model=built.drafter,
                method="mtp",
                use_compress=False,
                use_cuda_graph=False,
                use_local_argmax_reduction=False,
                vllm_config=built.vllm_config,
            )
            methods["_maybe_share_embeddings"](me, built.target)
            methods["_maybe_share_lm_head"](me, built.target)
            layer = built.drafter.model.layers["3"]
            shared[(name, equal)] = layer.shared_head.head is built.target.lm_head
            assert built.drafter.model.embed_tokens is built.target.model.embed_tokens
    assert shared == {
        ("vllm", True): True,
        ("vllm", False): True,
        ("vllm-ascend", True): True,
        ("vllm-ascend", False): False,
    }
