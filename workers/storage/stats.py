"""Request counters of one :class:`~mxload.workers.storage.Storage`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class StorageStats:
    """Counters of one Storage; safe to update from several threads.

    ``requests`` counts every request sent (retries included), ``retries`` the tries that
    failed transiently and were repeated, ``bytes_fetched`` the bytes that arrived in
    successful requests (over-read included: compare with the bytes needed for the read
    amplification of docs/contract.md §6).
    """

    bytes_fetched: int = 0
    requests: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, bytes_fetched: int = 0, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.bytes_fetched += bytes_fetched
            self.requests += requests
            self.retries += retries
