"""The engines' real sources, downloaded at test time into a cache outside the repository,
and loaded on CPU with named stand-ins for what cannot import here.

* :func:`vllm_ascend_sdist` — ``pip download --no-deps`` of a vllm-ascend sdist (releases
  and pre-releases), its ``vllm_ascend/`` unpacked;
* :func:`vllm_wheel` — ``pip download --no-deps vllm==X``, its Python files unpacked;
* :func:`load_module` — import one file of those trees under its own module name, with
  ``stubs`` in ``sys.modules`` for the duration (each stub a named module), undone after.

Cache: ``$MXLOAD_TEST_CACHE`` or ``~/.cache/mxload-tests``. A test skips, saying so, only
when the package index cannot be reached; any other failure fails it. Nothing of the
engines is copied into the project.
"""

from __future__ import annotations

import abc
import ast
import fcntl
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

_NETWORK_SIGNS = (
    "NewConnectionError",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Max retries exceeded",
    "ConnectionError",
    "Could not find a version that satisfies",
    "No matching distribution",
    "timed out",
)


def cache_root() -> Path:
    base = os.environ.get("MXLOAD_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mxload-tests"
    )
    return Path(base)


def _pip_download(spec: str, dest: Path, env: Mapping[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--pre", spec, "-d", str(dest)]
    if env is not None:
        cmd.insert(5, "--no-build-isolation")
    try:
        done = subprocess.run(
            cmd, env=dict(env or os.environ), capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {spec}: the package index did not answer in 240 s")
    out = done.stdout + done.stderr
    if done.returncode != 0:
        if any(sign in out for sign in _NETWORK_SIGNS):
            pytest.skip(f"the package index cannot be reached: {out.strip().splitlines()[-1]}")
        pytest.fail(f"pip download {spec} failed:\n{out[-3000:]}")


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One download into ``cache`` at a time (pytest-xdist workers share the cache)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def vllm_ascend_sdist(version: str) -> Path:
    """The unpacked sdist's root (``<root>/vllm_ascend/...``)."""
    cache = cache_root() / f"vllm-ascend-{version}"
    root = cache / f"vllm_ascend-{version}"
    if (root / "vllm_ascend" / "platform.py").is_file():
        return root
    with _locked(cache):
        return _fetch_sdist(version, cache, root)


def _fetch_sdist(version: str, cache: Path, root: Path) -> Path:
    if (root / "vllm_ascend" / "platform.py").is_file():
        return root
    archive = cache / f"vllm_ascend-{version}.tar.gz"
    if not archive.is_file():
        # pip prepares an sdist's metadata before saving it; vllm-ascend's isolated build
        # needs torch, torch_npu and cmake (GBs). Without isolation its setup.py needs only
        # setuptools_scm (for the version, which we know) and a SOC_VERSION: a four-line
        # stand-in for setuptools_scm on PYTHONPATH, for pip's subprocess only.
        with tempfile.TemporaryDirectory() as shim:
            (Path(shim) / "setuptools_scm").mkdir()
            (Path(shim) / "setuptools_scm" / "__init__.py").write_text(
                "import os\n\ndef get_version(**kwargs):\n"
                "    return os.environ['SETUPTOOLS_SCM_PRETEND_VERSION']\n"
            )
            env = dict(
                os.environ,
                PYTHONPATH=shim,
                SETUPTOOLS_SCM_PRETEND_VERSION=version,
                SOC_VERSION="ascend950",
                COMPILE_CUSTOM_KERNELS="0",
            )
            _pip_download(f"vllm-ascend=={version}", cache, env)
    prefix = f"vllm_ascend-{version}/vllm_ascend/"
    with tempfile.TemporaryDirectory(dir=cache) as tmp, tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(tmp, members=members, filter="data")
        try:  # another test process may have unpacked it meanwhile: either copy is whole
            os.rename(Path(tmp) / f"vllm_ascend-{version}", root)
        except OSError:
            pass
    assert (root / "vllm_ascend" / "platform.py").is_file()
    return root


def vllm_wheel(version: str) -> Path:
    """The root holding the wheel's ``vllm/`` Python files."""
    cache = cache_root() / f"vllm-{version}"
    root = cache / "py"
    if (root / "vllm" / "__init__.py").is_file():
        return root
    with _locked(cache):
        return _fetch_wheel(version, cache, root)


def _fetch_wheel(version: str, cache: Path, root: Path) -> Path:
    if (root / "vllm" / "__init__.py").is_file():
        return root
    wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        _pip_download(f"vllm=={version}", cache)
        wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    with tempfile.TemporaryDirectory(dir=cache) as tmp, zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(tmp, members=[m for m in z.namelist() if m.endswith(".py")])
        try:
            os.rename(tmp, root)
            os.mkdir(tmp)  # for TemporaryDirectory's cleanup
        except OSError:
            pass
    assert (root / "vllm" / "__init__.py").is_file()
    return root


class _Placeholder(abc.ABCMeta):
    """Metaclass of placeholders: any attribute of the class is another placeholder (an
    ABCMeta, so that a class may derive from a placeholder and ABC together)."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(attr, cls.__module__)()


def _placeholder(name: str, module: str) -> type:
    """A class named ``name`` that takes any arguments, returns its first when called as a
    decorator, and answers any attribute (of the class or an instance) with another
    placeholder: what module-level code does with an imported name (subclass, annotate,
    decorate, build a constant) works, and nothing of it can compute anything."""

    def __getattr__(self: Any, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(attr, module)()

    return _Placeholder(
        name,
        (),
        {
            "__module__": module,
            "__init__": lambda self, *a, **k: None,
            "__call__": lambda self, *a, **k: a[0] if a else None,
            "__getattr__": __getattr__,
        },
    )


class Stub(types.ModuleType):
    """A named stand-in module: the attributes given, and for any other name asked of it a
    placeholder class of that name (imported, subclassed or annotated with, never run by
    the code under test)."""

    def __init__(self, name: str, path: Path | None = None, **attrs: Any) -> None:
        super().__init__(name)
        if path is not None:
            self.__path__ = [str(path)]
        self.__dict__.update(attrs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        placeholder = _placeholder(attr, self.__name__)
        setattr(self, attr, placeholder)
        return placeholder


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return Stub(spec.name, Path("/nonexistent"))

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: set[str], real: Mapping[str, Path]) -> None:
        self.roots, self.real = roots, real

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] not in self.roots:
            return None
        if name in self.real:
            return importlib.util.spec_from_file_location(name, self.real[name])
        return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)


@contextmanager
def stubbed_packages(
    roots: set[str],
    real: Mapping[str, Path],
    given: Mapping[str, types.ModuleType] | None = None,
) -> Iterator[None]:
    """While active, importing any module under ``roots`` gives a :class:`Stub`, except
    the modules named in ``real``, which load from their files (the engine's own code),
    and those ``given``; everything imported under ``roots`` meanwhile is dropped after."""
    finder = _StubFinder(roots, real)
    before = set(sys.modules)
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in roots}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(given or {})
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for k in set(sys.modules) - before | set(given or {}):
            if k.split(".")[0] in roots:
                sys.modules.pop(k, None)
        sys.modules.update(saved)


class QuietLogger:
    """Stand-in for vLLM's logger (``info_once``, ``warning_once``, ... beside logging's)."""

    def __getattr__(self, attr: str) -> Any:
        return lambda *a, **k: None


def package(name: str, path: Path) -> types.ModuleType:
    """A package whose submodules load from ``path`` without running its ``__init__``."""
    m = types.ModuleType(name)
    m.__path__ = [str(path)]
    return m


def constants(path: Path) -> dict[str, Any]:
    """The module-level literal constants (``NAME = "..."``) of a source file, as written."""
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


@contextmanager
def modules(stubs: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """``stubs`` in ``sys.modules``; every module of their top-level packages imported
    meanwhile is dropped after (the standard library's, imported once, stay)."""
    roots = {k.split(".")[0] for k in stubs}
    before = set(sys.modules)
    saved = {k: sys.modules[k] for k in stubs if k in sys.modules}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for k in set(sys.modules) - before:
            if k.split(".")[0] in roots:
                del sys.modules[k]
        for k in stubs:
            if k not in saved:
                sys.modules.pop(k, None)
        sys.modules.update(saved)


def load_module(name: str, path: Path) -> types.ModuleType:
    """Import ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
