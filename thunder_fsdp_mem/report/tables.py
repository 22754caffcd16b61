"""The rich tables the text renderings share: ``table(first, *others)``, a table of named rows and right-aligned
figures, and ``top_table(top, width)``, the largest allocations at the peak fitted to a terminal's width without
cutting a figure. ``short_source`` shortens a source line to its last two path parts."""

from __future__ import annotations

import os

from thunder_fsdp_mem.report.contents import TopAllocation
from thunder_fsdp_mem.units import format_bytes

# The top allocations' columns, and the order in which a narrow terminal leaves them out: a column is shown whole
# or not at all, so no figure, shape or source line is ever cut; a name too long is shortened in the middle.
_TOP_HEADERS = ("name", "count", "shape", "dtype", "size each", "total", "category", "symbol", "source", "trace name")
_LEFT_OUT_FIRST = ("trace name", "source", "symbol", "category", "dtype", "shape")
_NAME_WIDTH = 32  # the least width of the name column: other columns are left out before it is narrower
GAP = 3  # between two columns: a space of padding on each side of a space of border


def table(first: str, *others: str):
    """A table whose first column names the rows (folding onto more lines where the width is short) and whose
    other columns are right-aligned figures, never wrapped or cut."""
    from rich import box
    from rich.table import Table

    out = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    out.add_column(first, overflow="fold")  # a word longer than the column folds
    for header in others:
        out.add_column(header, justify="right", no_wrap=True)
    return out


def middle_shortened(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its first third and its end kept, the middle replaced by one ``…``
    (``gradient of…h.11.mlp.fc.weight``), so that what a name starts with (a gradient, the logits) and the part of
    a module path that tells layers apart both stay."""
    if len(text) <= width:
        return text
    head = width // 3
    return text[:head] + "…" + text[len(text) - (width - head - 1) :]


def shortened_names(names: list[str], width: int) -> list[str] | None:
    """Each name ``middle_shortened`` to ``width``, or None where that would make two different names alike (the
    caller then shows them whole)."""
    short = [middle_shortened(n, width) for n in names]
    return short if len(set(short)) == len(set(names)) else None


def top_table(top: tuple[TopAllocation, ...], width: int):
    """The largest allocations at the peak as a table of at most ``width`` columns (see ``_LEFT_OUT_FIRST``)."""
    rows = [
        (
            t.name,
            f"x{t.count}",
            "x".join(str(d) for d in t.shape) or "-",
            t.dtype,
            format_bytes(t.nbytes),
            format_bytes(t.total_bytes),
            t.category.value,
            t.symbol,
            short_source(t.source),
            t.trace_name if t.trace_name != t.name else "",
        )
        for t in top
    ]
    need = {h: max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(_TOP_HEADERS)}
    shown = list(_TOP_HEADERS)

    def total() -> int:
        return sum(need[h] if h != "name" else _NAME_WIDTH for h in shown) + GAP * (len(shown) - 1)

    for header in _LEFT_OUT_FIRST:
        if total() <= width:
            break
        shown.remove(header)
    name_width = max(_NAME_WIDTH, min(need["name"], width - (total() - _NAME_WIDTH)))
    out = table(*shown)
    for column in out.columns:
        header = column.header
        column.no_wrap, column.min_width = True, name_width if header == "name" else need[header]
        column.justify = "right" if header in ("count", "size each", "total") else "left"
    names = shortened_names([row[0] for row in rows], name_width)
    if names is None:  # whole names, folded onto more lines, rather than rows a reader cannot tell apart
        out.columns[0].no_wrap, out.columns[0].overflow = False, "fold"
    for i, row in enumerate(rows):
        cells = [row[_TOP_HEADERS.index(h)] for h in shown]
        cells[0] = names[i] if names is not None else cells[0]
        out.add_row(*cells)
    return out


def short_source(source: str | None) -> str:
    """``path/to/file.py:12`` as its last two path parts and the line (``to/file.py:12``); ``-`` for none."""
    if not source:
        return "-"
    path, _, line = source.rpartition(":")
    parts = path.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{line}" if line.isdigit() else source
