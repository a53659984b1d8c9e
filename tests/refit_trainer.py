"""A trainer rank for the refit tests: a real process holding the shards its manifest
places on it (FSDP-style dim-0 shards, Megatron-style dim-1 shards of row-parallel layers,
whole replicas).

Run as ``python -m tests.refit_trainer RANK WORLD``; it reads one JSON command per line
on stdin and answers one JSON line on stdout:

* ``{"op": "join", "name", "src", "layout", "engine", "trainer"}``: make an
  ``MxloadSender`` for refit group ``name`` (blocks until the engine's ranks join); the
  sends of ``name`` hold what the trainer form's ``manifest`` places on this rank;
* ``{"op": "send", "name", "step", "weights", "delta_of"?, "changed"?, "mix"?,
  "die_after"?}``: send this rank's shards of the BF16 checkpoint ``weights`` (tensors
  named in ``mix`` taken from the checkpoint ``mix["from"]`` instead) as ``step``;
  ``die_after``: the process kills itself (SIGKILL) after that many messages of the
  send (a trainer dying mid-update); ``stop_after``: it stops itself (SIGSTOP) there;
* ``{"op": "exit"}``.

Its shards are cut from the whole tensors as the manifest's placements say, each slice
along its ``dim`` (an FSDP manifest: dim-0 chunks in ``torch.chunk``'s sizes, as FSDP2
cuts them; a Megatron one: dim 1 for row-parallel layers), each its own memory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from mxload.orchestrator.plan.trainer import TrainerManifest, fsdp_manifest, manifest_from_json
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.refit import MxloadSender
from safetensors.torch import load_file


def free_port() -> int:
    """A loopback port free now (the refit group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def manifest_shards(
    tensors: dict[str, torch.Tensor], manifest: TrainerManifest, rank: int
) -> dict[str, torch.Tensor]:
    """What ``manifest`` places on ``rank`` of every tensor it names: the slice along the
    placement's dim (or the whole tensor), cloned: its own memory, as a trainer holds it."""
    out = {}
    for t in manifest.tensors:
        for s in t.placement:
            if s.rank == rank:
                whole = tensors[t.name]
                cut = whole if s.dim is None else whole.narrow(s.dim, s.start, s.stop - s.start)
                out[t.name] = cut.clone()
    return out


def shards(tensors: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's dim-0 chunk of every tensor (FSDP2's placement), cloned: its own memory."""
    m = fsdp_manifest({n: tuple(t.shape) for n, t in tensors.items()}, world)
    return manifest_shards(tensors, m, rank)


def die_after(sender: MxloadSender, messages: int, sig: int = signal.SIGKILL) -> None:
    """Send this process ``sig`` (SIGKILL: a trainer rank dying mid-update; SIGSTOP: one
    stopped, until the test sends SIGCONT) when the sender is about to send message
    ``messages`` (0-based) of its send."""
    transport = sender.sender.transport
    real = transport.send
    count = [0]

    def send(peer: int, buf: torch.Tensor) -> None:
        if count[0] == messages:
            os.kill(os.getpid(), sig)
        count[0] += 1
        real(peer, buf)

    transport.send = send


class Trainers:
    """The trainer's ranks: one process of this module each, driven by JSON lines (the
    refit tests and ``bench/bench_refit.py``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[subprocess.Popen[str]] = []
        for r in range(world):
            self.start(r)

    def start(self, rank: int) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.refit_trainer", str(rank), str(self.world)],
            cwd=Path(__file__).resolve().parents[1],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if rank < len(self.procs):
            self.procs[rank] = proc
        else:
            self.procs.append(proc)

    def post(self, cmd: dict[str, Any], ranks: list[int] | None = None) -> None:
        for r in ranks if ranks is not None else range(self.world):
            stdin = self.procs[r].stdin
            assert stdin is not None
            stdin.write(json.dumps(cmd) + "\n")
            stdin.flush()

    def replies(self, ranks: list[int] | None = None) -> list[dict[str, Any]]:
        out = []
        for r in ranks if ranks is not None else range(self.world):
            stdout = self.procs[r].stdout
            assert stdout is not None
            line = stdout.readline()
            out.append(json.loads(line) if line else {"ok": False, "error": "process ended"})
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    self.post({"op": "exit"}, [self.procs.index(p)])
                    p.wait(timeout=20)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
                    p.wait()


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    senders: dict[str, MxloadSender] = {}
    manifests: dict[str, TrainerManifest] = {}
    cache: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def weights(path: str, name: str) -> dict[str, torch.Tensor]:
        m = manifests[name]
        key = (path, m.digest())
        if key not in cache:
            cache[key] = manifest_shards(read_checkpoint(path), m, rank)
        return cache[key]

    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        try:
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "join":
                m = manifest_from_json(cmd["trainer"]["manifest"])
                if m.world != world:
                    raise ValueError(f"the manifest's world is {m.world}, this trainer's {world}")
                old = senders.pop(cmd["name"], None)
                if old is not None:
                    old.close()
                senders[cmd["name"]] = MxloadSender(
                    cmd["src"],
                    ParallelLayout(**cmd["layout"]),
                    cmd["trainer"],
                    rank=rank,
                    engine=cmd.get("engine"),
                )
                manifests[cmd["name"]] = m
                reply: dict[str, Any] = {"ok": True}
            else:
                sender = senders[cmd["name"]]
                params = dict(weights(cmd["weights"], cmd["name"]))
                mix = cmd.get("mix")
                if mix:
                    other = weights(mix["from"], cmd["name"])
                    params.update({n: other[n] for n in mix["tensors"] if n in other})
                die = cmd.get("die_after")
                if die is not None:
                    die_after(sender, die)
                stop = cmd.get("stop_after")
                if stop is not None:
                    die_after(sender, stop, signal.SIGSTOP)
                reply = {
                    "ok": True,
                    **sender.send_weights(
                        params,
                        cmd["step"],
                        delta_of=cmd.get("delta_of"),
                        changed=cmd.get("changed"),
                    ),
                }
        except Exception as err:
            reply = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "tb": traceback.format_exc(),
            }
        print(json.dumps(reply), flush=True)
    for s in senders.values():
        s.close()


if __name__ == "__main__":
    main()
