"""The ``mxload`` command: flags, commands and what they print (``main`` is the entry point)."""

from mxload.orchestrator.cli.commands import main

__all__ = ["main"]
