"""A worker's error as the user sees it: one line, ``rank N: <what>``, an error of
mxload's hierarchy (its exit status kept), without the colour codes Ray puts in its
remote tracebacks (docs/contract.md §5).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import MxloadError, RunError

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain(text: str) -> str:
    """``text`` without terminal colour codes (Ray colours its remote tracebacks)."""
    return _ANSI.sub("", text)


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's text, without colour codes."""
    lines = [ln.strip() for ln in plain(str(err)).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def rank_error(rank: int, err: Any) -> MxloadError:
    """A worker's error as the user sees it: ``rank N: <what>``, one error of mxload's
    hierarchy (its exit status kept), the remote traceback kept aside in ``details`` for
    ``--debug`` and the log file."""
    cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err
    details = plain(str(err))
    if isinstance(cause, MxloadError):
        if not cause.message.startswith(f"rank {rank}"):
            cause.message = f"rank {rank}: {cause.message}"
            cause.args = (cause.message,)
        cause.context.setdefault("rank", rank)
        cause.context["details"] = details
        return cause
    return RunError(
        f"rank {rank}: {type(cause).__name__}: {first_line(cause)}", rank=rank, details=details
    )
