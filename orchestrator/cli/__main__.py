"""``python -m mxload.orchestrator.cli``: the same as the ``mxload`` console script."""

from .commands import run

run()
