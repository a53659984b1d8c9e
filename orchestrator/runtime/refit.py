"""Refit: a reload whose bytes come from a trainer's ranks (docs/contract.md §4 "Refit").

The same units, conversion and write stages, identities, fencing and address check as a
checkpoint reload (:func:`mxload.orchestrator.runtime.reload.apply`); only the read stage
differs: every engine rank first receives the bytes its units read of the trainer's
memory (``mxload.workers.transfer``) into a receive ring allocated once, which its
loader reads from as the bytes land, unit by unit in order (the ring holds the span of
units one bucket touches, ``RefitSummary.receiver_ring``, not the rank's whole need). The identity a refit writes is (trainer step, manifest
hash): ``status`` and vLLM's ``weight_version`` read the step back.

* :class:`TrainerSource`: the trainer form of the weight-transfer init info (transport,
  addresses, world, manifest, ``convert_on``, bucket bytes);
* :func:`refit_setup`: the wire checkpoint, its plan for the engine's layout (preflight
  against what the ranks hold) and the transfer plan; both sides compute it;
* :class:`RefitRank`: an in-process engine rank's receiver, :class:`RayRefitRanks` and
  :func:`join_ray` a ``Session``'s actors'; :func:`refit`: one update;
* :class:`MxloadSender`: the trainer side, ``MxloadSender(...).send_weights(params, step)``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from ..errors import InputError, ReloadMismatch
from ..plan.checkpoint import CheckpointMeta, build_meta
from ..plan.config import ModelConfig, QuantConfig
from ..plan.formats import MX_GROUP
from ..plan.readplan import matrix_shape
from ..plan.refit import (
    DEFAULT_BUCKET_BYTES,
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    ConvertOn,
    RefitPlan,
    refit_plan,
)
from ..plan.safetensors_header import FileHeader, TensorInfo
from ..plan.trainer import TrainerManifest, manifest_from_json
from ..plan.types import ParallelLayout, Plan
from .liveness import Liveness
from .reload import Ranks, ReloadInputs, ReloadResult, apply, inputs_for, plan_for
from .state import Progress, Report, SessionState

if TYPE_CHECKING:
    import torch

    from ...workers.rank.loader import RankLoader
    from ...workers.transfer.exchange import Received
    from ...workers.transfer.rank import RankRefit, TransportSpec
    from .ray_run import RayRun

log = logging.getLogger(__name__)

WIRE_ROOT = "trainer://"
"""The root of a trainer source (what ``status`` names as the source of a refit)."""

WIRE_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
SCALE_SUFFIX = "_scale"


def trainer_fingerprint(manifest_hash: str) -> str:
    """What units written by a refit record as their checkpoint (with the step)."""
    return f"trainer-{manifest_hash}"


def wire_checkpoint(
    config: ModelConfig, manifest: TrainerManifest, *, on_sender: frozenset[str] = frozenset()
) -> CheckpointMeta:
    """The trainer's memory as the planner reads a checkpoint: one file per tensor as the
    wire carries it, its bytes at offset 0 (validated as a checkpoint is). ``on_sender``:
    the tensors converted to MXFP8 by the sender, each an E4M3 file and its
    ``_scale`` file of E8M0 bytes, as an MXFP8 checkpoint stores them (§1.2)."""
    headers: dict[str, FileHeader] = {}

    def add(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
        info = TensorInfo(name, dtype, shape, name, 0, nbytes)
        headers[name] = FileHeader(name, nbytes, 0, 0, {name: info}, {})

    for t in manifest.tensors:
        if t.name in on_sender:
            n, k = matrix_shape(t.shape)
            add(t.name, "F8_E4M3", t.shape, n * k)
            add(t.name + SCALE_SUFFIX, "U8", (n, k // MX_GROUP), n * (k // MX_GROUP))
        else:
            add(t.name, WIRE_DTYPES[t.dtype], t.shape, t.nbytes)
    quant = QuantConfig(kind="mxfp8" if on_sender else "none")
    root = WIRE_ROOT + manifest.digest()
    meta = build_meta(root, replace(config, quant=quant), {f: f for f in headers}, headers)
    return replace(meta, fingerprint=trainer_fingerprint(manifest.digest()))


def row_bytes(wire: CheckpointMeta) -> dict[str, int]:
    """Per wire file, the bytes of one row of its ``[N, K]`` view."""
    out = {}
    for name, info in wire.tensors.items():
        n, _ = matrix_shape(info.shape)
        out[name] = info.nbytes // n
    return out


MANIFEST_MAX_BYTES = 1 << 30
"""Largest trainer manifest file read (a 1T-parameter model over 1024 ranks is ~300 MB)."""
MAX_TIMEOUT_S = 86400.0
GROUP_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
MAX_NODES = 1 << 20
"""A refit group's name: part of shared-memory file names and Ray actor names."""


def read_manifest(path: str, what: str) -> TrainerManifest:
    """The trainer manifest JSON file ``path`` (a regular file of at most
    :data:`MANIFEST_MAX_BYTES`); one InputError naming ``what`` and the file."""
    from ...workers.storage.local import read_whole

    try:
        raw = read_whole(os.path.abspath(path), MANIFEST_MAX_BYTES, path)
    except OSError as err:
        raise InputError(f"{what}: cannot read {path}: {err.strerror}", file=path) from None
    except InputError as err:  # not a regular file, or too large
        raise InputError(f"{what}: {err.message}", file=path) from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        reason = str(err) if isinstance(err, ValueError) else "nested too deeply"
        raise InputError(
            f"{what}: {path}: not a JSON trainer manifest: {reason}", file=path
        ) from None
    return manifest_from_json(data, file=path)


def _host_port(address: Any) -> bool:
    if not isinstance(address, str):
        return False
    host, sep, port = address.rpartition(":")
    return bool(host and sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)


def node_numbers(node_ids: Sequence[str]) -> list[int]:
    """Per rank, its node numbered in order of first appearance (``["b", "a", "b"]`` ->
    ``[0, 1, 0]``): the trainer form's ``engine_nodes`` from the engine ranks' node ids."""
    number: dict[str, int] = {}
    return [number.setdefault(n, len(number)) for n in node_ids]


TRAINER_KEYS = (
    "transport",
    "addresses",
    "world",
    "manifest",
    "convert_on",
    "bucket_bytes",
    "group",
    "timeout_s",
    "engine_nodes",
)


@dataclass(frozen=True)
class TrainerSource:
    """Where a refit's bytes come from: the trainer form of the ``"mxload"`` backend's
    init info (docs/adoption.md "Refit from the trainer")."""

    transport: str
    """``gloo`` (torch.distributed push over TCP), ``ray`` (object store
    pull), ``shm`` (same-node shared memory)."""
    world: int
    """Trainer ranks that send (members ``0..world-1`` of the refit group; engine rank
    ``r`` is member ``world + r``)."""
    manifest: TrainerManifest
    addresses: tuple[str, ...] = ()
    """``HOST:PORT`` of the group's rendezvous (torch.distributed transports)."""
    convert_on: ConvertOn = "receiver"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    group: str = "mxload-refit"
    """Name of the refit group (shared-memory segments, Ray mailbox, store prefix)."""
    timeout_s: float = 60.0
    """How long a rank waits on the other side before naming it (the refit's lease)."""
    engine_nodes: tuple[int, ...] = ()
    """Per engine rank, the machine it runs on (numbered as the manifest numbers the
    trainer's): ranks of one machine holding the same buffers copy them from the first
    of them once written (``plan.refit.NodeCopy``). Empty: every rank receives all it
    holds."""

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | TrainerSource) -> TrainerSource:
        """Parse the trainer form; one InputError naming the bad key."""
        if isinstance(data, TrainerSource):
            return data
        if not isinstance(data, Mapping):
            raise InputError("trainer: must be an object", key="trainer")
        unknown = sorted(set(data) - set(TRAINER_KEYS))
        if unknown:
            raise InputError(f"trainer: unknown keys {unknown}", key="trainer")
        for key in ("transport", "world", "manifest"):
            if key not in data:
                raise InputError(f"trainer: {key!r} is required", key=f"trainer.{key}")
        m = data["manifest"]
        if isinstance(m, TrainerManifest):
            manifest = m
        elif isinstance(m, str):
            manifest = read_manifest(m, "trainer.manifest")
        else:
            manifest = manifest_from_json(m)
        from ...workers.transfer.transports import KINDS

        transport = data["transport"]
        if transport not in KINDS:
            raise InputError(
                f"trainer.transport {transport!r} is not one of {list(KINDS)}",
                key="trainer.transport",
            )
        convert_on = data.get("convert_on", "receiver")
        if convert_on not in ("receiver", "sender"):
            raise InputError(
                f"trainer.convert_on {convert_on!r} is not 'receiver' or 'sender'",
                key="trainer.convert_on",
            )
        world = data["world"]
        if isinstance(world, bool) or not isinstance(world, int) or world != manifest.world:
            raise InputError(
                f"trainer.world {world!r} is not the manifest's world {manifest.world}",
                key="trainer.world",
            )
        bucket = data.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
        if (
            isinstance(bucket, bool)
            or not isinstance(bucket, int)
            or not MIN_BUCKET_BYTES <= bucket <= MAX_BUCKET_BYTES
        ):
            raise InputError(
                f"trainer.bucket_bytes {bucket!r} must be an integer in "
                f"{MIN_BUCKET_BYTES}..{MAX_BUCKET_BYTES} (1 KiB..16 GiB)",
                key="trainer.bucket_bytes",
            )
        addresses = data.get("addresses", ())
        if not isinstance(addresses, list | tuple) or not all(_host_port(a) for a in addresses):
            raise InputError(
                f"trainer.addresses {addresses!r} must be a list of 'HOST:PORT' (port 1..65535)",
                key="trainer.addresses",
            )
        timeout = data.get("timeout_s", 60.0)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= MAX_TIMEOUT_S  # NaN fails too
        ):
            raise InputError(
                f"trainer.timeout_s {timeout!r} must be a number of seconds in "
                f"(0, {MAX_TIMEOUT_S}]",
                key="trainer.timeout_s",
            )
        group = data.get("group", "mxload-refit")
        if not isinstance(group, str) or not GROUP_NAME.fullmatch(group):
            raise InputError(
                f"trainer.group {group!r} must be 1-100 letters, digits, '.', '_' or '-'",
                key="trainer.group",
            )
        nodes = data.get("engine_nodes", ())
        if not isinstance(nodes, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_NODES for n in nodes
        ):
            raise InputError(
                f"trainer.engine_nodes {str(nodes)[:80]} must be a list of node numbers "
                f"(0..{MAX_NODES - 1}), one per engine rank",
                key="trainer.engine_nodes",
            )
        return cls(
            transport=transport,
            world=world,
            manifest=manifest,
            addresses=tuple(addresses),
            convert_on=cast(ConvertOn, convert_on),
            bucket_bytes=bucket,
            group=group,
            timeout_s=float(timeout),
            engine_nodes=tuple(nodes),
        )


@dataclass(frozen=True)
class RefitSetup:
    """What both sides of a refit compute from the engine's plan and the trainer source."""

    source: TrainerSource
    held: Plan
    wire: CheckpointMeta
    """The trainer's memory as the wire carries it, read as a checkpoint."""
    plan: Plan
    """``wire`` planned for the held layout: every rank's reads."""
    refit: RefitPlan
    _inputs: dict[tuple[int | None, bool], ReloadInputs] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def manifest_hash(self) -> str:
        return self.refit.summary.manifest_digest

    def inputs(self, staging_budget: int | None, fused: bool) -> ReloadInputs:
        """What every rank runs for an update: the same every step (the staging budgets
        take a fifth of a small model's update to work out), so worked out once."""
        key = (staging_budget, fused)
        got = self._inputs.get(key)
        if got is None:
            got = self._inputs[key] = inputs_for(
                self.held,
                self.wire,
                self.plan,
                self.wire.root,
                staging_budget=staging_budget,
                fused=fused,
            )
        return got


MAX_STEP = (1 << 63) - 1
"""The largest trainer step: steps travel as signed 64-bit words in each link's header."""


def check_update(step: Any, delta_of: Any = None, changed: Collection[str] | None = None) -> None:
    """One InputError naming the argument of an update (either side) that is not a step
    in ``1..MAX_STEP``, a ``delta_of`` that is not None or such a step, or a ``changed``
    that is not a collection of tensor names."""
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_STEP:
        raise InputError(f"update step {step!r} must be an integer in 1..2**63-1", key="step")
    if delta_of is not None and (
        isinstance(delta_of, bool) or not isinstance(delta_of, int) or not 1 <= delta_of <= MAX_STEP
    ):
        raise InputError(
            f"delta_of {delta_of!r} must be None or the step the engine holds (1..2**63-1)",
            key="delta_of",
        )
    if changed is not None and (
        isinstance(changed, str | bytes) or not all(isinstance(c, str) for c in changed)
    ):
        raise InputError("changed must be a collection of tensor names", key="changed")


def refit_setup(
    held: Plan, config: ModelConfig, source: TrainerSource, *, fused: bool = True
) -> RefitSetup:
    """Plan a refit of ``held`` (the engine's plan, ``config`` its model) from ``source``:
    the transfer plan (``plan.refit.refit_plan``, engine ranks on the source's
    ``engine_nodes``: ranks of one node copy the buffers they share) and the wire checkpoint's plan (the loader's
    reads); ReloadMismatch (nothing touched) when the trainer's tensors do not give every
    rank exactly what it holds."""
    world = held.layout.world
    nodes = source.engine_nodes or tuple(range(world))
    if len(nodes) != world:
        raise InputError(
            f"trainer.engine_nodes names {len(nodes)} engine ranks, the engine has {world}",
            key="trainer.engine_nodes",
        )
    rp = refit_plan(
        held,
        source.manifest,
        convert_on=source.convert_on,
        bucket_bytes=source.bucket_bytes,
        receiver_nodes=nodes,
        fused=fused,
    )
    on_sender = frozenset(t.tensor for b in rp.buckets for t in b.transfers if t.on_sender)
    wire = wire_checkpoint(config, source.manifest, on_sender=on_sender)
    plan = plan_for(held, wire, wire.root, fused=fused)
    # The receive ring is laid out in the held plan's unit order, and the loader reads
    # the wire plan's units: they must be the same units in the same order.
    for r in range(world):
        mine = [(u.buffer, u.expert, u.row0, u.rows) for u in held.ranks[r].units]
        theirs = [(u.buffer, u.expert, u.row0, u.rows) for u in plan.ranks[r].units]
        if mine != theirs:
            raise ReloadMismatch(
                f"engine rank {r}: the trainer's tensors plan other units than the engine "
                "holds (or in another order); nothing was touched",
                rank=r,
            )
    return RefitSetup(source, held, wire, plan, rp)


def transport_spec(setup: RefitSetup, member: int) -> TransportSpec:
    from ...workers.transfer.exchange import HEAD_WORDS
    from ...workers.transfer.rank import TransportSpec

    s = setup.source
    return TransportSpec(
        kind=s.transport,
        addresses=s.addresses,
        member=member,
        senders=s.world,
        size=s.world + setup.held.layout.world,
        group=s.group,
        timeout_s=s.timeout_s,
        bucket_bytes=max(s.bucket_bytes, HEAD_WORDS * 8 + len(s.manifest.tensors)),
    )


def receiver_args(setup: RefitSetup, rank: int) -> tuple[Any, ...]:
    """What engine rank ``rank``'s ``RankRefit`` is built from (in its own process)."""
    itemsize = {t.name: t.itemsize for t in setup.source.manifest.tensors}
    member = setup.source.world + rank
    spec = transport_spec(setup, member)
    units = setup.held.ranks[rank].units
    share = setup.refit.only(receiver=rank)  # not the whole plan to every rank
    return share, rank, spec, itemsize, row_bytes(setup.wire), units


@dataclass
class _Update:
    step: int
    delta_of: int | None


@dataclass
class RefitRank:
    """One in-process engine rank's receiving side (``workers.transfer.rank.RankRefit``)
    with the update it is running."""

    setup: RefitSetup
    rank: int
    receiver: RankRefit = field(init=False)
    update: _Update | None = None

    def __post_init__(self) -> None:
        from ...workers.transfer.rank import RankRefit

        self.receiver = RankRefit(*receiver_args(self.setup, self.rank))

    @property
    def last(self) -> Received | None:
        return self.receiver.last

    def prepare(self, inputs: ReloadInputs, version: int, loader: RankLoader) -> Any:
        """Receive this rank's bytes of step ``version`` (and re-stamp what a delta
        leaves unchanged); returns the storage the loader reads them from."""
        upd = self.update
        assert upd is not None and upd.step == version
        return self.receiver.prepare(
            loader, inputs.reads[self.rank], inputs.source.fingerprint, version, upd.delta_of
        )

    def close(self) -> None:
        self.receiver.close()


class RayRefitRanks:
    """:class:`Ranks` of a refit of a session whose ranks are Ray actors: each actor
    receives its bytes itself (``RankWorker.refit_load``)."""

    def __init__(self, run: RayRun, step: int, delta_of: int | None) -> None:
        self.run = run
        self.step = step
        self.delta_of = delta_of

    @property
    def fused(self) -> bool:
        from .request import workers_fused

        return workers_fused(self.run.req.device)

    def run_ranks(
        self, inputs: ReloadInputs, version: int, on_progress: Progress | None
    ) -> list[Report]:
        import ray

        refs = [
            a.refit_load.remote(
                self.step,
                self.delta_of,
                list(inputs.reads[r]),
                inputs.source,
                inputs.budgets[r],
                list(inputs.units[r]),
            )
            for r, a in enumerate(self.run.actors)
        ]
        Liveness(self.run.actors, self.run.answer_timeout_s, self.run.pids()).wait(
            dict(enumerate(refs))
        )
        out: list[Report] = ray.get(refs)
        return out


def join_ray(run: RayRun, setup: RefitSetup) -> None:
    """Every actor of ``run`` joins the refit group (waits for the trainer's ranks). The
    first rank that cannot (no device for its transport, an address it cannot reach) is
    named as it fails, not after the others have waited for the trainer."""
    import ray

    from .worker_errors import rank_error

    refs = {a.refit_join.remote(*receiver_args(setup, r)): r for r, a in enumerate(run.actors)}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as err:
            raise rank_error(refs[done[0]], err) from None


def refit(
    ranks: Ranks,
    state: SessionState,
    save: Any,
    setup: RefitSetup,
    receivers: Sequence[RefitRank],
    *,
    step: int,
    manifest_hash: str,
    delta_of: int | None = None,
    staging_budget: int | None = None,
    on_progress: Progress | None = None,
    fence: int = 0,
) -> ReloadResult:
    """Bring ``state``'s session to trainer step ``step``: refused, nothing touched and
    nothing received, when ``manifest_hash`` is not the manifest the refit was set up for,
    or when ``delta_of`` is not the step the session holds."""
    check_update(step, delta_of)
    if manifest_hash != setup.manifest_hash:
        raise ReloadMismatch(
            f"refit to step {step} refused, nothing was touched: the trainer's manifest "
            f"hash is {manifest_hash}, the engine was set up for {setup.manifest_hash} "
            "(a tensor, shape, dtype or placement changed); initialise the weight transfer "
            "again with the new manifest",
            key="manifest_hash",
        )
    if delta_of is not None and (delta_of, setup.wire.fingerprint) != state.identity:
        raise ReloadMismatch(
            f"refit to step {step} as a delta of step {delta_of} refused, nothing was "
            f"touched: the engine holds version {state.version} of {state.src}; send the "
            "update in full (delta_of None), after initialising the weight transfer again "
            "if the trainer already sent this one (its bytes were not taken)",
            key="delta_of",
        )
    inputs = setup.inputs(staging_budget, ranks.fused)
    for r in receivers:
        r.update = _Update(step, delta_of)
    try:
        return apply(
            ranks,
            state,
            save,
            inputs,
            setup.wire.root,
            target=step,
            storage_options=state.storage_options,
            on_progress=on_progress,
            fence=fence,
        )
    finally:
        for r in receivers:
            r.update = None


def local_tensors(manifest: TrainerManifest, rank: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What trainer rank ``rank`` holds of each tensor the manifest places on it: its
    dtype and local shape."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for t in manifest.tensors:
        for sl in t.placement:
            if sl.rank == rank:
                shape = list(t.shape)
                if sl.dim is not None:
                    shape[sl.dim] = sl.stop - sl.start
                out[t.name] = (t.dtype, tuple(shape))
    return out


def check_local(
    params: Mapping[str, torch.Tensor], local: Mapping[str, tuple[str, tuple[int, ...]]], rank: int
) -> None:
    """Each given tensor is what the manifest places on trainer rank ``rank`` (``local``,
    :func:`local_tensors`), before a byte is sent: a trainer's fp32 master weights under a
    bfloat16 manifest, or a whole tensor for a shard, would otherwise be sent as bytes the
    engine reads as something else. InputError naming the tensor and rank."""
    from ...workers.transfer.exchange import local_shard

    for name, param in params.items():
        want = local.get(name)
        if want is None:
            continue  # not placed here: never read
        dtype, shape = want
        t = local_shard(param)
        got = str(t.dtype).removeprefix("torch.")
        if got != dtype or tuple(t.shape) != shape:
            raise InputError(
                f"trainer rank {rank}: tensor {name!r} is {got} {list(t.shape)}, the manifest "
                f"places {dtype} {list(shape)} on this rank; nothing was sent",
                tensor=name,
                rank=rank,
            )


class MxloadSender:
    """The trainer side of a refit: one per trainer rank.

    ``src``: the checkpoint the engine was started from (its plan's layouts), ``layout``
    and ``engine`` the engine's; ``trainer``: the same trainer form the engine's init info
    carries. Joins the refit group on construction (the engine's ranks join theirs in
    ``init_weight_transfer_engine``)."""

    def __init__(
        self,
        src: str,
        layout: ParallelLayout,
        trainer: Mapping[str, Any] | TrainerSource,
        *,
        rank: int,
        engine: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        device: str = "cpu",
    ) -> None:
        from ...workers.numerics.select import select_backend
        from ...workers.transfer.exchange import Sender
        from ..plan.engines import DEFAULT_ENGINE, engine_profile
        from ..plan.planner import build_plan
        from ..plan.refit import open_share, sender_share
        from .catalog import open_checkpoint

        source = TrainerSource.from_json(trainer)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < source.world:
            raise InputError(
                f"trainer rank {rank!r} is not an integer in 0..{source.world - 1} (the trainer world)",
                key="rank",
            )
        meta = open_checkpoint(src, storage_options=storage_options)
        profile = engine_profile(engine or DEFAULT_ENGINE)
        held = build_plan(meta.config, layout, checkpoint=meta, engine=profile)
        setup = refit_setup(held, meta.config, source)
        self.rank = rank
        self.local = local_tensors(source.manifest, rank)
        units = {r: ranked.units for r, ranked in enumerate(held.ranks)}
        backend = select_backend(device)
        rule = setup.refit.summary.scale_alg
        if rule:  # the engine only repacks what a sender converts: the rule its loader has
            backend = backend.with_scale_alg(rule)
        # This rank keeps its share, not the whole plan (gigabytes for a large model):
        # the plan is dropped before the share is opened.
        blob = sender_share(setup.refit, rank, units)
        setup = replace(setup, refit=replace(setup.refit, buckets=()))
        share, layouts = open_share(blob)
        del blob
        self.setup = replace(setup, refit=share)
        self.sender = Sender(share, rank, transport_spec(self.setup, rank).make(), backend, layouts)

    @property
    def manifest_hash(self) -> str:
        return self.setup.manifest_hash

    def send_weights(
        self,
        named_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        step: int,
        *,
        delta_of: int | None = None,
        changed: Collection[str] | None = None,
    ) -> dict[str, Any]:
        """Send this rank's local shards (checkpoint names, as the manifest names them)
        of trainer step ``step`` to every engine rank that needs them. ``delta_of``: the
        step the engine holds; ``changed``: the tensors changed since (the others are not
        sent). Returns what was sent."""
        check_update(step, delta_of, changed)
        params = dict(named_params.items() if isinstance(named_params, Mapping) else named_params)
        check_local(params, self.local, self.rank)
        stats = self.sender.send(params, step, delta_of=delta_of, changed=changed)
        return {
            "rank": self.rank,
            "step": step,
            "bytes_sent": stats.bytes_sent,
            "buckets": stats.buckets,
            "seconds": round(stats.seconds, 6),
            "manifest_hash": self.manifest_hash,
        }

    def close(self) -> None:
        self.sender.transport.close()
