"""``mxload sessions``: what ``$MXLOAD_HOME`` records, read from its files alone.

The head ``load --detach`` started (``head.json``, ``cluster/local.py``) and each detached
session's record (``sessions/<name>.json``, written by ``records.record_session``: its
head's address and its processes on this machine), each with whether its processes still
run. No Ray call: a stopped or dead head
cannot make the listing wait, and listing starts nothing (docs/contract.md §5).
"""

from __future__ import annotations

import json
from typing import Any

from ...cluster.local import head_down, head_stopped, live_process, mxload_home, read_head_record
from .heads import same_address


def list_sessions() -> dict[str, Any]:
    """The head recorded in ``$MXLOAD_HOME`` (None when none) and every session recorded there:
    ``{"home", "head", "sessions": [{"session", "address", "on_recorded_head",
    "processes", "running"}]}``. A record that is not JSON is listed as unreadable."""
    home = mxload_home()
    record = read_head_record()
    head: dict[str, Any] | None = None
    if record is not None:
        down = head_down(record)
        stopped = [] if down else head_stopped(record)
        head = {
            "address": record.address,
            "started_at": record.started_at,
            "devices": record.num_devices,
            "resource": record.resource,
            "state": "down" if down else "stopped" if stopped else "up",
            "why": down or stopped,
        }
    sessions: list[dict[str, Any]] = []
    for path in sorted((home / "sessions").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            procs = [p for p in data.get("processes") or () if isinstance(p, dict)]
            address = str(data["address"])
            name = str(data.get("session") or path.stem)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            sessions.append({"session": path.stem, "unreadable": str(path)})
            continue
        sessions.append(
            {
                "session": name,
                "address": address,
                "on_recorded_head": record is not None and same_address(address, record.address),
                "processes": len(procs),
                "running": sum(live_process(p) is not None for p in procs),
            }
        )
    return {"home": str(home), "head": head, "sessions": sessions}
