"""Refit from the trainer's memory against the storage round trip: ``python bench/bench_refit.py``.

One Qwen3-30B-A3B layer (128 experts of 2048 x 768, attention 32/4 heads of 128; 1.2 GB
in BF16) held by two trainer ranks as FSDP dim-0 shards, refitting one engine rank (tp 1)
that holds it as MXFP8 (planned from the FP8 checkpoint, as an engine started from it).
Side by side in each repeat (``common.interleave``, medians of 3 after one warm-up):

* ``storage``: the trainer's state saved as a BF16 checkpoint (``safetensors``, 2 shards),
  every file fsynced, then reloaded in place (the checkpoint form, the path today);
* ``refit shm`` / ``refit gloo``: the same bytes sent by the two trainer ranks (processes
  of their own, ``tests/refit_trainer.py``, each its own member of the refit group) and
  written in place;
* ``refit shm, convert on sender``: MXFP8 on the wire, the engine rank only repacks.

Printed and written to ``bench/results/refit.{json,md}``: each median with its spread,
the ratio refit / storage per repeat, the transfer phase's GB/s (the refit's receiving
overlaps its conversion, so each transport is also timed alone: the same bytes in the
same 64 MiB buckets, two sender threads to one receiver), the receiver's own time
(its loader's convert-and-write seconds, not reading or waiting for bytes) with
sender-side conversion over its time with BF16 on the wire (in the refits, where the
trainer processes share the two cores with it, and alone: reloads of the MXFP8 and BF16
forms of the same weights from checkpoints, and in refits with the engine rank and the
trainer processes pinned to cores of their own), the engine rank's CPU seconds per refit
(receiving, converting and writing: this process's), and the bytes a delta sends when half the
tensors are unchanged over a full refit's. The load average before and after is printed: the
machine is small and shared, so the ratios are the figures to read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import interleave, load_average, machine_facts, md_table, paired_ratio

OVERRIDES = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 1,
    "mlp_only_layers": [],
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
}


def engine_model(plan_rank: Any) -> torch.nn.Module:
    """A module holding one zeroed parameter per buffer of the rank, as an engine would."""
    model = torch.nn.Module()
    for b in plan_rank.buffers:
        *path, leaf = b.name.split(".")
        mod = model
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        t = torch.zeros(b.storage_shape, dtype=getattr(torch, b.dtype))
        if b.storage_order:
            t = t.permute([b.storage_order.index(d) for d in range(len(b.shape))])
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return model


def read_twin(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def save_round_trip(twin: str, full: dict[str, torch.Tensor], out: str) -> None:
    """The trainer's state written as a checkpoint: the twin's config and index, its
    shards rewritten from ``full``, every file fsynced."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    index = json.load(open(os.path.join(twin, "model.safetensors.index.json")))
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, f in index["weight_map"].items():
        by_file.setdefault(f, {})[name] = full[name]
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copyfile(os.path.join(twin, name), os.path.join(out, name))
    for f, tensors in by_file.items():
        save_file(tensors, os.path.join(out, f))
    for name in os.listdir(out):
        fd = os.open(os.path.join(out, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def link_rate(kind: str, nbytes: int, bucket: int, repeats: int) -> float:
    """GB/s of the transport ``kind`` alone: ``nbytes`` in ``bucket``-byte messages from
    two sender threads to one receiver (the refit's 2 -> 1), nothing converted; the
    median of ``repeats`` after one warm-up."""
    import time

    from mxload.workers.transfer.transports import make_transport

    from tests.refit_trainer import free_port

    port, group = free_port(), f"bench-link-{os.getpid()}-{kind}"
    count = max(1, nbytes // bucket // 2)
    ends: list[Any] = [None] * 3

    def make(member: int) -> None:
        ends[member] = make_transport(
            kind,
            addresses=[f"127.0.0.1:{port}"],
            member=member,
            senders=2,
            size=3,
            group=group,
            timeout_s=120,
            bucket_bytes=bucket,
        )

    threads = [threading.Thread(target=make, args=(m,)) for m in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bufs = [torch.full((bucket,), s, dtype=torch.uint8) for s in range(2)]
    into = {s: torch.empty(bucket, dtype=torch.uint8) for s in range(2)}

    def send(s: int) -> None:
        for _ in range(count):
            ends[s].send(2, bufs[s])

    def recv(s: int) -> None:
        for _ in range(count):
            ends[2].recv(s, into[s])

    rates = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        workers = [threading.Thread(target=f, args=(s,)) for f in (send, recv) for s in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        rates.append(2 * count * bucket / (time.perf_counter() - t0) / 1e9)
    for end in ends:
        end.close()
    return statistics.median(rates[1:])


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended since the listing
            pass


def pinned_refits(
    trainer: Any, refit_fn: Any, stats: dict[str, list[dict[str, Any]]], repeats: int
) -> dict[str, Any]:
    """The BF16 and the sender-side shm refits, alternating, with this process (the engine
    rank) on the last core and the trainer processes on the others, the engine rank's
    threads set to its cores; afterwards everything gets every core back. Medians of
    ``repeats`` after one warm-up of each: the engine rank's convert-and-write seconds
    and its process's CPU seconds."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {"skipped": "one core"}
    mine, theirs = {cores[-1]}, set(cores[:-1])
    threads = torch.get_num_threads()
    names = ("refit shm", "refit shm, convert on sender")
    got: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        _pin(os.getpid(), mine)
        for p in trainer.procs:
            _pin(p.pid, theirs)
        torch.set_num_threads(len(mine))
        for _ in range(repeats + 1):
            for name in names:
                refit_fn(name)()
                got[name].append(stats[name][-1])
    finally:
        torch.set_num_threads(threads)
        _pin(os.getpid(), set(cores))
        for p in trainer.procs:
            _pin(p.pid, set(cores))
    out: dict[str, Any] = {"engine_cores": sorted(mine), "trainer_cores": sorted(theirs)}
    for name in names:
        runs = got[name][1:]
        out[name] = {
            "receiver_seconds": statistics.median(g["convert_seconds"] for g in runs),
            "receiver_cpu_seconds": statistics.median(g["cpu_seconds"] for g in runs),
        }
    bf16, mx = (out[n] for n in names)
    out["receiver_ratio"] = mx["receiver_seconds"] / bf16["receiver_seconds"]
    out["receiver_cpu_ratio"] = mx["receiver_cpu_seconds"] / bf16["receiver_cpu_seconds"]
    return out


def own_cores_text(own: dict[str, Any]) -> str:
    if "skipped" in own:
        return f"each on cores of its own: skipped ({own['skipped']})\n"
    bf16, mx = own["refit shm"], own["refit shm, convert on sender"]
    return (
        f"each on cores of its own (engine rank {own['engine_cores']}, trainer ranks "
        f"{own['trainer_cores']}): receiver time ratio {own['receiver_ratio']:.3f} "
        f"(convert-and-write {mx['receiver_seconds']:.3f} s against {bf16['receiver_seconds']:.3f} s), "
        f"CPU seconds per refit ratio {own['receiver_cpu_ratio']:.3f} "
        f"({mx['receiver_cpu_seconds']:.3f} against {bf16['receiver_cpu_seconds']:.3f})\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="", help="folder for the checkpoints (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--small", action="store_true", help="a 30 MB model: a smoke run")
    args = ap.parse_args()
    overrides = dict(OVERRIDES)
    if args.small:
        overrides.update(hidden_size=512, moe_intermediate_size=256, num_experts=16)

    from mxload.orchestrator.hosts.engine_ext import Attachment, EngineFacts, engine_params
    from mxload.orchestrator.plan.planner import build_plan
    from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
    from mxload.orchestrator.plan.types import ParallelLayout
    from mxload.orchestrator.runtime.catalog import open_checkpoint
    from mxload.orchestrator.tools.synth import make_checkpoint

    machine = machine_facts()
    print(f"load average before: {machine['load_average_start']}", flush=True)
    work = args.work or tempfile.mkdtemp(prefix="mxload-bench-refit-")
    fp8, twin, saved = (os.path.join(work, n) for n in ("fp8", "bf16", "saved"))
    if not os.path.exists(os.path.join(twin, "config.json")):
        make_checkpoint(fp8, "qwen3-moe-tiny", seed=1, overrides=overrides)
        make_checkpoint(twin, "qwen3-moe-tiny", seed=1, overrides=overrides, bf16=True)
    full = read_twin(twin)
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    print(f"trainer state: {len(full)} tensors, {nbytes / 2**30:.2f} GiB BF16", flush=True)
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full.items()}, 2)
    h = manifest.digest()

    layout = ParallelLayout(tp=1)
    meta = open_checkpoint(fp8)
    plan = build_plan(meta.config, layout, checkpoint=meta)
    model = engine_model(plan.ranks[0])
    facts = EngineFacts(layout, 0, 0, 0, "mxload", {})
    storage_engine = Attachment(fp8, facts, engine_params(model))

    from tests.refit_trainer import Trainers, free_port

    def answered(replies: list[dict[str, Any]]) -> None:
        for r, reply in enumerate(replies):
            if not reply["ok"]:
                raise RuntimeError(f"trainer rank {r}: {reply['error']}\n{reply.get('tb', '')}")

    trainer = Trainers(2)
    groups: dict[str, Attachment] = {}
    for name, kind, conv in (
        ("refit shm", "shm", "receiver"),
        ("refit gloo", "gloo", "receiver"),
        ("refit shm, convert on sender", "shm", "sender"),
    ):
        port = free_port()
        form = {
            "transport": kind,
            "addresses": [f"127.0.0.1:{port}"],
            "world": 2,
            "manifest": manifest_to_json(manifest),
            "convert_on": conv,
            "bucket_bytes": 64 << 20,
            "group": f"bench-refit-{port}",
            "timeout_s": 600,
        }
        eng = Attachment(fp8, facts, engine_params(model))
        trainer.post({"op": "join", "name": name, "src": fp8, "layout": {"tp": 1}, "trainer": form})
        eng.attach_trainer(form)
        answered(trainer.replies())
        groups[name] = eng

    steps = itertools.count(1)
    stats: dict[str, list[dict[str, Any]]] = {n: [] for n in groups}

    def refit_fn(name: str, **kw: Any) -> Any:
        eng = groups[name]

        def run() -> None:
            step = next(steps)
            delta = {"delta_of": step - 1} if kw else {}
            trainer.post({"op": "send", "name": name, "step": step, "weights": twin, **delta, **kw})
            # This process is the engine rank (its receive threads, its kernels' threads):
            # its CPU seconds over the refit are its own work, however the cores were shared.
            cpu = time.process_time()
            got = eng.refit(step, h, **delta)
            stats[name].append({**got, "cpu_seconds": time.process_time() - cpu})
            answered(trainer.replies())

        return run

    storage_stats: list[dict[str, Any]] = []

    def storage() -> None:
        save_round_trip(twin, full, saved)
        storage_stats.append(storage_engine.reload(saved))

    candidates: dict[str, Any] = {"storage": storage}
    candidates.update({n: refit_fn(n) for n in groups})
    timings = interleave(candidates, repeats=args.repeats, warmup=1)

    # A delta with half the tensors unchanged, against the full refit before it.
    names = sorted(full)
    half = names[: len(names) // 2]
    full_run = refit_fn("refit shm")
    full_run()
    full_bytes = stats["refit shm"][-1]["bytes_received"]
    refit_fn("refit shm", changed=half)()
    delta_bytes = stats["refit shm"][-1]["bytes_received"]

    # The refits again with the engine rank and the trainer ranks each on cores of their
    # own, as on a cluster where they sit on different devices: in the refits above the
    # trainer ranks' conversion takes the engine rank's cores (sender-side), and their
    # sending hardly does (BF16), so its seconds there compare unlike machines.
    own_cores = pinned_refits(trainer, refit_fn, stats, args.repeats)

    # The engine rank's own work with nothing else running: its convert-and-write from
    # the BF16 form of the weights and from their MXFP8 form (what the wire carries when
    # the sender converts), each read from a checkpoint in turn. In the refits the
    # trainer ranks share this machine's two cores with it.
    from mxload.orchestrator.tools.convert import convert_checkpoint

    mx_ckpt = os.path.join(work, "mxfp8")
    if not os.path.exists(os.path.join(mx_ckpt, "config.json")):
        convert_checkpoint(fp8, mx_ckpt)
    alone: dict[str, list[float]] = {"bf16": [], "mxfp8": []}
    for _ in range(args.repeats + 1):
        for form, path in (("bf16", twin), ("mxfp8", mx_ckpt)):
            alone[form].append(storage_engine.reload(path)["convert_seconds"])
    own_alone = {k: statistics.median(v[1:]) for k, v in alone.items()}

    # The transfer phase: each transport alone, moving the same bytes in the same buckets.
    links = {
        f"refit {kind}": link_rate(kind, nbytes, 64 << 20, args.repeats) for kind in ("shm", "gloo")
    }
    rows = []
    out: dict[str, Any] = {"bytes_bf16": nbytes, "machine": machine, "candidates": {}}
    for name, t in timings.items():
        ratio = paired_ratio(t, timings["storage"])
        row = {"seconds": t.to_json(), "vs_storage": ratio.to_json()}
        if name == "storage":
            # the reload's own convert-and-write seconds, beside the refits' receiver time
            row["receiver_seconds"] = statistics.median(
                g["convert_seconds"] for g in storage_stats[1 : 1 + args.repeats]
            )
        if name != "storage":
            got = stats[name][1 : 1 + args.repeats]
            recv = statistics.median(g["receive_seconds"] for g in got)
            # its own work: converting (or repacking) and writing, not reading or waiting
            own = statistics.median(g["convert_seconds"] for g in got)
            row["waited_for_bytes_seconds"] = statistics.median(
                g["waited_for_bytes_seconds"] for g in got
            )
            moved = statistics.median(g["bytes_received"] for g in got)
            row.update(receive_seconds=recv, receiver_seconds=own, bytes_received=moved)
            row["receiver_cpu_seconds"] = statistics.median(g["cpu_seconds"] for g in got)
            row["in_place_fraction"] = (
                statistics.median(g["bytes_received_in_place"] for g in got) / moved
            )
            row["transfer_gb_s"] = links.get(name)
        out["candidates"][name] = row
        rows.append(
            [
                name,
                t.text(),
                ratio.text(digits=2, unit="x") if name != "storage" else "1",
                f"{row['transfer_gb_s']:.2f}" if row.get("transfer_gb_s") else "-",
                f"{row['receiver_seconds']:.3f}",
                f"{row['receiver_cpu_seconds']:.3f}" if "receiver_cpu_seconds" in row else "-",
                f"{row['in_place_fraction']:.2f}" if "in_place_fraction" in row else "-",
            ]
        )
    rx = out["candidates"]
    out["sender_conversion_receiver_ratio"] = (
        rx["refit shm, convert on sender"]["receiver_seconds"] / rx["refit shm"]["receiver_seconds"]
    )
    out["sender_conversion_receiver_cpu_ratio"] = (
        rx["refit shm, convert on sender"]["receiver_cpu_seconds"]
        / rx["refit shm"]["receiver_cpu_seconds"]
    )
    out["sender_conversion_wire_ratio"] = (
        rx["refit shm, convert on sender"]["bytes_received"] / rx["refit shm"]["bytes_received"]
    )
    out["delta_half_unchanged_bytes_ratio"] = delta_bytes / full_bytes
    out["receiver_seconds_alone"] = own_alone
    out["receiver_ratio_alone"] = own_alone["mxfp8"] / own_alone["bf16"]
    out["own_cores"] = own_cores
    out["load_average_after"] = load_average()
    table = md_table(
        [
            "candidate",
            "seconds (median [min-max])",
            "/ storage round trip",
            "its link alone, GB/s",
            "engine rank's own convert+write s",
            "engine rank's CPU s per refit",
            "bytes received in place",
        ],
        rows,
    )
    extra = (
        f"\nsender-side conversion: receiver time ratio {out['sender_conversion_receiver_ratio']:.3f} "
        f"in the refits, {out['receiver_ratio_alone']:.3f} alone (convert-and-write from MXFP8 "
        f"{own_alone['mxfp8']:.3f} s, from BF16 {own_alone['bf16']:.3f} s), "
        f"engine rank's CPU seconds per refit ratio "
        f"{out['sender_conversion_receiver_cpu_ratio']:.3f}, "
        f"wire bytes ratio {out['sender_conversion_wire_ratio']:.3f}\n"
        + own_cores_text(own_cores)
        + f"delta with half the tensors unchanged: bytes ratio {out['delta_half_unchanged_bytes_ratio']:.3f}\n"
        f"load average before {out['machine'].get('load_average_start')}, after {out['load_average_after']}\n"
    )
    print(table + extra, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "refit.json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(args.out, "refit.md"), "w") as f:
        f.write(
            f"# Refit vs storage round trip ({nbytes / 2**30:.2f} GiB BF16, 2 trainer ranks -> "
            f"1 engine rank, medians of {args.repeats})\n\n`python bench/bench_refit.py`\n\n"
            + table
            + extra
        )
    for eng in groups.values():
        eng.close()
    trainer.close()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
