"""Tests of workers/numerics/repack.py: the kernel layouts of docs/contract.md §2.3."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import NumericsError
from mxload.workers.numerics import repack


def _payload(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _scale(n: int, groups: int, seed: int = 1) -> torch.Tensor:
    # Bytes 1..255 so that a pad byte 0 can never be mistaken for data.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n, groups), generator=g, dtype=torch.uint8)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_pack_scale_spelled_out() -> None:
    # N = 2 rows, g = 3 groups: pairs (g0, g1) and (g2, pad 0).
    scale = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8)
    packed = repack.pack_scale(scale)
    assert packed.tolist() == [[[1, 2], [4, 5]], [[3, 0], [6, 0]]]
    assert packed.is_contiguous() and packed.dtype == torch.uint8


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7, 8])
def test_pack_scale_element_mapping_and_round_trip(groups: int) -> None:
    n = 5
    scale = _scale(n, groups)
    packed = repack.pack_scale(scale)
    pairs = -(-groups // 2)
    assert tuple(packed.shape) == (pairs, n, 2) and packed.is_contiguous()
    for j in range(pairs):
        for row in range(n):
            for p in range(2):
                k = 2 * j + p
                want = int(scale[row, k]) if k < groups else 0  # odd g: pad byte 0
                assert int(packed[j, row, p]) == want
    assert torch.equal(repack.unpack_scale(packed, groups), scale)


@pytest.mark.parametrize(("n", "k"), [(3, 32), (4, 64), (5, 96), (1, 224), (8, 1024)])
def test_pack_linear_round_trip(n: int, k: int) -> None:
    payload, scale = _payload(n, k), _scale(n, k // 32)
    weight, scale_packed = repack.pack_linear(payload, scale)
    assert tuple(weight.shape) == (k, n) and weight.is_contiguous()
    assert weight.dtype == torch.float8_e4m3fn
    assert torch.equal(_u8(weight), _u8(payload).t())
    p2, s2 = repack.unpack_linear(weight, scale_packed)
    assert torch.equal(_u8(p2), _u8(payload)) and torch.equal(s2, scale)


def test_pack_moe_is_per_expert_pack_linear() -> None:
    e, n, k = 3, 6, 96  # g = 3, odd
    payloads = [_payload(n, k, seed=i) for i in range(e)]
    scales = [_scale(n, k // 32, seed=10 + i) for i in range(e)]
    weight, scale_packed = repack.pack_moe(payloads, scales)
    assert tuple(weight.shape) == (e, k, n) and weight.is_contiguous()
    assert tuple(scale_packed.shape) == (e, 2, n, 2) and scale_packed.is_contiguous()
    for i in range(e):
        w_i, s_i = repack.pack_linear(payloads[i], scales[i])
        assert torch.equal(_u8(weight[i]), _u8(w_i))
        assert torch.equal(scale_packed[i], s_i)
    # Stacked tensors work the same as lists, and unpack inverts.
    w2, s2 = repack.pack_moe(torch.stack(payloads), torch.stack(scales))
    assert torch.equal(_u8(w2), _u8(weight)) and torch.equal(s2, scale_packed)
    up, us = repack.unpack_moe(weight, scale_packed)
    assert torch.equal(_u8(up), _u8(torch.stack(payloads)))
    assert torch.equal(us, torch.stack(scales))


@pytest.mark.parametrize("groups", [2, 3])
def test_write_rows_touches_only_its_rows(groups: int) -> None:
    n_total, k = 11, 32 * groups
    payload, scale = _payload(n_total, k), _scale(n_total, groups)
    want_w, want_s = repack.pack_linear(payload, scale)
    pairs = -(-groups // 2)
    weight_buf = torch.full((k, n_total), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale_buf = torch.full((pairs, n_total, 2), 0xAA, dtype=torch.uint8)
    w_ptr, s_ptr = weight_buf.data_ptr(), scale_buf.data_ptr()
    # Write rows [3, 7) only; everything else must keep its sentinel.
    repack.write_rows(weight_buf, scale_buf, payload[3:7], scale[3:7], row0=3)
    wb, sb = _u8(weight_buf), scale_buf
    assert torch.equal(wb[:, 3:7], _u8(want_w)[:, 3:7])
    assert torch.equal(sb[:, 3:7], want_s[:, 3:7])  # includes the 0 pad byte when g is odd
    assert bool((wb[:, :3] == 0x55).all()) and bool((wb[:, 7:] == 0x55).all())
    assert bool((sb[:, :3] == 0xAA).all()) and bool((sb[:, 7:] == 0xAA).all())
    # Chunked writes of the rest complete the buffers; nothing moved.
    for r0, r1 in [(0, 3), (7, 10), (10, 11)]:
        repack.write_rows(weight_buf, scale_buf, payload[r0:r1], scale[r0:r1], row0=r0)
    assert torch.equal(wb, _u8(want_w)) and torch.equal(sb, want_s)
    assert weight_buf.data_ptr() == w_ptr and scale_buf.data_ptr() == s_ptr


def test_write_rows_into_a_moe_expert_view() -> None:
    e, n, k = 3, 4, 96
    weight_buf = torch.zeros((e, k, n), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale_buf = torch.zeros((e, 2, n, 2), dtype=torch.uint8)
    payload, scale = _payload(n, k), _scale(n, 3)
    repack.write_rows(weight_buf[1], scale_buf[1], payload, scale, row0=0)
    want_w, want_s = repack.pack_linear(payload, scale)
    assert torch.equal(_u8(weight_buf[1]), _u8(want_w)) and torch.equal(scale_buf[1], want_s)
    assert bool((_u8(weight_buf[0]) == 0).all()) and bool((_u8(weight_buf[2]) == 0).all())
    assert bool((scale_buf[0] == 0).all()) and bool((scale_buf[2] == 0).all())


def test_write_rows_refuses_out_of_range_and_mismatch() -> None:
    weight_buf = torch.zeros((64, 4), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale_buf = torch.zeros((1, 4, 2), dtype=torch.uint8)
    with pytest.raises(NumericsError):
        repack.write_rows(weight_buf, scale_buf, _payload(2, 64), _scale(2, 2), row0=3)
    with pytest.raises(NumericsError):
        repack.write_rows(weight_buf, scale_buf, _payload(2, 32), _scale(2, 1), row0=0)


def test_pack_refuses_mismatched_groups() -> None:
    with pytest.raises(NumericsError):
        repack.pack_linear(_payload(2, 64), _scale(2, 3))
    with pytest.raises(NumericsError):
        repack.pack_linear(_payload(2, 48), _scale(2, 1))
    with pytest.raises(NumericsError):
        repack.unpack_scale(torch.zeros((2, 3, 2), dtype=torch.uint8), 5)


@pytest.mark.parametrize(
    ("n", "k", "n_total", "row0"),
    [
        (64, 64, 128, 64),  # one whole 64-row item, 16x16 blocks throughout
        (136, 64, 272, 128),  # three items, the last 8 rows by bytes
        (9, 16, 24, 8),  # under one block: bytes only
        (13, 40, 40, 3),  # under one block of rows, an odd column
        (100, 96, 300, 7),  # blocks at odd places in q, items of 64 and 36 rows
        (70, 36, 72, 0),  # K off the blocks: its last 4 columns by bytes
        (33, 17, 50, 17),  # both edges, an item of 33 rows
        (1, 32, 1, 0),
        (200, 48, 320, 64),  # 64-byte lines: three 64-row line groups, then 8 rows of bytes
        (130, 40, 192, 0),  # lines, with K's last 8 columns by bytes
    ],
)
def test_row_writer_transposes_as_torch_does(n: int, k: int, n_total: int, row0: int) -> None:
    """The numba row writer's payload part writes what torch's transposing copy does, and
    nothing outside the chunk's columns, on one thread and on two (numba is a dependency:
    its kernels run here)."""
    from mxload.workers.numerics import kernels

    assert kernels.available(), kernels.unavailable_reason()
    g = torch.Generator().manual_seed(n * 1000 + k)
    payload = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    before = torch.randint(0, 256, (k, n_total), dtype=torch.uint8, generator=g)
    want = before.clone()
    want[:, row0 : row0 + n] = payload.t()
    none = np.empty(0, dtype=np.uint8)
    # Whole 64-byte lines where q's rows are aligned at row0 (torch's allocations are
    # 64-byte aligned): every full 64-row item, when K has a 16-column band.
    assert before.data_ptr() % 64 == 0
    lines = n // 64 * 64 if n_total % 64 == 0 and row0 % 64 == 0 and k >= 16 else 0
    for threads, parallel_from, final in (
        (1, 0, True),
        (2, 0, True),  # on two threads whatever the size
        (2, 0, False),  # staging: no line stores
        (2, kernels.PARALLEL_ROWS_BYTES, True),  # these sizes: on one thread
    ):
        got = before.clone()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "PARALLEL_ROWS_BYTES", parallel_from)
            as_lines = kernels.run_rows(
                payload.numpy(), k, got.view(-1).numpy(), none, 0, none, row0, threads, final=final
            )
        assert torch.equal(got, want), (threads, parallel_from, final)
        assert as_lines == (lines if final else 0), (threads, final)


@pytest.mark.parametrize(
    ("src_shape", "k", "n_total", "col"),
    [
        ((64, 16), 16, 64, 32),  # 32 columns past the end
        ((64, 16), 16, 64, -1),
        ((10,), 16, 64, 0),  # a ragged last row
        ((64, 16), 16, 63.5, 0),  # q is no whole number of rows
    ],
)
def test_row_writer_refuses_rows_that_do_not_fit_and_writes_nothing(
    src_shape: tuple[int, ...], k: int, n_total: float, col: int
) -> None:
    from mxload.workers.numerics import kernels

    assert kernels.available(), kernels.unavailable_reason()
    q = np.full(int(k * n_total), 0xA5, dtype=np.uint8)
    src = np.ones(src_shape, dtype=np.uint8)
    none = np.empty(0, dtype=np.uint8)
    with pytest.raises(NumericsError, match="do not fit"):
        kernels.run_rows(src, k, q, none, 0, none, col, 1)
    assert (q == 0xA5).all()


@pytest.mark.parametrize(("n", "k", "n_total", "row0"), [(64, 64, 128, 64), (100, 96, 300, 7)])
def test_write_rows_takes_strided_chunks(n: int, k: int, n_total: int, row0: int) -> None:
    """A chunk that is a view (a K slice of a wider result) is written as its contiguous
    copy would be, by the kernel, scales included."""
    g = torch.Generator().manual_seed(n + k)
    wide = torch.randint(0, 256, (n, 2 * k), dtype=torch.uint8, generator=g)
    wide_s = torch.randint(0, 256, (n, 2 * k // 32), dtype=torch.uint8, generator=g)
    payload, scale = wide[:, k:], wide_s[:, k // 32 :]
    assert not payload.is_contiguous() and not scale.is_contiguous()
    bufs = [
        (
            torch.zeros((k, n_total), dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.zeros(((k // 32 + 1) // 2, n_total, 2), dtype=torch.uint8),
        )
        for _ in range(2)
    ]
    for (wb, sb), (p, s) in zip(
        bufs, [(payload, scale), (payload.clone(), scale.clone())], strict=True
    ):
        repack.write_rows(wb, sb, p.view(torch.float8_e4m3fn), s, row0)
    assert torch.equal(bufs[0][0].view(torch.uint8), bufs[1][0].view(torch.uint8))
    assert torch.equal(bufs[0][1], bufs[1][1])
    assert torch.equal(bufs[0][0].view(torch.uint8)[:, row0 : row0 + n], payload.t())
    assert torch.equal(repack.unpack_scale(bufs[0][1], k // 32)[row0 : row0 + n], scale)


@pytest.mark.parametrize(("n", "g", "n_total", "row0"), [(5, 4, 9, 3), (7, 3, 7, 0), (1, 1, 4, 2)])
def test_row_writer_pairs_the_scales(n: int, g: int, n_total: int, row0: int) -> None:
    """The numba scale writer: ``buf[j, row0 + i, p] = scale[i, 2j + p]``, the pad byte
    of an odd ``g`` 0, nothing outside the chunk's columns (spelled out per element)."""
    from mxload.workers.numerics import kernels

    assert kernels.available(), kernels.unavailable_reason()
    gen = torch.Generator().manual_seed(n * 100 + g)
    scale = torch.randint(1, 256, (n, g), dtype=torch.uint8, generator=gen)
    pairs = (g + 1) // 2
    before = torch.randint(1, 256, (pairs, n_total, 2), dtype=torch.uint8, generator=gen)
    want = before.clone()
    for i in range(n):
        for j in range(pairs):
            for p in range(2):
                want[j, row0 + i, p] = scale[i, 2 * j + p] if 2 * j + p < g else 0
    for threads in (1, 2):
        got = before.clone()
        payload = torch.zeros((n, 32 * g), dtype=torch.uint8)
        q = torch.zeros((32 * g) * n_total, dtype=torch.uint8)
        kernels.run_rows(
            payload.numpy(),
            32 * g,
            q.numpy(),
            scale.numpy(),
            g,
            got.view(-1).numpy(),
            row0,
            threads,
        )
        assert torch.equal(got, want)


def test_row_writer_refuses_a_strided_output_and_writes_nothing() -> None:
    """The vector transposes address the output as one run of bytes: a strided view
    (every other byte of a buffer) is refused, not written past."""
    from mxload.workers.numerics import kernels

    assert kernels.available(), kernels.unavailable_reason()
    buf = np.full(2 * 16 * 17, 0xA5, dtype=np.uint8)
    src = np.arange(16 * 16, dtype=np.uint8).reshape(16, 16)
    with pytest.raises(NumericsError, match="not one contiguous run"):
        kernels.run_rows(src, 16, buf[::2], src[:, :0], 0, buf[:0], 1, 1)
    assert (buf == 0xA5).all()
