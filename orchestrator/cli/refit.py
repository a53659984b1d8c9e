"""``mxload plan --from-trainer``: the transfer plan of a refit from a trainer's memory
(``plan.refit``) and its predicted seconds (``plan.timemodel.refit_times``), beside the
storage round trip of the same bytes: the trainer saving a BF16 checkpoint (fsync'ed),
the engine reloading it (docs/contract.md §5, docs/time-model.md "Refit")."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, replace
from typing import Any

from ..errors import InputError, UsageError
from ..plan.sizes import format_size
from . import flags

REFIT_FLAGS = ("trainer_link", "convert_on", "bucket_size")
DEFAULT_LINK = "hccl"


def refuse_refit_flags(args: argparse.Namespace) -> None:
    """A refit flag without ``--from-trainer`` plans nothing: refused, naming it."""
    for name in REFIT_FLAGS:
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} applies to a refit plan: give --from-trainer too", key=flag)


def trainer_manifest(source: str, plan: Any, config: Any, devices_per_node: int) -> Any:
    """The manifest ``--from-trainer`` names: a JSON file, or ``fsdp:N`` / ``megatron:N``
    over the plan's own tensors (Megatron's N dividing the attention heads and the KV
    heads, as Megatron's attention requires)."""
    from ..plan.refit import needed_shapes
    from ..plan.trainer import fsdp_manifest, megatron_manifest

    kind, sep, count = source.partition(":")
    if sep and kind in ("fsdp", "megatron") and not os.path.exists(source):
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise UsageError(
                f"--from-trainer {source}: {kind}:N needs a number of trainer ranks >= 1",
                key="--from-trainer",
            )
        heads = (config.num_attention_heads, config.num_key_value_heads)
        if kind == "megatron" and any(h % int(count) for h in heads):
            raise UsageError(
                f"--from-trainer {source}: Megatron splits the attention heads over its "
                f"tensor-parallel ranks; {count} must divide both the heads ({heads[0]}) "
                f"and the KV heads ({heads[1]})",
                key="--from-trainer",
            )
        make = fsdp_manifest if kind == "fsdp" else megatron_manifest
        try:
            return make(needed_shapes(plan), int(count), devices_per_node=devices_per_node)
        except InputError as err:
            raise InputError(f"--from-trainer {source}: {err}", key="--from-trainer") from None
    from ..runtime.refit import read_manifest

    return read_manifest(source, "--from-trainer")


def add_refit(obj: dict[str, Any], plan: Any, config: Any, args: argparse.Namespace) -> str:
    """The refit's plan and prediction into ``obj["refit"]``; its human lines."""
    from ..plan.config import QuantConfig
    from ..plan.planner import build_plan
    from ..plan.refit import DEFAULT_BUCKET_BYTES, MAX_BUCKET_BYTES, MIN_BUCKET_BYTES, refit_summary
    from ..plan.timemodel import RefitRates, plan_times, refit_times, save_seconds

    source = args.from_trainer
    if not source:
        raise UsageError(
            "--from-trainer: an empty value; give a manifest file, fsdp:N or megatron:N",
            key="--from-trainer",
        )
    bucket = flags.size(args, "bucket_size")
    if bucket is not None and not MIN_BUCKET_BYTES <= bucket <= MAX_BUCKET_BYTES:
        raise UsageError(
            f"--bucket-size {bucket} bytes is outside 1KiB..16GiB (what the trainer form takes)",
            key="--bucket-size",
        )
    bucket = bucket or DEFAULT_BUCKET_BYTES
    per_node = args.devices_per_node
    manifest = trainer_manifest(source, plan, config, per_node)
    link = args.trainer_link or DEFAULT_LINK
    convert_on = args.convert_on or "receiver"
    try:
        summary = refit_summary(
            plan, manifest, convert_on=convert_on, bucket_bytes=bucket, devices_per_node=per_node
        )
    except InputError as err:
        ctx = {k: v for k, v in err.context.items() if k in ("tensor", "rank")}
        if err.context.get("key") == "bucket_bytes":  # the flag's value, not the source's
            raise UsageError(f"--bucket-size: {err}", key="--bucket-size", **ctx) from None
        raise InputError(f"{source}: {err}", file=source, **ctx) from None
    rates = flags.time_model_rates(args)
    # --network-bandwidth given: the rate between nodes of an hccl/nccl/gloo/ray link
    given = not any(d.startswith("--network-bandwidth ") for d in args.defaults_used)
    refit_rates = RefitRates.for_link(
        link,
        network=rates.network_node if given or link in ("hccl", "nccl") else None,
        device=args.device,
        convert=rates.convert,
    )
    try:
        t = refit_times(summary, refit_rates)
        # Beside it: every rank receiving all it holds (no copies within a node).
        direct = refit_summary(
            plan,
            manifest,
            convert_on=convert_on,
            bucket_bytes=bucket,
            devices_per_node=per_node,
            fanout=False,
        )
        t_direct = refit_times(direct, refit_rates)
    except ValueError as err:
        raise UsageError(f"--trainer-link {link}: {err}", key="--trainer-link") from None
    # The storage round trip of the same bytes: the trainer saves its BF16 state, the
    # engine reloads it (a BF16 checkpoint of the same model, read as any reload).
    twin = replace(config, quant=QuantConfig("none"))
    twin_plan = build_plan(twin, plan.layout, device=args.device, engine=plan.engine, remote=True)
    reload = plan_times(
        twin_plan, twin, rates=rates, scope=args.share, devices_per_node=per_node, local=False
    )["predicted_reload_seconds"]
    node_bytes = manifest.node_bytes()
    save = save_seconds(node_bytes, rates)
    refit = {
        "manifest": source,
        "manifest_digest": summary.manifest_digest,
        "trainer_world": manifest.world,
        "trainer_link": link,
        "convert_on": summary.convert_on,
        "bucket_bytes": summary.bucket_bytes,
        "needed_bytes": summary.needed_bytes,
        "wire_bytes": summary.wire_bytes,
        "wire_ratio": round(summary.wire_ratio, 4),
        "mx_needed_bytes": summary.mx_needed_bytes,
        "mx_wire_bytes": summary.mx_wire_bytes,
        "transfers": summary.transfers,
        "links": [
            {
                "sender_node": k.sender_node,
                "receiver_node": k.receiver_node,
                "bytes": k.nbytes,
                "same_node": k.same_node,
            }
            for k in summary.links
        ],
        "fanout_bytes": list(summary.fanout_bytes),
        "receivers": [
            {
                "rank": r,
                "node": summary.receiver_nodes[r],
                "landing_bytes": summary.receiver_bytes[r],
                "mx_bytes": summary.receiver_mx_bytes[r],
                "peak_staging_bytes": summary.receiver_staging[r],
            }
            for r in range(len(summary.receiver_nodes))
        ],
        "senders": [
            {
                "rank": s,
                "node": manifest.node_of(s),
                "bytes": summary.sender_bytes[s],
                "buckets": summary.sender_buckets[s],
                "staging_bytes": summary.sender_staging[s],
                "convert_bytes": summary.sender_convert_bytes[s],
            }
            for s in range(manifest.world)
        ],
        "unused_tensors": list(summary.unused_tensors),
        "rates_bytes_per_s": {
            "network_node": refit_rates.network,
            "same_node": refit_rates.same_node,
            "convert": refit_rates.convert,
            "repack": refit_rates.repack,
        },
        "predicted": {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(t).items()},
        "predicted_seconds": round(t.seconds, 4),
        "without_fanout": {
            "link_bytes": sum(k.nbytes for k in direct.links),
            "predicted_seconds": round(t_direct.seconds, 4),
        },
        "storage_round_trip": {
            "bytes_saved": sum(node_bytes.values()),
            "save_seconds": round(save, 4),
            "reload_seconds": round(reload, 4),
            "predicted_seconds": round(save + reload, 4),
        },
    }
    obj["refit"] = refit
    return "\n".join(render_refit(refit))


def render_refit(r: dict[str, Any]) -> list[str]:
    """The human lines of ``plan --from-trainer``."""
    p, trip = r["predicted"], r["storage_round_trip"]
    lines = [
        f"refit from {r['manifest']} ({r['trainer_world']} trainer ranks, manifest "
        f"{r['manifest_digest']}): convert on the {r['convert_on']}, link {r['trainer_link']}, "
        f"buckets of {format_size(r['bucket_bytes'])}",
        f"  the engine ranks take {format_size(r['needed_bytes'])} (trainer dtype); on the "
        f"wire {format_size(r['wire_bytes'])} ({r['wire_ratio']:.3f}x), in {r['transfers']} "
        "pieces",
        f"  {'from node':>10} {'to node':>8} {'bytes':>12}",
    ]
    for k in r["links"][:64]:
        same = "  (same node)" if k["same_node"] else ""
        lines.append(
            f"  {k['sender_node']:>10} {k['receiver_node']:>8} {format_size(k['bytes']):>12}{same}"
        )
    if len(r["links"]) > 64:
        lines.append(f"  ... {len(r['links']) - 64} more links (see --json)")
    lines.append(f"  {'rank':>10} {'node':>8} {'landing':>12} {'peak staging':>14}")
    recv = r["receivers"]
    for x in recv if len(recv) <= 64 else recv[:32] + recv[-8:]:
        lines.append(
            f"  {x['rank']:>10} {x['node']:>8} {format_size(x['landing_bytes']):>12} "
            f"{format_size(x['peak_staging_bytes']):>14}"
        )
    if len(recv) > 64:
        lines.append(f"  ... {len(recv) - 40} more ranks (see --json)")
    senders = r["senders"]
    worst = max(senders, key=lambda s: s["staging_bytes"])
    lines += [
        f"  trainer ranks: staging at most {format_size(worst['staging_bytes'])} (rank "
        f"{worst['rank']}: its largest bucket"
        f"{', and a conversion chunk' if worst['convert_bytes'] else ''}), at most "
        f"{max(s['buckets'] for s in senders)} buckets",
        f"predicted refit {p['seconds']:.2f} s (network {p['network_seconds']:.2f} s, "
        f"same node {p['same_node_seconds']:.2f} s, sender convert "
        f"{p['sender_convert_seconds']:.2f} s, receiver {p['receiver_seconds']:.2f} s, fill "
        f"{p['fill_seconds']:.2f} s; of the same node, copies between ranks "
        f"{p['copy_seconds']:.2f} s; "
        f"{format_size(int(r['rates_bytes_per_s']['network_node']))}"
        f"/s per node between nodes, {format_size(int(r['rates_bytes_per_s']['same_node']))}/s "
        "within)",
        *(
            [
                f"  link {r['trainer_link']}: priced at the link's rate; the runtime's messages "
                "are host memory and cross it through device buffers (two copies each, not "
                "priced here)"
            ]
            if r["trainer_link"] in ("hccl", "nccl")
            else []
        ),
        f"  node fan-out: {format_size(max(r['fanout_bytes'], default=0))} copied between "
        "ranks of the busiest node once written; without it (each engine rank receives "
        f"all it holds) {r['without_fanout']['predicted_seconds']:.2f} s, "
        f"{format_size(r['without_fanout']['link_bytes'])} over the links",
        f"storage round trip of the same bytes {trip['predicted_seconds']:.2f} s (save + "
        f"fsync {format_size(trip['bytes_saved'])} {trip['save_seconds']:.2f} s, reload "
        f"{trip['reload_seconds']:.2f} s)",
    ]
    if r["unused_tensors"]:
        lines.append(
            f"  {len(r['unused_tensors'])} manifest tensors no engine rank holds (not sent), "
            f"e.g. {r['unused_tensors'][0]}"
        )
    return lines
