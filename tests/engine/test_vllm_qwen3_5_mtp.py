"""mxload's Qwen3.5 MTP drafter (``drafter.*``) against vLLM 0.23.0's own MTP model, on CPU.

With ``--speculative-config '{"method": "mtp", ...}'`` vLLM's ``SpeculativeConfig`` derives
a draft model config from the target's checkpoint (``hf_config_override``: model_type
``qwen3_5_mtp``, architectures ``Qwen3_5MTP`` or ``Qwen3_5MoeMTP``), and the proposer's
``get_model`` builds that class (models/qwen3_5_mtp.py) under the target's ``VllmConfig``,
with the target's parallel layout, and runs its ``load_weights`` over the checkpoint. Then
the proposer replaces the drafter's ``embed_tokens`` and ``lm_head`` by the target's
(v1/spec_decode/llm_base_proposer.py ``_maybe_share_embeddings`` /
``_maybe_share_lm_head``); vllm-ascend 0.23.0.post1 keeps the drafter's own ``lm_head``
(the ``vllm-ascend-0.23`` profile).

tests/engine/vllm_model.py (``Models.with_drafter``) does the same on CPU: the
``SpeculativeConfig`` is vLLM's own, made from the target's ``ModelConfig`` and
``ParallelConfig``, and the drafter's class, parameters (``fc`` a ColumnParallelLinear,
the full-attention ``Qwen3_5DecoderLayer`` with the model's MLP or FusedMoE experts, the
three norms, ``ParallelLMHead``) and loaded values are vLLM's, on the stubs that module
names (process groups, platform, absent third-party modules).

Each rank's target and drafter parameters must equal, byte for byte, the buffers mxload
loads for that rank (tests/engine/test_vllm_qwen3_5.py's ``check_against_vllm``), for tp
1, 2 and 4 (and the MoE drafter's experts under expert parallelism), from the BF16 twin of
a ``qwen3.5-tiny`` whose block-FP8 checkpoint quantizes the MTP module too (the releases
leave it BF16: ``mtp`` in modules_to_not_convert), so that the MX session's drafter units
are checked against the independent reference's MXFP8 of vLLM's values. One layout runs
the vision tower in ``--mm-encoder-tp-mode data``: vLLM builds every vision linear
``disable_tp`` (whole on every rank).

Which of the drafter's rows each engine replaces by the target's is read by running the
engines' own ``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` on the models vLLM
built (vLLM 0.23.0's ``SpecDecodeBaseProposer``, imported; vllm-ascend 0.23.0.post1's
``AscendSpecDecodeBaseProposer``, whose module needs ``torch_npu``: its two methods are
taken out of its file by name and run unmodified) and compared with the profiles'
``drafter_own``.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mxload.orchestrator.plan.planner import plan_rank
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint
from mxload.orchestrator.tools.synth import make_checkpoint, preset_config

from tests.engine import sources
from tests.engine.test_vllm_qwen3_5 import check_against_vllm
from tests.engine.vllm_code import _node, _parsed
from tests.engine.vllm_model import Built, Models, RankOf, vllm_models


@pytest.fixture(scope="module")
def vllm() -> Iterator[Models]:
    """vLLM 0.23.0's model modules, imported once (tests/engine/vllm_model.py)."""
    with vllm_models() as models:
        yield models


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
    vllm: Models, checkpoints: dict[str, tuple[str, str]], case: str
) -> None:
    preset, layout, engine = CASES[case]
    own = engine != "mxload"
    seen: list[str] = []

    def with_drafter(checkpoint: str, at: RankOf) -> dict[str, torch.Tensor]:
        built = vllm.with_drafter(checkpoint, at)
        target = dict(built.target.named_parameters())
        drafter = {f"drafter.{n}": p for n, p in built.drafter.named_parameters()}
        # the proposer replaces the drafter's embedding by the target's, which holds the
        # same values: mxload writes the target's only
        emb = drafter.pop("drafter.model.embed_tokens.weight")
        assert torch.equal(emb, target["language_model.model.embed_tokens.weight"])
        head = drafter["drafter.lm_head.weight"]
        assert torch.equal(head, target["language_model.lm_head.weight"])
        if not own:  # vLLM shares the target's lm_head too
            del drafter["drafter.lm_head.weight"]
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
    n_mx = check_against_vllm(vllm, checkpoints[preset], layout, engine, with_drafter)
    assert n_mx > 0
    assert len([n for n in seen if n == "drafter.model.fc.weight"]) == layout.world
    assert ("drafter.lm_head.weight" in seen) == own


# --- which drafter rows each engine shares with the target --------------------------------

ASCEND_PIN = "0.23.0.post1"
ASCEND_PROPOSER = ("vllm_ascend/spec_decode/llm_base_proposer.py", "AscendSpecDecodeBaseProposer")
SHARE = ("_maybe_share_embeddings", "_maybe_share_lm_head")


def _ascend_methods(root: Path, models: Models) -> dict[str, Any]:
    """vllm-ascend's two methods, compiled from its file into a namespace of the names they
    read: torch, nn, and vLLM's own ``get_pp_group`` and ``logger``."""
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.logger import logger

    file, cls = ASCEND_PROPOSER
    text, tree = _parsed(root / file)
    ns: dict[str, Any] = {
        "torch": torch,
        "nn": torch.nn,
        "logger": logger,
        "get_pp_group": get_pp_group,
    }
    for name in SHARE:
        node = _node(tree, (cls, name))
        lines = text.splitlines()[node.lineno - 1 : node.end_lineno]  # type: ignore[attr-defined]
        source = "\n".join(line[4:] for line in lines)  # the class body's indent
        exec(compile(source, f"<vllm-ascend {name}>", "exec"), ns)
    return {name: ns[name] for name in SHARE}


def _shared_by(methods: dict[str, Any], built: Built, whole_to_lm_head: bool) -> set[str]:
    """Run an engine's ``_maybe_share_embeddings`` and ``_maybe_share_lm_head`` as its
    ``load_model`` does on the models vLLM built, and say which of the drafter's
    ``embed_tokens`` / ``lm_head`` became the target's. vLLM passes the target's language
    model to both; vllm-ascend the whole model to ``_maybe_share_lm_head``."""
    # the proposer's own state these methods read, named: the drafter, the method, no
    # graph capture, the VllmConfig the models were built under
    me = types.SimpleNamespace(
        model=built.drafter,
        method="mtp",
        use_compress=False,
        use_cuda_graph=False,
        use_local_argmax_reduction=False,
        vllm_config=built.vllm_config,
    )
    target = built.target
    lm = target.get_language_model()  # type: ignore[operator]
    methods["_maybe_share_embeddings"](me, lm)
    methods["_maybe_share_lm_head"](me, target if whole_to_lm_head else lm)
    drafter = built.drafter
    return {
        name
        for name, mine, theirs in (
            ("embed_tokens", drafter.model.embed_tokens, lm.model.embed_tokens),
            ("lm_head", drafter.lm_head, lm.lm_head),
        )
        if mine is theirs
    }


def test_the_engines_share_what_their_profiles_say(
    vllm: Models, checkpoints: dict[str, tuple[str, str]]
) -> None:
    """vLLM 0.23 shares the drafter's embedding and lm_head with the target (the mxload
    profile plans neither); vllm-ascend 0.23.0.post1 shares the embedding only (its
    profile plans ``drafter.lm_head``)."""
    from mxload.orchestrator.plan.engines import engine_profile
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    _, bf16 = checkpoints["qwen3.5-tiny"]
    at = RankOf(tp=1, tp_rank=0, speculative_method="mtp")
    ascend = _ascend_methods(sources.vllm_ascend_sdist(ASCEND_PIN), vllm)
    arch = "Qwen3_5ForConditionalGeneration"
    for methods, whole, profile in (
        ({n: getattr(SpecDecodeBaseProposer, n) for n in SHARE}, False, "mxload"),
        (ascend, True, "vllm-ascend-0.23"),
    ):
        shared = _shared_by(methods, vllm.with_drafter(bf16, at), whole)
        assert "embed_tokens" in shared, (profile, shared)
        own = engine_profile(profile).drafter_own.get(arch, ())
        assert ("drafter.lm_head" in own) == ("lm_head" not in shared), (profile, shared)
