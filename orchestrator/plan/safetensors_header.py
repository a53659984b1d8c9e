"""Safetensors headers, parsed as hostile input: bytes -> metadata. Pure.

Why parse them ourselves: the planner needs every tensor's absolute byte offset to plan
ranged reads of only a rank's own bytes (docs/contract.md §4), and it must do so from two small reads
per shard (the 8-byte length prefix and the header), never from the whole file.

The file format: ``u64 little-endian N`` | ``N bytes of UTF-8 JSON`` | data section.
The JSON object maps tensor names to ``{"dtype", "shape", "data_offsets": [start, end]}``
(offsets relative to the data section) plus an optional ``"__metadata__"`` str -> str map.

docs/contract.md §1.3: every check below has its own error class (``mxload.orchestrator.errors``) and a
message naming the file and, where there is one, the tensor:

- ``TruncatedFile``: fewer than 8 bytes, or a well-formed layout whose data runs past the
  end of the file (a file cut short, or one whose data section is missing).
- ``HeaderTooLarge``: declared header length above 100 MB or beyond the end of the file.
- ``InvalidHeaderJson``: not UTF-8, not JSON, not an object, duplicate keys, an entry that
  is not an object or lacks a field, ``__metadata__`` not str -> str.
- ``UnknownDtype``: a dtype string outside ``formats.SAFETENSORS_ITEMSIZE``.
- ``InvalidShape``: not a list of non-negative ints, or a byte size above ``MAX_TENSOR_BYTES``.
- ``InvalidOffset``: offsets not two non-negative ints, ``end < start``, or pointing past
  the data section when the layout is not simply a truncated file.
- ``SizeMismatch``: ``end - start != numel * itemsize``.
- ``OverlappingTensors``: two tensors share a byte.

Limits, on purpose: gaps between tensors and trailing bytes after the last tensor are
accepted (they are harmless to a reader of ranges; the reference library refuses them);
unknown fields inside a tensor entry are ignored, as the reference library ignores them.
Python ints do not overflow, so the "overflow" checks are caps that keep every size a sane
64-bit quantity for the workers (numpy/torch) that later use them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import (
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
from .formats import HEADER_MAX_BYTES, SAFETENSORS_ITEMSIZE

PREFIX_BYTES = 8
"""Length of the little-endian u64 header-length prefix."""

METADATA_KEY = "__metadata__"
"""The one header key that is not a tensor."""

MAX_TENSOR_BYTES = 2**62
"""Cap on one tensor's byte size: keeps numel * itemsize (and every offset built from it)
well inside a signed 64-bit integer, which is what the workers index with."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of one safetensors file, located absolutely in that file."""

    name: str
    dtype: str
    """The safetensors dtype string (``F8_E4M3``, ``BF16``, ``F32``, ``U8``...)."""
    shape: tuple[int, ...]
    file: str
    """The file's name relative to the checkpoint root (as the index names it)."""
    start: int
    """ABSOLUTE byte offset of the first data byte in the file: 8 + header_len + data_offsets[0]."""
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return SAFETENSORS_ITEMSIZE[self.dtype]

    @property
    def end(self) -> int:
        """Absolute offset one past the last data byte."""
        return self.start + self.nbytes


@dataclass(frozen=True)
class FileHeader:
    """A parsed, validated header of one safetensors file."""

    file: str
    file_size: int
    header_len: int
    """N, the JSON header's length in bytes (without the 8-byte prefix)."""
    data_start: int
    """Absolute offset of the data section: 8 + header_len."""
    tensors: Mapping[str, TensorInfo]
    """Tensor name -> info, in data order (by start offset, then name)."""
    metadata: Mapping[str, str]
    """The ``__metadata__`` map ({} when absent)."""


def parse_header_length(prefix8: bytes, *, file: str, file_size: int) -> int:
    """Decode and bound the header length N from the first 8 bytes (docs/contract.md §1.3).

    ``file_size`` is the size of the whole file. Refuses N above 100 MB or beyond the end
    of the file before anyone reads N bytes on its word.
    """
    if file_size < PREFIX_BYTES or len(prefix8) < PREFIX_BYTES:
        raise TruncatedFile(
            f"{file}: file is {min(file_size, len(prefix8))} bytes, shorter than the "
            f"{PREFIX_BYTES}-byte safetensors header-length prefix",
            file=file,
        )
    (n,) = struct.unpack("<Q", bytes(prefix8[:PREFIX_BYTES]))
    # The messages never print n: in a file that is not safetensors those 8 bytes are
    # whatever the file starts with (a password hash, a key), and a message must not
    # echo a file's content.
    if n > HEADER_MAX_BYTES:
        raise HeaderTooLarge(
            f"{file}: not a safetensors file: its 8-byte length prefix declares a header "
            f"above the {HEADER_MAX_BYTES}-byte cap",
            file=file,
        )
    if n > file_size - PREFIX_BYTES:
        raise HeaderTooLarge(
            f"{file}: not a safetensors file (or a truncated one): its 8-byte length prefix "
            f"declares a header longer than the {file_size - PREFIX_BYTES} bytes the file "
            f"holds after it ({file_size} bytes in all)",
            file=file,
        )
    return int(n)


def parse_header(header: bytes, *, file: str, file_size: int) -> FileHeader:
    """Validate the JSON header (the N bytes after the prefix) of a file of ``file_size`` bytes."""
    header_len = len(header)
    data_start = PREFIX_BYTES + header_len
    if data_start > file_size:
        raise HeaderTooLarge(
            f"{file}: header of {header_len} bytes does not fit in a file of {file_size} bytes",
            file=file,
        )
    obj = _decode_json(header, file)
    metadata = _metadata(obj.pop(METADATA_KEY, None), file)

    infos: list[TensorInfo] = []
    for name, entry in obj.items():
        infos.append(_tensor_info(name, entry, file=file, data_start=data_start))

    # Sorting by start makes the overlap test linear; zero-byte tensors occupy no byte,
    # so they overlap nothing (the reference library allows them anywhere).
    infos.sort(key=lambda t: (t.start, t.nbytes, t.name))
    _check_overlaps(infos, file)
    _check_bounds(infos, file=file, file_size=file_size, data_start=data_start)
    return FileHeader(
        file=file,
        file_size=file_size,
        header_len=header_len,
        data_start=data_start,
        tensors={t.name: t for t in infos},
        metadata=metadata,
    )


# --- pieces -------------------------------------------------------------------------------


def reject_json_constant(token: str) -> NoReturn:
    # json accepts NaN/Infinity by default; they are not JSON and never valid here.
    raise ValueError(f"non-JSON constant {token}")


class JsonObject(dict[str, Any]):
    """A decoded JSON object that remembers the keys it saw more than once."""

    dups: list[str]


def json_object_pairs(pairs: list[tuple[str, Any]]) -> JsonObject:
    # A duplicate key would silently keep the last entry; a hostile file could use that
    # to make two readers disagree on where a tensor is. Recorded here, refused by the
    # caller, which knows which object (header, metadata, tensor entry) it is looking at.
    out = JsonObject()
    out.dups = []
    for key, value in pairs:
        if key in out:
            out.dups.append(key)
        out[key] = value
    return out


def _dups(obj: Any) -> list[str]:
    return obj.dups if isinstance(obj, JsonObject) else []


def _decode_json(header: bytes, file: str) -> dict[str, Any]:
    try:
        text = bytes(header).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidHeaderJson(
            f"{file}: header is not valid UTF-8 (byte {exc.start}: {exc.reason})", file=file
        ) from None
    try:
        obj = json.loads(
            text, object_pairs_hook=json_object_pairs, parse_constant=reject_json_constant
        )
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and Python's cap on huge integer literals;
        # RecursionError a deeply nested hostile header.
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise InvalidHeaderJson(f"{file}: header is not valid JSON ({reason})", file=file) from None
    if not isinstance(obj, dict):
        raise InvalidHeaderJson(
            f"{file}: header is a JSON {type(obj).__name__}, not an object", file=file
        )
    if _dups(obj):
        name = _dups(obj)[0]
        raise InvalidHeaderJson(f"{file}: header names {name!r} twice", file=file, tensor=name)
    return obj


def _metadata(raw: Any, file: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or _dups(raw):
        what = f"names {_dups(raw)[0]!r} twice" if _dups(raw) else f"is a {type(raw).__name__}"
        raise InvalidHeaderJson(
            f"{file}: {METADATA_KEY!r} must be an object of strings; it {what}",
            file=file,
            tensor=METADATA_KEY,
            key=METADATA_KEY,
        )
    for key, value in raw.items():
        if not isinstance(value, str):
            raise InvalidHeaderJson(
                f"{file}: {METADATA_KEY!r} entry {key!r} must be a string, got "
                f"{type(value).__name__}",
                file=file,
                tensor=METADATA_KEY,
                key=f"{METADATA_KEY}.{key}",
            )
    return dict(raw)


def _bad_tensor_name(name: str) -> str | None:
    """Why ``name`` is not a usable tensor name (None if it is). Names become module paths,
    dump and report keys and file content of every checkpoint mxload writes: control
    characters (NUL...) and path syntax have no place in them."""
    if not name:
        return "an empty tensor name"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "tensor name holds a control character"
    if "/" in name or "\\" in name:
        return "tensor name holds a path separator; names are dotted module paths"
    return None


def _tensor_info(name: str, entry: Any, *, file: str, data_start: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    bad_name = _bad_tensor_name(name)
    if bad_name:
        raise InvalidTensorName(f"{where}: {bad_name}", file=file, tensor=name)
    if not isinstance(entry, dict):
        raise InvalidHeaderJson(
            f"{where}: entry must be an object with dtype, shape and data_offsets, got "
            f"{type(entry).__name__}",
            file=file,
            tensor=name,
        )
    if _dups(entry):
        raise InvalidHeaderJson(
            f"{where}: entry names {_dups(entry)[0]!r} twice",
            file=file,
            tensor=name,
            key=_dups(entry)[0],
        )
    for field_name in ("dtype", "shape", "data_offsets"):
        if field_name not in entry:
            raise InvalidHeaderJson(
                f"{where}: entry lacks {field_name!r}", file=file, tensor=name, key=field_name
            )

    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
        raise UnknownDtype(
            f"{where}: unknown dtype {_short(dtype)}; known: {', '.join(SAFETENSORS_ITEMSIZE)}",
            file=file,
            tensor=name,
        )
    itemsize = SAFETENSORS_ITEMSIZE[dtype]

    shape_raw = entry["shape"]
    if not isinstance(shape_raw, list):
        raise InvalidShape(
            f"{where}: shape must be a list of non-negative integers, got {_short(shape_raw)}",
            file=file,
            tensor=name,
        )
    nbytes = itemsize
    for dim in shape_raw:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise InvalidShape(
                f"{where}: shape {_short(shape_raw)} has {_short(dim)}; dimensions must be non-negative "
                "integers",
                file=file,
                tensor=name,
            )
        # Checked as we go, so a hostile shape of a million huge dims stops at once.
        nbytes *= dim
        if nbytes > MAX_TENSOR_BYTES:
            raise InvalidShape(
                f"{where}: shape {_short(shape_raw)} of {dtype} overflows: more than "
                f"{MAX_TENSOR_BYTES} bytes",
                file=file,
                tensor=name,
            )
    shape = tuple(shape_raw)

    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in offsets)
    ):
        raise InvalidOffset(
            f"{where}: data_offsets must be two non-negative integers [start, end], got "
            f"{_short(offsets)}",
            file=file,
            tensor=name,
        )
    start, end = offsets
    if end < start:
        raise InvalidOffset(
            f"{where}: data_offsets [{start}, {end}] end before they start",
            file=file,
            tensor=name,
            byte_range=(start, end),
        )
    if end - start != nbytes:
        raise SizeMismatch(
            f"{where}: data_offsets [{start}, {end}] span {end - start} bytes but shape "
            f"{_short(list(shape))} of {dtype} needs {nbytes}",
            file=file,
            tensor=name,
            byte_range=(start, end),
        )
    if end > MAX_TENSOR_BYTES:
        # Offsets this large cannot be in any file; refuse before adding them to anything.
        raise InvalidOffset(
            f"{where}: data_offsets [{start}, {end}] are beyond any possible file",
            file=file,
            tensor=name,
            byte_range=(start, end),
        )
    return TensorInfo(
        name=name, dtype=dtype, shape=shape, file=file, start=data_start + start, nbytes=nbytes
    )


def _check_overlaps(infos: list[TensorInfo], file: str) -> None:
    prev: TensorInfo | None = None
    for info in infos:
        if info.nbytes == 0:
            continue
        if prev is not None and info.start < prev.end:
            raise OverlappingTensors(
                f"{file}: tensors {prev.name!r} (bytes {prev.start}..{prev.end}) and "
                f"{info.name!r} (bytes {info.start}..{info.end}) overlap",
                file=file,
                tensor=info.name,
                other=prev.name,
            )
        prev = info


def _check_bounds(infos: list[TensorInfo], *, file: str, file_size: int, data_start: int) -> None:
    data_len = file_size - data_start
    past = [t for t in infos if t.end > file_size]
    if not past:
        return
    first = past[0]
    # A layout that tiles [0, end) without gaps is what every writer produces; if the file
    # is shorter than that, the file was cut (or its data section never written), which
    # is a different fault from a header that points at bytes no writer would.
    cursor = data_start
    contiguous = True
    for t in infos:
        if t.nbytes == 0:
            continue
        if t.start != cursor:
            contiguous = False
            break
        cursor = t.end
    rel = (first.start - data_start, first.end - data_start)
    if contiguous:
        raise TruncatedFile(
            f"{file}: file is {file_size} bytes, but its header places tensor {first.name!r} "
            f"at bytes {first.start}..{first.end} (data section needs {cursor - data_start} "
            f"bytes, has {data_len}); the file is truncated",
            file=file,
            tensor=first.name,
            byte_range=rel,
        )
    raise InvalidOffset(
        f"{file}: tensor {first.name!r} data_offsets [{rel[0]}, {rel[1]}] point outside the "
        f"data section ({data_len} bytes)",
        file=file,
        tensor=first.name,
        byte_range=rel,
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
