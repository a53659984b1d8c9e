"""vLLM's own functions, taken unmodified out of its files and run on CPU, for
tests/engine/test_vllm_ascend.py (the Qwen3.5 and DeepSeek-V3 tests build vLLM's whole
models instead: tests/engine/vllm_model.py).

Nothing of vLLM is copied into the repository: ``_node`` and ``_parsed`` find a
definition in a downloaded file (tests/engine/sources.py), compiled into a namespace from
``_namespace``, whose stand-ins are the ones named in ``_STUBS``.
"""

from __future__ import annotations

import ast
import functools
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def _node(tree: ast.Module, path: tuple[str, ...]) -> ast.AST:
    """The definition at ``path``; the last one of a name (``@overload`` stubs come first)."""
    body: list[ast.stmt] = tree.body
    found: ast.AST | None = None
    for name in path:
        found = [
            n
            for n in body
            if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)
            and n.name == name
        ][-1]
        body = getattr(found, "body", [])
    assert found is not None
    return found


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text()
    return text, ast.parse(text)


class _Stub:
    """A named stand-in for a vLLM class only used in ``isinstance`` checks that must be
    false here (no quantized, GGUF, packed or uninitialized parameter is built)."""


_STUBS = {
    "BlockQuantScaleParameter": "linear.py: block-FP8 scale parameter (none here: BF16 load)",
    "BasevLLMParameter": "parameter.py: v2 parameters (the unquantized method uses plain ones)",
    "UninitializedParameter": "torch lazy parameter (GGUF only)",
    "adjust_*": "linear.py quantization helpers, reached only for packed/quantized params",
    "get_tensor_model_parallel_rank": "vllm.distributed: the rank under test",
    "is_pp_missing_parameter": "models/utils.py: the name is not a parameter of this stage",
    "envs": "vllm.envs: VLLM_PP_LAYER_PARTITION unset",
    "maybe_remap_kv_scale_name": "weight_utils.py: no kv-cache scales in the checkpoint",
    "logger": "vllm.logger: Python logging",
    "quant_method": "FusedMoE.quant_method: an object named UnquantizedFusedMoEMethod",
    "expert_map_manager": "its map_global_to_local (vLLM's) over determine_expert_map's map",
}


def _namespace(tp_rank: int) -> dict[str, Any]:
    def unreachable(*_: Any, **__: Any) -> Any:
        raise AssertionError("a quantization-only vLLM helper was reached")

    ns: dict[str, Any] = {
        "torch": torch,
        "Parameter": torch.nn.Parameter,
        "BlockQuantScaleParameter": type("BlockQuantScaleParameter", (_Stub,), {}),
        "BasevLLMParameter": type("BasevLLMParameter", (_Stub,), {}),
        "UninitializedParameter": type("UninitializedParameter", (_Stub,), {}),
        "adjust_block_scale_shard": unreachable,
        "adjust_marlin_shard": unreachable,
        "adjust_bitsandbytes_4bit_shard": unreachable,
        "adjust_scalar_to_fused_array": unreachable,
        "get_tensor_model_parallel_rank": lambda: tp_rank,
        "is_pp_missing_parameter": lambda name, model: name not in model.params,
        "envs": types.SimpleNamespace(VLLM_PP_LAYER_PARTITION=None),
        "maybe_remap_kv_scale_name": lambda name, params: name,
        "logger": _Logger(),
        "dataclass": dataclass,
        "typing": __import__("typing"),
        "Callable": Callable,
        "LoaderFunction": Callable,
        "itertools": __import__("itertools"),
    }
    return ns


class _Logger:
    def warning(self, msg: str, *a: Any) -> None:
        logging.getLogger("vllm").warning(msg, *a)

    warning_once = warning
    info = warning
