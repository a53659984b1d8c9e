"""The ``mxload`` command: flags, commands and what they print (``main(argv)`` runs one
command and returns its exit status; ``run`` is the console script)."""

from .commands import main, run

__all__ = ["main", "run"]
