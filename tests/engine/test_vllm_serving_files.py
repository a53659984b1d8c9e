"""A converted folder starts in vLLM's own config and tokenizer loading (vLLM 0.23.0, on
CPU, tests/engine/vllm_model.py's import) with no file copied by hand: ``mxload convert``
carries the tokenizer, the generation defaults and the chat template
(orchestrator/tools/convert.py ``SERVING_FILES``), so ``LLM(model=DST)`` reads what it
would read from the source."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.cli.commands import main

from tests.engine.vllm_model import Models, vllm_models

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm() -> Iterator[Models]:
    with vllm_models() as models:
        yield models


def _served(models: Models, folder: str) -> tuple[Any, Any]:
    """vLLM's ``ModelConfig`` of ``folder`` (tokenizer not skipped) and the tokenizer vLLM
    builds from it (``cached_tokenizer_from_config``, what ``LLM`` uses)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    config = models.config.model(model=folder, dtype="bfloat16", enforce_eager=True)
    return config, cached_tokenizer_from_config(config)


def test_converted_folder_loads_as_its_source(vllm: Models, tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    assert main(["make-checkpoint", src, "--preset", "qwen3.5-tiny"]) == 0
    assert main(["convert", src, dst]) == 0
    (src_cfg, src_tok), (dst_cfg, dst_tok) = _served(vllm, src), _served(vllm, dst)
    assert dst_cfg.quantization == "modelopt_mxfp8"
    text = "w1 w2 w3 <|user|>"
    assert dst_tok.encode(text) == src_tok.encode(text) and len(src_tok.encode(text)) >= 4
    chat = [{"role": "user", "content": "w4"}]
    rendered = dst_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == src_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>")
    # the generation defaults LLM applies to its sampling parameters
    assert dst_cfg.get_diff_sampling_param() == src_cfg.get_diff_sampling_param()
    assert dst_cfg.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 0.95}
