"""The load/reload progress line, fed counters as the driver polls them, with an injected
clock (no sleeping): ranks done, bytes, rate, and the rank that stalls, by number."""

from __future__ import annotations

import io

from mxload.orchestrator.cli.progress import RankProgress


def lines(text: str) -> list[str]:
    return [part for part in text.replace("\r", "\n").split("\n") if part.strip()]


def test_counts_ranks_bytes_and_rate() -> None:
    now = [100.0]
    out = io.StringIO()
    bar = RankProgress("load", stream=out, clock=lambda: now[0], stall_s=15, ncols=200)
    now[0] = 104.0
    bar([(10, 10, 3 * 2**20), (4, 10, 1 * 2**20)])
    bar.close()
    last = lines(out.getvalue())[-1]
    assert "load:" in last and "14/20 units" in last
    assert "ranks 1/2 done" in last
    assert "read 4.00 MiB at 1.00 MiB/s" in last  # 4 MiB in 4 s of the injected clock
    assert "stalled" not in last


def test_a_rank_without_progress_is_named() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = RankProgress("reload", stream=out, clock=lambda: now[0], stall_s=15, ncols=200)
    for step in range(1, 6):
        now[0] = step * 5.0
        # rank 0 keeps moving; rank 1 finished; rank 2 stops at 3 units from the start
        bar([(step, 10, step * 100), (10, 10, 1000), (3, 10, 300)])
    bar.close()
    last = lines(out.getvalue())[-1]
    assert "rank 2 stalled 20 s" in last, last
    assert "rank 0" not in last and "rank 1 " not in last


def test_a_finished_rank_never_stalls() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = RankProgress("load", stream=out, clock=lambda: now[0], stall_s=1, ncols=200)
    bar([(5, 5, 50)])
    now[0] = 60.0
    bar([(5, 5, 50)])
    bar.close()
    assert "stalled" not in out.getvalue()
    assert "ranks 1/1 done" in lines(out.getvalue())[-1]
