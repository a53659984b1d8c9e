"""``mxload``'s commands: one function per command, each calling the library and printing
through ``rendering.py``; ``main`` parses (``flags.py``), dispatches and turns errors into
exit statuses (docs/contract.md §5).

Exit status: 0 success; 2 bad input or a refusal (``mxload: error: ...`` on stderr, no
traceback unless ``--debug``); 3 a plan that does not fit; 1 a failed run; 4 ``status``
of a session that does not hold one checkpoint on every rank; 130 interrupted (Ctrl-C),
143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...cluster.local import mxload_home
from ..errors import MxloadError, OutputError, UsageError
from ..runtime.models import model_config, model_config_path, model_names
from . import flags
from . import rendering as show

if TYPE_CHECKING:
    from ..plan.checkpoint import CheckpointMeta
    from ..plan.config import ModelConfig
    from ..plan.types import ParallelLayout, Plan
    from ..runtime.outputs import OutputDir
    from ..runtime.request import LoadRequest

log = logging.getLogger(__name__)


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from ..runtime.outputs import OutputDir
    from ..tools.synth import PRESETS, make_checkpoint

    if args.preset not in PRESETS:
        raise UsageError(
            f"--preset: unknown preset {args.preset!r}; choose from {', '.join(sorted(PRESETS))}",
            key="--preset",
        )
    options = flags.storage_options(args)
    if args.bf16 and args.scale_dtype:
        raise UsageError(
            "--scale-dtype: a --bf16 checkpoint has no block scales; give one or the other",
            key="--scale-dtype",
        )
    out = OutputDir(args.out, "OUT", overwrite=args.overwrite, storage_options=options)
    out.check()
    with out:
        assert out.path is not None
        summary = make_checkpoint(
            out.path,
            args.preset,
            seed=args.seed,
            shards=args.shards,
            storage_options=options,
            bf16=args.bf16,
            scale_dtype=args.scale_dtype or "F32",
        )
    summary["out"] = args.out  # the place it now is, not the folder it was written in
    show.emit(args, summary, show.render_made(summary, bf16=args.bf16))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..runtime.catalog import describe, open_checkpoint

    opts = flags.storage_options(args)
    meta = open_checkpoint(args.src, storage_options=opts, dtype=args.dtype)
    info = describe(meta)
    show.emit(args, info, show.render_inspect(args.src, info))
    return 0


def _plan_config(args: argparse.Namespace) -> tuple[ModelConfig, CheckpointMeta | None]:
    """The model config ``plan`` is for, and the checkpoint when it reads one."""
    from ..plan.config import parse_config

    if args.model:
        path = str(model_config_path(args.model))
        return parse_config(model_config(args.model), path, dtype=args.dtype), None
    if args.config:
        if os.path.isdir(args.config):
            hint = os.path.join(args.config, "config.json")
            msg = f"--config {args.config}: is a folder; give its config.json ({hint})"
            raise UsageError(msg, file=args.config, key="--config")
        from ...workers.storage.local import read_whole
        from ...workers.storage.store import MAX_METADATA_BYTES

        try:
            # A regular file under the metadata cap (docs/contract.md §1.4), as a
            # checkpoint's own config.json: not a FIFO, a device or a 3 GiB sparse file.
            raw = json.loads(read_whole(os.path.abspath(args.config), MAX_METADATA_BYTES))
        except MxloadError as err:
            raise UsageError(f"--config: {err}", file=args.config, key="--config") from None
        except OSError as err:
            msg = f"--config: cannot read {args.config}: {err}"
            raise UsageError(msg, file=args.config) from None
        except (ValueError, RecursionError) as err:
            reason = str(err) if isinstance(err, ValueError) else "nested too deeply"
            msg = f"--config: {args.config} is not JSON: {reason}"
            raise UsageError(msg, file=args.config) from None
        return parse_config(raw, args.config, dtype=args.dtype), None
    if args.src:
        from ..runtime.catalog import open_checkpoint

        flags.check_plan_source(args.src)
        opts = flags.storage_options(args)
        meta = open_checkpoint(args.src, storage_options=opts, dtype=args.dtype)
        return meta.config, meta
    raise UsageError(
        f"plan needs SRC (a checkpoint), --config FILE or --model NAME ({', '.join(model_names())})"
    )


def _local_source(args: argparse.Namespace) -> bool:
    """``plan`` reads a local checkpoint; without SRC the time model takes an object store."""
    return bool(args.src) and not flags.is_remote(args.src)


def _build_plan(
    args: argparse.Namespace,
    config: ModelConfig,
    meta: CheckpointMeta | None,
    layout: ParallelLayout,
    *,
    device_memory: bool,
) -> Plan:
    """The plan of ``layout`` under the command's flags (``device_memory``: checked too)."""
    from ..plan.planner import build_plan

    return build_plan(
        config,
        layout,
        checkpoint=meta,
        staging_budget=flags.size(args, "staging_budget"),
        device_memory=flags.size(args, "device_memory") if device_memory else None,
        device=args.device,
        remote=flags.is_remote(args.src),
        engine=args.engine,
        read_ahead=not _local_source(args),
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from ..errors import StagingBudgetError
    from ..plan.planner import plan_to_json

    layout = flags.layout(args)
    if args.from_trainer is None:
        from .refit import refuse_refit_flags

        refuse_refit_flags(args)
    config, meta = _plan_config(args)
    # the engine's knobs are checked whether or not the cache is sized (--device-memory)
    from ..plan.kvcache import max_model_len

    max_model_len(config, flags.serve_knobs(args))
    budget = flags.size(args, "staging_budget")
    plan = _build_plan(args, config, meta, layout, device_memory=True)
    if budget is not None and budget < plan.min_staging_load:
        raise StagingBudgetError(
            f"--staging-budget {budget} bytes is below the minimum a load can run under "
            f"({plan.min_staging_load} bytes)",
            key="--staging-budget",
        )
    obj = plan_to_json(plan)
    obj["device"] = args.device
    if obj["device_memory_bytes"] is None:
        obj["fits"] = None  # not checked: no --device-memory (docs/contract.md §5)
    else:
        add_kv_cache(obj, config, args)
    add_times(obj, plan, config, args, meta)
    per_node = max(1, args.devices_per_node)
    human = show.render_plan_table(obj, per_node, args.defaults_used)
    if args.from_trainer is not None:
        from .refit import add_refit

        human += "\n" + add_refit(obj, plan, config, args)
    show.emit(args, obj, human)
    return 3 if obj["fits"] is False else 0


def add_kv_cache(obj: dict[str, Any], config: Any, args: argparse.Namespace) -> None:
    """The engine's KV cache beside the weights (``plan/kvcache.py``): per rank its room,
    the longest request it holds alone and the batch of ``--max-model-len`` requests;
    under ``kv_cache`` the knobs and whether every rank holds one such request, which
    ``fits`` then requires too (docs/contract.md §5)."""
    from ..plan.kvcache import rank_rooms

    knobs = flags.serve_knobs(args)
    ranks = obj["ranks"]
    parallel = obj["parallel"]
    # an MTP drafter's attention layers sit with the last stage's (mxload plans MTP
    # with --pp 1), their cache in the same pool
    draft = config.mtp_layers if knobs.num_speculative_tokens else 0
    last = parallel["pp"] - 1
    rooms = rank_rooms(
        config,
        parallel["tp"],
        [(r["layers"], draft if r["pp_rank"] == last else 0, r["peak_bytes"]) for r in ranks],
        obj["device_memory_bytes"],
        knobs,
        args.device,
    )
    held = [(r, room) for r, room in zip(ranks, rooms, strict=True) if room is not None]
    for entry, room in held:
        entry["kv_cache"] = {
            "room_bytes": room.room_bytes,
            "bytes_per_sequence": room.bytes_per_sequence,
            "blocks": room.blocks,
            "largest_context": room.largest_context,
            "largest_batch": room.largest_batch,
        }
    summary: dict[str, Any] = {
        "gpu_memory_utilization": knobs.gpu_memory_utilization,
        "max_model_len": held[0][1].max_model_len if held else knobs.max_model_len,
        "max_num_seqs": knobs.max_num_seqs,
        "kv_cache_dtype": knobs.kv_cache_dtype,
        "enable_prefix_caching": knobs.enable_prefix_caching,
        "fits": all(room.fits for _, room in held),
    }
    if held:
        entry, room = min(held, key=lambda h: (h[1].largest_batch, h[1].largest_context))
        g = room.geometry
        summary.update(
            kind=g.kind,
            block_size=g.block_size,
            page_bytes=g.page_bytes,
            block_bytes=g.block_bytes,
            tightest_rank=entry["rank"],
        )
    obj["kv_cache"] = summary
    obj["fits"] = bool(obj["fits"]) and summary["fits"]


def add_times(
    obj: dict[str, Any],
    plan: Plan,
    config: ModelConfig,
    args: argparse.Namespace,
    meta: CheckpointMeta | None = None,
) -> None:
    """The time model's prediction (``mxload.orchestrator.plan.timemodel``) into the plan
    object: per rank ``predicted_load_seconds`` / ``predicted_reload_seconds`` and its
    traffic, and the totals under ``time_model``."""
    from ..plan.timemodel import plan_times

    rates = flags.time_model_rates(args)
    local = _local_source(args)
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
    if got["slowest_request_seconds"] > 0.5 * got["predicted_load_seconds"]:
        obj["time_model"]["request_bound"] = request_bound(plan, config, args, got, meta)


REQUEST_KINDS = {
    "moe_w2": "expert w2",
    "moe_w13": "expert w13",
    "linear": "linears",
    "copy": "norms and embeddings",
}


def request_bound(
    plan: Plan,
    config: ModelConfig,
    args: argparse.Namespace,
    got: dict[str, Any],
    meta: CheckpointMeta | None,
) -> dict[str, Any]:
    """Why requests bound the slowest rank, and the flags that would help, each with its
    predicted time (the plan rebuilt under it)."""
    from dataclasses import replace

    from ..errors import MxloadError
    from ..plan.timemodel import plan_times

    kinds = sorted(got["slowest_rank_requests_by_kind"].items(), key=lambda kv: -kv[1])
    layout = plan.layout
    cause = ", ".join(f"{REQUEST_KINDS.get(k, k)} {n}" for k, n in kinds if n)
    moe_split = config.is_moe and not layout.enable_expert_parallel
    if moe_split:
        cause += "; every rank reads its slice of every expert"
    options: list[tuple[str, ParallelLayout, str]] = []
    if moe_split:
        options.append(
            ("--enable-expert-parallel", replace(layout, enable_expert_parallel=True), args.share)
        )
    if args.share != "cluster":
        options.append(("--share cluster", layout, "cluster"))
        if moe_split:
            ep = replace(layout, enable_expert_parallel=True)
            options.append(("--enable-expert-parallel --share cluster", ep, "cluster"))
    helps = []
    for flag, lay, scope in options:
        try:
            # The same layout under another share scope: the same plan.
            alt = (
                plan if lay == layout else _build_plan(args, config, meta, lay, device_memory=False)
            )
        except MxloadError as err:  # the layout cannot take it (e.g. fewer experts than ranks)
            helps.append({"flags": flag, "refused": str(err)})
            continue
        t = plan_times(
            alt,
            config,
            rates=flags.time_model_rates(args),
            scope=scope,
            devices_per_node=args.devices_per_node,
            local=_local_source(args),
        )
        helps.append(
            {
                "flags": flag,
                "predicted_load_seconds": round(t["predicted_load_seconds"], 4),
                "requests_to_storage": t["requests_to_storage"],
            }
        )
    return {"slowest_rank": got["slowest_rank"], "cause": cause, "would_help": helps}


def _load_request(args: argparse.Namespace) -> LoadRequest:
    from ..runtime.request import LoadRequest

    if args.max_restarts < 0:
        raise UsageError(
            f"--max-restarts must be >= 0, got {args.max_restarts}", key="--max-restarts"
        )
    return LoadRequest(
        src=args.src,
        layout=flags.layout(args),
        storage_options=flags.storage_options(args),
        device=args.device,
        resource=args.resource,
        placement=args.placement,
        address=args.address,
        staging_budget=flags.size(args, "staging_budget"),
        device_memory=flags.size(args, "device_memory"),
        dtype=args.dtype,
        allow_nonfinite=args.allow_nonfinite,
        max_restarts=args.max_restarts,
        engine=args.engine,
        share=args.share,
    )


def _write_report(path: str | None, manifest: dict[str, Any]) -> None:
    from ..runtime.outputs import write_file_atomic

    if path is not None:
        write_file_atomic(path, json.dumps(manifest, indent=1).encode(), "--report")


def _outputs(args: argparse.Namespace) -> OutputDir | None:
    """Check --report and --dump before any work (outputs.py): writable, and overwriting
    no input (SRC; a session's checkpoint is checked where it is known). The checked
    --dump target."""
    from ..runtime.outputs import (
        OutputDir,
        check_file_target,
        check_not_input,
        normalise,
    )

    src = getattr(args, "src", None)
    inputs = [("SRC", src)] if src else []
    for path, flag in _output_paths(args):
        check_not_input(path, flag, inputs)
    check_file_target(getattr(args, "report", None), "--report")
    dump = getattr(args, "dump", None)
    if dump is None:
        return None
    report = getattr(args, "report", None)
    if report is not None and normalise(report) == normalise(dump):
        raise OutputError(
            f"--report {report} and --dump {dump} are the same path: the report is a file, "
            "the dump a folder; give two paths",
            file=report,
            key="--report",
        )
    target = OutputDir(dump, "--dump", overwrite=args.overwrite)
    target.check()
    return target


def _output_paths(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(path, flag) of every output the command was given."""
    out = [(getattr(args, "report", None), "--report"), (getattr(args, "dump", None), "--dump")]
    return [(p, f) for p, f in out if p]


def cmd_load(args: argparse.Namespace) -> int:
    req = _load_request(args)
    dump = _outputs(args)
    bar = show.progress(args.json, "load")
    try:
        if args.detach:
            from ..runtime.detached import detached_load

            manifest = detached_load(req, session=args.session, dump=dump, on_progress=bar)
        else:
            from ..runtime.driver import load

            manifest, _ = load(req, dump=dump, on_progress=bar)
    finally:
        if bar:
            bar.close()
    _write_report(args.report, manifest)
    header = show.layout_header(manifest["parallel"], args.defaults_used, manifest.get("model"))
    show.emit(args, manifest, "\n".join([*header, show.render_load_table(manifest)]))
    if args.detach:
        # On stderr under --json, so stdout stays one JSON object.
        note = show.detach_note(manifest, args.session, mxload_home())
        print(note, file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    from ..runtime.detached import detached_reload

    _outputs(args)
    bar = show.progress(args.json, "reload")
    try:
        manifest = detached_reload(
            args.src,
            session=args.session,
            address=args.address,
            storage_options=flags.storage_options(args),
            staging_budget=flags.size(args, "staging_budget"),
            engine=args.engine,
            on_progress=bar,
            outputs=_output_paths(args),
        )
    finally:
        if bar:
            bar.close()
    try:
        _write_report(args.report, manifest)
    except OutputError as err:
        # The weights were replaced before the report failed: the outcome is said first,
        # then the failure, which must not read as a reload that did not happen (§5).
        show.emit(args, manifest, show.render_reloaded(manifest))
        raise reload_report_failed(manifest, args.src, err) from None
    show.emit(args, manifest, show.render_reloaded(manifest))
    return 0


def reload_report_failed(manifest: dict[str, Any], src: str, err: OutputError) -> OutputError:
    """The error of a reload that replaced the weights and then failed to write its
    ``--report`` (a full disk): exit 2 as every output failure, saying the weights ARE
    replaced."""
    version = manifest["ranks"][0]["version"] if manifest.get("ranks") else "?"
    return OutputError(
        f"the reload completed: the weights ARE replaced (session "
        f"{manifest.get('session', '?')!r} at version {version}, from {src}); only its "
        f"report was not written: {err.message}",
        **err.context,
    )


def cmd_status(args: argparse.Namespace) -> int:
    from ..runtime.detached import detached_status

    dump = _outputs(args)
    manifest = detached_status(
        session=args.session, address=args.address, dump=dump, engine=args.engine
    )
    show.emit(args, manifest, show.render_status(manifest))
    return 0 if manifest["consistent"] else show.STATUS_INCONSISTENT


def cmd_release(args: argparse.Namespace) -> int:
    from ..runtime.detached import detached_release

    info = detached_release(session=args.session, address=args.address, force=args.force)
    show.emit(args, info, show.render_release(info, args.session))
    return 0


def cmd_sessions(args: argparse.Namespace) -> int:
    from ..runtime.listing import list_sessions

    listing = list_sessions()
    show.emit(args, listing, show.render_sessions(listing))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ..tools.convert import convert_checkpoint

    bar = show.convert_progress(args.json)
    try:
        summary = convert_checkpoint(
            args.src,
            args.dst,
            storage_options=flags.storage_options(args),
            dtype=args.dtype,
            allow_nonfinite=args.allow_nonfinite,
            on_progress=bar,
            numerics=args.numerics,
            engine=args.engine,
            scale_alg=args.scale_alg,
            overwrite=args.overwrite,
            fmt=args.format,
        )
    finally:
        if bar is not None:
            bar.close()
    show.emit(args, summary, show.render_convert(args.src, args.dst, summary))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(workdir=args.workdir, json_out=args.json, preset=args.preset)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": cmd_demo,
    "make-checkpoint": cmd_make_checkpoint,
    "inspect": cmd_inspect,
    "plan": cmd_plan,
    "load": cmd_load,
    "reload": cmd_reload,
    "status": cmd_status,
    "release": cmd_release,
    "sessions": cmd_sessions,
    "convert": cmd_convert,
}


# --- the entry point ----------------------------------------------------------------------------


def configure_logging(debug: bool, verbose: bool) -> None:
    """The process's logging, set once by the command: library modules log through their
    own loggers; ``-v`` shows INFO, ``--debug`` DEBUG and library noise (Ray's, warnings)."""
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="mxload: %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mxload").setLevel(level)
    if not debug:
        from ...cluster.local import route_ray_output

        warnings.filterwarnings("ignore")
        # Ray's tracebacks and warnings go to $MXLOAD_HOME/logs, never the terminal
        # (docs/contract.md §5); --debug shows them as Ray prints them.
        route_ray_output()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs: it unwinds as a Ctrl-C does (a temporary
    output folder removed, a reload's interruption said), then exits 143."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (docs/contract.md §5). SIGTERM is handled as a
    Ctrl-C for the command's duration (the default ends the process where it stands,
    leaving convert's temporary folder behind)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    configure_logging(debug, verbose=bool({"-v", "--verbose"} & set(argv)))
    # Before anything imports Ray: loopback only, no usage stats (cluster/local.py).
    from ...cluster import local  # noqa: F401

    hidden: list[str] = []  # storage option values: never printed, never logged
    try:
        args = flags.parse_args(argv)
        hidden = _option_secrets(args)
        shown = {k: v for k, v in vars(args).items() if k != "storage_options"}
        log.debug("mxload %s: %s", args.command, shown)
        return COMMANDS[args.command](args)
    except SystemExit as done:  # --help, --version
        return done.code if isinstance(done.code, int) else 0
    except MxloadError as err:
        if debug:  # the tracebacks, then the same line and exit status as without
            if err.context.get("details"):  # the worker's own traceback, then ours
                sys.stderr.write(f"--- from the worker ---\n{err.context['details']}\n")
            traceback.print_exc()
        return report_error(err, err.exit_code, argv, hidden)
    except KeyboardInterrupt as stop:
        command = next((a for a in argv if not a.startswith("-")), "")
        hint = " (`mxload status` says what the devices hold)" if command == "reload" else ""
        what, code = ("terminated", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        sys.stderr.write(f"mxload: {what}{hint}\n")
        return code
    except BrokenPipeError:
        # `mxload plan ... | head`: the reader left; say nothing more, like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # a failed run: say what failed, no traceback
        if debug:
            traceback.print_exc()
        return report_error(err, 1, argv, hidden)


def run() -> None:
    """The console script and ``python -m``: :func:`main`'s exit status, which a Ctrl-C
    during the interpreter's own shutdown (Ray's, seconds long) no longer changes: the
    command's outcome was already said."""
    import signal

    from .outcome import watch

    outcome = watch(sys.argv[1:])
    try:
        code = main()
    finally:  # said, or shown as a traceback (--debug)
        if outcome is not None:
            outcome.said()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def _option_secrets(args: argparse.Namespace) -> list[str]:
    """The values of the command's storage options (``options.secret_values``)."""
    from ...workers.storage.options import secret_values

    if not getattr(args, "storage_options", None):
        return []
    try:
        return secret_values(flags.storage_options(args))
    except MxloadError:  # refused when the command runs, saying why
        return []


def shown_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` as a log may show it: the value of ``--storage-options`` hidden (an
    ``@FILE`` names only a file, and is kept)."""
    from ...workers.storage.options import HIDDEN

    out: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next and not word.startswith("@"):
            word = HIDDEN
        elif word.startswith("--storage-options=") and not word.partition("=")[2].startswith("@"):
            word = f"--storage-options={HIDDEN}"
        hide_next = word == "--storage-options"
        out.append(word)
    return out


def report_error(
    err: BaseException, code: int, argv: Sequence[str], hidden: Sequence[str] = ()
) -> int:
    """One line on stderr, ``mxload: error: ...``, without colour codes or traceback,
    and with no storage option's value (``hidden``). A failed run or a worker's error
    also gets a log file (the traceback, the worker's remote traceback) whose path is
    printed on a second line; ``--debug`` shows them."""
    from ...workers.storage.options import scrub
    from ..runtime.worker_errors import first_line, plain

    context = err.context if isinstance(err, MxloadError) else {}
    if isinstance(err, MxloadError):
        text = show.condense_error(plain(str(err)))
    else:
        text = f"{type(err).__name__}: {first_line(err)}"
    sys.stderr.write(f"mxload: error: {scrub(text, hidden)}\n")
    if code == 1 or "details" in context:
        path = write_error_log(err, argv, hidden)
        if path:
            sys.stderr.write(f"mxload: the traceback is in {path} (or rerun with --debug)\n")
    return code


def write_error_log(
    err: BaseException, argv: Sequence[str], hidden: Sequence[str] = ()
) -> str | None:
    """Write what a user would need to report a failure; the file's path, or None when
    $MXLOAD_HOME cannot take it. In ``$MXLOAD_HOME/logs`` only (never a shared temp
    folder), a 0700 folder, the file 0600 and created new; storage option values
    (``hidden``, and ``--storage-options``' text) do not appear in it."""
    import time
    import traceback

    from ...workers.storage.options import scrub

    body = [
        f"mxload {' '.join(shown_argv(argv))}",
        f"at {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}",
        "",
        *traceback.format_exception(type(err), err, err.__traceback__),
    ]
    details = err.context.get("details") if isinstance(err, MxloadError) else None
    if details:
        body += ["", "--- from the worker ---", str(details)]
    from ...cluster.local import ray_log_path

    if ray_log_path():  # Ray's own messages of this run (never on the terminal)
        body += ["", f"--- what Ray said: {ray_log_path()} ---"]
    name = f"mxload-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    folder = mxload_home() / "logs"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Opened without following a link: a logs "folder" that links to a shared one
        # must neither be made 0700 nor receive the log (ELOOP: no log).
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(dir_fd, 0o700)  # an older mxload made it 0755
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "w") as f:
            f.write(scrub("\n".join(body) + "\n", hidden))
        return os.path.join(folder, name)
    except OSError:
        return None
