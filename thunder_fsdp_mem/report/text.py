"""The report as text: ``render_text(report, width=..., color=...) -> str``, rich tables in one string (only the
CLI prints it). It reads a ``Report`` (``contents``) and computes nothing of its own: the summary of each plan, what
the caching allocator's replay reserves, the bytes at the peak by category, what the transform did and what it
recomputes, the largest allocations at the peak, the advice, the measured step beside the predicted one, and last
the peak per rank (one line, what users grep)."""

from __future__ import annotations

import io

from thunder_fsdp_mem.analysis.caching_allocator import Reserved
from thunder_fsdp_mem.analysis.cost import H200
from thunder_fsdp_mem.passes.driver import Rewrite
from thunder_fsdp_mem.predict.comparison import Comparison
from thunder_fsdp_mem.report.contents import Report, summary_rows
from thunder_fsdp_mem.report.tables import GAP as _GAP, short_source, table, top_tables
from thunder_fsdp_mem.units import format_bytes


def render_text(report: Report, *, width: int = 180, color: bool = False) -> str:
    """The report as rich tables, one string (``color``: with the terminal's styles)."""
    from rich.console import Console

    console = Console(
        file=io.StringIO(),
        width=width,
        color_system="standard" if color else None,
        force_terminal=color,
        highlight=False,
    )
    plans = report.plans
    console.print(report.title)
    console.print()
    summary = table("step", *(p.label for p in plans))
    columns = [summary_rows(p.step) for p in plans]
    for i, (label, key, _) in enumerate(columns[0]):
        summary.add_row(label, *(format_bytes(c[i][2]) for c in columns), style="bold" if key == "peak_bytes" else None)
    if all(p.reserved is not None for p in plans):
        summary.add_row("reserved (caching allocator, modelled)", *(_reserved_cell(p.reserved) for p in plans))
    console.print(summary)
    console.print()
    if report.memory_cap is not None:
        for line in _cap_lines(report):
            console.print(line)
        console.print()
    by_category = table("at the peak, by category", *(p.label for p in plans))
    for category in dict.fromkeys(c for p in plans for c, _ in p.by_category):
        by_category.add_row(category.value, *(format_bytes(dict(p.by_category).get(category, 0)) for p in plans))
    console.print(by_category)
    console.print()
    if report.rewrites:
        _print_rewrites(console, report.rewrites)
        console.print()
        _print_recomputed(console, report)
        _print_budget(console, report)
    shown = report.shown
    console.print(
        f"Largest allocations alive at the peak ({shown.label}; top {len(shown.top)}; the same shape, dtype, "
        "symbol and source line counted once, as in repeated layers):"
    )
    for i, out in enumerate(top_tables(shown.top, width)):
        if i:  # the second of two stacked tables: what each row is and where it was made, by its number
            console.print()
        console.print(out)
    console.print()
    for item in report.advice:
        console.print(item.text)
    if report.advice:
        console.print()
    step = shown.step
    last = f"Peak per rank: {format_bytes(step.peak_bytes)} in {step.peak_phase}, at {step.peak_symbol}"
    if step.peak_bytes > H200.memory:
        last += f" (more than an {H200.name} holds: {format_bytes(H200.memory)})"
    if report.measured is not None:
        m = report.measured
        _print_measured(console, m)
        console.print()
        last += f"; measured {format_bytes(m.step_peak_bytes)} ({100 * m.step_error:+.2f}%)"
    console.print(last, style="bold", soft_wrap=True)
    return "\n".join(line.rstrip() for line in console.file.getvalue().rstrip("\n").splitlines())


def _reserved_cell(reserved: Reserved) -> str:
    if reserved.out_of_memory_bytes is not None:  # on two lines, so that two plans' fit beside the rows' names
        return f"out of memory\n({format_bytes(reserved.peak_reserved_bytes)} reserved)"
    return format_bytes(reserved.peak_reserved_bytes)


def _cap_lines(report: Report) -> list[str]:
    """Under ``--memory-cap``: per plan, whether the allocator's replay runs out, and why."""
    cap = format_bytes(report.memory_cap)
    lines = []
    for p in report.plans:
        r = p.reserved
        if r.out_of_memory_bytes is None:
            retried = f", after releasing its cached segments {r.retries} time(s)" if r.retries else ""
            lines.append(
                f"Under a cap of {cap} per rank, {p.label}: fits, reserving at most "
                f"{format_bytes(r.peak_reserved_bytes)}{retried}."
            )
        elif p.step.peak_bytes <= report.memory_cap:
            peak = format_bytes(p.step.peak_bytes)
            planned = report.budget is not None and p is report.shown  # planned under the cap: the least it reaches
            room = (
                "The budget's plan is the nearest to the cap the transform reaches"
                if planned
                else "--memory-budget with this --memory-cap plans a step that runs under it"
            )
            lines.append(
                f"Under a cap of {cap} per rank, {p.label}: runs out of memory at a request of "
                f"{format_bytes(r.out_of_memory_bytes)}, although its peak ({peak}) is under the cap: no "
                f"cached block holds the request and a new segment would pass the cap (fragmentation). "
                f"{room}; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may leave it room."
            )
        else:
            lines.append(
                f"Under a cap of {cap} per rank, {p.label}: runs out of memory (its peak, "
                f"{format_bytes(p.step.peak_bytes)}, is over the cap)."
            )
    return lines


def _print_rewrites(console, rewrites: tuple[Rewrite, ...]) -> None:
    """One row per pass and trace pair, each figure before and after on two lines (so that the table fits 80
    columns); the passes' notes below it."""
    console.print(
        "What the transform did, pass by pass (the peak estimated on the traces it saw, the loss and the optimizer "
        "state on top; what the forward saves for backward):"
    )
    rows = [
        (
            r.pass_name,
            str(r.pair),
            r.outcome.value,
            _before_after(r.peak_before, r.peak_after),
            _before_after(r.saved_before, r.saved_after),
            f"{r.seconds:.2f}",
        )
        for r in rewrites
    ]
    headers = ("pass", "pair", "outcome", "peak", "saved", "seconds")
    out = table(*headers)
    # The figures whole; the pass's name wraps between its words; the outcome takes what is left.
    need = [
        max(len(h), *(max(len(line) for line in row[i].split("\n")) for row in rows)) for i, h in enumerate(headers)
    ]
    words = max(len(w) for row in rows for w in row[0].split())
    fixed = sum(need[1:2] + need[3:]) + _GAP * (len(headers) - 1)
    outcome_words = max(len(w) for row in rows for w in row[2].split())
    name = max(words, min(need[0], (console.width - fixed) // 2))
    for column, width in zip(out.columns, (name, need[1], max(outcome_words, console.width - fixed - name), *need[3:])):
        column.width = width
    out.columns[2].justify, out.columns[2].no_wrap = "left", False
    for row in rows:
        out.add_row(*row)
    console.print(out)
    for r in rewrites:
        if r.note:
            console.print(f"  {r.pass_name} (pair {r.pair}): {r.note}")


def _before_after(before: int | None, after: int | None) -> str:
    return "-" if before is None else f"{format_bytes(before)}\n-> {format_bytes(after)}"


RECOMPUTED_ROWS = 8


def _print_recomputed(console, report: Report) -> None:
    """What the plan has the backward run again, by op and source line, the dearest first, with the predicted
    added time."""
    for r in report.rewrites:
        if not r.recomputed or r.outcome.value != "applied":
            continue
        total = sum(g.count for g in r.recomputed)
        console.print(
            f"Recomputed in backward ({r.pass_name}, trace pair {r.pair}): {total} symbols, predicted to "
            f"add {_seconds(r.added_seconds or 0.0)} on {H200.name} (dearest first):"
        )
        out = table("symbol", "count", "predicted time")
        out.add_column("source", overflow="fold")
        for g in r.recomputed[:RECOMPUTED_ROWS]:
            out.add_row(g.symbol, f"x{g.count}", _seconds(g.seconds), short_source(g.source))
        if len(r.recomputed) > RECOMPUTED_ROWS:
            rest = r.recomputed[RECOMPUTED_ROWS:]
            out.add_row(
                f"{len(rest)} more", f"x{sum(g.count for g in rest)}", _seconds(sum(g.seconds for g in rest)), ""
            )
        console.print(out)
        console.print()


def _print_budget(console, report: Report) -> None:
    """Whether the plan meets ``--memory-budget``: its peak, and under ``--memory-cap`` the allocator's replay too."""
    if report.budget is None:
        return
    peak = report.shown.step.peak_bytes
    reserved = report.shown.reserved if report.memory_cap is not None else None
    met = peak <= report.budget and (reserved is None or reserved.out_of_memory_bytes is None)
    under = f" under a cap of {format_bytes(report.memory_cap)}" if reserved is not None else ""
    if met:
        verdict = f"met: {format_bytes(peak)}"
        verdict += f", {format_bytes(reserved.peak_reserved_bytes)} reserved" if reserved is not None else ""
    elif peak <= report.budget:
        verdict = (
            f"cannot be met: the plan nearest to it ({format_bytes(peak)}) runs out of memory in the "
            "caching allocator's replay"
        )
    else:
        verdict = f"cannot be met: the least peak the plan reaches is {format_bytes(peak)}"
    console.print(f"Budget {format_bytes(report.budget)} per rank{under}: {verdict}", style="bold" if met else "yellow")
    console.print()


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} us"


def _print_measured(console, m: Comparison) -> None:
    n = len(m.ranks_peak_bytes)
    where = (
        f"one {m.device_type} process"
        if n == 1
        else f"{n} {m.device_type} ranks; rank {m.rank} has the highest peak (per rank: "
        f"{', '.join(format_bytes(b) for b in m.ranks_peak_bytes)})"
    )
    console.print(f"Measured: one step of {m.trainer} on {where}, a probe after every symbol:")
    out = table("stage", "predicted", "measured", "error")
    for stage, predicted, measured in m.stages:
        error = f"{100 * (predicted - measured) / measured:+.2f}%" if measured else "-"
        out.add_row(stage, format_bytes(predicted), format_bytes(measured), error)
    if m.measured_at_predicted_peak is not None:
        out.add_row(
            "over the stretch of the predicted peak",
            format_bytes(m.predicted_peak_bytes),
            format_bytes(m.measured_at_predicted_peak),
            "",
        )
    console.print(out)
    console.print(f"  measured peak: {m.measured_peak_where}")
    if m.unpaired != (0, 0):
        console.print(
            f"  {m.unpaired[0]} measured run(s) and {m.unpaired[1]} predicted phase(s) found no partner: "
            "the measured step did not run the traces the prediction has",
            style="yellow",
        )
