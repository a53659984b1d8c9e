"""Simulate a multi-node Ray cluster of NPU nodes on one machine, on loopback only.

    python cluster/simulate_cluster.py --workers 3 --npus 16      # head + 3 nodes, 64 NPUs
    eval "$(python cluster/simulate_cluster.py --env)"             # token + address for mxload
    mxload load CKPT --address "$RAY_ADDRESS" --tp 2 --dp 4 --enable-expert-parallel --device cpu
    python cluster/simulate_cluster.py --stop                      # ends exactly what it started

Why: docs/contract.md §4 "Cluster" — the multi-node path (placement across nodes, a TP group kept
on one node, ``--address``, token auth, detached sessions on a cluster mxload did not
start) should be exercised without NPU nodes. Each simulated node is a real ``ray start``
raylet declaring ``--resources '{"NPU": k}'``; Ray pins one unit per rank and sets
``ASCEND_RT_VISIBLE_DEVICES`` exactly as on a real node.

How, and the Ray quirks it works around (Ray 2.60):

* Every process binds 127.0.0.1 (``--node-ip-address``); all ports are picked free on
  loopback (GCS, Ray client server, each node's dashboard agent: their defaults 6379,
  10001 and 52365 would collide with any other Ray on the machine).
* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, ``RAY_USAGE_STATS_ENABLED=0``, no dashboard,
  a private short temp dir per node under one root (Ray's socket paths must stay under
  107 bytes; a stale cluster in Ray's default temp dir is never touched).
* Token auth: the head and every node get ``RAY_AUTH_MODE=token`` and a fresh
  ``RAY_AUTH_TOKEN``; a driver joining with an explicit address does not pick a token up
  by itself, so the token is recorded (``--env`` prints the exports) for
  ``mxload --address``. Nothing is written to ``~/.ray``.
* ``ray start --address`` (a worker node) refuses to run when
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` ("multi-node not supported"), and with it on it
  rewrites 127.0.0.1 — in both ``--address`` and ``--node-ip-address`` — to the machine's
  interface address, where the loopback-bound GCS is not listening. Worker nodes are
  therefore started by Ray's own ``ray start`` command run in a small launcher that
  passes that check and keeps loopback addresses as given (``_WORKER_LAUNCHER``); their
  processes keep ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``. A real cluster needs none of
  this (cluster/README.md).

``--stop`` ends, by pid, the processes whose command line names this cluster's root temp
dir, their descendants (Ray renames worker and agent processes ``ray::...``, so their
command lines no longer name it) and the head's Ray client server (which names only the
GCS address); never ``ray stop``, which would end every Ray on the machine. State lives
in ``$MXLOAD_HOME/sim-cluster.json`` (mode 0600: it holds the token).

Limits: one simulated cluster per ``$MXLOAD_HOME``; all nodes share the machine's CPUs
and memory (each node declares ``--num-cpus``, default 1, and a small object store).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..orchestrator.errors import InputError, SessionError
from .local import (
    GCS_GRACE_S,
    LOOPBACK,
    RAY_ENV,
    client_server_port_flags,
    daemon_env,
    free_port,
    head_processes,
    mxload_home,
    short_temp_dir,
    terminate,
)

RECORD_NAME = "sim-cluster.json"
DEFAULT_OBJECT_STORE = 256 * 1024 * 1024
"""Per node; Ray's default (30% of RAM per raylet) is far too much for several on one host."""

# Ray's `ray start`, run in-process with the two changes a loopback worker node needs
# (see the module docstring): pass the multi-node check, keep 127.0.0.1 as given.
_WORKER_LAUNCHER = """
import sys
from mxload.cluster.raycompat import allow_loopback_worker_node

allow_loopback_worker_node()
from ray.scripts.scripts import main
sys.argv = ["ray", "start", *sys.argv[1:]]
main()
"""

# Joins the cluster the way `mxload --address` does (cluster.local.connect, token from
# the environment) and waits until every node is alive: proves the recorded env works.
_CHECK = """
import json, sys, time
from mxload.cluster.local import connect
import ray
expected, timeout_s = int(sys.argv[2]), float(sys.argv[3])
connect(sys.argv[1])
deadline = time.monotonic() + timeout_s
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= expected or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
                   "resources": n["Resources"]} for n in alive]))
ray.shutdown()
"""


@dataclass(frozen=True)
class SimNode:
    """One simulated node: its own raylet, temp dir and accelerator count."""

    name: str
    temp_dir: str
    npus: int
    num_cpus: int
    head: bool


@dataclass(frozen=True)
class SimCluster:
    """A running simulated cluster, as recorded in ``$MXLOAD_HOME/sim-cluster.json``."""

    address: str
    token: str
    root: str
    """Parent of every node's temp dir; its path identifies this cluster's processes."""
    resource: str
    nodes: tuple[SimNode, ...]
    started_at: float = field(default_factory=time.time)

    @property
    def total_npus(self) -> int:
        return sum(n.npus for n in self.nodes)

    def env(self) -> dict[str, str]:
        """What a driver (``mxload ... --address``, ``ray status``) needs to join it."""
        return dict(
            RAY_ENV,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            RAY_ADDRESS=self.address,
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["nodes"] = [asdict(n) for n in self.nodes]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SimCluster:
        nodes = tuple(SimNode(**n) for n in data.pop("nodes"))
        return cls(nodes=nodes, **data)


def record_path() -> Path:
    return mxload_home() / RECORD_NAME


def read_record() -> SimCluster | None:
    path = record_path()
    if not path.exists():
        return None
    try:
        return SimCluster.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError):
        return None


def _write_record(cluster: SimCluster) -> None:
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)  # it holds the cluster's auth token
    path.write_text(json.dumps(cluster.to_json(), indent=2))


def _ray_bin() -> str:
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        raise SessionError("cannot find the `ray` command next to this Python")
    return ray_bin


def _node_env(token: str) -> dict[str, str]:
    env = daemon_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    env.pop("RAY_AUTH_TOKEN_PATH", None)  # the token above wins, never a file
    env.pop("RAY_ADDRESS", None)
    return env


def _run(cmd: list[str], env: dict[str, str], what: str, timeout_s: float) -> None:
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SessionError(f"{what}: `ray start` did not return within {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        raise SessionError(f"{what} failed: " + (proc.stderr or proc.stdout)[-2000:])


def _common_flags(node: SimNode, resource: str, object_store_memory: int) -> list[str]:
    return [
        f"--node-ip-address={LOOPBACK}",
        f"--num-cpus={node.num_cpus}",
        f"--resources={json.dumps({resource: node.npus})}",
        f"--temp-dir={node.temp_dir}",
        f"--object-store-memory={object_store_memory}",
        f"--dashboard-agent-listen-port={free_port()}",
        "--disable-usage-stats",
    ]


def start(
    *,
    workers: int = 1,
    npus: int = 2,
    head_npus: int | None = None,
    num_cpus: int = 1,
    resource: str = "NPU",
    object_store_memory: int = DEFAULT_OBJECT_STORE,
    timeout_s: float = 180.0,
) -> SimCluster:
    """Start a head and ``workers`` worker nodes, each declaring ``npus`` units of
    ``resource`` (the head ``head_npus``, default ``npus``), record it and return it.
    On any failure everything already started is stopped again."""
    if workers < 0 or npus < 0 or num_cpus < 0 or (head_npus is not None and head_npus < 0):
        raise InputError("--workers, --npus, --head-npus and --num-cpus must be >= 0")
    existing = read_record()
    if existing is not None and cluster_processes(existing):
        raise SessionError(
            f"a simulated cluster is already running at {existing.address} "
            f"(recorded in {record_path()}); stop it first with --stop"
        )
    root = short_temp_dir("mxsim-")
    nodes = [
        SimNode(
            "head",
            os.path.join(root, "n0"),
            npus if head_npus is None else head_npus,
            num_cpus,
            True,
        )
    ]
    nodes += [
        SimNode(f"worker-{i}", os.path.join(root, f"n{i}"), npus, num_cpus, False)
        for i in range(1, workers + 1)
    ]
    token = secrets.token_hex(32)
    cluster = SimCluster(
        address=f"{LOOPBACK}:{free_port()}",
        token=token,
        root=root,
        resource=resource,
        nodes=tuple(nodes),
    )
    env = _node_env(token)
    port = cluster.address.rpartition(":")[2]
    try:
        head = nodes[0]
        _run(
            [
                _ray_bin(),
                "start",
                "--head",
                f"--port={port}",
                *client_server_port_flags(),
                "--include-dashboard=false",
                *_common_flags(head, resource, object_store_memory),
            ],
            env,
            "starting the head",
            timeout_s,
        )
        _write_record(cluster)  # from here on --stop can find it
        for node in nodes[1:]:
            _run(
                [
                    sys.executable,
                    "-c",
                    _WORKER_LAUNCHER,
                    f"--address={cluster.address}",
                    *_common_flags(node, resource, object_store_memory),
                ],
                env,
                f"starting {node.name}",
                timeout_s,
            )
        check_nodes(cluster, timeout_s=timeout_s)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def check_nodes(cluster: SimCluster, *, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Join as a driver would (token from the recorded env) and return the alive nodes;
    raise unless all of them registered with the declared resources."""
    env = dict(os.environ, **cluster.env())
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, cluster.address, str(len(cluster.nodes)), str(timeout_s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )
    if proc.returncode != 0:
        raise SessionError(
            f"cannot join the simulated cluster at {cluster.address}: "
            + (proc.stderr or proc.stdout)[-2000:]
        )
    alive: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    have = sum(int(n["resources"].get(cluster.resource, 0)) for n in alive)
    if len(alive) != len(cluster.nodes) or have != cluster.total_npus:
        raise SessionError(
            f"simulated cluster at {cluster.address}: {len(alive)} of {len(cluster.nodes)} "
            f"nodes alive, {have} of {cluster.total_npus} {cluster.resource}"
        )
    bad = [n["ip"] for n in alive if n["ip"] != LOOPBACK]
    if bad:
        raise SessionError(f"simulated nodes registered non-loopback addresses: {bad}")
    return alive


def cluster_processes(cluster: SimCluster) -> list[Any]:
    """All of the simulated cluster's processes (GCS, raylets, agents, workers, the head's
    client server)."""
    return head_processes(cluster.root, cluster.address)


def cluster_pids(cluster: SimCluster) -> list[int]:
    """Pids of the simulated cluster's processes now (GCS, raylets, agents, workers)."""
    return sorted(p.pid for p in cluster_processes(cluster))


def _name(proc: Any) -> str:
    try:
        return str(proc.name())
    except Exception:  # gone meanwhile
        return ""


def stop(cluster: SimCluster | None = None, *, grace_s: float = 5.0) -> int:
    """End exactly the recorded cluster's processes; returns how many were ended."""
    cluster = cluster or read_record()
    if cluster is None:
        return 0
    victims = cluster_processes(cluster)
    # The GCS last, with a short grace: this Ray's does not exit on SIGTERM for 10+ s.
    gcs = [p for p in victims if _name(p) == "gcs_server"]
    terminate([p for p in victims if p not in gcs], grace_s)
    terminate(gcs, min(grace_s, GCS_GRACE_S))
    recorded = read_record()
    if recorded is not None and recorded.root == cluster.root:
        record_path().unlink(missing_ok=True)
    shutil.rmtree(cluster.root, ignore_errors=True)
    return len(victims)


def env_lines(cluster: SimCluster) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(cluster.env().items()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simulate_cluster.py", description=__doc__.splitlines()[0] if __doc__ else None
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--stop", action="store_true", help="stop the recorded simulated cluster")
    what.add_argument(
        "--env", action="store_true", help="print `export` lines to join the running one"
    )
    what.add_argument("--status", action="store_true", help="check the running one's nodes")
    p.add_argument("--workers", type=int, default=1, help="worker nodes besides the head")
    p.add_argument("--npus", type=int, default=2, help="accelerators each node declares")
    p.add_argument("--head-npus", type=int, default=None, help="the head's (default --npus)")
    p.add_argument("--num-cpus", type=int, default=1, help="CPUs each node declares")
    p.add_argument("--resource", default="NPU", help="accelerator resource name")
    p.add_argument(
        "--object-store-memory", type=int, default=DEFAULT_OBJECT_STORE, help="bytes per node"
    )
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per step")
    p.add_argument("--json", action="store_true", help="print the record (without the token)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.stop:
            n = stop()
            print(f"stopped {n} processes" if n else "no simulated cluster recorded or running")
            return 0
        if args.env or args.status:
            cluster = read_record()
            if cluster is None or not cluster_processes(cluster):
                sys.stderr.write("simulate_cluster: error: no simulated cluster is running\n")
                return 2
            if args.env:
                print(env_lines(cluster))
            else:
                print(json.dumps(check_nodes(cluster), indent=1))
            return 0
        cluster = start(
            workers=args.workers,
            npus=args.npus,
            head_npus=args.head_npus,
            num_cpus=args.num_cpus,
            resource=args.resource,
            object_store_memory=args.object_store_memory,
            timeout_s=args.timeout,
        )
    except (InputError, SessionError) as err:
        sys.stderr.write(f"simulate_cluster: error: {err}\n")
        return 2
    if args.json:
        shown = cluster.to_json()
        shown.pop("token")
        shown["record"] = str(record_path())
        print(json.dumps(shown, indent=1))
    else:
        print(cluster.address)
        sys.stderr.write(
            f"simulated cluster: {len(cluster.nodes)} nodes, {cluster.total_npus} "
            f"{cluster.resource} on {LOOPBACK}; token recorded in {record_path()}\n"
            f'join it:  eval "$(python {sys.argv[0]} --env)"; '
            f"mxload load SRC --address {cluster.address} ...\n"
            f"stop it:  python {sys.argv[0]} --stop\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
