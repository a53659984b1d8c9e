"""Run ``mypy --strict`` over every production module, as the installed ``mxload`` package.

The repository keeps ``orchestrator/``, ``workers/`` and ``cluster/`` at its top level, while
the code imports them as ``mxload.orchestrator`` and so on (pyproject's package-dir). mypy
has no package-dir setting, so this builds the installed shape as a tree of symbolic links
under ``build/typecheck/`` and checks that: every ``mxload.*`` import then resolves to the
repository's own files. Exit status is mypy's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"


def link_tree() -> Path:
    shutil.rmtree(TREE, ignore_errors=True)
    pkg = TREE / "mxload"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").symlink_to(ROOT / "orchestrator" / "api" / "__init__.py")
    (pkg / "py.typed").write_text("")
    for name in ("orchestrator", "workers", "cluster"):
        (pkg / name).symlink_to(ROOT / name, target_is_directory=True)
    return pkg


def main() -> int:
    pkg = link_tree()
    args = ["--config-file", str(ROOT / "pyproject.toml"), str(pkg)]
    out, err, status = api.run([*args, *sys.argv[1:]])
    sys.stdout.write(
        out.replace("build/typecheck/mxload/", "").replace(str(TREE / "mxload") + "/", "")
    )
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main())
