"""The streaming safetensors writer and byte views (workers/safetensors_io.py).

The official ``safetensors`` library is the judge of what we write; headers are also
parsed by hand here (not by mxload's parser) to check layout promises.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import uuid

import fsspec
import pytest
import torch
from mxload.workers.safetensors_io import SafetensorsWriter, tensor_from_bytes, write_safetensors
from safetensors import safe_open
from safetensors.torch import load as st_load


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w_fp8": (torch.randn(5, 33, generator=g) * 50).to(torch.float8_e4m3fn),
        "scale_inv_f32": torch.rand(1, 3, generator=g),
        "norm_bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "odd_u8": torch.arange(3, dtype=torch.uint8),  # 3 bytes: would misalign what follows
        "half": torch.randn(2, 3, generator=g).to(torch.float16),
        "i64": torch.arange(-4, 5, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _raw_header(blob: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", blob[:8])
    return n, json.loads(blob[8 : 8 + n])


def test_roundtrip_through_the_official_reader(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "a.safetensors")
    write_safetensors(path, tensors, {"format": "pt", "who": "mxload"})
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "who": "mxload"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert _same(f.get_tensor(name), t), name
    assert not os.path.exists(path + ".partial")


def test_layout_is_aligned_and_gapless(tmp_path):
    path = str(tmp_path / "a.safetensors")
    write_safetensors(path, _tensors())
    blob = open(path, "rb").read()
    n, header = _raw_header(blob)
    assert (8 + n) % 8 == 0  # data section starts 8-aligned
    itemsize = {"F8_E4M3": 1, "F32": 4, "BF16": 2, "U8": 1, "F16": 2, "I64": 8}
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(blob) - 8 - n
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end == start  # no gaps, no overlaps
    for k, v in header.items():
        if k != "__metadata__":
            assert v["data_offsets"][0] % itemsize[v["dtype"]] == 0, k


def test_any_write_order_gives_the_same_file(tmp_path):
    tensors = _tensors()
    specs = [(k, _st_dtype(t), tuple(t.shape)) for k, t in tensors.items()]
    paths = []
    for i, order in enumerate([list(tensors), list(reversed(tensors))]):
        path = str(tmp_path / f"{i}.safetensors")
        with SafetensorsWriter(path, specs) as w:
            for name in order:
                w.write(name, tensors[name])
        paths.append(path)
    a, b = (open(p, "rb").read() for p in paths)
    assert a == b
    loaded = st_load(a)
    assert all(_same(loaded[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("order", ["data", "reversed"])
def test_fsspec_destination(order):
    tensors = _tensors()
    specs = [(k, _st_dtype(t), tuple(t.shape)) for k, t in tensors.items()]
    url = f"memory://mxload-test-{uuid.uuid4().hex}/x.safetensors"
    with SafetensorsWriter(url, specs, {"k": "v"}) as w:
        names = w.order if order == "data" else list(reversed(w.order))
        for name in names:
            w.write(name, tensors[name])
    with fsspec.open(url, "rb") as f:
        blob = f.read()
    loaded = st_load(blob)
    assert all(_same(loaded[k], tensors[k]) for k in tensors)
    _, header = _raw_header(blob)
    assert header["__metadata__"] == {"k": "v"}


def test_bytes_input_and_write_order_property(tmp_path):
    path = str(tmp_path / "b.safetensors")
    specs = [("a", "U8", (3,)), ("b", "F32", (2,)), ("c", "BF16", (1,))]
    with SafetensorsWriter(path, specs) as w:
        assert w.order == ["b", "c", "a"]  # largest item size first, spec order within
        w.write("a", b"\x01\x02\x03")
        w.write("b", struct.pack("<2f", 1.5, -2.0))
        w.write("c", bytearray(b"\x80\x3f"))  # bf16 1.0
    with safe_open(path, "pt") as f:
        assert f.get_tensor("a").tolist() == [1, 2, 3]
        assert f.get_tensor("b").tolist() == [1.5, -2.0]
        assert f.get_tensor("c").float().tolist() == [1.0]


def test_close_refuses_missing_tensors_and_discards(tmp_path):
    path = str(tmp_path / "c.safetensors")
    w = SafetensorsWriter(path, [("a", "U8", (2,)), ("b", "U8", (2,))])
    w.write("a", b"xy")
    with pytest.raises(ValueError, match=r"1 tensor\(s\) never written: b"):
        w.close()
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")


def test_exception_in_context_discards(tmp_path):
    path = str(tmp_path / "d.safetensors")
    with pytest.raises(RuntimeError), SafetensorsWriter(path, [("a", "U8", (2,))]) as w:
        w.write("a", b"xy")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("name", "data", "error", "match"),
    [
        ("a", torch.zeros(3, dtype=torch.uint8), ValueError, r"declared \[2, 2\], got \[3\]"),
        ("a", torch.zeros(2, 2, dtype=torch.int8), ValueError, "declared U8, got torch torch.int8"),
        ("a", torch.zeros(2, 4, dtype=torch.uint8)[:, ::2], ValueError, "not contiguous"),
        ("a", b"abc", ValueError, "needs 4 bytes .U8 \\[2, 2\\]., got 3"),
        ("zz", b"abcd", KeyError, "not in the header"),
    ],
)
def test_write_checks(tmp_path, name, data, error, match):
    w = SafetensorsWriter(str(tmp_path / "e.safetensors"), [("a", "U8", (2, 2))])
    with pytest.raises(error, match=match):
        w.write(name, data)
    w.abort()


def test_double_write_and_bad_specs(tmp_path):
    path = str(tmp_path / "f.safetensors")
    w = SafetensorsWriter(path, [("a", "U8", (1,))])
    w.write("a", b"x")
    with pytest.raises(ValueError, match="written twice"):
        w.write("a", b"x")
    w.abort()
    for specs, match in [
        ([("a", "U8", (1,)), ("a", "U8", (1,))], "listed twice"),
        ([("a", "Q7", (1,))], "unknown dtype"),
        ([("a", "U8", (-1,))], "invalid shape"),
        ([("__metadata__", "U8", (1,))], "invalid tensor name"),
    ]:
        with pytest.raises(ValueError, match=match):
            SafetensorsWriter(path, specs)
    with pytest.raises(ValueError, match="str to str"):
        SafetensorsWriter(path, [], {"k": 1})  # type: ignore[dict-item]


# --- tensor_from_bytes -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(_tensors()))
def test_tensor_from_bytes_matches_the_source(name):
    t = _tensors()[name]
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    got = tensor_from_bytes(raw, _st_dtype(t), tuple(t.shape))
    assert _same(got, t)


def test_tensor_from_bytes_aliases_writable_buffers():
    buf = bytearray(struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
    t = tensor_from_bytes(buf, "F32", (2, 2))
    buf[0:4] = struct.pack("<f", 9.0)
    assert t[0, 0].item() == 9.0  # a view, not a copy
    ro = tensor_from_bytes(bytes(buf), "F32", (4,))  # read-only input: copied, still right
    assert ro.tolist() == [9.0, 2.0, 3.0, 4.0]


def test_tensor_from_bytes_misaligned_is_still_correct():
    raw = bytearray(1 + 8)
    raw[1:] = struct.pack("<2f", 0.5, -8.0)
    t = tensor_from_bytes(memoryview(raw)[1:], "F32", (2,))
    assert t.tolist() == [0.5, -8.0]


def test_tensor_from_bytes_checks():
    with pytest.raises(ValueError, match="needs 8 bytes, got 7"):
        tensor_from_bytes(bytearray(7), "F32", (2,))
    with pytest.raises(ValueError, match="unknown safetensors dtype"):
        tensor_from_bytes(bytearray(2), "F12", (2,))


def _st_dtype(t: torch.Tensor) -> str:
    return {
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float32: "F32",
        torch.bfloat16: "BF16",
        torch.uint8: "U8",
        torch.float16: "F16",
        torch.int64: "I64",
    }[t.dtype]
