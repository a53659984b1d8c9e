"""Tests of workers/numerics/fast.py: the fused CPU path must equal the reference byte for
byte (docs/contract.md §2; NaN payload bytes 0x7F and 0xFF count as equal).

Expected bytes come from the hand-written table (tests/numerics_cases.py), from a few
fused cases derived by hand below, from exhaustive enumeration of the 256 E4M3 codes,
and from mxload.workers.numerics.reference / repack on seeded random data -- never from the
code under test. No timing assertions (bench/bench_convert.py measures speed).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import zlib
from collections.abc import Iterator

import numba
import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import NumericsError
from mxload.workers.numerics import fast, kernels, repack, select
from mxload.workers.numerics import reference as ref
from mxload.workers.numerics.backend import ConvertPart, PackedOut

from tests import numerics_cases as nc

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAN = float("nan")
INF = float("inf")


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_available_here() -> None:
    # numba imports in this environment, so the kernels must compile and self-test.
    assert fast.fast_available(), fast.unavailable_reason()
    assert fast.unavailable_reason() is None


# --- comparison helpers -------------------------------------------------------------------


def _payload_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view with both e4m3 NaN codes mapped to 0x7F (they count as equal)."""
    u = t.contiguous().view(torch.uint8).clone()
    u[(u & 0x7F) == 0x7F] = 0x7F
    return u


def _assert_same_payload(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, label
    g, w = _payload_bytes(got), _payload_bytes(want)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (
        f"{label}: {bad.shape[0]} bytes differ, first at {bad[:3].tolist()}: "
        f"got {[hex(int(g[tuple(i)])) for i in bad[:3]]}, "
        f"want {[hex(int(w[tuple(i)])) for i in bad[:3]]}"
    )


def _assert_same_resolved(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Same bits, except that any NaN equals any NaN (torch's NaN bits vary by path)."""
    assert got.dtype == want.dtype and got.shape == want.shape, label
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), f"{label}: NaN positions differ"
    view = torch.int32 if got.dtype == torch.float32 else torch.int16
    g, w = got.view(view)[~gn], want.view(view)[~wn]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{label}: {bad.shape[0]} values differ"


def _convert(
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast.convert`` of one part, row-major."""
    [got] = fast.convert(
        [ConvertPart(w, scale, row0, col0)], block_n=block_n, block_k=block_k, dtype=dtype
    )
    return got


def _convert_packed(
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
    out_weight: torch.Tensor,
    out_scale: torch.Tensor,
    out_row0: int,
) -> None:
    """``fast.convert`` of one part into a kernel-layout output."""
    got = fast.convert(
        [ConvertPart(w, scale, row0, col0, out_row0)],
        block_n=block_n,
        block_k=block_k,
        dtype=dtype,
        into=[PackedOut(out_weight, out_scale)],
    )
    assert got == []


def _flat(units: list) -> dict[str, list]:  # type: ignore[type-arg]
    """``(parts, out_weight, out_scale)`` units as the parts and outputs of one call."""
    parts = [ConvertPart(*p) for ps, _, _ in units for p in ps]
    into = [PackedOut(ow, os_) for ps, ow, os_ in units for _ in ps]
    return {"parts": parts, "into": into}


def _check_block(
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    row0: int,
    col0: int,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
    label: str,
) -> None:
    """resolve_block, convert and the packed convert against the reference."""
    kw = dict(row0=row0, col0=col0, block_n=block_n, block_k=block_k, dtype=dtype)
    want_r = ref.resolve_block(w, scale, **kw)
    _assert_same_resolved(fast.resolve_block(w, scale, **kw), want_r, f"{label} resolve")
    whole = row0 == 0 and col0 == 0  # what the numpy API (mxload convert) takes
    if whole:
        got_r = _np_resolve(w, scale, block_n, block_k, dtype)
        _assert_same_resolved(got_r, want_r, f"{label} kernels.resolve")
    if w.shape[1] % 32:
        return
    want_p, want_s = ref.mx_quantize(want_r)
    got_p, got_s = _convert(w, scale, **kw)
    assert got_s.dtype == torch.uint8
    assert torch.equal(got_s, want_s), f"{label} convert scale"
    _assert_same_payload(got_p, want_p, f"{label} convert payload")
    if whole:
        got_p, got_s = _np_convert(w, scale, block_n, block_k, dtype)
        assert torch.equal(got_s, want_s), f"{label} kernels.convert scale"
        _assert_same_payload(got_p, want_p, f"{label} kernels.convert payload")
    got_p, got_s = fast.mx_quantize(want_r)
    assert torch.equal(got_s, want_s), f"{label} mx_quantize scale"
    _assert_same_payload(got_p, want_p, f"{label} mx_quantize payload")


_NP_MODE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _np_convert(
    w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.convert`` (numpy in, numpy out: ``mxload convert``'s call) as tensors."""
    q, e = kernels.convert(
        w.contiguous().view(torch.uint8).numpy(), scale.contiguous().numpy(),
        block_n=bn, block_k=bk, mode=kernels.MODE_OF[_NP_MODE[dtype]], threads=2,
    )  # fmt: skip
    return torch.from_numpy(q).view(torch.float8_e4m3fn), torch.from_numpy(e)


def _np_resolve(
    w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype: torch.dtype
) -> torch.Tensor:
    bits = kernels.resolve(
        w.contiguous().view(torch.uint8).numpy(), scale.contiguous().numpy(),
        block_n=bn, block_k=bk, mode=kernels.MODE_OF[_NP_MODE[dtype]], threads=2,
    )  # fmt: skip
    return torch.from_numpy(bits.view(np.int32 if dtype == torch.float32 else np.int16)).view(dtype)


def _seed(*parts: object) -> int:
    """A stable seed per parametrization (``hash`` of a str varies between runs)."""
    return zlib.crc32(repr(parts).encode())


def _random_weight(gen: torch.Generator, n: int, k: int, kind: str) -> torch.Tensor:
    if kind == "bytes":  # every code, NaN (0x7F/0xFF) included
        return torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen).view(
            torch.float8_e4m3fn
        )
    # Weight-like: Gaussian rows with a per-row magnitude spanning many binades, so
    # groups hit every E4M3 exponent, subnormals and saturation (448) included.
    mag = torch.exp2(torch.randint(-14, 10, (n, 1), generator=gen).float())
    x = torch.randn(n, k, generator=gen) * mag
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def _random_scales(gen: torch.Generator, tr: int, tc: int, special: bool) -> torch.Tensor:
    # Binades from 2**-140 (f32 subnormal scales) to 2**120 (products overflow to Inf).
    e = torch.randint(-140, 121, (tr, tc), generator=gen).float()
    s = torch.exp2(e) * (1 + torch.rand(tr, tc, generator=gen))
    s = torch.where(e < -126, torch.exp2(e), s)  # keep subnormal scales exact
    if special:
        flat = s.view(-1)
        picks = torch.randint(0, flat.numel(), (4,), generator=gen)
        flat[picks] = torch.tensor([NAN, INF, 0.0, -(2.0**-120)])
    return s


def _covering(tr0: int, tr1: int, tc0: int, tc1: int, full: torch.Tensor) -> torch.Tensor:
    return full[tr0:tr1, tc0:tc1].contiguous()


# --- the named table ----------------------------------------------------------------------


@pytest.mark.parametrize("case", nc.MX_CASES, ids=lambda c: c.name)
def test_mx_table(case: nc.MxCase) -> None:
    assert nc.run_mx_cases(fast.mx_quantize, [case]) == []


@pytest.mark.parametrize("case", nc.RESOLVE_CASES, ids=lambda c: c.name)
def test_resolve_table(case: nc.ResolveCase) -> None:
    assert nc.run_resolve_cases(fast.resolve_block, [case]) == []


# --- fused cases derived by hand ----------------------------------------------------------


def _codes(*head: int, fill: int = 0x00) -> torch.Tensor:
    return torch.tensor([list(nc.codes(*head, fill=fill))], dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )


FUSED_CASES = [
    # Scale 2**-120, w = 1.0 (0x38), -2.0 (0xC0), 448 (0x7E), 2**-9 (0x01): products
    # 2**-120, -2**-119, 1.75 * 2**-112, 2**-129 (an f32 and bf16 subnormal: bf16 holds
    # it exactly, 16 units of 2**-133). Emax = 15 (1.75 * 2**-112) -> S = 7 -> r = 2**120:
    # 1 -> 0x38, -2 -> 0xC0, 448 -> 0x7E, 2**-9 -> e4m3 subnormal 0x01.
    ("tiny_scale_subnormal_product", _codes(0x38, 0xC0, 0x7E, 0x01), 2.0**-120, torch.bfloat16,
     (7,), nc.codes(0x38, 0xC0, 0x7E, 0x01)),
    # Negative scale -0.5: R = -w/2. w = 448 -> -224 = -1.75 * 2**7: Emax = 134 -> S = 126,
    # r = 2: -448 -> 0xFE; w = -1.0 (0xB8) -> +0.5 -> 1.0 -> 0x38; zeros -> -0 (0x80).
    ("negative_scale", _codes(0x7E, 0xB8), -0.5, torch.bfloat16,
     (126,), nc.codes(0xFE, 0x38, fill=0x80)),
    # A NaN code (0x7F) poisons its group: S = 0xFF, all payload NaN.
    ("nan_code", _codes(0x38, 0x7F), 1.0, torch.float16, (0xFF,), nc.NAN_GROUP),
    # Scale 2**120 with w = 448: 1.75 * 2**128 overflows f32 -> Inf -> S = 0xFF.
    ("overflow_to_inf", _codes(0x7E, 0x38), 2.0**120, torch.float32, (0xFF,), nc.NAN_GROUP),
    # fp16: 448 * 256 = 114688 > 65504 -> Inf -> S = 0xFF (the f32 product is finite).
    ("fp16_overflow", _codes(0x38, 0x7E), 256.0, torch.float16, (0xFF,), nc.NAN_GROUP),
    # Scale 2**-140: 448 * 2**-140 = 1.75 * 2**-132 is a bf16 subnormal (3.5 units of
    # 2**-133, a tie -> 4 units = 2**-131, exponent field 0): every element has field 0,
    # so Emax = 0 -> S = 0 -> all ±0 with the sign of R.
    ("bf16_subnormal_group_is_zero", _codes(0x7E, 0xFE, 0x38), 2.0**-140, torch.bfloat16,
     (0,), nc.codes(0x00, 0x80, 0x00)),
    # Same in fp32: 1.75 * 2**-132 is an f32 subnormal too (field 0) -> S = 0 -> ±0.
    ("fp32_subnormal_group_is_zero", _codes(0x7E, 0xFE), 2.0**-140, torch.float32,
     (0,), nc.codes(0x00, 0x80)),
]  # fmt: skip


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c[0])
def test_fused_cases(case: tuple) -> None:  # type: ignore[type-arg]
    name, w, scale, dtype, want_s, want_p = case
    s = torch.tensor([[scale]], dtype=torch.float32)
    kw = dict(row0=0, col0=0, block_n=128, block_k=128, dtype=dtype)
    for fn_name, fn in (("fast", _convert), ("reference", _ref_convert)):
        payload, scale_u8 = fn(w, s, **kw)
        assert nc.compare_mx(f"{name} ({fn_name})", payload, scale_u8, want_p, want_s) == []
    payload, scale_u8 = _np_convert(w, s, 128, 128, dtype)
    assert nc.compare_mx(f"{name} (kernels.convert)", payload, scale_u8, want_p, want_s) == []


def _ref_convert(
    w: torch.Tensor, s: torch.Tensor, **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.mx_quantize(ref.resolve_block(w, s, **kw))  # type: ignore[arg-type]


def test_tables_with_flush_denormal() -> None:
    # The tiny-scale cases have f32-subnormal scales and products: a kernel relying on
    # the FPU keeping subnormals would give 0 with flush-to-zero / denormals-are-zero.
    # Inputs are built before the mode is set (building them under it would flush them).
    r_inputs = [
        (c, nc.e4m3_tensor(c.w_codes), torch.tensor([list(r) for r in c.scale]))
        for c in nc.RESOLVE_CASES
    ]
    m_inputs = [(c, nc.values_tensor(c.values, c.dtype)) for c in nc.MX_CASES]
    # Normal scales with f32-subnormal products (2**-9 * 2**-120 = 2**-129).
    f_inputs = [(c, torch.tensor([[c[2]]], dtype=torch.float32)) for c in FUSED_CASES]
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        r_out = [
            fast.resolve_block(
                w,
                s,
                row0=c.row0,
                col0=c.col0,
                block_n=c.block_n,
                block_k=c.block_k,
                dtype=nc.TORCH_DTYPES[c.dtype],
            )
            for c, w, s in r_inputs
        ]
        m_out = [fast.mx_quantize(x) for _, x in m_inputs]
        f_out = [
            _convert(c[1], s, row0=0, col0=0, block_n=1, block_k=32, dtype=c[3])
            for c, s in f_inputs
        ]
    finally:
        torch.set_flush_denormal(False)
    for (c, _, _), out in zip(r_inputs, r_out, strict=True):
        got = nc.float_bits(out, c.dtype)
        for r, (grow, wrow) in enumerate(zip(got, c.expected_bits, strict=True)):
            for j, (g, want) in enumerate(zip(grow, wrow, strict=True)):
                if want == nc.ANY_NAN:
                    assert torch.isnan(out[r, j].float()), f"{c.name} [{r}, {j}]"
                else:
                    assert g == want, f"{c.name} [{r}, {j}] = {g:#x}, expected {want:#x}"
    for (c, _), (payload, scale) in zip(m_inputs, m_out, strict=True):
        assert nc.compare_mx(c.name, payload, scale, c.payload, c.scale) == []
    for (c, _), (payload, scale) in zip(f_inputs, f_out, strict=True):
        assert nc.compare_mx(c[0], payload, scale, c[5], c[4]) == []


# --- exhaustive: every E4M3 code under many scales -------------------------------------------


SCALES = [
    1.0, 2.0**-9, 3.0, 0.1, 1e-3, 2.0**-120, 2.0**-126, 2.0**-127, 2.0**-140, 2.0**-149,
    (2 - 2.0**-23) * 2.0**-127, 2.0**100, 2.0**120, 3.4e38, 65504.0 / 448, 10364771 * 2.0**-24,
    -1.0, -(2.0**-130), 0.0, -0.0, NAN, INF, -INF,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_codes_all_scales(dtype: torch.dtype) -> None:
    # Row j: all 256 codes under scale j, as 8 groups of 32 (one tile per row), then the
    # same codes in a permuted order so that each group's largest magnitude varies.
    codes = torch.arange(256, dtype=torch.uint8)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(7))
    rows = torch.stack([codes, codes[perm]] * len(SCALES)).view(torch.float8_e4m3fn)
    scale = torch.tensor(SCALES, dtype=torch.float32).repeat_interleave(2).reshape(-1, 1)
    _check_block(rows, scale, row0=0, col0=0, block_n=1, block_k=256, dtype=dtype, label="codes")


# --- seeded random blocks ----------------------------------------------------------------------

# (n, k, block_n, block_k, row0, col0): full tiles, partial edge tiles, odd group counts,
# slices starting mid-tile (groups straddling two scale tiles), tiny tiles, one row.
GEOMETRIES = [
    (256, 512, 128, 128, 0, 0),
    (200, 352, 128, 128, 0, 0),
    (130, 96, 128, 128, 100, 224),
    (77, 160, 128, 128, 300, 48),
    (64, 224, 64, 96, 5, 17),
    (33, 288, 7, 100, 3, 250),
    (1, 32, 128, 128, 129, 4096),
    (48, 64, 1, 1, 0, 0),
    (90, 40, 16, 16, 8, 8),  # K not a multiple of 32: resolve only
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["weights", "bytes"])
def test_random_blocks_match_reference(
    geometry: tuple[int, int, int, int, int, int], dtype: torch.dtype, kind: str
) -> None:
    n, k, bn, bk, row0, col0 = geometry
    gen = torch.Generator().manual_seed(_seed(geometry, dtype, kind))
    w = _random_weight(gen, n, k, kind)
    tr = (row0 + n - 1) // bn - row0 // bn + 1
    tc = (col0 + k - 1) // bk - col0 // bk + 1
    for special in (False, True):
        scale = _random_scales(gen, tr, tc, special)
        _check_block(
            w, scale, row0=row0, col0=col0, block_n=bn, block_k=bk, dtype=dtype,
            label=f"{geometry} {dtype} {kind} special={special}",
        )  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_give_same_bytes(threads: int) -> None:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(11)
    w = _random_weight(gen, 300, 256, "weights")
    scale = _random_scales(gen, 3, 2, special=False)
    _check_block(w, scale, row0=0, col0=0, block_n=128, block_k=128, dtype=torch.bfloat16,
                 label=f"threads={threads}")  # fmt: skip
    # The kernels use torch's thread count (each Ray worker's share), capped by numba's.
    assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)


def test_sharding_commutes() -> None:
    # docs/contract.md §2.1/§3: converting slices (with the tiles covering each) and putting them
    # back together equals converting the whole tensor.
    gen = torch.Generator().manual_seed(3)
    n, k, bn, bk = 300, 640, 128, 128
    w = _random_weight(gen, n, k, "weights")
    full_scale = _random_scales(gen, 3, 5, special=False)
    kw = dict(block_n=bn, block_k=bk, dtype=torch.bfloat16)
    whole_p, whole_s = _convert(w, full_scale, row0=0, col0=0, **kw)
    for r0, r1, c0, c1 in [(0, 100, 0, 640), (100, 300, 0, 320), (100, 300, 320, 640),
                           (37, 211, 96, 544)]:  # fmt: skip
        s = _covering(r0 // bn, (r1 - 1) // bn + 1, c0 // bk, (c1 - 1) // bk + 1, full_scale)
        p, sc = _convert(w[r0:r1, c0:c1], s, row0=r0, col0=c0, **kw)
        _assert_same_payload(p, whole_p[r0:r1, c0:c1], f"slice {(r0, r1, c0, c1)}")
        assert torch.equal(sc, whole_s[r0:r1, c0 // 32 : c1 // 32])


# --- mx_quantize on model-dtype tensors -----------------------------------------------------------


def _special_values(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (*shape[:-1], 1), generator=gen).float()
    )
    x = x.to(dtype)
    flat = x.view(-1)
    n = flat.numel()
    picks = torch.randint(0, n, (8,), generator=gen)
    tiny = {torch.bfloat16: 2.0**-130, torch.float16: 2.0**-20, torch.float32: 2.0**-140}[dtype]
    big = torch.finfo(dtype).max
    vals = torch.tensor([NAN, INF, -INF, tiny, -tiny, big, -big, -0.0]).to(dtype)
    flat[picks] = vals
    # Whole groups of subnormals / tiny values, where S is 0 or small.
    flat[:32] = (torch.randn(32, generator=gen) * tiny).to(dtype)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (3, 5, 160), (64, 2048)], ids=str)
def test_mx_quantize_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(_seed(dtype, shape))
    x = _special_values(gen, shape, dtype)
    want_p, want_s = ref.mx_quantize(x)
    got_p, got_s = fast.mx_quantize(x)
    assert got_p.shape == x.shape and got_s.shape == (*shape[:-1], shape[-1] // 32)
    assert torch.equal(got_s, want_s)
    _assert_same_payload(got_p, want_p, f"mx_quantize {dtype} {shape}")


@pytest.mark.parametrize("backend", ["cpu-fast", "cpu-reference"])
def test_mx_quantize_into_writes_the_reference_bytes_into_views_and_nothing_else(
    backend: str,
) -> None:
    """A message buffer's views take the payload and scales (the sender's conversion);
    the bytes around them stay as they were, on the fast path (in place) and on the
    reference backend (through its own results)."""
    from mxload.workers.numerics.backend import Backend

    be = (
        select.select_backend("cpu")
        if backend == "cpu-fast"
        else Backend(backend, torch.device("cpu"))
    )
    assert be.name == backend
    gen = torch.Generator().manual_seed(11)
    x = _special_values(gen, (9, 96), torch.bfloat16)
    want_p, want_s = ref.mx_quantize(x)
    buf = torch.full((7 + 9 * 96 + 9 * 3 + 5,), 0xA5, dtype=torch.uint8)
    q = buf[7 : 7 + 9 * 96].view(9, 96)
    sc = buf[7 + 9 * 96 : 7 + 9 * 96 + 27].view(9, 3)
    be.mx_quantize_into(x, q, sc)
    assert torch.equal(sc, want_s)
    _assert_same_payload(q.view(torch.float8_e4m3fn), want_p, f"into, {backend}")
    assert (buf[:7] == 0xA5).all() and (buf[7 + 9 * 96 + 27 :] == 0xA5).all()


def test_mx_quantize_into_refuses_an_output_of_the_wrong_shape() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(NumericsError, match=r"shape \(4, 2\)"):
        fast.mx_quantize_into(
            x, torch.empty(4, 64, dtype=torch.uint8), torch.empty(4, 3, dtype=torch.uint8)
        )


def test_mx_quantize_noncontiguous_input() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    xt = x.t()  # [96, 64], not contiguous
    want_p, want_s = ref.mx_quantize(xt)
    got_p, got_s = fast.mx_quantize(xt)
    assert torch.equal(got_s, want_s)
    _assert_same_payload(got_p, want_p, "transposed input")


# --- packed output (docs/contract.md §2.3) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "n_total", "out_row0", "col0"),
    [
        (128, 256, 128, 0, 0),  # whole linear, even g, word-aligned (8x8 transposes)
        (64, 96, 200, 64, 0),  # odd g = 3, a row chunk in the middle
        (50, 160, 123, 70, 0),  # odd g, N_total not a multiple of 8 (byte path)
        (130, 64, 136, 3, 0),  # chunk at an unaligned column
        (8, 32, 8, 0, 0),  # g = 1
        (72, 320, 80, 8, 48),  # a K slice starting mid-tile: groups straddle two tiles
    ],
)
def test_packed_matches_write_rows(n: int, k: int, n_total: int, out_row0: int, col0: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = _random_weight(gen, n, k, "weights")
    row0 = 40  # a row slice starting mid-tile
    tc = (col0 + k - 1) // 128 - col0 // 128 + 1
    scale = _random_scales(gen, (row0 + n - 1) // 128 + 1, tc, special=True)
    kw = dict(row0=row0, col0=col0, block_n=128, block_k=128, dtype=torch.bfloat16)
    pairs = (k // 32 + 1) // 2
    # Sentinel bytes everywhere: columns outside the chunk must come back untouched.
    want_w = torch.full((k, n_total), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want_s = torch.full((pairs, n_total, 2), 0x5A, dtype=torch.uint8)
    got_w, got_s = want_w.clone(), want_s.clone()
    payload, scale_u8 = ref.mx_quantize(ref.resolve_block(w, scale, **kw))
    repack.write_rows(want_w, want_s, payload, scale_u8, out_row0)
    _convert_packed(w, scale, **kw, out_weight=got_w, out_scale=got_s, out_row0=out_row0)
    _assert_same_payload(got_w, want_w, "packed weight")
    assert torch.equal(got_s, want_s)
    if out_row0 == 0 and n == n_total:
        pw, ps = repack.pack_linear(payload, scale_u8)
        _assert_same_payload(got_w, pw, "pack_linear weight")
        assert torch.equal(got_s, ps)


def test_packed_into_uint8_view_of_moe_stack() -> None:
    # A persistent MoE buffer [E, K, N]: expert 1's view is written in place, the others
    # and the buffer's address are untouched.
    gen = torch.Generator().manual_seed(9)
    e, n, k = 3, 64, 128
    buf_w = torch.zeros((e, k, n), dtype=torch.uint8)
    buf_s = torch.zeros((e, k // 64, n, 2), dtype=torch.uint8)
    ptr = buf_w.data_ptr()
    w = _random_weight(gen, n, k, "weights")
    scale = _random_scales(gen, 1, 1, special=False)
    kw = dict(row0=0, col0=0, block_n=128, block_k=128, dtype=torch.float16)
    _convert_packed(w, scale, **kw, out_weight=buf_w[1], out_scale=buf_s[1], out_row0=0)
    pw, ps = repack.pack_linear(*ref.mx_quantize(ref.resolve_block(w, scale, **kw)))
    _assert_same_payload(buf_w[1].view(torch.float8_e4m3fn), pw, "expert 1")
    assert torch.equal(buf_s[1], ps)
    assert int(buf_w[0].count_nonzero()) == 0 and int(buf_w[2].count_nonzero()) == 0
    assert buf_w.data_ptr() == ptr


# --- several parts in one launch (the loader's unit) ---------------------------------------------

# (rows, first source row, first source column) per part, one K for all: a gate/up pair
# starting mid-tile, a part of zero rows, and K-split slices whose groups straddle tiles.
UNIT_CASES = {
    "gate_up_mid_tile": (160, [(96, 40, 0), (72, 200, 0)]),
    "three_parts_one_empty": (96, [(8, 0, 0), (0, 8, 0), (130, 120, 0)]),
    "k_split_straddling": (64, [(48, 0, 96), (40, 300, 96)]),
    "odd_g": (96, [(24, 0, 32), (16, 128, 32)]),
}


def _unit_case(name: str) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor, int, int, int]]]:
    k, geo = UNIT_CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    parts = []
    out_row0 = 0
    for i, (n, row0, col0) in enumerate(geo):
        w = _random_weight(gen, n, k, "bytes" if i % 2 else "weights")
        tr = (row0 + n - 1) // 128 - row0 // 128 + 1 if n else 0
        tc = (col0 + k - 1) // 128 - col0 // 128 + 1
        parts.append((w, _random_scales(gen, tr, tc, special=i == 0), row0, col0, out_row0))
        out_row0 += n
    return k, parts


def _reference_stage(k: int, parts: list, n_total: int, dtype: torch.dtype) -> tuple:
    """Each part through the reference and repack.write_rows, on sentinel-filled buffers
    (an odd g's pad byte is 0 in every written column)."""
    pairs = (k // 32 + 1) // 2
    want_w = torch.full((k, n_total), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want_s = torch.full((pairs, n_total, 2), 0x5A, dtype=torch.uint8)
    for w, sc, row0, col0, out_row0 in parts:
        kw = dict(row0=row0, col0=col0, block_n=128, block_k=128, dtype=dtype)
        payload, scale_u8 = ref.mx_quantize(ref.resolve_block(w, sc, **kw))
        repack.write_rows(want_w, want_s, payload, scale_u8, out_row0)
    return want_w, want_s


def _one_lease(parts: list, scales_too: bool, shift: int = 0) -> list:
    """The parts' payloads (and, with ``scales_too``, then their scales) copied back to
    back into one buffer, ``shift`` bytes in, as the loader's lease holds them."""
    sizes = [w.numel() for w, *_ in parts] + (
        [4 * sc.numel() for _, sc, *_ in parts] if scales_too else []
    )
    lease = torch.zeros(shift + sum(sizes), dtype=torch.uint8)
    pieces = lease[shift:].split_with_sizes(sizes)
    out = []
    for i, (w, sc, *rest) in enumerate(parts):
        pw = pieces[i].view(torch.float8_e4m3fn).view(w.shape)
        pw.copy_(w)
        psc = sc
        if scales_too:
            psc = pieces[len(parts) + i].view(torch.float32).view(sc.shape)
            psc.copy_(sc)
        out.append((pw, psc, *rest))
    return out


@pytest.mark.parametrize("where", ["one_lease", "one_lease_misaligned", "separate"])
@pytest.mark.parametrize("name", sorted(UNIT_CASES))
def test_parts_in_one_launch_match_per_part_reference(name: str, where: str) -> None:
    k, parts = _unit_case(name)
    if where == "one_lease":
        parts = _one_lease(parts, scales_too=True)
    elif where == "one_lease_misaligned":  # payloads at odd offsets: copied, same bytes
        parts = _one_lease(parts, scales_too=False, shift=3)
    n_total = sum(w.shape[0] for w, *_ in parts) + 8  # 8 columns no part writes
    want_w, want_s = _reference_stage(k, parts, n_total, torch.bfloat16)
    got_w = torch.full((k, n_total), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got_s = torch.full(want_s.shape, 0x5A, dtype=torch.uint8)
    fast.convert(**_flat([(parts, got_w, got_s)]), block_n=128, block_k=128, dtype=torch.bfloat16)
    _assert_same_payload(got_w, want_w, f"{name} parts payload")
    assert torch.equal(got_s, want_s), f"{name} parts scales"
    # the reference backend (one call per part) agrees through the same interface
    ref_w = torch.full((k, n_total), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ref_s = torch.full(want_s.shape, 0x5A, dtype=torch.uint8)
    cpu_ref = select.select_backend("cpu", prefer_fast=False)
    cpu_ref.convert(
        **_flat([(parts, ref_w, ref_s)]), block_n=128, block_k=128, dtype=torch.bfloat16
    )
    _assert_same_payload(ref_w, want_w, f"{name} reference backend payload")
    assert torch.equal(ref_s, want_s)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("outputs", ["one_storage", "separate"])
def test_units_of_different_k_in_one_launch_match_per_part_reference(
    outputs: str, threads: int
) -> None:
    """Every UNIT_CASES unit (K = 64, 96, 160) in one call, the loader's step: with the
    outputs carved from one storage (payloads first, then scales, as the loader's stage
    lease) the kernel takes them in one launch and deals their work items, of unequal
    size, over the threads; in separate storages it launches once per unit. Same bytes as
    the reference per part either way, and nothing outside each unit's columns written."""
    torch.set_num_threads(threads)
    names = sorted(UNIT_CASES)
    cases = [_unit_case(name) for name in names]
    all_parts = _one_lease([p for _, parts in cases for p in parts], scales_too=True)
    units_in = []
    at = 0
    for k, parts in cases:
        units_in.append((k, all_parts[at : at + len(parts)]))
        at += len(parts)
    shapes = []
    for k, parts in units_in:
        n_total = sum(w.shape[0] for w, *_ in parts) + 8  # 8 columns no part writes
        shapes.append(((k, n_total), ((k // 32 + 1) // 2, n_total, 2)))
    if outputs == "one_storage":
        sizes = [a * b for (a, b), _ in shapes] + [a * b * c for _, (a, b, c) in shapes]
        store = torch.full((sum(sizes) + 5,), 0xEE, dtype=torch.uint8)  # + a tail no one writes
        pieces = store[: sum(sizes)].split_with_sizes(sizes)
        outs = [
            (
                pieces[i]
                .copy_(torch.full_like(pieces[i], 0xA5))
                .view(torch.float8_e4m3fn)
                .view(sw),
                pieces[len(shapes) + i]
                .copy_(torch.full_like(pieces[len(shapes) + i], 0x5A))
                .view(ss),
            )
            for i, (sw, ss) in enumerate(shapes)
        ]
    else:
        outs = [
            (
                torch.full(sw, 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn),
                torch.full(ss, 0x5A, dtype=torch.uint8),
            )
            for sw, ss in shapes
        ]
    fast.convert(
        **_flat([(parts, ow, os_) for (_, parts), (ow, os_) in zip(units_in, outs, strict=True)]),
        block_n=128, block_k=128, dtype=torch.bfloat16,
    )  # fmt: skip
    for name, (k, parts), (ow, os_) in zip(names, units_in, outs, strict=True):
        want_w, want_s = _reference_stage(k, parts, ow.shape[1], torch.bfloat16)
        _assert_same_payload(ow, want_w, f"{name} payload ({outputs}, {threads} threads)")
        assert torch.equal(os_, want_s), f"{name} scales ({outputs}, {threads} threads)"
    if outputs == "one_storage":
        assert bool((store[-5:] == 0xEE).all())
    # the reference backend (one call per part) agrees through the same interface
    cpu_ref = select.select_backend("cpu", prefer_fast=False)
    ref_outs = [
        (
            torch.empty_like(ow).view(torch.uint8).fill_(0xA5).view(torch.float8_e4m3fn),
            torch.full_like(os_, 0x5A),
        )
        for ow, os_ in outs
    ]
    cpu_ref.convert(
        **_flat([(parts, rw, rs) for (_, parts), (rw, rs) in zip(units_in, ref_outs, strict=True)]),
        block_n=128, block_k=128, dtype=torch.bfloat16,
    )  # fmt: skip
    for (ow, os_), (rw, rs) in zip(outs, ref_outs, strict=True):
        _assert_same_payload(rw, ow, "reference backend")
        assert torch.equal(rs, os_)


# --- bad input ----------------------------------------------------------------------------------


def test_refusals() -> None:
    w = torch.zeros((4, 48), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.ones((1, 1), dtype=torch.float32)
    kw = dict(row0=0, col0=0, block_n=128, block_k=128, dtype=torch.bfloat16)
    with pytest.raises(NumericsError, match="multiple of 32"):
        _convert(w, s, **kw)
    with pytest.raises(NumericsError, match="multiple of 32"):
        fast.mx_quantize(torch.zeros(4, 48, dtype=torch.bfloat16))
    with pytest.raises(NumericsError, match="dtype"):
        fast.mx_quantize(torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(NumericsError, match="float8_e4m3fn"):
        fast.resolve_block(w.view(torch.uint8), s, **kw)
    with pytest.raises(NumericsError, match="tiles"):  # the reference's scale-shape rule
        fast.resolve_block(w, torch.ones((2, 1)), **kw)
    with pytest.raises(NumericsError, match="dtype"):
        fast.resolve_block(w, s, **{**kw, "dtype": torch.float64})
    w64 = torch.zeros((4, 64), dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(NumericsError, match="out_scale"):
        _convert_packed(
            w64, s, **kw, out_weight=torch.zeros((64, 4), dtype=torch.uint8),
            out_scale=torch.zeros((2, 4, 2), dtype=torch.uint8), out_row0=0,
        )  # fmt: skip
    with pytest.raises(NumericsError, match="does not fit"):
        _convert_packed(
            w64, s, **kw, out_weight=torch.zeros((64, 4), dtype=torch.uint8),
            out_scale=torch.zeros((1, 4, 2), dtype=torch.uint8), out_row0=1,
        )  # fmt: skip


def test_empty_blocks() -> None:
    w = torch.zeros((0, 64), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.ones((0, 1), dtype=torch.float32)
    kw = dict(row0=0, col0=0, block_n=128, block_k=128, dtype=torch.bfloat16)
    assert fast.resolve_block(w, s, **kw).shape == (0, 64)
    p, sc = _convert(w, s, **kw)
    assert p.shape == (0, 64) and sc.shape == (0, 2)


# --- concurrency and the no-numba fallback ----------------------------------------------------------


def test_concurrent_calls_from_threads() -> None:
    # The loader may convert from several Python threads; launches are serialized, and
    # every thread must get its own correct bytes.
    gen = torch.Generator().manual_seed(21)
    blocks = [_random_weight(gen, 96, 256, "weights") for _ in range(4)]
    scale = _random_scales(gen, 1, 2, special=False)
    kw = dict(row0=0, col0=0, block_n=128, block_k=128, dtype=torch.bfloat16)
    want = [ref.mx_quantize(ref.resolve_block(b, scale, **kw)) for b in blocks]
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = _convert(blocks[i], scale, **kw)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert torch.equal(got[i][1], want[i][1])
        _assert_same_payload(got[i][0], want[i][0], f"thread {i}")


def test_without_numba_reports_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh copy of the kernels module imported while numba cannot be imported.
    monkeypatch.setitem(sys.modules, "numba", None)
    spec = importlib.util.spec_from_file_location(
        "mxload.workers.numerics._kernels_without_numba", kernels.__file__
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look the module up
    spec.loader.exec_module(mod)
    assert mod.available() is False
    assert "numba" in (mod.unavailable_reason() or "")
    with pytest.raises(NumericsError, match="unavailable"):
        mod.convert(
            np.zeros((1, 32), np.uint8), np.ones((1, 1), np.float32),
            block_n=1, block_k=32, mode=mod.MODE_BF16, threads=1,
        )  # fmt: skip
    # The torch wrappers answer from the kernels module they launch.
    monkeypatch.setattr(fast, "kernels", mod)
    assert fast.fast_available() is False
    w = torch.zeros((1, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(NumericsError, match="unavailable"):
        fast.resolve_block(
            w, torch.ones((1, 1)), row0=0, col0=0, block_n=1, block_k=32, dtype=torch.bfloat16
        )


def test_backend_uses_reference_when_fast_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "fast_available", lambda: False)
    b = select.select_backend("cpu")
    assert b.name == "cpu-reference"
    monkeypatch.undo()
    assert select.select_backend("cpu").name == "cpu-fast"
