"""mxload.orchestrator.plan.safetensors_header: hostile files (docs/contract.md §1.3) and agreement with safetensors."""

from __future__ import annotations

import itertools
import json
import pickle
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mxload.orchestrator.errors import (
    HeaderError,
    HeaderTooLarge,
    InvalidHeaderJson,
    InvalidOffset,
    InvalidShape,
    InvalidTensorName,
    OverlappingTensors,
    SizeMismatch,
    TruncatedFile,
    UnknownDtype,
)
from mxload.orchestrator.plan.safetensors_header import (
    FileHeader,
    TensorInfo,
    parse_header,
    parse_header_length,
)

from tests.hostile import ATTACKS, EVIL, Attack, build_safetensors, layout, raw_file

FILE = "model-00001-of-00002.safetensors"


def parse_bytes(blob: bytes, file: str = FILE) -> FileHeader:
    """What the catalog does with a whole file: prefix, then header."""
    n = parse_header_length(blob[:8], file=file, file_size=len(blob))
    return parse_header(blob[8 : 8 + n], file=file, file_size=len(blob))


# --- the attack table ---------------------------------------------------------------------


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_attack_is_refused_with_its_error(attack: Attack) -> None:
    blob = attack.build()
    with pytest.raises(HeaderError) as info:
        parse_bytes(blob)
    err = info.value
    assert type(err) is attack.error, f"{attack.name}: {attack.why}: got {type(err).__name__}"
    assert err.file == FILE
    assert FILE in str(err), f"{attack.name}: message does not name the file: {err}"
    if attack.tensor is not None:
        assert err.tensor == attack.tensor, f"{attack.name}: names {err.context.get('tensor')}"
        assert repr(attack.tensor) in str(err), f"{attack.name}: message lacks tensor: {err}"


def test_every_header_error_class_has_an_attack() -> None:
    classes = {a.error for a in ATTACKS}
    assert classes == {
        HeaderTooLarge,
        TruncatedFile,
        InvalidHeaderJson,
        UnknownDtype,
        InvalidShape,
        InvalidOffset,
        SizeMismatch,
        OverlappingTensors,
        InvalidTensorName,
    }


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_attack_errors_pickle(attack: Attack) -> None:
    # Errors cross Ray process boundaries.
    with pytest.raises(HeaderError) as info:
        parse_bytes(attack.build())
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value)
    assert str(again) == str(info.value)
    assert again.context == info.value.context


# --- the length prefix --------------------------------------------------------------------


def test_header_length_at_the_cap_is_accepted_above_refused() -> None:
    cap = 100 * 1000 * 1000  # docs/contract.md §1.3: 100 MB
    big_file = 2 * cap
    assert parse_header_length(struct.pack("<Q", cap), file=FILE, file_size=big_file) == cap
    with pytest.raises(HeaderTooLarge, match="cap"):
        parse_header_length(struct.pack("<Q", cap + 1), file=FILE, file_size=big_file)


def test_header_length_equal_to_the_rest_of_the_file_is_accepted() -> None:
    assert parse_header_length(struct.pack("<Q", 92), file=FILE, file_size=100) == 92
    with pytest.raises(HeaderTooLarge):
        parse_header_length(struct.pack("<Q", 93), file=FILE, file_size=100)


def test_short_prefix_is_truncated() -> None:
    with pytest.raises(TruncatedFile):
        parse_header_length(b"\x02\x00\x00\x00", file=FILE, file_size=4)
    with pytest.raises(TruncatedFile):
        parse_header_length(b"", file=FILE, file_size=0)


def test_header_larger_than_file_given_to_parse_header() -> None:
    with pytest.raises(HeaderTooLarge):
        parse_header(b"{}" + b" " * 100, file=FILE, file_size=50)


# --- well-formed files --------------------------------------------------------------------


def test_offsets_are_absolute_and_in_data_order() -> None:
    header = {
        "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [16, 28]},
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    }
    body = json.dumps(header).encode()
    blob = raw_file(header, bytes(28))
    meta = parse_bytes(blob)
    data_start = 8 + len(body)
    assert meta.header_len == len(body)
    assert meta.data_start == data_start
    assert meta.file_size == len(blob)
    assert list(meta.tensors) == ["a", "b"]
    assert meta.tensors["a"] == TensorInfo("a", "F32", (4,), FILE, data_start, 16)
    b = meta.tensors["b"]
    assert (b.start, b.nbytes, b.end, b.numel, b.itemsize) == (
        data_start + 16,
        12,
        data_start + 28,
        6,
        2,
    )
    assert meta.metadata == {}


def test_metadata_and_padding_are_read() -> None:
    # Writers pad the header with spaces to an 8-byte boundary.
    header = {
        "__metadata__": {"format": "pt"},
        "x": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
    }
    body = json.dumps(header).encode() + b"   "
    meta = parse_bytes(raw_file(body, b"abc"))
    assert meta.metadata == {"format": "pt"}
    assert list(meta.tensors) == ["x"]
    assert meta.header_len == len(body)


def test_zero_size_and_scalar_tensors() -> None:
    header, data_len = layout(
        {"empty": ("F32", [0, 7]), "scalar": ("F64", []), "after": ("U8", [2])}
    )
    meta = parse_bytes(raw_file(header, bytes(data_len)))
    assert meta.tensors["empty"].nbytes == 0
    assert meta.tensors["scalar"].shape == () and meta.tensors["scalar"].nbytes == 8
    assert meta.tensors["after"].nbytes == 2


def test_zero_size_tensor_inside_another_is_not_an_overlap() -> None:
    # A zero-byte tensor occupies no byte (the reference library accepts it anywhere).
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
    }
    meta = parse_bytes(raw_file(header, bytes(16)))
    assert set(meta.tensors) == {"a", "z"}


def test_gaps_and_trailing_bytes_are_accepted() -> None:
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
    }
    meta = parse_bytes(raw_file(header, bytes(40)))
    assert meta.tensors["b"].start == meta.data_start + 12


def test_empty_header_object() -> None:
    meta = parse_bytes(raw_file({}))
    assert meta.tensors == {} and meta.metadata == {}


def test_huge_int_literal_is_invalid_json_not_a_crash() -> None:
    body = b'{"x": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}'
    with pytest.raises(HeaderError):
        parse_bytes(raw_file(body, b"\x00"))


def test_out_of_range_tensor_after_a_gap_is_invalid_offset_not_truncation() -> None:
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        EVIL: {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    with pytest.raises(InvalidOffset) as info:
        parse_bytes(raw_file(header, bytes(10)))
    assert info.value.tensor == EVIL


def test_truncation_names_the_first_tensor_cut() -> None:
    blob = build_safetensors({"a": ("F32", [4]), "b": ("F32", [4]), "c": ("F32", [4])})
    with pytest.raises(TruncatedFile) as info:
        parse_bytes(blob[:-20])  # cuts all of c and 4 bytes of b
    assert info.value.tensor == "b"


# --- fuzzing: hostile bytes never escape as anything but a HeaderError ----------------------

_VALID = build_safetensors(
    {"w": ("F8_E4M3", [4, 8]), "s": ("F32", [1, 1]), "n": ("BF16", [8])}, metadata={"format": "pt"}
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=6),
    st.integers(0, len(_VALID)),
)
def test_mutated_files_parse_or_raise_header_errors(edits: list[tuple[int, int]], cut: int) -> None:
    blob = bytearray(_VALID)
    for pos, byte in edits:
        blob[pos] = byte
    blob = blob[: max(cut, 0)] if cut < len(blob) else blob
    try:
        meta = parse_bytes(bytes(blob))
    except HeaderError:
        return
    # Whatever parses is safe to plan reads from: in bounds, sized right, disjoint.
    spans = []
    for t in meta.tensors.values():
        assert meta.data_start <= t.start <= t.end <= meta.file_size
        assert t.nbytes == t.numel * t.itemsize
        if t.nbytes:
            spans.append((t.start, t.end))
    spans.sort()
    for (_, e1), (s2, _) in itertools.pairwise(spans):
        assert e1 <= s2


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_headers_parse_or_raise_header_errors(body: bytes) -> None:
    try:
        parse_bytes(raw_file(body, bytes(64)))
    except HeaderError:
        pass


# --- agreement with the real safetensors library -------------------------------------------


def test_agrees_with_safetensors_library(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> object:
        return torch.randn(*shape, generator=gen)

    tensors = {
        "model.layers.0.mlp.down_proj.weight": rnd(96, 160).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv": rnd(1, 2).abs(),
        "model.embed_tokens.weight": rnd(33, 16).to(torch.bfloat16),
        "model.norm.weight": rnd(16).to(torch.float16),
        "f64": rnd(3, 2).to(torch.float64),
        "e5m2": rnd(5, 7).to(torch.float8_e5m2),
        "i64": torch.arange(-5, 6, dtype=torch.int64),
        "i32": torch.arange(10, dtype=torch.int32).reshape(2, 5),
        "i16": torch.arange(9, dtype=torch.int16),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "u8": torch.arange(200, 213, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    blob = path.read_bytes()
    meta = parse_bytes(blob, "model.safetensors")

    assert set(meta.tensors) == set(tensors)
    assert meta.metadata == {"format": "pt", "note": "x"}
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for name in f.keys():
            info = meta.tensors[name]
            sl = f.get_slice(name)
            assert info.dtype == sl.get_dtype(), name
            assert list(info.shape) == list(sl.get_shape()), name
            # Offsets: the bytes at [start, end) are the tensor's own bytes.
            want = tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert blob[info.start : info.end] == want, name
    assert meta.tensors["model.layers.0.mlp.down_proj.weight"].dtype == "F8_E4M3"
    assert meta.tensors["e5m2"].dtype == "F8_E5M2"
    assert meta.tensors["bool"].dtype == "BOOL"


def test_cut_real_file_is_truncated(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64, 64, dtype=torch.bfloat16)}, str(path))
    blob = path.read_bytes()
    with pytest.raises(TruncatedFile) as info:
        parse_bytes(blob[:-1], "model.safetensors")
    assert info.value.tensor == "a"
