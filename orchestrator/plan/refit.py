"""The transfer plan of a refit: who sends which slice of which tensor to whom. Pure.

A refit is a reload whose bytes come from a trainer's ranks (docs/contract.md §4
"Refit"). The trainer's memory is described to the planner as a checkpoint of its own
(:func:`wire_checkpoint`): one "file" per tensor as it crosses the wire, BF16 as the
trainer holds it, or, with ``convert_on="sender"``, each linear the engine holds as MXFP8
already converted (E4M3 payload ``X.weight`` and E8M0 scales ``X.weight_scale``). The
existing planner then gives every engine rank its byte ranges of those files, and
:func:`refit_plan` cuts each range by the trainer ranks holding it into pieces: a
strided byte range of one sender's local bytes landing at an offset of one receiver's
receive area (laid out sender by sender). Both sides compute the same plan; its
:attr:`RefitPlan.digest` travels with every transfer.

Executed by ``mxload.orchestrator.runtime.refit`` over ``mxload.workers.transfer``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ..errors import InputError, LayoutError
from .checkpoint import CheckpointMeta, build_meta
from .config import ModelConfig, QuantConfig
from .formats import MX_GROUP
from .ranges import ByteRange
from .safetensors_header import FileHeader, TensorInfo
from .trainer import TrainerManifest, TrainerTensor
from .types import Plan

ConvertOn = Literal["receiver", "sender"]
WireKind = Literal["raw", "mx_payload", "mx_scale"]

WIRE_ROOT = "trainer://"
"""The root of a trainer source (what ``status`` names as the source of a refit)."""

WIRE_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MX_SCALE_SUFFIX = "_scale"
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class WireFile:
    """One file of the wire form: a trainer tensor's bytes as they are sent."""

    name: str
    tensor: str
    """The trainer tensor it is made from (its manifest name)."""
    kind: WireKind
    """``raw``: the trainer's own bytes; ``mx_payload`` / ``mx_scale``: its MXFP8
    conversion (docs/contract.md §2.2), row for row."""
    row_bytes: int
    """Bytes of one dim-0 row on the wire."""


@dataclass(frozen=True)
class Piece:
    """Bytes one sender sends one receiver: ``src`` of the sender's local bytes of wire
    file ``file`` (its dim-0 slice), landing contiguously at ``dst`` of the receive area."""

    file: str
    src: ByteRange
    dst: int

    @property
    def nbytes(self) -> int:
        return self.src.nbytes


@dataclass(frozen=True)
class Needed:
    """One byte range a receiver's loader reads, and where its bytes land in the area:
    ``chunks`` of (offset in the range's bytes, area offset, bytes), in order."""

    file: str
    range: ByteRange
    chunks: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Link:
    sender: int
    receiver: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class RefitPlan:
    """Every link of a refit, and each receiver's area."""

    manifest_hash: str
    convert_on: ConvertOn
    bucket_bytes: int
    senders: int
    receivers: int
    files: tuple[WireFile, ...]
    links: tuple[Link, ...]
    """One per (sender, receiver) with bytes to move, sender-major."""
    area_bytes: tuple[int, ...]
    """Per receiver, the bytes of its receive area (what it needs of the trainer)."""
    needed: tuple[tuple[Needed, ...], ...]
    """Per receiver, every range its loader reads."""
    sender_offsets: tuple[tuple[int, ...], ...]
    """Per receiver, where each sender's pieces start in the area."""
    digest: str = ""

    def links_of_sender(self, sender: int) -> list[Link]:
        return [k for k in self.links if k.sender == sender]

    def links_of_receiver(self, receiver: int) -> list[Link]:
        return [k for k in self.links if k.receiver == receiver]

    def file_info(self) -> dict[str, WireFile]:
        return {f.name: f for f in self.files}

    def wire_bytes(self) -> int:
        return sum(k.nbytes for k in self.links)


def mx_tensors(held: Plan) -> frozenset[str]:
    """The tensors the engine holds as MXFP8 (every part of an MX unit): the ones a
    sender converts when ``convert_on="sender"``."""
    return frozenset(
        p.tensor_name
        for r in held.ranks
        for u in r.units
        if u.layout in ("mx_linear", "mx_moe")
        for p in u.parts
    )


def wire_files(
    manifest: TrainerManifest, convert_on: ConvertOn, mx: Iterable[str] = ()
) -> tuple[WireFile, ...]:
    """The wire files of ``manifest``'s tensors (``mx``: those converted by the sender)."""
    mx = frozenset(mx) if convert_on == "sender" else frozenset()
    out: list[WireFile] = []
    for t in manifest.tensors:
        row = t.nbytes // t.shape[0]
        if t.name in mx:
            k = t.shape[-1]
            if len(t.shape) != 2 or k % MX_GROUP:
                raise LayoutError(
                    f"trainer tensor {t.name!r} {list(t.shape)}: the engine holds it as "
                    f"MXFP8, which needs [N, K] with K a multiple of {MX_GROUP}"
                )
            out.append(WireFile(t.name, t.name, "mx_payload", k))
            out.append(WireFile(t.name + MX_SCALE_SUFFIX, t.name, "mx_scale", k // MX_GROUP))
        else:
            out.append(WireFile(t.name, t.name, "raw", row))
    return tuple(out)


def wire_checkpoint(
    config: ModelConfig,
    manifest: TrainerManifest,
    *,
    convert_on: ConvertOn = "receiver",
    mx: Iterable[str] = (),
) -> CheckpointMeta:
    """The trainer's memory as the planner reads a checkpoint: one file per wire file,
    its bytes at offset 0 (validated as a checkpoint is)."""
    files = wire_files(manifest, convert_on, mx)
    by_name = manifest.by_name()
    headers: dict[str, FileHeader] = {}
    for f in files:
        t = by_name[f.tensor]
        if f.kind == "raw":
            dtype, shape = WIRE_DTYPES[t.dtype], t.shape
        elif f.kind == "mx_payload":
            dtype, shape = "F8_E4M3", t.shape
        else:
            dtype, shape = "U8", (t.shape[0], t.shape[-1] // MX_GROUP)
        nbytes = f.row_bytes * t.shape[0]
        info = TensorInfo(f.name, dtype, tuple(shape), f.name, 0, nbytes)
        headers[f.name] = FileHeader(f.name, nbytes, 0, 0, {f.name: info}, {})
    quant = (
        QuantConfig(kind="mxfp8")
        if convert_on == "sender" and any(f.kind != "raw" for f in files)
        else QuantConfig(kind="none")
    )
    wire_config = replace(config, quant=quant)
    root = WIRE_ROOT + manifest.digest()
    meta = build_meta(root, wire_config, {f.name: f.name for f in files}, headers)
    return replace(meta, fingerprint=trainer_fingerprint(manifest.digest()))


def trainer_fingerprint(manifest_hash: str) -> str:
    """What units written by a refit record as their checkpoint (with the step)."""
    return f"trainer-{manifest_hash}"


def _holders(t: TrainerTensor, f: WireFile, receiver: int) -> list[tuple[int, int, int]]:
    """(sender, first byte, end byte) of the file's global bytes each sender gives."""
    split = [s for s in t.placement if s.dim is not None]
    if not split:
        one = t.placement[receiver % len(t.placement)]
        return [(one.rank, 0, f.row_bytes * t.shape[0])]
    if split[0].dim != 0:
        raise LayoutError(
            f"trainer tensor {t.name!r}: split along dim {split[0].dim}; refits take dim-0 "
            "slices (FSDP2) and whole tensors"
        )
    return [(s.rank, s.start * f.row_bytes, s.stop * f.row_bytes) for s in split]


def _cut(rng: ByteRange, a: int, b: int) -> list[tuple[int, ByteRange]]:
    """The parts of ``rng`` inside global bytes ``[a, b)``: (offset in the range's own
    bytes, range of those bytes, still global)."""
    s, n, count = rng.start, rng.length, rng.count
    if not n or not count or b <= a:
        return []
    if count == 1:
        lo, hi = max(s, a), min(s + n, b)
        return [(lo - s, ByteRange(lo, hi - lo, hi - lo, 1))] if lo < hi else []
    step = rng.stride
    first = max(0, -(-(a - s - n + 1) // step))
    last = min(count - 1, (b - 1 - s) // step)
    if first > last:
        return []
    out: list[tuple[int, ByteRange]] = []

    def inside(i: int) -> bool:
        return s + i * step >= a and s + i * step + n <= b

    i0 = first if inside(first) else first + 1
    i1 = last if inside(last) else last - 1
    if not inside(first):
        lo, hi = max(s + first * step, a), min(s + first * step + n, b)
        out.append((first * n + lo - s - first * step, ByteRange(lo, hi - lo, hi - lo, 1)))
    if i0 <= i1:
        out.append((i0 * n, ByteRange(s + i0 * step, n, step, i1 - i0 + 1)))
    if last != first and not inside(last):
        lo, hi = s + last * step, min(s + last * step + n, b)
        out.append((last * n, ByteRange(lo, hi - lo, hi - lo, 1)))
    return out


def _split(rng: ByteRange, limit: int) -> list[tuple[int, ByteRange]]:
    """``rng`` in ranges of at most ``limit`` bytes: (offset in its bytes, range)."""
    if rng.nbytes <= limit:
        return [(0, rng)]
    out: list[tuple[int, ByteRange]] = []
    if rng.count == 1 or rng.length > limit:
        at = 0
        for seg_start, seg_len in rng.segments():
            for o in range(0, seg_len, limit):
                m = min(limit, seg_len - o)
                out.append((at + o, ByteRange(seg_start + o, m, m, 1)))
            at += seg_len
        return out
    per = limit // rng.length
    for i in range(0, rng.count, per):
        c = min(per, rng.count - i)
        out.append(
            (i * rng.length, ByteRange(rng.start + i * rng.stride, rng.length, rng.stride, c))
        )
    return out


def refit_plan(
    plan: Plan,
    manifest: TrainerManifest,
    *,
    convert_on: ConvertOn = "receiver",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    mx: Iterable[str] = (),
) -> RefitPlan:
    """Who sends which slice to whom. ``plan``: the engine's plan of the wire checkpoint
    (``build_plan(..., checkpoint=wire_checkpoint(...))``, its reads per rank); ``mx``:
    the tensors converted by the sender (``convert_on="sender"``, :func:`mx_tensors`)."""
    if bucket_bytes < 1:
        raise InputError(f"bucket bytes {bucket_bytes} must be positive", key="bucket_bytes")
    files = wire_files(manifest, convert_on, mx)
    info = {f.name: f for f in files}
    tensors = manifest.by_name()
    # receiver -> sender -> [(needed index, offset in range, global range)]
    receivers = len(plan.ranks)
    links: list[Link] = []
    needed_all: list[tuple[Needed, ...]] = []
    area: list[int] = []
    offsets: list[tuple[int, ...]] = []
    per_link: dict[tuple[int, int], list[Piece]] = {}
    for rp in plan.ranks:
        r = rp.rank
        ranges: list[tuple[str, ByteRange]] = []
        seen: set[tuple[str, ByteRange]] = set()
        for ur in rp.reads or ():
            for pr in ur.parts:
                for file, rng in ((pr.file, pr.weight), (pr.scale_file or pr.file, pr.scale)):
                    if rng is None or (file, rng) in seen:
                        continue
                    if file not in info:
                        raise InputError(f"rank {r} reads {file!r}, not a trainer tensor")
                    seen.add((file, rng))
                    ranges.append((file, rng))
        cuts: dict[int, list[tuple[int, int, str, ByteRange, int]]] = {}
        for n, (file, rng) in enumerate(ranges):
            f = info[file]
            for sender, a, b in _holders(tensors[f.tensor], f, r):
                for off, part in _cut(rng, a, b):
                    local = replace(part, start=part.start - a)
                    for o2, sub in _split(local, bucket_bytes):
                        cuts.setdefault(sender, []).append((n, off + o2, file, sub, 0))
        chunks: list[list[tuple[int, int, int]]] = [[] for _ in ranges]
        at = 0
        starts = []
        for sender in range(manifest.world):
            starts.append(at)
            pieces = []
            for n, off, file, sub, _ in cuts.get(sender, []):
                pieces.append(Piece(file, sub, at))
                chunks[n].append((off, at, sub.nbytes))
                at += sub.nbytes
            if pieces:
                per_link[(sender, r)] = pieces
        area.append(at)
        offsets.append(tuple(starts))
        needed = []
        for (file, rng), ch in zip(ranges, chunks, strict=True):
            ch.sort()
            if sum(c[2] for c in ch) != rng.nbytes:
                raise InputError(
                    f"rank {r}: the trainer's ranks do not hold every byte of {file!r} it "
                    "needs (the manifest's placement leaves a gap)",
                    tensor=file,
                )
            needed.append(Needed(file, rng, tuple(ch)))
        needed_all.append(tuple(needed))
    for sender in range(manifest.world):
        for r in range(receivers):
            if (sender, r) in per_link:
                links.append(Link(sender, r, tuple(per_link[(sender, r)])))
    out = RefitPlan(
        manifest_hash=manifest.digest(),
        convert_on=convert_on,
        bucket_bytes=bucket_bytes,
        senders=manifest.world,
        receivers=receivers,
        files=files,
        links=tuple(links),
        area_bytes=tuple(area),
        needed=tuple(needed_all),
        sender_offsets=tuple(offsets),
    )
    return replace(out, digest=_digest(out))


def _digest(p: RefitPlan) -> str:
    h = hashlib.sha256()
    head = [p.manifest_hash, p.convert_on, p.bucket_bytes, p.senders, p.receivers]
    h.update(json.dumps(head).encode())
    for k in p.links:
        h.update(f"{k.sender}>{k.receiver}".encode())
        for pc in k.pieces:
            s = pc.src
            h.update(f"{pc.file}:{s.start},{s.length},{s.stride},{s.count}@{pc.dst};".encode())
    return h.hexdigest()[:15]


def buckets(
    pieces: Sequence[Piece], bucket_bytes: int, skip: frozenset[str] = frozenset()
) -> list[tuple[Piece, ...]]:
    """A link's pieces, those of files in ``skip`` left out (unchanged tensors of a delta),
    in buckets of at most ``bucket_bytes`` (a piece is never larger: :func:`refit_plan`),
    in order. Both sides compute the same buckets."""
    out: list[tuple[Piece, ...]] = []
    cur: list[Piece] = []
    size = 0
    for p in pieces:
        if p.file in skip:
            continue
        if cur and size + p.nbytes > bucket_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
        cur.append(p)
        size += p.nbytes
    if cur:
        out.append(tuple(cur))
    return out


def unchanged_files(plan: RefitPlan, changed: Mapping[str, bool]) -> frozenset[str]:
    """The wire files of the trainer tensors flagged unchanged (to skip)."""
    return frozenset(f.name for f in plan.files if not changed.get(f.tensor, True))
