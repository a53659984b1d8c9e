"""The one storage seam: everything mxload reads from a checkpoint (config.json, the
index, safetensors headers, tensor bytes) goes through :class:`Storage`.

A local path, ``file://``, ``memory://``, ``http(s)://``, ``s3://``, ``gs://`` or
``az://`` URL names the checkpoint folder; files are addressed relative to it. The
package, by concern:

* :mod:`.urls`: which locations are read, whether one is remote, which file names are
  accepted, links out of a local checkpoint (imports nothing heavy);
* :mod:`.options`: the storage options mxload reads itself (timeouts, outside links) and
  what fsspec is given;
* :mod:`.jobs`: ranges coalesced into requests, and where their bytes land;
* :mod:`.local` / :mod:`.remote`: the reads, ``preadv`` into the caller's buffer / fsspec;
* :mod:`.faults` / :mod:`.retry`: which failures are transient, and the bounded retries
  (the only place in mxload that retries);
* :mod:`.store`: :class:`Storage`, which ties them together.

Reads only: writers live in :mod:`mxload.workers.safetensors_io`. Names are resolved on
first use, so ``from mxload.workers.storage.urls import is_remote`` loads no back end.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "Storage": "mxload.workers.storage.store",
    "StorageStats": "mxload.workers.storage.stats",
    "RetryPolicy": "mxload.workers.storage.retry",
    "ShortRead": "mxload.workers.storage.faults",
    "is_retryable": "mxload.workers.storage.faults",
    "is_remote": "mxload.workers.storage.urls",
    "local_path": "mxload.workers.storage.urls",
    "ALLOW_OUTSIDE_LINKS": "mxload.workers.storage.options",
    "CONNECT_TIMEOUT": "mxload.workers.storage.options",
    "READ_TIMEOUT": "mxload.workers.storage.options",
}

__all__ = [
    "ALLOW_OUTSIDE_LINKS",
    "CONNECT_TIMEOUT",
    "READ_TIMEOUT",
    "RetryPolicy",
    "ShortRead",
    "Storage",
    "StorageStats",
    "is_remote",
    "is_retryable",
    "local_path",
]

if TYPE_CHECKING:
    from .faults import ShortRead, is_retryable
    from .options import ALLOW_OUTSIDE_LINKS, CONNECT_TIMEOUT, READ_TIMEOUT
    from .retry import RetryPolicy
    from .stats import StorageStats
    from .store import Storage
    from .urls import is_remote, local_path


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
