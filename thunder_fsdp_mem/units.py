"""Bytes for people: ``format_bytes`` renders them in binary units (GiB = 2**30), for every renderer (bytes stay
``int`` until here); ``parse_bytes`` reads a size a person typed (``60GB``, ``55.5GiB``, ``1e9``)."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def unit_of(nbytes: int) -> tuple[str, int]:
    """The unit ``format_bytes`` writes ``nbytes`` in, and its size: ``unit_of(3 * 2**30) == ("GiB", 2**30)``."""
    value, size = abs(nbytes), 1
    for unit in _UNITS:
        if value < 1024 * size or unit == _UNITS[-1]:
            return unit, size
        size *= 1024
    raise AssertionError("unreachable")


def format_bytes(nbytes: int, precision: int = 2) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``; negative values keep their sign."""
    unit, size = unit_of(nbytes)
    sign = "-" if nbytes < 0 else ""
    if unit == "B":
        return f"{sign}{abs(nbytes)} B"
    return f"{sign}{abs(nbytes) / size:.{precision}f} {unit}"


_PARSED = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(text: str) -> int:
    """``parse_bytes("60GB") == 60 * 10**9``, ``parse_bytes("1.5GiB") == 3 * 2**29``: a number, then an optional
    unit (B, KB, MB, GB, TB in powers of 10; KiB, MiB, GiB, TiB in powers of 2; case does not matter). Raises
    ValueError naming the text and the units known."""
    stripped = text.strip()
    number = stripped.rstrip("BbIiKkMmGgTt")
    unit = stripped[len(number) :].strip().upper()
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if unit not in _PARSED or not value == value or value < 0:  # nan fails the comparison with itself
        raise ValueError(
            f"cannot read {text!r} as a size: a number and one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (60GB, 55.5GiB)"
        )
    return round(value * _PARSED[unit])
