"""Fail when a tracked file names a path outside the repository.

Why: the repository must stand alone. A test, benchmark or document that names a folder
of the machine it was written on (an absolute workspace path, a sibling folder reached
with ``..``) passes there and fails, or misleads, on every clone.

Usage: ``python .ci/self_contained.py [ROOT]`` (default: the repository holding this
file). Lists every offending ``file:line`` and exits 1; exits 0 when there is none.
Limits: checks the files git tracks (``git ls-files``), so it needs a git checkout; it
looks for the patterns below, not for every conceivable outside path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Written in pieces so this file does not name them itself.
PATTERNS = (b"/" + b"work/", b"../" + b"shared")


def offenders(root: Path) -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = root / name.decode()
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
            if any(p in line for p in PATTERNS):
                found.append(f"{name.decode()}:{lineno}: {line.decode(errors='replace')[:160]}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    found = offenders(root)
    for line in found:
        print(line)
    if found:
        print(f"self-contained check: {len(found)} line(s) name a path outside the repository")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
