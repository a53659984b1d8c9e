"""The ``mxload`` command line, run as a user runs it (docs/contract.md §5).

* Refusals exit 2 with stderr *beginning* ``mxload: error:``, naming the file, key,
  tensor or flag, and with no traceback (library noise included);
* ``plan --json`` has the keys of docs/contract.md §5, and a plan that does not fit exits 3;
* ``inspect`` and ``convert`` agree with what the official safetensors reader sees;
* a detached session lives across processes: ``load --detach``, ``status``, ``reload``
  (addresses unchanged, version 2, bytes equal to the independent reference), a refused
  reload that touches nothing, ``release``; and ``mxload demo`` exits 0.

What depends on the process (exit statuses, tracebacks, the console script, a terminal,
Ray started and ended, a session across processes) runs as a subprocess; what only reads
the command's output (``plan``, ``inspect``, ``convert``, which start no Ray) runs
``main(argv)`` in this process (the ``cli`` fixture), which costs no interpreter start-up.

Every subprocess runs with its working directory set to a folder of this module's own,
and Ray's processes inherit it: that is how the module finds, at the end, any process it
started that is still alive, and ends exactly those (by pid), whatever their names.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
from mxload.orchestrator.runtime.models import model_config_path
from safetensors.torch import load_file, save_file

from tests.procs import end_processes, processes_in
from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank
from tests.unit.test_cli import SHARD2, build_inputs

pytestmark = [pytest.mark.slow]

CONFIGS = model_config_path("deepseek-v3").parent  # the packaged configs
MXLOAD = [sys.executable, "-m", "mxload.orchestrator.cli"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory):
    """The module's folder: cwd of every subprocess (so their processes can be found),
    MXLOAD_HOME, checkpoints. At the end, ends every process still running there."""
    root = tmp_path_factory.mktemp("cli")
    (root / "cwd").mkdir()
    (root / "home").mkdir()
    yield root
    leftovers = processes_in(root / "cwd")
    end_processes(leftovers)
    if leftovers:
        print(f"test_cli: ended {len(leftovers)} stray process(es): {leftovers}")


def assert_nothing_left(work: Path, grace_s: float = 8) -> None:
    """No process this module started is still alive (after a grace period for
    processes that are shutting down); any that is gets ended, then reported."""
    deadline = time.monotonic() + grace_s
    while processes_in(work / "cwd") and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_in(work / "cwd")
    described = []
    for pid in left:
        try:
            described.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    end_processes(left)
    assert described == [], described


def mx(
    work: Path, *args: str, home: str = "home", timeout: float = 120
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["MXLOAD_HOME"] = str(work / home)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return subprocess.run(
        [*MXLOAD, *args],
        cwd=work / "cwd",
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli(
    work: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """``cli(*argv)``: ``mxload`` run by ``main(argv)`` in this process, answered like
    :func:`mx` (exit status, stdout, stderr); $MXLOAD_HOME is ``work/HOME`` (``home=``,
    an empty one by default)."""
    from mxload.orchestrator.cli.commands import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    level = logging.getLogger("mxload").level

    def run(*argv: str, home: str = "home-empty") -> subprocess.CompletedProcess:
        monkeypatch.setenv("MXLOAD_HOME", str(work / home))
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["mxload", *argv], code, out, err)

    yield run
    logging.getLogger("mxload").setLevel(level)


def mx_tty(
    work: Path, *args: str, home: str = "home", timeout: float = 300
) -> tuple[int, str, str]:
    """Run ``mxload`` with stderr on a pseudo-terminal (as a user at a terminal sees it);
    stdout goes to a file. Returns (exit status, stdout, what the terminal showed)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    env = dict(os.environ, MXLOAD_HOME=str(work / home), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns
    out_path = work / f"tty-stdout-{time.monotonic_ns()}"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [*MXLOAD, *args], cwd=work / "cwd", env=env, stdin=subprocess.DEVNULL,
            stdout=out, stderr=slave,
        )  # fmt: skip
    os.close(slave)
    shown = bytearray()
    deadline = time.monotonic() + timeout
    # Read until the command exits (then a short drain: its children may hold the pty).
    exited_at = None
    while time.monotonic() < deadline:
        if exited_at is None and proc.poll() is not None:
            exited_at = time.monotonic()
        if exited_at is not None and time.monotonic() - exited_at > 1.0:
            break
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the pty
                data = b""
            if not data and exited_at is not None:
                break
            shown += data
    os.close(master)
    if proc.poll() is None:
        proc.kill()
        pytest.fail(f"mxload {' '.join(args)} did not finish in {timeout} s")
    return proc.returncode, out_path.read_text(), shown.decode(errors="replace")


def assert_refused(proc: subprocess.CompletedProcess, *names: str, code: int = 2) -> None:
    shown = f"rc={proc.returncode}\nstderr: {proc.stderr[-3000:]}\nstdout: {proc.stdout[-1000:]}"
    assert proc.returncode == code, shown
    assert proc.stderr.startswith("mxload: error:"), shown
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, shown
    for name in names:
        assert name in proc.stderr, f"{name!r} not named\n{shown}"


# --- inputs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(work: Path, ckpt_factory) -> dict[str, str]:
    """The module's checkpoints (those of the in-process refusals, tests/unit/test_cli.py)
    and v2 with one tensor of another shape (written with the official library)."""
    out = build_inputs(work, ckpt_factory)
    bad = work / "v2-bad-shape"
    shutil.copytree(out["v2"], bad)
    with open(bad / "model.safetensors.index.json") as f:
        file = json.load(f)["weight_map"][BAD_TENSOR]
    tensors = load_file(bad / file)
    tensors[BAD_TENSOR] = torch.ones(512, dtype=torch.bfloat16)  # hidden is 256
    save_file(tensors, bad / file, metadata={"format": "pt"})
    out["bad-shape"] = str(bad)
    return out


BAD_TENSOR = "model.layers.1.input_layernorm.weight"


# --- refusals as a process: exit status, one line, no traceback, nothing started ----------------
#
# Every refusal is checked in-process in tests/unit/test_cli.py (with ray.init and
# subprocess.Popen made to fail); these few prove the same of a real process.

REFUSALS = {
    "unknown-flag": (lambda w, c: ["plan", c["v1"], "--frobnicate"], ["--frobnicate"]),
    "missing-dir": (lambda w, c: ["inspect", str(w / "nowhere")], [str(Path("nowhere"))]),
    "static-activations-load": (
        lambda w, c: ["load", c["ckpt-static"], "--device", "cpu"],
        ["activation_scheme", "ckpt-static/config.json"],
    ),
    "dump-into-a-used-folder": (
        lambda w, c: ["load", c["v1"], "--device", "cpu", "--dump", c["used"]],
        ["--dump", "used", "not empty", "--overwrite"],
    ),
    "address-without-port": (
        lambda w, c: ["status", "--address", "localhost"],
        ["--address localhost", "HOST:PORT"],
    ),
    "outside-link": (
        lambda w, c: ["inspect", c["outside-link"]],
        [f"outside-link/{SHARD2}", "outside the checkpoint folder", "--allow-outside-links"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(work: Path, ckpts: dict[str, str], case: str) -> None:
    build, names = REFUSALS[case]
    # A home of its own: no head is ever recorded there, so no case can reach a session.
    proc = mx(work, *build(work, ckpts), home="home-empty")
    assert_refused(proc, *names)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line
    assert "\x1b[" not in proc.stderr
    assert processes_in(work / "cwd") == [], "a refusal must start nothing"
    assert "SECRET" not in proc.stderr + proc.stdout
    assert sorted(os.listdir(ckpts["used"])) == ["keep.txt"]
    assert not [p for p in work.rglob("*mxload-tmp*")], "a refusal leaves no temporary files"


def test_console_script_version(work: Path) -> None:
    from mxload import __version__

    exe = Path(sys.executable).parent / "mxload"
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mxload {__version__}", proc


@pytest.mark.ray
def test_a_worker_error_names_its_rank_without_a_traceback(
    work: Path, ckpts: dict[str, str]
) -> None:
    """A non-finite scale is found by the worker that converts it: the user reads
    ``mxload: error: rank N: ...`` (no colour codes, no traceback) and the path of a log
    that holds the worker's traceback."""
    src = work / "nan-scale-load"
    shutil.copytree(ckpts["v1"], src)
    name = "model.layers.2.self_attn.o_proj.weight_scale_inv"
    with open(src / "model.safetensors.index.json") as f:
        file = src / json.load(f)["weight_map"][name]
    tensors = load_file(file)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    proc = mx(work, "load", str(src), "--tp", "2", "--device", "cpu", home="home-empty", timeout=300)  # fmt: skip
    assert_refused(proc, name, "--allow-nonfinite")
    lines = proc.stderr.strip().splitlines()
    assert re.match(r"mxload: error: rank [01]: ", lines[0]), proc.stderr
    assert "\x1b[" not in proc.stderr
    assert len(lines) == 2 and lines[1].startswith("mxload: the traceback is in "), proc.stderr
    log = Path(lines[1].split(" is in ")[1].split(" (or rerun")[0])
    assert log.is_relative_to(work / "home-empty" / "logs")
    text = log.read_text()
    assert "Traceback" in text and "from the worker" in text and name in text
    assert_nothing_left(work)


def test_debug_shows_the_traceback(work: Path, ckpts: dict[str, str]) -> None:
    proc = mx(work, "plan", "--config", ckpts["config-static"], "--debug", home="home-empty")
    assert proc.returncode == 2  # the exit status does not change with --debug
    assert "Traceback" in proc.stderr and "activation_scheme" in proc.stderr.splitlines()[-1]


# --- plan ------------------------------------------------------------------------------------

PLAN_KEYS = {"format", "model", "parallel", "ranks", "min_staging_bytes", "device_memory_bytes", "fits"}  # fmt: skip
RANK_KEYS = {"rank", "tp_rank", "dp_rank", "pp_rank", "ep_rank", "layers", "experts", "persistent_bytes", "staging_bytes", "peak_bytes", "bytes_needed", "bytes_to_read"}  # fmt: skip
BYTE_KEYS = ("persistent_bytes", "staging_bytes", "peak_bytes", "bytes_needed", "bytes_to_read")


def test_plan_json_from_a_real_config(cli: Callable[..., subprocess.CompletedProcess]) -> None:
    config_file = CONFIGS / "qwen3-30b-a3b-fp8.json"
    cfg = json.loads(config_file.read_text())
    args = ["plan", "--config", str(config_file), "--tp", "4", "--dp", "2", "--enable-expert-parallel", "--json"]  # fmt: skip
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert PLAN_KEYS <= set(doc), sorted(PLAN_KEYS - set(doc))
    assert doc["format"] == "mxload-plan/1"
    assert doc["parallel"] == {
        "tp": 4,
        "dp": 2,
        "pp": 1,
        "enable_expert_parallel": True,
        "expert_placement": "linear",
        "world": 8,
    }
    assert set(doc["min_staging_bytes"]) == {"load", "reload"}
    assert all(type(v) is int for v in doc["min_staging_bytes"].values())
    assert 0 < doc["min_staging_bytes"]["load"] <= doc["min_staging_bytes"]["reload"]
    assert doc["device_memory_bytes"] is None and doc["fits"] is None  # not checked
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == list(range(8))
    n_exp, layers = cfg["num_experts"], cfg["num_hidden_layers"]
    per = n_exp // 8
    for r in ranks:
        assert RANK_KEYS <= set(r), sorted(RANK_KEYS - set(r))
        for key in BYTE_KEYS:
            assert type(r[key]) is int and r[key] > 0, (key, r[key])
        # vLLM's rank order and docs/contract.md §3's linear expert placement, computed here.
        assert (r["dp_rank"], r["pp_rank"], r["tp_rank"]) == (r["rank"] // 4, 0, r["rank"] % 4)
        assert r["ep_rank"] == r["dp_rank"] * 4 + r["tp_rank"]
        assert r["experts"] == list(range(r["ep_rank"] * per, (r["ep_rank"] + 1) * per))
        assert r["layers"] == list(range(layers))
        assert r["peak_bytes"] == r["persistent_bytes"] + r["staging_bytes"]
        assert r["bytes_to_read"] == r["bytes_needed"]  # config only: predicted as needed
    # Human table on a pipe: no JSON, the same exit status; the header says the layout
    # and the defaults that filled in what was not given.
    human = cli(*args[:-1])
    assert human.returncode == 0 and "minimum staging budget" in human.stdout
    head = human.stdout.splitlines()[:3]
    assert head[1].startswith("layout: tp=4 dp=2 pp=1 ep=on expert_placement=linear world=8")
    assert head[2].startswith("defaults used: --pp 1, --expert-placement linear"), head
    assert "--tp" not in head[2] and "--dp" not in head[2]


@pytest.mark.parametrize(
    "name",
    [
        "deepseek-v3",
        "qwen3-30b-a3b-fp8",
        "qwen3-32b-fp8",
        "qwen3-235b-a22b-fp8",
        "Qwen/Qwen3-32B-FP8",
    ],
)
def test_plan_a_packaged_model_by_name(
    cli: Callable[..., subprocess.CompletedProcess], name: str
) -> None:
    """``--model NAME`` plans the packaged config: the same plan as ``--config`` on that
    file, which is a copy of the model's published config.json."""
    tp = ["--tp", "8", "--dp", "2", "--enable-expert-parallel", "--json"]
    by_name = cli("plan", "--model", name, *tp)
    assert by_name.returncode == 0, by_name.stderr
    stem = name.lower().split("/")[-1]
    by_file = cli("plan", "--config", str(CONFIGS / f"{stem}.json"), *tp)
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_name.stdout) == json.loads(by_file.stdout)


def test_qwen3_235b_config_is_the_published_geometry() -> None:
    cfg = json.loads((CONFIGS / "qwen3-235b-a22b-fp8.json").read_text())
    published = {
        "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 1536,
        "num_experts": 128, "num_experts_per_tok": 8, "intermediate_size": 12288,
        "vocab_size": 151936, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False,
    }  # fmt: skip
    assert {k: cfg[k] for k in published} == published
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["quantization_config"]["activation_scheme"] == "dynamic"


def test_plan_table_notes_left_out_ranks_at_the_gap(
    cli: Callable[..., subprocess.CompletedProcess],
) -> None:
    config_file = CONFIGS / "deepseek-v3.json"
    args = ["plan", "--config", str(config_file), "--tp", "8", "--dp", "32", "--enable-expert-parallel"]  # fmt: skip
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    rows = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]
    note = rows.index("...")
    # 32 rows, the note, then the last 8 ranks: 256 - 40 = 216 left out, between 31 and 248.
    assert rows[note - 1] == "31" and rows[note + 1] == "248", rows[note - 2 : note + 3]
    assert "216 more ranks" in proc.stdout


def test_plan_that_does_not_fit_exits_3(work: Path) -> None:
    config_file = CONFIGS / "qwen3-30b-a3b-fp8.json"
    args = ["plan", "--config", str(config_file), "--tp", "4", "--dp", "2", "--enable-expert-parallel", "--device-memory", "1GiB", "--json"]  # fmt: skip
    proc = mx(work, *args)
    assert proc.returncode == 3, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["fits"] is False
    assert doc["device_memory_bytes"] == 2**30
    assert all(r["peak_bytes"] > 2**30 for r in doc["ranks"])
    assert "Traceback" not in proc.stderr


# --- inspect and convert ------------------------------------------------------------------------


def official(path: str) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values()))
        if os.path.exists(index)
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def test_inspect(cli: Callable[..., subprocess.CompletedProcess], ckpts: dict[str, str]) -> None:
    proc = cli("inspect", ckpts["v1"], "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    tensors = official(ckpts["v1"])
    assert info["architecture"] == "Qwen3MoeForCausalLM"
    assert info["quantization"] == "block_fp8"
    assert info["weight_block_size"] == [128, 128]
    assert info["num_tensors"] == len(tensors)
    assert info["tensor_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    n_fp8 = sum(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    assert info["quantized_linears"] == n_fp8
    assert (info["layers"], info["experts"], info["moe_layers"]) == (4, 8, 3)
    assert sum(info["tensor_bytes_by_kind"].values()) == info["tensor_bytes"]
    fp8_bytes = sum(t.numel() for t in tensors.values() if t.dtype == torch.float8_e4m3fn)
    assert info["tensor_bytes_by_kind"]["fp8 weight"] == fp8_bytes
    assert "..." not in proc.stdout
    human = cli("inspect", ckpts["v1"])
    assert human.returncode == 0, human.stderr
    text = human.stdout
    assert "Qwen3MoeForCausalLM: 4 layers, 8 experts in 3 MoE layers" in text
    assert "block_fp8 (blocks 128x128, scales F32)" in text and "bytes by kind" in text
    # Readable: no JSON or Python reprs, no truncation; every file listed.
    assert not any(c in text for c in "{}[]'") and "..." not in text, text
    assert all(f["file"] in text for f in info["files"])


def test_make_checkpoint_says_one_line_or_json(
    work: Path, cli: Callable[..., subprocess.CompletedProcess]
) -> None:
    human = cli("make-checkpoint", str(work / "made"), "--preset", "qwen3-dense-tiny")
    assert human.returncode == 0, human.stderr
    line = human.stdout.strip()
    assert "\n" not in line and "{" not in line, line
    assert line.startswith("wrote block-FP8 qwen3-dense-tiny (seed 0) to ")
    doc = cli("make-checkpoint", str(work / "made-json"), "--preset", "qwen3-dense-tiny", "--json")  # fmt: skip
    assert doc.returncode == 0, doc.stderr
    summary = json.loads(doc.stdout)
    assert f"{summary['tensors']} tensors in {summary['shards']} shard(s)" in line


def test_convert(
    work: Path, cli: Callable[..., subprocess.CompletedProcess], ckpts: dict[str, str]
) -> None:
    dst = work / "converted"
    proc = cli("convert", ckpts["v1"], str(dst), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    src_t, out_t = official(ckpts["v1"]), official(str(dst))
    n_scale_inv = sum(n.endswith(".weight_scale_inv") for n in src_t)
    assert summary["tensors"] == len(out_t) == len(src_t)  # each scale_inv -> one scale
    assert not any(n.endswith(".weight_scale_inv") for n in out_t)
    assert sum(n.endswith(".weight_scale") for n in out_t) == n_scale_inv
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "MXFP8"
    again = cli("inspect", str(dst), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["quantization"] == "mxfp8"


def test_convert_shows_progress_on_a_terminal_only(work: Path, ckpts: dict[str, str]) -> None:
    rc, _, shown = mx_tty(work, "convert", ckpts["v1"], str(work / "converted-tty"))
    assert rc == 0, shown[-2000:]
    assert "convert:" in shown and "100%" in shown, shown[-2000:]
    assert re.search(r"tensors (\d+)/\1\b", shown), shown[-2000:]  # every job done
    piped = mx(work, "convert", ckpts["v1"], str(work / "converted-pipe"))
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stderr and "convert:" not in piped.stderr, piped.stderr


@pytest.mark.ray
def test_load_on_a_terminal_for_an_engine(work: Path, ckpts: dict[str, str]) -> None:
    """One load at a terminal, read three ways. The terminal shows progress; stdout the
    layout and the defaults that filled in what was not given. ``--engine
    vllm-ascend-main``: vllm-ascend's names (routed_experts) and strides in the manifest
    (``--dump``'s and ``--report``'s), logical values in the dump (equal to the
    independent reference, whose MoE views read the same values as mxload's layout)."""
    dump, report = work / "dump-engine", work / "report-engine.json"
    layout = ["--dp", "2", "--enable-expert-parallel", "--device", "cpu"]
    rc, out, shown = mx_tty(
        work, "load", ckpts["v1"], *layout, "--engine", "vllm-ascend-main",
        "--dump", str(dump), "--report", str(report), home="home-empty",
    )  # fmt: skip
    assert rc == 0, shown[-3000:]
    assert "load:" in shown and "ranks 2/2 done" in shown, shown[-3000:]
    assert " at " in shown and "/s" in shown  # the read rate
    assert "Traceback" not in shown
    lines = out.splitlines()
    assert lines[0].startswith("layout: tp=1 dp=2 pp=1 ep=on"), out[:500]
    assert lines[1].startswith("defaults used: --tp 1, --pp 1"), out[:500]
    assert "--device" not in lines[1] and "--dp" not in lines[1], out[:500]
    assert_nothing_left(work)

    manifest = json.loads((dump / "manifest.json").read_text())
    assert json.loads(report.read_text()) == manifest
    assert manifest["engine"] == "vllm-ascend-main"
    assert len(manifest["ranks"]) == 2
    ref = RefCheckpoint(ckpts["v1"])
    for r, rank in enumerate(manifest["ranks"]):
        t = rank["tensors"]
        w13 = t["model.layers.0.mlp.experts.routed_experts.w13_weight"]
        _, h, n2 = w13["shape"]
        assert (w13["stride"], w13["storage_offset"]) == ([h * n2, 1, h], 0)
        s13 = t["model.layers.0.mlp.experts.routed_experts.w13_weight_scale"]
        _, g2, n, _ = s13["shape"]
        assert s13["stride"] == [n * g2 * 2, 2, g2 * 2, 1]
        qkv = t["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv["stride"] == [qkv["shape"][1], 1]  # linears stay contiguous
        got = load_file(dump / f"rank-{r:05d}.safetensors")
        renamed = {k.replace(".experts.routed_experts.", ".experts."): v for k, v in got.items()}
        problems = compare_rank(expected_rank(ref, Layout(1, 2, 1, True), r), renamed)
        assert problems == [], f"rank {r}: {problems[:8]}"


def test_convert_numerics_flag(
    work: Path, cli: Callable[..., subprocess.CompletedProcess], ckpts: dict[str, str]
) -> None:
    """``--numerics reference`` runs the naive path through the same pipeline and writes
    the same files as the default (fast) path; an unknown value is a usage error."""
    outs = {}
    for numerics in ("reference", "fast"):
        dst = work / f"converted-{numerics}"
        proc = cli("convert", ckpts["v1"], str(dst), "--json", "--numerics", numerics)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["backend"] == f"cpu-{numerics}"
        outs[numerics] = {p.name: p.read_bytes() for p in sorted(dst.glob("*.safetensors"))}
    assert outs["reference"] == outs["fast"] and outs["fast"]
    assert_refused(cli("convert", ckpts["v1"], str(work / "x"), "--numerics", "gpu"), "--numerics")


def test_convert_nonfinite_scale_needs_the_flag(
    work: Path, cli: Callable[..., subprocess.CompletedProcess], ckpts: dict[str, str]
) -> None:
    src = work / "nan-scale"
    shutil.copytree(ckpts["v1"], src)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    with open(src / "model.safetensors.index.json") as f:
        file = src / json.load(f)["weight_map"][name]
    tensors = load_file(file)
    tensors[name][1, 0] = float("inf")
    save_file(tensors, file, metadata={"format": "pt"})
    assert_refused(cli("convert", str(src), str(work / "nan-out")), name, "(1, 0)", "--allow-nonfinite")  # fmt: skip
    ok = cli("convert", str(src), str(work / "nan-out"), "--allow-nonfinite")
    assert ok.returncode == 0, ok.stderr


# --- a detached session across processes ----------------------------------------------------------


def tensors_of(manifest: dict, key: str) -> dict[tuple[int, str], object]:
    return {(r["rank"], n): t[key] for r in manifest["ranks"] for n, t in r["tensors"].items()}


def test_silent_server_is_a_bounded_failure_naming_the_url(work: Path) -> None:
    """An HTTP server that accepts and never answers: every attempt times out (0.5 s
    connect and 0.2 s read timeouts here; defaults 10 s and 30 s), the 5 attempts run
    out, and the command fails (exit 1: storage gone after retries) naming the URL,
    instead of waiting 5 x 300 s in silence. Each timed-out attempt is a warning on
    stderr (what a user waiting at a terminal needs to see); then the error naming the
    URL, and last the path of the log that holds the traceback (a failed run,
    docs/contract.md §5)."""
    from tests.servers import SilentServer

    with SilentServer() as server:
        url = server.url + "/ck"
        t0 = time.monotonic()
        proc = mx(work, "inspect", url, "--connect-timeout", "0.5", "--read-timeout", "0.2")
        seconds = time.monotonic() - t0
    shown = f"rc={proc.returncode}\nstderr: {proc.stderr[-3000:]}"
    assert proc.returncode == 1, shown
    assert "Traceback" not in proc.stderr + proc.stdout, shown
    *retries, error, log = proc.stderr.strip().splitlines()
    assert error.startswith("mxload: error:"), shown
    assert f"{url}/config.json" in error and "5 attempts" in error, shown
    assert log.startswith("mxload: the traceback is in "), shown
    retry = re.compile(
        r"mxload: WARNING mxload\.workers\.storage\.retry: (\S+): no answer in time"
        r" \(attempt (\d) of 5\); retrying$"
    )
    matched = [retry.match(line) for line in retries]
    assert all(matched), shown  # nothing before the error but the retries
    assert all(m[1].startswith(url) for m in matched if m), shown
    assert server.connections >= 1
    print(f"silent server: inspect failed after {seconds:.1f} s")


def test_full_disk_names_the_path_and_leaves_nothing(work: Path, ckpts: dict[str, str]) -> None:
    """convert onto a file system that fills up (a 256 KiB tmpfs, mounted in a private
    mount namespace): exit 2 naming DST and the full disk, no traceback, and nothing
    left on the full file system (the temporary folder removed)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available: no private tmpfs to fill")
    mnt = work / "small-disk"
    mnt.mkdir(exist_ok=True)
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {mnt} || exit 99; "
        f"{sys.executable} -m mxload.orchestrator.cli convert {ckpts['v1']} {mnt}/out; "
        f'rc=$?; echo "left: $(ls -A {mnt})" >&2; exit $rc'
    )
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -rm is not permitted here: no private tmpfs to fill")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=work / "cwd",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 99, proc.stderr
    err = proc.stderr.split("left:")[0]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert err.startswith("mxload: error:") and "Traceback" not in err, err
    assert f"{mnt}/out" in err and "no space left" in err, err
    assert proc.stderr.strip().endswith("left:"), proc.stderr


@pytest.mark.ray
def test_detached_session_across_processes(
    work: Path, ckpts: dict[str, str], cli: Callable[..., subprocess.CompletedProcess]
) -> None:
    """``load --detach`` in a process of its own; every later command (status, reload,
    release) from this one, as another process's would be: a driver joining the head."""
    # Two ranks, experts split between them: nothing here depends on a larger world.
    layout = ["--dp", "2", "--enable-expert-parallel"]

    def here(*argv: str) -> subprocess.CompletedProcess:
        return cli(*argv, home="home")

    proc = mx(work, "load", ckpts["v1"], *layout, "--device", "cpu", "--detach", "--json", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "load:" not in proc.stderr  # no progress in a pipe
    head = json.loads((work / "home" / "head.json").read_text())
    assert head["address"].startswith("127.0.0.1:")
    loaded = json.loads(proc.stdout)
    assert [r["version"] for r in loaded["ranks"]] == [1, 1]
    first_ptrs = tensors_of(loaded, "data_ptr")
    try:
        st = here("status", "--json")
        assert st.returncode == 0, st.stderr[-3000:]
        s1 = json.loads(st.stdout)
        assert [r["version"] for r in s1["ranks"]] == [1, 1]
        assert all(r["consistent"] for r in s1["ranks"]) and s1["consistent"] is True
        assert tensors_of(s1, "data_ptr") == first_ptrs
        assert tensors_of(s1, "checksum") == tensors_of(loaded, "checksum")

        # The session name and what comes next, with the actual $MXLOAD_HOME.
        assert "session 'default' is loaded and detached" in proc.stderr, proc.stderr[-2000:]
        for hint in ("mxload status", "mxload reload NEW_SRC", "mxload release", str(work / "home")):  # fmt: skip
            assert hint in proc.stderr, (hint, proc.stderr[-2000:])

        # A wrong session name: the hint names the sessions and is a command that works.
        wrong = here("status", "--session", "nosuch")
        assert_refused(wrong, "nosuch", "mxload status --session default")
        hinted = wrong.stderr.split("`")[1].split()
        human = here(*hinted[1:])
        assert human.returncode == 0 and "consistent: True" in human.stdout, human
        assert_refused(here("reload", ckpts["v2"], "--session", "nosuch"), "nosuch")

        rl = here("reload", ckpts["v2"], "--json")
        assert rl.returncode == 0, rl.stderr[-3000:]
        m2 = json.loads(rl.stdout)
        assert m2["addresses_moved"] == []
        assert [r["version"] for r in m2["ranks"]] == [2, 2]
        assert tensors_of(m2, "data_ptr") == first_ptrs

        # The dump folder holds an earlier run of 8 ranks: refused without --overwrite
        # (untouched); with it, replaced whole: no stale rank file beside the new manifest.
        dump = work / "dump-v2"
        dump.mkdir()
        stale = {f"rank-{r:05d}.safetensors": b"old" for r in range(8)} | {"manifest.json": b"{}"}
        for name, data in stale.items():
            (dump / name).write_bytes(data)
        assert_refused(here("status", "--dump", str(dump)), "--dump", "--overwrite")
        assert {p.name: p.read_bytes() for p in dump.iterdir()} == stale
        # What the devices hold is version 2, byte for byte (independent reference).
        st2 = here("status", "--dump", str(dump), "--overwrite", "--json")
        assert st2.returncode == 0, st2.stderr[-3000:]
        assert sorted(p.name for p in dump.iterdir()) == [
            "manifest.json",
            *(f"rank-{r:05d}.safetensors" for r in range(2)),
        ]
        assert not list(work.glob(".dump-v2*")), "no temporary or old folder left beside it"
        s2 = json.loads(st2.stdout)
        ref = RefCheckpoint(ckpts["v2"])
        for r in range(2):
            got = load_file(dump / f"rank-{r:05d}.safetensors")
            problems = compare_rank(expected_rank(ref, Layout(1, 2, 1, True), r), got)
            assert problems == [], f"rank {r}: {problems[:8]}"
        sums2 = tensors_of(s2, "checksum")

        # A reload whose checkpoint has one tensor of another shape: refused, untouched.
        bad = here("reload", ckpts["bad-shape"])
        assert_refused(bad, BAD_TENSOR)
        after = here("status", "--json")
        assert after.returncode == 0, after.stderr[-3000:]
        s3 = json.loads(after.stdout)
        assert [r["version"] for r in s3["ranks"]] == [2, 2] and s3["consistent"]
        assert tensors_of(s3, "checksum") == sums2
        assert tensors_of(s3, "data_ptr") == first_ptrs
    finally:
        rel = here("release", "--json")
    assert rel.returncode == 0, rel.stderr[-3000:]
    info = json.loads(rel.stdout)
    assert info["head_stopped"] is True and info["workers_ended"] == 2
    assert not (work / "home" / "head.json").exists()
    assert_refused(here("status"), "--address")
    assert_nothing_left(work)  # nothing the session started is still running


@pytest.mark.ray
def test_demo(work: Path) -> None:
    """The demo as a user runs it, at a terminal: its story on stdout, progress bars for
    the load and the reload on the terminal."""
    rc, out, shown = mx_tty(work, "demo", home="home-demo", timeout=300)
    assert rc == 0, (out[-3000:], shown[-3000:])
    assert "0 addresses moved" in out
    assert "all ranks match" in out
    assert "load:" in shown and "reload:" in shown and "ranks 4/4 done" in shown, shown[-3000:]
    assert "Traceback" not in shown
    # The demo's embedded Ray ends with it.
    assert_nothing_left(work)
