"""``mxload`` — the command line (SPEC §5). Thin: parse, call the library, print.

Exit status: 0 success; 2 bad input or a refusal (``mxload: error: ...`` on stderr, no
traceback unless ``--debug``); 3 a plan that does not fit; 1 a failed run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .errors import MxloadError, UsageError
from .plantypes import ParallelLayout
from .sizes import format_size, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="model dtype override")
    p.add_argument("--allow-nonfinite", action="store_true", help="let NaN/Inf scales through")
    p.add_argument("--max-restarts", type=int, default=1, help="restarts per worker")
    p.add_argument("--storage-options", default=None, help="JSON object passed to fsspec")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def _add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--expert-placement", choices=["linear", "round_robin"], default="linear")


def _add_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="join an existing Ray cluster")
    p.add_argument("--session", default="default", help="detached session name")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mxload", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    p = sub.add_parser("demo", help="make a tiny checkpoint, load it on local Ray, reload it")
    _add_common(p)
    p.add_argument("--workdir", default=None, help="keep the demo's files here")

    p = sub.add_parser("make-checkpoint", help="write a synthetic block-FP8 checkpoint")
    p.add_argument("out")
    p.add_argument("--preset", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="write the same model as plain BF16")
    _add_common(p)

    p = sub.add_parser("inspect", help="what a checkpoint is")
    p.add_argument("src")
    _add_common(p)

    p = sub.add_parser("plan", help="per-rank plan and memory table")
    p.add_argument("src", nargs="?")
    p.add_argument("--config", default=None, help="plan from config.json alone")
    _add_layout(p)
    p.add_argument("--device-memory", default=None)
    p.add_argument("--staging-budget", default=None)
    p.add_argument("--device", default="cpu", choices=["auto", "npu", "cuda", "cpu"])
    p.add_argument(
        "--devices-per-node",
        type=int,
        default=16,
        help="devices per node for the per-node headroom summary (ranks packed in order)",
    )
    _add_common(p)

    p = sub.add_parser("load", help="distributed load on Ray")
    p.add_argument("src")
    _add_layout(p)
    p.add_argument("--device", default="auto", choices=["auto", "npu", "cuda", "cpu"])
    p.add_argument(
        "--resource", default=None, help="accelerator resource (default NPU; GPU for cuda)"
    )
    p.add_argument(
        "--placement", default="pack", choices=["pack", "spread", "strict_pack", "strict_spread"]
    )
    p.add_argument("--staging-budget", default=None)
    p.add_argument("--device-memory", default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--report", default=None)
    p.add_argument("--detach", action="store_true")
    _add_cluster(p)
    _add_common(p)

    p = sub.add_parser("reload", help="in-place reload of a detached session")
    p.add_argument("src")
    p.add_argument("--staging-budget", default=None)
    p.add_argument("--report", default=None)
    _add_cluster(p)
    _add_common(p)

    p = sub.add_parser("status", help="a detached session's ranks, versions, addresses")
    p.add_argument("--dump", default=None)
    _add_cluster(p)
    _add_common(p)

    p = sub.add_parser("release", help="end a detached session")
    _add_cluster(p)
    _add_common(p)

    p = sub.add_parser("convert", help="offline block-FP8 -> ModelOpt-style MXFP8 checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--numerics",
        choices=("auto", "fast", "reference"),
        default="auto",
        help="conversion path: fast (numba kernels), reference (eager torch, the naive "
        "path), auto = fast where numba works (default)",
    )
    _add_common(p)
    return parser


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    raw = getattr(args, "storage_options", None)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError as err:
        raise UsageError(
            f"--storage-options: not valid JSON ({err})", key="--storage-options"
        ) from None
    if not isinstance(value, dict):
        raise UsageError("--storage-options: must be a JSON object", key="--storage-options")
    return value


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
    raw = getattr(args, name, None)
    if raw is None:
        return None
    return parse_size(raw, "--" + name.replace("_", "-"))


def _emit(args: argparse.Namespace, obj: Any, human: str) -> None:
    if getattr(args, "json", False):
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(human)


def _progress_printer(enabled: bool) -> Any:
    if not enabled:
        return None

    def show(progress: list[tuple[int, int, int]]) -> None:
        done = sum(p[0] for p in progress)
        total = sum(p[1] for p in progress) or 1
        nbytes = sum(p[2] for p in progress)
        sys.stderr.write(f"\r  units {done}/{total}  read {format_size(nbytes)}   ")
        sys.stderr.flush()

    return show


# --- commands ---------------------------------------------------------------------------------


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from mxload.workers.synth import PRESETS, make_checkpoint

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
    _emit(
        args,
        summary,
        f"wrote {args.preset} (seed {args.seed}) to {args.out}: {json.dumps(summary)}",
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .catalog import describe, open_checkpoint

    meta = open_checkpoint(args.src, storage_options=_storage_options(args), dtype=args.dtype)
    info = describe(meta)
    lines = [f"{args.src}"]
    for k, v in info.items():
        if isinstance(v, dict | list) and len(json.dumps(v)) > 100:
            lines.append(f"  {k}: {json.dumps(v)[:300]}...")
        else:
            lines.append(f"  {k}: {v}")
    _emit(args, info, "\n".join(lines))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .config import parse_config
    from .planner import build_plan, plan_to_json

    layout = _layout(args)
    meta = None
    if args.config:
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
        from .catalog import open_checkpoint

        meta = open_checkpoint(args.src, storage_options=_storage_options(args), dtype=args.dtype)
        config = meta.config
    else:
        raise UsageError("plan needs SRC or --config FILE")
    plan = build_plan(
        config,
        layout,
        checkpoint=meta,
        staging_budget=_size(args, "staging_budget"),
        device_memory=_size(args, "device_memory"),
        device=args.device,
        remote=bool(args.src) and "://" in args.src and not args.src.startswith("file://"),
    )
    budget = _size(args, "staging_budget")
    if budget is not None and budget < plan.min_staging_load:
        from .errors import StagingBudgetError

        raise StagingBudgetError(
            f"--staging-budget {budget} bytes is below the minimum a load can run under "
            f"({plan.min_staging_load} bytes)",
            key="--staging-budget",
        )
    obj = plan_to_json(plan)
    _emit(args, obj, render_plan_table(obj, devices_per_node=max(1, args.devices_per_node)))
    return 0 if obj["fits"] else 3


def render_plan_table(obj: dict[str, Any], devices_per_node: int = 16) -> str:
    par = obj["parallel"]
    lines = [
        f"{obj['model'].get('architecture')}  tp={par['tp']} dp={par['dp']} pp={par['pp']} "
        f"ep={'on' if par['enable_expert_parallel'] else 'off'} world={par['world']}",
        f"{'rank':>5} {'tp':>3} {'dp':>3} {'pp':>3} {'ep':>3} {'layers':>9} {'experts':>8} "
        f"{'persistent':>12} {'staging':>11} {'peak':>12} {'read':>11} {'amp':>6} {'headroom':>12}",
    ]
    dev = obj.get("device_memory_bytes")
    shown = obj["ranks"] if len(obj["ranks"]) <= 64 else obj["ranks"][:32] + obj["ranks"][-8:]
    for r in shown:
        layers = f"{r['layers'][0]}-{r['layers'][-1]}" if r["layers"] else "-"
        amp = r["bytes_to_read"] / r["bytes_needed"] if r["bytes_needed"] else 0.0
        head = format_size(dev - r["peak_bytes"]) if dev is not None else "-"
        lines.append(
            f"{r['rank']:>5} {r['tp_rank']:>3} {r['dp_rank']:>3} {r['pp_rank']:>3} {r['ep_rank']:>3} "
            f"{layers:>9} {len(r['experts']):>8} {format_size(r['persistent_bytes']):>12} "
            f"{format_size(r['staging_bytes']):>11} {format_size(r['peak_bytes']):>12} "
            f"{format_size(r['bytes_to_read']):>11} {amp:>6.3f} {head:>12}"
        )
    if len(shown) < len(obj["ranks"]):
        lines.append(f"  ... {len(obj['ranks']) - len(shown)} more ranks (see --json)")
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
    from .driver import LoadRequest

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
    )


def _write_report(path: str | None, manifest: dict[str, Any]) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)


def cmd_load(args: argparse.Namespace) -> int:
    req = _load_request(args)
    show = _progress_printer(sys.stderr.isatty() and not args.json)
    if args.detach:
        from .detached import detached_load

        manifest = detached_load(req, session=args.session, dump=args.dump, on_progress=show)
    else:
        from .driver import load

        manifest, _ = load(req, dump=args.dump, on_progress=show)
    if show:
        sys.stderr.write("\n")
    _write_report(args.report, manifest)
    _emit(args, manifest, render_load_table(manifest))
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    from .detached import detached_reload

    manifest = detached_reload(
        args.src,
        session=args.session,
        address=args.address,
        storage_options=_storage_options(args),
        staging_budget=_size(args, "staging_budget"),
    )
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
    from .detached import detached_status

    manifest = detached_status(session=args.session, address=args.address, dump=args.dump)
    consistent = all(r["consistent"] for r in manifest["ranks"])
    versions = sorted({r["version"] for r in manifest["ranks"]})
    _emit(
        args,
        manifest,
        render_load_table(manifest) + f"\nversions {versions}; consistent: {consistent}",
    )
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from .detached import detached_release

    info = detached_release(session=args.session, address=args.address)
    _emit(args, info, f"released session {args.session!r}: {info}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from mxload.workers.convert import convert_checkpoint

    summary = convert_checkpoint(
        args.src,
        args.dst,
        storage_options=_storage_options(args),
        dtype=args.dtype,
        allow_nonfinite=args.allow_nonfinite,
        progress=sys.stderr.isatty() and not args.json,
        numerics=args.numerics,
    )
    _emit(args, summary, f"converted {args.src} -> {args.dst}: {json.dumps(summary)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

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
        return COMMANDS[args.command](args)
    except MxloadError as err:
        if debug:
            raise
        sys.stderr.write(f"mxload: error: {err}\n")
        return err.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("mxload: interrupted\n")
        return 130
    except Exception as err:  # a failed run: say what failed, no traceback
        if debug:
            raise
        sys.stderr.write(f"mxload: error: {type(err).__name__}: {err}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
