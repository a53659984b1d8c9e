"""The ``mxload`` command line's flags: declared once, parsed, checked, given defaults.

What a command receives is an ``argparse.Namespace`` whose values are already checked and
converted (sizes in bytes, defaults filled in and recorded in ``args.defaults_used``), so
the commands in ``commands.py`` only call the library. Every mistake here is a
:class:`UsageError` (exit 2, one line naming the flag); a mistyped flag or command gets a
"did you mean" suggestion, and no parser accepts an abbreviation of a flag.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...cluster.local import mxload_home
from ...workers.storage.urls import absolute, local_path
from ...workers.storage.urls import is_remote as is_remote_url
from ..errors import MxloadError, UsageError
from ..plan.engines import DEFAULT_ENGINE, known_engines
from ..plan.sharing import DEFAULT_SHARE, SHARE_SCOPES
from ..plan.sizes import parse_size
from ..plan.types import ParallelLayout
from ..runtime.models import model_names, resolve_model


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are UsageErrors with a suggestion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            choices = re.findall(r"'([^']*)'", bad.group(2))
            message += did_you_mean(bad.group(1), choices)
        raise UsageError(message)


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """``"; did you mean --x?"`` for the closest known spelling, or nothing."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings]


ALL = ("demo", "make-checkpoint", "inspect", "plan", "load", "reload", "status", "release", "sessions", "convert")  # fmt: skip
LAYOUT = ("plan", "load")
"""Commands that take a parallel layout."""
SESSION = ("load", "reload", "status", "release")
"""Commands that reach a detached session or a Ray cluster."""
READS = ("make-checkpoint", "inspect", "plan", "load", "reload", "convert")
"""Commands that open a checkpoint URL through fsspec."""
SOURCE = ("inspect", "plan", "load", "reload", "convert")
"""Commands that read a checkpoint's files (the rules of the storage seam apply)."""

SIZE_HELP = (
    "SIZE with its unit: 64GiB = 64 x 2^30 bytes, 2GB = 2 x 10^9 bytes, 512MiB, 1048576B; "
    "a bare number and the ambiguous 64G are refused"
)


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
        long = [n for n in self.names if n.startswith("--")]
        return (long or list(self.names))[0].lstrip("-").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    # layout
    # vLLM's spellings of the layout flags are aliases: what a vLLM user types works.
    Flag(
        ("--tp", "--tensor-parallel-size", "-tp"),
        LAYOUT,
        "tensor-parallel size",
        1,
        kwargs={"type": int, "metavar": "N"},
    ),
    Flag(
        ("--dp", "--data-parallel-size", "-dp"),
        LAYOUT,
        "data-parallel size",
        1,
        kwargs={"type": int, "metavar": "N"},
    ),
    Flag(
        ("--pp", "--pipeline-parallel-size", "-pp"),
        LAYOUT,
        "pipeline-parallel size",
        1,
        kwargs={"type": int, "metavar": "N"},
    ),
    Flag(
        ("--enable-expert-parallel", "-ep"),
        LAYOUT,
        "shard MoE experts over tp x dp ranks (vLLM's EP) instead of TP-sharding each expert",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--expert-placement", "--expert-placement-strategy"),
        LAYOUT,
        "how experts map to EP ranks: linear (contiguous blocks) or round_robin",
        "linear",
        kwargs={"choices": ["linear", "round_robin"]},
    ),
    Flag(
        ("--language-model-only",),
        LAYOUT,
        "the engine runs vLLM's --language-model-only: no vision tower is planned or read "
        "(default: planned, as vLLM builds it)",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--speculative-config", "-sc"),
        LAYOUT,
        "the engine's vLLM speculative_config as JSON: "
        '\'{"method": "mtp", "num_speculative_tokens": 1}\' plans the checkpoint\'s own MTP '
        "module (Qwen3.5; --pp 1) as vLLM's drafter holds it; other methods are refused",
        kwargs={"metavar": "JSON"},
    ),
    Flag(
        ("--mm-encoder-tp-mode",),
        LAYOUT,
        "the engine's vLLM --mm-encoder-tp-mode: weights (vLLM's default) TP-shards the "
        "vision tower, data holds it whole on every TP rank",
        kwargs={"choices": ["weights", "data"]},
    ),
    Flag(
        ("--all2all-backend",),
        LAYOUT,
        "the engine's vLLM --all2all-backend (default: the engine profile's: vLLM's "
        "allgather_reducescatter, vllm-ascend's flashinfer_all2allv); under a sequence-"
        "parallel backend with EP, tp > 1 and dp > 1 vLLM holds the shared experts whole",
        kwargs={"metavar": "NAME"},
    ),
    Flag(
        ("--enable-shared-expert-dp",),
        LAYOUT,
        "the engine holds the shared experts whole on every TP rank by its own switch "
        "(vllm-ascend's enable_shared_expert_dp; 0.23 also flashcomm1)",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--scale-alg",),
        ("plan", "load", "convert"),
        "the MX scale rule (npu_dynamic_mx_quant's scale_alg): 0 OCP (floor of the group's "
        "exponent), 1 from amax / 448 rounded up; default: the engine's choice for the model "
        "(vllm-ascend 0.27+: 1 for MiniMax M3, else 0)",
        kwargs={"type": int, "choices": [0, 1]},
    ),
    # engine
    Flag(
        ("--engine",),
        ("plan", "load", "convert"),
        "lay buffers out as this engine holds them after its own post-load (names, views, "
        "placement), a profile or a vllm-ascend release: " + ", ".join(known_engines()),
        DEFAULT_ENGINE,
        kwargs={"choices": known_engines()},
    ),
    Flag(
        ("--engine",),
        ("reload", "status"),
        "the engine the session was loaded for (refused when it differs; default: the session's)",
        kwargs={"choices": known_engines()},
    ),
    # memory
    Flag(
        ("--device-memory",),
        ("plan", "load"),
        f"memory of one device; plans that do not fit exit 3 ({SIZE_HELP})",
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    # the engine's KV cache (vLLM's own knobs, names and defaults; plan/kvcache.py)
    Flag(
        ("--gpu-memory-utilization",),
        ("plan",),
        "share of --device-memory the engine may use; its KV cache gets what the weights "
        "and mxload's staging leave of it",
        0.92,
        kwargs={"type": float, "metavar": "F"},
    ),
    Flag(
        ("--max-model-len",),
        ("plan",),
        "longest request the engine serves; the KV cache must hold one (default: the "
        "model's max_position_embeddings, as vLLM)",
        kwargs={"type": int, "metavar": "TOKENS"},
    ),
    Flag(
        ("--max-num-seqs",),
        ("plan",),
        "most requests the engine batches per DP rank (caps the batch the KV cache holds)",
        128,
        kwargs={"type": int, "metavar": "N"},
    ),
    Flag(
        ("--kv-cache-dtype",),
        ("plan",),
        "KV cache dtype: auto (the model's), bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2",
        "auto",
        kwargs={"choices": ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]},
    ),
    Flag(
        ("--block-size",),
        ("plan",),
        "tokens per KV block (default: 128 on npu, as vllm-ascend; 16 elsewhere, vLLM's); "
        "a hybrid model's is raised until a block holds a Gated DeltaNet state, as vLLM does",
        kwargs={"type": int, "metavar": "TOKENS"},
    ),
    Flag(
        ("--enable-prefix-caching",),
        ("plan",),
        "vLLM's prefix caching (on by default there): a Gated DeltaNet layer then keeps two "
        "states per request; --no-enable-prefix-caching one",
        True,
        kwargs={"action": argparse.BooleanOptionalAction},
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
        "device the plan is for (its kernels' scratch, the engine's KV block size): npu "
        "(Ascend, vllm-ascend), cuda, cpu, auto",
        "npu",
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
        DEFAULT_SHARE,
        kwargs={"choices": list(SHARE_SCOPES)},
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
    # refit from a trainer's memory (no defaults here: a plan without --from-trainer
    # lists none of them among its defaults; orchestrator/cli/refit.py fills them in)
    Flag(
        ("--from-trainer",),
        ("plan",),
        "plan a refit from a trainer's memory beside the storage round trip: a trainer "
        "manifest (JSON FILE, docs/contract.md), or fsdp:N / megatron:N for N trainer "
        "ranks holding the plan's model in BF16, --devices-per-node of them per node",
        kwargs={"metavar": "MANIFEST"},
    ),
    Flag(
        ("--trainer-link",),
        ("plan",),
        "refit: how the bytes move: hccl or nccl (--network-bandwidth between nodes), "
        "gloo, ray (object store) or shm (within a node only) (default: hccl)",
        kwargs={"choices": ["hccl", "nccl", "gloo", "ray", "shm"]},
    ),
    Flag(
        ("--convert-on",),
        ("plan",),
        "refit: where BF16 becomes MXFP8: receiver (BF16 on the wire) or sender (MXFP8 on "
        "the wire) (default: receiver)",
        kwargs={"choices": ["receiver", "sender"]},
    ),
    Flag(
        ("--bucket-size",),
        ("plan",),
        f"refit: bytes one trainer rank packs into one message (default: 64MiB, as the "
        f"trainer form's bucket_bytes; {SIZE_HELP})",
        size=True,
        kwargs={"metavar": "SIZE"},
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
        '\'{"endpoint_url": "http://host:9000"}\', or @FILE: read from FILE (keeps '
        "credentials off the command line, where other users' ps shows them); values "
        "are never shown",
        kwargs={"metavar": "JSON|@FILE"},
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
    Flag(
        ("--min-read-rate",),
        SOURCE,
        "slowest average a remote read may make, bytes per second with a unit (default "
        "1MiB): a request taking longer than connect + read timeout + its bytes at this "
        "rate fails and is retried (a server that drips bytes); " + SIZE_HELP,
        size=True,
        kwargs={"metavar": "SIZE"},
    ),
    # outputs
    Flag(
        ("--overwrite",),
        ("load", "status", "convert", "make-checkpoint"),
        "replace a non-empty output folder (--dump DIR, convert's DST, make-checkpoint's OUT) "
        "whole; refused by default",
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
    Flag(
        ("-v", "--verbose"),
        ALL,
        "log what the library does (INFO) on stderr",
        kwargs={"action": "store_true"},
    ),
    Flag(
        ("--debug",),
        ALL,
        "show tracebacks and every library log (DEBUG)",
        kwargs={"action": "store_true"},
    ),
)


def _add_flags(p: argparse.ArgumentParser, command: str) -> None:
    for flag in FLAGS:
        if command in flag.commands:
            shown = flag.help if flag.default is None else f"{flag.help} (default: {flag.default})"
            p.add_argument(*flag.names, dest=flag.dest, default=None, help=shown, **flag.kwargs)


def build_parser() -> argparse.ArgumentParser:
    from ... import __version__

    parser = Parser(
        prog="mxload",
        description="Load block-FP8 checkpoints into Ascend MXFP8 kernel layouts, sharded "
        "over Ray workers, reload them in place, and plan device memory.",
        epilog="Exit status: 0 ok; 2 bad input or a refusal; 3 the plan does not fit; 1 a "
        f"failed run; 4 status: the session is inconsistent. Detached sessions are recorded "
        f"under $MXLOAD_HOME (here: {mxload_home()}; default ~/.mxload). 'mxload COMMAND "
        "--help' for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"mxload {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help)

    p = command("demo", "make a tiny checkpoint, load it on local Ray, reload it in place")
    p.add_argument("--workdir", default=None, metavar="DIR", help="keep the demo's files here")
    p.add_argument(
        "--preset",
        default="qwen3-moe-tiny",
        help="model shape (default qwen3-moe-tiny): " + ", ".join(preset_names()),
    )

    p = command("make-checkpoint", "write a synthetic block-FP8 checkpoint in the HF layout")
    p.add_argument("out", metavar="OUT", help="new folder or fsspec URL to write")
    p.add_argument("--preset", required=True, help="model shape: " + ", ".join(preset_names()))
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument(
        "--shards", type=int, default=2, metavar="N", help="safetensors files (default 2)"
    )
    p.add_argument("--bf16", action="store_true", help="write the same model as plain BF16")
    p.add_argument(
        "--scale-dtype",
        default=None,
        choices=("F32", "BF16"),
        help="dtype of the block scales weight_scale_inv (default F32; BF16 as third-party "
        "Qwen3.5 FP8 copies store them)",
    )

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
    command(
        "sessions",
        "the detached sessions and head recorded in $MXLOAD_HOME, from its files (no Ray call)",
    )

    p = command("convert", "offline block-FP8 -> MXFP8 checkpoint (ModelOpt or vllm-ascend)")
    p.add_argument("src", metavar="SRC", help="block-FP8 checkpoint folder or fsspec URL")
    p.add_argument("dst", metavar="DST", help="output folder")
    p.add_argument(
        "--format",
        choices=("modelopt", "ascend"),
        default=None,
        help="how the output describes its quantization: modelopt (vLLM's modelopt_mxfp8; "
        "vllm-ascend 0.27.1rc1+) or ascend (quant_model_description.json for "
        "--quantization ascend; every vllm-ascend release, the only one 0.23.0.post1 serves). "
        "Default: modelopt, or ascend where --engine names a release that serves only it",
    )
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


def preset_names() -> list[str]:
    # The preset table lives with the synthetic writer; listing it must not import torch.
    return [
        "deepseek-v3-tiny",
        "qwen3-dense-tiny",
        "qwen3-moe-awkward",
        "qwen3-moe-tiny",
        "qwen3.5-moe-tiny",
        "qwen3.5-tiny",
    ]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse, check and complete ``argv`` (UsageError on any mistake)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(list(argv))
    except UsageError as err:
        # argparse reports a missing required flag before an unknown one, so "--pres X"
        # would read "--preset is required": name the unknown flag first.
        _refuse_unknown_flag_in(parser, argv)
        _refuse_dash_value(str(err), argv)
        raise
    if extra:
        _refuse_unknown(parser, args.command, extra)
    if not args.command:
        raise UsageError("a command is required: " + ", ".join(ALL))
    _check_combinations(args)
    apply_defaults(args)
    resolve_paths(args)
    return args


PATHS = ("src", "dst", "out", "dump", "report", "config")
"""Arguments that name a local file or folder (or a URL)."""


def resolve_paths(args: argparse.Namespace) -> None:
    """Every local path made absolute here, once, before any worker sees it: a worker's
    working directory is not this command's, and a relative SRC read there is another
    checkpoint. ``plan``'s SRC may be a packaged model's name and is read here only."""
    for name in PATHS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value and not (name == "src" and args.command == "plan"):
            setattr(args, name, absolute(value))


def _refuse_unknown(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """An argument no parser took: named, with the closest flag of its command."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    known = option_strings(sub.choices[command] if command else parser)
    word = extra[0]
    hint = did_you_mean(word.split("=", 1)[0], known) if word.startswith("-") else ""
    raise UsageError(f"{command or 'mxload'}: unrecognized argument {word}{hint}", key=word)


def _refuse_unknown_flag_in(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse the first word of ``argv`` that looks like a flag its command does not know."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    command = next((w for w in argv if w in sub.choices), None)
    if command is None:
        return  # argparse's own error (an unknown command) comes first
    known = option_strings(sub.choices[command]) + option_strings(parser)
    for word in argv:
        if word == "--":
            return
        if re.match(r"--?[A-Za-z]", word) and word.split("=", 1)[0] not in known:
            _refuse_unknown(parser, command, [word])


def _refuse_dash_value(message: str, argv: Sequence[str]) -> None:
    """argparse's "expected one argument" where the value given starts with '-' but is no
    flag (such as ``--device-memory -5GB``): say that the value was read as a flag."""
    missing = re.match(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
    if not missing:
        return
    flag = missing.group(1)
    for word, value in itertools.pairwise(argv):
        if word == flag and value.startswith("-") and not re.match(r"--?[A-Za-z]", value):
            raise UsageError(
                f"{flag}: the value {value!r} reads as a flag; write {flag}={value}", key=flag
            )


def _check_combinations(args: argparse.Namespace) -> None:
    """Flags that parse on their own but contradict each other (before defaults fill in,
    so a flag the user gave is told apart from a default)."""
    if args.command == "plan" and args.src and (args.model or args.config):
        flag = f"--model {args.model}" if args.model else f"--config {args.config}"
        raise UsageError(
            f"plan: both SRC {args.src} and {flag} given; a plan reads one: drop SRC to "
            f"plan from {flag}, or drop {flag.split()[0]} to plan the checkpoint",
            key=flag.split()[0],
        )
    if args.command == "load" and args.session is not None and not args.detach:
        raise UsageError(
            f"--session {args.session} names a detached session: give --detach too (without "
            "it the workers end when load returns, and no session is kept)",
            key="--session",
        )
    if getattr(args, "address", None) is not None:
        check_address(args.address)
    if args.command in ("inspect", "load", "reload", "convert"):
        check_source_folder(args.src)


def apply_defaults(args: argparse.Namespace) -> None:
    """Fill in the defaults the user did not give, record them (``args.defaults_used``,
    shown by the tables), and parse sizes."""
    used: list[str] = []
    for flag in FLAGS:
        if args.command not in flag.commands:
            continue
        if flag.dest == "session" and args.command == "load" and not args.detach:
            continue  # a load without --detach keeps no session: no name to default
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
            setattr(args, flag.dest, size_flag(value, flag.names[0]))
    args.defaults_used = used


def size_flag(text: str, flag: str) -> int:
    """A size flag in bytes. ``G``, ``M``, ``K`` and ``T`` alone are refused: some read
    them as powers of 1024, others of 1000, and a plan off by 7% is a wrong verdict."""
    unit = re.fullmatch(r"\s*[0-9.]+\s*([A-Za-z]*)\s*", text)
    if unit and unit.group(1).upper() in ("K", "M", "G", "T"):
        number = text.strip()[: -len(unit.group(1))].strip()
        letter = unit.group(1).upper()
        power = "KMGT".index(letter) + 1
        raise UsageError(
            f"{flag}: {text!r} is ambiguous; write {number}{letter}iB ({number} x "
            f"2^{10 * power} bytes) or {number}{letter}B ({number} x 10^{3 * power} bytes)",
            key=flag,
        )
    return parse_size(text, flag, require_unit=True)


def check_address(address: str) -> None:
    """``--address`` is HOST:PORT (or a Ray URL such as ``ray://HOST:PORT``, or ``auto``)."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--address {address}: not HOST:PORT (e.g. 127.0.0.1:6379, the port of the Ray "
            "head's GCS)",
            key="--address",
        )


def check_source_folder(src: str) -> None:
    """A checkpoint is a folder: a local SRC that is a file (often its config.json) is
    refused naming the folder meant."""
    if not src:
        raise UsageError("SRC: an empty path; give a checkpoint folder or an fsspec URL", key="SRC")
    if is_remote_url(src):
        return
    path = local_path(src)
    if os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        raise UsageError(
            f"SRC {src} is a file, not a checkpoint folder; give its folder ({folder})",
            file=src,
        )


def check_plan_source(src: str) -> None:
    """``plan path/config.json`` (or a model name) where a checkpoint folder belongs: say
    which flag was meant instead of failing on a file that is not a folder."""
    if is_remote_url(src):
        return
    path = local_path(src)
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


# --- values the commands pass to the library ---------------------------------------------------


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    from ...workers.storage import ALLOW_OUTSIDE_LINKS, CONNECT_TIMEOUT, READ_TIMEOUT
    from ...workers.storage.options import MIN_READ_RATE

    raw = getattr(args, "storage_options", None)
    value: dict[str, Any] = {}
    if raw:
        where = "--storage-options"
        if raw.startswith("@"):  # a file: credentials stay off the command line and ps
            where = f"--storage-options {raw}"
            raw = _options_file(raw[1:], where)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as err:
            # The position only: the text may hold a secret.
            pos = f"line {err.lineno} column {err.colno}"
            raise UsageError(f"{where}: not valid JSON ({pos})", key="--storage-options") from None
        except (ValueError, RecursionError) as err:
            # An integer past Python's digit limit, or nesting past the recursion limit
            # (neither message quotes the text).
            reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
            raise UsageError(
                f"{where}: not valid JSON ({reason})", key="--storage-options"
            ) from None
        if not isinstance(value, dict):
            raise UsageError(f"{where}: must be a JSON object", key="--storage-options")
        _check_option_shapes(value, where)
    # The source flags travel as storage options: every worker then reads under them. A
    # flag and the same key in the JSON must agree: neither silently wins.
    given = {
        ALLOW_OUTSIDE_LINKS: True if getattr(args, "allow_outside_links", False) else None,
        CONNECT_TIMEOUT: getattr(args, "connect_timeout", None),
        READ_TIMEOUT: getattr(args, "read_timeout", None),
        MIN_READ_RATE: getattr(args, "min_read_rate", None),
    }
    for key, flag_value in given.items():
        if flag_value is None:
            continue
        flag = "--" + key.removeprefix("mxload_").removesuffix("_s").replace("_", "-")
        given_json = value.get(key)
        # JSON true is not the number 1: compare types too (bool is an int in Python).
        if key in value and (
            given_json != flag_value or isinstance(given_json, bool) != isinstance(flag_value, bool)
        ):
            raise UsageError(
                f"{flag} {json.dumps(flag_value)} and --storage-options {key}: "
                f"{json.dumps(given_json)} disagree; give one of them",
                key=flag,
            )
        value[key] = flag_value
    return value or None


OPTION_OBJECTS = ("client_kwargs", "config_kwargs", "headers")
"""Storage options fsspec's back ends take as objects (keyword arguments, HTTP headers)."""


def _check_option_shapes(value: dict[str, Any], where: str) -> None:
    """Refuse what fsspec would fail on later, and say so here: an HTTP back end turns
    any failure of a request (a header that is a number, ``client_kwargs`` that is not
    an object) into "no such file". Names keys only: the values may be secrets."""
    places = [("", value)]
    if isinstance(value.get("client_kwargs"), dict):
        places.append(("client_kwargs.", value["client_kwargs"]))
    for prefix, holder in places:
        for key in OPTION_OBJECTS:
            if key in holder and not isinstance(holder[key], dict):
                raise UsageError(
                    f"{where}: {prefix}{key} must be a JSON object", key="--storage-options"
                )
        for name, header in (holder.get("headers") or {}).items():
            if not isinstance(header, str):
                raise UsageError(
                    f"{where}: {prefix}headers {name!r} must be a JSON string (an HTTP "
                    f"header's value is text), not {_json_kind(header)}",
                    key="--storage-options",
                )


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else "null"


OPTIONS_FILE_MAX_BYTES = 1 << 20
"""Largest ``--storage-options @FILE`` read."""


def _options_file(path: str, where: str) -> str:
    """The text of ``--storage-options @FILE`` (a regular file, at most 1 MiB)."""
    from ...workers.storage.local import read_whole

    try:
        data = read_whole(os.path.abspath(path), OPTIONS_FILE_MAX_BYTES, path)
    except OSError as err:
        raise UsageError(
            f"{where}: cannot read {path}: {err.strerror}", key="--storage-options"
        ) from None
    except MxloadError as err:
        raise UsageError(f"{where}: {err}", key="--storage-options") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not UTF-8 text", key="--storage-options") from None


def layout(args: argparse.Namespace) -> ParallelLayout:
    for flag in ("tp", "dp", "pp"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}", key=f"--{flag}")
    return ParallelLayout(
        tp=args.tp,
        dp=args.dp,
        pp=args.pp,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_placement=args.expert_placement,
        language_model_only=args.language_model_only,
        speculative_method=speculative_method(args.speculative_config),
        mm_encoder_tp_mode=args.mm_encoder_tp_mode or "weights",
        all2all_backend=args.all2all_backend or "",
        shared_expert_dp=args.enable_shared_expert_dp,
        scale_alg=args.scale_alg,
    )


MTP_METHODS = ("mtp", "qwen3_5_mtp")
"""``method`` values vLLM 0.23 runs as its MTP proposer for Qwen3.5 ("qwen3_5_mtp" is
deprecated there and renamed "mtp")."""


def speculative_method(text: str | None) -> Literal["", "mtp"]:
    """The layout's speculative method from ``--speculative-config`` (vLLM's JSON):
    ``mtp`` for the MTP methods with a positive ``num_speculative_tokens``; UsageError for
    anything else."""
    if text is None:
        return ""
    flag = "--speculative-config"
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as err:
        reason = str(err) if isinstance(err, ValueError) else "nested too deeply"
        raise UsageError(f"{flag}: not valid JSON ({reason})", key=flag) from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{flag}: must be a JSON object, like vLLM's", key=flag)
    extra = sorted(set(cfg) - {"method", "num_speculative_tokens"})
    if extra:
        raise UsageError(
            f"{flag}: key {extra[0]!r} is not one mxload plans (method, num_speculative_tokens): "
            "only the checkpoint's own MTP module, on the target's layout, is planned",
            key=flag,
        )
    method = cfg.get("method")
    if method not in MTP_METHODS:
        raise UsageError(
            f"{flag}: method {method!r} is not one mxload plans ({', '.join(MTP_METHODS)}): "
            "a draft model, EAGLE or n-gram drafter is neither planned nor reloaded",
            key=flag,
        )
    tokens = cfg.get("num_speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise UsageError(
            f"{flag}: num_speculative_tokens must be an integer >= 1 (vLLM requires it for "
            f"method {method!r}), got {tokens!r}",
            key=flag,
        )
    return "mtp"


def serve_knobs(args: argparse.Namespace) -> Any:
    """The engine's memory knobs from ``plan``'s flags (``kvcache.ServeKnobs``)."""
    from ..plan.kvcache import ServeKnobs, check_knobs

    knobs = ServeKnobs(
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        num_speculative_tokens=speculative_tokens(args.speculative_config),
    )
    check_knobs(knobs)
    return knobs


def speculative_tokens(text: str | None) -> int:
    """``num_speculative_tokens`` of an MTP ``--speculative-config`` (checked by
    :func:`speculative_method`); 0 without one."""
    if speculative_method(text) == "":
        return 0
    return int(json.loads(str(text))["num_speculative_tokens"])


def size(args: argparse.Namespace, name: str) -> int | None:
    """A size flag's value in bytes (parsed, with its unit, by ``apply_defaults``)."""
    value = getattr(args, name, None)
    return None if value is None else int(value)


def is_remote(src: str | None) -> bool:
    return bool(src) and is_remote_url(str(src))


def time_model_rates(args: argparse.Namespace) -> Any:
    """The time model's rates from ``plan``'s flags (``timemodel.Rates``), checked."""
    from ..plan.timemodel import (
        CPU_CONVERT_BYTES_PER_S,
        LOCAL_REQUEST_LATENCY_S,
        NPU_CONVERT_BYTES_PER_S,
        REMOTE_REQUEST_LATENCY_S,
        Rates,
    )

    convert = size(args, "convert_rate")
    if convert is None:
        convert = int(CPU_CONVERT_BYTES_PER_S if args.device == "cpu" else NPU_CONVERT_BYTES_PER_S)
    for name in ("storage_bandwidth", "storage_aggregate_bandwidth", "network_bandwidth"):
        if (size(args, name) or 0) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0", key=name)
    if convert <= 0:
        raise UsageError(f"--convert-rate must be > 0, got {convert}", key="--convert-rate")
    if args.devices_per_node < 1:
        raise UsageError(
            f"--devices-per-node must be >= 1, got {args.devices_per_node}",
            key="--devices-per-node",
        )
    latency = args.request_latency
    if latency is None:
        # A config-only plan is for a cluster, whose checkpoint sits in shared storage.
        local = bool(args.src) and not is_remote(args.src)
        latency = LOCAL_REQUEST_LATENCY_S if local else REMOTE_REQUEST_LATENCY_S
    for flag, value in (
        ("--request-latency", latency),
        ("--storage-request-rate", args.storage_request_rate),
    ):
        if not 0 <= value < math.inf:  # also refuses nan, which compares false
            raise UsageError(f"{flag} must be a finite number >= 0, got {value}", key=flag)
    return Rates(
        storage_node=float(size(args, "storage_bandwidth") or 0),
        storage_aggregate=float(size(args, "storage_aggregate_bandwidth") or 0),
        network_node=float(size(args, "network_bandwidth") or 0),
        convert=float(convert),
        request_latency=float(latency),
        storage_requests=float(args.storage_request_rate),
    )
