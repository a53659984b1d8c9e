#!/usr/bin/env bash
# The built wheel works on its own: build it, install it into a fresh venv outside the
# repository (torch pinned to the CPU wheel first, as the README says; in CI, with the
# test venv's dependencies shared instead: MXLOAD_WHEEL_DEPS_FROM), check that it carries
# its package data, and run `mxload demo` from a folder outside the repository.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/mxload-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
if [ -n "${MXLOAD_WHEEL_DEPS_FROM:-}" ]; then
  # CI: the dependencies the test venv already resolved from the same pyproject are
  # shared through a .pth (its .pth files, the editable mxload's among them, are not
  # processed from there). The fresh venv has no pip or setuptools of its own (they
  # would shadow the shared ones); the test venv's pip installs the wheel into it
  # without dependencies, and pip check proves that what the wheel declares is met.
  # Saves installing torch and Ray a second time.
  python3 -m venv --without-pip "$work/venv"
  site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$MXLOAD_WHEEL_DEPS_FROM" > "$site/zz-ci-shared-deps.pth"
  pip=(python -m pip --python "$work/venv/bin/python")
  python -m pip wheel -q --no-deps "$repo" -w "$work/dist"
  "${pip[@]}" install -q --no-deps "$work"/dist/mxload-*.whl
  "${pip[@]}" check
  "$work/venv/bin/python" -c 'import sys, mxload.orchestrator.cli.commands as m; assert m.__file__.startswith(sys.prefix), m.__file__'
else
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install -q torch==2.13.0
  "$work/venv/bin/pip" wheel -q --no-deps "$repo" -w "$work/dist"
  "$work/venv/bin/pip" install -q "$work"/dist/mxload-*.whl
fi
cd "$work"
"$work/venv/bin/python" - "$repo" <<'PY'
import glob, pathlib, sys, zipfile
repo = pathlib.Path(sys.argv[1])
names = set(zipfile.ZipFile(glob.glob("dist/mxload-*.whl")[0]).namelist())
data = [f"mxload/orchestrator/configs/{p.name}" for p in (repo / "orchestrator/configs").glob("*.json")]
data += [f"mxload/cluster/{p.name}" for p in (repo / "cluster").iterdir() if p.suffix in (".yaml", ".sh", ".md")]
missing = sorted(set(data) - names)
assert len(data) >= 6 and not missing, f"package data missing from the wheel: {missing}"
print(f"wheel: {len(names)} files, all {len(data)} package-data files present")
PY
"$work/venv/bin/mxload" plan --model deepseek-v3 --tp 8 --dp 32 --enable-expert-parallel --device-memory 64GiB >/dev/null
"$work/venv/bin/mxload" demo
