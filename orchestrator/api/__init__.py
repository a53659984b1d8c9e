"""mxload's public import surface: the names the README and docs/adoption.md use.

``from mxload import Session, ParallelLayout`` is the documented way in; the modules behind
these names may move between releases, these names do not. Attributes are resolved on first
use, so ``import mxload`` imports neither torch nor Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "ParallelLayout": "mxload.orchestrator.plan.types",
    "Plan": "mxload.orchestrator.plan.types",
    "build_plan": "mxload.orchestrator.plan.planner",
    "open_checkpoint": "mxload.orchestrator.runtime.catalog",
    "load": "mxload.orchestrator.runtime.driver",
    "LoadRequest": "mxload.orchestrator.runtime.request",
    "Session": "mxload.orchestrator.runtime.session",
    "reload_inputs": "mxload.orchestrator.runtime.reload",
    "convert_checkpoint": "mxload.orchestrator.tools.convert",
    "RankLoader": "mxload.workers.rank.loader",
    "MxloadWorkerExtension": "mxload.orchestrator.hosts.engine_ext",
    "EngineReloader": "mxload.orchestrator.hosts.engine_ext",
    "MxloadError": "mxload.orchestrator.errors",
}

__all__ = [
    "EngineReloader",
    "LoadRequest",
    "MxloadError",
    "MxloadWorkerExtension",
    "ParallelLayout",
    "Plan",
    "RankLoader",
    "Session",
    "__version__",
    "build_plan",
    "convert_checkpoint",
    "load",
    "open_checkpoint",
    "reload_inputs",
]

if TYPE_CHECKING:
    from .orchestrator.errors import MxloadError
    from .orchestrator.hosts.engine_ext import EngineReloader, MxloadWorkerExtension
    from .orchestrator.plan.planner import build_plan
    from .orchestrator.plan.types import ParallelLayout, Plan
    from .orchestrator.runtime.catalog import open_checkpoint
    from .orchestrator.runtime.driver import load
    from .orchestrator.runtime.reload import reload_inputs
    from .orchestrator.runtime.request import LoadRequest
    from .orchestrator.runtime.session import Session
    from .orchestrator.tools.convert import convert_checkpoint
    from .workers.rank.loader import RankLoader


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mxload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
