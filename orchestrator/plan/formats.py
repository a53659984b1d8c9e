"""Format constants, each with its meaning. Pure: no torch, no I/O.

Everything that names a dtype, a group size or a magic byte value lives here so that
the planner (sizes), the numerics (bytes) and the writers agree by construction.
"""

from __future__ import annotations

from typing import Final

# --- MX (OCP Microscaling v1.0, as the Ascend npu_dynamic_mx_quant produces it) --------

MX_GROUP: Final = 32
"""Values along K that share one E8M0 scale byte (docs/contract.md §2.2)."""

MX_PAIR: Final = 2
"""Scale bytes are stored in pairs along K: ``[ceil(g/2), N, 2]`` (docs/contract.md §2.3)."""

E8M0_BIAS: Final = 127
"""Exponent bias of an E8M0 scale byte: byte S means 2**(S - 127)."""

E8M0_NAN: Final = 0xFF
"""The E8M0 NaN code: a group that contained an Inf or NaN."""

E4M3_MAX: Final = 448.0
"""Largest finite float8_e4m3fn magnitude; scaled values saturate here (bytes 0x7E/0xFE)."""

E4M3_EMAX: Final = 8
"""floor(log2(448)): the scale byte is max(Emax, 8) - 8, i.e. floor(log2(amax)) - 8 + 127."""

SCALE_ALG_OCP: Final = 0
"""``npu_dynamic_mx_quant``'s ``scale_alg=0``: S from the group's largest exponent, floored
(OCP MX; docs/contract.md §2.2)."""
SCALE_ALG_E4M3_CEIL: Final = 1
"""``scale_alg=1``: S from ``amax / 448`` (the E4M3 maximum), its exponent rounded up so no
value overflows (docs/contract.md §2.2)."""
SCALE_ALGS: Final = (SCALE_ALG_OCP, SCALE_ALG_E4M3_CEIL)

# --- safetensors dtypes ------------------------------------------------------------------

SAFETENSORS_ITEMSIZE: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""Every dtype string mxload accepts in a safetensors header, with its size in bytes."""

QUANT_WEIGHT_DTYPE: Final = "F8_E4M3"
"""Dtype of a quantized weight in block-FP8 and MXFP8 checkpoints."""

BLOCK_SCALE_DTYPE: Final = "F32"
"""Dtype of ``weight_scale_inv`` in block-FP8 checkpoints (the seed's releases)."""

BLOCK_SCALE_DTYPES: Final = ("F32", "BF16")
"""``weight_scale_inv`` dtypes accepted: float32, and bfloat16 as third-party copies of
Qwen3.5/3.6 FP8 releases store it; both are resolved in float32 (docs/contract.md §2.1)."""

MX_SCALE_DTYPE: Final = "U8"
"""Dtype of ``weight_scale`` (E8M0 biased exponents) in MXFP8 checkpoints."""

BLOCK_SCALE_SUFFIX: Final = "weight_scale_inv"
MX_SCALE_SUFFIX: Final = "weight_scale"

# --- model dtypes ------------------------------------------------------------------------

MODEL_DTYPES: Final[dict[str, str]] = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
"""``--dtype`` value -> safetensors dtype string of resolved (model dtype) tensors."""

TORCH_DTYPE_ALIASES: Final[dict[str, str]] = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
}
"""config.json ``torch_dtype`` spellings -> ``--dtype`` value; anything else means bf16."""

# --- device buffer dtypes (names as torch spells them, without importing torch) -----------

BUFFER_ITEMSIZE: Final[dict[str, int]] = {
    "float8_e4m3fn": 1,
    "uint8": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
}
"""Dtypes a persistent buffer can have, by torch name, with their size."""

SAFETENSORS_TO_BUFFER: Final[dict[str, str]] = {
    "F8_E4M3": "float8_e4m3fn",
    "U8": "uint8",
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
}
BUFFER_TO_SAFETENSORS: Final[dict[str, str]] = {v: k for k, v in SAFETENSORS_TO_BUFFER.items()}

# --- layouts of persistent buffers (docs/contract.md §2.3, §5 manifest) ---------------------------------

LAYOUT_MX_LINEAR: Final = "mx_linear"
LAYOUT_MX_MOE: Final = "mx_moe"
LAYOUT_DENSE: Final = "dense"
LAYOUTS: Final = (LAYOUT_MX_LINEAR, LAYOUT_MX_MOE, LAYOUT_DENSE)

# --- files ------------------------------------------------------------------------------------

CONFIG_FILE: Final = "config.json"
ASCEND_DESCRIPTION_FILE = "quant_model_description.json"
"""vllm-ascend's own quantization description (``--quantization ascend``): per tensor name
``"W8A8_MXFP8"`` or ``"FLOAT"``, plus ``group_size`` (``convert --format ascend``)."""
ASCEND_MXFP8 = "W8A8_MXFP8"
INDEX_FILE: Final = "model.safetensors.index.json"
SINGLE_FILE: Final = "model.safetensors"
HEADER_MAX_BYTES: Final = 100 * 1000 * 1000
"""docs/contract.md §1.3: a safetensors header longer than 100 MB is refused."""

PLAN_FORMAT: Final = "mxload-plan/1"
DUMP_FORMAT: Final = "mxload-dump/1"

VOCAB_PAD: Final = 64
"""vLLM pads the vocabulary to a multiple of 64 before splitting it over tp (docs/contract.md §3)."""


def ceil_div(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)
