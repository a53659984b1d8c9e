"""The refit's device transports (``nccl`` on CUDA, ``hccl`` on Ascend) move messages byte-exactly.

Skipped unless two devices of the kind are visible (each member of the pair holds its own
device, as NCCL and HCCL require). The same two processes exchange the messages of
``tests/unit/test_refit_transfer.py`` through ``make_transport``: host bytes in, host
bytes out, through the device buffers of each link.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.refit_trainer import free_port

SIZES = (72, 4096, 1, 65536, 300)


def _devices(kind: str) -> Any:
    """The device module of ``kind`` when two of its devices are visible, else None."""
    try:
        if kind == "nccl":
            mod: Any = torch.cuda
        else:
            mod = importlib.import_module("torch_npu").npu
        return mod if mod.is_available() and mod.device_count() >= 2 else None
    except Exception:
        return None


def _member(member: int, kind: str, port: int, out: str) -> None:
    from tests.unit.test_refit_transfer import pair_member

    _devices(kind).set_device(member)
    t = pair_member(kind, member, port, timeout_s=60, bucket_bytes=1 << 16)
    gen = torch.Generator().manual_seed(7)
    messages = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in SIZES]
    got = [torch.empty_like(m) for m in messages]
    for m, g in zip(messages, got, strict=True):
        t.send(1, m) if member == 0 else t.recv(0, g)
    if member == 1:
        same = all(torch.equal(a, b) for a, b in zip(messages, got, strict=True))
        with open(out, "w") as f:
            f.write("equal" if same else "different")
    t.close()


@pytest.mark.device
@pytest.mark.parametrize("kind", ["nccl", "hccl"])
def test_device_transport_moves_host_messages_byte_exact(kind: str, tmp_path) -> None:
    if _devices(kind) is None:
        pytest.skip(f"{kind} needs two visible devices of its kind")
    out = str(tmp_path / "result")
    mp.spawn(_member, args=(kind, free_port(), out), nprocs=2, join=True)
    assert os.path.exists(out) and open(out).read() == "equal"
