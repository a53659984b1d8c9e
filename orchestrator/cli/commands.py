"""``mxload`` — the command line (SPEC §5). Thin: parse, call the library, print.

Exit status: 0 success; 2 bad input or a refusal (``mxload: error: ...`` on stderr, no
traceback unless ``--debug``); 3 a plan that does not fit; 1 a failed run; 4 ``status``
of a session that does not hold one checkpoint on every rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mxload.cluster.local import mxload_home
from mxload.orchestrator.errors import MxloadError, UsageError
from mxload.orchestrator.plan.engines import DEFAULT_ENGINE, ENGINES
from mxload.orchestrator.plan.sizes import format_size, parse_size
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.models import (
    model_config,
    model_config_path,
    model_names,
    resolve_model,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


# --- flags: each declared once, with the commands it acts on -----------------------------------
#
# Why a table: a flag appears only where it means something (``--max-restarts`` on a load,
# not on ``inspect``), every flag has help text, and a default the user did not give is
# recorded so the output can say which were used. Adding a flag to a set of commands is one
# ``Flag(...)`` entry below; the command reads it as ``args.<dest>``.

ALL = ("demo", "make-checkpoint", "inspect", "plan", "load", "reload", "status", "release", "convert")  # fmt: skip
LAYOUT = ("plan", "load")
"""Commands that take a parallel layout."""
SESSION = ("load", "reload", "status", "release")
"""Commands that reach a detached session or a Ray cluster."""
READS = ("make-checkpoint", "inspect", "plan", "load", "reload", "convert")
"""Commands that open a checkpoint URL through fsspec."""
SOURCE = ("inspect", "plan", "load", "reload", "convert")
"""Commands that read a checkpoint's files (the rules of the storage seam apply)."""

SIZE_HELP = "SIZE with its unit, e.g. 64GiB, 512MiB, 2GB or 1048576B; a bare number is refused"


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its names, the commands it acts on, argparse keywords.

    ``default`` is applied after parsing (argparse sees None) so the command knows which
    defaults were used (``args.defaults_used``); ``size`` flags are parsed with a unit."""

    names: tuple[str, ...]
    commands: tuple[str, ...]
    help: str
    default: Any = None
    size: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    # layout
    Flag(("--tp",), LAYOUT, "tensor-parallel size", 1, kwargs={"type": int, "metavar": "N"}),
    Flag(("--dp",), LAYOUT, "data-parallel size", 1, kwargs={"type": int, "metavar": "N"}),
    Flag(("--pp",), LAYOUT, "pipeline-parallel size", 1, kwargs={"type": int, "metavar": "N"}),
    Flag(
        ("--enable-expert-parallel",),
        LAYOUT,
        "shard MoE experts over tp x dp ranks (vLLM's EP) instead of TP-sharding each expert",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--expert-placement",),
        LAYOUT,
        "how experts map to EP ranks: linear (contiguous blocks) or round_robin",
        "linear",
        kwargs={"choices": ["linear", "round_robin"]},
    ),
    # engine
    Flag(
        ("--engine",),
        ("plan", "load", "convert"),
        "lay buffers out as this engine holds them after its own post-load (names, views, "
        "placement): " + ", ".join(ENGINES),
        DEFAULT_ENGINE,
        kwargs={"choices": list(ENGINES)},
    ),
    Flag(
        ("--engine",),
        ("reload", "status"),
        "the engine the session was loaded for (refused when it differs; default: the session's)",
        kwargs={"choices": list(ENGINES)},
    ),
    # memory
    Flag(
        ("--device-memory",),
        ("plan", "load"),
        f"memory of one device; plans that do not fit exit 3 ({SIZE_HELP})",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    Flag(
        ("--staging-budget",),
        ("plan", "load", "reload"),
        f"host staging memory per rank (default: the largest unit; {SIZE_HELP})",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    # devices and placement
    Flag(
        ("--device",),
        ("load",),
        "where buffers live: npu, cuda, cpu, or auto (npu where torch_npu imports, else cpu)",
        "auto",
        kwargs={"choices": ["auto", "npu", "cuda", "cpu"]},
    ),
    Flag(
        ("--device",),
        ("plan",),
        "device the plan is for (its kernels' scratch differs): npu, cuda, cpu, auto",
        "cpu",
        kwargs={"choices": ["auto", "npu", "cuda", "cpu"]},
    ),
    Flag(
        ("--devices-per-node",),
        ("plan",),
        "devices per node for the per-node headroom summary (ranks packed in order)",
        16,
        kwargs={"type": int, "metavar": "N"},
    ),
    Flag(
        ("--resource",),
        ("load",),
        "Ray resource each rank asks one unit of (default NPU; GPU with --device cuda)",
        kwargs={"metavar": "NAME"},
    ),
    Flag(
        ("--placement",),
        ("load",),
        "Ray placement-group strategy for the ranks' bundles",
        "pack",
        kwargs={"choices": ["pack", "spread", "strict_pack", "strict_spread"]},
    ),
    Flag(
        ("--max-restarts",),
        ("load",),
        "times a lost worker process is restarted and its rank redone before the load fails",
        1,
        kwargs={"type": int, "metavar": "N"},
    ),
    # read once per cluster, and the time model
    Flag(
        ("--share",),
        ("plan", "load"),
        "read-once scope: each replicated read is fetched from storage once per cluster, "
        "once per node, or by every rank (none) and shared through Ray's object store",
        "cluster",
        kwargs={"choices": ["none", "node", "cluster"]},
    ),
    Flag(
        ("--storage-bandwidth",),
        ("plan",),
        "time model: one node's bandwidth to the checkpoint store, per second",
        "5GB",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    Flag(
        ("--storage-aggregate-bandwidth",),
        ("plan",),
        "time model: what the store serves the whole cluster at once, per second",
        "40GB",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    Flag(
        ("--network-bandwidth",),
        ("plan",),
        "time model: one node's inbound network for peers' shared bytes, per second",
        "25GB",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    Flag(
        ("--convert-rate",),
        ("plan",),
        "time model: source bytes one rank converts per second (default: 450MB on cpu, "
        "measured by bench/; 20GB on npu/cuda/auto, an estimate until measured)",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    Flag(
        ("--request-latency",),
        ("plan",),
        "time model: seconds one storage request waits for its first byte (default: "
        "0.01 for an object store or a config-only plan, 0.0001 for a local checkpoint)",
        kwargs={"type": float, "metavar": "SECONDS"},
    ),
    Flag(
        ("--storage-request-rate",),
        ("plan",),
        "time model: requests per second the store serves the whole cluster (0: unlimited)",
        0.0,
        kwargs={"type": float, "metavar": "N"},
    ),
    # cluster and session
    Flag(
        ("--address",),
        SESSION,
        "Ray head to join, HOST:PORT (default: the head recorded in $MXLOAD_HOME, "
        f"here {mxload_home()}; for load, a new local one)",
        kwargs={"metavar": "HOST:PORT"},
    ),
    Flag(
        ("--session",),
        SESSION,
        "detached session name (load: only with --detach)",
        "default",
        kwargs={"metavar": "NAME"},
    ),
    Flag(
        ("--force",),
        ("release",),
        "end the head mxload started and every session on it by pid, without asking Ray "
        "(for a head that is up but does not answer; a dead head is cleaned up without it)",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--detach",),
        ("load",),
        "keep the workers and their buffers alive after the command (then: status, "
        "reload, release)",
        kwargs={"action": "store_true"},
    ),
    # sources and numerics
    Flag(
        ("--storage-options",),
        READS,
        "JSON object passed to fsspec for s3:// or http(s):// URLs, e.g. "
        '\'{"endpoint_url": "http://host:9000"}\'',
        kwargs={"metavar": "JSON"},
    ),
    Flag(
        ("--dtype",),
        ("inspect", "plan", "load", "convert"),
        "model dtype of unquantized tensors, instead of config.json's torch_dtype",
        kwargs={"choices": ["bf16", "fp16", "fp32"]},
    ),
    Flag(
        ("--allow-nonfinite",),
        ("load", "convert"),
        "let NaN/Inf block scales through (they are refused by default, naming the tensor)",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--allow-outside-links",),
        SOURCE,
        "read checkpoint files whose links resolve outside the checkpoint folder (refused "
        "by default: a checkpoint is a folder)",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--connect-timeout",),
        SOURCE,
        "seconds to wait for a remote connection before the attempt fails and is retried "
        "(default 10, at most 60)",
        kwargs={"type": float, "metavar": "S"},
    ),
    Flag(
        ("--read-timeout",),
        SOURCE,
        "seconds to wait for the next bytes of a remote answer before the attempt fails and "
        "is retried (default 30, at most 60)",
        kwargs={"type": float, "metavar": "S"},
    ),
    # outputs
    Flag(
        ("--overwrite",),
        ("load", "status", "convert"),
        "replace a non-empty --dump DIR (convert: DST) whole; refused by default",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--dump",),
        ("load", "status"),
        "write what every rank holds to DIR/rank-NNNNN.safetensors",
        kwargs={"metavar": "DIR"},
    ),
    Flag(
        ("--report",),
        ("load", "reload"),
        "write the run's manifest (JSON) to FILE",
        kwargs={"metavar": "FILE"},
    ),
    Flag(
        ("--json",),
        ALL,
        "machine-readable JSON on stdout (no progress, no table)",
        kwargs={"action": "store_true"},
    ),
    Flag(("--debug",), ALL, "show tracebacks and library logs", kwargs={"action": "store_true"}),
)


def _add_flags(p: argparse.ArgumentParser, command: str) -> None:
    for flag in FLAGS:
        if command in flag.commands:
            shown = flag.help if flag.default is None else f"{flag.help} (default: {flag.default})"
            p.add_argument(*flag.names, dest=flag.dest, default=None, help=shown, **flag.kwargs)


def _apply_defaults(args: argparse.Namespace) -> None:
    """Fill in the defaults the user did not give, record them (``args.defaults_used``,
    shown by the tables), and parse sizes."""
    used: list[str] = []
    for flag in FLAGS:
        if args.command not in flag.commands:
            continue
        value = getattr(args, flag.dest, None)
        if flag.kwargs.get("action") == "store_true":
            setattr(args, flag.dest, bool(value))
            continue
        if value is None and flag.default is not None:
            default = flag.default
            if flag.size and isinstance(default, str):  # "5GB": written as a user would
                default = parse_size(default, flag.names[0], require_unit=True)
            setattr(args, flag.dest, default)
            used.append(f"{flag.names[0]} {flag.default}")
        elif value is not None and flag.size:
            setattr(args, flag.dest, parse_size(value, flag.names[0], require_unit=True))
    args.defaults_used = used


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mxload",
        description="Load block-FP8 checkpoints into Ascend MXFP8 kernel layouts, sharded "
        "over Ray workers, reload them in place, and plan device memory.",
        epilog="Exit status: 0 ok; 2 bad input or a refusal; 3 the plan does not fit; 1 a "
        f"failed run; 4 status: the session is inconsistent. Detached sessions are recorded "
        f"under $MXLOAD_HOME (here: {mxload_home()}; default ~/.mxload). 'mxload COMMAND "
        "--help' for a command's flags.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help)

    p = command("demo", "make a tiny checkpoint, load it on local Ray, reload it in place")
    p.add_argument("--workdir", default=None, metavar="DIR", help="keep the demo's files here")

    p = command("make-checkpoint", "write a synthetic block-FP8 checkpoint in the HF layout")
    p.add_argument("out", metavar="OUT", help="folder or fsspec URL to write")
    p.add_argument("--preset", required=True, help="model shape: " + ", ".join(_preset_names()))
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument(
        "--shards", type=int, default=2, metavar="N", help="safetensors files (default 2)"
    )
    p.add_argument("--bf16", action="store_true", help="write the same model as plain BF16")

    p = command("inspect", "what a checkpoint is: architecture, quantization, tensors, bytes")
    p.add_argument("src", metavar="SRC", help="checkpoint folder or fsspec URL")

    p = command("plan", "per-rank plan and memory table, from a checkpoint or a config alone")
    p.add_argument("src", nargs="?", metavar="SRC", help="checkpoint folder or fsspec URL")
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--config", default=None, metavar="FILE", help="plan from this config.json alone"
    )
    what.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="plan a packaged model from its published config: " + ", ".join(model_names()),
    )

    p = command("load", "distributed load on Ray (a local head unless --address)")
    p.add_argument("src", metavar="SRC", help="checkpoint folder or fsspec URL")

    p = command("reload", "in-place reload of a detached session (checked first)")
    p.add_argument("src", metavar="SRC", help="the new checkpoint (same model)")

    command("status", "a detached session's ranks, versions, addresses, memory")
    command("release", "end a detached session (and the head 'load --detach' started)")

    p = command("convert", "offline block-FP8 -> ModelOpt-style MXFP8 checkpoint")
    p.add_argument("src", metavar="SRC", help="block-FP8 checkpoint folder or fsspec URL")
    p.add_argument("dst", metavar="DST", help="output folder")
    p.add_argument(
        "--numerics",
        choices=("auto", "fast", "reference"),
        default="auto",
        help="conversion path: fast (numba kernels), reference (eager torch, the naive "
        "path), auto = fast where numba works (default)",
    )
    for name, p in sub.choices.items():
        _add_flags(p, name)
    return parser


def _preset_names() -> list[str]:
    # The preset table lives with the synthetic writer; listing it must not import torch.
    return ["qwen3-dense-tiny", "qwen3-moe-awkward", "qwen3-moe-tiny"]


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    from mxload.workers.storage import ALLOW_OUTSIDE_LINKS, CONNECT_TIMEOUT, READ_TIMEOUT

    raw = getattr(args, "storage_options", None)
    value: dict[str, Any] = {}
    if raw:
        try:
            value = json.loads(raw)
        except ValueError as err:
            raise UsageError(
                f"--storage-options: not valid JSON ({err})", key="--storage-options"
            ) from None
        if not isinstance(value, dict):
            raise UsageError("--storage-options: must be a JSON object", key="--storage-options")
    # The source flags travel as storage options: every worker then reads under them.
    if getattr(args, "allow_outside_links", False):
        value[ALLOW_OUTSIDE_LINKS] = True
    for flag, key in (("connect_timeout", CONNECT_TIMEOUT), ("read_timeout", READ_TIMEOUT)):
        if getattr(args, flag, None) is not None:
            value[key] = getattr(args, flag)
    return value or None


def _layout(args: argparse.Namespace) -> ParallelLayout:
    for flag in ("tp", "dp", "pp"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}", key=f"--{flag}")
    return ParallelLayout(
        tp=args.tp,
        dp=args.dp,
        pp=args.pp,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_placement=args.expert_placement,
    )


def _size(args: argparse.Namespace, name: str) -> int | None:
    """A size flag's value in bytes (parsed, with its unit, by ``_apply_defaults``)."""
    value = getattr(args, name, None)
    return None if value is None else int(value)


def _emit(args: argparse.Namespace, obj: Any, human: str) -> None:
    if getattr(args, "json", False):
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(human)


def _progress(args: argparse.Namespace, label: str) -> Any:
    """A progress bar for a long run when stderr is a terminal and --json is off; None
    otherwise (pipes and scripts see no control characters)."""
    if args.json or not sys.stderr.isatty():
        return None
    from mxload.orchestrator.cli.progress import RankProgress

    return RankProgress(label)


# --- commands ---------------------------------------------------------------------------------


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from mxload.workers.tools.synth import PRESETS, make_checkpoint

    if args.preset not in PRESETS:
        raise UsageError(
            f"--preset: unknown preset {args.preset!r}; choose from {', '.join(sorted(PRESETS))}",
            key="--preset",
        )
    summary = make_checkpoint(
        args.out,
        args.preset,
        seed=args.seed,
        shards=args.shards,
        storage_options=_storage_options(args),
        bf16=args.bf16,
    )
    _emit(args, summary, render_made(args, summary))
    return 0


def render_made(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    """``make-checkpoint``'s one-line summary (the details are in ``--json``)."""
    kind = "BF16" if args.bf16 else "block-FP8"
    return (
        f"wrote {kind} {args.preset} (seed {args.seed}) to {args.out}: "
        f"{summary['tensors']} tensors in {summary['shards']} shard(s), "
        f"{format_size(summary['bytes'])}, {len(summary.get('special_tiles', []))} special "
        "tile(s) (--json lists them)"
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    from mxload.orchestrator.runtime.catalog import describe, open_checkpoint

    meta = open_checkpoint(args.src, storage_options=_storage_options(args), dtype=args.dtype)
    info = describe(meta)
    _emit(args, info, render_inspect(args.src, info))
    return 0


def render_inspect(src: str, info: dict[str, Any]) -> str:
    """``inspect``'s human summary: the model, its quantization, bytes per kind, files."""
    quant = info["quantization"]
    if "weight_block_size" in info:
        quant += " (blocks " + "x".join(str(b) for b in info["weight_block_size"]) + ")"
    experts = f", {info['experts']} experts in {info['moe_layers']} MoE layers" if info["experts"] else ""  # fmt: skip
    lines = [
        src,
        f"  model         {info['architecture']}: {info['layers']} layers{experts}, "
        f"hidden {info['hidden_size']}, vocab {info['vocab_size']}, dtype {info['dtype']}",
        f"  quantization  {quant}; {info['quantized_linears']} quantized linears"
        + (
            f"; not converted: {', '.join(info['not_converted'])}"
            if info.get("not_converted")
            else ""
        ),
        f"  tensors       {info['num_tensors']} in {info['num_files']} file(s), "
        f"{format_size(info['tensor_bytes'])}",
        "  bytes by kind "
        + ", ".join(f"{kind} {format_size(n)}" for kind, n in info["tensor_bytes_by_kind"].items()),
        "  bytes by dtype "
        + ", ".join(
            f"{dt} {format_size(n)} ({info['tensors_by_dtype'][dt]} tensors)"
            for dt, n in info["tensor_bytes_by_dtype"].items()
        ),
        "  files",
    ]
    for f in info["files"]:
        lines.append(f"    {f['file']}  {format_size(f['bytes'])}, {f['tensors']} tensors")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from mxload.orchestrator.plan.config import parse_config
    from mxload.orchestrator.plan.planner import build_plan, plan_to_json

    layout = _layout(args)
    meta = None
    if args.model:
        config = parse_config(
            model_config(args.model), str(model_config_path(args.model)), dtype=args.dtype
        )
    elif args.config:
        try:
            with open(args.config, "rb") as f:
                raw = json.loads(f.read())
        except OSError as err:
            raise UsageError(
                f"--config: cannot read {args.config}: {err}", file=args.config
            ) from None
        except ValueError as err:
            raise UsageError(
                f"--config: {args.config} is not JSON: {err}", file=args.config
            ) from None
        config = parse_config(raw, args.config, dtype=args.dtype)
    elif args.src:
        from mxload.orchestrator.runtime.catalog import open_checkpoint

        _refuse_config_as_src(args.src)
        meta = open_checkpoint(args.src, storage_options=_storage_options(args), dtype=args.dtype)
        config = meta.config
    else:
        raise UsageError(
            "plan needs SRC (a checkpoint), --config FILE or --model NAME "
            f"({', '.join(model_names())})"
        )
    plan = build_plan(
        config,
        layout,
        checkpoint=meta,
        staging_budget=_size(args, "staging_budget"),
        device_memory=_size(args, "device_memory"),
        device=args.device,
        remote=bool(args.src) and "://" in args.src and not args.src.startswith("file://"),
        engine=args.engine,
    )
    budget = _size(args, "staging_budget")
    if budget is not None and budget < plan.min_staging_load:
        from mxload.orchestrator.errors import StagingBudgetError

        raise StagingBudgetError(
            f"--staging-budget {budget} bytes is below the minimum a load can run under "
            f"({plan.min_staging_load} bytes)",
            key="--staging-budget",
        )
    obj = plan_to_json(plan)
    add_times(obj, plan, config, args)
    _emit(
        args,
        obj,
        render_plan_table(
            obj, devices_per_node=max(1, args.devices_per_node), defaults_used=args.defaults_used
        ),
    )
    return 0 if obj["fits"] else 3


def add_times(obj: dict[str, Any], plan: Any, config: Any, args: argparse.Namespace) -> None:
    """The time model's prediction (``mxload.orchestrator.plan.timemodel``) into the plan
    object: per rank ``predicted_load_seconds`` / ``predicted_reload_seconds`` and its
    traffic, and the totals under ``time_model``."""
    from mxload.orchestrator.plan.timemodel import (
        CPU_CONVERT_BYTES_PER_S,
        LOCAL_REQUEST_LATENCY_S,
        NPU_CONVERT_BYTES_PER_S,
        REMOTE_REQUEST_LATENCY_S,
        Rates,
        plan_times,
    )

    convert = _size(args, "convert_rate")
    if convert is None:
        convert = int(CPU_CONVERT_BYTES_PER_S if args.device == "cpu" else NPU_CONVERT_BYTES_PER_S)
    for name in ("storage_bandwidth", "storage_aggregate_bandwidth", "network_bandwidth"):
        if (_size(args, name) or 0) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0", key=name)
    if convert <= 0 or args.devices_per_node < 1:
        raise UsageError("--convert-rate and --devices-per-node must be > 0", key="--convert-rate")
    # A config-only plan is for a cluster, whose checkpoint sits in shared storage.
    local = bool(args.src) and not ("://" in args.src and not args.src.startswith("file://"))
    latency = args.request_latency
    if latency is None:
        latency = LOCAL_REQUEST_LATENCY_S if local else REMOTE_REQUEST_LATENCY_S
    if latency < 0 or args.storage_request_rate < 0:
        raise UsageError(
            "--request-latency and --storage-request-rate must be >= 0", key="--request-latency"
        )
    rates = Rates(
        storage_node=float(_size(args, "storage_bandwidth") or 0),
        storage_aggregate=float(_size(args, "storage_aggregate_bandwidth") or 0),
        network_node=float(_size(args, "network_bandwidth") or 0),
        convert=float(convert),
        request_latency=float(latency),
        storage_requests=float(args.storage_request_rate),
    )
    got = plan_times(
        plan,
        config,
        rates=rates,
        scope=args.share,
        devices_per_node=args.devices_per_node,
        local=local,
    )
    for entry, t, tr in zip(obj["ranks"], got["times"], got["traffic"], strict=True):
        entry["predicted_load_seconds"] = round(t.load_seconds, 4)
        entry["predicted_reload_seconds"] = round(t.reload_seconds, 4)
        entry["bytes_from_storage"] = tr.bytes_from_storage
        entry["bytes_from_peers"] = tr.bytes_from_peers
        entry["predicted_requests"] = t.requests
    obj["time_model"] = {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in got.items()
        if k not in ("times", "traffic")
    }


def layout_header(par: dict[str, Any], defaults_used: Sequence[str] = ()) -> list[str]:
    """The layout a table is for, and the defaults that filled in what was not given."""
    lines = [
        f"layout: tp={par['tp']} dp={par['dp']} pp={par['pp']} "
        f"ep={'on' if par['enable_expert_parallel'] else 'off'} "
        f"expert_placement={par.get('expert_placement', 'linear')} world={par['world']}"
    ]
    if defaults_used:
        lines.append("defaults used: " + ", ".join(defaults_used))
    return lines


def _refuse_config_as_src(src: str) -> None:
    """``plan path/config.json`` (or a model name) where a checkpoint folder belongs: say
    which flag was meant instead of failing on a file that is not a folder."""
    if "://" in src and not src.startswith("file://"):
        return
    path = src.removeprefix("file://")
    if os.path.isfile(path):
        raise UsageError(
            f"plan: {src} is a file, not a checkpoint folder; to plan from a config.json "
            f"alone use --config {src}",
            file=src,
            key="--config",
        )
    if not os.path.exists(path):
        try:
            name = resolve_model(src)
        except UsageError:
            return
        raise UsageError(
            f"plan: {src} is not a checkpoint folder; for the packaged model use --model {name}",
            key="--model",
        )


def render_plan_table(
    obj: dict[str, Any], devices_per_node: int = 16, defaults_used: Sequence[str] = ()
) -> str:
    par = obj["parallel"]
    lines = [
        f"model: {obj['model'].get('architecture')}",
        *layout_header(par, defaults_used),
        f"{'rank':>5} {'tp':>3} {'dp':>3} {'pp':>3} {'ep':>3} {'layers':>9} {'experts':>8} "
        f"{'persistent':>12} {'staging':>11} {'peak':>12} {'read':>11} {'amp':>6} {'headroom':>12}"
        f" {'load s':>7}",
    ]
    dev = obj.get("device_memory_bytes")
    ranks = obj["ranks"]
    # Many ranks: the first 32 and the last 8, the note standing where rows are left out.
    gap = 32 if len(ranks) > 64 else len(ranks)
    shown = ranks if len(ranks) <= 64 else ranks[:32] + ranks[-8:]
    for i, r in enumerate(shown):
        if i == gap:
            lines.append(f"  ... {len(ranks) - len(shown)} more ranks (see --json)")
        layers = f"{r['layers'][0]}-{r['layers'][-1]}" if r["layers"] else "-"
        amp = r["bytes_to_read"] / r["bytes_needed"] if r["bytes_needed"] else 0.0
        head = format_size(dev - r["peak_bytes"]) if dev is not None else "-"
        lines.append(
            f"{r['rank']:>5} {r['tp_rank']:>3} {r['dp_rank']:>3} {r['pp_rank']:>3} {r['ep_rank']:>3} "
            f"{layers:>9} {len(r['experts']):>8} {format_size(r['persistent_bytes']):>12} "
            f"{format_size(r['staging_bytes']):>11} {format_size(r['peak_bytes']):>12} "
            f"{format_size(r['bytes_to_read']):>11} {amp:>6.3f} {head:>12}"
            f" {r.get('predicted_load_seconds', 0.0):>7.2f}"
        )
    tm = obj.get("time_model")
    if tm:
        rates = tm["rates_bytes_per_s"]
        lines.append(
            f"predicted load {tm['predicted_load_seconds']:.2f} s, reload "
            f"{tm['predicted_reload_seconds']:.2f} s (--share {tm['share']}: "
            f"{format_size(tm['bytes_from_storage'])} from storage, distinct reads "
            f"{format_size(tm['distinct_read_bytes'])}; storage {format_size(int(rates['storage_node']))}/s "
            f"per node, {format_size(int(rates['storage_aggregate']))}/s aggregate, network "
            f"{format_size(int(rates['network_node']))}/s per node, convert "
            f"{format_size(int(rates['convert']))}/s per rank; {tm['nodes']} nodes of "
            f"{tm['devices_per_node']})"
        )
        lines.append(
            f"storage requests: {tm['requests_to_storage']} in all, "
            f"{tm['request_latency_s'] * 1000:g} ms each, {tm['request_concurrency']} in "
            "flight per rank"
            + (
                f", store serves {tm['storage_requests_per_s']:g}/s"
                if tm["storage_requests_per_s"]
                else ""
            )
            + (
                f"; the slowest rank waits {tm['slowest_request_seconds']:.1f} s on requests "
                "(K-split slices are one request per row from an object store)"
                if tm.get("slowest_request_seconds", 0) > 0.5 * tm["predicted_load_seconds"]
                else ""
            )
        )
    mins = obj["min_staging_bytes"]
    lines.append(
        f"minimum staging budget: load {format_size(mins['load'])}, reload {format_size(mins['reload'])}"
    )
    if dev is not None:
        lines.append(
            f"device memory {format_size(dev)}: {'fits' if obj['fits'] else 'DOES NOT FIT'}"
        )
        ranks = obj["ranks"]
        nodes = [ranks[i : i + devices_per_node] for i in range(0, len(ranks), devices_per_node)]
        lines.append(f"per node ({devices_per_node} devices each, ranks packed in order):")
        for n, group in enumerate(nodes[:16]):
            worst = max(group, key=lambda r: r["peak_bytes"])
            lines.append(
                f"  node {n}: ranks {group[0]['rank']}-{group[-1]['rank']}, tightest rank "
                f"{worst['rank']} headroom {format_size(dev - worst['peak_bytes'])}"
            )
        if len(nodes) > 16:
            lines.append(f"  ... {len(nodes) - 16} more nodes")
    return "\n".join(lines)


def render_load_table(manifest: dict[str, Any]) -> str:
    lines = [
        f"{'rank':>5} {'node':>10} {'dev':>4} {'backend':>14} {'tensors':>8} {'GB':>8} "
        f"{'read amp':>8} {'staging pred':>13} {'measured':>11} {'seconds':>8} {'version':>7}"
    ]
    for r in manifest["ranks"]:
        gb = sum(t["nbytes"] for t in r["tensors"].values()) / 1e9
        amp = r.get("read_amplification") or 0.0
        lines.append(
            f"{r['rank']:>5} {str(r['node_id'])[:10]:>10} {r['visible_devices'] or '-':>4} "
            f"{r.get('backend', ''):>14} {len(r['tensors']):>8} {gb:>8.4f} {amp:>8.3f} "
            f"{format_size(r['predicted_peak_staging_bytes'] or 0):>13} "
            f"{format_size(r['measured_peak_staging_bytes'] or 0):>11} {r['seconds'] or 0:>8.2f} "
            f"{r['version']!s:>7}"
        )
    for note in sorted({r.get("backend_note", "") for r in manifest["ranks"]} - {""}):
        lines.append(f"compute: {note}")
    return "\n".join(lines)


def _load_request(args: argparse.Namespace) -> Any:
    from mxload.orchestrator.runtime.driver import LoadRequest

    if args.max_restarts < 0:
        raise UsageError(
            f"--max-restarts must be >= 0, got {args.max_restarts}", key="--max-restarts"
        )

    return LoadRequest(
        src=args.src,
        layout=_layout(args),
        storage_options=_storage_options(args),
        device=args.device,
        resource=args.resource,
        placement=args.placement,
        address=args.address,
        staging_budget=_size(args, "staging_budget"),
        device_memory=_size(args, "device_memory"),
        dtype=args.dtype,
        allow_nonfinite=args.allow_nonfinite,
        max_restarts=args.max_restarts,
        engine=args.engine,
        share=args.share,
    )


def _write_report(path: str | None, manifest: dict[str, Any]) -> None:
    from mxload.orchestrator.runtime.outputs import write_file_atomic

    if path is not None:
        write_file_atomic(path, json.dumps(manifest, indent=1).encode(), "--report")


def _outputs(args: argparse.Namespace) -> Any:
    """Check --report and --dump before any work (outputs.py); the checked --dump target."""
    from mxload.orchestrator.runtime.outputs import OutputDir, check_file_target

    check_file_target(getattr(args, "report", None), "--report")
    dump = getattr(args, "dump", None)
    if dump is None:
        return None
    target = OutputDir(dump, "--dump", overwrite=args.overwrite)
    target.check()
    return target


def cmd_load(args: argparse.Namespace) -> int:
    req = _load_request(args)
    args.dump = _outputs(args)
    show = _progress(args, "load")
    try:
        if args.detach:
            from mxload.orchestrator.runtime.detached import detached_load

            manifest = detached_load(req, session=args.session, dump=args.dump, on_progress=show)
        else:
            from mxload.orchestrator.runtime.driver import load

            manifest, _ = load(req, dump=args.dump, on_progress=show)
    finally:
        if show:
            show.close()
    _write_report(args.report, manifest)
    header = layout_header(manifest["parallel"], args.defaults_used)
    _emit(args, manifest, "\n".join([*header, render_load_table(manifest)]))
    if args.detach:
        # On stderr under --json, so stdout stays one JSON object.
        print(detach_note(manifest, args.session), file=sys.stderr if args.json else sys.stdout)
    return 0


def detach_note(manifest: dict[str, Any], session: str) -> str:
    """What a detached load leaves behind and the commands that come next."""
    from mxload.cluster.local import mxload_home

    flag = "" if session == "default" else f" --session {session}"
    return "\n".join(
        [
            f"session {session!r} is loaded and detached: {len(manifest['ranks'])} workers "
            f"hold the weights on the Ray head at {manifest.get('address')} "
            f"(recorded in {mxload_home()})",
            "next:",
            f"  mxload status{flag}            versions, consistency, addresses",
            f"  mxload reload NEW_SRC{flag}    rewrite the weights in place",
            f"  mxload release{flag}           end the session and free the devices",
        ]
    )


def cmd_reload(args: argparse.Namespace) -> int:
    from mxload.orchestrator.runtime.detached import detached_reload

    _outputs(args)
    show = _progress(args, "reload")
    try:
        manifest = detached_reload(
            args.src,
            session=args.session,
            address=args.address,
            storage_options=_storage_options(args),
            staging_budget=_size(args, "staging_budget"),
            engine=args.engine,
            on_progress=show,
        )
    finally:
        if show:
            show.close()
    _write_report(args.report, manifest)
    moved = manifest.get("addresses_moved", [])
    _emit(
        args,
        manifest,
        render_load_table(manifest)
        + f"\nreloaded to version {manifest['ranks'][0]['version']}; addresses moved: {len(moved)}",
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from mxload.orchestrator.runtime.detached import detached_status

    dump = _outputs(args)
    manifest = detached_status(
        session=args.session, address=args.address, dump=dump, engine=args.engine
    )
    consistent = bool(manifest["consistent"])
    versions = sorted({r["version"] for r in manifest["ranks"]})
    _emit(
        args,
        manifest,
        "\n".join(
            [
                *status_headline(manifest),
                render_load_table(manifest),
                f"versions {versions}; consistent: {consistent}",
            ]
        ),
    )
    return 0 if consistent else STATUS_INCONSISTENT


STATUS_INCONSISTENT = 4
"""``mxload status`` exit status while the session does not hold one checkpoint everywhere
(a failed or running reload, ranks or replicas that disagree, moved buffers)."""


def status_headline(manifest: dict[str, Any]) -> list[str]:
    """First lines of human ``status``: the verdict, then each reason and notice."""
    ident = manifest["identity"]
    world = len(manifest["ranks"])
    if manifest["consistent"]:
        lines = [
            f"CONSISTENT: all {world} ranks hold version {ident['version']} of "
            f"{ident['src']} (checkpoint {ident['fingerprint'][:12]}); replicated buffers agree"
        ]
    else:
        lines = [f"INCONSISTENT: {manifest['problems'][0]}"]
        lines += [f"  also: {p}" for p in manifest["problems"][1:]]
        lines.append(
            f"  the session records version {ident['version']} of {ident['src']}; "
            "`mxload reload SRC` rewrites every unit not at its checkpoint"
        )
    lines += [f"note: {n}" for n in manifest.get("notices", [])]
    return lines


def cmd_release(args: argparse.Namespace) -> int:
    from mxload.orchestrator.runtime.detached import detached_release

    info = detached_release(session=args.session, address=args.address, force=args.force)
    if "processes_ended" in info:
        why = (
            f"its head was down ({'; '.join(info['head_down'])})"
            if info["head_down"]
            else "--force"
        )
        human = (
            f"released session {args.session!r}: {why}; ended {len(info['processes_ended'])} "
            f"process(es), removed the head's record and temp dir and the records of "
            f"sessions {info['sessions_removed']}"
        )
    else:
        human = (
            f"released session {args.session!r}: {info['workers_ended']} worker(s) ended; "
            f"head stopped: {info['head_stopped']}"
        )
    _emit(args, info, human)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from mxload.workers.tools.convert import convert_checkpoint

    summary = convert_checkpoint(
        args.src,
        args.dst,
        storage_options=_storage_options(args),
        dtype=args.dtype,
        allow_nonfinite=args.allow_nonfinite,
        progress=sys.stderr.isatty() and not args.json,
        numerics=args.numerics,
        engine=args.engine,
        overwrite=args.overwrite,
    )
    _emit(args, summary, f"converted {args.src} -> {args.dst}: {json.dumps(summary)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mxload.orchestrator.cli.demo import run_demo

    return run_demo(workdir=args.workdir, json_out=args.json)


COMMANDS = {
    "demo": cmd_demo,
    "make-checkpoint": cmd_make_checkpoint,
    "inspect": cmd_inspect,
    "plan": cmd_plan,
    "load": cmd_load,
    "reload": cmd_reload,
    "status": cmd_status,
    "release": cmd_release,
    "convert": cmd_convert,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if not debug:
        warnings.filterwarnings("ignore")
        logging.getLogger("ray").setLevel(logging.ERROR)
    # Before anything imports Ray: loopback only, no usage stats (cluster/local.py).
    import mxload.cluster.local  # noqa: F401

    try:
        args = build_parser().parse_args(argv)
        if not args.command:
            raise UsageError("a command is required: " + ", ".join(COMMANDS))
        _apply_defaults(args)
        return COMMANDS[args.command](args)
    except MxloadError as err:
        if debug:
            if err.context.get("details"):  # the worker's own traceback, then ours
                sys.stderr.write(f"--- from the worker ---\n{err.context['details']}\n")
            raise
        return report_error(err, err.exit_code, argv)
    except KeyboardInterrupt:
        sys.stderr.write("mxload: interrupted\n")
        return 130
    except BrokenPipeError:
        # `mxload plan ... | head`: the reader left; say nothing more, like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # a failed run: say what failed, no traceback
        if debug:
            raise
        return report_error(err, 1, argv)


def report_error(err: BaseException, code: int, argv: Sequence[str]) -> int:
    """One line on stderr, ``mxload: error: ...``, without colour codes or traceback.
    A failed run or a worker's error also gets a log file (the traceback, the worker's
    remote traceback) whose path is printed on a second line; ``--debug`` shows them."""
    from mxload.orchestrator.runtime.driver import first_line, plain

    context = err.context if isinstance(err, MxloadError) else {}
    text = plain(str(err)) if isinstance(err, MxloadError) else f"{type(err).__name__}: {first_line(err)}"  # fmt: skip
    sys.stderr.write(f"mxload: error: {text}\n")
    if code == 1 or "details" in context:
        log = write_error_log(err, argv)
        if log:
            sys.stderr.write(f"mxload: the traceback is in {log} (or rerun with --debug)\n")
    return code


def write_error_log(err: BaseException, argv: Sequence[str]) -> str | None:
    """Write what a user would need to report a failure; the file's path, or None when no
    folder can take it. Under $MXLOAD_HOME/logs, else the temp folder."""
    import tempfile
    import time
    import traceback

    body = [
        f"mxload {' '.join(argv)}",
        f"at {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}",
        "",
        *traceback.format_exception(type(err), err, err.__traceback__),
    ]
    details = err.context.get("details") if isinstance(err, MxloadError) else None
    if details:
        body += ["", "--- from the worker ---", str(details)]
    name = f"mxload-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for folder in (mxload_home() / "logs", tempfile.gettempdir()):
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, name)
            with open(path, "w") as f:
                f.write("\n".join(body) + "\n")
            return path
        except OSError:
            continue
    return None
