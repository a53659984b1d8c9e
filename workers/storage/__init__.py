"""The one storage seam: read byte ranges of the files under a checkpoint URL.

SPEC §4 "Streaming" and "Faults". Everything mxload reads from a checkpoint (config.json,
the index, safetensors headers, tensor bytes) goes through :class:`Storage`, so there is
exactly one place that knows about URLs, fsspec, ranged requests, coalescing and retries:

* **URLs**: a local path, ``file://``, ``memory://``, ``http(s)://``, ``s3://`` or any
  other fsspec URL names the checkpoint *directory*; files are addressed relative to it.
  ``storage_options`` (the CLI's ``--storage-options JSON``) go to fsspec unchanged
  (``endpoint_url``, ``key``/``secret``, ``client_kwargs``...). Directories are never
  listed (SPEC §1.4: HTTP and object stores list badly); relative paths that climb out of
  the root (``..``, absolute paths) are refused, since they come from a checkpoint's index
  and a checkpoint is hostile input (SPEC §1.3).
* **Ranged reads** (:meth:`Storage.read_ranges_into`): the compact, possibly strided
  :class:`~orchestrator.ranges.ByteRange` s of a plan are coalesced into requests under a
  :class:`~orchestrator.ranges.CoalescePolicy` (exact for local files, gap-bridging with a
  bounded over-read for remote stores) and the bytes land directly in the caller's buffer:
  local files are ``preadv``-ed straight into it when a request maps onto one contiguous
  stretch of the output, remote requests run concurrently on a small thread pool and are
  scattered into it.
* **Retries** (SPEC §4 "Faults"; STYLE "tenacity — retries you can test"): this module is
  the only place in mxload that retries. Attempts are bounded, backoff is exponential and
  capped with a deterministic jitter (a pure function of the request and the attempt, so
  256 ranks that hit the same 503 do not come back in lockstep, and tests are
  reproducible), ``sleep`` is injectable so tests never wait, and only transient failures
  are retried (5xx, 429, S3 SlowDown, cut connections, timeouts, short reads). A missing
  file, a 403 or another 4xx fails at once. Whatever fails for good becomes one
  :class:`~orchestrator.errors.StorageError` naming the URL, the byte range, the attempts
  made and the last cause. fsspec back ends that retry on their own (s3fs, botocore) are
  configured for a single attempt unless the caller's storage options say otherwise, so
  attempts are counted here and nowhere else.

* **A checkpoint is a folder** (local roots): every file read must resolve (``realpath``,
  symlinks followed) inside the checkpoint root's real path, else
  :class:`~orchestrator.errors.CheckpointError` naming the file, before a byte of it is
  read; the storage option ``mxload_allow_outside_links`` (CLI ``--allow-outside-links``)
  lifts this for checkpoints assembled from links into a shared store.
* **Timeouts** (remote back ends): every HTTP(S) and S3 request has a connect timeout
  (default :data:`DEFAULT_CONNECT_TIMEOUT_S`) and a read timeout, the longest wait for
  the next bytes of an answer (default :data:`DEFAULT_READ_TIMEOUT_S`); both at most
  :data:`MAX_TIMEOUT_S`. A timeout is transient, so a server that accepts and never
  answers costs at most ``attempts x (connect + read timeout) + backoff`` (5 x 40 s + under
  1 s by default) and then fails naming the URL; on a terminal each timed-out attempt is
  reported on stderr as it happens. Set them with the storage options
  ``mxload_connect_timeout_s`` / ``mxload_read_timeout_s`` (CLI ``--connect-timeout`` /
  ``--read-timeout``); a ``client_kwargs.timeout`` (HTTP) or ``config_kwargs`` timeout
  (S3) of the caller's own wins.
* **Protocols**: local paths, ``file://``, ``memory://``, ``http(s)://``, ``s3://``,
  ``gs://`` and ``az://``/``abfs://`` (:data:`PROTOCOLS`); anything else (``ftp://``...) is
  refused as bad input before any connection is tried.

Storage options that mxload reads itself (:data:`MXLOAD_OPTIONS`, never passed to fsspec)
travel with the other storage options to every worker, so a setting given once holds for
the catalog, the planner and every rank.

Limits: reads only (writers live in :mod:`mxload.workers.safetensors_io`); the output buffer must
be CPU memory exposing the buffer protocol (or a contiguous CPU torch tensor); remote
back ends copy once, from the response body into the buffer, because fsspec's ``cat``
returns ``bytes``.
"""

from __future__ import annotations

import bisect
import errno
import os
import posixpath
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from mxload.orchestrator.errors import CheckpointError, StorageError, UsageError
from mxload.orchestrator.plan.ranges import (
    LOCAL_POLICY,
    REMOTE_POLICY,
    ByteRange,
    CoalescePolicy,
    coalesce,
    contiguous,
)
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

# --- settings mxload reads from the storage options -----------------------------------------

CONNECT_TIMEOUT = "mxload_connect_timeout_s"
READ_TIMEOUT = "mxload_read_timeout_s"
ALLOW_OUTSIDE_LINKS = "mxload_allow_outside_links"
MXLOAD_OPTIONS = (CONNECT_TIMEOUT, READ_TIMEOUT, ALLOW_OUTSIDE_LINKS)
"""Storage-option keys mxload reads itself and removes before calling fsspec."""

DEFAULT_CONNECT_TIMEOUT_S = 10.0
"""Seconds to wait for a remote connection (TCP and TLS) before the attempt fails."""
DEFAULT_READ_TIMEOUT_S = 30.0
"""Seconds to wait for the next bytes of a remote answer before the attempt fails."""
MAX_TIMEOUT_S = 60.0
"""Upper bound of either timeout: a bigger one would let one silent server stall a run."""

PROTOCOLS = frozenset(
    {
        "",
        "file",
        "local",
        "memory",
        "http",
        "https",
        "s3",
        "s3a",
        "gs",
        "gcs",
        "az",
        "abfs",
        "abfss",
    }
)
"""URL schemes mxload reads (SPEC §4 "Streaming"); others are refused before connecting."""


def _timeout_option(options: Mapping[str, Any], key: str, default: float) -> float:
    value = options.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 < value <= MAX_TIMEOUT_S)
    ):
        flag = "--" + key.removeprefix("mxload_").removesuffix("_s").replace("_", "-")
        raise UsageError(
            f"{flag} (storage option {key}): must be a number of seconds in (0, "
            f"{MAX_TIMEOUT_S:g}], got {value!r}",
            key=flag,
        )
    return float(value)


# --- retry policy -------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with capped exponential backoff (SPEC §4 "Faults")."""

    attempts: int = 5
    """Tries per request, the first one included (1 = never retry)."""
    initial_backoff_s: float = 0.05
    """Sleep before the second try; it doubles per try (with jitter in [0.5, 1] of it)."""
    max_backoff_s: float = 2.0
    """Cap on one sleep."""

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ValueError(f"RetryPolicy.attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                "RetryPolicy needs 0 <= initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )

    def backoff(self, attempt: int, key: str) -> float:
        """Seconds to sleep after failed try number ``attempt`` (1-based) of request ``key``.

        ``min(max, initial * 2**(attempt-1))`` scaled by a jitter factor in [0.5, 1] derived
        from a hash of (key, attempt): deterministic, yet different for different requests.
        """
        base = min(self.max_backoff_s, self.initial_backoff_s * (2.0 ** (attempt - 1)))
        jitter = zlib.crc32(f"{key}#{attempt}".encode()) / 0xFFFFFFFF
        return base * (0.5 + 0.5 * jitter)


# --- statistics ---------------------------------------------------------------------------


@dataclass
class StorageStats:
    """Counters of one :class:`Storage`; safe to update from several threads.

    ``requests`` counts every request sent (retries included), ``retries`` the tries that
    failed transiently and were repeated, ``bytes_fetched`` the bytes that arrived in
    successful requests (over-read included: compare with the bytes needed for the read
    amplification of SPEC §6).
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

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes_fetched": self.bytes_fetched,
                "requests": self.requests,
                "retries": self.retries,
            }

    def reset(self) -> None:
        with self._lock:
            self.bytes_fetched = self.requests = self.retries = 0


# --- error classification -----------------------------------------------------------------


class ShortRead(OSError):
    """Storage returned fewer bytes than asked for: retried (a cut stream, a racing writer)."""


class _OverlongRead(OSError):
    """Storage returned more bytes than asked for (a server that ignores ``Range``): fatal."""


_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "EAGAIN",
        "EINTR",
        "EBUSY",  # s3fs: SlowDown / ServiceUnavailable / 503
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTUNREACH",
        "EREMOTEIO",  # s3fs: InternalError (500)
        "ESTALE",  # NFS file handle gone stale
    )
    if hasattr(errno, name)
)
_RETRYABLE_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "TooManyRequests",
    }
)
# Transport failures of the HTTP stacks fsspec uses, by class name, so that this module
# does not import aiohttp/botocore/requests just to classify (and works if one is absent).
_RETRYABLE_CLASS_NAMES = frozenset(
    {
        # aiohttp (fsspec http, s3fs's aiobotocore)
        "ClientPayloadError",
        "ContentLengthError",
        "TransferEncodingError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerTimeoutError",
        "ConnectionTimeoutError",
        "SocketTimeoutError",
        # botocore / urllib3 / http.client / requests
        "IncompleteReadError",
        "ResponseStreamingError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ProtocolError",
        "IncompleteRead",
        "RemoteDisconnected",
        "ChunkedEncodingError",
        # fsspec's own timeout
        "FSTimeoutError",
    }
)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, whichever HTTP stack raised it."""
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    if isinstance(status, int) and not isinstance(status, bool):
        return status
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)  # requests.HTTPError
    if isinstance(code, int):
        return code
    if isinstance(response, Mapping):  # botocore.exceptions.ClientError
        meta = response.get("ResponseMetadata") or {}
        code = meta.get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        err = response.get("Error") or {}
        code = err.get("Code")
        if isinstance(code, str):
            return code
    return None


def _causes(exc: BaseException) -> Iterable[BaseException]:
    """The exception and its explicit/implicit causes, outermost first (bounded)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _classify(exc: BaseException) -> str:
    """``"retry"``, ``"not_found"`` or ``"fatal"`` for an exception raised by a read.

    The outermost decisive signal wins: a FileNotFoundError is permanent even if it wraps a
    transport error; an HTTP status or S3 error code decides before generic OS errors
    (s3fs turns a 503 into ``OSError(EBUSY)`` with the botocore error as its cause).
    """
    for e in _causes(exc):
        if isinstance(e, ShortRead):
            return "retry"
        if isinstance(e, _OverlongRead):
            return "fatal"
        if isinstance(e, FileNotFoundError):
            # fsspec's HTTP size lookup turns *any* failure of its GET fallback into
            # FileNotFoundError, with the real failure as the cause: a 503 stays transient.
            if e.__cause__ is not None and _classify(e.__cause__) == "retry":
                return "retry"
            return "not_found"
        if isinstance(e, _PERMANENT_OS_ERRORS):
            return "fatal"
        status = _http_status(e)
        if status is not None:
            if status == 404:
                return "not_found"
            return "retry" if status >= 500 or status == 429 else "fatal"
        code = _s3_code(e)
        if code is not None:
            if code in ("NoSuchKey", "NoSuchBucket", "404"):
                return "not_found"
            return "retry" if code in _RETRYABLE_S3_CODES else "fatal"
        if type(e).__name__ in _RETRYABLE_CLASS_NAMES:
            return "retry"
        if isinstance(e, ConnectionError | TimeoutError):
            return "retry"
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return "retry"
    return "fatal"


def is_timeout(exc: BaseException | None) -> bool:
    """Whether a failed request timed out (a server that accepts and does not answer)."""
    if exc is None:
        return False
    for e in _causes(exc):
        if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__:
            return True
        if isinstance(e, OSError) and e.errno == errno.ETIMEDOUT:
            return True
    return False


def _report_stall(exc: BaseException | None, url: str, attempt: int, attempts: int) -> None:
    """On a terminal, say that a request timed out and will be tried again (a stall
    must not look like a hang); quiet in pipes and logs."""
    if not is_timeout(exc):
        return
    try:
        if not sys.stderr.isatty():
            return
        sys.stderr.write(
            f"\nmxload: {url}: no answer in time (attempt {attempt} of {attempts}); retrying\n"
        )
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: nothing to tell
        pass


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed read is worth repeating (SPEC §4 "Faults")."""
    return _classify(exc) == "retry"


# --- the seam -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """Bytes ``[file_start, file_start + length)`` go to ``out[out_offset:...]``."""

    file_start: int
    length: int
    out_offset: int


@dataclass(frozen=True)
class _Job:
    """One request ``[start, end)`` and where its bytes go."""

    start: int
    end: int
    pieces: tuple[_Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def direct_offset(self) -> int | None:
        """``out`` offset if the request's bytes are one contiguous stretch of ``out``."""
        pos, out = self.start, None
        for p in self.pieces:
            if p.file_start != pos:
                return None
            if out is None:
                out = p.out_offset
            elif p.out_offset != out + (pos - self.start):
                return None
            pos += p.length
        return out if pos == self.end else None


_S3_PROTOCOLS = ("s3", "s3a")
_DEFAULT_MAX_REQUEST_BYTES = 32 << 20


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def _as_byte_view(out: Any) -> memoryview:
    """A writable, flat ``uint8`` memoryview over ``out`` (bytearray, numpy, torch...)."""
    mod = type(out).__module__
    if mod.startswith("torch"):
        t = out
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("read_ranges_into: a torch output must be a contiguous CPU tensor")
        import torch  # workers may import torch; kept local so storage stays light

        out = t.detach().reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(out)
    if mv.readonly:
        raise ValueError("read_ranges_into: the output buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("read_ranges_into: the output buffer must be contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


class Storage:
    """Reads files under one checkpoint root (a local path or any fsspec URL).

    Thread-safe: several threads may read through one instance (reads overlap conversion,
    SPEC §4). Picklable: a copy rebuilds its file system and starts with fresh stats.
    """

    def __init__(
        self,
        root_url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], None] = time.sleep,
        policy: CoalescePolicy | None = None,
        max_concurrency: int = 16,
        max_request_bytes: int = _DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        if not isinstance(root_url, str) or not root_url:
            raise UsageError(
                f"checkpoint location: an empty path or URL ({root_url!r}); give a folder or "
                "an fsspec URL",
                file=str(root_url),
            )
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ValueError("Storage: storage_options must be a mapping (a JSON object)")
        if _protocol(root_url) not in PROTOCOLS:
            raise UsageError(
                f"{root_url}: unsupported protocol {_protocol(root_url)!r}; mxload reads local "
                "paths and " + ", ".join(f"{p}://" for p in sorted(PROTOCOLS) if p),
                file=root_url,
            )
        if max_concurrency < 1 or max_request_bytes < 1:
            raise ValueError("Storage: max_concurrency and max_request_bytes must be >= 1")
        self.root_url = root_url
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retry = retry
        self._sleep = sleep
        self.max_concurrency = max_concurrency
        self.max_request_bytes = max_request_bytes
        self.stats = StorageStats()
        self.connect_timeout_s = _timeout_option(
            self.storage_options, CONNECT_TIMEOUT, DEFAULT_CONNECT_TIMEOUT_S
        )
        self.read_timeout_s = _timeout_option(
            self.storage_options, READ_TIMEOUT, DEFAULT_READ_TIMEOUT_S
        )
        self.allow_outside_links = bool(self.storage_options.get(ALLOW_OUTSIDE_LINKS, False))
        self._inside: dict[str, bool] = {}

        options = self._effective_options(
            root_url, self.storage_options, self.connect_timeout_s, self.read_timeout_s
        )
        try:
            self.fs, root_path = fsspec.core.url_to_fs(root_url, **options)
        except (ValueError, TypeError, ImportError) as exc:
            # An unknown protocol, a missing back end (s3fs...), options it rejects: bad
            # input (exit status 2), not a failed run.
            keys = ", ".join(sorted(self.storage_options)) or "none"
            raise UsageError(
                f"{root_url}: fsspec cannot open this URL ({type(exc).__name__}: {exc}); "
                f"--storage-options keys given: {keys}",
                key="--storage-options",
                file=root_url,
            ) from exc
        if _protocol(root_url) in _S3_PROTOCOLS and hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
        self.is_local: bool = isinstance(self.fs, LocalFileSystem)
        # Local roots are kept as OS paths so reads can go through os.preadv.
        self._root = os.path.abspath(root_path) if self.is_local else root_path.rstrip("/")
        self._real_root = os.path.realpath(self._root) if self.is_local else ""
        self.policy: CoalescePolicy = policy or (LOCAL_POLICY if self.is_local else REMOTE_POLICY)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- construction helpers ---------------------------------------------------------------

    @staticmethod
    def _effective_options(
        root_url: str,
        options: Mapping[str, Any],
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> dict[str, Any]:
        """The caller's options without mxload's own keys, plus: botocore makes one attempt
        per request (the retries happen here, where they are bounded and counted), and
        remote requests time out (see module doc), unless the caller's options say
        otherwise."""
        out = {k: v for k, v in options.items() if k not in MXLOAD_OPTIONS}
        protocol = _protocol(root_url)
        if protocol in ("http", "https"):
            import aiohttp

            client_kwargs = dict(out.get("client_kwargs") or {})
            client_kwargs.setdefault(
                "timeout",
                aiohttp.ClientTimeout(
                    total=None,
                    connect=connect_timeout_s,
                    sock_connect=connect_timeout_s,
                    sock_read=read_timeout_s,
                ),
            )
            out["client_kwargs"] = client_kwargs
        if protocol in _S3_PROTOCOLS:
            config_kwargs = dict(out.get("config_kwargs") or {})
            config_kwargs.setdefault("retries", {"total_max_attempts": 1})
            config_kwargs.setdefault("connect_timeout", connect_timeout_s)
            config_kwargs.setdefault("read_timeout", read_timeout_s)
            out["config_kwargs"] = config_kwargs
            # A private instance: its retry count is set below, and must not leak into
            # other users of fsspec's instance cache.
            out.setdefault("skip_instance_cache", True)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {
            "root_url": self.root_url,
            "storage_options": self.storage_options,
            "retry": self.retry,
            "sleep": self._sleep,
            "policy": self.policy,
            "max_concurrency": self.max_concurrency,
            "max_request_bytes": self.max_request_bytes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["root_url"],
            state["storage_options"],
            retry=state["retry"],
            sleep=state["sleep"],
            policy=state["policy"],
            max_concurrency=state["max_concurrency"],
            max_request_bytes=state["max_request_bytes"],
        )

    def close(self) -> None:
        """Stop the request thread pool (a later read starts a new one)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Storage({self.root_url!r}, policy={self.policy})"

    # -- paths ------------------------------------------------------------------------------

    def _check_relpath(self, relpath: str) -> str:
        parts = relpath.replace("\\", "/").split("/") if isinstance(relpath, str) else []
        if (
            not isinstance(relpath, str)
            or not relpath
            or relpath.startswith(("/", "\\"))
            or "://" in relpath
            or any(p in ("", ".", "..") for p in parts)
            or "\x00" in relpath
        ):
            raise CheckpointError(
                f"{self.root_url}: refusing file name {relpath!r}: checkpoint files must be "
                "plain relative paths inside the checkpoint root",
                file=str(relpath),
            )
        return relpath

    @property
    def reads_ranges_apart(self) -> bool:
        """Whether :meth:`read_ranges_into` reads every range on its own, bridging no gap
        (local files under a policy with ``max_gap_bytes == 0``): then one call for
        several units' ranges fetches exactly the bytes and requests of one call per
        unit, which the loader relies on to read a step's units together."""
        return self.is_local and self.policy.max_gap_bytes == 0

    def url(self, relpath: str) -> str:
        """The full URL (or path) of ``relpath``, as messages name it."""
        self._check_relpath(relpath)
        if self.is_local and "://" not in self.root_url:
            return os.path.join(self.root_url, relpath)
        return self.root_url.rstrip("/") + "/" + relpath

    def _path(self, relpath: str) -> str:
        """What the file system (or ``os``) is given for ``relpath``."""
        self._check_relpath(relpath)
        if self.is_local:
            path = os.path.join(self._root, *relpath.split("/"))
            if not self.allow_outside_links and not self._inside.get(relpath):
                self._check_inside(relpath, path)
            return path
        return posixpath.join(self._root, relpath) if self._root else relpath

    def _check_inside(self, relpath: str, path: str) -> None:
        """A local file must resolve inside the checkpoint folder (a symlink to a system
        file would otherwise be opened and its bytes parsed and quoted). Checked before
        the first read of each file; a link changed later is not seen (limit)."""
        real = os.path.realpath(path)
        if real != self._real_root and not real.startswith(self._real_root.rstrip(os.sep) + os.sep):
            url = self.url(relpath)
            raise CheckpointError(
                f"{url}: resolves to {real}, outside the checkpoint folder {self._real_root}; "
                "not read (a checkpoint is a folder: give --allow-outside-links to follow "
                "links out of it)",
                file=url,
                key="--allow-outside-links",
            )
        self._inside[relpath] = True

    # -- retries ----------------------------------------------------------------------------

    def _call(self, relpath: str, span: tuple[int, int] | None, fn: Callable[[], Any]) -> Any:
        """Run one request (``span`` = (start, length), None for a whole file) with the retry
        policy; a final failure becomes StorageError.

        The first try runs bare: a strided slice on a local disk is thousands of small
        preads, and setting up a tenacity loop per read would cost more than the read.
        Only a request whose first try failed transiently enters the tenacity loop, for
        the remaining ``attempts - 1`` tries.
        """
        self.stats.add(requests=1)
        try:
            return fn()
        except StorageError:
            raise
        except Exception as exc:
            first = exc
        url = self.url(relpath)
        where = contiguous(*span).describe() if span is not None else "whole file"
        if self.retry.attempts == 1 or not is_retryable(first):
            raise self._error(first, url, where, 1) from first
        key = f"{url}@{where}"
        attempts = 1

        def attempt() -> Any:
            nonlocal attempts
            attempts += 1
            self.stats.add(requests=1)
            return fn()

        def before_sleep(state: RetryCallState) -> None:
            self.stats.add(retries=1)
            if state.outcome is not None:
                _report_stall(state.outcome.exception(), url, attempts, self.retry.attempts)

        # Sleep after the bare first try, then let tenacity run tries 2..attempts; its
        # attempt numbers are offset by one from ours.
        self.stats.add(retries=1)
        _report_stall(first, url, 1, self.retry.attempts)
        self._sleep(self.retry.backoff(1, key))
        retrying = Retrying(
            stop=stop_after_attempt(self.retry.attempts - 1),
            wait=lambda state: self.retry.backoff(state.attempt_number + 1, key),
            retry=retry_if_exception(is_retryable),
            reraise=True,
            sleep=self._sleep,
            before_sleep=before_sleep,
        )
        try:
            return retrying(attempt)
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, url, where, attempts) from exc

    def _error(self, exc: Exception, url: str, where: str, attempts: int) -> StorageError:
        kind = _classify(exc)
        cause = f"{type(exc).__name__}: {exc}".rstrip(": ")
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        if kind == "not_found":
            msg = f"{url}: not found (reading {where}; {tries}, not retried); last error: {cause}"
        elif kind == "retry":
            msg = f"{url}: reading {where} failed after {tries} (transient errors); last error: {cause}"
        else:
            msg = (
                f"{url}: reading {where} failed after {tries} (not retryable); last error: {cause}"
            )
        return StorageError(
            msg, file=url, byte_range=where, attempts=attempts, not_found=kind == "not_found"
        )

    # -- whole files and metadata ------------------------------------------------------------

    def _not_a_folder(self, relpath: str, path: str) -> None:
        """A checkpoint file that is a folder is the checkpoint's fault (exit status 2)."""
        if self.is_local and os.path.isdir(path):
            url = self.url(relpath)
            raise CheckpointError(f"{url}: is a folder, not a file", file=url)

    def read_file(self, relpath: str) -> bytes:
        """The whole file (config.json, the index): small files only."""
        path = self._path(relpath)
        self._not_a_folder(relpath, path)

        def fetch() -> bytes:
            if self.is_local:
                with open(path, "rb") as f:
                    data = f.read()
            else:
                data = bytes(self.fs.cat_file(path))
            self.stats.add(bytes_fetched=len(data))
            return data

        result: bytes = self._call(relpath, None, fetch)
        return result

    def size(self, relpath: str) -> int:
        """Size in bytes of ``relpath`` (StorageError if it does not exist)."""
        path = self._path(relpath)
        self._not_a_folder(relpath, path)

        def stat() -> int:
            if self.is_local:
                return os.stat(path).st_size
            value = self.fs.size(path)
            if value is None:
                raise _OverlongRead(f"{self.url(relpath)}: storage reports no size")
            return int(value)

        result: int = self._call(relpath, None, stat)
        return result

    def version_tag(self, relpath: str) -> str:
        """What the store says identifies this version of ``relpath`` beyond its size: the
        ETag where it gives one (S3, most HTTP servers), else its modification time, else
        "" (a checkpoint's fingerprint, SPEC §4 "Reload", includes it)."""
        path = self._path(relpath)

        def stat() -> str:
            if self.is_local:
                st = os.stat(path)
                return f"mtime_ns={st.st_mtime_ns}"
            info = self.fs.info(path)
            for key in ("ETag", "etag", "LastModified", "last_modified", "mtime", "Last-Modified"):
                value = info.get(key)
                if value:
                    return f"{key}={value}"
            return ""

        result: str = self._call(relpath, None, stat)
        return result

    def exists(self, relpath: str) -> bool:
        """Whether ``relpath`` exists. Errors other than "not found" still raise."""
        try:
            self.size(relpath)
        except StorageError as err:
            if err.context.get("not_found"):
                return False
            raise
        return True

    def read_range(self, relpath: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` (a safetensors header, say), exactly."""
        if start < 0 or length < 0:
            raise ValueError(f"read_range({self.url(relpath)}): negative start or length")
        if length == 0:
            return b""
        path = self._path(relpath)

        def fetch() -> bytes:
            if self.is_local:
                buf = bytearray(length)
                fd = os.open(path, os.O_RDONLY)
                try:
                    _pread_into(fd, memoryview(buf), start)
                finally:
                    os.close(fd)
                data = bytes(buf)
            else:
                data = self._cat_checked(path, start, start + length)
            self.stats.add(bytes_fetched=len(data))
            return data

        result: bytes = self._call(relpath, (start, length), fetch)
        return result

    # -- ranged reads into a buffer ----------------------------------------------------------

    def read_ranges_into(self, relpath: str, ranges: Sequence[ByteRange], out: Any) -> int:
        """Read the segments of ``ranges``, concatenated in order, into ``out``.

        ``out`` is a writable contiguous buffer of exactly ``sum(r.nbytes)`` bytes. Returns
        the bytes fetched from storage for this call, over-read included.
        """
        view = _as_byte_view(out)
        total = sum(r.nbytes for r in ranges)
        if view.nbytes != total:
            raise ValueError(
                f"read_ranges_into({self.url(relpath)}): output buffer has {view.nbytes} "
                f"bytes, the ranges cover {total}"
            )
        if total == 0:
            return 0
        path = self._path(relpath)
        if self.reads_ranges_apart:
            # No per-segment bookkeeping here: a K-split expert slice is thousands of
            # segments, and listing them cost more than reading them (issue 13 bench).
            return self._run_local_exact(relpath, path, ranges, view)
        pieces: list[_Piece] = []
        offset = 0
        for r in ranges:
            for seg_start, seg_len in r.segments():
                pieces.append(_Piece(seg_start, seg_len, offset))
                offset += seg_len
        jobs = self._jobs(ranges, pieces)
        if self.is_local:
            return self._run_local(relpath, path, jobs, view)
        return self._run_remote(relpath, path, jobs, view)

    def _jobs(self, ranges: Sequence[ByteRange], pieces: list[_Piece]) -> list[_Job]:
        """Coalesced requests (split to at most max_request_bytes when remote), each with
        the pieces of output it fills, clipped to the request."""
        requests = coalesce(ranges, self.policy)
        chunk = None if self.is_local else self.max_request_bytes
        spans: list[tuple[int, int]] = []
        for req in requests:
            if chunk is None or req.nbytes <= chunk:
                spans.append((req.start, req.end))
            else:
                spans.extend((s, min(s + chunk, req.end)) for s in range(req.start, req.end, chunk))
        starts = [s for s, _ in spans]
        buckets: list[list[_Piece]] = [[] for _ in spans]
        for p in sorted(pieces, key=lambda p: (p.file_start, p.out_offset)):
            p_end = p.file_start + p.length
            i = bisect.bisect_right(starts, p.file_start) - 1
            while i < len(spans) and spans[i][0] < p_end:
                s, e = spans[i]
                lo, hi = max(s, p.file_start), min(e, p_end)
                if hi > lo:
                    buckets[i].append(_Piece(lo, hi - lo, p.out_offset + (lo - p.file_start)))
                i += 1
        return [_Job(s, e, tuple(b)) for (s, e), b in zip(spans, buckets, strict=True)]

    def _run_local_exact(
        self, relpath: str, path: str, ranges: Sequence[ByteRange], view: memoryview
    ) -> int:
        """Local files when no gap between ranges is bridged: each range goes straight
        into the output, one request (and retry scope) per range. A strided range whose
        gaps are under ``policy.span_gap_bytes`` (a page) is read as its span and its
        rows gathered out of it (:func:`_gather_span`); a wider one is pread row by row
        in one tight loop.

        A row-split slice is thousands of small segments; a request object per segment
        cost several times the pread itself (issue 6 bench, tp >= 2), and one pread per
        96-byte row cost more than reading the span (issue 13 bench, tp = 8)."""
        fetched = 0
        fd: int | None = None
        gather: list[np.ndarray] = []  # one scratch buffer, made on first use
        try:
            offset = 0
            for r in ranges:
                n = r.nbytes
                if n == 0:
                    continue
                dst = view[offset : offset + n]
                offset += n
                spanned = self.policy.as_read(r)

                def read(r: ByteRange = r, dst: memoryview = dst, span: ByteRange = spanned) -> int:
                    nonlocal fd
                    if fd is None:
                        fd = os.open(path, os.O_RDONLY)
                    if r.is_contiguous():
                        _pread_into(fd, dst, r.start)
                        got = r.nbytes
                    elif span is not r:
                        got = _gather_span(fd, r, dst, gather, self.stats)
                    else:
                        length, stride, start = r.length, r.stride, r.start
                        for i in range(r.count):
                            lo = i * length
                            _pread_into(fd, dst[lo : lo + length], start + i * stride)
                        self.stats.add(requests=r.count - 1)  # one pread per segment
                        got = r.nbytes
                    self.stats.add(bytes_fetched=got)
                    return got

                fetched += self._call(relpath, (r.start, r.end - r.start), read)
        finally:
            if fd is not None:
                os.close(fd)
        return fetched

    def _run_local(self, relpath: str, path: str, jobs: list[_Job], view: memoryview) -> int:
        fetched = 0
        fd: int | None = None
        try:
            for job in jobs:

                def read(job: _Job = job) -> int:
                    nonlocal fd
                    if fd is None:
                        fd = os.open(path, os.O_RDONLY)
                    direct = job.direct_offset()
                    if direct is not None:  # straight into the caller's buffer
                        _pread_into(fd, view[direct : direct + job.nbytes], job.start)
                    else:
                        tmp = bytearray(job.nbytes)
                        _pread_into(fd, memoryview(tmp), job.start)
                        _scatter(job, memoryview(tmp), view)
                    self.stats.add(bytes_fetched=job.nbytes)
                    return job.nbytes

                fetched += self._call(relpath, (job.start, job.nbytes), read)
        finally:
            if fd is not None:
                os.close(fd)
        return fetched

    def _run_remote(self, relpath: str, path: str, jobs: list[_Job], view: memoryview) -> int:
        def run(job: _Job) -> int:
            def fetch() -> int:
                data = self._cat_checked(path, job.start, job.end)
                self.stats.add(bytes_fetched=len(data))
                direct = job.direct_offset()
                src = memoryview(data)
                if direct is not None:
                    view[direct : direct + job.nbytes] = src
                else:
                    _scatter(job, src, view)
                return job.nbytes

            result: int = self._call(relpath, (job.start, job.nbytes), fetch)
            return result

        if len(jobs) == 1:
            return run(jobs[0])
        pool = self._get_pool()
        futures: list[Future[int]] = [pool.submit(run, job) for job in jobs]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending and any(f.exception() is not None for f in done):
            # Fail fast, but never return while a request may still write into `out`.
            for f in pending:
                f.cancel()
            wait(pending)
        for f in futures:  # the first failure in request order
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return sum(f.result() for f in futures)

    def _cat_checked(self, path: str, start: int, end: int) -> bytes:
        data = self.fs.cat_file(path, start=start, end=end)
        want = end - start
        if len(data) < want:
            raise ShortRead(f"short read: got {len(data)} of {want} bytes")
        if len(data) > want:
            raise _OverlongRead(
                f"got {len(data)} bytes for a request of {want}: the server does not honour "
                "HTTP Range requests"
            )
        return bytes(data) if not isinstance(data, bytes) else data

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix="mxload-storage"
                )
            return self._pool


_HAS_PREADV = hasattr(os, "preadv")


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; ShortRead if the file ends first."""
    want = buf.nbytes
    done = 0
    while done < want:
        if _HAS_PREADV:
            n = os.preadv(fd, [buf[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv: one extra copy
            chunk = os.pread(fd, want - done, offset + done)
            n = len(chunk)
            buf[done : done + n] = chunk
        if n == 0:
            raise ShortRead(f"short read: got {done} of {want} bytes (file ends early)")
        done += n


_GATHER_BYTES = 1 << 20
"""Largest block of a spanned strided range read at once (the gather scratch buffer, one
per read call, outside the staging pool like a remote response body)."""


def _gather_span(
    fd: int, r: ByteRange, dst: memoryview, scratch: list[np.ndarray], stats: StorageStats
) -> int:
    """Read the span of strided range ``r`` in blocks of whole strides and gather its
    rows into ``dst`` (one request per block); returns the bytes read (the span: first
    row's start to last row's end, exactly what ``CoalescePolicy.as_read`` predicts).

    Gathering out of a read-only mapping of the span instead was tried (issue 13): a
    fresh mapping's page faults cost what the copy does (w2 spans at tp = 8: 49 ms
    mapped, 44 ms copied, per load of the bench's 8 ranks), and a mapping turns a file
    truncated under the reader into SIGBUS instead of a ShortRead."""
    stride, length, count = r.stride, r.length, r.count
    rows_per_block = max(1, _GATHER_BYTES // stride)
    if not scratch:
        scratch.append(np.empty(rows_per_block * stride, dtype=np.uint8))
    buf = scratch[0]
    if buf.nbytes < rows_per_block * stride:
        buf = scratch[0] = np.empty(rows_per_block * stride, dtype=np.uint8)
    out = np.frombuffer(dst, dtype=np.uint8).reshape(count, length)
    by_row = buf[: rows_per_block * stride].reshape(rows_per_block, stride)
    got = 0
    for a in range(0, count, rows_per_block):
        b = min(count, a + rows_per_block)
        # whole strides, but the last block stops at the last row's end
        nbytes = (b - a) * stride if b < count else (b - a - 1) * stride + length
        _pread_into(fd, memoryview(buf)[:nbytes], r.start + a * stride)
        got += nbytes
        # rows of the block: a plain 2-D view (np.lib.stride_tricks.as_strided cost ~30 us
        # a call, a tenth of a 96-byte-row expert's whole read at tp = 8)
        out[a:b] = by_row[: b - a, :length]
    blocks = -(-count // rows_per_block)
    if blocks > 1:
        stats.add(requests=blocks - 1)  # one per block; the caller's _call counted the first
    return got


def _scatter(job: _Job, src: memoryview, out: memoryview) -> None:
    for p in job.pieces:
        lo = p.file_start - job.start
        out[p.out_offset : p.out_offset + p.length] = src[lo : lo + p.length]
