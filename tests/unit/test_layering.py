"""The house's floors, read from the production code's own imports (docs/architecture.md).

Inside the package every import is relative, so that tools reading imports see the arrows
between the top folders; and the arrows only run down:

* ``workers/`` is what runs on a rank (storage, numerics, rank loader): it imports the pure
  plan, the errors and ``cluster/``, never the runtime, the CLI, the engine hosts or the
  offline tools;
* ``orchestrator/plan/`` (the pure core) imports no other part of the orchestrator but the
  errors, and nothing of ``workers/`` or ``cluster/``;
* ``cluster/`` (heads, Ray's internals) sits under both: it imports only the errors;
* no two production modules import each other, directly or around a longer circle.
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


def module_file(name: str) -> Path | None:
    """The production file an absolute module name is, if it is one."""
    parts = name.split(".")
    if parts[0] != "mxload":
        return None
    for base in (ROOT.joinpath(*parts[1:]), ROOT.joinpath("orchestrator", "api", *parts[1:])):
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if parts[1:] and candidate.is_file():
                return candidate
    return ROOT / "orchestrator" / "api" / "__init__.py" if parts == ["mxload"] else None


def arrows(path: Path) -> set[Path]:
    """The production files ``path`` imports: ``from PKG import name`` is the module
    ``PKG.name`` where that is one, else ``PKG`` itself."""
    out: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [module_file(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(path)[: len(package_of(path)) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [module_file(f"{module}.{a.name}") or module_file(module) for a in node.names]
        else:
            continue
        out |= {t for t in targets if t is not None and t != path}
    return out


def test_no_two_modules_import_each_other() -> None:
    """No circle of imports between production modules, however long (each one found is
    named with its files)."""
    graph = {p: arrows(p) for p in production_files()}
    circles = []
    state: dict[Path, int] = {}  # 1: on the current path, 2: done
    path: list[Path] = []

    def walk(p: Path) -> None:
        state[p] = 1
        path.append(p)
        for q in sorted(graph[p]):
            if state.get(q) == 1:
                circles.append(" -> ".join(str(f.relative_to(ROOT)) for f in path[path.index(q) :]))
            elif q not in state:
                walk(q)
        path.pop()
        state[p] = 2

    for p in sorted(graph):
        if p not in state:
            walk(p)
    assert not circles, "\n".join(circles)
