"""Terminal progress for long runs: for ``load`` and ``reload`` a tqdm bar over the ranks'
units, with ranks done, bytes read, read rate, ETA, and the rank that stalls
(:class:`RankProgress`); for ``convert`` one bar over the source bytes (:class:`ConvertBar`).

Why here and not in the driver or the converter: they report raw counters through their
``on_progress`` callbacks (the driver ``(units_done, units_total, bytes_read)`` per rank,
polled about twice a second); how they are shown is the command line's business, and the
callbacks keep the library free of terminal code. The CLI enables it only when stderr is a terminal
and ``--json`` is off, so pipes and scripts get no control characters.

Limits: ETA is tqdm's, from units done per second, so a run whose units differ much in
size (a vocabulary block against a norm) shows a rough ETA early on. A rank counts as
stalled when its counters have not moved for ``stall_s`` seconds while it is unfinished;
that names the rank to look at, it does not stop anything.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from ..plan.sizes import format_size

RankCounters = tuple[int, int, int]
"""(units done, units total, bytes read) of one rank, as the driver polls them."""


def bar_width(stream: IO[str] | None = None) -> int:
    """Columns for a bar on ``stream`` (stderr by default): the terminal's width, or 100
    where it reports none (a pty without a size would make tqdm draw nothing)."""
    try:
        cols = os.get_terminal_size((stream or sys.stderr).fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal, or no fileno()
        cols = 0
    return cols if cols > 0 else shutil.get_terminal_size((100, 20)).columns or 100


class RankProgress:
    """The ``on_progress`` callback of a load or reload, drawing one tqdm bar."""

    def __init__(
        self,
        label: str,
        *,
        stream: IO[str] | None = None,
        stall_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        ncols: int | None = None,
    ) -> None:
        from tqdm import tqdm  # type: ignore[import-untyped]

        self.stall_s = stall_s
        self.clock = clock
        self.t0 = clock()
        self.bar: Any = tqdm(
            total=0,
            desc=label,
            unit="unit",
            file=stream,
            ncols=ncols or bar_width(stream),
            leave=True,
            mininterval=0.5,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} units "
            "[{elapsed}<{remaining}{postfix}]",
        )
        self.last: list[RankCounters] = []
        self.moved_at: list[float] = []

    def __call__(self, progress: Sequence[RankCounters]) -> None:
        now = self.clock()
        if len(self.last) != len(progress):
            self.last = [(0, 0, 0)] * len(progress)
            self.moved_at = [now] * len(progress)
        for rank, counters in enumerate(progress):
            if tuple(counters) != self.last[rank]:
                self.last[rank] = tuple(counters)  # type: ignore[assignment]
                self.moved_at[rank] = now
        self.bar.set_postfix_str(self.postfix(now), refresh=False)
        total = sum(c[1] for c in self.last)
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(sum(c[0] for c in self.last) - self.bar.n)
        self.bar.refresh()

    def postfix(self, now: float) -> str:
        ranks = len(self.last)
        done = sum(1 for d, t, _ in self.last if t and d >= t)
        nbytes = sum(c[2] for c in self.last)
        rate = nbytes / max(now - self.t0, 1e-9)
        text = (
            f"ranks {done}/{ranks} done, read {format_size(nbytes)} at {format_size(int(rate))}/s"
        )
        stalled = [
            r
            for r, (d, t, _) in enumerate(self.last)
            if not (t and d >= t) and now - self.moved_at[r] >= self.stall_s
        ]
        if stalled:
            worst = min(stalled, key=lambda r: self.moved_at[r])
            text += f"; rank {worst} stalled {now - self.moved_at[worst]:.0f} s" + (
                f" (+{len(stalled) - 1} more)" if len(stalled) > 1 else ""
            )
        return text

    def close(self) -> None:
        self.bar.close()


class ConvertBar:
    """The ``on_progress`` callback of ``convert``: one tqdm bar over the source bytes."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        from tqdm import tqdm

        self.bar: Any = tqdm(
            total=0,
            desc="convert",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=stream,
            ncols=bar_width(stream),
            mininterval=0.5,
        )

    def __call__(self, tensors: int, tensors_total: int, nbytes: int, total: int) -> None:
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(nbytes - self.bar.n)
        self.bar.set_postfix_str(f"tensors {tensors}/{tensors_total}", refresh=False)

    def close(self) -> None:
        self.bar.close()
