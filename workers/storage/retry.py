"""Retries of failed reads: the only place in mxload that retries (docs/contract.md §4
"Faults").

Attempts are bounded, backoff is exponential and capped with a deterministic jitter (a
pure function of the request and the attempt, so 256 ranks that hit the same 503 do not
come back in lockstep, and tests are reproducible), ``sleep`` is injectable so tests
never wait, and only transient failures (:func:`.faults.is_retryable`) are retried.
Whatever fails for good becomes one StorageError naming the URL, the byte range, the
attempts made and the last cause.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from ...orchestrator.errors import StorageError, UsageError
from .faults import classify, is_retryable, is_timeout, rejected_option
from .stats import StorageStats

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with capped exponential backoff."""

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


def retry_after_first_failure(
    fn: Callable[[], T],
    first: Exception,
    *,
    url: str,
    where: str,
    policy: RetryPolicy,
    sleep: Callable[[float], None],
    stats: StorageStats,
) -> T:
    """Tries 2..attempts of a request whose first try (run bare by the caller, where a
    tenacity loop per read would cost more than a small read) failed with ``first``.
    ``where`` names the byte range in messages. StorageError once it fails for good."""
    option = rejected_option(first)
    if option is not None:
        raise UsageError(
            f"{url}: the storage back end takes no option {option!r} (--storage-options)",
            key="--storage-options",
            file=url,
        ) from first
    if policy.attempts == 1 or not is_retryable(first):
        raise storage_error(first, url, where, 1) from first
    key = f"{url}@{where}"
    attempts = 1

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        stats.add(requests=1)
        return fn()

    def before_sleep(state: RetryCallState) -> None:
        stats.add(retries=1)
        if state.outcome is not None:
            _report_stall(state.outcome.exception(), url, attempts, policy.attempts)

    stats.add(retries=1)
    _report_stall(first, url, 1, policy.attempts)
    sleep(policy.backoff(1, key))
    # tenacity counts its own attempts from 1: ours are one more (the bare first try).
    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts - 1),
        wait=lambda state: policy.backoff(state.attempt_number + 1, key),
        retry=retry_if_exception(is_retryable),
        reraise=True,
        sleep=sleep,
        before_sleep=before_sleep,
    )
    try:
        return retrying(attempt)
    except StorageError:
        raise
    except Exception as exc:
        raise storage_error(exc, url, where, attempts) from exc


def storage_error(exc: Exception, url: str, where: str, attempts: int) -> StorageError:
    """The StorageError for a request that failed for good after ``attempts`` tries."""
    kind = classify(exc)
    cause = f"{type(exc).__name__}: {exc}".rstrip(": ")
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    if kind == "not_found":
        msg = f"{url}: not found (reading {where}; {tries}, not retried); last error: {cause}"
    elif kind == "retry":
        msg = f"{url}: reading {where} failed after {tries} (transient errors); last error: {cause}"
    else:
        msg = f"{url}: reading {where} failed after {tries} (not retryable); last error: {cause}"
    return StorageError(
        msg, file=url, byte_range=where, attempts=attempts, not_found=kind == "not_found"
    )


def _report_stall(exc: BaseException | None, url: str, attempt: int, attempts: int) -> None:
    """Say that a request timed out and will be tried again: a stall must not look like a
    hang. A warning, so the command line shows it at its default level."""
    if is_timeout(exc):
        logger.warning("%s: no answer in time (attempt %d of %d); retrying", url, attempt, attempts)
