"""The NAMED corner-case table of docs/contract.md §2, shared by every numerics path's tests.

Every case spells out its input values and the expected bytes by hand, with a comment
deriving them from the SPEC; nothing here is produced by the code under test. The CPU
reference, the fast CPU path, the NPU and CUDA backends all run this same table
(``run_mx_cases`` / ``run_resolve_cases``) and a mismatch is reported by case name.

E4M3 byte = sign<<7 | exp<<3 | mant, value (1 + mant/8) * 2**(exp - 7); exp = 0 is
subnormal, mant/8 * 2**-6 (units of 2**-9). Useful bytes: 256 = 0x78, 448 = 0x7E,
384 = 0x7C, 1.0 = 0x38, 2**-6 = 0x08, 2**-9 = 0x01. NaN is 0x7F / 0xFF (equal here).

MX rule (docs/contract.md §2.2): Emax = largest biased f32 exponent field of the group; S = 0xFF if
Emax == 255 else max(Emax, 8) - 8; y = e4m3_rne_sat(x * 2**(127 - S)), S = 0 -> ±0,
S = 0xFF -> NaN. For a normal amax = m * 2**e (m in [1, 2)) that is S = e + 127 - 8 and
r = 2**(8 - e): the scaled amax lands in [256, 512).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

INF = math.inf
NAN = math.nan
ANY_NAN = -1
"""In expected float bit patterns: any NaN is accepted at this position."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_BITS_VIEW: dict[str, torch.dtype] = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32}
_BITS_MASK: dict[str, int] = {"bf16": 0xFFFF, "fp16": 0xFFFF, "fp32": 0xFFFFFFFF}
GROUP = 32


def group(*head: float) -> tuple[float, ...]:
    """32 values: ``head`` then +0.0."""
    if len(head) > GROUP:
        raise ValueError("a group has 32 values")
    return tuple(head) + (0.0,) * (GROUP - len(head))


def codes(*head: int, fill: int = 0x00) -> tuple[int, ...]:
    """32 payload bytes: ``head`` then ``fill``."""
    if len(head) > GROUP:
        raise ValueError("a group has 32 bytes")
    return tuple(head) + (fill,) * (GROUP - len(head))


NAN_GROUP = codes(fill=0x7F)
"""A whole group of NaN payload bytes (S = 0xFF)."""


@dataclass(frozen=True)
class MxCase:
    """One MX quantize case: values ``[groups * 32]`` in ``dtype`` and expected bytes."""

    name: str
    dtype: str
    values: tuple[float, ...]
    scale: tuple[int, ...]
    payload: tuple[int, ...]


@dataclass(frozen=True)
class ResolveCase:
    """One resolve case: an E4M3 slice, the scale tiles covering it, expected bit patterns."""

    name: str
    dtype: str
    w_codes: tuple[tuple[int, ...], ...]
    scale: tuple[tuple[float, ...], ...]
    row0: int
    col0: int
    block_n: int
    block_k: int
    expected_bits: tuple[tuple[int, ...], ...]


MX_CASES: tuple[MxCase, ...] = (
    # Emax = 0 -> S = max(0, 8) - 8 = 0 -> r = 0: every byte +0.
    MxCase("all_zeros", "bf16", group(), (0,), codes()),
    # Same group, alternating -0/+0: S = 0, and x * 0 keeps the sign: 0x80 / 0x00.
    MxCase(
        "negative_zero",
        "bf16",
        tuple(-0.0 if i % 2 == 0 else 0.0 for i in range(GROUP)),
        (0,),
        tuple(0x80 if i % 2 == 0 else 0x00 for i in range(GROUP)),
    ),
    # bf16 subnormals (|x| < 2**-126; min 2**-133, max 127 * 2**-133) have exponent
    # field 0, so Emax = 0 -> S = 0 -> ±0 with the input's sign.
    MxCase(
        "bf16_subnormals_only",
        "bf16",
        group(2.0**-133, -(2.0**-133), 127 * 2.0**-133, -3 * 2.0**-133),
        (0,),
        codes(0x00, 0x80, 0x00, 0x80),
    ),
    # fp32 subnormals (min 2**-149, max (2**23 - 1) * 2**-149): exponent field 0 -> S = 0.
    MxCase(
        "fp32_subnormals_only",
        "fp32",
        group(2.0**-149, -(2.0**-149), (2**23 - 1) * 2.0**-149, -(2.0**-127), 2.0**-130),
        (0,),
        codes(0x00, 0x80, 0x00, 0x80, 0x00),
    ),
    # amax = 1.0: Emax = 127 -> S = 119 -> r = 2**8, so 2**-j -> 2**(8 - j).
    # j = 0..14: normal, exp = 15 - j -> byte (15 - j) << 3: 0x78, 0x70, ... 0x08.
    # j = 15, 16, 17: 2**-7, 2**-8, 2**-9 are 4, 2, 1 subnormal units -> 0x04, 0x02, 0x01.
    # j = 18: 2**-10 is half a unit, a tie between 0 and 1 -> even 0 -> 0x00; j = 19 -> 0x00.
    # Then -2**-j, j = 0..11 -> 0x80 | (15 - j) << 3.
    MxCase(
        "powers_of_two",
        "bf16",
        tuple(2.0**-j for j in range(20)) + tuple(-(2.0**-j) for j in range(12)),
        (119,),
        (
            *(0x78, 0x70, 0x68, 0x60, 0x58, 0x50, 0x48, 0x40, 0x38, 0x30, 0x28, 0x20, 0x18, 0x10),
            *(0x08, 0x04, 0x02, 0x01, 0x00, 0x00),
            *(0xF8, 0xF0, 0xE8, 0xE0, 0xD8, 0xD0, 0xC8, 0xC0, 0xB8, 0xB0, 0xA8, 0xA0),
        ),
    ),
    # Group 0: amax 56 = 1.75 * 2**5 -> S = 5 + 119 = 124, r = 2**3: 56 -> 448 = 0x7E,
    #   -56 -> 0xFE, 28 -> 224 = 1.75 * 2**7 = 0x76, 1.0 -> 8 = 2**3 = 0x50.
    # Group 1: amax 448 * 2**10 = 1.75 * 2**18 -> S = 137, r = 2**-10: -> 448 = 0x7E;
    #   1.75 -> 1.75 * 2**-10 = 0.875 subnormal units -> 1 unit = 0x01; -448 * 2**10 -> 0xFE.
    MxCase(
        "amax_exactly_448_times_2k",
        "fp32",
        group(56.0, -56.0, 28.0, 1.0) + group(448.0 * 2**10, 1.75, -448.0 * 2**10),
        (124, 137),
        codes(0x7E, 0xFE, 0x76, 0x50) + codes(0x7E, 0x01, 0xFE),
    ),
    # amax 1.9921875 (bf16 1.1111111b) -> Emax 127 -> S = 119, r = 2**8. Mantissas above
    # 1.75 exceed 448 after scaling and saturate: 1.875 -> 480, -1.9921875 -> -510,
    # 1.8125 -> 464, all to ±448 (0x7E / 0xFE); 1.75 -> 448 exactly (0x7E);
    # 1.625 -> 416 = 1.625 * 2**8 = 0x7D; 1.0 -> 256 = 0x78.
    MxCase(
        "mantissa_above_1p75_saturates",
        "bf16",
        group(1.875, -1.9921875, 1.8125, 1.75, 1.625, 1.0),
        (119,),
        codes(0x7E, 0xFE, 0x7E, 0x7E, 0x7D, 0x78),
    ),
    # amax 256 = 2**8 -> Emax 135 -> S = 127 -> r = 1: values are rounded as they are.
    # 256 -> 0x78. 1.0625: tie 1.0 (mant 0, even) / 1.125 -> 0x38. 1.1875: tie 1.125
    # (mant 1) / 1.25 (mant 2, even) -> 0x3A. -1.0625 -> 0xB8. 1.0703125 and
    # 1.0625 + 2**-20 are just above the tie -> 1.125 = 0x39. Subnormal units of 2**-9:
    # 2**-10 = 0.5 -> 0 (0x00); 3 * 2**-10 = 1.5 -> 2 (0x02); 5 * 2**-10 = 2.5 -> 2 (0x02);
    # 7 * 2**-10 = 3.5 -> 4 (0x04); 15 * 2**-10 = 7.5 -> 8 = 2**-6, the first normal (0x08).
    # 248: tie 240 (0x77, odd) / 256 (0x78) -> 0x78. 232: tie 224 (0x76) / 240 -> 0x76.
    # -2**-10 -> -0 (0x80).
    MxCase(
        "rne_ties",
        "fp32",
        group(
            256.0,
            1.0625,
            1.1875,
            -1.0625,
            1.0703125,
            1.0625 + 2.0**-20,
            2.0**-10,
            3 * 2.0**-10,
            5 * 2.0**-10,
            7 * 2.0**-10,
            15 * 2.0**-10,
            248.0,
            232.0,
            -(2.0**-10),
        ),
        (127,),
        codes(0x78, 0x38, 0x3A, 0xB8, 0x39, 0x39, 0x00, 0x02, 0x02, 0x04, 0x08, 0x78, 0x76, 0x80),
    ),
    # amax 1.5 * 2**-119 has biased exponent 8 -> S = max(8, 8) - 8 = 0 -> r = 0: all ±0.
    # (With r = 2**127 it would have given 384 = 0x7C: SPEC rule 3 says 0.)
    MxCase(
        "emax_8_group_is_zero",
        "fp32",
        group(1.5 * 2.0**-119, -1.5 * 2.0**-119, 2.0**-119, -(2.0**-125)),
        (0,),
        codes(0x00, 0x80, 0x00, 0x80),
    ),
    # amax 2**-124 < 2**-118 (biased exponent 3) -> S = 0 -> all ±0, sign kept;
    # 2**-130 and -2**-133 are bf16 subnormals.
    MxCase(
        "tiny_group_scale_0",
        "bf16",
        group(2.0**-124, -(2.0**-126), 2.0**-130, -(2.0**-133)),
        (0,),
        codes(0x00, 0x80, 0x00, 0x80),
    ),
    # amax 2**-118: biased exponent 9 -> S = 1 -> r = 2**126, the first non-zero scale.
    # 2**-118 -> 2**8 = 0x78; 1.5 * 2**-119 -> 192 = 1.5 * 2**7 = 0x74; -2**-125 -> -2 = 0xC0;
    # 2**-130 (an f32 subnormal input) -> 2**-4 = 0x18; 2**-136 -> 2**-10, a tie -> 0x00.
    MxCase(
        "emax_9_scale_1",
        "fp32",
        group(2.0**-118, 1.5 * 2.0**-119, -(2.0**-125), 2.0**-130, 2.0**-136),
        (1,),
        codes(0x78, 0x74, 0xC0, 0x18, 0x00),
    ),
    # Largest finite f32, (2 - 2**-23) * 2**127: biased exponent 254 -> S = 246, the
    # largest byte a finite group can get (247..254 never arise), r = 2**-119.
    # Group 0: max -> (2 - 2**-23) * 2**8 ~ 512 -> 0x7E; 2**127 -> 256 = 0x78;
    #   1.0 -> 2**-119 -> 0x00; -2**100 -> -2**-19 -> 0x80; -max -> 0xFE.
    # Group 1: 1.5 * 2**127 -> 384 = 0x7C; -1.25 * 2**126 -> -160 = -1.25 * 2**7 = 0xF2.
    MxCase(
        "max_normal_fp32",
        "fp32",
        group((2 - 2.0**-23) * 2.0**127, 2.0**127, 1.0, -(2.0**100), -(2 - 2.0**-23) * 2.0**127)
        + group(1.5 * 2.0**127, -1.25 * 2.0**126),
        (246, 246),
        codes(0x7E, 0x78, 0x00, 0x80, 0xFE) + codes(0x7C, 0xF2),
    ),
    # Largest finite bf16 (2 - 2**-7) * 2**127: S = 246 -> 510 -> 0x7E.
    MxCase(
        "max_normal_bf16",
        "bf16",
        group((2 - 2.0**-7) * 2.0**127, -1.0),
        (246,),
        codes(0x7E, 0x80),
    ),
    # Any Inf or NaN: Emax = 255 -> S = 0xFF -> r = NaN: the whole group is NaN.
    MxCase("inf_group", "bf16", group(INF, 1.0, -2.0), (0xFF,), NAN_GROUP),
    MxCase("neg_inf_group", "fp32", group(-INF), (0xFF,), NAN_GROUP),
    MxCase("nan_group", "bf16", group(1.0, NAN), (0xFF,), NAN_GROUP),
    # Three groups (an odd count): a NaN poisons only its own group.
    # Group 0: amax 1.0 -> S = 119, r = 2**8: 1.0 -> 0x78, -0.5 -> -128 = 0xF0.
    # Group 1: NaN -> 0xFF, all NaN.
    # Group 2: amax 3 = 1.5 * 2 -> S = 120, r = 2**7: 3 -> 384 = 0x7C.
    MxCase(
        "mixed_nan",
        "fp32",
        group(1.0, -0.5) + group(NAN, 2.0) + group(3.0),
        (119, 0xFF, 120),
        codes(0x78, 0xF0) + NAN_GROUP + codes(0x7C),
    ),
    # Where the amax sits must not matter: group 0's amax 8 is in lane 31, group 1's 0.5
    # in lane 0 (element 32). Group 0: 8 = 2**3 -> S = 122, r = 2**5: 1.0 -> 32 = 0x60,
    # 8 -> 256 = 0x78. Group 1: 0.5 -> S = 118, r = 2**9: 0.5 -> 256 = 0x78,
    # 2**-8 (lane 31) -> 2 = 0x40.
    MxCase(
        "group_boundaries",
        "bf16",
        (1.0,) + (0.0,) * 30 + (8.0,) + (0.5,) + (0.0,) * 30 + (2.0**-8,),
        (122, 118),
        (0x60,) + (0x00,) * 30 + (0x78,) + (0x78,) + (0x00,) * 30 + (0x40,),
    ),
    # fp16 max 65504 = (2 - 2**-10) * 2**15: f32 biased exponent 142 -> S = 134, r = 2**-7.
    # 65504 -> 511.75 -> 0x7E; 1024 -> 8 = 0x50; -0.5 -> -2**-8 = 2 subnormal units = 0x82;
    # 2**-14 (fp16 min normal) -> 2**-21 -> 0x00.
    MxCase(
        "fp16_normal",
        "fp16",
        group(65504.0, 1024.0, -0.5, 2.0**-14),
        (134,),
        codes(0x7E, 0x50, 0x82, 0x00),
    ),
    # fp16 subnormals (units of 2**-24) become normal f32 values, so their exponent counts:
    # Group 0: 1023 * 2**-24 = 1.998 * 2**-15 -> biased 112 -> S = 104, r = 2**23:
    #   1023 * 2**-24 -> 511.5 -> 0x7E; 512 * 2**-24 = 2**-15 -> 256 = 0x78;
    #   2**-24 -> 0.5 = 2**-1 = 0x30; 3 * 2**-24 -> 1.5 = 0x3C; -5 * 2**-24 -> -2.5 = 0xC2.
    # Group 1: amax 2**-24 -> biased 103 -> S = 95, r = 2**32: ±2**-24 -> ±256 = 0x78 / 0xF8.
    # (Reading fp16's own exponent field, 0, would have made both groups zero.)
    MxCase(
        "fp16_subnormals",
        "fp16",
        group(1023 * 2.0**-24, 512 * 2.0**-24, 2.0**-24, 3 * 2.0**-24, -5 * 2.0**-24)
        + group(2.0**-24, -(2.0**-24)),
        (104, 95),
        codes(0x7E, 0x78, 0x30, 0x3C, 0xC2) + codes(0x78, 0xF8),
    ),
    MxCase("fp16_inf", "fp16", group(-INF, 1.0), (0xFF,), NAN_GROUP),
    # fp32 mantissa bits below E4M3 precision: amax 2 - 2**-23 -> biased 127 -> S = 119,
    # r = 2**8: -> 512 - 2**-15 -> 0x7E; 1 + 2**-23 -> 256 + 2**-15 -> 256 = 0x78;
    # 1.5 - 2**-23 -> 384 - 2**-15 -> 384 = 0x7C.
    MxCase(
        "fp32_fine_mantissa",
        "fp32",
        group(2 - 2.0**-23, 1 + 2.0**-23, 1.5 - 2.0**-23),
        (119,),
        codes(0x7E, 0x78, 0x7C),
    ),
)


# Double rounding (docs/contract.md §2.1: f32 product, then one RNE to the model dtype).
# w = 1.625 (E4M3 0x3D) = 13/8; s1 = 10364771 * 2**-24, s2 = 10445430 * 2**-24 (exact f32).
# w * s1 = 134742023 * 2**-27 = 1 + 2**-8 + 7 * 2**-27: below half an f32 ulp (8 * 2**-27)
#   above 1 + 2**-8, so f32 gives 1 + 2**-8 (0x3F808000), a bf16 tie -> even 0x3F80
#   (rounding the exact product directly would give 0x3F81).
# w * s2 = 135790590 * 2**-27 = 1 + 3 * 2**-8 - 2 * 2**-27: f32 gives 1 + 3 * 2**-8
#   (0x3F818000), a bf16 tie between 0x3F81 (odd) and 0x3F82 -> 0x3F82 (direct: 0x3F81).
# fp16 holds both f32 values exactly: 1 + 2**-8 = 0x3C04, 1 + 3 * 2**-8 = 0x3C0C.
_S1 = 10364771 * 2.0**-24
_S2 = 10445430 * 2.0**-24

# bf16 bit patterns used below.
_B_2, _B_3, _B_4, _B_5, _B_7 = 0x4000, 0x4040, 0x4080, 0x40A0, 0x40E0
_B_HALF, _B_QUARTER, _B_NEG_QUARTER = 0x3F00, 0x3E80, 0xBE80

RESOLVE_CASES: tuple[ResolveCase, ...] = (
    # Source [5, 7], block (4, 4): tiles rows {0-3, 4}, cols {0-3, 4-6}, edge tiles cropped.
    # Scales [[2, 3], [0.5, 0.25]], weights 1.0 (0x38) except w[0][0] = 2.0 (0x40) and
    # w[4][6] = -1.0 (0xB8): R = w * tile scale, exact in bf16.
    ResolveCase(
        "partial_edge_tiles",
        "bf16",
        ((0x40,) + (0x38,) * 6,) + ((0x38,) * 7,) * 3 + ((0x38,) * 6 + (0xB8,),),
        ((2.0, 3.0), (0.5, 0.25)),
        0,
        0,
        4,
        4,
        ((_B_4, _B_2, _B_2, _B_2, _B_3, _B_3, _B_3),)
        + ((_B_2,) * 4 + (_B_3,) * 3,) * 3
        + ((_B_HALF,) * 4 + (_B_QUARTER, _B_QUARTER, _B_NEG_QUARTER),),
    ),
    # Slice rows [3, 6) x cols [2, 7) of a source with block (4, 4): first tile is
    # (3 // 4, 2 // 4) = (0, 0), last (5 // 4, 6 // 4) = (1, 1). The scale slice holds tiles
    # [[(0,0)=2, (0,1)=3], [(1,0)=5, (1,1)=7]]. Global row 3 is in tile row 0 (a ceil of the
    # offset would wrongly start at tile row 1); cols 2, 3 are tile col 0, cols 4-6 col 1.
    ResolveCase(
        "slice_starting_mid_tile",
        "bf16",
        ((0x38,) * 5,) * 3,
        ((2.0, 3.0), (5.0, 7.0)),
        3,
        2,
        4,
        4,
        ((_B_2, _B_2, _B_3, _B_3, _B_3),) + ((_B_5, _B_5, _B_7, _B_7, _B_7),) * 2,
    ),
    # One tile, scale 2**-140 (an f32 subnormal, still a valid positive scale).
    # 448 * 2**-140 = 3.5 * 2**-133: f32 exact; bf16 subnormal units are 2**-133, 3.5 is a
    # tie -> 4 -> 0x0004 (-448 -> 0x8004). 1.0 * 2**-140 = 2**-7 units -> 0x0000.
    # 2**-9 (E4M3 0x01) * 2**-140 = 2**-149, the smallest f32 subnormal -> bf16 0x0000.
    # A flush-to-zero path would give 0 for all four.
    ResolveCase(
        "tiny_tile_scale_bf16",
        "bf16",
        ((0x7E, 0x38), (0xFE, 0x01)),
        ((2.0**-140,),),
        0,
        0,
        2,
        2,
        ((0x0004, 0x0000), (0x8004, 0x0000)),
    ),
    # Same in fp32: 3.5 * 2**-133 = 7 * 2**-134 = 229376 * 2**-149 -> bits 0x00038000;
    # 2**-140 = 512 * 2**-149 -> 0x00000200; 2**-149 -> 0x00000001.
    ResolveCase(
        "tiny_tile_scale_fp32",
        "fp32",
        ((0x7E, 0x38), (0xFE, 0x01)),
        ((2.0**-140,),),
        0,
        0,
        2,
        2,
        ((0x00038000, 0x00000200), (0x80038000, 0x00000001)),
    ),
    # Block (1, 1): each element has its own tile. w * 0 = ±0 (sign of w: 0x0000, 0x8000);
    # w * NaN = NaN; 1.0 * Inf = Inf (0x7F80); 0 * Inf = NaN.
    ResolveCase(
        "zero_nan_inf_tile_scales",
        "bf16",
        ((0x38, 0xB8, 0x38, 0x38, 0x00),),
        ((0.0, 0.0, NAN, INF, INF),),
        0,
        0,
        1,
        1,
        ((0x0000, 0x8000, ANY_NAN, 0x7F80, ANY_NAN),),
    ),
    # E4M3 NaN (0x7F) stays NaN; E4M3 subnormal 2**-9 (0x01) * 3 = 1.5 * 2**-8 -> bf16
    # exponent 119 (0x77), mantissa 0x40 -> 0x3BC0.
    ResolveCase(
        "nan_and_subnormal_weights",
        "bf16",
        ((0x7F, 0x01),),
        ((3.0,),),
        0,
        0,
        1,
        2,
        ((ANY_NAN, 0x3BC0),),
    ),
    ResolveCase(
        "double_rounding_bf16",
        "bf16",
        ((0x3D, 0x3D),),
        ((_S1, _S2),),
        0,
        0,
        1,
        1,
        ((0x3F80, 0x3F82),),
    ),
    ResolveCase(
        "double_rounding_fp16",
        "fp16",
        ((0x3D, 0x3D),),
        ((_S1, _S2),),
        0,
        0,
        1,
        1,
        ((0x3C04, 0x3C0C),),
    ),
    ResolveCase(
        "double_rounding_fp32",
        "fp32",
        ((0x3D, 0x3D),),
        ((_S1, _S2),),
        0,
        0,
        1,
        1,
        ((0x3F808000, 0x3F818000),),
    ),
    # 448 * 256 = 114688 > 65504: RNE to fp16 overflows to ±Inf (0x7C00 / 0xFC00).
    ResolveCase(
        "fp16_overflow_to_inf",
        "fp16",
        ((0x7E, 0xFE),),
        ((256.0,),),
        0,
        0,
        1,
        2,
        ((0x7C00, 0xFC00),),
    ),
)


MX_ALG1_CASES: tuple[MxCase, ...] = (
    # scale_alg=1 (docs/contract.md §2.2): Q = RNE_f32(amax / 448); S = biased exponent of
    # Q, plus 1 if Q is normal with a non-zero mantissa (or subnormal with a mantissa above
    # one half); every group scaled by 2**(127 - S), S = 0 included; Inf/NaN -> 0xFF.
    #
    # amax 448: Q = 1.0 exactly (mantissa 0) -> S = 127, r = 1: 448 -> 0x7E, 1.0 -> 0x38.
    MxCase("alg1_amax_448", "bf16", group(448.0, 1.0), (127,), codes(0x7E, 0x38)),
    # amax 449: Q = 449/448 > 1 -> S = 128, r = 2**-1: 224.5 -> 224 (1.75 * 2**7, 0x76;
    # the next code 240 is farther); -1.0 -> -0.5 = 2**-1, exp field 6 -> 0xB0.
    MxCase("alg1_rounds_up", "fp32", group(449.0, -1.0), (128,), codes(0x76, 0xB0)),
    # amax 1.875 (bf16 1.111b): Q = 1.875/448 = 1.071 * 2**-8 -> S = -8 + 127 + 1 = 120,
    # r = 2**7: 1.875 -> 240 = 1.875 * 2**7 (0x77); 1.0 -> 128 (0x70). (scale_alg=0 gives
    # S = 119 and saturates 1.875 * 256 = 480 to 448.)
    MxCase("alg1_amax_above_1_75", "bf16", group(1.875, 1.0), (120,), codes(0x77, 0x70)),
    # amax 1.75: Q = 2**-8 exactly -> S = 119, r = 2**8: +-1.75 -> +-448 (0x7E, 0xFE).
    MxCase("alg1_amax_exactly_1_75", "bf16", group(1.75, -1.75), (119,), codes(0x7E, 0xFE)),
    # amax 0: Q = 0 (subnormal, mantissa 0) -> S = 0, r = 2**127: +-0 stay +-0.
    MxCase(
        "alg1_zeros",
        "bf16",
        tuple(-0.0 if i % 2 == 0 else 0.0 for i in range(GROUP)),
        (0,),
        tuple(0x80 if i % 2 == 0 else 0x00 for i in range(GROUP)),
    ),
    # amax 2**-128 (an f32 subnormal): Q = 2**-128 / 448 < 2**-127 -> S = 0, and the group
    # is scaled by 2**127, not zeroed: 2**-128 -> 0.5 (0x30), -(2**-130) -> -0.125 (0xA0).
    MxCase(
        "alg1_s0_scales_by_2_127", "fp32", group(2.0**-128, -(2.0**-130)), (0,), codes(0x30, 0xA0)
    ),
    # amax 1.75 * 2**-119: Q = 2**-127 exactly, a subnormal with mantissa one half (not
    # above) -> S = 0, r = 2**127: 1.75 * 2**8 = 448 (0x7E).
    MxCase("alg1_subnormal_quotient_half", "fp32", group(1.75 * 2.0**-119), (0,), codes(0x7E)),
    # amax (7 * 2**20 + 1) * 2**-141, the next float32: Q / 2**-149 = 2**22 + 4/7 -> RNE
    # 2**22 + 1, mantissa above one half -> S = 1, r = 2**126: amax -> 224 + 2**-15 -> 224
    # (0x76).
    MxCase(
        "alg1_subnormal_quotient_above_half",
        "fp32",
        group((7 * 2**20 + 1) * 2.0**-141),
        (1,),
        codes(0x76),
    ),
    # amax 1.75 * 2**-118: Q = 2**-126, the smallest normal, mantissa 0 -> S = 1, r = 2**126:
    # 448 (0x7E).
    MxCase("alg1_quotient_smallest_normal", "fp32", group(1.75 * 2.0**-118), (1,), codes(0x7E)),
    # bf16's largest, (2 - 2**-7) * 2**127: Q's exponent 127 - 9 + 127 = 245 with a mantissa
    # -> S = 246 + 1 = 247, r = 2**-120: (2 - 2**-7) * 2**7 = 254 -> 256 (0x78: 14 away from
    # 240, 2 from 256).
    MxCase("alg1_bf16_max", "bf16", group((2 - 2.0**-7) * 2.0**127), (247,), codes(0x78)),
    # Inf or NaN in a group: amax is not finite -> S = 0xFF, the whole group NaN.
    MxCase("alg1_inf", "bf16", group(1.0, INF), (0xFF,), NAN_GROUP),
    MxCase("alg1_nan", "fp32", group(NAN, 3.0), (0xFF,), NAN_GROUP),
    # fp16: amax 65504 = 1.999 * 2**15 -> Q = 146.2 = 1.142 * 2**7 -> S = 7 + 127 + 1 = 135,
    # r = 2**-8: 65504 -> 255.875 -> 256 (0x78); 1.0 -> 2**-8, subnormal 2 units (0x02).
    MxCase("alg1_fp16_max", "fp16", group(65504.0, 1.0), (135,), codes(0x78, 0x02)),
)
"""The same table's rule with ``scale_alg=1`` (each case derived by hand above)."""


# --- running the table against any implementation ------------------------------------


def values_tensor(values: Sequence[float], dtype: str) -> torch.Tensor:
    """The case's values as a ``dtype`` tensor; refuses values the dtype cannot hold exactly."""
    exact = torch.tensor(list(values), dtype=torch.float64)
    t = exact.to(TORCH_DTYPES[dtype])
    back = t.to(torch.float64)
    same = (back == exact) | (torch.isnan(back) & torch.isnan(exact))
    same &= (torch.signbit(back) == torch.signbit(exact)) | torch.isnan(exact)
    if not bool(same.all()):
        bad = int((~same).nonzero()[0, 0])
        raise ValueError(f"table bug: {values[bad]!r} is not exact in {dtype}")
    return t


def e4m3_tensor(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """E4M3 bytes ``[r][c]`` as a float8_e4m3fn tensor."""
    return torch.tensor([list(r) for r in rows], dtype=torch.uint8).view(torch.float8_e4m3fn)


def _nan_byte(b: int) -> bool:
    return (b & 0x7F) == 0x7F


def compare_mx(
    name: str,
    payload: torch.Tensor,
    scale: torch.Tensor,
    want_payload: Sequence[int],
    want_scale: Sequence[int],
) -> list[str]:
    """Mismatches between an MX result and expected bytes, each prefixed by ``name``."""
    got_p = payload.detach().cpu().contiguous().view(torch.uint8).reshape(-1).tolist()
    got_s = scale.detach().cpu().contiguous().view(torch.uint8).reshape(-1).tolist()
    problems: list[str] = []
    if scale.dtype != torch.uint8:
        problems.append(f"{name}: scale dtype {scale.dtype}, expected uint8")
    if payload.dtype != torch.float8_e4m3fn:
        problems.append(f"{name}: payload dtype {payload.dtype}, expected float8_e4m3fn")
    if got_s != list(want_scale):
        problems.append(f"{name}: scale bytes {got_s} != expected {list(want_scale)}")
    if len(got_p) != len(want_payload):
        problems.append(f"{name}: {len(got_p)} payload bytes, expected {len(want_payload)}")
        return problems
    for i, (g, w) in enumerate(zip(got_p, want_payload, strict=True)):
        if g != w and not (_nan_byte(g) and _nan_byte(w)):
            problems.append(f"{name}: payload[{i}] = {g:#04x}, expected {w:#04x}")
    return problems


QuantizeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_mx_cases(quantize: QuantizeFn, cases: Sequence[MxCase] = MX_CASES) -> list[str]:
    """Run ``quantize`` over the MX table; the list of mismatches, by case name."""
    problems: list[str] = []
    for case in cases:
        x = values_tensor(case.values, case.dtype)
        try:
            payload, scale = quantize(x)
        except Exception as exc:
            problems.append(f"{case.name}: raised {type(exc).__name__}: {exc}")
            continue
        problems += compare_mx(case.name, payload, scale, case.payload, case.scale)
    return problems


def float_bits(t: torch.Tensor, dtype: str) -> list[list[int]]:
    """Bit patterns (non-negative ints) of a 2-D bf16/fp16/fp32 tensor."""
    mask = _BITS_MASK[dtype]
    raw = t.detach().cpu().contiguous().view(_BITS_VIEW[dtype]).tolist()
    return [[v & mask for v in row] for row in raw]


ResolveFn = Callable[..., torch.Tensor]


def run_resolve_cases(
    resolve: ResolveFn, cases: Sequence[ResolveCase] = RESOLVE_CASES
) -> list[str]:
    """Run ``resolve(w_fp8, scale, row0=, col0=, block_n=, block_k=, dtype=)`` over the table."""
    problems: list[str] = []
    for case in cases:
        w = e4m3_tensor(case.w_codes)
        s = torch.tensor([list(r) for r in case.scale], dtype=torch.float32)
        try:
            out = resolve(
                w,
                s,
                row0=case.row0,
                col0=case.col0,
                block_n=case.block_n,
                block_k=case.block_k,
                dtype=TORCH_DTYPES[case.dtype],
            )
        except Exception as exc:
            problems.append(f"{case.name}: raised {type(exc).__name__}: {exc}")
            continue
        if out.dtype != TORCH_DTYPES[case.dtype]:
            problems.append(f"{case.name}: dtype {out.dtype}, expected {case.dtype}")
            continue
        want_shape = (len(case.expected_bits), len(case.expected_bits[0]))
        if tuple(out.shape) != want_shape:
            problems.append(f"{case.name}: shape {tuple(out.shape)}, expected {want_shape}")
            continue
        got = float_bits(out, case.dtype)
        nan = torch.isnan(out.detach().cpu().float()).tolist()
        for r, (grow, wrow) in enumerate(zip(got, case.expected_bits, strict=True)):
            for c, (g, w_bits) in enumerate(zip(grow, wrow, strict=True)):
                if w_bits == ANY_NAN:
                    if not nan[r][c]:
                        problems.append(f"{case.name}: [{r}, {c}] = {g:#x}, expected NaN")
                elif g != w_bits:
                    problems.append(f"{case.name}: [{r}, {c}] = {g:#x}, expected {w_bits:#x}")
    return problems


# --- device conformance: any backend against the CPU reference on random data ---------------


def _random_inputs(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Seeded inputs for conformance runs: wide exponent spreads, ties, specials, odd g."""
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for dtype_name, dtype in TORCH_DTYPES.items():
        for shape in ((1, 32), (3, 96), (17, 224), (64, 1024), (2, 5, 160)):
            base = torch.randn(shape, generator=g, dtype=torch.float64)
            groups = base.reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
            lo, hi = (-26, 12) if dtype_name == "fp16" else (-140, 120)
            exps = torch.randint(lo, hi, (*groups.shape[:-1], 1), generator=g)
            groups = groups * torch.pow(2.0, exps.to(torch.float64))
            x = groups.reshape(shape).to(dtype)
            out.append((f"scaled-{dtype_name}-{shape}", x))
            bits_dtype = torch.int32 if dtype_name == "fp32" else torch.int16
            info = torch.iinfo(bits_dtype)
            raw = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64)
            out.append((f"bits-{dtype_name}-{shape}", raw.to(bits_dtype).view(dtype)))
    return out


def random_conformance(backend: object, seed: int = 2024, scale_alg: int = 0) -> list[str]:
    """Compare ``backend`` (any device) with the CPU reference, byte for byte, on seeded
    random data; returns mismatch descriptions naming the input. Runs ``mx_quantize``,
    ``resolve_block`` and ``convert`` (tile-misaligned slices), under ``scale_alg``."""
    from mxload.workers.numerics import reference
    from mxload.workers.numerics.backend import ConvertPart

    if scale_alg:
        backend = backend.with_scale_alg(scale_alg)  # type: ignore[attr-defined]
    problems: list[str] = []
    for label, x in _random_inputs(seed):
        want_p, want_s = reference.mx_quantize(x, scale_alg)
        got_p, got_s = backend.mx_quantize(x)  # type: ignore[attr-defined]
        problems += compare_mx(
            label,
            got_p,
            got_s,
            want_p.view(torch.uint8).reshape(-1).tolist(),
            want_s.reshape(-1).tolist(),
        )[:5]
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randint(0, 256, (300, 512), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s_full = torch.rand((3, 4), generator=g, dtype=torch.float32) + 0.5
    for dtype_name, dtype in TORCH_DTYPES.items():
        for r0, r1, c0, c1 in ((0, 300, 0, 512), (37, 250, 64, 480), (129, 130, 96, 128)):
            tiles = s_full[r0 // 128 : (r1 - 1) // 128 + 1, c0 // 128 : (c1 - 1) // 128 + 1]
            kw = {"row0": r0, "col0": c0, "block_n": 128, "block_k": 128, "dtype": dtype}
            label = f"resolve-{dtype_name}-rows[{r0},{r1})-cols[{c0},{c1})"
            want = reference.resolve_block(w[r0:r1, c0:c1], tiles, **kw)
            got = backend.resolve_block(w[r0:r1, c0:c1], tiles, **kw)  # type: ignore[attr-defined]
            got_cpu = got.detach().cpu()
            same = (got_cpu.view(_BITS_VIEW[dtype_name]) == want.view(_BITS_VIEW[dtype_name])) | (
                torch.isnan(got_cpu.float()) & torch.isnan(want.float())
            )
            if got_cpu.dtype != dtype or not bool(same.all()):
                problems.append(f"{label}: differs from the CPU reference")
            want_p, want_s = reference.mx_quantize(want, scale_alg)
            [(got_p, got_s)] = backend.convert(  # type: ignore[attr-defined]
                [ConvertPart(w[r0:r1, c0:c1], tiles, r0, c0)], block_n=128, block_k=128, dtype=dtype
            )
            problems += compare_mx(
                "convert-" + label,
                got_p,
                got_s,
                want_p.view(torch.uint8).reshape(-1).tolist(),
                want_s.reshape(-1).tolist(),
            )[:5]
    return problems
