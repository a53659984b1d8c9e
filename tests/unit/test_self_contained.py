"""The repository stands alone: no tracked file names a path outside it (the check CI runs
first, ``.ci/self_contained.py``), and the check does fail on a file that does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / ".ci" / "self_contained.py"


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=120
    )


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    done = run_check(ROOT)
    assert done.returncode == 0, done.stdout


def test_the_check_fails_on_a_file_that_names_one(tmp_path: Path) -> None:
    outside = "/" + "work/" + "shared/configs/x.json"  # in pieces: this file names none
    sibling = ".." + "/shared/SPEC.md"
    (tmp_path / "ok.md").write_text("nothing here\n")
    (tmp_path / "bad.py").write_text(f"CONFIG = {outside!r}\n")
    (tmp_path / "bad.md").write_text(f"see\n{sibling}\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert "bad.py:1:" in done.stdout and "bad.md:2:" in done.stdout
    assert "ok.md" not in done.stdout
