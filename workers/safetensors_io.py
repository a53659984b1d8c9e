"""Writing safetensors files as a stream, and viewing raw bytes as tensors.

Why a writer of our own: mxload writes checkpoints (``make-checkpoint``, ``convert``) and
per-rank dumps (``--dump``) whose tensors are produced one at a time; the ``safetensors``
library wants every tensor in memory at once. :class:`SafetensorsWriter` knows every name,
dtype and shape up front, so it writes the header first and then each tensor's bytes as
they come: memory stays bounded by one tensor.

Layout written (the safetensors format, as the official library writes it): 8-byte
little-endian header length, the JSON header (``__metadata__`` when given, then each
tensor's ``dtype``, ``shape`` and ``data_offsets`` relative to the data section) padded
with spaces to a multiple of 8, then the data with no gaps. The data is ordered by item
size, largest first, then by the order of ``specs`` (:attr:`SafetensorsWriter.order`): with
the data section 8-byte aligned, every tensor then starts aligned to its item size.

Tensors are torch tensors, numpy arrays or raw bytes; torch is imported only by callers
that hold tensors (``mxload convert`` never imports it).

Destinations: a local path is written to ``<path>.partial`` with positioned writes, so
tensors may arrive in any order, and renamed into place on :meth:`close` (a crash leaves
no file that looks complete). Any other fsspec URL (``memory://``, ``s3://``...) is written
sequentially: a tensor that arrives before its turn is held in memory until the tensors
before it are written, so the memory bound holds when tensors are written in ``order``.

:func:`tensor_from_bytes` turns a buffer of little-endian bytes into a torch tensor of a
safetensors dtype without copying when the buffer is writable and aligned.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import fsspec  # type: ignore[import-untyped]
import numpy as np

from ..orchestrator.plan.formats import SAFETENSORS_ITEMSIZE
from .storage.urls import is_remote, local_path

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian only
    raise ImportError("mxload's safetensors I/O assumes a little-endian host")


@functools.cache
def _to_torch() -> dict[str, Any]:
    """safetensors dtype string -> torch dtype (those this torch build has), built on
    first use: torch is imported only by callers that hold tensors (``mxload convert``
    writes numpy arrays and never imports it)."""
    import torch

    names = {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2", "I16": "int16", "U16": "uint16", "F16": "float16",
        "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
        "I64": "int64", "U64": "uint64", "F64": "float64", "F8_E8M0": "float8_e8m0fnu",
    }  # fmt: skip
    return {st: getattr(torch, t) for st, t in names.items() if hasattr(torch, t)}


@functools.cache
def _to_safetensors() -> dict[Any, str]:
    return {v: k for k, v in _to_torch().items()}


def __getattr__(name: str) -> Any:
    """``SAFETENSORS_TO_TORCH`` and its inverse ``TORCH_TO_SAFETENSORS``, built on first
    access (see :func:`_to_torch`)."""
    if name == "SAFETENSORS_TO_TORCH":
        return _to_torch()
    if name == "TORCH_TO_SAFETENSORS":
        return _to_safetensors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def data_order(specs: Sequence[tuple[str, str, Sequence[int]]]) -> list[str]:
    """Tensor names in the order :class:`SafetensorsWriter` lays out their data: largest
    item size first, then ``specs`` order (so every tensor starts aligned)."""
    ranked = sorted(range(len(specs)), key=lambda i: -SAFETENSORS_ITEMSIZE[specs[i][1]])
    return [specs[i][0] for i in ranked]


_ALIGN = 8


def _checked_specs(
    path: str, specs: Sequence[tuple[str, str, tuple[int, ...]]]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``specs`` as (name, dtype, shape) with int dims, each checked (ValueError naming
    ``path`` and the tensor otherwise)."""
    checked: list[tuple[str, str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for spec in specs:
        if not (isinstance(spec, tuple | list) and len(spec) == 3):
            raise ValueError(f"{path}: a tensor spec must be (name, dtype, shape), got {spec!r}")
        name, dtype, shape = spec
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"{path}: invalid tensor name {name!r}")
        if name in seen:
            raise ValueError(f"{path}: tensor {name!r} is listed twice")
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, tuple | list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise ValueError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
        seen.add(name)
        checked.append((name, dtype, tuple(int(d) for d in shape)))
    return checked


def _header_prefix(
    path: str,
    order: Sequence[str],
    entries: Mapping[str, tuple[str, tuple[int, ...], int, int]],
    metadata: Mapping[str, str] | None,
) -> bytes:
    """The file's first bytes: the header length, then the JSON header padded with
    spaces so that the data section starts aligned."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"{path}: safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    for name in order:
        dtype, shape, start, end = entries[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return len(raw).to_bytes(8, "little") + raw


class SafetensorsWriter:
    """Streams one safetensors file: header first, then tensors in any order.

    ``specs`` is ``[(name, dtype, shape), ...]`` with safetensors dtype strings (``F8_E4M3``,
    ``F32``, ``BF16``, ``U8``...). Every tensor must be written exactly once before
    :meth:`close`; a context manager closes on success and discards the file on error.
    """

    def __init__(
        self,
        path: str,
        specs: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        checked = _checked_specs(path, specs)
        # Largest item size first keeps every tensor aligned (see module doc).
        self.order: list[str] = data_order(checked)
        """Tensor names in data order: writing in this order never buffers a tensor."""
        by_name = {name: (dtype, shape) for name, dtype, shape in checked}
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        offset = 0
        for name in self.order:
            dtype, shape = by_name[name]
            nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
            self._entries[name] = (dtype, shape, offset, offset + nbytes)
            offset += nbytes
        self.data_bytes = offset
        """Size of the data section."""
        self._prefix = _header_prefix(path, self.order, self._entries, metadata)
        self.data_start = len(self._prefix)
        """File offset of the data section."""

        self._written: set[str] = set()
        self._pending: dict[str, bytes] = {}
        self._next = 0  # sequential mode: index into order of the next tensor to write
        self._closed = False
        self._local = not is_remote(path)
        if self._local:
            local = local_path(path)
            self._final = local
            self._partial = local + ".partial"
            self._fh: Any = open(self._partial, "wb")  # closed in close() / abort()
        else:
            self._final = self._partial = path
            self._fh = fsspec.open(path, "wb", **dict(storage_options or {})).open()
        self._fh.write(self._prefix)
        self._skip_empty()

    # -- writing ------------------------------------------------------------------------------

    def write(self, name: str, data: Any) -> None:
        """Write tensor ``name``: a contiguous torch tensor of its dtype and shape, or bytes."""
        if self._closed:
            raise ValueError(f"{self.path}: write({name!r}) after close")
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the header")
        if name in self._written:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        dtype, shape, start, end = entry
        view = self._bytes_of(name, data, dtype, shape)
        if view.nbytes != end - start:
            raise ValueError(
                f"{self.path}: tensor {name!r} needs {end - start} bytes "
                f"({dtype} {list(shape)}), got {view.nbytes}"
            )
        if self._local:
            self._fh.seek(self.data_start + start)
            self._fh.write(view)
            self._written.add(name)
            return
        self._written.add(name)
        if view.nbytes == 0:
            return  # occupies no bytes; _skip_empty steps over it
        if self.order[self._next] != name:
            self._pending[name] = bytes(view)  # early: held until its turn (see module doc)
            return
        self._fh.write(view)
        self._next += 1
        self._drain()

    def _bytes_of(self, name: str, data: Any, dtype: str, shape: tuple[int, ...]) -> memoryview:
        torch = sys.modules.get("torch")  # a tensor cannot exist without it
        if isinstance(data, np.ndarray):
            if not data.flags.c_contiguous:
                raise ValueError(f"{self.path}: tensor {name!r} is not contiguous")
            if data.size * data.itemsize != math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]:
                raise ValueError(
                    f"{self.path}: tensor {name!r} is declared {dtype} {list(shape)}, got a "
                    f"{data.dtype} array of shape {list(data.shape)}"
                )
            return data.reshape(-1).view(np.uint8).data if data.size else memoryview(b"")
        if torch is not None and isinstance(data, torch.Tensor):
            expected = _to_torch().get(dtype)
            if data.dtype != expected:
                raise ValueError(
                    f"{self.path}: tensor {name!r} is declared {dtype}, got torch {data.dtype}"
                )
            if tuple(data.shape) != shape:
                raise ValueError(
                    f"{self.path}: tensor {name!r} is declared {list(shape)}, got {list(data.shape)}"
                )
            if not data.is_contiguous():
                raise ValueError(f"{self.path}: tensor {name!r} is not contiguous")
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if t.numel() == 0:
                return memoryview(b"")
            flat: Any = t.reshape(-1).view(torch.uint8).numpy()
            return memoryview(flat).cast("B")
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError(f"{self.path}: tensor {name!r}: bytes must be contiguous")
        return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv

    def _skip_empty(self) -> None:
        # Zero-byte tensors occupy no bytes: they never block the sequential stream.
        while self._next < len(self.order):
            name = self.order[self._next]
            _, _, start, end = self._entries[name]
            if start != end:
                break
            self._next += 1

    def _drain(self) -> None:
        self._skip_empty()
        while self._next < len(self.order) and self.order[self._next] in self._pending:
            self._fh.write(self._pending.pop(self.order[self._next]))
            self._next += 1
            self._skip_empty()

    # -- closing -------------------------------------------------------------------------------

    def missing(self) -> list[str]:
        """Tensors not written yet, in header order."""
        done = self._written
        return [
            n for n in self.order if n not in done and self._entries[n][2] != self._entries[n][3]
        ]

    def close(self) -> None:
        """Finish the file; refuses (and discards it) if a tensor was never written."""
        if self._closed:
            return
        missing = self.missing()
        if missing:
            self.abort()
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"{self.path}: {len(missing)} tensor(s) never written: {shown}; file discarded"
            )
        try:
            if self._local:
                # A tensor with no bytes at the end still needs the file to reach its length.
                self._fh.truncate(self.data_start + self.data_bytes)
            self._fh.close()  # the last buffered bytes go out here: a full disk fails here
        except BaseException:
            self.abort()  # never leave a .partial behind
            raise
        self._closed = True
        if self._local:
            os.replace(self._partial, self._final)

    def abort(self) -> None:
        """Discard the file being written."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._local:
            try:
                self._fh.close()
            except OSError:  # a full disk fails the final flush too; the file goes anyway
                pass
            try:
                os.remove(self._partial)
            except FileNotFoundError:
                pass
        else:
            discard = getattr(self._fh, "discard", None)
            if callable(discard):
                discard()  # fsspec buffered files: drop without committing
            else:
                self._fh.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_safetensors(
    path: str,
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write ``tensors`` (name -> contiguous torch tensor) to ``path`` in one go."""
    to_st = _to_safetensors()
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    for name, t in tensors.items():
        dtype = to_st.get(t.dtype)
        if dtype is None:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {t.dtype} with no safetensors name"
            )
        specs.append((name, dtype, tuple(t.shape)))
    with SafetensorsWriter(path, specs, metadata, storage_options=storage_options) as w:
        for name, t in tensors.items():
            w.write(name, t.contiguous())


def tensor_from_bytes(buf: Any, dtype: str, shape: Sequence[int]) -> Any:
    """View little-endian ``buf`` as a tensor of safetensors ``dtype`` and ``shape``.

    No copy when ``buf`` is writable and aligned to the item size; a read-only buffer
    (``bytes``) or a misaligned one is copied first (torch must not alias memory it may
    not write, and misaligned wide loads are slow or faulting on some hosts).
    """
    import torch

    tdtype = _to_torch().get(dtype)
    if tdtype is None:
        raise ValueError(f"unknown safetensors dtype {dtype!r}")
    shape_t = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape_t):
        raise ValueError(f"invalid shape {list(shape_t)}")
    itemsize = SAFETENSORS_ITEMSIZE[dtype]
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("tensor_from_bytes: buffer must be contiguous")
    mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    want = math.prod(shape_t) * itemsize
    if mv.nbytes != want:
        raise ValueError(
            f"tensor_from_bytes: {dtype} {list(shape_t)} needs {want} bytes, got {mv.nbytes}"
        )
    if want == 0:
        return torch.empty(shape_t, dtype=tdtype)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    raw = torch.frombuffer(mv, dtype=torch.uint8)
    if raw.data_ptr() % itemsize:
        raw = raw.clone()
    return raw.view(tdtype).reshape(shape_t)
