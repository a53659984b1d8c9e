"""Numerics of SPEC §2: the CPU reference, the kernel repack, and device backends.

``reference`` is the bit-exact contract in plain torch; ``repack`` builds the Ascend 950
kernel layouts; ``backend.select_backend`` picks where a worker computes (torch_npu and
CUDA are imported lazily, never here). ``npu.NpuBackend`` is not re-exported so that
importing this package never touches torch_npu.
"""

from workers.numerics.backend import DEVICE_CHOICES, Backend, CudaBackend, select_backend
from workers.numerics.reference import (
    MODEL_TORCH_DTYPES,
    check_block_scales,
    mx_dequantize,
    mx_quantize,
    mx_scale_bytes,
    resolve_block,
    resolve_mx,
)
from workers.numerics.repack import (
    pack_linear,
    pack_moe,
    pack_scale,
    unpack_linear,
    unpack_moe,
    unpack_scale,
    write_rows,
)

__all__ = [
    "DEVICE_CHOICES",
    "MODEL_TORCH_DTYPES",
    "Backend",
    "CudaBackend",
    "check_block_scales",
    "mx_dequantize",
    "mx_quantize",
    "mx_scale_bytes",
    "pack_linear",
    "pack_moe",
    "pack_scale",
    "resolve_block",
    "resolve_mx",
    "select_backend",
    "unpack_linear",
    "unpack_moe",
    "unpack_scale",
    "write_rows",
]
