"""``mxload demo``: the whole story on one machine, in about a minute.

1. write a tiny block-FP8 checkpoint (``--preset``, default Qwen3-MoE; ``qwen3.5-tiny`` is
   the seed's Qwen3.8-27B in miniature) and a second version of it;
2. start a local Ray head (loopback) declaring 4 virtual NPUs;
3. load it with tp 2 x dp 2 (and expert parallelism for a MoE model), one worker pinned
   per virtual NPU;
4. check every rank's buffers against the CPU reference conversion of the same plan;
5. reload the second version in place, check again, and show that no address moved.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..plan.types import ParallelLayout


def reference_checksums(src: str, layout: ParallelLayout, rank: int) -> dict[str, str]:
    """Checksums of one rank's buffers converted in-process by the CPU reference path."""
    from ...workers.numerics.select import select_backend
    from ...workers.rank.loader import RankLoader
    from ..plan.message import RankJob, SourceInfo
    from ..plan.planner import build_plan
    from ..runtime.catalog import open_checkpoint

    meta = open_checkpoint(src)
    plan = build_plan(meta.config, layout, checkpoint=meta)
    rp = plan.ranks[rank]
    loader = RankLoader(
        rp,
        model_dtype=meta.config.model_dtype,
        backend=select_backend("cpu", prefer_fast=False),
    )
    q = meta.config.quant
    source = SourceInfo(root=src, quant=q.kind, block_n=q.block_n, block_k=q.block_k)
    loader.run(
        RankJob(
            reads=rp.reads or (),
            source=source,
            version=1,
            staging_budget=plan.min_staging_reload * 4,
        )
    )
    return loader.checksums()


def _verify(
    src: str, layout: ParallelLayout, manifest: dict[str, Any], out: Callable[[str], None]
) -> int:
    bad = 0
    for r in manifest["ranks"]:
        want = reference_checksums(src, layout, r["rank"])
        got = {n: t["checksum"] for n, t in r["tensors"].items()}
        if got != want:
            bad += 1
            diff = sorted(n for n in set(want) | set(got) if want.get(n) != got.get(n))
            out(f"  rank {r['rank']}: MISMATCH in {diff[:5]}")
    return bad


@contextmanager
def _progress(json_out: bool, label: str) -> Iterator[Any]:
    """A progress bar on a terminal (None in a pipe or with --json), closed afterwards."""
    from .rendering import progress

    bar = progress(json_out, label)
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def run_demo(
    workdir: str | None = None, json_out: bool = False, preset: str = "qwen3-moe-tiny"
) -> int:
    from ..plan.config import parse_config
    from ..runtime.session import Session
    from ..tools.synth import make_checkpoint, preset_config
    from .rendering import render_load_table

    cfg = parse_config(preset_config(preset), f"preset {preset}")

    out = print if not json_out else (lambda *a, **k: print(*a, file=sys.stderr, **k))
    root = workdir or tempfile.mkdtemp(prefix="mxload-demo-")
    v1, v2 = f"{root}/step-1", f"{root}/step-2"
    try:
        out(
            f"[1/5] writing a tiny {cfg.architecture} block-FP8 checkpoint ({preset}, "
            f"2 versions) under {root}"
        )
        make_checkpoint(v1, preset, seed=1)
        make_checkpoint(v2, preset, seed=2)
        layout = ParallelLayout(tp=2, dp=2, enable_expert_parallel=cfg.is_moe)
        ep = " EP" if cfg.is_moe else ""
        out(f"[2/5] starting local Ray (127.0.0.1) with 4 virtual NPUs; loading tp=2 dp=2{ep}")
        with _progress(json_out, "load") as show:
            session = Session.load(v1, layout, device="auto", on_progress=show)
        try:
            m1 = session.manifest
            out(render_load_table(m1))
            notes = {r.get("backend", "") for r in m1["ranks"]}
            out(f"      workers compute on: {', '.join(sorted(notes))} (no NPU runtime here)")
            devs = [r["visible_devices"] for r in m1["ranks"]]
            out(f"      ASCEND_RT_VISIBLE_DEVICES per rank: {devs}")
            out("[3/5] checking every rank against the CPU reference conversion")
            bad = _verify(v1, layout, m1, out)
            out(f"      {'all ranks match' if not bad else f'{bad} rank(s) differ'}")
            out("[4/5] reloading step-2 in place")
            with _progress(json_out, "reload") as show:
                m2 = session.reload(v2, on_progress=show)
            out(render_load_table(m2))
            bad2 = _verify(v2, layout, m2, out)
            moved = m2.get("addresses_moved", [])
            total = sum(len(r["tensors"]) for r in m2["ranks"])
            out(
                f"      version {m2['ranks'][0]['version']}: {'all ranks match' if not bad2 else f'{bad2} rank(s) differ'}"
            )
            out(f"[5/5] {total} buffers, {len(moved)} addresses moved")
            if json_out:
                print(json.dumps({"load": m1, "reload": m2, "mismatched_ranks": bad + bad2}))
            return 0 if not (bad or bad2 or moved) else 1
        finally:
            session.release()
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
