"""Engine releases: what each vllm-ascend release can serve and what mxload refuses, as data.
Pure.

:mod:`mxload.orchestrator.plan.engines` says how an engine *holds* its parameters (names,
views); this table says, per release an operator actually installs, which checkpoint
formats the release accepts at start (its platform's supported quantization list, which
vLLM checks before loading anything), which of mxload's ``convert --format`` outputs it
serves, which profile describes its parameters, and which engine settings mxload must
refuse because the engine would then hold something no in-place write can reach (a
FRACTAL_NZ cast that reallocates, per-expert clone lists, experts moved by EPLB).

The installed release is matched by exact version (:func:`release_of_version`): a release
nobody has read is refused, listing the known ones, never mapped to the nearest guess.
Each fact names the source lines it was read from (sdists: ``pip download --no-deps
vllm-ascend==X``; vLLM from the wheel the release builds on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import UsageError

ACL_FORMAT_FRACTAL_NZ = 29
"""torch_npu's storage-format code of FRACTAL_NZ (vllm_ascend/utils.py:56 in 0.23.0.post1)."""

FORMATS = ("modelopt", "ascend")
"""``mxload convert --format`` values: ``modelopt`` (ModelOpt MXFP8, config.json
``quantization_config``; served by vLLM's ``modelopt_mxfp8`` method) and ``ascend``
(vllm-ascend's own description, ``quant_model_description.json`` with per-tensor
``W8A8_MXFP8``; served by ``--quantization ascend``)."""

QUANTIZATION_OF_FORMAT = {"modelopt": "modelopt_mxfp8", "ascend": "ascend"}
"""The vLLM quantization method name each format is dispatched to."""


@dataclass(frozen=True)
class SourceRef:
    """Where a fact of a profile or a release was read: file and lines of the engine's
    source."""

    what: str
    where: str


@dataclass(frozen=True)
class Refusal:
    """An engine setting mxload cannot honour unless it has one of ``allowed`` values."""

    setting: str
    """How the engine names it (``additional_config.weight_nz_mode``, an environment
    variable, ``parallel_config.enable_eplb``)."""
    allowed: tuple[str, ...]
    default: str
    """The value the engine uses when the setting is not given."""
    fix: str
    """The exact change that makes the engine acceptable."""
    reason: str


@dataclass(frozen=True)
class EngineRelease:
    """One vllm-ascend release as users install it."""

    name: str
    """``--engine`` name: ``vllm-ascend-<version>``."""
    versions: tuple[str, ...]
    """Installed package versions this entry describes (exact)."""
    vllm: str
    """The vLLM release it is built on."""
    profile: str
    """The engine profile (parameter names and views) of this release."""
    quantizations: tuple[str, ...]
    """The platform's supported quantization methods: any other is refused at start."""
    formats: tuple[str, ...]
    """``mxload convert --format`` outputs this release serves."""
    refusals: tuple[Refusal, ...]
    architectures: Mapping[str, tuple[Refusal, ...]] = field(default_factory=dict)
    """Architecture -> the engine settings a reload of that model cannot be complete
    under (beyond ``refusals``)."""
    notes: tuple[str, ...] = ()
    sources: tuple[SourceRef, ...] = ()


_NZ_WHY = (
    "FRACTAL_NZ is cast with torch_npu.npu_format_cast, which reallocates: the engine's "
    "kernels (and captured graphs) then read a tensor mxload's buffers are not, in a "
    "layout no view describes"
)


def _nz_refusal(default: str, fix: str) -> Refusal:
    return Refusal("weight_nz_mode", ("0",), default, fix, _NZ_WHY)


_NZ_023 = _nz_refusal(
    "1",
    "start the engine with additional_config={'weight_nz_mode': 0} (or the environment "
    "VLLM_ASCEND_ENABLE_NZ=0, or additional_config.rl_config.enabled=true)",
)
_NZ_027 = _nz_refusal(
    "1",
    "start the engine with additional_config={'weight_nz_mode': 0} (or "
    "additional_config.rl_config.enabled=true); VLLM_ASCEND_ENABLE_NZ is no longer read",
)
_FUSED_MC2 = Refusal(
    "enable_fused_mc2",
    ("0",),
    "0",
    "start the engine with additional_config={'enable_fused_mc2': 0}",
    "with fused MC2 (MegaMoE) the MXFP8 MoE post-load replaces w13/w2 by per-expert clone "
    "lists (cann_mega_moe_*_list) and disposes of the parameters mxload would write",
)
_EPLB = Refusal(
    "enable_eplb",
    ("0",),
    "0",
    "start the engine without enable_eplb (vLLM's --enable-eplb)",
    "EPLB swaps experts' weights between slots in place while serving; a reload plans "
    "experts by the placement at attach and would write other experts into moved slots",
)
_DYNAMIC_EPLB = Refusal(
    "eplb_config.dynamic_eplb",
    ("0",),
    "0",
    "start the engine without additional_config.eplb_config.dynamic_eplb (and without "
    "expert_map_record_path, which turns it on)",
    "vllm-ascend's dynamic EPLB moves experts between slots while serving",
)
_EXPERT_MAP = Refusal(
    "eplb_config.expert_map_path",
    ("",),
    "",
    "start the engine without additional_config.eplb_config.expert_map_path",
    "a static expert map places experts in slots other than vLLM's linear placement, "
    "which is what mxload plans",
)
_REDUNDANT = Refusal(
    "num_redundant_experts",
    ("0",),
    "0",
    "start the engine with num_redundant_experts 0 (vLLM's eplb_config and vllm-ascend's "
    "additional_config.eplb_config)",
    "redundant experts are extra physical slots holding copies of some logical experts; "
    "mxload's plan has one slot per logical expert",
)
_SPECULATIVE = Refusal(
    "speculative_config",
    ("", "mtp"),
    "",
    "start the engine without speculative_config, or with method 'mtp' on a Qwen3.5 or "
    "DeepSeek-V3 checkpoint (whose MTP module mxload plans and reloads), or reload the "
    "draft model yourself",
    "other draft models' weights (EAGLE, a draft checkpoint) are neither planned nor "
    "updated by mxload, so it would keep drafting from the old weights",
)
_EPLB_ALL = (_EPLB, _DYNAMIC_EPLB, _EXPERT_MAP, _REDUNDANT, _SPECULATIVE)

VLLM_REFUSALS = (_EPLB, _REDUNDANT, _SPECULATIVE)
"""vLLM's own settings that no in-place reload can serve, whatever platform runs it: they
apply to an engine without vllm-ascend (``--engine mxload``) too."""

VLLM_ARCHITECTURES: Mapping[str, str] = {
    "DeepseekV3ForCausalLM": (
        "vLLM's MLAAttention derives W_UK_T / W_UV (or their quantized forms) from "
        "kv_b_proj in its post-load (model_executor/layers/attention/mla_attention.py "
        "process_weights_after_loading) and reads those, and no profile of plain vLLM "
        "describes them, so a reload would leave them stale; reload DeepSeek-V3 in place "
        "under vllm-ascend (whose profiles recompute them, docs/contract.md §2.4)"
    )
}
"""Architectures an engine without vllm-ascend cannot be reloaded in place for, and why."""

_MLAPO = Refusal(
    "enable_mlapo",
    ("0",),
    "1",
    "start the engine with additional_config={'enable_mlapo': False} (0.23.0.post1 also "
    "reads VLLM_ASCEND_ENABLE_MLAPO=0)",
    "with MLAPO (on by default on Ascend 950) the MLA post-load keeps FRACTAL_NZ copies "
    "of fused_qkv_a_proj and q_b_proj (weight_dq, weight_dkv_kr, weight_uq_qr) that its "
    "fused kernel reads instead of the parameters mxload writes",
)
_DEEPSEEK = {"DeepseekV3ForCausalLM": (_MLAPO,)}
"""DeepSeek's MLA: W_UK_T / W_UV are recomputed in place (the profile's ``derived``), but
MLAPO's NZ copies cannot be."""

_QUANT_023 = ("ascend", "compressed-tensors", "fp8", "deepseek_v4_fp8")
_QUANT_027 = (*_QUANT_023, "modelopt_mxfp8", "mxfp8")

RELEASES: Mapping[str, EngineRelease] = {
    r.name: r
    for r in (
        EngineRelease(
            name="vllm-ascend-0.23.0.post1",
            versions=("0.23.0.post1",),
            vllm="0.23.0",
            profile="vllm-ascend-0.23",
            quantizations=_QUANT_023,
            formats=("ascend",),
            refusals=(_NZ_023, *_EPLB_ALL),
            architectures=_DEEPSEEK,
            notes=(
                "ModelOpt MXFP8 is refused at start (modelopt_mxfp8 is not in the "
                "platform's supported quantization list): convert with --format ascend and "
                "serve with --quantization ascend",
            ),
            sources=(
                SourceRef("supported quantization", "vllm_ascend/platform.py:140-145"),
                SourceRef(
                    "--quantization ascend reads quant_model_description.json, "
                    "'<module>.weight': 'W8A8_MXFP8' | 'FLOAT', group_size",
                    "vllm_ascend/quantization/modelslim_config.py:67,348-379,604-708,760-800; "
                    "quantization/methods/w8a8_mxfp8.py:43,57,211",
                ),
                SourceRef(
                    "weight_nz_mode from additional_config, else VLLM_ASCEND_ENABLE_NZ (default 1)",
                    "vllm_ascend/ascend_config.py:249-253,354-365; envs.py:92",
                ),
                SourceRef(
                    "eplb_config: dynamic_eplb, expert_map_path, num_redundant_experts",
                    "vllm_ascend/ascend_config.py:831-894",
                ),
            ),
        ),
        EngineRelease(
            name="vllm-ascend-0.27.1rc1",
            versions=("0.27.1rc1",),
            vllm="0.27.1",
            profile="vllm-ascend-main",
            quantizations=_QUANT_027,
            formats=("ascend", "modelopt"),
            refusals=(_NZ_027, *_EPLB_ALL),
            architectures=_DEEPSEEK,
            notes=(
                "block-FP8 checkpoints are also served directly: on Ascend 950 the engine "
                "re-quantizes them to MXFP8 at load (fp8_block.py); mxload reloads such an "
                "engine only from its own MXFP8 plan",
            ),
            sources=(
                SourceRef("supported quantization", "vllm_ascend/platform.py:99-106"),
                SourceRef(
                    "MX linear persistent [K, N] buffer; MoE transposed views; no NZ cast, "
                    "no MegaMoE in the MXFP8 scheme",
                    "vllm_ascend/quantization/methods/w8a8/w8a8_mxfp8.py:150-175,340-352",
                ),
                SourceRef(
                    "weight_nz_mode an additional_config key (default 1), rl_config forces 0",
                    "vllm_ascend/ascend_config.py:205-213,271,423,457",
                ),
                SourceRef(
                    "routed experts under AscendRoutedExperts",
                    "vllm_ascend/ops/fused_moe/fused_moe.py:33,86-111",
                ),
            ),
        ),
        *(
            EngineRelease(
                name=f"vllm-ascend-{v}",
                versions=(v,),
                vllm=base,
                profile="vllm-ascend-main",
                quantizations=_QUANT_027,
                formats=("ascend", "modelopt"),
                refusals=(_NZ_027, _FUSED_MC2, *_EPLB_ALL),
                architectures=_DEEPSEEK,
                notes=(
                    "MXFP8 weights are cast to FRACTAL_NZ unless weight_nz_mode is 0",
                    "row-parallel MXFP8 shards whose K does not start and end on a 32 "
                    "boundary are padded by the engine: refused at plan time",
                ),
                sources=(
                    SourceRef("supported quantization", f"vllm_ascend/platform.py:{lines}"),
                    SourceRef(
                        "MX linear: row-parallel K padding, maybe_trans_nz; MoE: MegaMoE "
                        "clone lists under use_cann_megamoe, else maybe_trans_nz_with_scale",
                        "vllm_ascend/quantization/methods/w8a8/w8a8_mxfp8.py "
                        "(0.30.0rc2: 189-230, 417-465)",
                    ),
                    SourceRef(
                        "use_cann_megamoe: enable_fused_mc2 == 1 with EP",
                        "vllm_ascend/ascend_forward_context.py:87-97 (0.30.0rc2)",
                    ),
                    SourceRef(
                        "_should_trans_nz: weight_nz_mode 0 off, 1 quantized, 2 all",
                        "vllm_ascend/utils.py:352-386 (0.30.0rc2)",
                    ),
                ),
            )
            for v, base, lines in (
                ("0.28.0rc1", "0.28.0", "92-99"),
                ("0.29.0rc1", "0.29.0", "94-101"),
                ("0.30.0rc2", "0.30.0", "101-108"),
            )
        ),
        EngineRelease(
            name="vllm-ascend-main",
            versions=(),
            vllm="main",
            profile="vllm-ascend-main",
            quantizations=_QUANT_027,
            formats=("ascend", "modelopt"),
            refusals=(_NZ_027, _FUSED_MC2, *_EPLB_ALL),
            architectures=_DEEPSEEK,
            notes=("read at 182b75ea; as 0.28-0.30 for NZ, fused MC2 and row-parallel padding",),
        ),
    )
}
"""Every release mxload knows, by ``--engine`` name."""


_RELEASE_OF_PROFILE = {"vllm-ascend-0.23": "vllm-ascend-0.23.0.post1"}
"""A profile named instead of a release stands for this release (else the one of its name)."""


def engine_release(engine: str) -> EngineRelease | None:
    """The release ``engine`` (a release or profile name) stands for; None for mxload's
    own layout, which has no engine settings."""
    return RELEASES.get(_RELEASE_OF_PROFILE.get(engine, engine))


def release_of_version(version: str) -> EngineRelease:
    """The release an installed ``vllm-ascend`` version is; UsageError listing the known
    ones (and how to override) for any other."""
    for r in RELEASES.values():
        if version in r.versions:
            return r
    known = ", ".join(v for r in RELEASES.values() for v in r.versions)
    raise UsageError(
        f"vllm-ascend {version} is installed, a release mxload has not read; known: {known} "
        f"(pass engine= one of {', '.join(RELEASES)} to use a known release's table)",
        key="--engine",
    )


def check_settings(release: EngineRelease | None, settings: Mapping[str, str]) -> list[str]:
    """One line per engine setting ``release`` (None: vLLM without vllm-ascend) cannot be
    reloaded under (empty = fine)."""
    return _refused(release.refusals if release is not None else VLLM_REFUSALS, settings)


def check_architecture(
    release: EngineRelease, architecture: str, settings: Mapping[str, str]
) -> list[str]:
    """One line per engine setting ``release`` cannot be reloaded in place under for
    ``architecture`` (empty = fine)."""
    return _refused(release.architectures.get(architecture, ()), settings)


def _refused(refusals: tuple[Refusal, ...], settings: Mapping[str, str]) -> list[str]:
    bad = []
    for r in refusals:
        value = settings.get(r.setting, r.default)
        if value not in r.allowed:
            bad.append(f"{r.setting}={value!r}: {r.reason}; {r.fix}")
    return bad
