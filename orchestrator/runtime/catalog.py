"""Open a checkpoint: read its config, index and shard headers through the storage seam.

This is the only module of the metadata path that does I/O; everything it reads goes to
the pure parsers (``config.parse_config``, ``checkpoint.parse_index``,
``safetensors_header``) and is joined by ``checkpoint.build_meta``.

What it reads, and why no more (docs/contract.md §1.4, §4): ``config.json``; then
``model.safetensors.index.json`` if it exists, else ``model.safetensors``; then per shard
its size, the 8-byte length prefix and the header, as two ranged reads, and the store's
version tag (ETag or mtime) for the checkpoint's fingerprint (:func:`fingerprint`). Shards are found
only through the index, never by listing a directory: HTTP and object stores list badly.
Weight bytes are never read here.

Errors: a missing ``config.json``, a checkpoint with neither index nor single file, or a
shard the index names that does not exist is bad input (:class:`CheckpointError`, exit
status 2); other storage failures propagate as the seam raised them (exit status 1).
Headers of several shards are read concurrently (a DeepSeek-V3 checkpoint has 163 shards;
one round trip after another to S3 would take a while); the first failing shard in file
order is the one reported.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from ..errors import CheckpointError, ConfigError, StorageError, TruncatedFile
from ..plan.checkpoint import CheckpointMeta, build_meta, parse_index
from ..plan.config import ascend_description_quant, check_ascend_description, parse_config
from ..plan.formats import (
    ASCEND_DESCRIPTION_FILE,
    BLOCK_SCALE_SUFFIX,
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
)
from ..plan.safetensors_header import (
    PREFIX_BYTES,
    FileHeader,
    parse_header,
    parse_header_length,
)

DEFAULT_HEADER_WORKERS = 8
"""Shard headers read at once; each costs two small reads."""


class StorageLike(Protocol):
    """The part of ``mxload.workers.storage.Storage`` the catalog uses (paths relative to the root)."""

    def read_file(self, relpath: str) -> bytes: ...
    def read_range(self, relpath: str, start: int, length: int) -> bytes: ...
    def size(self, relpath: str) -> int: ...
    def exists(self, relpath: str) -> bool: ...


def open_checkpoint(
    src: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    storage: StorageLike | None = None,
    max_workers: int = DEFAULT_HEADER_WORKERS,
) -> CheckpointMeta:
    """Read and validate the metadata of the checkpoint at ``src`` (a path or fsspec URL).

    ``dtype`` is the ``--dtype`` override of the model dtype. ``storage`` replaces the
    default ``mxload.workers.storage.Storage(src, storage_options)`` (tests, shared connections).
    """
    if storage is not None:
        return _open(src, storage, dtype=dtype, max_workers=max_workers)
    # Imported here so that importing the orchestrator never pulls in fsspec.
    from ...workers.storage import Storage

    with Storage(src, storage_options) as own:
        return _open(src, own, dtype=dtype, max_workers=max_workers)


def _open(src: str, storage: StorageLike, *, dtype: str | None, max_workers: int) -> CheckpointMeta:
    config_path = _display(src, CONFIG_FILE)
    try:
        config_bytes = storage.read_file(CONFIG_FILE)
    except StorageError as exc:
        if _not_found(storage, exc, CONFIG_FILE):
            raise CheckpointError(
                f"{config_path}: no such file; is {src!r} a checkpoint directory?",
                file=config_path,
            ) from exc
        raise
    tagger = getattr(storage, "version_tag", None)
    # config.json is read again by convert: its tag is checked with the shards'.
    config_tag = tagger(CONFIG_FILE) if tagger is not None else ""
    config_obj = _load_json(config_bytes, config_path)
    described: tuple[Any, str] | None = None
    if isinstance(config_obj, dict) and "quantization_config" not in config_obj:
        # vllm-ascend's own form (convert --format ascend): the scheme per tensor lives in
        # its description file, config.json has no quantization_config.
        desc_path = _display(src, ASCEND_DESCRIPTION_FILE)
        try:
            desc = _load_json(storage.read_file(ASCEND_DESCRIPTION_FILE), desc_path)
        except StorageError as exc:
            if not _not_found(storage, exc, ASCEND_DESCRIPTION_FILE):
                raise
        else:
            qc = ascend_description_quant(desc, desc_path)
            config_obj = {**config_obj, "quantization_config": qc}
            described = (desc, desc_path)
    config = parse_config(config_obj, config_path, dtype=dtype)

    index_bytes: bytes | None = None
    if storage.exists(INDEX_FILE):
        index_bytes = storage.read_file(INDEX_FILE)
        index = parse_index(index_bytes, file=INDEX_FILE)
        weight_map: dict[str, str] | None = index
        files = sorted(set(index.values()))
    elif storage.exists(SINGLE_FILE):
        weight_map = None
        files = [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{src}: neither {INDEX_FILE} nor {SINGLE_FILE} exists; shards are found only "
            "through the index (directories are never listed)",
            file=_display(src, INDEX_FILE),
        )

    def read(f: str) -> tuple[FileHeader, str]:
        return read_header(storage, f, src=src), (tagger(f) if tagger is not None else "")

    if max_workers > 1 and len(files) > 1:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(files))) as pool:
            # map() yields in file order and re-raises the first failure in that order.
            got = dict(zip(files, pool.map(read, files), strict=True))
    else:
        got = {f: read(f) for f in files}
    headers = {f: h for f, (h, _) in got.items()}
    if described is not None:
        dtypes = {n: t.dtype for h in headers.values() for n, t in h.tensors.items()}
        check_ascend_description(described[0], dtypes, described[1])
    meta = build_meta(src, config, weight_map, headers)
    tags = {f: t for f, (_, t) in got.items()}
    fp, identity = fingerprint(src, config_bytes, index_bytes, headers, tags)
    if CONFIG_FILE not in tags:
        tags[CONFIG_FILE] = config_tag
    return replace(meta, fingerprint=fp, identity=identity, file_tags=tags)


UNVERIFIED = "unverified"
"""How ``status`` starts the identity of a checkpoint no tag vouches for."""


def fingerprint(
    src: str,
    config_bytes: bytes,
    index_bytes: bytes | None,
    headers: Mapping[str, FileHeader],
    tags: Mapping[str, str],
) -> tuple[str, str]:
    """The identity of a checkpoint as read (docs/contract.md §4 "Reload"), and how it was
    established: BLAKE2b-128 over its URL, config.json, the index, and per shard its
    name, size, the store's change tag (``Storage.version_tag``: inode, size, ctime and
    mtime of a local file; VersionId or ETag of an object) and every tensor's name,
    dtype, shape and offsets.

    A reload skips a unit only when it already holds this fingerprint at the target
    version number, so a checkpoint rewritten in place (same URL, new shards) is reloaded
    whole. Where a shard has no tag (a plain HTTP server without ETag), nothing vouches
    for its bytes: consecutive checkpoints of one model have equal headers and sizes. The
    fingerprint then takes a random part, so it never matches a unit and every reload
    rewrites every unit, and the identity says "unverified" and why (weights are not
    hashed: that would cost a full read on the driver)."""
    h = hashlib.blake2b(digest_size=16)

    def put(*items: object) -> None:
        for item in items:
            data = item if isinstance(item, bytes) else str(item).encode("utf-8", "replace")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)

    put(src.rstrip("/"), config_bytes, index_bytes if index_bytes is not None else b"")
    for f in sorted(headers):
        hdr = headers[f]
        put(f, hdr.file_size, hdr.header_len, tags.get(f, ""))
        for name, info in hdr.tensors.items():
            put(name, info.dtype, info.shape, info.start, info.nbytes)
        for key in sorted(hdr.metadata):
            put(key, hdr.metadata[key])
    bare = sorted(f for f in headers if not tags.get(f))
    if bare:
        put(secrets.token_bytes(16))  # unverifiable: never equal to any earlier read
        more = f" and {len(bare) - 1} more shard(s)" if len(bare) > 1 else ""
        identity = (
            f"{UNVERIFIED}: the store gives no ETag or VersionId for {_display(src, bare[0])}"
            f"{more}; every reload rewrites every unit, and a rewrite in place between "
            "reads cannot be seen"
        )
    elif tags and all(t.startswith("dev=") for t in tags.values()):
        identity = "local files: inode, size, ctime and mtime (ns) of every shard"
    else:
        identity = "the store's change tags (VersionId, ETag or digest) of every shard"
    return h.hexdigest(), identity


def read_header(storage: StorageLike, file: str, *, src: str = "") -> FileHeader:
    """Size, 8-byte prefix and header of one shard: one stat and two ranged reads."""
    try:
        file_size = storage.size(file)
    except StorageError as exc:
        # Tell "the index names a file that is not there" (bad input) from a store that
        # failed (a run error): only the former is the checkpoint's fault.
        if _not_found(storage, exc, file):
            raise CheckpointError(
                f"{_display(src, file)}: shard named by the checkpoint does not exist",
                file=file,
            ) from exc
        raise
    if file_size < PREFIX_BYTES:
        prefix = b""
    else:
        prefix = storage.read_range(file, 0, PREFIX_BYTES)
    header_len = parse_header_length(prefix, file=file, file_size=file_size)
    header = storage.read_range(file, PREFIX_BYTES, header_len) if header_len else b""
    if len(header) != header_len:
        # The size said the bytes were there; the store returned fewer (file replaced or
        # cut while we read it).
        raise TruncatedFile(
            f"{file}: asked for {header_len} header bytes, got {len(header)}",
            file=file,
            byte_range=(PREFIX_BYTES, PREFIX_BYTES + header_len),
        )
    return parse_header(header, file=file, file_size=file_size)


def describe(meta: CheckpointMeta) -> dict[str, Any]:
    """What the checkpoint is, for ``mxload inspect`` (JSON-able)."""
    quant = meta.config.quant
    by_dtype: Counter[str] = Counter()
    bytes_by_dtype: Counter[str] = Counter()
    for info in meta.tensors.values():
        by_dtype[info.dtype] += 1
        bytes_by_dtype[info.dtype] += info.nbytes
    files = [
        {
            "file": f,
            "bytes": meta.headers[f].file_size,
            "header_bytes": meta.headers[f].header_len,
            "tensors": len(meta.headers[f].tensors),
        }
        for f in meta.files
    ]
    cfg = meta.config
    bytes_by_kind: Counter[str] = Counter()
    for name, info in meta.tensors.items():
        bytes_by_kind[tensor_kind(name, info.dtype)] += info.nbytes
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    out: dict[str, Any] = {
        "root": meta.root,
        "architecture": cfg.architecture,
        "quantization": quant.kind,
        "dtype": cfg.model_dtype,
        "layers": cfg.num_hidden_layers,
        "moe_layers": moe_layers,
        "experts": cfg.num_experts,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "tensor_bytes_by_kind": dict(sorted(bytes_by_kind.items())),
        "files": files,
        "num_files": len(files),
        "num_tensors": len(meta.tensors),
        "tensors_by_dtype": dict(sorted(by_dtype.items())),
        "tensor_bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
        "quantized_linears": len(meta.quantized_modules()),
        "tensor_bytes": sum(bytes_by_dtype.values()),
        "total_bytes": meta.total_bytes,
    }
    if quant.kind == "block_fp8":
        out["weight_block_size"] = [quant.block_n, quant.block_k]
        # float32 (the seed's releases) or bfloat16 (third-party Qwen3.5 copies) tiles
        out["block_scale_dtypes"] = sorted(
            {
                info.dtype
                for name, info in meta.tensors.items()
                if name.endswith(f".{BLOCK_SCALE_SUFFIX}")
            }
        )
    if cfg.layer_types:
        out["linear_attention_layers"] = sum(
            cfg.is_linear_attention(i) for i in range(len(cfg.layer_types))
        )
    if cfg.not_planned():
        out["not_planned"] = list(cfg.not_planned())
    if quant.not_converted:
        out["not_converted"] = list(quant.not_converted)
    return out


TENSOR_KINDS = (
    ("scale", (".weight_scale_inv", ".weight_scale")),
    ("embedding", ("embed_tokens.weight", "lm_head.weight")),
    ("router", (".mlp.gate.weight", ".e_score_correction_bias")),
    ("norm", ("norm.weight",)),
)
"""Name suffix -> kind, for ``inspect``'s bytes per kind; the first match wins."""


def tensor_kind(name: str, dtype: str) -> str:
    """What a checkpoint tensor is, for a summary: ``fp8 weight``, ``scale``,
    ``embedding``, ``router``, ``norm`` or ``other`` (unquantized weights)."""
    for kind, suffixes in TENSOR_KINDS:
        if name.endswith(suffixes):
            return kind
    return "fp8 weight" if dtype.startswith("F8") else "other"


def _not_found(storage: StorageLike, exc: StorageError, file: str) -> bool:
    """Whether ``exc`` means ``file`` does not exist. ``mxload.workers.storage`` says so in the
    error's context; for a seam that does not, ask it."""
    flag = exc.context.get("not_found")
    if flag is not None:
        return bool(flag)
    return not storage.exists(file)


def _load_json(data: bytes, path: str) -> Any:
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 ({exc.reason})", file=path) from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise ConfigError(f"{path}: not valid JSON ({reason})", file=path) from None


def _display(src: str, relpath: str) -> str:
    """``src`` joined with a relative name, for messages."""
    return f"{src.rstrip('/')}/{relpath}" if src else relpath
