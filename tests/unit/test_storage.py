"""The storage seam (workers/storage/): ranged reads over every back end, coalescing,
retries and the errors of docs/contract.md §4 "Streaming" / "Faults".

Expected bytes always come from slicing the source file in the test, never from the code
under test. Servers are loopback only (tests/servers.py); sleeps are injected, so no test
waits for a backoff.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from mxload.orchestrator.errors import CheckpointError, StorageError, UsageError
from mxload.orchestrator.plan.ranges import (
    LOCAL_POLICY,
    REMOTE_POLICY,
    ByteRange,
    CoalescePolicy,
    requested_bytes,
)
from mxload.workers.storage import RetryPolicy, ShortRead, Storage, is_retryable

from tests.servers import Faults, MotoS3, RangeHTTPServer, moto_s3

FILE = "model-00001-of-00001.safetensors"
SIZE = 200_003  # odd on purpose


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(1234).randbytes(SIZE)


@pytest.fixture
def ckpt_dir(tmp_path, data) -> str:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / FILE).write_bytes(data)
    (d / "config.json").write_bytes(b'{"a": 1}')
    return str(d)


@pytest.fixture
def http(ckpt_dir) -> Iterator[RangeHTTPServer]:
    root = os.path.dirname(ckpt_dir)
    with RangeHTTPServer(root) as server:
        yield server


def expected(data: bytes, ranges: list[ByteRange]) -> bytes:
    return b"".join(data[s : s + n] for r in ranges for s, n in r.segments())


# A plan-like mix: a row-strided column window, a contiguous block, an overlapping
# re-read of a small "scale" range, out of file order, a zero-length range.
MIXED = [
    ByteRange(1000, 96, 256, 40),
    ByteRange(150_000, 20_000),
    ByteRange(0, 8),
    ByteRange(1000, 32),  # overlaps the first segment of the strided range
    ByteRange(5, 0),
    ByteRange(199_990, 13),  # up to the last byte
]


# --- back ends --------------------------------------------------------------------------------


def _backend(kind: str, ckpt_dir: str, http: RangeHTTPServer | None = None) -> str:
    if kind == "path":
        return ckpt_dir
    if kind == "file":
        return "file://" + ckpt_dir
    if kind == "memory":
        url = f"memory://mxload-test-{uuid.uuid4().hex}"
        fs = fsspec.filesystem("memory")
        for name in os.listdir(ckpt_dir):
            with open(os.path.join(ckpt_dir, name), "rb") as f:
                fs.pipe(f"{url}/{name}", f.read())
        return url
    assert http is not None
    return http.url + "/ckpt"


@pytest.mark.parametrize("kind", ["path", "file", "memory", "http"])
def test_reads_exact_bytes_on_every_backend(kind, ckpt_dir, http, data):
    st = Storage(_backend(kind, ckpt_dir, http))
    assert st.is_local == (kind in ("path", "file"))
    assert st.policy == (LOCAL_POLICY if st.is_local else REMOTE_POLICY)
    assert st.size(FILE) == SIZE
    assert st.exists(FILE) and st.exists("config.json")
    assert not st.exists("nope.json")
    assert st.read_file("config.json") == b'{"a": 1}'
    assert st.read_range(FILE, 12_345, 678) == data[12_345 : 12_345 + 678]
    out = bytearray(sum(r.nbytes for r in MIXED))
    st.read_ranges_into(FILE, MIXED, out)
    assert bytes(out) == expected(data, MIXED)
    st.close()


@pytest.mark.parametrize("kind", ["path", "memory"])
def test_output_may_be_numpy_or_torch(kind, ckpt_dir, data):
    st = Storage(_backend(kind, ckpt_dir))
    ranges = [ByteRange(64, 16, 48, 10)]
    want = np.frombuffer(expected(data, ranges), dtype=np.uint8)
    arr = np.zeros(160, dtype=np.uint8)
    st.read_ranges_into(FILE, ranges, arr)
    assert np.array_equal(arr, want)
    t = torch.zeros(40, dtype=torch.float32)  # any contiguous CPU tensor: its bytes are filled
    st.read_ranges_into(FILE, ranges, t)
    assert np.array_equal(t.view(torch.uint8).numpy(), want)
    mv = memoryview(bytearray(160))
    st.read_ranges_into(FILE, ranges, mv)
    assert bytes(mv) == want.tobytes()


def test_local_reads_span_rows_under_a_page(ckpt_dir, data):
    """Gaps under a page: one span read, rows gathered; bytes_fetched counts the span."""
    st = Storage(ckpt_dir)
    ranges = [ByteRange(1000, 96, 256, 40), ByteRange(100_000, 5000)]
    out = bytearray(96 * 40 + 5000)
    fetched = st.read_ranges_into(FILE, ranges, out)
    assert fetched == 39 * 256 + 96 + 5000 == requested_bytes(ranges, LOCAL_POLICY)
    assert st.stats.requests == 2
    assert st.stats.bytes_fetched == fetched
    assert bytes(out) == expected(data, ranges)


def test_local_spans_gather_rows_off_page_boundaries(ckpt_dir, data, monkeypatch):
    """Spans starting off a page boundary and ending near the file's end: the right
    bytes, the span counted, one request per block of whole strides."""
    import mxload.workers.storage.local as storage_local

    monkeypatch.setattr(storage_local, "GATHER_BYTES", 1000)  # 1 and 5 rows a block
    st = Storage(ckpt_dir)
    ranges = [ByteRange(5, 96, 768, 7), ByteRange(SIZE - 3 - 40 * 200 - 40, 40, 200, 41)]
    out = bytearray(sum(r.nbytes for r in ranges))
    fetched = st.read_ranges_into(FILE, ranges, out)
    assert bytes(out) == expected(data, ranges)
    assert fetched == requested_bytes(ranges, LOCAL_POLICY) == sum(r.end - r.start for r in ranges)
    assert st.stats.requests == 7 + 9


def test_local_span_past_the_end_of_file_is_a_short_read(ckpt_dir):
    """A span the file does not hold is a clean, retried ShortRead."""
    st = Storage(ckpt_dir, retry=RetryPolicy(attempts=2), sleep=lambda s: None)
    rng = ByteRange(SIZE - 500, 50, 100, 6)  # the last row ends 50 bytes past the end
    with pytest.raises(StorageError, match=r"2 attempts.*short read"):
        st.read_ranges_into(FILE, [rng], bytearray(rng.nbytes))


def test_local_span_reads_in_blocks_and_wide_gaps_row_by_row(ckpt_dir, data, monkeypatch):
    import mxload.workers.storage.local as storage_local

    monkeypatch.setattr(storage_local, "GATHER_BYTES", 1000)  # 3 rows of 300 per block
    st = Storage(ckpt_dir)
    spanned = ByteRange(64, 100, 300, 10)
    wide = ByteRange(3000, 16, 16 + 4096, 5)
    out = bytearray(spanned.nbytes + wide.nbytes)
    fetched = st.read_ranges_into(FILE, [spanned, wide], out)
    assert bytes(out) == expected(data, [spanned, wide])
    assert fetched == (spanned.end - spanned.start) + wide.nbytes
    assert st.stats.requests == 4 + 5  # blocks of 3, 3, 3, 1 rows; one pread per wide row


def test_output_buffer_size_is_checked(ckpt_dir):
    st = Storage(ckpt_dir)
    with pytest.raises(ValueError, match="output buffer has 10 bytes, the ranges cover 11"):
        st.read_ranges_into(FILE, [ByteRange(0, 11)], bytearray(10))
    with pytest.raises(ValueError, match="read-only"):
        st.read_ranges_into(FILE, [ByteRange(0, 4)], b"1234")


def test_concurrent_callers_share_one_storage(ckpt_dir, http, data):
    st = Storage(http.url + "/ckpt")
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(5):
            start = rng.randrange(0, SIZE - 5000)
            ranges = [ByteRange(start, 100, 300, 10)]
            out = bytearray(1000)
            try:
                st.read_ranges_into(FILE, ranges, out)
                assert bytes(out) == expected(data, ranges)
            except BaseException as exc:  # collected: asserting in threads is silent
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_storage_pickles_and_reads_the_same(ckpt_dir, data):
    st = Storage(ckpt_dir, retry=RetryPolicy(attempts=2))
    copy = pickle.loads(pickle.dumps(st))
    assert copy.retry == RetryPolicy(attempts=2) and copy.root_url == ckpt_dir
    assert copy.read_range(FILE, 7, 9) == data[7:16]


@pytest.mark.parametrize(
    "bad", ["../secrets", "/etc/passwd", "", "a/../../b", "x\\..\\y", "s3://b/k"]
)
def test_paths_outside_the_root_are_refused(ckpt_dir, bad):
    st = Storage(ckpt_dir)
    with pytest.raises(CheckpointError, match="refusing file name"):
        st.read_file(bad)


@pytest.mark.parametrize("scheme", ["nosuchproto", "ftp", "sftp"])
def test_unknown_or_unsupported_protocol_is_bad_input_before_any_connection(scheme):
    """``ftp://x`` used to look the host up and fail with a raw gaierror (exit 1). Now
    the URL is refused by its scheme, naming it, and nothing is contacted: the listening
    loopback socket sees no connection."""
    from tests.servers import SilentServer

    with SilentServer() as server:
        url = f"{scheme}://127.0.0.1:{server.port}/ck"
        with pytest.raises(
            UsageError, match=f"{scheme}://127.0.0.1:{server.port}/ck: unsupported"
        ) as info:
            Storage(url)
        time.sleep(0.2)
        assert server.connections == 0
    assert info.value.exit_code == 2


def test_empty_location_is_bad_input():
    with pytest.raises(UsageError, match="empty path") as info:
        Storage("")
    assert info.value.exit_code == 2


# --- a checkpoint is a folder -----------------------------------------------------------------

SECRET = b"\x05\x00\x00\x00\x00\x00\x00\x00TOPSECRET-hash$6$abcdefgh"


def test_symlink_out_of_the_checkpoint_is_refused_before_reading(tmp_path):
    """A shard symlinked to a file outside the folder (a system file, say) is refused
    naming the link, before any byte of the target is read; --allow-outside-links
    (the storage option) lifts it."""
    root = tmp_path / "ck"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    (root / "model.safetensors").symlink_to(secret)
    (root / "inside").write_bytes(b"ok")
    (root / "alias").symlink_to(root / "inside")  # a link that stays inside is fine
    st = Storage(str(root))
    for call in (
        lambda: st.read_file("model.safetensors"),
        lambda: st.size("model.safetensors"),
        lambda: st.read_range("model.safetensors", 0, 8),
        lambda: st.read_ranges_into("model.safetensors", [ByteRange(0, 8)], bytearray(8)),
    ):
        with pytest.raises(CheckpointError, match="outside the checkpoint folder") as info:
            call()
        msg = str(info.value)
        assert "model.safetensors" in msg and "--allow-outside-links" in msg
        assert "TOPSECRET" not in msg and "abcdefgh" not in msg
        assert info.value.exit_code == 2
    assert st.stats.bytes_fetched == 0
    assert st.read_file("alias") == b"ok"
    allowed = Storage(str(root), {"mxload_allow_outside_links": True})
    assert allowed.read_file("model.safetensors") == SECRET


def test_symlinked_root_is_its_own_folder(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "f").write_bytes(b"xyz")
    (tmp_path / "via").symlink_to(real)
    assert Storage(str(tmp_path / "via")).read_file("f") == b"xyz"


# --- timeouts -----------------------------------------------------------------------------------


def _read_from_silent_server(
    root: Callable[[str], str], options: Callable[[str], dict[str, Any]]
) -> tuple[str, str, list[float], int]:
    """One read from a server that accepts and never answers, through ``Storage`` with
    0.3 s timeouts and 3 attempts (backoff sleeps injected, so the wait is attempts x
    timeout). ``root``/``options`` of the server's URL. Returns the storage root, the
    error's text, the sleeps and the connections the server saw."""
    from tests.servers import SilentServer

    slept: list[float] = []
    with SilentServer() as server:
        url = root(server.url)
        st = Storage(
            url,
            {**options(server.url), "mxload_connect_timeout_s": 0.3, "mxload_read_timeout_s": 0.3},
            retry=RetryPolicy(attempts=3),
            sleep=slept.append,
        )
        with pytest.raises(StorageError) as info:
            st.read_range("model.safetensors", 0, 8)
        connections = server.connections
    return url, str(info.value), slept, connections


@pytest.mark.timeout(120)  # a hang guard: without timeouts this waits 3 x 300 s
def test_silent_server_fails_in_bounded_time_naming_the_url(capfd):
    """A server that accepts and never answers: every attempt times out, the retries are
    bounded, and the error names the URL."""
    url, msg, slept, connections = _read_from_silent_server(lambda u: u + "/ck", lambda u: {})
    assert url + "/model.safetensors" in msg
    assert "3 attempts" in msg and "Timeout" in msg
    assert len(slept) == 2
    assert connections >= 1
    assert "no answer" not in capfd.readouterr().err, "quiet when stderr is not a terminal"


@pytest.mark.timeout(120)  # a hang guard: botocore's own default read timeout is 60 s
def test_silent_s3_endpoint_fails_in_bounded_time_naming_the_url():
    """The same silent server as an S3 endpoint: mxload's timeouts reach botocore
    (``config_kwargs``), botocore makes one attempt per request, and the seam's retries
    are bounded and named in the error."""
    _, msg, slept, connections = _read_from_silent_server(
        lambda u: "s3://mxload-test/ck",
        lambda u: {"endpoint_url": u, "key": "testing", "secret": "testing"},
    )
    assert "s3://mxload-test/ck/model.safetensors" in msg
    assert "3 attempts" in msg and "timeout" in msg.lower(), msg
    assert len(slept) == 2
    # one connection per attempt: botocore retried nothing on its own (with its default
    # 60 s read timeout, three attempts would outlast the test's 120 s guard)
    assert connections == 3, connections


@pytest.mark.timeout(120)
def test_a_stall_is_logged_as_a_warning_naming_the_url(caplog):
    """Each timed-out attempt that will be tried again is a warning naming the URL (the
    command line shows warnings by default), so a stall does not look like a hang."""
    import logging

    from tests.servers import SilentServer

    caplog.set_level(logging.WARNING, logger="mxload.workers.storage.retry")
    with SilentServer() as server:
        st = Storage(
            server.url + "/ck",
            {"mxload_connect_timeout_s": 0.2, "mxload_read_timeout_s": 0.2},
            retry=RetryPolicy(attempts=2),
            sleep=lambda s: None,
        )
        with pytest.raises(StorageError):
            st.read_file("config.json")
    shown = caplog.text
    assert f"{server.url}/ck/config.json: no answer in time (attempt 1 of 2)" in shown


@pytest.mark.parametrize(
    "options",
    [
        {"mxload_read_timeout_s": 0},
        {"mxload_read_timeout_s": 61},
        {"mxload_connect_timeout_s": "10"},
        {"mxload_connect_timeout_s": True},
    ],
)
def test_timeouts_out_of_range_are_refused_naming_the_flag(options):
    with pytest.raises(UsageError, match=r"--(read|connect)-timeout") as info:
        Storage("http://127.0.0.1:9/ck", options)
    assert info.value.exit_code == 2


def test_mxload_options_never_reach_fsspec(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    st = Storage(
        f"file://{tmp_path}",
        {"mxload_read_timeout_s": 5, "mxload_allow_outside_links": False},
    )
    assert st.read_file("f") == b"abc"
    assert st.read_timeout_s == 5


def test_subdirectories_are_allowed(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"xyz")
    assert Storage(str(tmp_path)).read_file("sub/f") == b"xyz"


# --- coalescing -------------------------------------------------------------------------------


def _parse_range(header: str) -> tuple[int, int]:
    a, b = header.removeprefix("bytes=").split("-")
    return int(a), int(b) + 1


def test_remote_coalescing_cuts_requests_within_the_overread_bound(http, data):
    # 64 rows of 100 bytes every 110 bytes: 10-byte holes (9% of each row).
    strided = ByteRange(10_000, 100, 110, 64)
    url = http.url + "/ckpt"

    exact = Storage(url, policy=CoalescePolicy(max_gap_bytes=0, max_overread_ratio=1.0))
    out = bytearray(strided.nbytes)
    assert exact.read_ranges_into(FILE, [strided], out) == strided.nbytes
    assert bytes(out) == expected(data, [strided])
    assert len(http.requests("GET", f"ckpt/{FILE}")) == 64
    http.clear_log()

    st = Storage(url)  # REMOTE_POLICY
    out = bytearray(strided.nbytes)
    fetched = st.read_ranges_into(FILE, [strided], out)
    assert bytes(out) == expected(data, [strided])
    reqs = http.requests("GET", f"ckpt/{FILE}")
    assert 1 <= len(reqs) < 64
    assert st.stats.requests == len(reqs)
    segments = list(strided.segments())
    total = 0
    for rec in reqs:
        a, b = _parse_range(rec.range)
        needed = sum(max(0, min(b, s + n) - max(a, s)) for s, n in segments)
        assert (b - a) <= REMOTE_POLICY.max_overread_ratio * needed, rec
        total += b - a
    assert fetched == total == st.stats.bytes_fetched
    assert fetched <= 1.25 * strided.nbytes


def test_remote_does_not_bridge_big_holes(http, data):
    sparse = ByteRange(0, 100, 1000, 20)  # 90% holes: bridging would exceed 1.25x
    st = Storage(http.url + "/ckpt")
    out = bytearray(sparse.nbytes)
    assert st.read_ranges_into(FILE, [sparse], out) == sparse.nbytes
    assert bytes(out) == expected(data, [sparse])
    assert len(http.requests("GET")) == 20


def test_large_requests_are_split(http, data):
    block = ByteRange(3, 100_000)
    st = Storage(http.url + "/ckpt", max_request_bytes=30_000)
    out = bytearray(block.nbytes)
    assert st.read_ranges_into(FILE, [block], out) == 100_000
    assert bytes(out) == data[3:100_003]
    # The server logs a request after its body is sent: the client may be done first.
    deadline = time.monotonic() + 5
    while len(http.requests("GET")) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = sorted(_parse_range(r.range) for r in http.requests("GET"))
    assert spans == [(3, 30_003), (30_003, 60_003), (60_003, 90_003), (90_003, 100_003)]


# --- retries ----------------------------------------------------------------------------------


def test_flaky_server_succeeds_and_counts_its_retries(ckpt_dir, http, data):
    http.faults = Faults(fail_fraction=0.3, cut_fraction=0.2)
    sleeps: list[float] = []
    # Many attempts: with concurrent requests, a retry can land on another failure slot.
    policy = RetryPolicy(attempts=30, initial_backoff_s=0.01, max_backoff_s=0.5)
    st = Storage(http.url + "/ckpt", retry=policy, sleep=sleeps.append)
    ranges = [*MIXED, ByteRange(20_000, 50, 1000, 60)]
    out = bytearray(sum(r.nbytes for r in ranges))
    st.read_ranges_into(FILE, ranges, out)
    assert bytes(out) == expected(data, ranges)
    injected = http.injected_failures + http.injected_cuts
    assert http.injected_failures > 0 and http.injected_cuts > 0
    assert st.stats.retries == injected == len(sleeps)
    assert st.stats.requests == len(http.requests("GET"))
    assert all(0 < s <= 0.5 for s in sleeps)


def test_fail_first_is_retried_exactly(ckpt_dir, http, data):
    http.faults = Faults(fail_first=2)
    sleeps: list[float] = []
    st = Storage(http.url + "/ckpt", retry=RetryPolicy(attempts=3), sleep=sleeps.append)
    ranges = [ByteRange(0, 100, 5000, 4)]  # four separate requests
    out = bytearray(400)
    st.read_ranges_into(FILE, ranges, out)
    assert bytes(out) == expected(data, ranges)
    assert st.stats.requests == 12 and st.stats.retries == 8
    assert len(sleeps) == 8


def test_permanent_failure_names_url_and_range_after_exactly_attempts(http):
    http.faults = Faults(broken=True, broken_status=503)
    sleeps: list[float] = []
    policy = RetryPolicy(attempts=4, initial_backoff_s=0.1, max_backoff_s=0.25)
    st = Storage(http.url + "/ckpt", retry=policy, sleep=sleeps.append)
    with pytest.raises(StorageError) as info:
        st.read_ranges_into(FILE, [ByteRange(1000, 500)], bytearray(500))
    err = info.value
    url = f"{http.url}/ckpt/{FILE}"
    assert url in str(err) and "bytes 1000-1499" in str(err)
    assert "4 attempts" in str(err) and "503" in str(err)
    assert err.file == url and err.byte_range == "bytes 1000-1499" and err.attempts == 4
    assert err.exit_code == 1
    assert len(http.requests("GET")) == 4
    # capped exponential backoff, jitter in [0.5, 1] of the base: bases 0.1, 0.2, 0.25
    assert len(sleeps) == 3
    for s, base in zip(sleeps, [0.1, 0.2, 0.25], strict=True):
        assert 0.5 * base <= s <= base
    # errors cross process boundaries
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is StorageError and again.byte_range == "bytes 1000-1499"


def test_404_is_not_retried(http):
    http.faults = Faults(not_found=frozenset({f"ckpt/{FILE}"}))
    sleeps: list[float] = []
    st = Storage(http.url + "/ckpt", sleep=sleeps.append)
    with pytest.raises(StorageError, match="not found") as info:
        st.read_range(FILE, 0, 10)
    assert info.value.not_found is True and info.value.attempts == 1
    assert len(http.requests("GET")) == 1 and sleeps == []
    assert st.exists(FILE) is False


@pytest.mark.parametrize("status", [403, 400, 416])
def test_client_errors_are_not_retried(http, status):
    http.faults = Faults(broken=True, broken_status=status)
    sleeps: list[float] = []
    st = Storage(http.url + "/ckpt", sleep=sleeps.append)
    with pytest.raises(StorageError, match=f"1 attempt .not retryable.*{status}"):
        st.read_range(FILE, 0, 10)
    assert len(http.requests("GET")) == 1 and sleeps == []


def test_429_is_retried(http):
    http.faults = Faults(fail_first=1, fail_statuses=(429,))
    st = Storage(http.url + "/ckpt", sleep=lambda s: None)
    assert len(st.read_range(FILE, 0, 10)) == 10
    assert st.stats.retries == 1


def test_server_ignoring_range_is_an_error_not_wrong_bytes(http):
    http.faults = Faults(ignore_range=True)
    st = Storage(http.url + "/ckpt", sleep=lambda s: None)
    with pytest.raises(StorageError, match="does not honour HTTP Range"):
        st.read_range(FILE, 10, 10)
    assert len(http.requests("GET")) == 1


def test_size_survives_transient_errors(http):
    http.faults = Faults(fail_first=1)
    st = Storage(http.url + "/ckpt", sleep=lambda s: None)
    assert st.size(FILE) == SIZE


def test_missing_local_file(ckpt_dir):
    sleeps: list[float] = []
    st = Storage(ckpt_dir, sleep=sleeps.append)
    with pytest.raises(StorageError, match="not found") as info:
        st.read_ranges_into("nope.safetensors", [ByteRange(0, 4)], bytearray(4))
    assert info.value.file == os.path.join(ckpt_dir, "nope.safetensors")
    assert info.value.attempts == 1 and sleeps == []
    with pytest.raises(StorageError, match="not found"):
        st.size("nope.safetensors")


def test_local_short_read_is_retried_then_named(ckpt_dir):
    sleeps: list[float] = []
    st = Storage(ckpt_dir, retry=RetryPolicy(attempts=3), sleep=sleeps.append)
    with pytest.raises(StorageError, match=r"bytes 199990-200009.*3 attempts.*short read"):
        st.read_ranges_into(FILE, [ByteRange(199_990, 20)], bytearray(20))
    assert len(sleeps) == 2


def test_retry_policy_is_validated_and_pure():
    for bad in (dict(attempts=0), dict(initial_backoff_s=-1.0), dict(max_backoff_s=0.01)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
    p = RetryPolicy(attempts=5, initial_backoff_s=0.05, max_backoff_s=2.0)
    assert p.backoff(3, "k") == p.backoff(3, "k")
    assert 0.1 <= p.backoff(3, "k") <= 0.2
    assert 1.0 <= p.backoff(30, "k") <= 2.0  # capped
    keys = {p.backoff(2, f"url{i}") for i in range(20)}
    assert len(keys) > 1  # jitter decorrelates requests


# --- classification table ---------------------------------------------------------------------


def _aiohttp_status(status: int) -> BaseException:
    import aiohttp

    return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]


def _boto(code: str, status: int) -> BaseException:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


def _s3fs_translated(code: str, status: int) -> BaseException:
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_boto(code, status))


def _payload() -> BaseException:
    import aiohttp

    return aiohttp.ClientPayloadError("Response payload is not completed")


def _disconnected() -> BaseException:
    import aiohttp

    return aiohttp.ServerDisconnectedError()


def _fsspec_http_size_503() -> BaseException:
    # fsspec's HTTP size lookup raises FileNotFoundError from whatever its GET raised.
    try:
        try:
            raise _aiohttp_status(503)
        except Exception as inner:
            raise FileNotFoundError("http://x/f") from inner
    except FileNotFoundError as outer:
        return outer


CLASSIFICATION = {
    # name: (exception factory, retryable?)
    "http_500": (lambda: _aiohttp_status(500), True),
    "http_503": (lambda: _aiohttp_status(503), True),
    "http_429": (lambda: _aiohttp_status(429), True),
    "http_404": (lambda: _aiohttp_status(404), False),
    "http_403": (lambda: _aiohttp_status(403), False),
    "http_416": (lambda: _aiohttp_status(416), False),
    "cut_body": (_payload, True),
    "server_disconnected": (_disconnected, True),
    "connection_reset": (lambda: ConnectionResetError(errno.ECONNRESET, "reset"), True),
    "timeout": (lambda: TimeoutError("timed out"), True),
    "short_read": (lambda: ShortRead("short read"), True),
    "file_not_found": (lambda: FileNotFoundError("x"), False),
    "permission": (lambda: PermissionError("x"), False),
    "eio": (lambda: OSError(errno.EIO, "I/O error"), True),
    "einval": (lambda: OSError(errno.EINVAL, "bad"), False),
    "s3_slowdown": (lambda: _boto("SlowDown", 503), True),
    "s3_internal": (lambda: _boto("InternalError", 500), True),
    "s3_nosuchkey": (lambda: _boto("NoSuchKey", 404), False),
    "s3_access_denied": (lambda: _boto("AccessDenied", 403), False),
    "s3fs_slowdown": (lambda: _s3fs_translated("SlowDown", 503), True),
    "s3fs_nosuchkey": (lambda: _s3fs_translated("NoSuchKey", 404), False),
    "s3fs_access_denied": (lambda: _s3fs_translated("AccessDenied", 403), False),
    "fsspec_http_size_503": (_fsspec_http_size_503, True),
    "value_error": (lambda: ValueError("bug"), False),
}


@pytest.mark.parametrize("name", sorted(CLASSIFICATION))
def test_classification(name):
    factory, retryable = CLASSIFICATION[name]
    assert is_retryable(factory()) is retryable, name


# --- S3 (moto, loopback) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with moto_s3() as server:
        yield server


def test_s3_reads_through_storage_options(s3, ckpt_dir, data):
    url = s3.upload_dir(ckpt_dir, "mxload-test", f"ck-{uuid.uuid4().hex}")
    assert s3.endpoint_url.startswith("http://127.0.0.1:")
    st = Storage(url, s3.storage_options)
    assert not st.is_local and st.policy == REMOTE_POLICY
    assert st.size(FILE) == SIZE
    assert st.read_file("config.json") == b'{"a": 1}'
    out = bytearray(sum(r.nbytes for r in MIXED))
    st.read_ranges_into(FILE, MIXED, out)
    assert bytes(out) == expected(data, MIXED)
    assert st.exists(FILE) and not st.exists("nope.json")
    with pytest.raises(StorageError, match="not found") as info:
        st.read_range("nope.json", 0, 4)
    assert info.value.file == f"{url}/nope.json" and info.value.attempts == 1
    # s3fs and botocore make one attempt each: retrying is the seam's job only
    assert st.fs.retries == 1


@pytest.mark.parametrize(
    "location,remote,path",
    [
        ("/ckpt/m", False, "/ckpt/m"),
        ("rel/m", False, "rel/m"),
        ("file:///ckpt/m", False, "/ckpt/m"),
        ("local:///ckpt/m", False, "/ckpt/m"),
        ("memory://ckpt/m", True, "memory://ckpt/m"),
        ("s3://bucket/m", True, "s3://bucket/m"),
        ("https://host/m", True, "https://host/m"),
    ],
)
def test_one_answer_to_is_this_location_remote(location, remote, path):
    """The one is-remote test every caller uses (CLI checks, planner inputs, outputs,
    the writer); it agrees with what Storage opens: fsspec's local file system or not."""
    from mxload.workers.storage import is_remote, local_path

    assert is_remote(location) is remote
    assert local_path(location) == path
    if not location.startswith(("s3", "https")):  # no connection needed to open these
        assert Storage(location).is_local is not remote
