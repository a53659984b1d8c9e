"""A trainer's memory as a source: which trainer rank holds which slice of each tensor.

A refit reads from a trainer's ranks instead of a checkpoint's files (docs/contract.md,
"Trainer sources"). The manifest names every tensor by its checkpoint (Hugging Face) name,
with its global shape and dtype, and says for each trainer rank which contiguous slice it
holds along one dimension: FSDP2 holds dim-0 shards, Megatron's tensor parallelism dim 0
(column-parallel) or dim 1 (row-parallel) shards; a tensor no rank splits is held whole by
one or more ranks (replicas). It is pure data: validated on construction, hashed for the
refit's identity (trainer step + manifest hash), read from and written to JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .safetensors_header import MAX_TENSOR_BYTES, _bad_tensor_name

TRAINER_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Element sizes of the dtypes a trainer may hold (the BF16 twin of a model, mostly)."""

MAX_TRAINER_WORLD = 1 << 16
"""Most trainer ranks a manifest may name: the transfer plan keeps a table per sender
(and per sender and engine rank), so a world no trainer has must not reach it."""


@dataclass(frozen=True)
class TrainerSlice:
    """What one trainer rank holds of a tensor: ``[start, stop)`` along ``dim`` (``dim`` None:
    the whole tensor, ``start``/``stop`` 0)."""

    rank: int
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class TrainerTensor:
    """One tensor of the trainer's model, by its checkpoint name."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: tuple[TrainerSlice, ...]

    @property
    def itemsize(self) -> int:
        return TRAINER_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TrainerManifest:
    """The trainer's side of a refit: ``world`` ranks, ``nodes[r]`` the node of rank ``r``
    (ranks on one node share memory and a link), and every tensor's placement."""

    world: int
    tensors: tuple[TrainerTensor, ...]
    nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.world <= MAX_TRAINER_WORLD:
            raise InputError(
                f"trainer manifest: world {self.world} must be from 1 to {MAX_TRAINER_WORLD}"
            )
        if self.nodes and len(self.nodes) != self.world:
            raise InputError(
                f"trainer manifest: 'nodes' names {len(self.nodes)} ranks, world is {self.world}"
            )
        if any(n < 0 for n in self.nodes):
            rank = next(r for r, n in enumerate(self.nodes) if n < 0)
            raise InputError(f"trainer manifest: rank {rank}'s node {self.nodes[rank]} is below 0")
        seen: set[str] = set()
        # Tensors of one shape share their placement (fsdp_manifest builds it once per
        # shape): a placement checked for a shape and dtype is checked for every tensor
        # holding the same object.
        checked: set[tuple[int, tuple[int, ...], str]] = set()
        for t in self.tensors:
            if t.name in seen:
                raise InputError(f"trainer manifest: tensor {t.name!r} is listed twice")
            seen.add(t.name)
            key = (id(t.placement), t.shape, t.dtype)
            if key not in checked:
                _check_tensor(t, self.world)
                checked.add(key)

    def node_of(self, rank: int) -> int:
        return self.nodes[rank] if self.nodes else rank

    def by_name(self) -> dict[str, TrainerTensor]:
        return {t.name: t for t in self.tensors}

    def node_bytes(self) -> dict[int, int]:
        """Bytes each trainer node holds, a tensor held whole by several ranks counted
        at its first (what a checkpoint of the trainer writes from each node)."""
        # tensors of one shape share their placement: each (placement, shape, dtype) is
        # walked once and counted as often as tensors hold it
        first: dict[tuple[int, tuple[int, ...], str], TrainerTensor] = {}
        times: Counter[tuple[int, tuple[int, ...], str]] = Counter()
        for t in self.tensors:
            key = (id(t.placement), t.shape, t.dtype)
            first.setdefault(key, t)
            times[key] += 1
        out: dict[int, int] = {}
        for key, t in first.items():
            count = times[key]
            nbytes = t.nbytes
            for s in t.placement:
                node = self.node_of(s.rank)
                if s.dim is None:
                    out[node] = out.get(node, 0) + nbytes * count
                    break
                part = nbytes * (s.stop - s.start) // t.shape[s.dim]
                out[node] = out.get(node, 0) + part * count
        return out

    def digest(self) -> str:
        """The manifest's hash: a refit's identity is (trainer step, this)."""
        return hashlib.sha256(_canonical_json(self).encode()).hexdigest()[:16]


def _check_tensor(t: TrainerTensor, world: int) -> None:
    where = f"trainer manifest: tensor {t.name!r}"
    if t.dtype not in TRAINER_DTYPES:
        raise InputError(f"{where}: dtype {t.dtype!r} is not one of {sorted(TRAINER_DTYPES)}")
    if not t.shape or any(d < 1 for d in t.shape):
        raise InputError(f"{where}: shape {list(t.shape)} must have positive sizes")
    nbytes = t.itemsize
    for d in t.shape:  # checked as it grows: a shape of huge dims stops at once
        nbytes *= d
        if nbytes > MAX_TENSOR_BYTES:
            raise InputError(f"{where}: shape of more than {MAX_TENSOR_BYTES} bytes")
    if not t.placement:
        raise InputError(f"{where}: no rank holds it")
    split = [s for s in t.placement if s.dim is not None]
    ranks: set[int] = set()
    for s in t.placement:
        if s.rank in ranks:
            # its send would take one local tensor for two slices
            raise InputError(f"{where}: rank {s.rank} is placed twice (a rank holds one slice)")
        ranks.add(s.rank)
        if not 0 <= s.rank < world:
            raise InputError(f"{where}: rank {s.rank} is outside the trainer's world {world}")
        if s.dim is None:
            if s.start or s.stop:
                raise InputError(f"{where}: rank {s.rank} holds it whole but names a range")
            continue
        if not 0 <= s.dim < len(t.shape):
            raise InputError(f"{where}: rank {s.rank} splits dim {s.dim} of {list(t.shape)}")
        if not 0 <= s.start < s.stop <= t.shape[s.dim]:
            raise InputError(
                f"{where}: rank {s.rank} holds [{s.start}, {s.stop}) of dim {s.dim}, "
                f"size {t.shape[s.dim]}"
            )
    if not split:
        return
    if len(split) != len(t.placement) or len({s.dim for s in split}) != 1:
        raise InputError(f"{where}: ranks split it along different dims or mix whole and split")
    covered = sorted((s.start, s.stop, s.rank) for s in split)
    end = 0
    for start, stop, rank in covered:
        if start != end:
            what = "overlaps" if start < end else "leaves a gap before"
            raise InputError(f"{where}: rank {rank}'s slice [{start}, {stop}) {what} {end}")
        end = stop
    if end != t.shape[split[0].dim or 0]:
        raise InputError(f"{where}: the slices end at {end}, the dim's size is not covered")


def _placement_json(placement: tuple[TrainerSlice, ...]) -> list[dict[str, Any]]:
    return [
        {"rank": s.rank, "dim": s.dim, "start": s.start, "stop": s.stop}
        if s.dim is not None
        else {"rank": s.rank}
        for s in placement
    ]


def manifest_to_json(m: TrainerManifest) -> dict[str, Any]:
    return {
        "world": m.world,
        "nodes": list(m.nodes),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "placement": _placement_json(t.placement),
            }
            for t in m.tensors
        ],
    }


def _canonical_json(m: TrainerManifest) -> str:
    """``json.dumps(manifest_to_json(m), sort_keys=True, separators=(",", ":"))``, built
    tensor by tensor with each shared placement written once (a large model's manifest
    has millions of slices in a few distinct placements)."""

    def dump(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    placed: dict[int, str] = {}
    tensors = []
    for t in m.tensors:
        p = placed.get(id(t.placement))
        if p is None:
            p = placed[id(t.placement)] = dump(_placement_json(t.placement))
        tensors.append(
            f'{{"dtype":{dump(t.dtype)},"name":{dump(t.name)},"placement":{p},'
            f'"shape":{dump(list(t.shape))}}}'
        )
    return f'{{"nodes":{dump(list(m.nodes))},"tensors":[{",".join(tensors)}],"world":{m.world}}}'


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"trainer manifest: {what} must be an integer, not {value!r}")
    return value


def manifest_from_json(data: Any, *, file: str = "manifest") -> TrainerManifest:
    """Parse a manifest; every malformed field is one :class:`InputError` naming ``file``."""
    try:
        return _parse(data)
    except InputError as e:
        raise InputError(f"{file}: {e}") from None


def _parse(data: Any) -> TrainerManifest:
    if not isinstance(data, Mapping):
        raise InputError("trainer manifest: must be a JSON object")
    unknown = set(data) - {"world", "nodes", "tensors"}
    if unknown:
        raise InputError(f"trainer manifest: unknown keys {sorted(unknown)}")
    tensors = data.get("tensors")
    if not isinstance(tensors, Sequence) or isinstance(tensors, str):
        raise InputError("trainer manifest: 'tensors' must be a list")
    nodes = data.get("nodes", [])
    if not isinstance(nodes, Sequence) or isinstance(nodes, str):
        raise InputError("trainer manifest: 'nodes' must be a list")
    parsed: list[TrainerTensor] = []
    placements: dict[Any, tuple[TrainerSlice, ...]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
            raise InputError(f"trainer manifest: tensor {i} needs a string 'name'")
        name = t["name"]
        bad_name = _bad_tensor_name(name)  # the rule of a checkpoint's names (§1.3)
        if bad_name:
            raise InputError(f"trainer manifest: tensor {i} {name!r}: {bad_name}")
        extra = set(t) - {"name", "shape", "dtype", "placement"}
        if extra:
            raise InputError(f"trainer manifest: tensor {name!r}: unknown keys {sorted(extra)}")
        shape = t.get("shape")
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise InputError(f"trainer manifest: tensor {name!r}: 'shape' must be a list")
        placement = t.get("placement")
        if not isinstance(placement, Sequence) or isinstance(placement, str):
            raise InputError(f"trainer manifest: tensor {name!r}: 'placement' must be a list")
        # Equal placements parsed once into one object: the checks and the refit walk
        # do their work once per distinct placement (a large model's manifest has
        # millions of slices in a few of them). Keyed with each value's type, so a
        # placement is validated as written (True is no rank 1).
        try:
            key: Any = tuple(tuple((k, type(v), v) for k, v in p.items()) for p in placement)
            known = placements.get(key)
        except (AttributeError, TypeError):  # not objects of hashable values: checked below
            key = known = None
        if known is not None:
            parsed.append(_tensor(t, name, shape, known))
            continue
        slices: list[TrainerSlice] = []
        for p in placement:
            if not isinstance(p, Mapping) or set(p) - {"rank", "dim", "start", "stop"}:
                raise InputError(
                    f"trainer manifest: tensor {name!r}: a placement is "
                    "{rank, dim?, start?, stop?}"
                )
            dim = p.get("dim")
            slices.append(
                TrainerSlice(
                    rank=_int(p.get("rank"), f"tensor {name!r} placement rank"),
                    dim=None if dim is None else _int(dim, f"tensor {name!r} placement dim"),
                    start=_int(p.get("start", 0), f"tensor {name!r} placement start"),
                    stop=_int(p.get("stop", 0), f"tensor {name!r} placement stop"),
                )
            )
        held = tuple(slices)
        if key is not None:
            placements[key] = held
        parsed.append(_tensor(t, name, shape, held))
    return TrainerManifest(
        world=_int(data.get("world"), "'world'"),
        tensors=tuple(parsed),
        nodes=tuple(_int(n, "a node") for n in nodes),
    )


def _tensor(
    t: Mapping[str, Any], name: str, shape: Sequence[Any], held: tuple[TrainerSlice, ...]
) -> TrainerTensor:
    dtype = t.get("dtype")
    if not isinstance(dtype, str):
        raise InputError(f"trainer manifest: tensor {name!r}: 'dtype' must be a string")
    return TrainerTensor(
        name=name,
        shape=tuple(_int(d, f"tensor {name!r} shape") for d in shape),
        dtype=dtype,
        placement=held,
    )


def fsdp_manifest(
    shapes: Mapping[str, tuple[int, ...]],
    world: int,
    *,
    dtype: str = "bfloat16",
    devices_per_node: int | None = None,
) -> TrainerManifest:
    """The manifest of FSDP2's placement: every tensor's dim 0 split over ``world`` ranks in
    ``torch.chunk``'s sizes (ceil(n / world) per rank, the last ones shorter or empty); a
    tensor with fewer rows than ranks is held by the first ranks only.
    ``devices_per_node``: rank ``r`` on node ``r // devices_per_node`` (default: no
    ``nodes``, every rank its own node)."""
    by_rows: dict[int, tuple[TrainerSlice, ...]] = {}
    tensors = []
    for name, shape in shapes.items():
        rows = shape[0]
        slices = by_rows.get(rows)
        if slices is None:
            step = -(-rows // world)
            slices = by_rows[rows] = tuple(
                TrainerSlice(rank=r, dim=0, start=r * step, stop=min(rows, (r + 1) * step))
                for r in range(world)
                if r * step < rows
            )
        tensors.append(TrainerTensor(name=name, shape=tuple(shape), dtype=dtype, placement=slices))
    nodes = () if devices_per_node is None else _packed(world, devices_per_node)
    return TrainerManifest(world=world, tensors=tuple(tensors), nodes=nodes)


def _packed(world: int, devices_per_node: int) -> tuple[int, ...]:
    if devices_per_node < 1:
        raise InputError(f"trainer manifest: devices per node {devices_per_node} must be >= 1")
    return tuple(r // devices_per_node for r in range(world))


def megatron_manifest(
    shapes: Mapping[str, tuple[int, ...]],
    tp: int,
    *,
    dtype: str = "bfloat16",
    row_parallel: Sequence[str] = ("o_proj.weight", "down_proj.weight"),
    replicated: Sequence[str] = ("mlp.gate.weight", "shared_expert_gate.weight"),
    devices_per_node: int | None = None,
) -> TrainerManifest:
    """The manifest of Megatron's tensor parallelism over ``tp`` ranks, by Hugging Face
    name (as a trainer exports it): a row-parallel linear (a name ending in one of
    ``row_parallel``) split along dim 1, every other matrix (column-parallel linears,
    the vocab-parallel embedding and head) along dim 0, in equal parts; 1-D tensors
    (norms, biases) and the MoE router and shared-expert gate (a name ending in one of
    ``replicated``: Megatron does not split them over TP) held whole by every rank. A dim that ``tp`` does not divide is
    refused, naming the tensor (Megatron splits evenly)."""
    tensors = []
    for name, shape in shapes.items():
        if len(shape) == 1 or name.endswith(tuple(replicated)):
            whole = tuple(TrainerSlice(rank=r) for r in range(tp))
            tensors.append(TrainerTensor(name, tuple(shape), dtype, whole))
            continue
        dim = 1 if name.endswith(tuple(row_parallel)) else 0
        size = shape[dim]
        if size % tp:
            raise InputError(
                f"trainer manifest: tensor {name!r}: dim {dim} of {list(shape)} does not "
                f"split evenly over tp {tp}"
            )
        step = size // tp
        slices = tuple(TrainerSlice(r, dim, r * step, (r + 1) * step) for r in range(tp))
        tensors.append(TrainerTensor(name, tuple(shape), dtype, slices))
    nodes = () if devices_per_node is None else _packed(tp, devices_per_node)
    return TrainerManifest(world=tp, tensors=tuple(tensors), nodes=nodes)
