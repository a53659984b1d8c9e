"""Loopback storage servers for tests: an HTTP server with Range and fault injection, and S3.

Everything binds 127.0.0.1 on a free port (tests touch no other network, STYLE/rules).

* :class:`RangeHTTPServer` serves a directory over HTTP/1.1 (keep-alive, ``HEAD`` with
  ``Content-Length``, single ``Range: bytes=a-b`` / ``a-`` / ``-n`` requests answered 206)
  and injects faults on demand (:class:`Faults`): a deterministic fraction of requests
  answered 500/503, the first ``n`` tries of every distinct request answered so, a
  fraction of bodies cut mid-way (full ``Content-Length`` announced, half sent, connection
  closed), paths that always 404, a "permanently broken" mode, and a server that ignores
  ``Range``. Fractions are deterministic (request number ``i`` is hit
  when ``floor((i+1)*f) > floor(i*f)``), so hits are spread evenly and never consecutive
  for ``f < 0.5`` in a sequential client (a concurrent client's retries land on arbitrary
  slots: give it enough attempts, or use ``fail_first``, which is exact). ``latency``
  delays every answer (an object store's time to first byte). ``bandwidth``
  throttles what it sends in all (bytes/s over every connection: a store's aggregate
  limit, for the time model's checks in ``bench/``). It records
  every request (method, path, Range header, outcome) and counts injected faults, so tests
  can compare a client's retry count with what the server actually did.
* :class:`MotoS3` runs moto's S3 in server mode (``ThreadedMotoServer``) on 127.0.0.1,
  with fake credentials set in the environment only while it runs; :meth:`MotoS3.upload_dir`
  copies a local directory into a bucket; :attr:`MotoS3.storage_options` is what
  ``--storage-options`` would carry.

Use the context managers (:func:`serve_directory`, :func:`moto_s3`), or the fixtures at the
bottom once a root ``conftest.py`` registers this module (``pytest_plugins =
["tests.servers"]``); importing a fixture by name into a test module trips ruff's F811.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

LOOPBACK = "127.0.0.1"

# --- HTTP ------------------------------------------------------------------------------------


@dataclass
class Faults:
    """What the HTTP server does wrong. Mutable: a test may change it between requests."""

    fail_fraction: float = 0.0
    """Fraction of requests (GET and HEAD) answered with an error status, spread evenly."""
    fail_statuses: tuple[int, ...] = (503, 500)
    """Statuses used for ``fail_fraction``, in turn."""
    cut_fraction: float = 0.0
    """Fraction of successful GETs whose body is cut half-way (connection closed)."""
    fail_first: int = 0
    """Each distinct request (method, path, Range) fails its first ``fail_first`` times
    (statuses from ``fail_statuses``): deterministic however requests interleave."""
    not_found: frozenset[str] = frozenset()
    """Paths (relative to the served root, no leading slash) that always get 404."""
    data_gone: frozenset[str] = frozenset()
    """Paths whose data section is gone for good (403), while the safetensors header
    (``Range`` starting at byte 0 or 8) and HEAD still answer: storage failing after a
    run was planned."""
    broken: bool = False
    """Every request gets ``broken_status``: storage that is gone for good."""
    broken_status: int = 503
    ignore_range: bool = False
    """Answer ``Range`` requests with 200 and the whole file (a misbehaving server)."""
    etag: bool = False
    """Send an ETag (from the file's inode, size and ctime) as most stores do; a plain
    server (the default here) sends neither ETag nor Last-Modified."""
    drip_s: float = 0.0
    """Send each body one byte every ``drip_s`` seconds: a server that never stalls long
    enough for a read timeout, and never finishes."""


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    """Relative to the served root, no leading slash."""
    range: str | None
    """The ``Range`` header as sent, or None."""
    outcome: str
    """``ok``, ``fail:<status>``, ``cut``, ``404``, ``broken:<status>``, ``416``, ``drip``."""


def _hit(counter: int, fraction: float) -> bool:
    return fraction > 0 and math.floor((counter + 1) * fraction) > math.floor(counter * fraction)


@dataclass
class _State:
    root: str
    faults: Faults
    lock: threading.Lock = field(default_factory=threading.Lock)
    log: list[RequestRecord] = field(default_factory=list)
    n_requests: int = 0
    n_gets_ok: int = 0
    injected_failures: int = 0
    injected_cuts: int = 0
    seen: dict[tuple[str, str, str | None], int] = field(default_factory=dict)
    bandwidth: float = 0.0
    """Bytes/s the server sends in all, over every connection (0 = unthrottled)."""
    latency: float = 0.0
    """Seconds each request waits before it is answered (an object store's time to first
    byte; requests on other connections wait at the same time)."""
    next_free: float = 0.0
    """Throttle: when the link is free again (time.monotonic())."""
    bytes_sent: int = 0
    """Body bytes sent by successful GETs."""

    def throttle(self, nbytes: int) -> None:
        """Wait for ``nbytes`` of the shared link: concurrent requests queue for it, so
        the server as a whole sends ``bandwidth`` bytes/s (a store's aggregate limit)."""
        if self.bandwidth <= 0:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + nbytes / self.bandwidth
            wait = self.next_free - now
        time.sleep(wait)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like real object stores
    # Headers and body go out in two writes; with Nagle on, the body of a small response
    # waits for the client's delayed ACK of the headers: ~40 ms per request, which no
    # real store adds (the time-model bench measured 44 ms per 64-byte request).
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet tests

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _empty(self, status: int, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _record(self, rel: str, rng: str | None, outcome: str) -> None:
        state = self.server.state
        with state.lock:
            state.log.append(RequestRecord(self.command, rel, rng, outcome))

    def _serve(self, *, head: bool) -> None:
        state = self.server.state
        if state.latency > 0:
            time.sleep(state.latency)
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        rng = self.headers.get("Range")
        with state.lock:
            faults = state.faults
            i = state.n_requests
            state.n_requests += 1
            fail = _hit(i, faults.fail_fraction)
            key = (self.command, rel, rng)
            state.seen[key] = state.seen.get(key, 0) + 1
            fail = fail or state.seen[key] <= faults.fail_first
        if faults.broken:
            self._record(rel, rng, f"broken:{faults.broken_status}")
            return self._empty(faults.broken_status)
        if rel in faults.not_found:
            self._record(rel, rng, "404")
            return self._empty(404)
        if rel in faults.data_gone and self.command == "GET" and rng is not None:
            first = rng.removeprefix("bytes=").split("-", 1)[0]
            if first not in ("0", "8"):
                self._record(rel, rng, "403")
                return self._empty(403)
        if fail:
            with state.lock:
                status = faults.fail_statuses[state.injected_failures % len(faults.fail_statuses)]
                state.injected_failures += 1
            self._record(rel, rng, f"fail:{status}")
            return self._empty(status)

        full = os.path.realpath(os.path.join(state.root, rel))
        root = os.path.realpath(state.root)
        if not (full == root or full.startswith(root + os.sep)) or not os.path.isfile(full):
            self._record(rel, rng, "404")
            return self._empty(404)
        size = os.path.getsize(full)
        start, end, status = 0, size, 200
        if rng is not None and not faults.ignore_range:
            parsed = _parse_range(rng, size)
            if parsed is None:
                self._record(rel, rng, "416")
                return self._empty(416, {"Content-Range": f"bytes */{size}"})
            start, end = parsed
            status = 206
        length = end - start
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        if faults.etag:
            st = os.stat(full)
            self.send_header("ETag", f'"{st.st_ino:x}-{st.st_size:x}-{st.st_ctime_ns:x}"')
        # Every request is logged before its last byte leaves: a client that has its
        # whole response must find it in the log (with TCP_NODELAY it can get there
        # before this thread runs another line).
        if head:
            self._record(rel, rng, "ok")
            self.end_headers()
            return None
        self.end_headers()
        with open(full, "rb") as f:
            f.seek(start)
            body = f.read(length)
        with state.lock:
            cut = length > 1 and _hit(state.n_gets_ok, faults.cut_fraction)
            state.n_gets_ok += 1
            if cut:
                state.injected_cuts += 1
        if cut:
            self.wfile.write(body[: length // 2])
            self.wfile.flush()
            self.close_connection = True
            self._record(rel, rng, "cut")
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if faults.drip_s > 0:
            self._record(rel, rng, "drip")
            for i in range(len(body)):
                try:
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                except OSError:  # the client gave up: what a drip test waits for
                    return None
                time.sleep(faults.drip_s)
            return None
        chunks = [body[lo : lo + _THROTTLE_CHUNK] for lo in range(0, len(body), _THROTTLE_CHUNK)]
        for n, chunk in enumerate(chunks or [b""]):
            if state.bandwidth > 0:  # throttled: the link's share, chunk by chunk
                state.throttle(len(chunk))
            if n == len(chunks) - 1 or not chunks:  # the last: log it, then send it
                with state.lock:
                    state.bytes_sent += len(body)
                self._record(rel, rng, "ok")
            self.wfile.write(chunk)
        return None


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single ``bytes=`` range, or None if unsatisfiable/unsupported."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return (max(0, size - n), size) if n > 0 else None
        start = int(first)
        end = size if last == "" else min(int(last) + 1, size)
    except ValueError:
        return None
    if start >= size or end <= start:
        return None
    return start, end


_THROTTLE_CHUNK = 64 << 10


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a client opening 16 connections at once must not hit SYN retries
    state: _State


class RangeHTTPServer:
    """Serves ``root`` at ``http://127.0.0.1:<port>/`` (see module doc)."""

    def __init__(
        self,
        root: str,
        faults: Faults | None = None,
        *,
        bandwidth: float = 0.0,
        latency: float = 0.0,
    ) -> None:
        self._server = _Server((LOOPBACK, 0), _Handler)
        self._server.state = _State(
            root=root, faults=faults or Faults(), bandwidth=bandwidth, latency=latency
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # quick shutdown
            name="range-http",
            daemon=True,
        )

    @property
    def state(self) -> _State:
        return self._server.state

    @property
    def faults(self) -> Faults:
        return self._server.state.faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        with self.state.lock:
            self.state.faults = value

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, no trailing slash: a checkpoint in ``root/ck`` is ``url + "/ck"``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def log(self) -> list[RequestRecord]:
        with self.state.lock:
            return list(self.state.log)

    def requests(self, method: str = "GET", path: str | None = None) -> list[RequestRecord]:
        return [r for r in self.log if r.method == method and (path is None or r.path == path)]

    @property
    def injected_failures(self) -> int:
        return self.state.injected_failures

    @property
    def injected_cuts(self) -> int:
        return self.state.injected_cuts

    def clear_log(self) -> None:
        with self.state.lock:
            self.state.log.clear()

    def start(self) -> RangeHTTPServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> RangeHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_directory(root: str, faults: Faults | None = None) -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(root, faults) as server:
        yield server


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (a hung server, a black-hole
    proxy): every socket stays open, unread, until :meth:`stop`. Counts the connections."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((LOOPBACK, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port = int(self._sock.getsockname()[1])
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent", daemon=True)
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(conn)
            self.connections += 1

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for c in self._held:
            c.close()
        self._sock.close()


# --- S3 (moto) -----------------------------------------------------------------------------

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # never read the developer's real configuration or credentials
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoS3:
    """moto's S3 in server mode on 127.0.0.1; fake credentials in the env while running."""

    key = "testing"
    secret = "testing"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        self._saved_env: dict[str, str | None] = {}
        self.endpoint_url = ""

    def start(self) -> MotoS3:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        self._saved_env = {k: os.environ.get(k) for k in _AWS_ENV}
        os.environ.update(_AWS_ENV)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        try:
            self._server.stop()
        finally:
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def storage_options(self) -> dict[str, str]:
        """What ``--storage-options`` carries for this server (s3fs keywords)."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret}

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
        )

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload_dir(self, local_dir: str, bucket: str, prefix: str = "") -> str:
        """Copy the files of ``local_dir`` (recursively) to ``s3://bucket/prefix``; the
        bucket is created if needed. Returns the ``s3://`` URL of the copy."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        prefix = prefix.strip("/")
        for dirpath, _, files in os.walk(local_dir):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
                key = f"{prefix}/{rel}" if prefix else rel
                client.upload_file(path, bucket, key)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


@contextlib.contextmanager
def moto_s3() -> Iterator[MotoS3]:
    with MotoS3() as s3:
        yield s3


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[object]:
    """Factory: ``http_server(root, faults=None) -> RangeHTTPServer`` (stopped at teardown)."""
    started: list[RangeHTTPServer] = []

    def make(root: str, faults: Faults | None = None) -> RangeHTTPServer:
        server = RangeHTTPServer(root, faults).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def s3_server() -> Iterator[MotoS3]:
    """A running :class:`MotoS3` (module-scoped use: wrap :func:`moto_s3` yourself)."""
    with moto_s3() as s3:
        yield s3
