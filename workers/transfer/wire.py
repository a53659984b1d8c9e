"""Bytes of a refit on either side of the wire (``mxload.orchestrator.plan.refit``).

Sender: a trainer rank's local slice of each tensor as wire bytes (its own BF16 bytes, or
converted to MXFP8 by the one conversion entry point, ``Backend.mx_quantize``: rows are
converted independently, so a dim-0 slice converts to exactly the rows the whole tensor
would), and a bucket's pieces packed into one send buffer.

Receiver: the receive area, allocated once (pre-faulted) and rewritten every refit, and
:class:`AreaStorage`, the loader's storage seam over it: the loader reads the trainer's
bytes exactly as it reads a checkpoint's (same units, conversion and write stages).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...orchestrator.errors import InputError
from ...orchestrator.plan.ranges import ByteRange
from ...orchestrator.plan.refit import Piece, RefitPlan, WireFile


def range_view(flat: torch.Tensor, rng: ByteRange) -> torch.Tensor:
    """The segments of ``rng`` in the flat uint8 tensor ``flat``, as ``[count, length]``."""
    if rng.count <= 1:
        return flat[rng.start : rng.start + rng.length].view(1, rng.length)
    return flat.as_strided(
        (rng.count, rng.length), (rng.stride, 1), flat.storage_offset() + rng.start
    )


def pack(pieces: Sequence[Piece], local: Callable[[str], torch.Tensor], out: torch.Tensor) -> int:
    """Copy ``pieces`` (of the files ``local`` gives as flat uint8) one after another into
    ``out``; the bytes packed."""
    at = 0
    for p in pieces:
        n = p.nbytes
        src = range_view(local(p.file), p.src)
        out[at : at + n].view(src.shape).copy_(src)
        at += n
    return at


class LocalBytes:
    """One trainer rank's wire bytes for one step: each file's flat uint8 view, made on
    first use (an MXFP8 file converted once per tensor and step)."""

    def __init__(
        self,
        files: Mapping[str, WireFile],
        params: Mapping[str, torch.Tensor],
        backend: Any,
        rank: int,
    ) -> None:
        self.files = files
        self.params = params
        self.backend = backend
        self.rank = rank
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, file: str) -> torch.Tensor:
        got = self._cache.get(file)
        if got is not None:
            return got
        f = self.files[file]
        t = self.params.get(f.tensor)
        if t is None:
            raise InputError(
                f"trainer rank {self.rank}: the manifest places {f.tensor!r} here but "
                "send_weights was not given it",
                tensor=f.tensor,
            )
        t = t.detach()
        if f.kind == "raw":
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            self._cache[file] = flat
            return flat
        payload, scale = self.backend.mx_quantize(t.reshape(-1, t.shape[-1]))
        base = f.name if f.kind == "mx_payload" else f.name[: -len("_scale")]
        self._cache[base] = payload.contiguous().reshape(-1).view(torch.uint8).cpu()
        self._cache[base + "_scale"] = scale.contiguous().reshape(-1).view(torch.uint8).cpu()
        return self._cache[file]


class ReceiveArea:
    """One engine rank's receive area: every byte its loader reads of the trainer, laid
    out sender by sender (``RefitPlan.needed``)."""

    def __init__(self, plan: RefitPlan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        # zero_() faults every page in now, not during the first refit.
        self.tensor = torch.empty(plan.area_bytes[rank], dtype=torch.uint8).zero_()
        self.index = {(n.file, n.range): n.chunks for n in plan.needed[rank]}

    def scatter(self, pieces: Sequence[Piece], buf: torch.Tensor) -> None:
        at = 0
        for p in pieces:
            n = p.nbytes
            self.tensor[p.dst : p.dst + n].copy_(buf[at : at + n])
            at += n

    def storage(self) -> AreaStorage:
        return AreaStorage(self)


class AreaStorage:
    """The storage seam of the rank loader (``read_ranges_into``) over a receive area."""

    is_local = True
    reads_ranges_apart = False

    def __init__(self, area: ReceiveArea) -> None:
        self.area = area
        self._np = area.tensor.numpy()

    def url(self, file: str) -> str:
        return f"trainer://{file}"

    def version_tag(self, file: str) -> str:
        return ""

    def read_ranges_into(self, file: str, ranges: Sequence[ByteRange], out: Any) -> int:
        dst = np.frombuffer(out, dtype=np.uint8)
        at = 0
        for rng in ranges:
            chunks = self.area.index.get((file, rng))
            if chunks is None:
                raise InputError(
                    f"rank {self.area.rank}: {file} {rng.describe()} is not in the refit plan"
                )
            for off, src, n in chunks:
                dst[at + off : at + off + n] = self._np[src : src + n]
            at += rng.nbytes
        return at
