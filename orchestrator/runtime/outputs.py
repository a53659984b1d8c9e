"""Where mxload writes: output paths checked before any work, folders replaced whole.

Why: a user's earlier output must never be lost to a later run that fails, and a run must
not spend an hour loading only to find that ``--report`` cannot be written. Every output
of mxload goes through this module:

* **files** (``--report FILE``): :func:`check_file_target` before any work (the parent
  folder exists and takes a new file, the path is not a folder), then
  :func:`write_file_atomic`: a temporary file beside the target, renamed over it only once
  it is complete, so the old report stays whole if the new one cannot be written.
* **folders** (``--dump DIR``, ``convert``'s ``DST``): :class:`OutputDir`. The target is
  checked first (:meth:`OutputDir.check`): its parent exists and is writable; a target
  that exists and is not an empty folder is refused unless ``overwrite``. Everything is
  written into a fresh temporary folder beside the target (same file system, mode 0700
  while it is written); :meth:`OutputDir.commit` renames it into place only when the
  writer succeeded. With ``overwrite`` the old folder is first renamed aside and removed
  only after the new one is in place, so the result is always one whole run's files,
  never a mix of shard sets, and a failure before commit leaves the old folder untouched.
  :meth:`OutputDir.discard` (or leaving the ``with`` block with an exception) removes the
  temporary folder.
* **a full disk** (ENOSPC, EDQUOT), a read-only file system, a denied write: an
  :class:`~orchestrator.errors.OutputError` (exit status 2) naming the path and the flag,
  raised after the temporary files are removed.

Limits: on a local file system the final rename of a new folder is atomic; with
``overwrite`` there is a moment between the two renames when the target does not exist
(the old folder is then beside it, named ``.NAME.mxload-old-*``, and is put back if the
second rename fails). Object stores (``s3://``, ``memory://``...) have no rename: the
temporary prefix is moved (copied) into place after the old target is removed, so a crash
during that move can leave the target incomplete; a failure before it never touches the
target.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from ...workers.storage.urls import PROTOCOLS, is_remote, local_path, protocol
from ..errors import OutputError, SessionError

_DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large",
}
"""OSErrors that mean "this output location cannot take the files", by errno."""

_TMP_TAG = ".mxload-tmp-"
_OLD_TAG = ".mxload-old-"


def output_error(exc: OSError, path: str, flag: str, *, doing: str = "writing") -> OutputError:
    """An OSError met while writing ``path`` as the user-facing error (names path and flag)."""
    reason = _DISK_ERRNOS.get(exc.errno or 0) or (exc.strerror or type(exc).__name__)
    where = exc.filename if isinstance(exc.filename, str) and exc.filename else path
    return OutputError(f"{flag} {path}: {doing} {where} failed: {reason}", file=path, key=flag)


def is_disk_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an OSError about the output location (full, read-only, denied)."""
    return isinstance(exc, OSError) and (exc.errno or 0) in _DISK_ERRNOS


# --- files -------------------------------------------------------------------------------------


def check_file_target(path: str | None, flag: str) -> None:
    """Refuse, before any work, a file output that cannot be written (OutputError)."""
    if path is None:
        return
    if not path:
        raise OutputError(f"{flag}: an empty path", key=flag)
    if is_remote(path):
        raise OutputError(f"{flag} {path}: must be a local path", file=path, key=flag)
    p = _through_link(local_path(path))
    check_not_input(path, flag, own_state())
    if os.path.isdir(p):
        raise OutputError(f"{flag} {path}: is a folder; give a file name", file=path, key=flag)
    if os.path.lexists(p) and not os.path.isfile(p):
        # The rename would replace a device, FIFO or socket (as root, /dev/null itself).
        raise OutputError(
            f"{flag} {path}: exists and is not a regular file (a device, FIFO or socket); "
            "give a file name",
            file=path,
            key=flag,
        )
    _probe_parent(p, path, flag)


def _through_link(p: str) -> str:
    """The file a link names (as a shell's ``>`` writes it): a file output replaces the
    target's contents, never the link itself."""
    return os.path.realpath(p) if os.path.islink(p) else p


def write_file_atomic(path: str, data: bytes, flag: str) -> None:
    """``data`` into ``path`` (through a link, into its target) via a temporary file beside
    it and a rename."""
    p = _through_link(local_path(path))
    parent = os.path.dirname(os.path.abspath(p))
    fd, tmp = tempfile.mkstemp(dir=parent, prefix="." + os.path.basename(p) + _TMP_TAG)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except OSError as exc:
        _remove_quietly(tmp)
        raise output_error(exc, path, flag) from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def _probe_parent(p: str, shown: str, flag: str) -> None:
    """The parent of ``p`` exists, is a folder and takes a new file (tried for real: as
    root, or on a read-only mount, permission bits alone do not say)."""
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.exists(parent):
        raise OutputError(f"{flag} {shown}: folder {parent} does not exist", file=shown, key=flag)
    if not os.path.isdir(parent):
        raise OutputError(f"{flag} {shown}: {parent} is not a folder", file=shown, key=flag)
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix="." + os.path.basename(p) + _TMP_TAG)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise output_error(exc, shown, flag, doing="creating a file in") from None


# --- folders -----------------------------------------------------------------------------------


WRITE_PROTOCOLS = PROTOCOLS - {"http", "https"}
"""Where outputs may go: every scheme mxload reads but HTTP, which fsspec only reads."""


class OutputDir:
    """A folder written whole (see module doc). ``path`` is where to write meanwhile."""

    def __init__(
        self,
        target: str,
        flag: str,
        *,
        overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.target = target
        self.flag = flag
        self.overwrite = overwrite
        self.storage_options = dict(storage_options or {})
        self.path: str | None = None
        """The temporary folder (a local path or URL) once :meth:`begin` ran."""
        self._fs: Any = None

    # -- before any work ------------------------------------------------------------------

    def check(self) -> None:
        """Refuse an unusable target (OutputError naming it and the flag)."""
        t, flag = self.target, self.flag
        if not t:
            raise OutputError(f"{flag}: an empty path", key=flag)
        scheme = protocol(t)
        if scheme not in WRITE_PROTOCOLS:
            # Refused before any connection: ftp://, sftp://, http(s):// (read-only) ...
            raise OutputError(
                f"{flag} {t}: mxload does not write to {scheme}://; give a local folder or "
                + ", ".join(f"{p}://" for p in sorted(WRITE_PROTOCOLS) if p),
                file=t,
                key=flag,
            )
        if is_remote(t):
            fs = self._filesystem()
            root = self._root()
            if fs.exists(root) and not self.overwrite:
                if not fs.isdir(root) or fs.ls(root, detail=False):
                    raise OutputError(
                        f"{flag} {t}: exists and is not empty; give --overwrite to replace it "
                        "whole, or choose a new folder",
                        file=t,
                        key=flag,
                    )
            return
        p = local_path(t)
        check_not_input(t, flag, own_state())
        if os.path.lexists(p):
            if not os.path.isdir(p) or os.path.islink(p):
                raise OutputError(f"{flag} {t}: exists and is not a folder", file=t, key=flag)
            if os.listdir(p) and not self.overwrite:
                raise OutputError(
                    f"{flag} {t}: exists and is not empty; give --overwrite to replace it "
                    "whole, or choose a new folder",
                    file=t,
                    key=flag,
                )
        _probe_parent(p.rstrip("/") or p, t, flag)

    # -- writing ----------------------------------------------------------------------------

    def begin(self) -> str:
        """Create the temporary folder beside the target; returns its path (or URL)."""
        if self.path is not None:
            return self.path
        if is_remote(self.target):
            root = self._root()
            tmp = root + _TMP_TAG + uuid.uuid4().hex[:12]
            self._filesystem().makedirs(tmp, exist_ok=True)
            protocol = self.target.split("://", 1)[0]
            self.path = f"{protocol}://{tmp.lstrip('/')}"
            self._tmp_root = tmp
            return self.path
        p = os.path.abspath(local_path(self.target)).rstrip("/")
        parent, name = os.path.split(p)
        try:
            self.path = tempfile.mkdtemp(dir=parent, prefix=f".{name}{_TMP_TAG}")
        except OSError as exc:
            raise output_error(exc, self.target, self.flag, doing="creating a folder in") from None
        return self.path

    def commit(self) -> None:
        """Put the finished folder in place of the target (see module doc)."""
        if self.path is None:
            raise RuntimeError("OutputDir.commit before begin")
        try:
            if is_remote(self.target):
                self._commit_remote()
            else:
                self._commit_local(self.path)
        except OSError as exc:
            self.discard()
            raise output_error(exc, self.target, self.flag, doing="putting in place") from None
        self.path = None

    def discard(self) -> None:
        """Remove the temporary folder (best effort); the target is untouched."""
        tmp, self.path = self.path, None
        if tmp is None:
            return
        if is_remote(self.target):
            try:
                self._filesystem().rm(self._tmp_root, recursive=True)
            except Exception:  # best effort: the caller's error is what the user needs
                pass
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    def _commit_local(self, tmp: str) -> None:
        target = os.path.abspath(local_path(self.target)).rstrip("/")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it 0700 while it was written
        if os.path.isdir(target) and not os.path.islink(target) and not os.listdir(target):
            os.rmdir(target)
        if not os.path.lexists(target):
            os.rename(tmp, target)
            return
        if not self.overwrite:  # appeared while we worked: never clobber it
            raise OutputError(
                f"{self.flag} {self.target}: appeared while this run wrote its output; "
                f"nothing replaced (the new files were removed)",
                file=self.target,
                key=self.flag,
            )
        parent, name = os.path.split(target)
        old = os.path.join(parent, f".{name}{_OLD_TAG}{uuid.uuid4().hex[:12]}")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            os.rename(old, target)  # put the old output back: nothing lost
            raise
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)

    def _commit_remote(self) -> None:
        fs, root = self._filesystem(), self._root()
        if fs.exists(root):
            if not self.overwrite and fs.ls(root, detail=False):
                raise OutputError(
                    f"{self.flag} {self.target}: appeared while this run wrote its output; "
                    "nothing replaced",
                    file=self.target,
                    key=self.flag,
                )
            fs.rm(root, recursive=True)
        fs.mv(self._tmp_root, root, recursive=True)

    def __enter__(self) -> OutputDir:
        self.begin()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
            return
        self.discard()
        if exc is not None and is_disk_error(exc):
            assert isinstance(exc, OSError)
            raise output_error(exc, self.target, self.flag) from None

    # -- helpers ------------------------------------------------------------------------------

    def _filesystem(self) -> Any:
        if self._fs is None:
            import fsspec  # type: ignore[import-untyped]

            self._fs, _ = fsspec.core.url_to_fs(self.target, **self.storage_options)
        return self._fs

    def _root(self) -> str:
        import fsspec

        _, root = fsspec.core.url_to_fs(self.target, **self.storage_options)
        return str(root).rstrip("/")


# --- source vs destination ---------------------------------------------------------------------


def normalise(location: str) -> str:
    """A comparable form of a path or URL: real path for local ones (symlinks resolved),
    ``protocol://`` + normalised path for URLs."""
    if not is_remote(location):
        return os.path.realpath(local_path(location) or ".")
    protocol, rest = location.split("://", 1)
    rest = posixpath.normpath("/" + rest.split("?", 1)[0].split("#", 1)[0]).lstrip("/")
    return f"{protocol.lower()}://{rest}"


def check_disjoint(src: str, dst: str, *, src_flag: str = "SRC", dst_flag: str = "DST") -> None:
    """Refuse an empty SRC or DST, and DST that would overwrite SRC
    (:func:`check_not_input`; OutputError)."""
    for flag, location in ((src_flag, src), (dst_flag, dst)):
        if not location:
            raise OutputError(f"{flag}: an empty path", key=flag)
    check_not_input(dst, dst_flag, [(src_flag, src)])


def check_not_input(output: str | None, flag: str, inputs: Iterable[tuple[str, str]]) -> None:
    """The one rule for every output (``--dump``, ``--report``, convert's DST): it may not
    be an input, lie inside one, or contain one, compared as real paths (links resolved)
    or normalised URLs. ``inputs``: (what it is, location) each, such as ("SRC", src) or
    ("the session's checkpoint", state.src). OutputError naming both, one message."""
    if not output:
        return
    b = normalise(output)
    for what, location in _with_linked_files(inputs):
        a = normalise(location)
        if a == b:
            relation = "is"
        elif b.startswith(a.rstrip("/") + "/"):
            relation = "is inside"
        elif a.startswith(b.rstrip("/") + "/"):
            relation = "contains"
        else:
            continue
        raise OutputError(
            f"{flag} {output} {relation} {what} {location}: no output may overwrite an input; "
            "choose a location outside it",
            file=output,
            key=flag,
        )


def own_state() -> list[tuple[str, str]]:
    """mxload's own state on this machine, an input of every command that no output may
    overwrite (docs/contract.md §5 "Files"): what $MXLOAD_HOME records (the head, the
    sessions, the logs) and the folder of the head recorded there (its sockets)."""
    from ...cluster.local import mxload_home, read_head_record

    home = mxload_home()
    out = [
        ("mxload's record of its Ray head", str(home / "head.json")),
        ("mxload's session records", str(home / "sessions")),
        ("mxload's error logs", str(home / "logs")),
    ]
    try:
        record = read_head_record()
    except SessionError:  # no record mxload wrote: nothing to say where its folder is
        record = None
    if record is not None and record.temp_dir:
        out.append(("the folder of the Ray head mxload started", record.temp_dir))
    return out


def _with_linked_files(inputs: Iterable[tuple[str, str]]) -> Iterable[tuple[str, str]]:
    """Each input, then the files a local input folder holds through links (a shard kept
    elsewhere and linked in, allowed by ``--allow-outside-links``): an output over a
    link's target destroys the input just as surely."""
    for what, location in inputs:
        if not location:
            continue
        yield what, location
        folder = None if is_remote(location) else local_path(location)
        if not folder or not os.path.isdir(folder):
            continue
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                yield f"{what}'s {name} (a link to {os.path.realpath(path)})", path


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (``os.umask`` would
    set it for a moment, and another thread may be creating files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
