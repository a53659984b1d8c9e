"""mxload.orchestrator.runtime.catalog: what it reads (and does not), errors, describe()."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.errors import (
    CheckpointError,
    ConfigError,
    DuplicateTensor,
    HeaderTooLarge,
    IndexError_,
    MissingTensor,
    StorageError,
    TruncatedFile,
    UnsupportedError,
)
from mxload.orchestrator.runtime.catalog import describe, open_checkpoint

from tests.hostile import build_safetensors, raw_file

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
Q = "model.layers.0.self_attn.q_proj"
D = "model.layers.0.mlp.down_proj"

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 200,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 100,
    "intermediate_size": 300,
    "vocab_size": 64,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}

PART1 = {
    "model.embed_tokens.weight": ("BF16", [64, 200]),  # 25600 bytes
    f"{Q}.weight": ("F8_E4M3", [256, 200]),  # 51200 bytes
    f"{Q}.weight_scale_inv": ("F32", [2, 2]),  # 16 bytes
}
PART2 = {
    f"{D}.weight": ("F8_E4M3", [200, 300]),  # 60000 bytes
    f"{D}.weight_scale_inv": ("F32", [2, 3]),  # 24 bytes
    "model.norm.weight": ("BF16", [200]),  # 400 bytes
}


class FakeStorage:
    """An in-memory storage seam that records every call; it has no way to list."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = dict(files)
        self.calls: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    def _log(self, *call: Any) -> None:
        with self._lock:
            self.calls.append(call)

    def _get(self, relpath: str) -> bytes:
        if relpath not in self.files:
            raise StorageError(f"memory://ckpt/{relpath}: not found", file=relpath, not_found=True)
        return self.files[relpath]

    def read_file(self, relpath: str) -> bytes:
        self._log("read_file", relpath)
        return self._get(relpath)

    def read_range(self, relpath: str, start: int, length: int) -> bytes:
        self._log("read_range", relpath, start, length)
        return self._get(relpath)[start : start + length]

    def size(self, relpath: str) -> int:
        self._log("size", relpath)
        return len(self._get(relpath))

    def exists(self, relpath: str) -> bool:
        self._log("exists", relpath)
        return relpath in self.files


def sharded_files(config: Mapping[str, Any] = CONFIG) -> dict[str, bytes]:
    weight_map = {n: SHARD1 for n in PART1} | {n: SHARD2 for n in PART2}
    return {
        "config.json": json.dumps(config).encode(),
        INDEX: json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode(),
        SHARD1: build_safetensors(PART1),
        SHARD2: build_safetensors(PART2, metadata={"format": "pt"}),
    }


def write(root: Path, files: Mapping[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


# --- what is read ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_workers", [1, 8])
def test_sharded_reads_only_config_index_and_two_ranges_per_shard(max_workers: int) -> None:
    files = sharded_files()
    storage = FakeStorage(files)
    meta = open_checkpoint("memory://ckpt", storage=storage, max_workers=max_workers)
    assert meta.files == (SHARD1, SHARD2)
    assert set(meta.tensors) == set(PART1) | set(PART2)

    whole = [c[1] for c in storage.calls if c[0] == "read_file"]
    assert sorted(whole) == sorted(["config.json", INDEX])  # never a shard
    for shard in (SHARD1, SHARD2):
        n = int.from_bytes(files[shard][:8], "little")
        ranges = sorted(c[2:] for c in storage.calls if c[0] == "read_range" and c[1] == shard)
        assert ranges == [(0, 8), (8, n)]
    # Weight bytes never read: all ranged reads end at the header.
    read = sum(c[3] for c in storage.calls if c[0] == "read_range")
    assert read < sum(len(files[s]) for s in (SHARD1, SHARD2)) // 10


def test_tensor_offsets_point_at_the_tensor_bytes() -> None:
    files = sharded_files()
    meta = open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    # build_safetensors fills data with i % 251 from the data section's start; the
    # second tensor of SHARD1 (q_proj.weight) starts 25600 bytes in.
    q = meta.tensor(f"{Q}.weight")
    blob = files[SHARD1]
    assert blob[q.start : q.start + 4] == bytes((25600 + i) % 251 for i in range(4))
    assert q.nbytes == 256 * 200


def test_single_file_checkpoint() -> None:
    files = {
        "config.json": json.dumps(CONFIG).encode(),
        "model.safetensors": build_safetensors({**PART1, **PART2}),
    }
    storage = FakeStorage(files)
    meta = open_checkpoint("memory://ckpt", storage=storage)
    assert meta.files == ("model.safetensors",)
    assert meta.module_weights(D).quant == "block_fp8"
    assert ("read_file", INDEX) not in storage.calls


def test_dtype_override_reaches_the_config() -> None:
    meta = open_checkpoint("memory://ckpt", storage=FakeStorage(sharded_files()), dtype="fp16")
    assert meta.config.model_dtype == "fp16"


# --- errors --------------------------------------------------------------------------------------


def test_missing_config_is_bad_input() -> None:
    files = sharded_files()
    del files["config.json"]
    with pytest.raises(CheckpointError) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    assert "config.json" in str(info.value)
    assert info.value.exit_code == 2


def test_config_not_json() -> None:
    files = sharded_files()
    files["config.json"] = b"{not json"
    with pytest.raises(ConfigError) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    assert info.value.file == "memory://ckpt/config.json"


def test_config_errors_name_the_full_config_path() -> None:
    cfg = json.loads(json.dumps(CONFIG))
    cfg["quantization_config"]["activation_scheme"] = "static"
    with pytest.raises(UnsupportedError) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(sharded_files(cfg)))
    assert "memory://ckpt/config.json" in str(info.value)


def test_neither_index_nor_single_file() -> None:
    files = {"config.json": json.dumps(CONFIG).encode(), SHARD1: build_safetensors(PART1)}
    with pytest.raises(CheckpointError) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    assert INDEX in str(info.value) and "model.safetensors" in str(info.value)


def test_shard_named_by_index_is_missing() -> None:
    files = sharded_files()
    del files[SHARD2]
    with pytest.raises(CheckpointError) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    assert type(info.value) is CheckpointError
    assert info.value.file == SHARD2


def test_other_storage_failures_propagate() -> None:
    class Flaky(FakeStorage):
        def size(self, relpath: str) -> int:
            raise StorageError(f"{relpath}: 503 after 5 attempts", file=relpath, not_found=False)

    with pytest.raises(StorageError) as info:
        open_checkpoint("memory://ckpt", storage=Flaky(sharded_files()))
    assert info.value.exit_code == 1


def test_hostile_shard_header_is_refused_naming_the_shard() -> None:
    files = sharded_files()
    files[SHARD2] = raw_file({}, b"", declared_len=10**12)
    with pytest.raises(HeaderTooLarge) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    assert info.value.file == SHARD2


def test_truncated_shard() -> None:
    files = sharded_files()
    files[SHARD1] = files[SHARD1][:-100]
    with pytest.raises(TruncatedFile) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files), max_workers=4)
    assert info.value.file == SHARD1 and info.value.tensor == f"{Q}.weight"


def test_tiny_shard_is_truncated_without_reading() -> None:
    files = sharded_files()
    files[SHARD1] = b"\x01\x02"
    storage = FakeStorage(files)
    with pytest.raises(TruncatedFile):
        open_checkpoint("memory://ckpt", storage=storage, max_workers=1)


def test_short_read_is_truncated() -> None:
    class Short(FakeStorage):
        def read_range(self, relpath: str, start: int, length: int) -> bytes:
            return super().read_range(relpath, start, length)[: max(length - 3, 8)]

    with pytest.raises(TruncatedFile):
        open_checkpoint("memory://ckpt", storage=Short(sharded_files()), max_workers=1)


def test_index_errors_surface() -> None:
    files = sharded_files()
    files[INDEX] = b'{"metadata": {}}'
    with pytest.raises(IndexError_):
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))

    files = sharded_files()
    wm = json.loads(files[INDEX])["weight_map"]
    wm["model.layers.0.self_attn.o_proj.weight"] = SHARD1
    files[INDEX] = json.dumps({"weight_map": wm}).encode()
    with pytest.raises(MissingTensor) as info:
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    assert info.value.tensor == "model.layers.0.self_attn.o_proj.weight"

    files = sharded_files()
    files[SHARD1] = build_safetensors({**PART1, "model.norm.weight": ("BF16", [200])})
    with pytest.raises(DuplicateTensor):
        open_checkpoint("memory://ckpt", storage=FakeStorage(files))


def test_first_failing_shard_in_file_order_is_reported() -> None:
    files = sharded_files()
    files[SHARD1] = files[SHARD1][:-1]
    files[SHARD2] = files[SHARD2][:-1]
    for workers in (1, 8):
        with pytest.raises(TruncatedFile) as info:
            open_checkpoint("memory://ckpt", storage=FakeStorage(files), max_workers=workers)
        assert info.value.file == SHARD1


# --- describe ------------------------------------------------------------------------------------


def test_describe() -> None:
    files = sharded_files()
    meta = open_checkpoint("memory://ckpt", storage=FakeStorage(files))
    d = describe(meta)
    json.dumps(d)  # JSON-able
    assert d["architecture"] == "Qwen3ForCausalLM"
    assert d["quantization"] == "block_fp8"
    assert d["weight_block_size"] == [128, 128]
    assert d["dtype"] == "bf16"
    assert d["num_tensors"] == 6
    assert d["quantized_linears"] == 2
    assert d["tensors_by_dtype"] == {"BF16": 2, "F32": 2, "F8_E4M3": 2}
    assert d["tensor_bytes_by_dtype"] == {
        "BF16": 25600 + 400,
        "F32": 16 + 24,
        "F8_E4M3": 51200 + 60000,
    }
    assert d["tensor_bytes"] == 25600 + 400 + 16 + 24 + 51200 + 60000
    assert d["total_bytes"] == len(files[SHARD1]) + len(files[SHARD2])
    assert [(f["file"], f["bytes"], f["tensors"]) for f in d["files"]] == [
        (SHARD1, len(files[SHARD1]), 3),
        (SHARD2, len(files[SHARD2]), 3),
    ]


# --- through the real storage seam ---------------------------------------------------------------


def _real_storage_available() -> bool:
    try:
        import mxload.workers.storage  # noqa: F401
    except ImportError:
        return False
    return True


needs_storage = pytest.mark.skipif(
    not _real_storage_available(), reason="mxload.workers.storage absent"
)


@needs_storage
def test_local_directory_through_real_storage(tmp_path: Path) -> None:
    files = sharded_files()
    root = write(tmp_path, files)
    meta = open_checkpoint(str(root))
    assert meta.files == (SHARD1, SHARD2)
    assert meta.headers[SHARD2].metadata == {"format": "pt"}
    assert describe(meta)["total_bytes"] == len(files[SHARD1]) + len(files[SHARD2])


@needs_storage
def test_missing_shard_through_real_storage(tmp_path: Path) -> None:
    files = sharded_files()
    del files[SHARD2]
    root = write(tmp_path, files)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(root))
    assert type(info.value) is CheckpointError and info.value.file == SHARD2


@needs_storage
def test_missing_config_through_real_storage(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(tmp_path))
    assert "config.json" in str(info.value)


@needs_storage
def test_memory_url_through_real_storage() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "memory://mxload-test-catalog"
    try:
        for name, data in sharded_files().items():
            fs.pipe(f"{root}/{name}", data)
        meta = open_checkpoint(root)
        assert meta.module_weights(Q).scale is not None
    finally:
        fs.rm(root, recursive=True)


@needs_storage
def test_files_written_by_safetensors_library(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    shard1: dict[str, Any] = {
        "model.embed_tokens.weight": torch.randn(64, 200, generator=gen).to(torch.bfloat16),
        f"{Q}.weight": torch.randn(256, 200, generator=gen).to(torch.float8_e4m3fn),
        f"{Q}.weight_scale_inv": torch.rand(2, 2, generator=gen),
    }
    shard2: dict[str, Any] = {
        f"{D}.weight": torch.randn(200, 300, generator=gen).to(torch.float8_e4m3fn),
        f"{D}.weight_scale_inv": torch.rand(2, 3, generator=gen),
        "model.norm.weight": torch.ones(200, dtype=torch.bfloat16),
    }
    save_file(shard1, str(tmp_path / SHARD1), metadata={"format": "pt"})
    save_file(shard2, str(tmp_path / SHARD2), metadata={"format": "pt"})
    weight_map = {n: SHARD1 for n in shard1} | {n: SHARD2 for n in shard2}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    meta = open_checkpoint(str(tmp_path))
    for name, tensor in {**shard1, **shard2}.items():
        info = meta.tensor(name)
        blob = (tmp_path / info.file).read_bytes()
        want = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert blob[info.start : info.end] == want, name
