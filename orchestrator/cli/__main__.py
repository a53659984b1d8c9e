"""``python -m mxload.orchestrator.cli``: the same as the ``mxload`` console script."""

from mxload.orchestrator.cli.commands import run

run()
