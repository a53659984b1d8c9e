"""Reads through fsspec (HTTP(S), S3, GCS, Azure, memory://...).

Ranged requests run concurrently on a small thread pool and their bytes are scattered
into the caller's buffer: one copy, from the response body (fsspec's ``cat`` returns
``bytes``). A response of the wrong length is an error: short is transient (a cut
stream), long is fatal (a server that ignores ``Range``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import fsspec  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

from ...orchestrator.errors import UsageError
from .faults import OverlongRead, ShortRead
from .jobs import Job
from .local import Runner
from .options import MxloadOptions
from .stats import StorageStats
from .urls import S3_PROTOCOLS, protocol


def open_fs(root_url: str, fs_options: Mapping[str, Any], given: Mapping[str, Any]) -> Any:
    """The fsspec file system and root path of ``root_url``, opened with ``fs_options``
    (``given``: the caller's options, named in errors). UsageError when fsspec cannot
    open it: an unknown protocol, a missing back end (s3fs...), options it rejects are
    bad input, not a failed run."""
    try:
        fs, root_path = fsspec.core.url_to_fs(root_url, **fs_options)
    except (ValueError, TypeError, ImportError) as exc:
        keys = ", ".join(sorted(given)) or "none"
        raise UsageError(
            f"{root_url}: fsspec cannot open this URL ({type(exc).__name__}: {exc}); "
            f"--storage-options keys given: {keys}",
            key="--storage-options",
            file=root_url,
        ) from exc
    if protocol(root_url) in S3_PROTOCOLS and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
    return fs, str(root_path)


def is_local_fs(fs: Any) -> bool:
    """Whether fsspec opened the local file system (then reads bypass fsspec)."""
    return isinstance(fs, LocalFileSystem)


def request_timeout(root_url: str, mine: MxloadOptions, nbytes: int) -> dict[str, Any]:
    """Keywords that bound one request of ``nbytes`` in all (``request_budget_s``), where
    the back end takes them per request: HTTP(S) (aiohttp's total timeout, beside the
    connect and read timeouts). Others: nothing (their timeouts are per connection)."""
    if protocol(root_url) not in ("http", "https"):
        return {}
    import aiohttp

    return {
        "timeout": aiohttp.ClientTimeout(
            total=mine.request_budget_s(nbytes),
            connect=mine.connect_timeout_s,
            sock_connect=mine.connect_timeout_s,
            sock_read=mine.read_timeout_s,
        )
    }


def cat(
    fs: Any, path: str, start: int | None, end: int | None, limits: Mapping[str, Any] | None
) -> Any:
    """``fs.cat_file``, with ``limits`` handed to the request itself: the synchronous
    wrapper would take a ``timeout`` keyword as its own (how long to wait for the
    coroutine, which then runs on unbounded)."""
    if not limits:
        return fs.cat_file(path, start=start, end=end)
    from fsspec.asyn import sync  # type: ignore[import-untyped]

    async def call() -> Any:
        return await fs._cat_file(path, start=start, end=end, **limits)

    return sync(fs.loop, call)


def cat_checked(
    fs: Any, path: str, start: int, end: int, limits: Mapping[str, Any] | None = None
) -> bytes:
    """Bytes ``[start, end)`` of ``path``, exactly (ShortRead / OverlongRead otherwise).
    ``limits``: :func:`request_timeout`'s keywords."""
    data = cat(fs, path, start, end, limits)
    want = end - start
    if len(data) < want:
        raise ShortRead(f"short read: got {len(data)} of {want} bytes")
    if len(data) > want:
        raise OverlongRead(
            f"got {len(data)} bytes for a request of {want}: the server does not honour "
            "HTTP Range requests"
        )
    return data if isinstance(data, bytes) else bytes(data)


def size(fs: Any, path: str, url: str) -> int:
    value = fs.size(path)
    if value is None:
        raise OverlongRead(f"{url}: storage reports no size")
    return int(value)


STRONG_TAGS = ("VersionId", "version_id", "generation", "ETag", "etag", "Content-MD5", "md5Hash", "Digest")  # fmt: skip
"""What a store says of an object that changes whenever its bytes do: S3's VersionId,
GCS's generation, an ETag, a content digest. A modification time is not one (a second's
resolution, and a writer can set it back)."""


def version_tag(fs: Any, path: str) -> str:
    """The store's strong change tags of ``path`` (:data:`STRONG_TAGS`), "" when it gives
    none: then nothing vouches for the bytes."""
    info = fs.info(path)
    return ",".join(f"{key}={info[key]}" for key in STRONG_TAGS if info.get(key))


def read_jobs(
    fs: Any,
    path: str,
    jobs: Sequence[Job],
    view: memoryview,
    run: Runner,
    stats: StorageStats,
    pool: Callable[[], ThreadPoolExecutor],
    limits: Callable[[int], Mapping[str, Any]] | None = None,
) -> int:
    """Run requests ``jobs`` into ``view``, concurrently on ``pool()`` when several.
    Fails with the first failure in request order, and never returns while a request
    may still write into ``view``. ``limits(nbytes)``: per-request keywords
    (:func:`request_timeout`)."""

    def one(job: Job) -> int:
        def fetch() -> int:
            extra = limits(job.nbytes) if limits is not None else None
            data = cat_checked(fs, path, job.start, job.end, extra)
            stats.add(bytes_fetched=len(data))
            direct = job.direct_offset()
            if direct is not None:
                view[direct : direct + job.nbytes] = memoryview(data)
            else:
                job.scatter(memoryview(data), view)
            return job.nbytes

        return run((job.start, job.nbytes), fetch)

    if len(jobs) == 1:
        return one(jobs[0])
    futures: list[Future[int]] = [pool().submit(one, job) for job in jobs]
    done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if pending and any(f.exception() is not None for f in done):
        for f in pending:
            f.cancel()
        wait(pending)
    for f in futures:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            raise error
    return sum(f.result() for f in futures)
