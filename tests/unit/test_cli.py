"""The ``mxload`` command line in-process: ``main(argv)``'s exit status and what it prints.

* Refusals exit 2 (3 for a load that does not fit) with one line on stderr beginning
  ``mxload: error:``, naming the file, key, tensor or flag, without traceback or colour
  codes; and they start nothing: the ``guard`` fixture makes ``ray.init`` and
  ``subprocess.Popen`` fail (and records the attempt), so a refusal that reached either
  shows up as a failed test.
* What a new user meets: outputs that do not overwrite, a file where a folder belongs,
  a flag without its port or unit, contradicting flags, a mistyped or abbreviated flag,
  ``--version``, the device and the verdict of a plan, ``convert``'s summary, a refused
  reload's root cause.

The same behaviour as a real process (exit status, no traceback, the console script) is
in tests/integration/test_cli.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.cli import main
from mxload.orchestrator.runtime.models import model_config_path

from tests.hostile import ATTACKS

CONFIGS = model_config_path("deepseek-v3").parent  # the packaged configs
SHARD2 = "model-00002-of-00002.safetensors"
SECRET = b"\x07\x00\x00\x00\x00\x00\x00\x00SECRET-hash-$6$rounds"
"""The target of the outside link: a small header length then bytes nobody may see."""


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """What the command tried to start (must stay empty for a refusal): ``ray.init`` and
    ``subprocess.Popen`` fail and are recorded. Also an empty $MXLOAD_HOME of the test's
    own, so no command can reach a recorded session."""
    import ray

    started: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def start(*args: Any, **kwargs: Any) -> Any:
            started.append(what)
            raise AssertionError(f"a refusal must start nothing; {what} was called")

        return start

    monkeypatch.setattr(ray, "init", refuse("ray.init"))
    monkeypatch.setattr(subprocess, "Popen", refuse("subprocess.Popen"))
    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home-empty"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return started


@pytest.fixture
def mxload(
    guard: list[str], capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """``mxload(*argv)`` -> (exit status, stdout, stderr), in this process."""
    level = logging.getLogger("mxload").level

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    logging.getLogger("mxload").setLevel(level)


def build_inputs(work: Path, ckpt_factory: Callable[..., str]) -> dict[str, str]:
    """Checkpoints and configs for the refusals: two versions, a BF16 model, broken
    variants (config edits, a shard that is a folder, a shard linked outside), a folder of
    someone's that must never be written into."""
    out = {
        "v1": ckpt_factory("qwen3-moe-tiny", 1),
        "v2": ckpt_factory("qwen3-moe-tiny", 2),
        "bf16": ckpt_factory("qwen3-dense-tiny", 1, bf16=True),
    }
    with open(os.path.join(out["v1"], "config.json")) as f:
        config = json.load(f)

    def variant(name: str, change: Callable[[dict[str, Any]], Any]) -> None:
        cfg = json.loads(json.dumps(config))
        change(cfg)
        path = work / f"config-{name}.json"
        path.write_text(json.dumps(cfg))
        out[f"config-{name}"] = str(path)
        ck = work / f"ckpt-{name}"
        shutil.copytree(out["v1"], ck)
        (ck / "config.json").write_text(json.dumps(cfg))
        out[f"ckpt-{name}"] = str(ck)

    variant("per-tensor", lambda c: c["quantization_config"].pop("weight_block_size"))
    variant("static", lambda c: c["quantization_config"].update(activation_scheme="static"))
    variant("arch", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    variant("huge", lambda c: c.update(hidden_size=10**12))
    folder = work / "shard-folder"  # a directory where a shard file should be
    shutil.copytree(out["v1"], folder)
    (folder / SHARD2).unlink()
    (folder / SHARD2).mkdir()
    out["shard-folder"] = str(folder)
    used = work / "used"  # someone's folder: never to be written into without --overwrite
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    out["used"] = str(used)
    link = work / "outside-link"  # a shard linked to a file outside the checkpoint
    shutil.copytree(out["v1"], link)
    (work / "secret").write_bytes(SECRET)
    (link / SHARD2).unlink()
    (link / SHARD2).symlink_to(work / "secret")
    out["outside-link"] = str(link)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-unit")


@pytest.fixture(scope="module")
def ckpts(work: Path, ckpt_factory: Callable[..., str]) -> dict[str, str]:
    return build_inputs(work, ckpt_factory)


def assert_refused(got: tuple[int, str, str], *names: str, code: int = 2) -> str:
    """Exit ``code``, one line on stderr ``mxload: error: ...`` naming ``names``; the line."""
    rc, out, err = got
    shown = f"rc={rc}\nstderr: {err[-3000:]}\nstdout: {out[-1000:]}"
    assert rc == code, shown
    assert err.startswith("mxload: error:"), shown
    assert len(err.strip().splitlines()) == 1, shown
    assert "Traceback" not in err + out and "\x1b[" not in err, shown
    for name in names:
        assert name in err, f"{name!r} not named\n{shown}"
    return err.strip()


# --- refusals: exit 2, `mxload: error:`, names what is wrong, starts nothing -------------------


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def _sparse(path: Path, size: int) -> str:
    """A sparse file of ``size`` bytes (no disk used): a config nobody should read whole."""
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


_PLAN_27B = ("plan", "--model", "qwen3.8-27b-fp8", "--tp", "4")


def _spec(method: str, tokens: int, **more: str) -> str:
    return json.dumps({"method": method, "num_speculative_tokens": tokens, **more})


def _written(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


REFUSALS: dict[str, tuple[Callable[[Path, dict[str, str]], list[str]], list[str]]] = {
    "config-nested-too-deeply": (
        lambda w, c: ["plan", "--config", _written(w / "deep.json", "[" * 30000 + "]" * 30000)],
        ["--config", "deep.json", "nested too deeply"],
    ),
    "speculative-config-nested-too-deeply": (
        lambda w, c: ["plan", "--model", "qwen3.8-27b-fp8", "--speculative-config", "[" * 30000],
        ["--speculative-config", "nested too deeply"],
    ),
    "storage-options-file-nested-too-deeply": (
        lambda w, c: [
            "inspect",
            c["v1"],
            "--storage-options",
            "@" + _written(w / "o.json", "[" * 30000),
        ],
        ["--storage-options", "o.json", "nested too deeply"],
    ),
    "storage-options-huge-integer": (
        lambda w, c: [
            "inspect",
            c["v1"],
            "--storage-options",
            '{"mxload_read_timeout_s": ' + "1" * 5000 + "}",
        ],
        ["--storage-options", "not valid JSON", "digits"],
    ),
    "report-is-a-fifo": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--report", _fifo(w / "fifo")],
        ["--report", "fifo", "not a regular file"],
    ),
    "report-and-dump-same-path": (
        lambda w, c: [
            "load",
            c["v1"],
            "--device",
            "cpu",
            "--report",
            str(w / "o"),
            "--dump",
            str(w / "o"),
        ],
        ["--report", "--dump", "same path"],
    ),
    "unknown-preset": (
        lambda w, c: ["make-checkpoint", str(w / "x"), "--preset", "nope"],
        ["--preset", "nope", "qwen3-moe-tiny"],
    ),
    "bad-storage-options": (
        lambda w, c: ["inspect", c["v1"], "--storage-options", "{bad"],
        ["--storage-options"],
    ),
    "storage-options-not-object": (
        lambda w, c: ["inspect", c["v1"], "--storage-options", "[1]"],
        ["--storage-options"],
    ),
    "flag-and-storage-option-disagree": (
        lambda w, c: [
            "inspect",
            c["v1"],
            "--min-read-rate",
            "2MiB",
            "--storage-options",
            '{"mxload_min_read_rate": 1000}',
        ],
        ["--min-read-rate", "2097152", "mxload_min_read_rate", "1000", "disagree"],
    ),
    "outside-links-flag-and-option-disagree": (
        lambda w, c: [
            "inspect",
            c["v1"],
            "--allow-outside-links",
            "--storage-options",
            '{"mxload_allow_outside_links": false}',
        ],
        ["--allow-outside-links", "mxload_allow_outside_links", "disagree"],
    ),
    "missing-dir": (lambda w, c: ["inspect", str(w / "nowhere")], [str(Path("nowhere"))]),
    "per-tensor-fp8": (
        lambda w, c: ["plan", "--config", c["config-per-tensor"]],
        ["weight_block_size", "config-per-tensor.json"],
    ),
    "per-tensor-fp8-ckpt": (
        lambda w, c: ["inspect", c["ckpt-per-tensor"]],
        ["weight_block_size", "ckpt-per-tensor/config.json"],
    ),
    "static-activations": (
        lambda w, c: ["plan", "--config", c["config-static"]],
        ["activation_scheme", "config-static.json"],
    ),
    "static-activations-load": (
        lambda w, c: ["load", c["ckpt-static"], "--device", "cpu"],
        ["activation_scheme", "ckpt-static/config.json"],
    ),
    "unknown-architecture": (
        lambda w, c: ["plan", "--config", c["config-arch"]],
        ["LlamaForCausalLM", "architectures", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"],
    ),
    "bad-layout": (lambda w, c: ["plan", c["v1"], "--tp", "3"], ["--tp"]),
    "bad-layout-load": (
        lambda w, c: ["load", c["v1"], "--tp", "3", "--device", "cpu"],
        ["--tp"],
    ),
    "zero-tp": (lambda w, c: ["plan", c["v1"], "--tp", "0"], ["--tp"]),
    "budget-below-minimum": (
        lambda w, c: ["plan", c["v1"], "--staging-budget", "1000B"],
        ["--staging-budget"],
    ),
    "budget-below-minimum-load": (
        lambda w, c: ["load", c["v1"], "--staging-budget", "1000B", "--device", "cpu"],
        ["--staging-budget"],
    ),
    "bad-size": (lambda w, c: ["plan", c["v1"], "--device-memory", "lots"], ["--device-memory"]),
    "reload-no-session": (
        lambda w, c: ["reload", c["v2"], "--session", "nosuch"],
        ["--address"],
    ),
    "status-no-session": (lambda w, c: ["status"], ["--address", "home-empty"]),
    "release-no-session": (lambda w, c: ["release"], ["--address"]),
    "convert-bf16": (
        lambda w, c: ["convert", c["bf16"], str(w / "never")],
        ["quantization_config"],
    ),
    "no-command": (lambda w, c: [], ["command"]),
    "config-file-missing": (
        lambda w, c: ["plan", "--config", str(w / "absent.json")],
        ["--config", "absent.json"],
    ),
    "config-file-a-device": (
        lambda w, c: ["plan", "--config", "/dev/zero"],
        ["--config", "/dev/zero", "character device"],
    ),
    "config-file-too-large": (
        lambda w, c: ["plan", "--config", _sparse(w / "huge.json", 65 << 20)],
        ["--config", "huge.json", "larger than"],
    ),
    "convert-format-the-release-cannot-serve": (
        lambda w, c: [
            "convert",
            c["v1"],
            str(w / "never"),
            "--format",
            "modelopt",
            "--engine",
            "vllm-ascend-0.23.0.post1",
        ],
        ["--format modelopt", "vllm-ascend-0.23.0.post1", "--format ascend"],
    ),
    "bf16-with-scale-dtype": (
        lambda w, c: [
            *("make-checkpoint", str(w / "never"), "--preset", "qwen3.5-tiny"),
            *("--bf16", "--scale-dtype", "BF16"),
        ],
        ["--scale-dtype", "--bf16"],
    ),
    # vLLM's speculative_config: only the checkpoint's own Qwen3.5 MTP module is planned
    "speculative-method-not-mtp": (
        lambda w, c: [*_PLAN_27B, "--speculative-config", _spec("eagle", 1)],
        ["--speculative-config", "'eagle'", "mtp"],
    ),
    "speculative-without-tokens": (
        lambda w, c: [*_PLAN_27B, "--speculative-config", '{"method": "mtp"}'],
        ["--speculative-config", "num_speculative_tokens"],
    ),
    "speculative-draft-model": (
        lambda w, c: [*_PLAN_27B, "--speculative-config", _spec("mtp", 1, model="x/y")],
        ["--speculative-config", "'model'"],
    ),
    "mtp-with-pipeline-parallel": (
        lambda w, c: [*_PLAN_27B, "--pp", "2", "--speculative-config", _spec("mtp", 2)],
        ["--speculative-config", "--pp 2", "last pipeline stage"],
    ),
    "mtp-on-a-model-without-mtp": (
        lambda w, c: ["plan", c["v1"], "--speculative-config", _spec("qwen3_5_mtp", 1)],
        ["--speculative-config", "mtp_num_hidden_layers"],
    ),
    "mtp-on-deepseek-pp2": (
        lambda w, c: [
            *("plan", "--model", "deepseek-v3", "--tp", "8", "--pp", "2"),
            *("--speculative-config", _spec("mtp", 1)),
        ],
        ["--speculative-config", "--pp 2", "DeepSeekMTP drafter then loads its own embed_tokens"],
    ),
    "mm-encoder-tp-mode-typo": (
        lambda w, c: [*_PLAN_27B, "--mm-encoder-tp-mode", "dat"],
        ["--mm-encoder-tp-mode", "did you mean data?"],
    ),
    "convert-to-ftp": (
        lambda w, c: ["convert", c["v1"], "ftp://nowhere.invalid/out"],
        ["DST", "ftp://", "does not write"],
    ),
    "dump-to-http": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--dump", "http://127.0.0.1:9/d"],
        ["--dump", "http://", "does not write"],
    ),
    "unknown-flag": (lambda w, c: ["plan", c["v1"], "--frobnicate"], ["--frobnicate"]),
    "config-file-as-src": (
        lambda w, c: ["plan", c["config-static"]],
        ["--config", "config-static.json", "is a file"],
    ),
    "model-name-as-src": (lambda w, c: ["plan", "deepseek-v3"], ["--model deepseek-v3"]),
    "unknown-model": (
        lambda w, c: ["plan", "--model", "llama-3"],
        ["--model", "llama-3", "deepseek-v3", "qwen3-235b-a22b-fp8", "--config"],
    ),
    "npu-without-torch-npu": (
        lambda w, c: ["load", c["v1"], "--tp", "2", "--device", "npu"],
        ["--device npu", "torch_npu", "--device cpu"],
    ),
    "cuda-without-cuda": (
        lambda w, c: ["load", c["v1"], "--device", "cuda"],
        ["--device cuda", "CUDA"],
    ),
    "unreachable-address-load": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--address", "127.0.0.1:1"],
        ["--address 127.0.0.1:1", "refused"],
    ),
    "unreachable-address-status": (
        lambda w, c: ["status", "--address", "127.0.0.1:1"],
        ["--address 127.0.0.1:1"],
    ),
    "size-without-unit": (
        lambda w, c: ["plan", c["v1"], "--device-memory", "64"],
        ["--device-memory", "'64'", "64GiB", "64B"],
    ),
    "max-restarts-negative": (
        lambda w, c: ["load", c["v1"], "--max-restarts", "-5", "--device", "cpu"],
        ["--max-restarts", "-5"],
    ),
    "inspect-empty-location": (lambda w, c: ["inspect", ""], ["empty path"]),
    "shard-is-a-folder": (
        lambda w, c: ["inspect", c["shard-folder"]],
        [f"shard-folder/{SHARD2}", "is a folder"],
    ),
    "unsupported-protocol": (lambda w, c: ["inspect", "ftp://x"], ["ftp://x", "unsupported"]),
    "timeout-above-cap": (
        lambda w, c: ["inspect", c["v1"], "--read-timeout", "600"],
        ["--read-timeout", "600"],
    ),
    "report-parent-missing": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--report", str(w / "nodir" / "r.json")],
        ["--report", "nodir", "does not exist"],
    ),
    "report-is-a-folder": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--report", str(w)],
        ["--report", "is a folder"],
    ),
    "report-unwritable-reload": (
        lambda w, c: ["reload", c["v2"], "--report", str(w / "nodir" / "r.json")],
        ["--report", "nodir"],
    ),
    "dump-into-a-used-folder": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--dump", c["used"]],
        ["--dump", "used", "not empty", "--overwrite"],
    ),
    "status-dump-into-a-used-folder": (
        lambda w, c: ["status", "--dump", c["used"]],
        ["--dump", "used", "--overwrite"],
    ),
    "convert-onto-itself": (
        lambda w, c: ["convert", c["v1"], c["v1"], "--overwrite"],
        ["DST", "is SRC", "no output may overwrite an input"],
    ),
    "convert-into-itself": (
        lambda w, c: ["convert", c["v1"], c["v1"] + "/out"],
        ["inside"],
    ),
    "convert-into-a-used-folder": (
        lambda w, c: ["convert", c["v1"], c["used"]],
        ["DST", "used", "--overwrite"],
    ),
    "convert-hidden-size-1e12": (
        lambda w, c: ["convert", c["ckpt-huge"], str(w / "never")],
        ["hidden_size", "1000000000000"],
    ),
    "outside-link": (
        lambda w, c: ["inspect", c["outside-link"]],
        [f"outside-link/{SHARD2}", "outside the checkpoint folder", "--allow-outside-links"],
    ),
    "outside-link-convert": (
        lambda w, c: ["convert", c["outside-link"], str(w / "never")],
        [f"outside-link/{SHARD2}", "--allow-outside-links"],
    ),
    "flag-where-it-does-not-act": (
        lambda w, c: ["inspect", c["v1"], "--max-restarts", "3"],
        ["--max-restarts"],
    ),
    # What a new user met (each once exit 1 with a raw Python exception, or silent):
    "make-checkpoint-over-a-file": (
        lambda w, c: ["make-checkpoint", c["v1"] + "/config.json", "--preset", "qwen3-moe-tiny"],
        ["OUT", "config.json", "not a folder"],
    ),
    "make-checkpoint-over-a-used-folder": (
        lambda w, c: ["make-checkpoint", c["used"], "--preset", "qwen3-moe-tiny"],
        ["OUT", "used", "not empty", "--overwrite"],
    ),
    "make-checkpoint-parent-missing": (
        lambda w, c: ["make-checkpoint", str(w / "nodir" / "ck"), "--preset", "qwen3-moe-tiny"],
        ["OUT", "nodir", "does not exist"],
    ),
    "inspect-a-file": (
        lambda w, c: ["inspect", c["v1"] + "/config.json"],
        ["config.json", "is a file", "not a checkpoint folder", "give its folder ("],
    ),
    "load-a-file": (
        lambda w, c: ["load", c["v1"] + "/config.json", "--device", "cpu"],
        ["config.json", "is a file"],
    ),
    "address-without-port": (
        lambda w, c: ["status", "--address", "localhost"],
        ["--address localhost", "HOST:PORT"],
    ),
    "address-without-port-load": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--address", "localhost"],
        ["--address localhost", "HOST:PORT"],
    ),
    "plan-src-and-model": (
        lambda w, c: ["plan", "--model", "deepseek-v3", c["v1"]],
        ["SRC", "--model deepseek-v3", "drop SRC"],
    ),
    "plan-src-and-config": (
        lambda w, c: ["plan", "--config", c["config-static"], c["v1"]],
        ["SRC", "--config", "drop SRC"],
    ),
    "session-without-detach": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--session", "mine"],
        ["--session mine", "--detach"],
    ),
    "ambiguous-size-unit": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--device-memory", "64G"],
        ["--device-memory", "'64G'", "64GiB", "2^30", "64GB", "10^9"],
    ),
    "mistyped-flag": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--device-memroy", "64GiB"],
        ["--device-memroy", "did you mean --device-memory?"],
    ),
    "abbreviated-flag": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--device-mem", "64GiB"],
        ["--device-mem", "did you mean --device-memory?"],
    ),
    "abbreviated-flag-top-level": (lambda w, c: ["--vers"], ["--vers", "--version?"]),
    "abbreviated-required-flag": (
        lambda w, c: ["make-checkpoint", str(w / "never"), "--pres", "qwen3-moe-tiny"],
        ["--pres", "did you mean --preset?"],
    ),
    "convert-from-an-empty-path": (
        lambda w, c: ["convert", "", str(w / "never")],
        ["SRC", "empty path"],
    ),
    "inspect-an-empty-path": (lambda w, c: ["inspect", ""], ["SRC", "empty path"]),
    "load-an-empty-path": (lambda w, c: ["load", "", "--device", "cpu"], ["SRC", "empty path"]),
    "size-starting-with-a-dash": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--device-memory", "-5GB"],
        ["--device-memory", "'-5GB'", "--device-memory=-5GB"],
    ),
    "config-is-a-folder": (
        lambda w, c: ["plan", "--config", c["v1"]],
        ["--config", "is a folder", "config.json"],
    ),
    "request-latency-nan": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--request-latency", "nan"],
        ["--request-latency", "nan"],
    ),
    "storage-request-rate-inf": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--storage-request-rate", "inf"],
        ["--storage-request-rate", "inf"],
    ),
    "devices-per-node-zero": (
        lambda w, c: ["plan", "--model", "deepseek-v3", "--devices-per-node", "0"],
        ["--devices-per-node must be >= 1, got 0"],
    ),
    "mistyped-command": (lambda w, c: ["plna", "--model", "deepseek-v3"], ["plna", "plan?"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(
    mxload: Callable[..., tuple[int, str, str]],
    guard: list[str],
    work: Path,
    ckpts: dict[str, str],
    case: str,
) -> None:
    build, names = REFUSALS[case]
    got = mxload(*build(work, ckpts))
    assert guard == [], "a refusal must start nothing"
    assert_refused(got, *names)
    assert not (work / "never").exists() and not (work / "nodir").exists()
    assert "SECRET" not in got[1] + got[2]
    assert sorted(os.listdir(ckpts["used"])) == ["keep.txt"]
    assert (Path(ckpts["used"]) / "keep.txt").read_text() == "mine"
    assert not list(work.rglob("*mxload-tmp*")), "a refusal leaves no temporary files"


def test_convert_to_an_empty_path_from_the_current_folder(
    mxload: Callable[..., tuple[int, str, str]],
    guard: list[str],
    ckpts: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An empty DST is named as such, not taken for the current folder (which holds SRC)."""
    monkeypatch.chdir(Path(ckpts["v1"]).parent)
    err = assert_refused(mxload("convert", Path(ckpts["v1"]).name, ""), "DST", "empty path")
    assert "inside" not in err


def test_a_storage_option_the_back_end_does_not_take_is_named(
    mxload: Callable[..., tuple[int, str, str]], guard: list[str], ckpts: dict[str, str]
) -> None:
    """fsspec's HTTP file system hands unknown options to every request (aiohttp then
    raises TypeError): a bad input named by its key, not a missing config.json."""
    from tests.servers import RangeHTTPServer

    root = Path(ckpts["v1"])
    with RangeHTTPServer(str(root.parent)) as server:
        url = f"{server.url}/{root.name}"
        assert mxload("inspect", url)[0] == 0
        got = mxload("inspect", url, "--storage-options", '{"verify_tls": false}')
    err = assert_refused(got, "--storage-options", "'verify_tls'", "takes no option")
    assert "no such file" not in err


HOSTILE = ["oversized_header_length", "overlapping_tensors", "unknown_dtype", "header_nested_too_deep"]  # fmt: skip


@pytest.mark.parametrize("attack", HOSTILE)
def test_hostile_header_is_refused(
    mxload: Callable[..., tuple[int, str, str]],
    guard: list[str],
    work: Path,
    ckpts: dict[str, str],
    attack: str,
) -> None:
    spec = {a.name: a for a in ATTACKS}[attack]
    ck = work / f"hostile-{attack}"
    shutil.copytree(ckpts["v1"], ck)
    (ck / SHARD2).write_bytes(spec.build())
    names = [SHARD2] + ([spec.tensor] if spec.tensor else [])
    assert_refused(mxload("inspect", str(ck)), *names)
    assert_refused(mxload("plan", str(ck), "--tp", "2"), *names)
    assert guard == []


def test_a_silent_listener_is_not_taken_for_a_ray_head(
    mxload: Callable[..., tuple[int, str, str]], guard: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port that accepts connections but never speaks gRPC: refused in seconds, naming
    the address (Ray itself would retry for a minute and more). The probe waits 1 s here
    (5 s by default)."""
    import socket
    import threading

    from mxload.cluster import local

    monkeypatch.setattr(local.check_reachable, "__defaults__", (1.0,))

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    try:
        got = mxload("status", "--address", address)
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
    line = assert_refused(got, f"--address {address}", "no answer")
    assert "Failed to connect" not in line
    assert guard == []


def test_load_that_does_not_fit_exits_3_before_starting_anything(
    mxload: Callable[..., tuple[int, str, str]], guard: list[str], ckpts: dict[str, str]
) -> None:
    got = mxload("load", ckpts["v1"], "--tp", "2", "--device", "cpu", "--device-memory", "1MiB")
    assert_refused(got, "--device-memory", code=3)
    assert guard == []


def test_debug_raises_the_error_itself(
    mxload: Callable[..., tuple[int, str, str]], ckpts: dict[str, str]
) -> None:
    """No traceback unless --debug: with it the traceback, then the same line and exit
    status (a script's handling of the status does not change with the flag)."""
    assert_refused(mxload("plan", "--config", ckpts["config-static"]), "activation_scheme")
    code, _, err = mxload("plan", "--config", ckpts["config-static"], "--debug")
    assert code == 2 and "Traceback" in err, err
    assert "activation_scheme" in err.strip().splitlines()[-1]


# --- outputs: make-checkpoint follows the outputs rule ------------------------------------------


def test_make_checkpoint_replaces_a_checkpoint_only_with_overwrite(
    mxload: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    out = tmp_path / "ck"
    rc, first, _ = mxload("make-checkpoint", str(out), "--preset", "qwen3-dense-tiny", "--json")
    assert rc == 0
    made = json.loads(first)
    assert made["out"] == str(out)
    assert sorted(os.listdir(out)) == sorted(made["files"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = ["make-checkpoint", str(out), "--preset", "qwen3-dense-tiny", "--seed", "5"]
    assert_refused(mxload(*again), f"OUT {out}", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    rc, line, _ = mxload(*again, "--overwrite")
    assert rc == 0 and line.startswith(f"wrote block-FP8 qwen3-dense-tiny (seed 5) to {out}:")
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted(before) and after != before  # replaced whole
    assert sorted(os.listdir(tmp_path)) == ["ck"], "no temporary folder left beside it"


# --- what the commands print ---------------------------------------------------------------------


def test_version_is_the_package_version(mxload: Callable[..., tuple[int, str, str]]) -> None:
    import mxload as package

    rc, out, err = mxload("--version")
    assert rc == 0 and err == ""
    assert out.strip() == f"mxload {package.__version__}"
    assert package.__version__.count(".") == 2  # a release number, not a placeholder


def test_size_help_says_which_unit_is_binary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "64GiB = 64 x 2^30 bytes" in text and "2GB = 2 x 10^9 bytes" in text
    assert "64G are refused" in text


@pytest.mark.parametrize(
    "model,extra,noted",
    [
        ("qwen3-32b-fp8", [], True),
        ("qwen3.8-27b-fp8", ["--language-model-only"], True),
        ("qwen3.8-27b-fp8", [], False),
    ],
)
def test_encoder_mode_without_a_planned_tower_is_called_out(
    model: str, extra: list[str], noted: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", "--model", model, "--tp", "4", "--mm-encoder-tp-mode", "data", *extra]) == 0
    )
    layout = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("layout:"))
    assert ("mm-encoder-tp-mode changes nothing" in layout) == noted


@pytest.mark.parametrize(
    "model,extra,noted",
    [
        ("qwen3-32b-fp8", ["--enable-expert-parallel"], True),
        ("qwen3-32b-fp8", ["--expert-placement", "round_robin"], True),
        ("qwen3-32b-fp8", [], False),
        ("qwen3-30b-a3b-fp8", ["--enable-expert-parallel"], False),
    ],
)
def test_expert_flags_on_a_dense_model_are_called_out(
    model: str, extra: list[str], noted: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", model, "--tp", "4", *extra]) == 0
    layout = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("layout:"))
    assert ("a dense model: ep and expert_placement change nothing" in layout) == noted


PLAN_30B = ["plan", "--config", str(CONFIGS / "qwen3-30b-a3b-fp8.json"), "--tp", "4", "--dp", "2", "--enable-expert-parallel"]  # fmt: skip


def test_plan_heading_names_the_device(mxload: Callable[..., tuple[int, str, str]]) -> None:
    rc, out, _ = mxload(*PLAN_30B)
    assert rc == 0
    # plan plans for the NPU unless told otherwise (docs/contract.md §5)
    assert out.splitlines()[0] == "model: Qwen3MoeForCausalLM, planned for device npu"
    assert "--device npu" in out.splitlines()[2], "the defaults used name the device"
    rc, out, _ = mxload(*PLAN_30B, "--device", "cpu")
    assert rc == 0
    assert out.splitlines()[0] == (
        "model: Qwen3MoeForCausalLM, planned for device cpu (--device npu for Ascend)"
    )
    rc, out, _ = mxload(*PLAN_30B, "--device", "npu", "--json")
    assert json.loads(out)["device"] == "npu"
    rc, out, _ = mxload(*PLAN_30B, "--device", "auto")
    assert rc == 0
    assert out.splitlines()[0] == (
        "model: Qwen3MoeForCausalLM, planned for device auto "
        "(planned as for npu; --device cpu for a CPU load)"
    )


def test_plan_verdict_is_the_last_line(mxload: Callable[..., tuple[int, str, str]]) -> None:
    rc, out, _ = mxload(*PLAN_30B, "--device-memory", "1GiB")
    assert rc == 3
    lines = out.strip().splitlines()
    assert lines[-1].startswith("DOES NOT FIT: 8 of 8 ranks need more than 1.00 GiB"), lines[-1]
    assert not any("FIT" in ln for ln in lines[:-1]), "the verdict appears once, last"
    rc, out, _ = mxload(*PLAN_30B, "--device-memory", "1TiB")
    assert rc == 0
    # the weights fit, and so does the engine's KV cache (plan/kvcache.py)
    assert out.strip().splitlines()[-1].startswith("FITS: the weights and a KV cache of ")
    rc, out, _ = mxload(*PLAN_30B)
    assert rc == 0
    assert out.strip().splitlines()[-1].startswith("fit not checked: give --device-memory")


def test_plan_json_fits_is_null_when_not_checked(
    mxload: Callable[..., tuple[int, str, str]],
) -> None:
    rc, out, _ = mxload(*PLAN_30B, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["device_memory_bytes"] is None and doc["fits"] is None
    rc, out, _ = mxload(*PLAN_30B, "--json", "--device-memory", "1GiB")
    doc = json.loads(out)
    assert rc == 3 and doc["device_memory_bytes"] == 2**30 and doc["fits"] is False
    assert all(r["peak_bytes"] > 2**30 for r in doc["ranks"])
    rc, out, _ = mxload(*PLAN_30B, "--json", "--device-memory", "1TiB")
    assert rc == 0 and json.loads(out)["fits"] is True


def test_convert_prints_a_short_summary(
    mxload: Callable[..., tuple[int, str, str]], ckpts: dict[str, str], tmp_path: Path
) -> None:
    rc, out, _ = mxload("convert", ckpts["v1"], str(tmp_path / "a"), "--json")
    assert rc == 0
    summary = json.loads(out)
    rc, text, _ = mxload("convert", ckpts["v1"], str(tmp_path / "b"))
    assert rc == 0
    assert "{" not in text and "[" not in text, text
    lines = text.strip().splitlines()
    assert lines[0].startswith(f"converted {ckpts['v1']} -> {tmp_path / 'b'}: ")
    assert f"{summary['tensors']} tensors in {summary['files']} file(s)" in lines[0]
    assert lines[1].startswith("  kept unquantized (not converted): lm_head, ")
    assert len(lines) == 2


def test_verbose_and_debug_set_the_log_level(
    mxload: Callable[..., tuple[int, str, str]],
) -> None:
    args = ["plan", "--model", "qwen3-32b-fp8", "--json"]
    assert mxload(*args)[0] == 0
    assert logging.getLogger("mxload").level == logging.WARNING
    assert mxload(*args, "-v")[0] == 0
    assert logging.getLogger("mxload").level == logging.INFO
    assert mxload(*args, "--debug")[0] == 0
    assert logging.getLogger("mxload").level == logging.DEBUG


def test_a_refused_reload_shows_its_root_cause_first_on_one_line(
    ckpt_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A reload against another model (hidden 160, held 256): the refusal's one line
    names the size behind the mismatches first and is capped; the error itself lists
    every buffer (--debug shows it)."""
    from mxload import ParallelLayout, build_plan, open_checkpoint, reload_inputs
    from mxload.orchestrator.cli.commands import report_error
    from mxload.orchestrator.errors import ReloadMismatch

    held_src = ckpt_factory("qwen3-moe-tiny", 1)
    other = ckpt_factory("qwen3-moe-tiny", 3, overrides={"hidden_size": 160})
    meta = open_checkpoint(held_src)
    held = build_plan(
        meta.config, ParallelLayout(tp=2, enable_expert_parallel=True), checkpoint=meta
    )
    with pytest.raises(ReloadMismatch) as refused:
        reload_inputs(held, other)
    listed = str(refused.value).splitlines()
    assert len(listed) > 50  # the whole list is in the error
    capsys.readouterr()
    assert report_error(refused.value, 2, ["reload", other]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"mxload: error: reload from {other} refused, nothing was touched; ")
    shapes = [ln for ln in listed if ": shape (" in ln]
    by_hidden = [
        ln
        for ln in shapes
        if "160" in ln.split(" in the new")[0] and "256" in ln.split("checkpoint, ")[1]
    ]
    cause = (
        f"most shape mismatches listed ({len(by_hidden)} of {len(shapes)}) are a size 160 in "
        "the new checkpoint where 256 is held"
    )
    assert len(by_hidden) > len(shapes) / 2
    assert cause in err and err.index(cause) < err.index("rank 0:"), err
    total = int(listed[0].split("; ")[1].split()[0])
    # Three items shown: the cause (not itself a mismatch) and listed mismatches.
    shown = [ln.strip() for ln in listed[1:] if ln.strip() in err]
    assert len(shown) == 2 and len(err.split("; ")) == 5, err
    assert err.endswith(f"... and {total - len(shown)} more (--debug lists them)"), err
    assert len(err) < 700


def test_engine_takes_release_names_and_refuses_unknown_ones(
    mxload: Callable[..., tuple[int, str, str]],
) -> None:
    rc, out, _ = mxload(*PLAN_30B, "--engine", "vllm-ascend-0.30.0rc2", "--json")
    assert rc == 0 and json.loads(out)["engine"] == "vllm-ascend-main"
    rc, out, _ = mxload(*PLAN_30B, "--engine", "vllm-ascend-0.23.0.post1", "--json")
    assert rc == 0 and json.loads(out)["engine"] == "vllm-ascend-0.23"
    rc, _, err = mxload(*PLAN_30B, "--engine", "vllm-ascend-0.26.0rc1")
    assert rc == 2 and "vllm-ascend-0.23.0.post1" in err and "vllm-ascend-0.30.0rc2" in err


def test_an_interrupted_reload_says_where_to_look(monkeypatch, capsys) -> None:
    """Ctrl-C during a reload: exit 130, and the line says how to learn what the devices
    hold (the reload may have finished, or stopped part-way)."""
    from mxload.orchestrator.cli import commands

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(commands.COMMANDS, "reload", interrupted)
    assert main(["reload", "/nowhere"]) == 130
    assert capsys.readouterr().err == (
        "mxload: interrupted (`mxload status` says what the devices hold)\n"
    )


def test_plan_counts_the_tensors_vllm_ascend_derives_for_deepseek_mla(mxload) -> None:
    """DeepSeek-V3 under a vllm-ascend profile: every rank holds W_UK_T and W_UV per MLA
    layer (docs/contract.md §2.4), counted in persistent bytes and named. By hand from the
    packaged config: 61 layers, 128 heads over tp 8 = 16 local, qk_nope_head_dim 128 and
    v_head_dim 128 rows per head, kv_lora_rank 512 columns, bfloat16: 61 x 16 x 256 x 512 x
    2 bytes = 244 MiB per rank."""
    layout = ("--model", "deepseek-v3", "--tp", "8", "--dp", "4", "--enable-expert-parallel")
    code, out, _ = mxload("plan", *layout, "--engine", "vllm-ascend-main", "--json")
    assert code == 0
    ascend = json.loads(out)
    code, out, _ = mxload("plan", *layout, "--json")
    mine = json.loads(out)
    assert ascend["derived"] == ["W_UK_T", "W_UV"] and "derived" not in mine
    want = 61 * 16 * 256 * 512 * 2
    for a, m in zip(ascend["ranks"], mine["ranks"], strict=True):
        assert (a["derived_buffers"], a["derived_bytes"]) == (2 * 61, want)
        # plain vLLM (the mxload profile) also holds the shared experts whole and kv_b_proj
        # MXFP8 here: 2,180,956,160 B more per rank, counted by hand in test_moe_mode.py
        assert m["persistent_bytes"] - a["persistent_bytes"] == 2_180_956_160 - want
        assert "derived_bytes" not in m
    code, out, _ = mxload("plan", *layout, "--engine", "vllm-ascend-main")
    assert (
        "derived in place after their source (W_UK_T, W_UV; --engine vllm-ascend-main): "
        "up to 122 tensors, 244.00 MiB per rank" in out
    )


def test_sigterm_during_convert_leaves_no_partial_output(
    ckpt_factory, tmp_path, monkeypatch, capsys
) -> None:
    """SIGTERM (what a scheduler or `kill` sends) during convert: handled as Ctrl-C is,
    the temporary output folder is removed, exit 143. The signal comes at the first
    converted tensor, through the progress display's hook."""
    import signal

    from mxload.orchestrator.cli import commands

    class TermAtFirstTensor:
        def __call__(self, *_: int) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

        def close(self) -> None:
            pass

    monkeypatch.setattr(commands.show, "convert_progress", lambda _json: TermAtFirstTensor())
    got: list[int] = []
    # Were SIGTERM left to its default here, it would end pytest itself.
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        src = shutil.copytree(ckpt_factory("qwen3-dense-tiny", 1), tmp_path / "src")
        rc = main(["convert", str(src), str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (rc, got) == (143, []), capsys.readouterr().err
    assert capsys.readouterr().err == "mxload: terminated\n"
    assert sorted(os.listdir(tmp_path)) == ["src"], "no DST, no temporary folder"


@pytest.mark.parametrize("end", ["said", "killed"])
def test_a_command_ended_from_outside_is_still_told(tmp_path: Path, end: str) -> None:
    """The console script's watcher (``outcome.watch``): a command that said its outcome
    leaves stderr to itself; one ended at once from outside (SIGKILL here; Ray's core
    worker ending a driver alike) gets one line naming it and its pid."""
    script = (
        "import os, signal, sys\n"
        "from mxload.orchestrator.cli.outcome import watch\n"
        "out = watch(['reload', 'ckpt'])\n"
        "print(os.getpid(), flush=True)\n"
        f"out.said() if {end == 'said'!r} else os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, MXLOAD_HOME=str(tmp_path / "home"))
    got = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    pid = got.stdout.strip()
    if end == "said":
        assert (got.returncode, got.stderr) == (0, ""), got
    else:
        assert got.returncode == -signal.SIGKILL
        assert got.stderr.splitlines() == [
            f"mxload: error: reload (pid {pid}) ended without saying its outcome (killed, or "
            "ended by Ray); `mxload status` says what the devices hold"
        ], got.stderr
