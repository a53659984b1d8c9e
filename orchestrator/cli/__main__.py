"""``python -m mxload.orchestrator.cli``: the same as the ``mxload`` console script."""

import sys

from mxload.orchestrator.cli.commands import main

sys.exit(main())
