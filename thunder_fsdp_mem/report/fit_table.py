"""The largest step that fits, as the ``fit`` command shows it: ``render_fit(fits, title=...) -> str`` (a rich
table, one row per plan) and ``fit_json(fits) -> dict``. The search itself is ``predict.largest_step.fit_step``; this
module only presents its ``StepFit`` results."""

from __future__ import annotations

import dataclasses
import io

from thunder_fsdp_mem.predict.largest_step import MICRO_BATCHES, SHORTEST, Longest, StepFit
from thunder_fsdp_mem.report.tables import table
from thunder_fsdp_mem.units import format_bytes


def render_fit(
    fits: list[tuple[str, StepFit]],
    *,
    title: str,
    block_size: int,
    micro_batch_size: int,
    longest: Longest,
    width: int = 100,
) -> str:
    """``thunder-fsdp-mem fit``: per plan, the largest sequence length and micro-batch that fit, and the next that does
    not, each with its predicted peak; then the limits searched and why (``longest``)."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    capacity = fits[0][1].capacity
    console.print(
        f"{title}: the largest step whose predicted peak fits {format_bytes(capacity)} per rank ({capacity} bytes)"
    )
    console.print()

    # Three columns, so that an 80-column terminal shows every one: the plan and what was searched name the row
    # (folding where short), the figures are never cut.
    out = table("plan: the largest", "that fits (peak)", "the next (peak)")
    for label, fit in fits:
        t, m = fit.tokens, fit.micro_batch
        out.add_row(
            f"{label}: sequence length at micro-batch {micro_batch_size}",
            _cell(t.value, t.peak_bytes, " tokens") if t.value else "none fits",
            _cell(t.above, t.above_peak_bytes, " tokens"),
        )
        out.add_row(
            f"{label}: micro-batch at {block_size} tokens",
            _cell(m.value, m.peak_bytes, " sequences") if m.value else "none fits",
            _cell(m.above, m.above_peak_bytes, " sequences"),
        )
    console.print(out)
    console.print(
        f"Searched sequence lengths of {SHORTEST} to {longest.tokens} tokens (the longest: {longest.why}) and "
        f"micro-batches of 1 to {MICRO_BATCHES[-1]}, powers of two; a next of '-': the largest searched fits. "
        "The transform runs with the size as its memory budget."
    )
    return "\n".join(line.rstrip() for line in console.file.getvalue().rstrip("\n").splitlines())


def fit_json(fits: list[tuple[str, StepFit]], longest: Longest) -> dict:
    """The capacity, the limits searched, and per plan its ``Largest`` sequence length and micro-batch as dicts
    (bytes as integers)."""
    return {
        "capacity_bytes": fits[0][1].capacity,
        "searched": {
            "tokens": [SHORTEST, longest.tokens],
            "longest_because": longest.why,
            "micro_batches": [1, MICRO_BATCHES[-1]],
        },
        "plans": [
            {
                "label": label,
                "tokens": dataclasses.asdict(fit.tokens),
                "micro_batch": dataclasses.asdict(fit.micro_batch),
            }
            for label, fit in fits
        ],
    }


def _cell(value: int | None, peak: int | None, what: str) -> str:
    if value is None:
        return "-"
    return f"{value}{what} ({format_bytes(peak)})" if peak is not None else f"{value}{what}"
