"""Numerics of docs/contract.md §2: the CPU reference, the fast kernels, the kernel repack, and device
backends.

``reference`` is the bit-exact contract in plain torch; ``kernels`` the fast numba path on
numpy arrays (torch-free) and ``fast`` its torch wrappers; ``repack`` builds the Ascend 950
kernel layouts; ``backend`` is the interface every device implements and
``select.select_backend`` picks where a worker computes (torch_npu and CUDA are imported
lazily, never here). The names below are re-exported lazily, so that
importing one torch-free submodule (``kernels``, ``scales``: what ``mxload convert``
uses) does not import torch, and nothing here touches torch_npu.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEVICE_CHOICES": "backend",
    "Backend": "backend",
    "ConvertPart": "backend",
    "PackedOut": "backend",
    "CudaBackend": "backend",
    "select_backend": "select",
    "MODEL_TORCH_DTYPE": "reference",
    "MODEL_TORCH_DTYPES": "reference",
    "check_block_scales": "reference",
    "mx_dequantize": "reference",
    "mx_quantize": "reference",
    "mx_scale_bytes": "reference",
    "resolve_block": "reference",
    "resolve_mx": "reference",
    "pack_linear": "repack",
    "pack_moe": "repack",
    "pack_scale": "repack",
    "unpack_linear": "repack",
    "unpack_moe": "repack",
    "unpack_scale": "repack",
    "write_rows": "repack",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
