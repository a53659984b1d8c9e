"""Which failed reads are worth repeating: transient (5xx, 429, S3 SlowDown, cut
connections, timeouts, short reads) or not (a missing file, a 403 or another 4xx).

Exceptions are recognised by what they carry (an HTTP status, an S3 error code, an
errno) or by class name, so this module imports none of the HTTP stacks fsspec may use
(and works when one is absent). docs/contract.md §4 "Faults".
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable, Mapping
from typing import Literal

Verdict = Literal["retry", "not_found", "fatal"]


class ShortRead(OSError):
    """Storage returned fewer bytes than asked for: retried (a cut stream, a racing writer)."""


class OverlongRead(OSError):
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


_UNEXPECTED_KEYWORD = re.compile(r"unexpected keyword argument '([^']+)'")


def rejected_option(exc: BaseException) -> str | None:
    """The storage option a back end refused, when a read failed because of one: fsspec
    hands the options it does not know to each request (aiohttp, botocore), which then
    raises TypeError naming the keyword. None for any other failure."""
    for e in _causes(exc):
        if isinstance(e, TypeError):
            m = _UNEXPECTED_KEYWORD.search(str(e))
            if m:
                return m.group(1)
    return None


def classify(exc: BaseException) -> Verdict:
    """``"retry"``, ``"not_found"`` or ``"fatal"`` for an exception raised by a read.

    The outermost decisive signal wins: a FileNotFoundError is permanent even if it wraps a
    transport error; an HTTP status or S3 error code decides before generic OS errors
    (s3fs turns a 503 into ``OSError(EBUSY)`` with the botocore error as its cause).
    """
    for e in _causes(exc):
        if isinstance(e, ShortRead):
            return "retry"
        if isinstance(e, OverlongRead):
            return "fatal"
        if isinstance(e, FileNotFoundError):
            # fsspec's HTTP size lookup turns *any* failure of its GET fallback into
            # FileNotFoundError, with the real failure as the cause: a 503 stays transient.
            if e.__cause__ is not None and classify(e.__cause__) == "retry":
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


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed read is worth repeating."""
    return classify(exc) == "retry"
