"""Byte formatting: binary units (GiB = 2**30), used by every renderer. Bytes stay ``int`` until here."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: int, precision: int = 2) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``; negative values keep their sign."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    unit = _UNITS[0]
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.{precision}f} {unit}"
