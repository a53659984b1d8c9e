""":class:`Storage`: reads byte ranges of the files under one checkpoint location.

It ties the parts of this package together: the location and file names are checked
(:mod:`.urls`), the storage options read (:mod:`.options`), every request runs once bare
and then under the retry policy (:mod:`.retry`), and the bytes come from the local file
system (:mod:`.local`) or through fsspec (:mod:`.remote`).
"""

from __future__ import annotations

import os
import posixpath
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ...orchestrator.errors import CheckpointError, InputError, StorageError
from ...orchestrator.plan.ranges import (
    LOCAL_POLICY,
    REMOTE_POLICY,
    ByteRange,
    CoalescePolicy,
    contiguous,
)
from . import local, remote
from .jobs import as_byte_view, plan_jobs
from .options import MxloadOptions, fsspec_options
from .retry import RetryPolicy, retry_after_first_failure
from .stats import StorageStats
from .urls import check_inside, check_location, check_relpath, file_url

T = TypeVar("T")

_DEFAULT_MAX_REQUEST_BYTES = 32 << 20
MAX_METADATA_BYTES = 64 << 20
"""Most bytes of a whole-file read (config.json, the index; docs/contract.md §1.4): a
DeepSeek-V3 index is 9 MB; a bigger file is not a checkpoint's, and would be held whole
in memory (twice, as bytes and parsed) before the JSON parser could object."""
_DEFAULT_RETRY = RetryPolicy()


class Storage:
    """Reads files under one checkpoint root (a local path or any fsspec URL).

    Files are addressed relative to the root; directories are never listed (HTTP and
    object stores list badly). Thread-safe: several threads may read through one
    instance (reads overlap conversion). Picklable: a copy rebuilds its file system and
    starts with fresh stats.
    """

    def __init__(
        self,
        root_url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy = _DEFAULT_RETRY,
        sleep: Callable[[float], None] = time.sleep,
        policy: CoalescePolicy | None = None,
        max_concurrency: int = 16,
        max_request_bytes: int = _DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        check_location(root_url)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ValueError("Storage: storage_options must be a mapping (a JSON object)")
        if max_concurrency < 1 or max_request_bytes < 1:
            raise ValueError("Storage: max_concurrency and max_request_bytes must be >= 1")
        self.root_url = root_url
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retry = retry
        self._sleep = sleep
        self.max_concurrency = max_concurrency
        self.max_request_bytes = max_request_bytes
        self.stats = StorageStats()
        mine = MxloadOptions.parse(self.storage_options)
        self.limits = mine
        self.connect_timeout_s = mine.connect_timeout_s
        self.read_timeout_s = mine.read_timeout_s
        self.allow_outside_links = mine.allow_outside_links
        self._inside: dict[str, bool] = {}
        fs_options = fsspec_options(root_url, self.storage_options, mine)
        self.fs, root_path = remote.open_fs(root_url, fs_options, self.storage_options)
        self.is_local: bool = remote.is_local_fs(self.fs)
        # Local roots are kept as OS paths so reads can go through os.preadv.
        self._root = os.path.abspath(root_path) if self.is_local else root_path.rstrip("/")
        self._real_root = os.path.realpath(self._root) if self.is_local else ""
        self.policy: CoalescePolicy = policy or (LOCAL_POLICY if self.is_local else REMOTE_POLICY)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- lifetime -------------------------------------------------------------------------

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

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix="mxload-storage"
                )
            return self._pool

    # -- paths ----------------------------------------------------------------------------

    @property
    def reads_ranges_apart(self) -> bool:
        """Whether :meth:`read_ranges_into` reads every range on its own, bridging no gap
        (local files under a policy with ``max_gap_bytes == 0``): then one call for
        several units' ranges fetches exactly the bytes and requests of one call per
        unit, which the loader relies on to read a step's units together."""
        return self.is_local and self.policy.max_gap_bytes == 0

    def url(self, relpath: str) -> str:
        """The full URL (or path) of ``relpath``, as messages name it."""
        return file_url(self.root_url, relpath, local=self.is_local)

    def _path(self, relpath: str) -> str:
        """What the file system (or ``os``) is given for ``relpath``. A local file is
        checked to resolve inside the checkpoint folder before its first read (a link
        changed later is not seen: a limit)."""
        check_relpath(self.root_url, relpath)
        if not self.is_local:
            return posixpath.join(self._root, relpath) if self._root else relpath
        path = os.path.join(self._root, *relpath.split("/"))
        if not self.allow_outside_links and not self._inside.get(relpath):
            check_inside(self._real_root, path, self.url(relpath))
            self._inside[relpath] = True
        return path

    def _regular(self, relpath: str, path: str) -> None:
        """A local checkpoint file that is a folder, a FIFO, a device or a socket is the
        checkpoint's fault (exit status 2), refused before it is opened (links followed:
        a link to ``/dev/zero`` is a device)."""
        if not self.is_local:
            return
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return  # missing: the request itself says so
        if not stat.S_ISREG(mode):
            url = self.url(relpath)
            raise CheckpointError(
                f"{url}: is {local.file_kind(mode)}, not a regular file; not read", file=url
            )

    # -- requests -------------------------------------------------------------------------

    def _call(self, relpath: str, span: tuple[int, int] | None, fn: Callable[[], T]) -> T:
        """Run one request of ``relpath`` (``span`` = (start, length), None for a whole
        file): the first try bare (a strided slice on a local disk is thousands of small
        preads, and a retry loop set up per read would cost more than the read), the
        rest under the retry policy; a final failure becomes StorageError."""
        self.stats.add(requests=1)
        try:
            return fn()
        except (StorageError, InputError):  # failed for good, or the checkpoint's fault
            raise
        except Exception as exc:
            first = exc
        return retry_after_first_failure(
            fn,
            first,
            url=self.url(relpath),
            where=contiguous(*span).describe() if span is not None else "whole file",
            policy=self.retry,
            sleep=self._sleep,
            stats=self.stats,
        )

    def _runner(self, relpath: str) -> local.Runner:
        """:meth:`_call` bound to ``relpath``, for the reads of :mod:`.local` and
        :mod:`.remote`."""
        return lambda span, fn: self._call(relpath, span, fn)

    # -- whole files and metadata ---------------------------------------------------------

    def read_file(self, relpath: str, max_bytes: int = MAX_METADATA_BYTES) -> bytes:
        """The whole file (config.json, the index): small files only, at most
        ``max_bytes`` (CheckpointError naming it when bigger, read no further)."""
        path = self._path(relpath)
        self._regular(relpath, path)
        url = self.url(relpath)

        def fetch() -> bytes:
            if self.is_local:
                data = local.read_whole(path, max_bytes, url)
            else:
                size = remote.size(self.fs, path, url)
                if size > max_bytes:
                    raise local.too_large(url, max_bytes)
                data = bytes(remote.cat(self.fs, path, None, None, self._limits(size)))
                if len(data) > max_bytes:  # grew since: still not kept
                    raise local.too_large(url, max_bytes)
            self.stats.add(bytes_fetched=len(data))
            return data

        return self._call(relpath, None, fetch)

    def size(self, relpath: str) -> int:
        """Size in bytes of ``relpath`` (StorageError if it does not exist)."""
        path = self._path(relpath)
        self._regular(relpath, path)

        def stat() -> int:
            if self.is_local:
                return os.stat(path).st_size
            return remote.size(self.fs, path, self.url(relpath))

        return self._call(relpath, None, stat)

    def version_tag(self, relpath: str) -> str:
        """What changes whenever the bytes of ``relpath`` do (a checkpoint's fingerprint
        includes it, docs/contract.md §4 "Reload"), "" when the store gives nothing that
        does. Local: device, inode, size, and ctime and mtime in nanoseconds (a writer can
        set the mtime back with ``os.utime``, not the ctime; a file replaced by a rename is
        another inode). Remote: the store's VersionId, ETag or digest
        (``remote.STRONG_TAGS``); a modification time alone is not enough."""
        path = self._path(relpath)

        def stat() -> str:
            if self.is_local:
                st = os.stat(path)
                return (
                    f"dev={st.st_dev},ino={st.st_ino},size={st.st_size},"
                    f"ctime_ns={st.st_ctime_ns},mtime_ns={st.st_mtime_ns}"
                )
            return remote.version_tag(self.fs, path)

        return self._call(relpath, None, stat)

    def changed(self, tags: Mapping[str, str]) -> list[str]:
        """The files of ``tags`` (relpath -> its :meth:`version_tag` when a run began)
        whose tag is another now, sorted: rewritten in place while the run read them
        (docs/contract.md §4 "Reload", §1.2 convert). One stat (or HEAD) per file."""
        return [f for f in sorted(tags) if self.version_tag(f) != tags[f]]

    def exists(self, relpath: str) -> bool:
        """Whether ``relpath`` exists. Errors other than "not found" still raise."""
        try:
            self.size(relpath)
        except StorageError as err:
            if err.context.get("not_found"):
                return False
            raise
        return True

    # -- ranges ---------------------------------------------------------------------------

    def read_range(self, relpath: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` (a safetensors header, say), exactly."""
        if start < 0 or length < 0:
            raise ValueError(f"read_range({self.url(relpath)}): negative start or length")
        if length == 0:
            return b""
        path = self._path(relpath)

        def fetch() -> bytes:
            if self.is_local:
                data = local.read_at(path, start, length, self.url(relpath))
            else:
                data = remote.cat_checked(
                    self.fs, path, start, start + length, self._limits(length)
                )
            self.stats.add(bytes_fetched=len(data))
            return data

        return self._call(relpath, (start, length), fetch)

    def read_ranges_into(self, relpath: str, ranges: Sequence[ByteRange], out: Any) -> int:
        """Read the segments of ``ranges``, concatenated in order, into ``out``.

        ``out`` is a writable contiguous buffer of exactly ``sum(r.nbytes)`` bytes (CPU
        memory). Ranges are coalesced into requests under :attr:`policy` (exact for local
        files, gap-bridging with a bounded over-read for remote stores). Returns the
        bytes fetched from storage for this call, over-read included.
        """
        view = as_byte_view(out)
        total = sum(r.nbytes for r in ranges)
        if view.nbytes != total:
            raise ValueError(
                f"read_ranges_into({self.url(relpath)}): output buffer has {view.nbytes} "
                f"bytes, the ranges cover {total}"
            )
        if total == 0:
            return 0
        path = self._path(relpath)
        run = self._runner(relpath)
        if self.reads_ranges_apart:
            return local.read_ranges_apart(path, ranges, view, self.policy, run, self.stats)
        if self.is_local:
            jobs = plan_jobs(ranges, self.policy, None)
            return local.read_jobs(path, jobs, view, run, self.stats)
        jobs = plan_jobs(ranges, self.policy, self.max_request_bytes)
        return remote.read_jobs(
            self.fs, path, jobs, view, run, self.stats, self._get_pool, self._limits
        )

    def _limits(self, nbytes: int) -> dict[str, Any]:
        """Per-request keywords bounding a remote request of ``nbytes`` in all."""
        return remote.request_timeout(self.root_url, self.limits, nbytes)
