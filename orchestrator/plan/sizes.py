"""Byte sizes as people write them (``80GiB``, ``512 MiB``, ``2GB``, ``1048576``). Pure."""

from __future__ import annotations

import re

from ..errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
    "K": 1024,
    "M": 1024**2,
    "G": 1024**3,
    "T": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, flag: str = "size", *, require_unit: bool = False) -> int:
    """Parse a size; raise UsageError naming ``flag`` when it is not one.

    ``require_unit``: a bare number is refused (the CLI's rule: ``--device-memory 64``
    read as 64 bytes would plan against a device that cannot exist); ``64B`` is bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise UsageError(f"{flag}: {text!r} is not a size (examples: 64GiB, 512MiB, 2GB, 1048576B)")
    number, unit = match.groups()
    if require_unit and not unit:
        raise UsageError(
            f"{flag}: {text!r} has no unit; write {number}GiB (binary), {number}GB "
            f"(decimal) or {number}B (bytes)"
        )
    factor = _UNITS.get(unit.upper())
    if factor is None:
        raise UsageError(
            f"{flag}: unknown unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, KB, MB, GB)"
        )
    value = float(number) * factor
    if value != int(value) and factor == 1:
        raise UsageError(f"{flag}: {text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """Human form with binary units: 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"
