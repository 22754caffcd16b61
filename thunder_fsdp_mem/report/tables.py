"""The rich tables the text renderings share: ``table(first, *others)``, a table of named rows and right-aligned
figures, and ``top_tables(top, width)``, the largest allocations at the peak fitted to a terminal's width with
every column kept and no figure cut. ``short_source`` shortens a source line to its last two path parts."""

from __future__ import annotations

import os

from thunder_fsdp_mem.report.contents import TopAllocation
from thunder_fsdp_mem.units import format_bytes

# The top allocations' columns. Where they do not all fit beside a name of ``_NAME_WIDTH`` columns, two tables
# stacked, joined by the row's number ``#``, keep every one: what each row holds (``_HELD``), then what it is and
# where it was made (``_MADE``: one line a row where it fits, else each group a column of three lines, its headers
# one above the other). No figure, shape or source line is cut; a name too long is shortened in the middle (never
# into another row's), a trace name too long folds.
_TOP_HEADERS = ("name", "count", "shape", "dtype", "size each", "total", "category", "symbol", "source", "trace name")
_FIGURES = ("#", "count", "size each", "total")  # right-aligned
_HELD = ("#", "name", "count", "size each", "total")
_MADE = (("shape", "dtype", "category"), ("symbol", "source", "trace name"))
_NAME_WIDTH = 32  # the least width of the name column in one table: narrower, the tables are stacked
_FOLD_WIDTH = 20  # the least width of the trace name on one line: narrower, the second table takes three a row
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


def top_tables(top: tuple[TopAllocation, ...], width: int) -> tuple:
    """The largest allocations at the peak in at most ``width`` columns, every column kept: one table where all fit
    beside a name of ``_NAME_WIDTH`` columns (a wide terminal), else two stacked tables joined by the row's number
    ``#`` (see ``_HELD`` and ``_MADE``)."""
    rows = [_top_cells(t) for t in top]
    need = {h: max([len(h), *(len(r[h]) for r in rows)]) for h in _TOP_HEADERS}
    need["#"] = len(str(len(rows)))
    others = sum(need[h] for h in _TOP_HEADERS[1:]) + GAP * (len(_TOP_HEADERS) - 1)
    if others + _NAME_WIDTH <= width:
        return (_named_table(rows, _TOP_HEADERS, need, width - others),)
    others = sum(need[h] for h in _HELD if h != "name") + GAP * (len(_HELD) - 1)
    return _named_table(rows, _HELD, need, width - others), _made_table(rows, need, width)


def _top_cells(t: TopAllocation) -> dict[str, str]:
    return {
        "name": t.name,
        "count": f"x{t.count}",
        "shape": "x".join(str(d) for d in t.shape) or "-",
        "dtype": t.dtype,
        "size each": format_bytes(t.nbytes),
        "total": format_bytes(t.total_bytes),
        "category": t.category.value,
        "symbol": t.symbol,
        "source": short_source(t.source),
        "trace name": t.trace_name if t.trace_name != t.name else "",
    }


def _named_table(rows: list[dict[str, str]], headers: tuple[str, ...], need: dict[str, int], room: int):
    """``headers``' columns of ``rows``, one line each, the name in ``room`` columns (at most what the longest
    needs), shortened in the middle; where that would make two rows alike, whole names fold."""
    name_width = min(need["name"], max(room, 8))
    out = table(*headers)
    for column in out.columns:
        header = column.header
        column.no_wrap, column.min_width = True, name_width if header == "name" else need[header]
        column.justify = "right" if header in _FIGURES else "left"
    names = shortened_names([row["name"] for row in rows], name_width)
    if names is None:  # whole names, folded onto more lines, rather than rows a reader cannot tell apart
        name = out.columns[headers.index("name")]
        name.no_wrap, name.overflow = False, "fold"
    for i, row in enumerate(rows):
        cells = {**row, "#": str(i + 1), "name": names[i] if names is not None else row["name"]}
        out.add_row(*(cells[h] for h in headers))
    return out


def _made_table(rows: list[dict[str, str]], need: dict[str, int], width: int):
    """Each row's shape, dtype, category, symbol, source and trace name by its number: one line a row where they
    fit beside a trace name of ``_FOLD_WIDTH`` columns, else each group of ``_MADE`` a column of three lines."""
    one_line = [h for group in _MADE for h in group]
    fixed = sum(need[h] for h in ("#", *one_line[:-1])) + GAP * len(one_line)
    columns = [(h,) for h in one_line] if fixed + min(need["trace name"], _FOLD_WIDTH) <= width else list(_MADE)
    out = table("#", *("\n".join(c) for c in columns))
    out.columns[0].justify, out.columns[0].min_width = "right", need["#"]
    for column, headers in zip(out.columns[1:], columns):
        folds = "trace name" in headers  # the one that folds: the rest are whole, each line of a cell a field
        column.justify, column.no_wrap, column.overflow = "left", not folds, "fold"
        column.min_width = max((need[h] for h in headers if h != "trace name"), default=_FOLD_WIDTH)
    for i, row in enumerate(rows):
        out.add_row(str(i + 1), *("\n".join(row[h] for h in c) for c in columns))
    return out


def short_source(source: str | None) -> str:
    """``path/to/file.py:12`` as its last two path parts and the line (``to/file.py:12``); ``-`` for none."""
    if not source:
        return "-"
    path, _, line = source.rpartition(":")
    parts = path.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{line}" if line.isdigit() else source
