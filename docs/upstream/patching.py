"""Applying a proposed change (a unified diff beside this file) to an installed module's source, in-process: what
the reproducers here use to run Thunder or litgpt as it is and as changed, side by side."""

from __future__ import annotations

import re


def apply_patch(source: str, diff: str) -> str:
    """``source`` with the unified ``diff``'s hunks applied (each hunk's old lines must be there as they are)."""
    lines = source.splitlines(keepends=True)
    offset = 0
    hunks = re.split(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@.*\n", diff, flags=re.M)
    for start, body in zip(hunks[1::2], hunks[2::2]):
        old = [line[1:] for line in body.splitlines(keepends=True) if line[:1] in (" ", "-")]
        new = [line[1:] for line in body.splitlines(keepends=True) if line[:1] in (" ", "+")]
        at = int(start) - 1 + offset
        if lines[at : at + len(old)] != old:
            raise ValueError(f"the patch does not apply at line {start}: this is not the source it was made for")
        lines[at : at + len(old)] = new
        offset += len(new) - len(old)
    return "".join(lines)
