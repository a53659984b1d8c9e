"""The release table against each release's own start-up check.

vLLM refuses, before loading anything, a checkpoint whose quantization method the
platform does not list: ``ModelConfig._verify_quantization`` calls
``current_platform.verify_quantization(method)``, and on Ascend the platform is
vllm-ascend's ``NPUPlatform``. So, for every release in
:data:`mxload.orchestrator.plan.releases.RELEASES` with a version on the index, this test
downloads its sdist, imports its real ``vllm_ascend/platform.py`` on top of vLLM's real
``Platform`` (``vllm/platforms/interface.py`` from the wheel the release builds on: 0.23.0
for 0.23.0.post1, 0.30.0 for the 0.27.1rc1-0.30.0rc2 pre-releases, whose
``verify_quantization`` is the same four lines), and asks ``NPUPlatform.verify_quantization``
about the method each ``mxload convert --format`` output is dispatched to.

Stand-ins (platform.py's other imports are used only inside its methods, never by the
class body or ``verify_quantization``): ``vllm.envs``, ``vllm.logger``,
``vllm.v1.attention.backends.registry``, ``vllm_ascend.ascend_config``,
``vllm_ascend.device.hardware_profile`` — empty named modules; ``vllm_ascend.utils`` —
its own module-level string constants (``ASCEND_QUANTIZATION_METHOD = "ascend"``, ...)
read from the release's ``utils.py``, which imports torch_npu.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from mxload.orchestrator.errors import UsageError
from mxload.orchestrator.plan.engines import engine_profile
from mxload.orchestrator.plan.releases import (
    FORMATS,
    QUANTIZATION_OF_FORMAT,
    RELEASES,
    release_of_version,
)

from tests.engine import sources
from tests.engine.sources import QuietLogger, Stub, constants, load_module, modules, package

DOWNLOADED = [r for r in RELEASES.values() if r.versions]
VLLM_OF = {"0.23.0": "0.23.0"}
"""vLLM wheel whose ``Platform`` each release's platform is loaded on (else 0.30.0)."""


def _stub_tree(names: list[str], given: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in [*names, *given]:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            n = ".".join(parts[:i])
            if n not in out:
                out[n] = given.get(n) or Stub(n, Path("/nonexistent") if i < len(parts) else None)
    return out


def vllm_interface(vllm_root: Path) -> Any:
    """vLLM's ``vllm/platforms/interface.py`` (``Platform``), run for real."""
    interface_stubs = _stub_tree(
        ["vllm.logger", "vllm.v1.attention.backends.registry"],
        {"vllm.logger": Stub("vllm.logger", init_logger=lambda name: QuietLogger())},
    )
    with modules(interface_stubs):
        return load_module(
            "vllm.platforms.interface", vllm_root / "vllm" / "platforms" / "interface.py"
        )


def npu_platform(va_root: Path, interface: Any) -> Any:
    """vllm-ascend's NPUPlatform class, its module run for real (stubs in the doc)."""
    env = dict(os.environ)  # platform.py sets a variable at import
    try:
        pkg = va_root / "vllm_ascend"
        given = {
            "vllm.logger": Stub("vllm.logger", logger=QuietLogger()),
            "vllm.platforms": Stub(
                "vllm.platforms",
                Path("/nonexistent"),
                Platform=interface.Platform,
                PlatformEnum=interface.PlatformEnum,
                interface=interface,
            ),
            "vllm_ascend": package("vllm_ascend", pkg),
            "vllm_ascend.utils": Stub("vllm_ascend.utils", **constants(pkg / "utils.py")),
        }
        stubs = _stub_tree(
            [
                "vllm.envs",
                "vllm.platforms.interface",
                "vllm.v1.attention.backends.registry",
                "vllm_ascend.ascend_config",
                "vllm_ascend.utils",
                "vllm_ascend.device.hardware_profile",
            ],
            {**given, "vllm.platforms.interface": interface},
        )
        with modules(stubs):
            platform = load_module("vllm_ascend.platform", pkg / "platform.py")
            assert Path(platform.__file__).resolve() == (pkg / "platform.py").resolve()
            return platform.NPUPlatform
    finally:
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture(scope="module")
def platforms() -> dict[str, Any]:
    out, interfaces = {}, {}
    for r in DOWNLOADED:
        va = sources.vllm_ascend_sdist(r.versions[-1])
        v = VLLM_OF.get(r.vllm, "0.30.0")
        if v not in interfaces:
            interfaces[v] = vllm_interface(sources.vllm_wheel(v))
        out[r.name] = npu_platform(va, interfaces[v])
    return out


@pytest.mark.parametrize("name", [r.name for r in DOWNLOADED])
def test_each_release_accepts_what_the_table_says(name: str, platforms: dict[str, Any]) -> None:
    release = RELEASES[name]
    npu = platforms[name]
    # The table's list is the platform's own.
    assert tuple(npu.supported_quantization) == release.quantizations
    for fmt in FORMATS:
        method = QUANTIZATION_OF_FORMAT[fmt]
        try:
            npu.verify_quantization(method)
            accepted = True
        except ValueError as err:
            assert "not supported" in str(err)
            accepted = False
        assert accepted == (fmt in release.formats), f"{name}: --format {fmt} ({method})"


def test_the_stable_release_refuses_modelopt_and_serves_ascend(platforms: dict[str, Any]) -> None:
    npu = platforms["vllm-ascend-0.23.0.post1"]
    with pytest.raises(ValueError, match="modelopt_mxfp8 quantization is currently not supported"):
        npu.verify_quantization("modelopt_mxfp8")
    npu.verify_quantization("ascend")


def test_release_names_and_versions() -> None:
    # Release names work as --engine and plan with their profile.
    assert engine_profile("vllm-ascend-0.23.0.post1").name == "vllm-ascend-0.23"
    assert engine_profile("vllm-ascend-0.30.0rc2").name == "vllm-ascend-main"
    assert release_of_version("0.23.0.post1").name == "vllm-ascend-0.23.0.post1"
    assert release_of_version("0.28.0rc1").name == "vllm-ascend-0.28.0rc1"
    # An unread release is refused in one line, listing the known ones.
    with pytest.raises(UsageError) as err:
        release_of_version("0.25.1rc1")
    msg = str(err.value)
    assert "\n" not in msg and "0.25.1rc1" in msg and "0.23.0.post1" in msg and "0.30.0rc2" in msg
    with pytest.raises(UsageError, match=r"--engine 'vllm-ascend-0.26'.*vllm-ascend-0.27.1rc1"):
        engine_profile("vllm-ascend-0.26")
