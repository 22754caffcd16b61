"""units: sizes written for people and read from them, against values worked out by hand."""

import pytest

from thunder_fsdp_mem.units import format_bytes, parse_bytes


def test_format_bytes_in_binary_units():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(-512) == "-512 B"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("60GB", 60 * 10**9),
        ("80 gb", 80 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("512", 512),
        ("1e9", 10**9),
        ("4KiB", 4096),
        ("2TB", 2 * 10**12),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["x", "60XB", "-1GB", "GB", "", "nan"])
def test_parse_bytes_refuses_what_is_no_size(text):
    with pytest.raises(ValueError, match="cannot read .* as a size: a number and one of B, KB"):
        parse_bytes(text)
