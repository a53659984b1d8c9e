"""Storage options: the keys mxload reads itself, and what fsspec is given.

``storage_options`` (the CLI's ``--storage-options JSON``) go to fsspec unchanged
(``endpoint_url``, ``key``/``secret``, ``client_kwargs``...), except the keys of
:data:`MXLOAD_OPTIONS`, which mxload reads and removes. They travel with the other
options to every worker, so a setting given once holds for the catalog, the planner and
every rank:

* timeouts of remote requests: a connect timeout and a read timeout (the longest wait
  for the next bytes of an answer), each at most :data:`MAX_TIMEOUT_S`, so a server
  that accepts and never answers costs at most ``attempts x (connect + read timeout)
  + backoff`` and then fails naming the URL. A ``client_kwargs.timeout`` (HTTP) or
  ``config_kwargs`` timeout (S3) of the caller's own wins;
* ``mxload_min_read_rate``: the slowest progress a remote read may make, in bytes per
  second. A request may take at most ``connect + read timeout + bytes / rate`` in all
  (HTTP(S)), so a server that sends a byte now and then, never silent long enough for
  the read timeout, is given up on too;
* ``mxload_allow_outside_links``: follow links out of a local checkpoint folder (a JSON
  boolean).

The other values are the caller's, often credentials: mxload never shows them. They
have no repr in the objects that carry them, and :func:`scrub` takes them out of any
text that leaves the process (error lines, log files).

Back ends that retry on their own (s3fs, botocore) are set to one attempt, unless the
caller's options say otherwise: attempts are counted in :mod:`.retry` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...orchestrator.errors import UsageError
from .urls import S3_PROTOCOLS, protocol

CONNECT_TIMEOUT = "mxload_connect_timeout_s"
READ_TIMEOUT = "mxload_read_timeout_s"
ALLOW_OUTSIDE_LINKS = "mxload_allow_outside_links"
MIN_READ_RATE = "mxload_min_read_rate"
MXLOAD_OPTIONS = (CONNECT_TIMEOUT, READ_TIMEOUT, ALLOW_OUTSIDE_LINKS, MIN_READ_RATE)
"""Storage-option keys mxload reads itself and removes before calling fsspec."""

DEFAULT_CONNECT_TIMEOUT_S = 10.0
"""Seconds to wait for a remote connection (TCP and TLS) before the attempt fails."""
DEFAULT_READ_TIMEOUT_S = 30.0
"""Seconds to wait for the next bytes of a remote answer before the attempt fails."""
MAX_TIMEOUT_S = 60.0
"""Upper bound of either timeout: a bigger one would let one silent server stall a run."""
DEFAULT_MIN_READ_RATE = 1 << 20
"""Bytes per second a remote read must average (1 MiB/s): a 32 MiB request may take
about 32 s beyond its timeouts. A store slower than that is not one to load from."""


@dataclass(frozen=True)
class MxloadOptions:
    """The storage options mxload reads itself, checked."""

    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    allow_outside_links: bool = False
    min_read_rate: float = DEFAULT_MIN_READ_RATE

    def request_budget_s(self, nbytes: int) -> float:
        """The longest one remote request of ``nbytes`` may take, all told."""
        return self.connect_timeout_s + self.read_timeout_s + max(0, nbytes) / self.min_read_rate

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> MxloadOptions:
        """Read mxload's keys from ``options`` (UsageError naming the flag if one is bad)."""
        return cls(
            connect_timeout_s=_timeout(options, CONNECT_TIMEOUT, DEFAULT_CONNECT_TIMEOUT_S),
            read_timeout_s=_timeout(options, READ_TIMEOUT, DEFAULT_READ_TIMEOUT_S),
            allow_outside_links=_boolean(options, ALLOW_OUTSIDE_LINKS),
            min_read_rate=_rate(options),
        )


def _rate(options: Mapping[str, Any]) -> float:
    value = options.get(MIN_READ_RATE, DEFAULT_MIN_READ_RATE)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e15:
        raise UsageError(
            f"--min-read-rate (storage option {MIN_READ_RATE}): must be bytes per second "
            f"> 0, got {_shown(value)}",
            key="--min-read-rate",
        )
    return float(value)


def _boolean(options: Mapping[str, Any], key: str) -> bool:
    """A switch is a JSON boolean: ``"false"`` (a non-empty string) would read as true."""
    value = options.get(key, False)
    if not isinstance(value, bool):
        flag = "--" + key.removeprefix("mxload_").replace("_", "-")
        raise UsageError(
            f"{flag} (storage option {key}): must be a JSON boolean (true or false), got "
            f"{type(value).__name__} {_shown(value)}",
            key=flag,
        )
    return value


def _shown(value: Any) -> str:
    """A value of mxload's own keys, for a message: never a secret, but kept short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _timeout(options: Mapping[str, Any], key: str, default: float) -> float:
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


def fsspec_options(
    root_url: str, options: Mapping[str, Any], mine: MxloadOptions = MxloadOptions()
) -> dict[str, Any]:
    """The caller's options without mxload's own keys, plus: botocore makes one attempt
    per request, and remote requests time out, unless the caller's options say
    otherwise."""
    out = {k: v for k, v in options.items() if k not in MXLOAD_OPTIONS}
    scheme = protocol(root_url)
    if scheme in ("http", "https"):
        import aiohttp

        client_kwargs = dict(out.get("client_kwargs") or {})
        client_kwargs.setdefault(
            "timeout",
            aiohttp.ClientTimeout(
                total=None,
                connect=mine.connect_timeout_s,
                sock_connect=mine.connect_timeout_s,
                sock_read=mine.read_timeout_s,
            ),
        )
        out["client_kwargs"] = client_kwargs
    if scheme in S3_PROTOCOLS:
        config_kwargs = dict(out.get("config_kwargs") or {})
        config_kwargs.setdefault("retries", {"total_max_attempts": 1})
        config_kwargs.setdefault("connect_timeout", mine.connect_timeout_s)
        config_kwargs.setdefault("read_timeout", mine.read_timeout_s)
        out["config_kwargs"] = config_kwargs
        # A private instance: its retry count is set after opening, and must not leak
        # into other users of fsspec's instance cache.
        out.setdefault("skip_instance_cache", True)
    return out


HIDDEN = "<hidden>"


def secret_values(options: Mapping[str, Any] | None) -> list[str]:
    """Every value of the caller's storage options (nested ones too) as text, longest
    first, that :func:`scrub` hides: texts, and numbers as written (a header may be a
    numeric token). mxload's own keys, booleans and values under 4 characters (``true``,
    a region such as ``us``, a port-less count) are not secrets."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = repr(value)
        if isinstance(value, str):
            if len(value) >= 4:
                found.add(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    for key, value in (options or {}).items():
        if key not in MXLOAD_OPTIONS:
            walk(value)
    return sorted(found, key=len, reverse=True)


def scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``<hidden>``."""
    for secret in secrets:
        text = text.replace(secret, HIDDEN)
    return text
