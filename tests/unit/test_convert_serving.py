"""``convert`` carries the source's serving files (orchestrator/tools/convert.py
``SERVING_FILES``) as they are, from any store, and leaves out with a warning one the
source will not give (tests/engine/test_vllm_serving_files.py: vLLM loads the result)."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import fsspec
import pytest
from mxload.orchestrator.tools.convert import convert_checkpoint
from mxload.orchestrator.tools.synth import make_checkpoint


def test_from_an_fsspec_store(tmp_path: Path) -> None:
    src = f"memory://mxload-serving-{uuid.uuid4().hex}"
    make_checkpoint(src, "qwen3-dense-tiny", shards=1)
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{src}/chat_template.jinja", b"{{ messages }}")
    dst = tmp_path / "out"
    convert_checkpoint(src, str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == fs.cat(f"{src}/{name}"), name
    assert (dst / "chat_template.jinja").read_bytes() == b"{{ messages }}"
    assert not (dst / "tokenizer.model").exists(), "only the files the source has"


def test_a_file_the_source_will_not_give_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = tmp_path / "src"
    make_checkpoint(str(src), "qwen3-dense-tiny", shards=1)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    os.replace(src / "generation_config.json", tmp_path / "kept.json")
    os.symlink(outside, src / "generation_config.json")  # a link out of the folder
    dst = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="mxload"):
        convert_checkpoint(str(src), str(dst))
    assert not (dst / "generation_config.json").exists()
    assert (dst / "tokenizer.json").exists()
    assert any("generation_config.json not carried" in r.getMessage() for r in caplog.records)
