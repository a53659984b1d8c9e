"""Safetensors files built on purpose: well-formed ones and one hostile file per attack.

In the spirit of safetensors' ``attacks/`` folder: each attack is a named builder of the
raw bytes of a whole file, with the error class the parser must raise and the tensor it
must name (None when the fault is in the file as a whole). Pure Python, no torch, so the
tests of the pure core can use them anywhere.

``ATTACKS`` is the named table; a test that fails reports the attack by name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

# Itemsizes spelled out here rather than imported, so fixtures do not lean on the code
# they test.
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

EVIL = "evil"
"""The name every hostile tensor has, so tests can check that the message names it."""


def raw_file(header: Any, data: bytes = b"", *, declared_len: int | None = None) -> bytes:
    """prefix + header + data. ``header`` is a JSON-able object (dumped compactly) or raw
    bytes; ``declared_len`` overrides the length written in the 8-byte prefix."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    n = len(body) if declared_len is None else declared_len
    return struct.pack("<Q", n) + body + data


def layout(
    entries: Mapping[str, tuple[str, Sequence[int]]],
) -> tuple[dict[str, Any], int]:
    """Header entries for tensors laid out back to back in the given order, and the data
    section's length. ``entries``: name -> (dtype, shape)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in entries.items():
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset


def build_safetensors(
    entries: Mapping[str, tuple[str, Sequence[int]]],
    *,
    metadata: Mapping[str, str] | None = None,
    fill: Callable[[int], bytes] | None = None,
) -> bytes:
    """A well-formed safetensors file. Data bytes are ``fill(length)`` (default: a
    repeating 0..250 pattern, so a wrong offset reads visibly wrong bytes)."""
    header, data_len = layout(entries)
    if metadata is not None:
        header = {"__metadata__": dict(metadata), **header}
    data = fill(data_len) if fill is not None else bytes(i % 251 for i in range(data_len))
    return raw_file(header, data)


@dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[], bytes]
    error: type[HeaderError]
    tensor: str | None
    """The tensor the error must name; None for faults of the whole file."""
    why: str


def _good() -> dict[str, Any]:
    # One innocent tensor before the evil one, so errors must pick the right name.
    return {"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}


def _with_evil(evil: Any, data_len: int) -> Callable[[], bytes]:
    def build() -> bytes:
        return raw_file({**_good(), EVIL: evil}, bytes(data_len))

    return build


def _truncated() -> bytes:
    whole = build_safetensors({"a": ("F32", [8]), EVIL: ("BF16", [16])})
    return whole[:-5]  # cut inside the last tensor


def _missing_data() -> bytes:
    header, _ = layout({EVIL: ("F32", [8]), "z": ("F32", [2])})
    return raw_file(header, b"")


def _header_beyond_file() -> bytes:
    return raw_file({"__metadata__": {}}, b"", declared_len=1000)


def _nested() -> bytes:
    return raw_file(b"[" * 100_000 + b"]" * 100_000)


def _named(name: str) -> Callable[[], bytes]:
    def build() -> bytes:
        return raw_file(
            {**_good(), name: {"dtype": "U8", "shape": [4], "data_offsets": [16, 20]}}, bytes(20)
        )

    return build


ATTACKS: tuple[Attack, ...] = (
    Attack(
        "tensor_name_with_nul",
        _named("model.a\x00b"),
        InvalidTensorName,
        "model.a\x00b",
        "a NUL inside a tensor name: it would travel into every file written from it",
    ),
    Attack(
        "tensor_name_climbing_out",
        _named("../../etc/evil"),
        InvalidTensorName,
        "../../etc/evil",
        "path syntax in a tensor name",
    ),
    Attack(
        "oversized_header_length",
        lambda: raw_file({}, b"", declared_len=2**64 - 1),
        HeaderTooLarge,
        None,
        "prefix declares a 16 EiB header: refused before any read, by the 100 MB cap",
    ),
    Attack(
        "header_length_beyond_file",
        _header_beyond_file,
        HeaderTooLarge,
        None,
        "prefix declares 1000 bytes; the file holds a few dozen after the prefix",
    ),
    Attack(
        "file_shorter_than_prefix",
        lambda: b"\x10\x00\x00",
        TruncatedFile,
        None,
        "3 bytes: not even the 8-byte length prefix",
    ),
    Attack(
        "header_not_utf8",
        lambda: raw_file(b'{"ok": "\xff\xfe"}'),
        InvalidHeaderJson,
        None,
        "invalid UTF-8 bytes inside a JSON string",
    ),
    Attack(
        "header_not_json",
        lambda: raw_file(b'{"ok": {"dtype": "F32",'),
        InvalidHeaderJson,
        None,
        "JSON cut in the middle",
    ),
    Attack(
        "header_json_array",
        lambda: raw_file(b'[{"dtype": "F32"}]'),
        InvalidHeaderJson,
        None,
        "valid JSON, but an array, not an object",
    ),
    Attack(
        "header_nested_too_deep",
        _nested,
        InvalidHeaderJson,
        None,
        "100k nested arrays: must not crash the parser with a RecursionError",
    ),
    Attack(
        "header_nan_constant",
        lambda: raw_file(b'{"evil": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 0]}}'),
        InvalidHeaderJson,
        None,
        "NaN is not JSON, though Python's json accepts it by default",
    ),
    Attack(
        "duplicate_tensor_name",
        lambda: raw_file(
            b'{"evil": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
            b' "evil": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
            bytes(8),
        ),
        InvalidHeaderJson,
        EVIL,
        "one name twice: a lax parser keeps the last, another reader the first",
    ),
    Attack(
        "entry_not_object",
        _with_evil([1, 2, 3], 16),
        InvalidHeaderJson,
        EVIL,
        "a tensor entry that is a list",
    ),
    Attack(
        "entry_missing_offsets",
        _with_evil({"dtype": "F32", "shape": [1]}, 16),
        InvalidHeaderJson,
        EVIL,
        "no data_offsets",
    ),
    Attack(
        "metadata_not_str_map",
        lambda: raw_file({"__metadata__": {"format": 1}, **_good()}, bytes(16)),
        InvalidHeaderJson,
        "__metadata__",
        "__metadata__ values must be strings",
    ),
    Attack(
        "metadata_not_object",
        lambda: raw_file({"__metadata__": ["pt"], **_good()}, bytes(16)),
        InvalidHeaderJson,
        "__metadata__",
        "__metadata__ must be an object",
    ),
    Attack(
        "unknown_dtype",
        _with_evil({"dtype": "F128", "shape": [1], "data_offsets": [16, 32]}, 32),
        UnknownDtype,
        EVIL,
        "F128 is no safetensors dtype",
    ),
    Attack(
        "dtype_not_string",
        _with_evil({"dtype": 4, "shape": [1], "data_offsets": [16, 20]}, 20),
        UnknownDtype,
        EVIL,
        "dtype given as a number",
    ),
    Attack(
        "negative_shape",
        _with_evil({"dtype": "F32", "shape": [-1, 4], "data_offsets": [16, 16]}, 16),
        InvalidShape,
        EVIL,
        "a negative dimension (numel would be -4)",
    ),
    Attack(
        "float_shape",
        _with_evil({"dtype": "F32", "shape": [2.0], "data_offsets": [16, 24]}, 24),
        InvalidShape,
        EVIL,
        "a float dimension",
    ),
    Attack(
        "bool_shape",
        _with_evil({"dtype": "F32", "shape": [True], "data_offsets": [16, 20]}, 20),
        InvalidShape,
        EVIL,
        "true is an int in Python, not a dimension",
    ),
    Attack(
        "shape_not_list",
        _with_evil({"dtype": "F32", "shape": 4, "data_offsets": [16, 32]}, 32),
        InvalidShape,
        EVIL,
        "shape given as a number",
    ),
    Attack(
        "overflowing_shape",
        # 2**32 * 2**32 * 4 bytes = 2**66: wraps a u64 to 0, so a wrapping reader would
        # accept data_offsets [16, 16].
        _with_evil({"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [16, 16]}, 16),
        InvalidShape,
        EVIL,
        "numel * itemsize beyond 64 bits",
    ),
    Attack(
        "non_int_offsets",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [16.0, 32.0]}, 32),
        InvalidOffset,
        EVIL,
        "offsets given as floats",
    ),
    Attack(
        "string_offsets",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": ["16", "32"]}, 32),
        InvalidOffset,
        EVIL,
        "offsets given as strings",
    ),
    Attack(
        "three_offsets",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [16, 32, 48]}, 48),
        InvalidOffset,
        EVIL,
        "data_offsets must be exactly [start, end]",
    ),
    Attack(
        "negative_offset",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}, 16),
        InvalidOffset,
        EVIL,
        "a negative start would read the header as data",
    ),
    Attack(
        "end_before_start",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [32, 16]}, 32),
        InvalidOffset,
        EVIL,
        "end < start",
    ),
    Attack(
        "offsets_outside_file",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [1000, 1016]}, 32),
        InvalidOffset,
        EVIL,
        "points far past the 32-byte data section, leaving a gap no writer leaves",
    ),
    Attack(
        "huge_offsets",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [2**64, 2**64 + 16]}, 32),
        InvalidOffset,
        EVIL,
        "offsets past any 64-bit file",
    ),
    Attack(
        "size_mismatch",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [16, 28]}, 32),
        SizeMismatch,
        EVIL,
        "4 x F32 is 16 bytes, the offsets span 12",
    ),
    Attack(
        "overlapping_tensors",
        _with_evil({"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}, 24),
        OverlappingTensors,
        EVIL,
        "bytes 8..16 belong to both 'ok' and 'evil'",
    ),
    Attack(
        "truncated_file",
        _truncated,
        TruncatedFile,
        EVIL,
        "a valid file cut 5 bytes short, inside its last tensor",
    ),
    Attack(
        "missing_data_section",
        _missing_data,
        TruncatedFile,
        EVIL,
        "a header with no data section after it at all",
    ),
)
"""Every attack, by name. Each error class appears at least once."""
