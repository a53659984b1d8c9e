"""What a session holds, typed: its plan, the identity of its version, every buffer's
address as first loaded, its ranks' processes; and the verdict over what the ranks
report (docs/contract.md §4 "Reload").

One :class:`SessionState` serves every host of a session: the in-process ``Session``
keeps it as an attribute, a detached session's keeper actor holds it (and its record in
the GCS, without credentials: :meth:`SessionState.without_credentials`),
an engine extension's ``Attachment`` keeps the one rank it hosts. It becomes JSON only
in a manifest (:meth:`ReloadRecord.to_json`, :func:`verdict`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..plan.types import Plan

if TYPE_CHECKING:
    from .request import LoadRequest

Report = dict[str, Any]
"""A rank's report as its worker sends it: a manifest entry (docs/contract.md §5) in the
making. The keys read here: ``rank``, ``pid``, ``tensors`` (name -> ``data_ptr``,
``checksum``), ``identity``, ``units``, ``restarts``, ``addresses_changed``."""


Progress = Callable[[list[tuple[int, int, int]]], None]
"""Called while ranks run with each rank's (units done, units, bytes read)."""


def addresses_of(report: Report) -> dict[str, int]:
    """Buffer name -> data_ptr, from a rank's report."""
    return {n: int(t["data_ptr"]) for n, t in report["tensors"].items()}


@dataclass(frozen=True)
class ReloadRecord:
    """How the last reload of a session ended (``status`` says when it failed)."""

    src: str
    version: int
    fingerprint: str
    ok: bool
    error: str = ""
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LeaseHolder:
    """A command that holds (or asks for) a session's lease: its process, told from a
    later one with the same pid (``cluster.local.process_identity``), and what it runs."""

    token: str
    pid: int
    created: float
    host: str
    what: str
    src: str = ""
    start_ticks: int | None = None

    def process(self) -> dict[str, Any]:
        """The process as ``cluster.local.same_process`` compares it."""
        return {"pid": self.pid, "created": self.created, "start_ticks": self.start_ticks}


@dataclass(frozen=True)
class Lease:
    """A session's lease: one holder at a time, until it is released or expires."""

    holder: LeaseHolder
    since: float
    expires: float
    took_over_from: LeaseHolder | None = None
    """The holder whose lease this one took over (its process gone, or it expired)."""
    fence: int = 0
    """Fencing token: each lease of a session gets a larger one; ranks refuse writes
    from a smaller one, the keeper refuses its state (docs/contract.md §4)."""

    def to_json(self) -> dict[str, Any]:
        h = self.holder
        out: dict[str, Any] = {
            "what": h.what,
            "src": h.src,
            "pid": h.pid,
            "host": h.host,
            "since": self.since,
            "expires": self.expires,
        }
        if self.took_over_from is not None:
            t = self.took_over_from
            out["took_over_from"] = {"what": t.what, "src": t.src, "pid": t.pid, "host": t.host}
        return out


@dataclass
class SessionState:
    """A session's state, wherever it lives (see the module docstring)."""

    plan: Plan
    src: str
    """Where the session's current version was read from."""
    fingerprint: str
    """Fingerprint of that checkpoint (``catalog.fingerprint``): with ``version``, the
    identity every unit of every rank must hold."""
    addresses: dict[int, dict[str, int]]
    """rank -> buffer -> data_ptr: what captured graphs point at (re-recorded for a rank
    whose process was restarted)."""
    pids: dict[int, int | None]
    """rank -> the pid of the process holding its buffers."""
    version: int = 1
    identity_basis: str = ""
    """How the fingerprint was established (``CheckpointMeta.identity``): ``status``
    says it, and "unverified: ..." when nothing vouches for the bytes."""
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """Never shown (no repr): it holds credentials (a detached session's keeper holds
    only mxload's own keys)."""
    restarted: set[int] = field(default_factory=set)
    """Ranks whose process was lost and restarted since the first load: their buffers
    are at new addresses."""
    last_reload: ReloadRecord | None = None
    request: LoadRequest | None = None
    """The load request (a detached session starts its run from it)."""
    session: str = ""
    """The detached session's name ("" in-process)."""
    started_head: bool = False
    """Whether the detached load started the Ray head (release stops it with the last
    session)."""
    created: float = field(default_factory=time.time)

    @classmethod
    def from_reports(
        cls, plan: Plan, reports: Sequence[Report], *, src: str, fingerprint: str, **kw: Any
    ) -> SessionState:
        """The state after a first load, from its ranks' reports."""
        return cls(
            plan=plan,
            src=src,
            fingerprint=fingerprint,
            addresses={r["rank"]: addresses_of(r) for r in reports},
            pids={r["rank"]: r.get("pid") for r in reports},
            **kw,
        )

    @property
    def identity(self) -> tuple[int, str]:
        return self.version, self.fingerprint

    def without_credentials(self) -> SessionState:
        """This state with only mxload's own storage options (timeouts, the links
        switch: no secrets), in itself and its request: what a detached session's keeper
        holds and stores (docs/contract.md §4 "Credentials")."""
        req = self.request
        return replace(
            self,
            storage_options=own_options(self.storage_options),
            request=replace(req, storage_options=own_options(req.storage_options))
            if req is not None
            else None,
        )

    def with_credentials(self, options: Mapping[str, Any] | None) -> SessionState:
        """This state with the caller's storage ``options`` (kept outside the keeper)
        added to mxload's own, in itself and its request; unchanged for None."""
        if not options:
            return self
        merged = {**(self.storage_options or {}), **options}
        req = self.request
        return replace(
            self,
            storage_options=merged,
            request=replace(req, storage_options=merged) if req is not None else None,
        )

    def lost(self, rank: int, pid: int | None) -> bool:
        """Whether ``rank``'s process is not the recorded one (None: it does not answer)."""
        return pid is None or pid != self.pids.get(rank)

    def observe(self, reports: Sequence[Report]) -> list[int]:
        """Count restarts: a rank whose report comes from another process than the one
        recorded (or whose run lost its process) was restarted, with new buffers. Records
        its pid and addresses, and marks every report: ``restarts`` at least 1 for a rank
        restarted now, ``addresses_changed`` for any rank restarted since the first load.
        Returns the ranks restarted now."""
        now = []
        for rep in reports:
            rank = int(rep["rank"])
            if rep.get("restarts", 0) > 0 or self.lost(rank, rep.get("pid")):
                now.append(rank)
                rep["restarts"] = max(int(rep.get("restarts", 0)), 1)
                self.pids[rank] = rep.get("pid")
                self.addresses[rank] = addresses_of(rep)
                self.restarted.add(rank)
            rep["addresses_changed"] = rank in self.restarted
        return now

    def moved(self, reports: Sequence[Report]) -> list[str]:
        """``rank N: buffer`` for every buffer not at its recorded address. A restarted
        rank is not asked: its buffers are new, and it says so (``addresses_changed``)."""
        out = []
        for rep in reports:
            if rep.get("addresses_changed"):
                continue
            first = self.addresses.get(int(rep["rank"]), {})
            out += [
                f"rank {rep['rank']}: {n}"
                for n, ptr in addresses_of(rep).items()
                if first.get(n) not in (None, ptr)
            ]
        return out


def own_options(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """mxload's own keys of ``options`` (``storage.options.MXLOAD_OPTIONS``), None if none."""
    from ...workers.storage.options import MXLOAD_OPTIONS

    own = {k: v for k, v in (options or {}).items() if k in MXLOAD_OPTIONS}
    return own or None


def caller_options(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The caller's keys of ``options`` (credentials, endpoints), None if none."""
    from ...workers.storage.options import MXLOAD_OPTIONS

    theirs = {k: v for k, v in (options or {}).items() if k not in MXLOAD_OPTIONS}
    return theirs or None


def verdict(state: SessionState, manifest: dict[str, Any], *, busy: Lease | None = None) -> None:
    """Decide, from what the ranks report, whether the session holds one checkpoint, and
    say why not (docs/contract.md §4). Sets ``consistent``, ``problems`` (each a reason it
    is not), ``notices`` (true but not inconsistent: restarted ranks, a failed reload
    that wrote nothing), ``identity``, ``addresses_moved``, ``replicated_tensors_agree``
    and ``replica_mismatches``. ``busy``: the holder of a running reload's lease."""
    want = state.identity
    problems: list[str] = []
    notices: list[str] = []
    held: dict[tuple[int, str], list[int]] = {}
    for r in manifest["ranks"]:
        ident = r.get("identity")
        if ident is None:
            by = (r.get("units") or {}).get("units_by_identity", {})
            mix = ", ".join(f"{n} at version {_short(k)}" for k, n in by.items())
            problems.append(f"rank {r['rank']}: its units hold different versions ({mix})")
            continue
        held.setdefault((int(ident[0]), str(ident[1])), []).append(r["rank"])
    if len(held) > 1:
        parts = [
            f"ranks {_ranks(rs)} at version {v} of checkpoint {fp[:12]}"
            for (v, fp), rs in sorted(held.items())
        ]
        problems.append("ranks hold different checkpoints: " + "; ".join(parts))
    for (v, fp), rs in sorted(held.items()):
        if (v, fp) != want:
            problems.append(
                f"ranks {_ranks(rs)} hold version {v} of checkpoint {fp[:12]}, not the "
                f"session's version {want[0]} of {state.src} ({want[1][:12]})"
            )
    mismatches = replica_mismatches(state.plan, manifest)
    manifest["replicated_tensors_agree"] = not mismatches
    manifest["replica_mismatches"] = mismatches[:50]
    if mismatches:
        problems.append(
            f"{len(mismatches)} replicated buffer(s) differ between ranks that must hold the "
            f"same bytes, e.g. {mismatches[0]}"
        )
    for r in manifest["ranks"]:
        if r.get("addresses_changed"):
            notices.append(
                f"rank {r['rank']} was lost and restarted (pid now {r.get('pid')}): its "
                "buffers are at new addresses; graphs captured on that device must be recaptured"
            )
    moved = state.moved(manifest["ranks"])
    manifest["addresses_moved"] = moved
    if moved:
        problems.append(f"{len(moved)} buffer(s) moved: {', '.join(moved[:5])}")
    if manifest.get("repaired_ranks"):
        notices.append(
            f"ranks {_ranks(manifest['repaired_ranks'])} were reloaded by this status call "
            f"after a restart, from {state.src}"
        )
    if busy is not None:
        h = busy.holder
        problems.append(
            f"a reload is running: {h.what} from {h.src or '-'} by pid {h.pid} on {h.host}"
        )
    last = state.last_reload
    if last is not None and not last.ok:
        notices.append(f"the last reload, from {last.src}, failed: {last.error}")
    if state.identity_basis.startswith("unverified"):
        notices.append(
            f"the identity of {state.src} is {state.identity_basis}: consistent means every "
            "unit was written by the session's last reload, not that the bytes are the "
            "store's now"
        )
    manifest["identity"] = {
        "version": want[0],
        "fingerprint": want[1],
        "src": state.src,
        "established_by": state.identity_basis or "not recorded",
    }
    manifest["consistent"] = not problems
    manifest["problems"] = problems
    manifest["notices"] = notices


def _short(key: str) -> str:
    v, _, fp = key.partition(":")
    return f"{v} of {fp[:12] or 'nothing'}" if v != "0" else "none (never written whole)"


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def replica_mismatches(plan: Plan, manifest: Mapping[str, Any]) -> list[str]:
    """Buffers that ranks should hold byte for byte alike (the same buffer filled from the
    same slices of the checkpoint: dp replicas of attention, the norms, experts replicated
    without EP) but whose checksums differ: a check on the bytes themselves, independent
    of the version bookkeeping."""
    groups: dict[tuple[Any, ...], list[tuple[int, str]]] = {}
    for rp, r in zip(plan.ranks, manifest["ranks"], strict=True):
        units: dict[str, list[tuple[Any, ...]]] = {}
        for u in rp.units:
            units.setdefault(u.buffer, []).append(
                (
                    u.global_expert,
                    u.row0,
                    u.rows,
                    u.cols,
                    tuple((p.tensor_name, p.rows, p.cols, p.dst_row) for p in u.parts),
                )
            )
        for name, keys in units.items():
            for buf in (name, name + "_scale"):
                t = r["tensors"].get(buf)
                if t is not None:
                    groups.setdefault((buf, tuple(keys)), []).append((r["rank"], t["checksum"]))
    out = []
    for (buf, _), held in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len({c for _, c in held}) > 1:
            out.append(
                f"{buf} on ranks {_ranks([r for r, _ in held])}: "
                + ", ".join(f"rank {r} {c[:8]}" for r, c in held)
            )
    return out
