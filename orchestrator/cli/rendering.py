"""What the ``mxload`` commands print: tables and one-line summaries for people, one JSON
object on stdout with ``--json``, and refusals condensed to the line that matters.

Pure functions of the library's results (dicts as they become JSON): no I/O here except
:func:`emit`, so each text can be checked without running a command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..plan.sizes import format_size

STATUS_INCONSISTENT = 4
"""``mxload status`` exit status while the session does not hold one checkpoint everywhere
(a failed or running reload, ranks or replicas that disagree, moved buffers)."""

MISMATCHES_SHOWN = 3
"""Items of a listing error (a refused reload's mismatches) kept on its one line; the
whole list is in the error itself (``--debug``)."""


def emit(args: argparse.Namespace, obj: Any, human: str) -> None:
    """``obj`` as one JSON object on stdout under ``--json``, else the human text."""
    if getattr(args, "json", False):
        write_json(obj, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(human)


def write_json(obj: Any, out: Any) -> None:
    """``json.dump(obj, out, indent=1)``, byte for byte, at a fraction of its cost on a
    plan of thousands of ranks: the standard encoder's indenting path is pure Python
    and walks every element, where here a list of numbers is one join and an equal list
    met again (every rank's expert ids, without EP) is written from the text already
    made. The text is written in pieces of a few MB, as it is made."""
    pieces: list[str] = []
    size = 0
    seen: dict[tuple[int, int, Any], list[tuple[list[Any], str]]] = {}
    for piece in _json_pieces(obj, 0, seen):
        pieces.append(piece)
        size += len(piece)
        if size > 1 << 22:
            out.write("".join(pieces))
            pieces.clear()
            size = 0
    out.write("".join(pieces))


_ESCAPE = json.encoder.encode_basestring_ascii


def _json_float(v: float) -> str:
    if v != v:
        return "NaN"
    if v == float("inf"):
        return "Infinity"
    if v == -float("inf"):
        return "-Infinity"
    return float.__repr__(v)


def _json_scalar(v: Any) -> str | None:
    """The JSON text of a scalar as ``json`` writes it; None for a container."""
    if isinstance(v, str):
        return str(_ESCAPE(v))
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return int.__repr__(v)
    if isinstance(v, float):
        return _json_float(v)
    if isinstance(v, (list, tuple, dict)):
        return None
    raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")


def _json_key(k: Any) -> str:
    if isinstance(k, str):
        return str(_ESCAPE(k))
    if isinstance(k, (bool, int, float)) or k is None:
        # json writes a non-string key as the string of its scalar text
        return str(_ESCAPE(_json_scalar(k) or ""))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")


def _json_pieces(
    v: Any, level: int, seen: dict[tuple[int, int, Any], list[tuple[list[Any], str]]]
) -> Any:
    text = _json_scalar(v)
    if text is not None:
        yield text
        return
    pad = "\n" + " " * (level + 1)
    if isinstance(v, dict):
        if not v:
            yield "{}"
            return
        sep = "{" + pad
        out: list[str] = []
        for k, item in v.items():
            out.append(sep)
            sep = "," + pad
            out.append(_ESCAPE(k) if type(k) is str else _json_key(k))
            out.append(": ")
            kind = type(item)
            # the common scalars inline: a plan's ranks are thousands of flat entries
            if kind is int:
                out.append(int.__repr__(item))
            elif kind is str:
                out.append(_ESCAPE(item))
            elif kind is float:
                out.append(_json_float(item))
            else:
                text = _json_scalar(item)
                if text is not None:
                    out.append(text)
                else:
                    yield "".join(out)
                    out.clear()
                    yield from _json_pieces(item, level + 1, seen)
        out.append("\n" + " " * level + "}")
        yield "".join(out)
        return
    if not v:
        yield "[]"
        return
    # Only lists of plain ints are remembered: equal as Python values means equal text
    # for them (not for 1 and True, or 1 and 1.0).
    ints = len(v) >= 8 and set(map(type, v)) == {int}
    if ints:
        key = (level, len(v), v[0])
        for prev, made in seen.get(key, ()):
            if prev == v:
                yield made
                return
    scalars = [_json_scalar(item) for item in v]
    texts = [t for t in scalars if t is not None]
    if len(texts) == len(scalars):
        made = "[" + pad + ("," + pad).join(texts) + "\n" + " " * level + "]"
        if ints:
            seen.setdefault(key, []).append((list(v), made))
        yield made
        return
    for i, (item, text) in enumerate(zip(v, scalars, strict=True)):
        yield ("[" if i == 0 else ",") + pad
        if text is not None:
            yield text
        else:
            yield from _json_pieces(item, level + 1, seen)
    yield "\n" + " " * level + "]"


def progress(json_out: bool, label: str) -> Any:
    """A progress bar for a long run when stderr is a terminal and --json is off; None
    otherwise (pipes and scripts see no control characters)."""
    if json_out or not sys.stderr.isatty():
        return None
    from .progress import RankProgress

    return RankProgress(label)


def convert_progress(json_out: bool) -> Any:
    """``convert``'s byte progress bar, under the same terms as :func:`progress`."""
    if json_out or not sys.stderr.isatty():
        return None
    from .progress import ConvertBar

    return ConvertBar()


def render_made(summary: dict[str, Any], *, bf16: bool) -> str:
    """``make-checkpoint``'s one-line summary (the details are in ``--json``)."""
    kind = "BF16" if bf16 else "block-FP8"
    return (
        f"wrote {kind} {summary['preset']} (seed {summary['seed']}) to {summary['out']}: "
        f"{summary['tensors']} tensors in {summary['shards']} shard(s), "
        f"{format_size(summary['bytes'])}, {len(summary.get('special_tiles', []))} special "
        "tile(s) (--json lists them)"
    )


def render_convert(src: str, dst: str, summary: dict[str, Any]) -> str:
    """``convert``'s human summary: what was written, how fast, what stayed unconverted."""
    rate = summary.get("source_gb_per_s")
    lines = [
        f"converted {src} -> {dst}: {summary['tensors']} tensors in {summary['files']} "
        f"file(s), {format_size(summary['source_bytes'])} read in {summary['seconds']:.2f} s"
        + (f" ({rate:.3f} GB/s)" if rate else "")
        + f" on {summary['backend']}"
    ]
    excluded = summary.get("excluded_modules") or []
    if excluded:
        lines.append(f"  kept unquantized (not converted): {_some(excluded)}")
    return "\n".join(lines)


def render_release(info: dict[str, Any], session: str) -> str:
    if "processes_ended" in info:
        why = f"its head was down ({'; '.join(info['head_down'])})" if info["head_down"] else "--force"  # fmt: skip
        return (
            f"released session {session!r}: {why}; ended {len(info['processes_ended'])} "
            f"process(es), removed the head's record and temp dir and the records of "
            f"sessions {info['sessions_removed']}"
        )
    return (
        f"released session {session!r}: {info['workers_ended']} worker(s) ended; "
        f"head stopped: {info['head_stopped']}"
    )


def render_reloaded(manifest: dict[str, Any]) -> str:
    moved = manifest.get("addresses_moved", [])
    return (
        render_load_table(manifest)
        + f"\nreloaded to version {manifest['ranks'][0]['version']}; addresses moved: {len(moved)}"
    )


def render_sessions(listing: dict[str, Any]) -> str:
    """``sessions``: the recorded head, then a line per recorded session."""
    import time

    head = listing["head"]
    lines = [f"$MXLOAD_HOME {listing['home']}:"]
    if head is None:
        lines.append("  no head recorded (`mxload load SRC --detach` starts one)")
    else:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(head["started_at"]))
        why = f" ({'; '.join(head['why'])})" if head["why"] else ""
        lines.append(
            f"  head {head['address']}, {head['devices']} {head['resource']}, started {since}: "
            f"{head['state']}{why}"
        )
    if not listing["sessions"]:
        lines.append("  no sessions recorded")
    for s in listing["sessions"]:
        if "unreadable" in s:
            lines.append(f"  session {s['session']}: record unreadable ({s['unreadable']})")
            continue
        where = "" if s["on_recorded_head"] else " (not the recorded head)"
        lines.append(
            f"  session {s['session']}: head {s['address']}{where}, {s['running']} of "
            f"{s['processes']} processes running (`mxload status --session {s['session']}`)"
        )
    return "\n".join(lines)


def render_status(manifest: dict[str, Any]) -> str:
    versions = sorted({r["version"] for r in manifest["ranks"]})
    return "\n".join(
        [
            *status_headline(manifest),
            render_load_table(manifest),
            f"versions {versions}; consistent: {bool(manifest['consistent'])}",
        ]
    )


def condense_error(text: str) -> str:
    """An error's text as the one line ``mxload: error:`` shows. A message that lists many
    mismatches (a refused reload) keeps its first line, then its root cause: the lines
    about the whole model before those of one rank's buffer, and the dimension that
    differs in most shapes; then the first items, capped."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return text.strip()
    head = lines[0].rstrip(":")
    items = [ln for ln in lines[1:] if not ln.startswith("... and ")]
    total = len(items) + sum(int(ln.split()[2]) for ln in lines[1:] if ln.startswith("... and "))
    model_wide = [ln for ln in items if not ln.startswith("rank ")]
    first = [
        *model_wide,
        *_common_dimension(items),
        *(ln for ln in items if ln.startswith("rank ")),
    ]
    shown = first[:MISMATCHES_SHOWN]
    left = total - sum(line in items for line in shown)
    return f"{head}: {'; '.join(shown)}" + (
        f"; ... and {left} more (--debug lists them)" if left > 0 else ""
    )


_SHAPES = re.compile(r": shape \(([^)]*)\) in the new checkpoint, \(([^)]*)\) held")


def _common_dimension(items: Sequence[str]) -> list[str]:
    """``["most shapes differ in one size: 160 in the new checkpoint, 256 held"]`` when
    one (new, held) pair of sizes is behind most shape mismatches, else nothing."""
    pairs: Counter[tuple[str, str]] = Counter()
    shapes = 0
    for item in items:
        found = _SHAPES.search(item)
        if not found:
            continue
        new, held = (part.split(",") for part in found.groups())
        shapes += 1
        if len(new) == len(held):
            pairs.update({(a.strip(), b.strip()) for a, b in zip(new, held, strict=True) if a != b})
    if not pairs:
        return []
    (new_size, held_size), count = pairs.most_common(1)[0]
    if count * 2 <= shapes:
        return []
    return [
        f"most shape mismatches listed ({count} of {shapes}) are a size {new_size} in the new "
        f"checkpoint where {held_size} is held (another model?)"
    ]


def render_inspect(src: str, info: dict[str, Any]) -> str:
    """``inspect``'s human summary: the model, its quantization, bytes per kind, files."""
    quant = info["quantization"]
    if "weight_block_size" in info:
        quant += " (blocks " + "x".join(str(b) for b in info["weight_block_size"])
        if info.get("block_scale_dtypes"):
            quant += ", scales " + "/".join(info["block_scale_dtypes"])
        quant += ")"
    experts = f", {info['experts']} experts in {info['moe_layers']} MoE layers" if info["experts"] else ""  # fmt: skip
    lines = [
        src,
        f"  model         {info['architecture']}: {info['layers']} layers{experts}, "
        f"hidden {info['hidden_size']}, vocab {info['vocab_size']}, dtype {info['dtype']}",
        f"  quantization  {quant}; {info['quantized_linears']} quantized linears"
        + (
            f"; not converted: {_some(info['not_converted'])} (--json lists them)"
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
    if info.get("not_planned"):
        lines[-1:-1] = [f"  not planned   {reason}" for reason in info["not_planned"]]
    for f in info["files"]:
        lines.append(f"    {f['file']}  {format_size(f['bytes'])}, {f['tensors']} tensors")
    return "\n".join(lines)


def layout_header(
    par: dict[str, Any], defaults_used: Sequence[str] = (), model: dict[str, Any] | None = None
) -> list[str]:
    """The layout a table is for, and the defaults that filled in what was not given."""
    placement = par.get("expert_placement", "linear")
    no_experts = (
        model is not None
        and not model.get("num_experts")
        and (par["enable_expert_parallel"] or placement != "linear")
    )
    no_tower = (
        model is not None
        and par.get("mm_encoder_tp_mode") == "data"
        and (not model.get("vision_depth") or bool(par.get("language_model_only")))
    )
    lines = [
        f"layout: tp={par['tp']} dp={par['dp']} pp={par['pp']} "
        f"ep={'on' if par['enable_expert_parallel'] else 'off'} "
        f"expert_placement={placement} world={par['world']}"
        + (" language-model-only" if par.get("language_model_only") else "")
        + (
            f" speculative={par['speculative_config']['method']}"
            if par.get("speculative_config")
            else ""
        )
        + (
            f" mm-encoder-tp-mode={par['mm_encoder_tp_mode']}"
            if par.get("mm_encoder_tp_mode")
            else ""
        )
        + (f" all2all-backend={par['all2all_backend']}" if par.get("all2all_backend") else "")
        + (" shared-expert-dp" if par.get("shared_expert_dp") else "")
        + (f" scale-alg={par['scale_alg']}" if par.get("scale_alg") is not None else "")
        + (" (a dense model: ep and expert_placement change nothing)" if no_experts else "")
        + (" (no vision tower planned: mm-encoder-tp-mode changes nothing)" if no_tower else "")
    ]
    if defaults_used:
        lines.append("defaults used: " + ", ".join(defaults_used))
    return lines


_DEVICE_NOTES = {
    "cpu": " (--device npu for Ascend)",
    # A plan is made where no device is probed: auto is planned as an accelerator.
    "auto": " (planned as for npu; --device cpu for a CPU load)",
}
"""What ``plan``'s first line adds after the device it was planned for."""


def moe_mode_lines(mode: dict[str, Any] | None) -> list[str]:
    """The MoE mode a plan assumed (none for a dense model)."""
    if not mode:
        return []
    return [
        f"MoE mode ({mode['engine']}): all2all backend {mode['all2all_backend']}, "
        f"sequence-parallel MoE {'on' if mode['sequence_parallel_moe'] else 'off'}; shared "
        f"experts {mode['shared_experts']} ({mode['why']})"
    ]


def render_plan_table(
    obj: dict[str, Any], devices_per_node: int = 16, defaults_used: Sequence[str] = ()
) -> str:
    """``plan``'s human output: what it is for (model, device, layout), a row per rank,
    the time model, and the verdict as the last line."""
    device = obj.get("device", "cpu")
    lines = [
        f"model: {obj['model'].get('architecture')}, planned for device {device}"
        + _DEVICE_NOTES.get(device, ""),
        *layout_header(obj["parallel"], defaults_used, obj.get("model")),
        *moe_mode_lines(obj.get("moe_mode")),
        *_plan_rows(obj),
        *_derived_lines(obj),
        *_time_model_lines(obj.get("time_model")),
        "minimum staging budget: load "
        f"{format_size(obj['min_staging_bytes']['load'])}, reload "
        f"{format_size(obj['min_staging_bytes']['reload'])}",
        *_per_node_lines(obj, devices_per_node),
        plan_verdict(obj),
    ]
    return "\n".join(lines)


def plan_verdict(obj: dict[str, Any]) -> str:
    """One line: whether every rank's peak fits the device memory, or that it was not
    checked (no ``--device-memory``)."""
    dev = obj.get("device_memory_bytes")
    if dev is None:
        return "fit not checked: give --device-memory SIZE to check each rank's peak against it"
    worst = max(obj["ranks"], key=lambda r: r["peak_bytes"])
    peak = worst["peak_bytes"]
    over = sum(r["peak_bytes"] > dev for r in obj["ranks"])
    kv = obj.get("kv_cache")
    if not over and kv is not None:
        return _kv_verdict(obj, kv, dev)
    if obj["fits"]:
        return (
            f"FITS: every rank's peak fits {format_size(dev)} of device memory (tightest: "
            f"rank {worst['rank']}, peak {format_size(peak)}, headroom {format_size(dev - peak)})"
        )
    return (
        f"DOES NOT FIT: {over} of {len(obj['ranks'])} ranks need more than "
        f"{format_size(dev)} of device memory (worst: rank {worst['rank']}, peak "
        f"{format_size(peak)}, short by {format_size(peak - dev)})"
    )


def _kv_verdict(obj: dict[str, Any], kv: dict[str, Any], dev: int) -> str:
    """The verdict of a plan whose weights fit: whether the KV cache holds one request of
    ``--max-model-len`` on every rank, and how much it holds on the tightest."""
    if "tightest_rank" not in kv:
        return f"FITS: every rank's peak fits {format_size(dev)} of device memory (no KV cache)"
    rank = obj["ranks"][kv["tightest_rank"]]
    room = rank["kv_cache"]
    length = kv["max_model_len"]
    share = f"--gpu-memory-utilization {kv['gpu_memory_utilization']}"
    if kv["fits"]:
        return (
            f"FITS: the weights and a KV cache of {format_size(room['room_bytes'])} on the "
            f"tightest rank {rank['rank']} ({share} of {format_size(dev)}): "
            f"{room['largest_batch']} request{'s' if room['largest_batch'] != 1 else ''} of "
            f"--max-model-len {length} at once "
            f"(--max-num-seqs {kv['max_num_seqs']}), {room['largest_context']} tokens alone"
        )
    if room["room_bytes"] <= 0:
        return (
            f"DOES NOT FIT: the weights fit {format_size(dev)}, but rank {rank['rank']} leaves "
            f"no KV cache under {share} (short by {format_size(-room['room_bytes'])}): "
            "raise --gpu-memory-utilization or --device-memory, or spread the weights "
            "(--tp, --pp)"
        )
    longest = room["largest_context"]
    return (
        f"DOES NOT FIT: the weights fit {format_size(dev)}, but rank {rank['rank']}'s KV cache "
        f"({format_size(room['room_bytes'])} under {share}) cannot hold one request of "
        f"--max-model-len {length} ({format_size(room['bytes_per_sequence'])}); "
        + (
            f"it holds {longest} tokens: lower --max-model-len"
            if longest
            else "lower --max-model-len"
        )
        + (
            ", raise --gpu-memory-utilization, or give the KV cache fp8 (--kv-cache-dtype fp8)"
            if not str(kv["kv_cache_dtype"]).startswith("fp8")
            else " or raise --gpu-memory-utilization"
        )
    )


def _plan_rows(obj: dict[str, Any]) -> list[str]:
    lines = [
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
    return lines


def _derived_lines(obj: dict[str, Any]) -> list[str]:
    """The tensors the engine derives after loading, which the plan holds and rewrites in
    place after their source (docs/contract.md §2.4), counted in persistent."""
    if not obj.get("derived"):
        return []
    worst = max(obj["ranks"], key=lambda r: r.get("derived_bytes", 0))
    return [
        f"derived in place after their source ({', '.join(obj['derived'])}; --engine "
        f"{obj.get('engine')}): up to {worst.get('derived_buffers', 0)} tensors, "
        f"{format_size(worst.get('derived_bytes', 0))} per rank, in persistent"
    ]


def _time_model_lines(tm: dict[str, Any] | None) -> list[str]:
    if not tm:
        return []
    rates = tm["rates_bytes_per_s"]
    slow = tm.get("slowest_request_seconds", 0) > 0.5 * tm["predicted_load_seconds"]
    return [
        f"predicted load {tm['predicted_load_seconds']:.2f} s, reload "
        f"{tm['predicted_reload_seconds']:.2f} s (--share {tm['share']}: "
        f"{format_size(tm['bytes_from_storage'])} from storage, distinct reads "
        f"{format_size(tm['distinct_read_bytes'])}; storage {format_size(int(rates['storage_node']))}/s "
        f"per node, {format_size(int(rates['storage_aggregate']))}/s aggregate, network "
        f"{format_size(int(rates['network_node']))}/s per node, convert "
        f"{format_size(int(rates['convert']))}/s per rank; {tm['nodes']} nodes of "
        f"{tm['devices_per_node']})",
        f"storage requests: {tm['requests_to_storage']} in all, "
        f"{tm['request_latency_s'] * 1000:g} ms each, {tm['request_concurrency']} in "
        "flight per rank"
        + (
            f", store serves {tm['storage_requests_per_s']:g}/s"
            if tm["storage_requests_per_s"]
            else ""
        )
        + (
            f"; the slowest rank waits {tm['slowest_request_seconds']:.1f} s on requests"
            if slow
            else ""
        ),
        *_request_bound_lines(tm.get("request_bound")),
    ]


def _request_bound_lines(rb: dict[str, Any] | None) -> list[str]:
    """What sends the requests that bound the slowest rank, and what would help."""
    if not rb:
        return []
    lines = [f"requests bound the load: rank {rb['slowest_rank']} sends {rb['cause']}"]
    for h in rb["would_help"]:
        if "refused" in h:
            lines.append(f"  {h['flags']}: not possible here ({h['refused']})")
        else:
            lines.append(
                f"  {h['flags']}: predicted load {h['predicted_load_seconds']:.2f} s, "
                f"{h['requests_to_storage']} requests"
            )
    if not rb["would_help"]:
        lines.append("  no flag of plan lowers them (a coarser --tp sends fewer per rank)")
    return lines


def _per_node_lines(obj: dict[str, Any], devices_per_node: int) -> list[str]:
    dev = obj.get("device_memory_bytes")
    if dev is None:
        return []
    ranks = obj["ranks"]
    nodes = [ranks[i : i + devices_per_node] for i in range(0, len(ranks), devices_per_node)]
    lines = [f"per node ({devices_per_node} devices each, ranks packed in order):"]
    for n, group in enumerate(nodes[:16]):
        worst = max(group, key=lambda r: r["peak_bytes"])
        lines.append(
            f"  node {n}: ranks {group[0]['rank']}-{group[-1]['rank']}, tightest rank "
            f"{worst['rank']} headroom {format_size(dev - worst['peak_bytes'])}"
        )
    if len(nodes) > 16:
        lines.append(f"  ... {len(nodes) - 16} more nodes")
    return lines


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


def detach_note(manifest: dict[str, Any], session: str, home: object) -> str:
    """What a detached load leaves behind (recorded under ``home``, $MXLOAD_HOME) and the
    commands that come next."""
    flag = "" if session == "default" else f" --session {session}"
    return "\n".join(
        [
            f"session {session!r} is loaded and detached: {len(manifest['ranks'])} workers "
            f"hold the weights on the Ray head at {manifest.get('address')} "
            f"(recorded in {home})",
            "next:",
            f"  mxload status{flag}            versions, consistency, addresses",
            f"  mxload reload NEW_SRC{flag}    rewrite the weights in place",
            f"  mxload release{flag}           end the session and free the devices",
        ]
    )


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
    if ident.get("established_by"):
        lines.append(f"identity: {ident['established_by']}")
    lines += [f"note: {n}" for n in manifest.get("notices", [])]
    return lines


def _some(names: list[str], shown: int = 4) -> str:
    """The first ``shown`` names and how many more: a line stays a line."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
