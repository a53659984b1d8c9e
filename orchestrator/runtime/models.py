"""The public models mxload plans for, shipped as package data: ``mxload plan --model NAME``.

Why: capacity planning needs only ``config.json``, and a user asking "does DeepSeek-V3 fit
on 256 devices of 64 GiB" should not have to fetch one first. The files in
``orchestrator/configs/`` are the models' published ``config.json`` (the keys the planner
reads, quantization included), one file per model, named by the lowercase model name.

Limits: this is a short list, not a model hub; any other model plans with
``--config FILE``. Reading a packaged file is I/O, so this module is not in the pure core.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError

MODELS: dict[str, str] = {
    "qwen3-30b-a3b-fp8": "Qwen/Qwen3-30B-A3B-FP8",
    "qwen3-32b-fp8": "Qwen/Qwen3-32B-FP8",
    "qwen3-235b-a22b-fp8": "Qwen/Qwen3-235B-A22B-FP8",
    "qwen3.8-27b-fp8": "Qwen/Qwen3.8-27B-FP8",
    "qwen3.5-397b-a17b-fp8": "Qwen/Qwen3.5-397B-A17B-FP8",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
}
"""Packaged name -> the model's published id. Either spelling is accepted (any case), and
a Qwen3 name without its ``-fp8`` suffix."""


def model_names() -> list[str]:
    return list(MODELS)


def resolve_model(name: str) -> str:
    """The packaged name for what a user typed; UsageError listing the names otherwise."""
    want = name.strip().lower()
    for stem, hub_id in MODELS.items():
        if want in (stem, hub_id.lower(), hub_id.lower().split("/")[-1]) or want + "-fp8" == stem:
            return stem
    raise UsageError(
        f"--model: unknown model {name!r}; packaged: {', '.join(MODELS)} "
        "(for any other model, --config FILE)",
        key="--model",
    )


def model_config_path(name: str) -> Path:
    """The packaged config.json of a model (a real file: the package is never zipped)."""
    stem = resolve_model(name)
    return Path(str(resources.files("mxload.orchestrator") / "configs" / f"{stem}.json"))


def model_config(name: str) -> dict[str, Any]:
    """The decoded config.json of a packaged model."""
    raw: dict[str, Any] = json.loads(model_config_path(name).read_text())
    return raw
