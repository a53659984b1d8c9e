"""The house's floors, read from the production code's own imports (docs/architecture.md).

Inside the package every import is relative, so that tools reading imports see the arrows
between the top folders; and the arrows only run down:

* ``workers/`` is what runs on a rank (storage, numerics, rank loader): it imports the pure
  plan, the errors and ``cluster/``, never the runtime, the CLI, the engine hosts or the
  offline tools;
* ``orchestrator/plan/`` (the pure core) imports no other part of the orchestrator but the
  errors, and nothing of ``workers/`` or ``cluster/``;
* ``cluster/`` (heads, Ray's internals) sits under both: it imports only the errors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("orchestrator", "workers", "cluster")


def package_of(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).parts)
    if parts[:2] == ["orchestrator", "api"]:
        return ["mxload"]
    return ["mxload", *parts[:-1]]


def imports(path: Path) -> list[tuple[int, str, int]]:
    """(line, absolute module named, level) of every import in a file."""
    found: list[tuple[int, str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module or "", 0))
                continue
            base = package_of(path)[: len(package_of(path)) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{module}.{a.name}" for a in node.names]
            found += [(node.lineno, m, node.level) for m in [module, *names]]
    return found


def production_files() -> list[Path]:
    return sorted(p for top in PRODUCTION for p in (ROOT / top).rglob("*.py"))


def test_inside_the_package_imports_are_relative() -> None:
    absolute = [
        f"{p.relative_to(ROOT)}:{line}: {mod}"
        for p in production_files()
        for line, mod, level in imports(p)
        if level == 0 and (mod == "mxload" or mod.startswith("mxload."))
    ]
    assert not absolute, "\n".join(absolute)


FORBIDDEN = {
    "workers": (
        "mxload.orchestrator.runtime",
        "mxload.orchestrator.cli",
        "mxload.orchestrator.hosts",
        "mxload.orchestrator.tools",
    ),
    "cluster": (
        "mxload.orchestrator.plan",
        "mxload.orchestrator.runtime",
        "mxload.orchestrator.cli",
        "mxload.orchestrator.hosts",
        "mxload.orchestrator.tools",
        "mxload.workers",
    ),
    "orchestrator/plan": (
        "mxload.orchestrator.runtime",
        "mxload.orchestrator.cli",
        "mxload.orchestrator.hosts",
        "mxload.orchestrator.tools",
        "mxload.workers",
        "mxload.cluster",
    ),
}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_arrows_run_down(folder: str) -> None:
    wrong = [
        f"{p.relative_to(ROOT)}:{line}: {mod}"
        for p in sorted((ROOT / folder).rglob("*.py"))
        for line, mod, _ in imports(p)
        if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[folder])
    ]
    assert not wrong, "\n".join(wrong)
