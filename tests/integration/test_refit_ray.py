"""The refit's Ray object-store transport on the shared local Ray: messages in order, and
a sender that never sends is named after the timeout."""

from __future__ import annotations

import pytest
import torch
from mxload.orchestrator.errors import RunError
from mxload.workers.transfer.transports import RayTransport

from tests.unit.test_refit_transfer import MESSAGES, _exchange

pytestmark = pytest.mark.ray


def test_ray_transport_moves_messages_in_order(local_ray) -> None:
    got = _exchange(lambda m: RayTransport(m, group="refit-test", prefault_bytes=1 << 16), MESSAGES)
    assert all(torch.equal(a, b) for a, b in zip(MESSAGES, got, strict=True))


def test_ray_transport_names_a_silent_sender(local_ray) -> None:
    rx = RayTransport(1, group="refit-test", timeout_s=1)
    with pytest.raises(RunError, match="no message from member 0"):
        rx.recv(0, torch.empty(4, dtype=torch.uint8))
    rx.close()
