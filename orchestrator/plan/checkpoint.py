"""Checkpoint metadata: config + index + parsed headers -> :class:`CheckpointMeta`. Pure.

The planner works from this object alone: every tensor's file, dtype, shape and absolute
byte offset, and, per linear module, which weight and scale tensors belong together.

Validation (docs/contract.md §1.1, §1.2, §1.4), each fault with its own error class, naming the
tensor and the file:

- the index (``model.safetensors.index.json``): valid UTF-8 JSON object with a
  ``weight_map`` of tensor -> relative ``.safetensors`` file name (no absolute paths, URLs
  or ``..``: the index is input, and must not steer reads outside the checkpoint)
  -> :class:`IndexError_`; a tensor listed twice -> :class:`DuplicateTensor`;
- a tensor the index names but its file lacks -> :class:`MissingTensor`; a tensor present
  in two files -> :class:`DuplicateTensor`; a tensor in a file but not in the index ->
  :class:`IndexError_` (a reader guided by the index would never see it: the index and the
  shards disagree, and guessing which one is right is not ours to do);
- block-FP8: every ``F8_E4M3`` ``X.weight [N, K]`` has ``X.weight_scale_inv`` ``F32``
  ``[ceil(N/B_N), ceil(K/B_K)]``; MXFP8: ``X.weight_scale`` ``U8`` ``[N, K/32]`` with K a
  multiple of 32. A wrong scale -> :class:`MismatchedScale`; a weight without its scale or
  a scale without its quantized weight -> :class:`UnpairedTensor`; an ``F8_E4M3`` tensor in
  a checkpoint whose config declares no quantization -> :class:`CheckpointError`.

Limits: scale *values* (non-finite, non-positive) are not visible here; the workers check
them when they read the bytes (docs/contract.md §1.1). Which modules the config excludes from
quantization is not cross-checked against the weights' dtypes here: the checkpoint's own
dtypes say what each module is, and merged-part consistency is the planner's check (§1.4).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CheckpointError,
    DuplicateTensor,
    IndexError_,
    MismatchedScale,
    MissingTensor,
    UnpairedTensor,
)
from .config import ModelConfig, QuantKind
from .formats import (
    BLOCK_SCALE_DTYPES,
    BLOCK_SCALE_SUFFIX,
    INDEX_FILE,
    MX_GROUP,
    MX_SCALE_DTYPE,
    MX_SCALE_SUFFIX,
    QUANT_WEIGHT_DTYPE,
    SINGLE_FILE,
    ceil_div,
)
from .safetensors_header import (
    FileHeader,
    JsonObject,
    TensorInfo,
    json_object_pairs,
    reject_json_constant,
)

WEIGHT_SUFFIX = "weight"
SHARD_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class ModuleWeights:
    """The tensors of one linear module ``X``: ``X.weight`` and, when quantized, its scale."""

    module: str
    weight: TensorInfo
    scale: TensorInfo | None
    """``X.weight_scale_inv`` (block_fp8), ``X.weight_scale`` (mxfp8), None when unquantized."""
    quant: QuantKind
    """``block_fp8`` | ``mxfp8`` | ``none``: what this module's weight is in the checkpoint."""


@dataclass(frozen=True)
class CheckpointMeta:
    """Everything about a checkpoint except its weight bytes. Validated by :func:`build_meta`."""

    root: str
    """The checkpoint's location as the user gave it (path or fsspec URL)."""
    config: ModelConfig
    tensors: Mapping[str, TensorInfo]
    """Every tensor of every shard, by name (sorted by name)."""
    files: tuple[str, ...]
    """Shard file names relative to ``root``, sorted."""
    headers: Mapping[str, FileHeader]
    """Shard file name -> its parsed header."""
    fingerprint: str = ""
    """Identity of what was read (``catalog.fingerprint``): with a version number, it names
    the checkpoint a unit was loaded from (docs/contract.md §4 "Reload"). "" when unknown."""
    file_tags: Mapping[str, str] = field(default_factory=dict)
    """Per shard, and for config.json, what changes whenever its bytes do
    (``Storage.version_tag``; "" where the store gives nothing): ranks and ``convert``
    compare it after reading (``Storage.changed``), so a file rewritten while a run reads
    it fails the run instead of leaving mixed bytes under one identity."""
    identity: str = ""
    """How the fingerprint was established (``catalog.fingerprint``), as ``status`` says
    it: from what the store vouches for, or "unverified: ..." and why."""

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def tensor(self, name: str) -> TensorInfo:
        """The tensor called ``name``; :class:`MissingTensor` naming it when absent."""
        info = self.tensors.get(name)
        if info is None:
            raise MissingTensor(
                f"{self.root}: tensor {name!r} is not in the checkpoint",
                tensor=name,
                file=self.root,
            )
        return info

    def module_weights(self, module: str) -> ModuleWeights:
        """``module.weight`` and its scale (by the config's quantization kind, docs/contract.md §1.1/§1.2).

        ``quant`` is what the checkpoint holds: a module whose weight is not ``F8_E4M3``
        (an excluded module, an embedding) is ``none`` even in a quantized checkpoint.
        """
        weight = self.tensor(f"{module}.{WEIGHT_SUFFIX}")
        kind = self.config.quant.kind
        if weight.dtype != QUANT_WEIGHT_DTYPE or kind == "none":
            return ModuleWeights(module=module, weight=weight, scale=None, quant="none")
        suffix = BLOCK_SCALE_SUFFIX if kind == "block_fp8" else MX_SCALE_SUFFIX
        scale = self.tensor(f"{module}.{suffix}")
        return ModuleWeights(module=module, weight=weight, scale=scale, quant=kind)

    def quantized_modules(self) -> tuple[str, ...]:
        """Modules whose weight is ``F8_E4M3`` (each paired with its scale), sorted."""
        tail = f".{WEIGHT_SUFFIX}"
        return tuple(
            name[: -len(tail)]
            for name, info in self.tensors.items()
            if info.dtype == QUANT_WEIGHT_DTYPE and name.endswith(tail)
        )

    @property
    def total_bytes(self) -> int:
        """Sum of the shard files' sizes."""
        return sum(self.headers[f].file_size for f in self.files)


# --- the index ---------------------------------------------------------------------------


def parse_index(data: bytes, *, file: str) -> dict[str, str]:
    """``model.safetensors.index.json`` bytes -> its ``weight_map`` (tensor -> shard file)."""
    try:
        obj = json.loads(
            bytes(data).decode("utf-8"),
            object_pairs_hook=json_object_pairs,
            parse_constant=reject_json_constant,
        )
    except UnicodeDecodeError as exc:
        raise IndexError_(f"{file}: not valid UTF-8 ({exc.reason})", file=file) from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise IndexError_(f"{file}: not valid JSON ({reason})", file=file) from None
    if not isinstance(obj, dict):
        raise IndexError_(
            f"{file}: must be a JSON object with a 'weight_map', got {type(obj).__name__}",
            file=file,
        )
    if isinstance(obj, JsonObject) and obj.dups:
        raise IndexError_(f"{file}: key {obj.dups[0]!r} appears twice", file=file, key=obj.dups[0])
    if "metadata" in obj and obj["metadata"] is not None and not isinstance(obj["metadata"], dict):
        raise IndexError_(f"{file}: key 'metadata' must be an object", file=file, key="metadata")
    weight_map = obj.get("weight_map")
    if not isinstance(weight_map, dict):
        what = "is missing" if weight_map is None else f"is a {type(weight_map).__name__}"
        raise IndexError_(
            f"{file}: key 'weight_map' {what}; it must be an object of tensor name -> shard file",
            file=file,
            key="weight_map",
        )
    if isinstance(weight_map, JsonObject) and weight_map.dups:
        dup = weight_map.dups[0]
        raise DuplicateTensor(
            f"{file}: tensor {dup!r} is listed twice in 'weight_map'",
            file=file,
            tensor=dup,
            key=f"weight_map.{dup}",
        )
    if not weight_map:
        raise IndexError_(f"{file}: 'weight_map' is empty", file=file, key="weight_map")
    out: dict[str, str] = {}
    for name, shard in weight_map.items():
        problem = _bad_shard_name(shard)
        if problem is not None:
            raise IndexError_(
                f"{file}: weight_map[{name!r}] = {shard!r}: {problem}",
                file=file,
                tensor=name,
                key=f"weight_map.{name}",
            )
        out[name] = shard
    return out


def _bad_shard_name(shard: Any) -> str | None:
    """Why ``shard`` is not a safe shard name relative to the checkpoint root (None if it is)."""
    if not isinstance(shard, str) or not shard:
        return "must be a non-empty file name"
    if not shard.endswith(SHARD_SUFFIX):
        return f"shard files must end in {SHARD_SUFFIX!r}"
    # Reads go to root + "/" + shard: an absolute path, a URL or ".." would leave the
    # checkpoint (and an index is input we do not trust).
    if shard.startswith("/") or "\\" in shard or ":" in shard or "\x00" in shard:
        return "must be a plain relative file name (no absolute path, URL or backslash)"
    if any(part in ("", ".", "..") for part in shard.split("/")):
        return "must not contain '.', '..' or empty path components"
    return None


# --- assembling and validating -------------------------------------------------------------


def build_meta(
    root: str,
    config: ModelConfig,
    weight_map: Mapping[str, str] | None,
    headers: Mapping[str, FileHeader],
) -> CheckpointMeta:
    """Join the index and the shards' headers, and validate them against each other and
    against the config. ``weight_map`` None means a single ``model.safetensors``."""
    if weight_map is None:
        files: tuple[str, ...] = (SINGLE_FILE,)
        index_name = SINGLE_FILE
    else:
        files = tuple(sorted(set(weight_map.values())))
        index_name = INDEX_FILE
    for f in files:
        if f not in headers:
            raise CheckpointError(
                f"{root}: no header was read for shard {f!r} named by {index_name}", file=f
            )
    for f, header in headers.items():
        if f not in files:
            raise CheckpointError(
                f"{root}: a header was given for {f!r}, which {index_name} does not name", file=f
            )
        if header.file != f:
            raise CheckpointError(
                f"{root}: the header given for {f!r} is that of {header.file!r}", file=f
            )

    if weight_map is not None:
        for name in sorted(weight_map):
            f = weight_map[name]
            if name not in headers[f].tensors:
                raise MissingTensor(
                    f"{f}: tensor {name!r} is named by {INDEX_FILE} but absent from its file",
                    file=f,
                    tensor=name,
                )

    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in headers[f].tensors.items():
            seen = tensors.get(name)
            if seen is not None:
                raise DuplicateTensor(
                    f"tensor {name!r} is present in both {seen.file!r} and {f!r}",
                    file=f,
                    tensor=name,
                    other_file=seen.file,
                )
            tensors[name] = info
    if weight_map is not None:
        # After the two checks above, a tensor listed in the index sits in exactly the
        # file the index names; anything else in a shard is unknown to the index.
        for name, info in tensors.items():
            if name not in weight_map:
                raise IndexError_(
                    f"{info.file}: tensor {name!r} is in this shard but {INDEX_FILE} does "
                    "not list it; the index and the shards disagree",
                    file=info.file,
                    tensor=name,
                )
    tensors = dict(sorted(tensors.items()))
    _check_pairs(tensors, config)
    return CheckpointMeta(
        root=root, config=config, tensors=tensors, files=files, headers=dict(headers)
    )


def _check_pairs(tensors: Mapping[str, TensorInfo], config: ModelConfig) -> None:
    """docs/contract.md §1.1/§1.2 tensor validation: weights and scales pair up with the right shapes."""
    kind = config.quant.kind
    weight_tail = f".{WEIGHT_SUFFIX}"
    if kind == "none":
        for name, info in tensors.items():
            if info.dtype == QUANT_WEIGHT_DTYPE:
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} is {QUANT_WEIGHT_DTYPE}, but "
                    f"{config.source} declares no quantization_config",
                    file=info.file,
                    tensor=name,
                    key="quantization_config",
                )
        return
    scale_tail = f".{BLOCK_SCALE_SUFFIX}" if kind == "block_fp8" else f".{MX_SCALE_SUFFIX}"

    for name, info in tensors.items():
        if name.endswith(scale_tail):
            weight_name = name[: -len(scale_tail)] + weight_tail
            weight = tensors.get(weight_name)
            if weight is None or weight.dtype != QUANT_WEIGHT_DTYPE:
                what = "absent" if weight is None else f"{weight.dtype}, not {QUANT_WEIGHT_DTYPE}"
                raise UnpairedTensor(
                    f"{info.file}: scale {name!r} has no quantized weight ({weight_name!r} is "
                    f"{what}): mismatched or unpaired scale",
                    file=info.file,
                    tensor=name,
                )
        elif info.dtype == QUANT_WEIGHT_DTYPE:
            if not name.endswith(weight_tail):
                raise UnpairedTensor(
                    f"{info.file}: tensor {name!r} is {QUANT_WEIGHT_DTYPE} but is not a "
                    f"'<module>.weight', so no scale can belong to it",
                    file=info.file,
                    tensor=name,
                )
            scale_name = name[: -len(weight_tail)] + scale_tail
            scale = tensors.get(scale_name)
            if scale is None:
                raise UnpairedTensor(
                    f"{info.file}: quantized weight {name!r} has no scale {scale_name!r}: "
                    "mismatched or unpaired scale",
                    file=info.file,
                    tensor=name,
                )
            if kind == "block_fp8":
                _check_block_scale(info, scale, config)
            else:
                _check_mx_scale(info, scale)


def _weight_nk(weight: TensorInfo, scale: TensorInfo) -> tuple[int, int]:
    if len(weight.shape) != 2:
        raise MismatchedScale(
            f"{weight.file}: quantized weight {weight.name!r} has shape {list(weight.shape)}; "
            f"a quantized linear weight is 2-D [N, K] (scale {scale.name!r})",
            file=weight.file,
            tensor=weight.name,
        )
    return weight.shape[0], weight.shape[1]


def _check_block_scale(weight: TensorInfo, scale: TensorInfo, config: ModelConfig) -> None:
    n, k = _weight_nk(weight, scale)
    b_n, b_k = config.quant.block_n, config.quant.block_k
    want = (ceil_div(n, b_n), ceil_div(k, b_k))
    if scale.dtype not in BLOCK_SCALE_DTYPES or scale.shape != want:
        raise MismatchedScale(
            f"{scale.file}: mismatched or unpaired scale {scale.name!r}: {scale.dtype} "
            f"{list(scale.shape)}, but weight {weight.name!r} [{n}, {k}] with "
            f"weight_block_size [{b_n}, {b_k}] needs {' or '.join(BLOCK_SCALE_DTYPES)} "
            f"{list(want)}",
            file=scale.file,
            tensor=scale.name,
        )


def _check_mx_scale(weight: TensorInfo, scale: TensorInfo) -> None:
    n, k = _weight_nk(weight, scale)
    if k % MX_GROUP != 0:
        raise MismatchedScale(
            f"{weight.file}: MXFP8 weight {weight.name!r} [{n}, {k}] has K not a multiple of "
            f"{MX_GROUP}, so it cannot carry an MX scale ({scale.name!r}); such a linear is "
            "stored unquantized (docs/contract.md §1.2)",
            file=weight.file,
            tensor=weight.name,
        )
    want = (n, k // MX_GROUP)
    if scale.dtype != MX_SCALE_DTYPE or scale.shape != want:
        raise MismatchedScale(
            f"{scale.file}: mismatched or unpaired scale {scale.name!r}: {scale.dtype} "
            f"{list(scale.shape)}, but weight {weight.name!r} [{n}, {k}] needs "
            f"{MX_SCALE_DTYPE} {list(want)}",
            file=scale.file,
            tensor=scale.name,
        )
