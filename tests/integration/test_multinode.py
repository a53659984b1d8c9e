"""The distributed load across several Ray nodes, simulated on one machine (docs/contract.md §4).

One two-node cluster (``ray.cluster_utils.Cluster``: a head and one added node, each its
own raylet on 127.0.0.1 declaring ``{"NPU": 2}`` and one CPU, token auth on) serves the
module. On it a tp=2 x dp=2 expert-parallel load must put ranks on both nodes, keep each
TP group (ranks 0-1, 2-3) on one node under ``pack`` — and, through ``assign_ranks``,
under ``spread`` too — and leave every rank holding exactly what the independent
reference (``tests/reference_model.py``) says, byte for byte (the single-node load is
held to the same reference in test_load.py and test_cli.py). A layout asking more
accelerators than the cluster has is refused with an error naming the resource, and
every socket of every process of the cluster is bound to loopback (checked while the
pack load's workers are alive).

``cluster/simulate_cluster.py`` (the ``ray start`` route an operator uses) is checked
once too, with the CLI joining it by ``--address`` and the recorded token.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from mxload.orchestrator.errors import InputError, RunError
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.driver import load
from mxload.orchestrator.runtime.request import LoadRequest
from safetensors.torch import load_file

from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NPUS_PER_NODE = 2
LAYOUT = ParallelLayout(tp=2, dp=2, enable_expert_parallel=True)
LAYOUT_FLAGS = ["--tp", "2", "--dp", "2", "--enable-expert-parallel"]
LOOPBACK_IPS = {"127.0.0.1", "::ffff:127.0.0.1"}
AUTH_KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "RAY_ADDRESS")


@pytest.fixture(scope="module")
def src(ckpt_factory) -> str:
    return ckpt_factory("qwen3-moe-tiny", 1)


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_KEYS}
    # A driver that joined a cluster once died of SIGSEGV after printing its manifest
    # (not reproduced since): should it again, stderr holds every thread's Python stack.
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra)
    return env


def _cli_load(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mxload.orchestrator.cli",
            "load",
            *args,
            "--device",
            "cpu",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    manifest: dict[str, Any] = json.loads(proc.stdout)
    return manifest


def _name(proc: psutil.Process) -> str:
    try:
        return str(proc.name())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def _bound_addresses(procs: list[psutil.Process]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every listening TCP socket and bound UDP socket."""
    out = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if not c.laddr:
                continue
            if c.type == socket.SOCK_STREAM and c.status != psutil.CONN_LISTEN:
                continue
            out.append((proc.pid, c.laddr.ip, c.laddr.port))
    return out


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A head and one more node, each with 2 NPUs and 1 CPU, all on 127.0.0.1, token
    auth on; the driver (this process) joins by address like ``mxload --address``."""
    import ray
    from mxload.cluster.local import (
        LOOPBACK,
        _refresh_ray_auth,
        connect,
        free_port,
        prepare_environment,
        short_temp_dir,
    )
    from ray.cluster_utils import Cluster

    prepare_environment()
    if ray.is_initialized():
        ray.shutdown()
    temp = short_temp_dir("mxmn-")
    # Cluster() records its address in $RAY_TMPDIR/ray/ray_current_cluster: keep that
    # inside our temp dir instead of the machine-wide /tmp/ray.
    os.makedirs(os.path.join(temp, "ray"))
    saved = {k: os.environ.get(k) for k in AUTH_KEYS}
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update(RAY_TMPDIR=temp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    _refresh_ray_auth()
    node = {
        "node_ip_address": LOOPBACK,
        "num_cpus": 1,
        "resources": {"NPU": NPUS_PER_NODE},
        "temp_dir": temp,
        "object_store_memory": 128 * 1024 * 1024,
    }
    cluster = None
    try:
        # The head's dashboard agent defaults to port 52365: another Ray on this machine
        # may hold it. Added nodes get a free one from Cluster itself.
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                node, include_dashboard=False, dashboard_agent_listen_port=free_port()
            ),
        )
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        connect(cluster.address)  # what `mxload --address` does, token from the environment
        cluster.temp_dir = temp
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(src) -> RefCheckpoint:
    return RefCheckpoint(src)


def _rank_nodes(manifest: dict[str, Any]) -> list[str]:
    return [r["node_id"] for r in sorted(manifest["ranks"], key=lambda r: r["rank"])]


def _check_placement(manifest: dict[str, Any], alive_nodes: set[str]) -> None:
    nodes = _rank_nodes(manifest)
    assert set(nodes) <= alive_nodes and len(set(nodes)) == 2, nodes
    # vLLM's rank order puts a TP group on consecutive ranks: 0-1 and 2-3.
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    for node in set(nodes):
        # Ray pinned one NPU unit per rank: distinct ASCEND_RT_VISIBLE_DEVICES per node.
        vis = [r["visible_devices"] for r in manifest["ranks"] if r["node_id"] == node]
        assert len(set(vis)) == NPUS_PER_NODE and all(v.isdigit() for v in vis), vis


def _check_reference(dump: str, manifest: dict[str, Any], reference: RefCheckpoint) -> None:
    """Every rank's dumped bytes are the independent reference's, version 1, consistent."""
    lay = Layout(LAYOUT.tp, LAYOUT.dp, LAYOUT.pp, LAYOUT.enable_expert_parallel)
    assert sorted(r["rank"] for r in manifest["ranks"]) == list(range(LAYOUT.world))
    for r in manifest["ranks"]:
        got = load_file(os.path.join(dump, f"rank-{r['rank']:05d}.safetensors"))
        problems = compare_rank(expected_rank(reference, lay, r["rank"]), got)
        assert problems == [], f"rank {r['rank']}: {problems[:10]}"
        assert r["consistent"] is True and r["version"] == 1


def _live_placement_groups() -> set[str]:
    """Ids of the cluster's placement groups not removed."""
    import ray

    return {
        pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"
    }


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_simulate_cluster_script_joined_by_address(src, reference, tmp_path, monkeypatch) -> None:
    """``cluster/simulate_cluster.py``: real ``ray start`` nodes on loopback, a token the
    CLI joins with (``--address``), and ``stop`` ends exactly what it started."""
    from mxload.cluster import simulate_cluster as sim

    monkeypatch.setenv("MXLOAD_HOME", str(tmp_path / "home"))
    cluster = sim.start(workers=1, npus=NPUS_PER_NODE, num_cpus=1)
    try:
        assert sim.read_record() == cluster
        assert oct(os.stat(sim.record_path()).st_mode & 0o777) == "0o600"
        pids = sim.cluster_pids(cluster)
        bound = _bound_addresses([psutil.Process(p) for p in pids if psutil.pid_exists(p)])
        assert bound and {ip for _, ip, _ in bound} <= LOOPBACK_IPS, bound
        dump = str(tmp_path / "dump")
        manifest = _cli_load(
            [src, *LAYOUT_FLAGS, "--address", cluster.address, "--dump", dump],
            _cli_env(MXLOAD_HOME=str(tmp_path / "home"), **cluster.env()),
        )
        _check_placement(manifest, {r["node_id"] for r in manifest["ranks"]})
        _check_reference(dump, manifest, reference)
    finally:
        stopped = sim.stop(cluster)
    assert stopped > 0
    assert sim.cluster_pids(cluster) == []
    assert not os.path.exists(cluster.root) and sim.read_record() is None


def test_pack_spans_nodes_keeps_tp_groups_and_matches_reference(
    two_nodes, src, reference, tmp_path
) -> None:
    """Also, while its rank workers are alive: GCS, raylets, agents, workers and this
    driver bind 127.0.0.1 only (the equivalent of ``ss -tlnp`` filtered to our processes)."""
    dump = str(tmp_path / "dump")
    manifest, run = load(
        LoadRequest(src=src, layout=LAYOUT, device="cpu", placement="pack"), dump=dump, keep=True
    )
    assert run is not None
    try:
        _check_loopback_only(two_nodes, manifest)
        # the trainer form's engine_nodes as a Session gives it: the live actors' nodes,
        # numbered in rank order; pack puts each TP group on one node
        from mxload.orchestrator.runtime.refit import node_numbers
        from mxload.orchestrator.runtime.shared_reads import node_ids

        assert node_numbers(node_ids(run.actors, 60)) == [0, 0, 1, 1]
        # a cluster mxload did not start passes the workers' environment through the
        # job's runtime_env
        if "OMP_WAIT_POLICY" not in os.environ:
            import ray

            policy = run.actors[3].__ray_call__.remote(lambda _: os.environ.get("OMP_WAIT_POLICY"))
            assert ray.get(policy, timeout=60) == "PASSIVE"
    finally:
        run.shutdown()
    _check_placement(manifest, _alive_nodes())
    _check_reference(dump, manifest, reference)


def test_spread_spans_nodes_with_the_reference_bytes(two_nodes, src, reference, tmp_path) -> None:
    dump = str(tmp_path / "dump")
    manifest, _ = load(
        LoadRequest(src=src, layout=LAYOUT, device="cpu", placement="spread"), dump=dump
    )
    # SPREAD alternates bundles between nodes; assign_ranks still gives each TP group
    # one node, so the check is the same as for pack.
    _check_placement(manifest, _alive_nodes())
    _check_reference(dump, manifest, reference)


@pytest.mark.parametrize(
    ("layout", "resource", "needs", "have"),
    [
        (ParallelLayout(tp=2, dp=4, enable_expert_parallel=True), None, 8, 4),
        (LAYOUT, "GPU", 4, 0),
    ],
    ids=["8-ranks-on-4-NPUs", "no-GPU-resource"],
)
def test_more_ranks_than_accelerators_is_refused(
    two_nodes, src, layout: ParallelLayout, resource: str | None, needs: int, have: int
) -> None:
    before = _live_placement_groups()
    with pytest.raises(InputError) as info:
        load(LoadRequest(src=src, layout=layout, device="cpu", resource=resource))
    name = resource or "NPU"
    msg = str(info.value)
    assert f"has {have} {name} resources" in msg and f"needs {needs}" in msg, msg
    assert info.value.key == "--resource"
    assert _live_placement_groups() <= before, "a refused layout left a placement group behind"


def test_strict_spread_wider_than_the_cluster_fails_naming_the_strategy(two_nodes, src) -> None:
    """4 bundles, each on its own node, on 2 nodes: Ray can never place it. The group that
    never became ready is removed, not left pending for the next load to wait behind."""
    before = _live_placement_groups()
    with pytest.raises(RunError) as info:
        load(
            LoadRequest(
                src=src,
                layout=LAYOUT,
                device="cpu",
                placement="strict_spread",
                placement_timeout_s=1,
            )
        )
    assert "STRICT_SPREAD" in str(info.value) and "NPU" in str(info.value)
    assert _live_placement_groups() <= before, "the unplaceable group was left behind"


def _check_loopback_only(cluster: Any, manifest: dict[str, Any]) -> None:
    """Every listening or bound socket of the cluster's processes (rank workers among
    them) and of this driver is on loopback."""
    from mxload.cluster.local import processes_under

    procs = [*processes_under(cluster.temp_dir), psutil.Process()]
    pids = {p.pid for p in procs}
    assert {r["pid"] for r in manifest["ranks"]} <= pids, "rank workers not found"
    bound = _bound_addresses(procs)
    raylets = {p.pid for p in procs if _name(p) == "raylet"}
    assert len(raylets) == 2 and raylets <= {pid for pid, _, _ in bound}
    assert {ip for _, ip, _ in bound} <= LOOPBACK_IPS, [b for b in bound]


def test_a_node_without_the_device_runtime_is_refused_before_any_worker(two_nodes, src) -> None:
    """``--device npu`` on nodes without torch_npu: each node of the placement group is
    asked first (a small task in one of its bundles); the refusal names the node and the
    flag, is an input error (exit 2), and starts no worker (nothing to restart)."""
    before = _live_placement_groups()
    with pytest.raises(InputError) as info:
        load(LoadRequest(src=src, layout=LAYOUT, device="npu", placement="spread"))
    msg = str(info.value)
    assert msg.startswith("node ") and "--device npu" in msg and "torch_npu" in msg, msg
    assert info.value.key == "--device" and info.value.exit_code == 2
    assert _live_placement_groups() <= before, "a refused layout left a placement group behind"
