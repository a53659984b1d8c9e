"""Parallel layouts: rank coordinates, pipeline stages, expert placement, shard ranges. Pure.

Everything here follows vLLM's conventions as docs/contract.md §3 states them, so that a rank's
buffers are the ones the inference engine's parameters have:

* ``rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank``;
* pipeline: ``L // pp`` layers per stage, the ``L % pp`` extra layers one each to the
  stages just before the last, counting backwards (vLLM ``get_pp_indices``);
* MoE without expert parallel: each expert TP-sharded over the flattened ``dp * tp``
  group; with it: ``ep = dp * tp`` ranks holding whole experts, placed ``linear`` or
  ``round_robin``;
* kv heads: split over tp when ``kv % tp == 0``, else (``tp % kv == 0``) each kv head is
  replicated on ``tp / kv`` ranks.

:func:`validate_layout` refuses a layout the model cannot take, with the reason and the
flag to change. It reads the split dimensions from the architecture table
(``mxload.orchestrator.plan.arch``), so a new architecture gets its checks for free.

Decision: ``--enable-expert-parallel`` on a dense model is accepted and does nothing
(vLLM accepts it too: there are no experts to place); the plan reports ``ep_rank`` 0.
"""

from __future__ import annotations

from ..errors import LayoutError
from .arch import (
    LAYER_KINDS,
    Architecture,
    SourceSpec,
    TensorRule,
    architecture_for,
)
from .config import ModelConfig
from .formats import VOCAB_PAD, ceil_div
from .types import ParallelLayout

PLACEMENTS = ("linear", "round_robin")
"""Expert placements vLLM knows (``--expert-placement``)."""


def padded_vocab(vocab_size: int) -> int:
    """V rounded up to a multiple of 64, as vLLM's VocabParallelEmbedding pads it."""
    return ceil_div(vocab_size, VOCAB_PAD) * VOCAB_PAD


def uses_expert_parallel(config: ModelConfig, layout: ParallelLayout) -> bool:
    """EP is in effect only on a model with routed experts (a no-op on dense models)."""
    return layout.enable_expert_parallel and config.is_moe


def ep_size(layout: ParallelLayout) -> int:
    """Size of the expert (or MoE tensor) group of one pipeline stage: dp * tp."""
    return layout.dp * layout.tp


def ep_rank_of(layout: ParallelLayout, dp_rank: int, tp_rank: int) -> int:
    """Rank within the expert group (also the MoE-TP rank without EP): dp_rank*tp + tp_rank."""
    return dp_rank * layout.tp + tp_rank


def rank_coords(layout: ParallelLayout, rank: int) -> tuple[int, int, int]:
    """``(dp_rank, pp_rank, tp_rank)`` of global ``rank`` (vLLM's order, docs/contract.md §3)."""
    _check_degrees(layout)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world:
        raise LayoutError(
            f"rank {rank!r} is outside the world of {layout.world} ranks "
            f"(tp {layout.tp} x dp {layout.dp} x pp {layout.pp})",
            rank=rank,
        )
    tp_rank = rank % layout.tp
    pp_rank = (rank // layout.tp) % layout.pp
    dp_rank = rank // (layout.tp * layout.pp)
    return dp_rank, pp_rank, tp_rank


def pipeline_layers(num_layers: int, pp: int, pp_rank: int) -> tuple[int, ...]:
    """Decoder layers of stage ``pp_rank``: contiguous, ``L // pp`` each, the ``L % pp``
    extras one each to the stages just before the last (L=94, pp=4 -> 23, 24, 24, 23)."""
    if pp < 1:
        raise LayoutError(f"--pp must be >= 1, got {pp}", key="--pp")
    if pp > num_layers:
        raise LayoutError(
            f"--pp {pp} is more pipeline stages than the model's {num_layers} layers "
            "(num_hidden_layers)",
            key="--pp",
        )
    if not 0 <= pp_rank < pp:
        raise LayoutError(f"pipeline stage {pp_rank} is outside 0..{pp - 1}", key="--pp")
    base, extra = divmod(num_layers, pp)
    # vLLM: partitions[-i] += 1 for i in 2..extra+1, i.e. stages pp-2 down to pp-1-extra.
    sizes = [base + (1 if pp - 1 - extra <= s <= pp - 2 else 0) for s in range(pp)]
    start = sum(sizes[:pp_rank])
    return tuple(range(start, start + sizes[pp_rank]))


def experts_for_rank(num_experts: int, ep: int, ep_rank: int, placement: str) -> tuple[int, ...]:
    """Global expert ids held by ``ep_rank`` of ``ep``, in local order (docs/contract.md §3).

    ``base = E // ep``, ``rem = E % ep``; rank ``r`` holds ``base + (r < rem)`` experts:
    ``linear`` the contiguous run from ``r*base + min(r, rem)``, ``round_robin``
    ``r, r + ep, r + 2*ep, ...``.
    """
    if ep < 1 or not 0 <= ep_rank < ep:
        raise LayoutError(f"expert-parallel rank {ep_rank} is outside 0..{ep - 1}")
    if placement not in PLACEMENTS:
        raise LayoutError(
            f"--expert-placement {placement!r} is not one of {', '.join(PLACEMENTS)}",
            key="--expert-placement",
        )
    base, rem = divmod(num_experts, ep)
    if placement == "linear":
        start = ep_rank * base + min(ep_rank, rem)
        return tuple(range(start, start + base + (1 if ep_rank < rem else 0)))
    return tuple(range(ep_rank, num_experts, ep))


def even_split(count: int, per_unit: int, ways: int, index: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of shard ``index`` of ``count`` units of ``per_unit`` split
    ``ways`` ways (count % ways == 0 is checked by validate_layout)."""
    share = count // ways * per_unit
    return index * share, (index + 1) * share


def kv_head_rows(kv_heads: int, head_dim: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Rows of the k/v projection held by ``tp_rank`` (docs/contract.md §3): split when
    ``kv % tp == 0``, else head ``tp_rank // (tp / kv)``, replicated on ``tp / kv`` ranks."""
    if tp <= kv_heads:
        return even_split(kv_heads, head_dim, tp, tp_rank)
    shard = tp_rank // (tp // kv_heads)
    return shard * head_dim, (shard + 1) * head_dim


def _check_degrees(layout: ParallelLayout) -> None:
    for flag, value in (("--tp", layout.tp), ("--dp", layout.dp), ("--pp", layout.pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{flag} must be an integer >= 1, got {value!r}", key=flag)
    if layout.expert_placement not in PLACEMENTS:
        raise LayoutError(
            f"--expert-placement {layout.expert_placement!r} is not one of "
            + ", ".join(PLACEMENTS),
            key="--expert-placement",
        )


def _rule_present(rule: TensorRule, config: ModelConfig, layout: ParallelLayout) -> bool:
    if rule.place in ("vision", "vision_layer"):
        return config.vision is not None and not layout.language_model_only
    if rule.place in ("mtp", "mtp_layer"):
        return layout.speculative_method == "mtp" and config.mtp_layers > 0
    if rule.place != "layer":
        return True
    kind = LAYER_KINDS[rule.when]
    return any(kind(config, i) for i in range(config.num_hidden_layers))


class _Problems:
    """Reasons a layout is refused, each with the flag to change and the tensors it hits."""

    def __init__(self) -> None:
        self.reasons: dict[str, tuple[str, list[str]]] = {}

    def add(self, reason: str, flag: str, tensor: str = "") -> None:
        _, tensors = self.reasons.setdefault(reason, (flag, []))
        if tensor and tensor not in tensors:
            tensors.append(tensor)

    def split(
        self,
        arch: Architecture,
        config: ModelConfig,
        dim_name: str,
        ways: int,
        flag: str,
        tensor: str,
    ) -> None:
        dim = arch.dims[dim_name]
        count = dim.count(config)
        if count % ways != 0:
            hint = ""
            if dim.key.startswith("vision_config."):
                hint = (
                    " (--language-model-only plans no vision tower; --mm-encoder-tp-mode "
                    "data holds it whole on every TP rank)"
                )
            self.add(f"{dim.key} ({count}) is not divisible by {flag} ({ways}){hint}", flag, tensor)


def _source_problems(
    problems: _Problems,
    arch: Architecture,
    config: ModelConfig,
    layout: ParallelLayout,
    rule: TensorRule,
    src: SourceSpec,
) -> None:
    tp = layout.tp
    if rule.style == "column" and src.split == "kv_heads":
        dim = arch.dims[src.dims[0]]
        kv = dim.count(config)
        if kv % tp != 0 and tp % kv != 0:
            problems.add(
                f"{dim.key} ({kv}) and --tp ({tp}) do not divide one another (kv heads are "
                "split when kv % tp == 0 and replicated when tp % kv == 0)",
                "--tp",
                rule.name,
            )
    elif rule.style == "column":
        problems.split(arch, config, src.dims[0], tp, "--tp", rule.name)
    elif rule.style == "row":
        problems.split(arch, config, src.dims[1], tp, "--tp", rule.name)


SPECULATIVE_METHODS = ("mtp",)
"""vLLM ``speculative_config`` methods mxload plans (the checkpoint's own MTP module)."""

MTP_PP_REASON = (
    "vLLM 0.23 builds the MTP drafter on the last pipeline stage only, where "
    "Qwen3_5MultiTokenPredictor.forward expects the intermediate tensors of a previous "
    "stage that the proposer never passes (qwen3_5_mtp.py forward, "
    "v1/spec_decode/llm_base_proposer.py build_model_inputs_first_pass; vllm-ascend "
    "0.23.0.post1 lets the drafter's config through with pp > 1 but runs that forward "
    "unchanged), and a DeepSeekMTP drafter then loads its own embed_tokens "
    "(_maybe_share_embeddings shares it at pp 1 only), which mxload does not plan; use --pp 1"
)
"""Why MTP with pipeline parallelism is refused."""


def _speculative_problems(
    problems: _Problems, arch: Architecture, config: ModelConfig, layout: ParallelLayout
) -> None:
    """MTP needs the checkpoint's MTP layers, a table that plans them, and --pp 1."""
    if not layout.speculative_method:
        return
    flag = "--speculative-config"
    if layout.speculative_method not in SPECULATIVE_METHODS:
        problems.add(
            f"{flag} method {layout.speculative_method!r} is not one mxload plans "
            f"({', '.join(SPECULATIVE_METHODS)})",
            flag,
        )
    elif not config.mtp_layers:
        problems.add(
            f"{flag} method 'mtp' needs the checkpoint's MTP layers, and the config declares none "
            "(mtp_num_hidden_layers / num_nextn_predict_layers)",
            flag,
        )
    elif not arch.rules_at("mtp_layer"):
        problems.add(
            f"{flag} method 'mtp': {arch.name}'s MTP layers are in no table of mxload "
            "(it plans those of Qwen3.5, Qwen3.5-MoE and DeepSeek-V3)",
            flag,
        )
    elif layout.pp > 1:
        problems.add(f"{flag} method 'mtp' with --pp {layout.pp}: {MTP_PP_REASON}", flag)


def validate_layout(
    config: ModelConfig, layout: ParallelLayout, shared_experts_whole: bool = False
) -> None:
    """Refuse a layout the model cannot take: one LayoutError listing every reason, each
    with the tensors it concerns (docs/contract.md §5); ``key`` names the flag of the first
    reason. ``shared_experts_whole``: the engine's MoE mode holds them unsplit."""
    _check_degrees(layout)
    arch = (
        architecture_for(config)
        .for_layout(layout.mm_encoder_tp_mode)
        .for_engine(shared_experts_whole, ())
    )
    problems = _Problems()
    _speculative_problems(problems, arch, config, layout)
    if layout.pp > config.num_hidden_layers:
        problems.add(
            f"--pp ({layout.pp}) is more pipeline stages than num_hidden_layers "
            f"({config.num_hidden_layers})",
            "--pp",
        )
    moe_group = ep_size(layout)
    for rule in arch.rules:
        if not _rule_present(rule, config, layout):
            continue
        if rule.style == "vocab":
            vp = padded_vocab(config.vocab_size)
            if vp % layout.tp != 0:
                problems.add(
                    f"vocab_size ({config.vocab_size}, padded to {vp}) is not divisible by "
                    f"--tp ({layout.tp})",
                    "--tp",
                    rule.name,
                )
        elif rule.style == "moe" and uses_expert_parallel(config, layout):
            if config.num_experts < moe_group:
                problems.add(
                    f"{arch.dims['E'].key} ({config.num_experts}) is fewer than the "
                    f"expert-parallel group dp*tp ({moe_group}): some ranks would hold "
                    "no expert; lower --dp/--tp or drop --enable-expert-parallel",
                    "--enable-expert-parallel",
                    rule.name,
                )
        elif rule.style == "moe":
            # Without EP each expert is TP-sharded over dp*tp: gate and up (w13) split
            # their rows, down (w2) its columns.
            for k, src in enumerate(rule.sources):
                dim = src.dims[0] if k < 2 else src.dims[1]
                problems.split(arch, config, dim, moe_group, "dp*tp", rule.name)
        else:
            for src in rule.sources:
                _source_problems(problems, arch, config, layout, rule, src)
    if problems.reasons:
        listed = [
            reason + (f" [{', '.join(tensors)}]" if tensors else "")
            for reason, (_, tensors) in problems.reasons.items()
        ]
        first_flag = next(iter(problems.reasons.values()))[0]
        raise LayoutError(
            f"{config.source}: layout tp={layout.tp} dp={layout.dp} pp={layout.pp}"
            f"{' with expert parallel' if layout.enable_expert_parallel else ''}"
            f"{' with MTP' if layout.speculative_method else ''} does not fit "
            f"{config.architecture}: " + "; ".join(listed),
            file=config.source,
            key="--dp" if first_flag == "dp*tp" else first_flag,
        )
