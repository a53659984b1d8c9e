"""Which locations mxload reads, and which file names under a checkpoint it accepts.

A location is a local path or an fsspec URL. :func:`is_remote` is the one answer to
"does this location go over the network" for the whole code base; :func:`local_path`
turns a local location into an OS path. A checkpoint names its files relative to its
root, and a checkpoint is hostile input (docs/contract.md §1.3), so a name that is
absolute, a URL, or climbs out with ``..`` is refused, and a local file must resolve
(links followed) inside the root's real path unless links out of it are allowed.

This module imports nothing heavy: the CLI asks it questions before any back end loads.
"""

from __future__ import annotations

import os

from ...orchestrator.errors import CheckpointError, UsageError

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
"""URL schemes mxload reads (docs/contract.md §4 "Streaming"); others are refused before
connecting. ``""`` is a plain local path."""

LOCAL_PROTOCOLS = frozenset({"", "file", "local"})
"""Schemes that name the local file system (fsspec's ``file://`` and ``local://``)."""

S3_PROTOCOLS = frozenset({"s3", "s3a"})


def protocol(url: str) -> str:
    """The scheme of ``url``, lower case; ``""`` for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_remote(url: str) -> bool:
    """Whether ``url`` is read through a network back end (anything but a local path,
    ``file://`` or ``local://``)."""
    return protocol(url) not in LOCAL_PROTOCOLS


def local_path(url: str) -> str:
    """The OS path of a local location: ``url`` without its ``file://`` (or
    ``local://``) prefix. Other locations come back unchanged."""
    if "://" in url and protocol(url) in LOCAL_PROTOCOLS:
        return url.split("://", 1)[1]
    return url


def absolute(location: str) -> str:
    """A local location as an absolute OS path (``file://`` dropped), made once in the
    process that names it: a relative path means another folder in a worker whose
    working directory differs. URLs and empty strings come back unchanged."""
    if not location or is_remote(location):
        return location
    return os.path.abspath(local_path(location))


def check_location(root_url: object) -> str:
    """``root_url`` if it is a non-empty string with a scheme mxload reads, else
    UsageError (bad input, refused before any connection)."""
    if not isinstance(root_url, str) or not root_url:
        raise UsageError(
            f"checkpoint location: an empty path or URL ({root_url!r}); give a folder or "
            "an fsspec URL",
            file=str(root_url),
        )
    scheme = protocol(root_url)
    if scheme not in PROTOCOLS:
        raise UsageError(
            f"{root_url}: unsupported protocol {scheme!r}; mxload reads local "
            "paths and " + ", ".join(f"{p}://" for p in sorted(PROTOCOLS) if p),
            file=root_url,
        )
    return root_url


def check_relpath(root_url: str, relpath: object) -> str:
    """``relpath`` if it is a plain relative file name inside the checkpoint, else
    CheckpointError (names come from a checkpoint's index: hostile input)."""
    if isinstance(relpath, str):
        parts = relpath.replace("\\", "/").split("/")
        if (
            relpath
            and not relpath.startswith(("/", "\\"))
            and "://" not in relpath
            and not any(p in ("", ".", "..") for p in parts)
            and "\x00" not in relpath
        ):
            return relpath
    raise CheckpointError(
        f"{root_url}: refusing file name {relpath!r}: checkpoint files must be "
        "plain relative paths inside the checkpoint root",
        file=str(relpath),
    )


def file_url(root_url: str, relpath: str, *, local: bool) -> str:
    """The full URL (or path) of ``relpath`` under ``root_url``, as messages name it."""
    check_relpath(root_url, relpath)
    if local and "://" not in root_url:
        return os.path.join(root_url, relpath)
    return root_url.rstrip("/") + "/" + relpath


def check_inside(real_root: str, path: str, url: str) -> None:
    """A local file must resolve inside the checkpoint folder's real path ``real_root``
    (a link to a system file would otherwise be opened and its bytes parsed and
    quoted); CheckpointError naming ``url`` otherwise."""
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"{url}: resolves to {real}, outside the checkpoint folder {real_root}; "
            "not read (a checkpoint is a folder: give --allow-outside-links to follow "
            "links out of it)",
            file=url,
            key="--allow-outside-links",
        )
