"""The memory report of one step: computed once (``build_report``), rendered as text, JSON or a plot by
functions that only read it. Only the CLI prints.

A report holds one plan, or two side by side: the step without ``FSDPMemoryTransform`` and with it; and with
``--measure``, the measured step beside the plan shown (``comparison.Comparison``). The top
allocations at the peak are grouped: allocations of the same shape, dtype, category, producing symbol and source
line (one per block of a litgpt model) are one row with a count.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import os
import re
import sys
from dataclasses import dataclass

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.cost import H200
from thunder_fsdp_mem.analysis.step import Stage, StepMemory, Timeline
from thunder_fsdp_mem.passes.driver import Rewrite
from thunder_fsdp_mem.predict.comparison import Comparison
from thunder_fsdp_mem.predict.fit import StepFit
from thunder_fsdp_mem.analysis.allocator import Reserved, replay_step
from thunder_fsdp_mem.units import format_bytes, unit_of


@dataclass(frozen=True, slots=True)
class TopAllocation:
    """Allocations alive at the peak that share a pattern: ``count`` of them, ``nbytes`` each; ``name`` is
    ``pattern_name`` of their labels (what made them, the layers' numbers as a range: ``Allocation.label``);
    ``trace_name``: the first one's name in its trace, for whoever reads traces."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    category: Category
    symbol: str
    source: str | None
    count: int = 1
    trace_name: str = ""

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count


@dataclass(frozen=True, slots=True)
class Plan:
    """One column of the report: a step's estimate, the bytes at its peak by category, its largest groups."""

    label: str
    step: StepMemory
    by_category: tuple[tuple[Category, int], ...]
    top: tuple[TopAllocation, ...]
    reserved: Reserved | None = None  # the caching allocator replayed over the step (CUDA runs)


@dataclass(frozen=True, slots=True)
class Report:
    """What the report shows. ``plans``: one, or (without the transform, with it); the last is the one whose
    top allocations and peak the report lists, and the one ``measured`` was run with. ``rewrites``: the
    transform's record of that plan (``FSDPMemoryTransform.rewrites``)."""

    title: str
    plans: tuple[Plan, ...]
    measured: Comparison | None = None
    rewrites: tuple[Rewrite, ...] = ()  # what each pass of the transform did, for the plan with it
    budget: int | None = None  # the per-rank peak the plan with the transform was asked to fit
    advice: tuple[Advice, ...] = ()  # what would lower the shown plan's peak
    settings: tuple[tuple[str, object], ...] = ()  # what the step was made of (model, tokens, mode...), by name
    versions: tuple[tuple[str, str], ...] = ()  # of this package and what it predicts with
    memory_cap: int | None = None  # the per-rank limit the caching allocator was replayed under

    @property
    def shown(self) -> Plan:
        return self.plans[-1]


def build_report(
    step: StepMemory,
    *,
    title: str,
    top: int = 10,
    baseline: StepMemory | None = None,
    measured: Comparison | None = None,
    rewrites: tuple[Rewrite, ...] = (),
    budget: int | None = None,
    settings: dict[str, object] | None = None,
    caching: bool = False,
    memory_cap: int | None = None,
) -> Report:
    """``step``: the plan the report lists; ``baseline``: the same step without the transform, shown beside;
    ``measured``: ``step`` beside a real run of it; ``rewrites``: what the transform did to make ``step``;
    ``budget``: the per-rank peak it was asked to fit; ``settings``: what the step was made of, by name;
    ``caching``: replay CUDA's caching allocator over each plan (``reserved.replay_step``), under ``memory_cap``
    per rank where given."""
    if memory_cap is not None and not caching:
        raise ValueError("memory_cap needs caching=True: a cap limits what the CUDA caching allocator reserves")
    plans = [] if baseline is None else [_plan("without transform", baseline, top, caching, memory_cap)]
    label = (
        "estimate"
        if baseline is None
        else ("with transform" if budget is None else f"with transform, budget {format_bytes(budget)}")
    )
    plans.append(_plan(label, step, top, caching, memory_cap))
    return Report(
        title=title,
        plans=tuple(plans),
        measured=measured,
        rewrites=tuple(rewrites),
        budget=budget,
        advice=advice(step),
        settings=tuple((settings or {}).items()),
        versions=versions(),
        memory_cap=memory_cap,
    )


# distribution -> its module: the module's own ``__version__`` where it is imported (torch's names its CUDA build)
VERSIONED = {
    "thunder-fsdp-mem": "thunder_fsdp_mem",
    "lightning-thunder": "thunder",
    "torch": "torch",
    "litgpt": "litgpt",
    "nvfuser": "nvfuser",
}


def versions() -> tuple[tuple[str, str], ...]:
    """The versions of ``VERSIONED``'s distributions that are installed."""
    out = []
    for name, module in VERSIONED.items():
        version = getattr(sys.modules.get(module), "__version__", None)
        try:
            out.append((name, str(version or importlib.metadata.version(name))))
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Advice:
    """What would lower a step's peak, and by how much at most (``saving_bytes``, predicted: the peak would move
    to the next highest phase if that is higher)."""

    text: str
    saving_bytes: int


ADVICE_SHARE = 0.1  # what a category must hold of the peak for advice about it


def advice(step: StepMemory) -> tuple[Advice, ...]:
    """One or two lines on what holds the peak and what would remove it: the eager loss (a chunked
    cross-entropy), saved activations (a memory budget), gathered parameters (ZeRO3 with the transform)."""
    out = []
    loss = _peak_held_by(step, Stage.LOSS)
    if loss is not None:
        held, saving = loss
        out.append(
            Advice(
                "The peak is in the eager cross-entropy: its log_softmax, the nll_loss gradient and the logits' "
                f"gradient hold {format_bytes(held)}. A chunked cross-entropy (litgpt's chunked_cross_entropy) holds "
                f"a chunk of each at a time: the peak would fall by up to {format_bytes(saving)}, to "
                f"{format_bytes(step.peak_bytes - saving)}.",
                saving,
            )
        )
    optimizer = _peak_held_by(step, Stage.OPTIMIZER)
    if optimizer is not None:
        held, saving = optimizer
        out.append(
            Advice(
                f"The peak is in the optimizer's step ({step.peak_symbol}): its temporaries hold {format_bytes(held)}. "
                f"AdamW(..., fused=True) updates in place: the peak would fall by up to {format_bytes(saving)}, to "
                f"{format_bytes(step.peak_bytes - saving)}.",
                saving,
            )
        )
    at_peak: dict[Category, int] = {}
    for a in step.live_at_peak:
        at_peak[a.category] = at_peak.get(a.category, 0) + a.nbytes
    saved = at_peak.get(Category.SAVED, 0)
    if saved >= ADVICE_SHARE * step.peak_bytes:
        out.append(
            Advice(
                f"Saved activations hold {format_bytes(saved)} at the peak: --memory-budget trades them for "
                "recomputation in backward (the report shows what it would recompute and the time that adds).",
                saved,
            )
        )
    gathered = at_peak.get(Category.GATHERED_PARAMETER, 0)
    if gathered >= ADVICE_SHARE * step.peak_bytes:
        out.append(
            Advice(
                f"Gathered parameters hold {format_bytes(gathered)} at the peak: with --shard zero3 and --transform "
                "they are gathered again in backward instead of kept from the forward.",
                gathered,
            )
        )
    return tuple(out)


def _peak_held_by(step: StepMemory, stage: Stage) -> tuple[int, int] | None:
    """Where the peak is in a phase of ``stage`` without a trace (the eager loss, the optimizer's step): what that
    phase itself holds, and how much the peak would fall without it (to the next highest phase at most)."""
    phase = next((p for p in step.phases if p.stage is stage), None)
    if step.peak_stage is not stage or phase is None:
        return None
    held = sum(a.nbytes for a in phase.extra)
    others = max((p.peak_bytes for p in step.phases if p is not phase), default=0)
    return held, step.peak_bytes - max(others, phase.peak_bytes - held)


def _plan(label: str, step: StepMemory, top: int, caching: bool = False, memory_cap: int | None = None) -> Plan:
    by_category: dict[Category, int] = {}
    for a in step.live_at_peak:
        by_category[a.category] = by_category.get(a.category, 0) + a.nbytes
    groups: dict[tuple, list] = {}
    for a in step.live_at_peak:
        key = (a.shape, a.dtype, a.category, a.symbol, a.source, a.nbytes)
        groups.setdefault(key, []).append(a)
    rows = [
        TopAllocation(
            pattern_name([a.label for a in g]),
            g[0].shape,
            g[0].dtype,
            g[0].nbytes,
            g[0].category,
            g[0].symbol,
            g[0].source,
            len(g),
            g[0].name,
        )
        for g in groups.values()
    ]
    rows.sort(key=lambda t: -t.total_bytes)
    reserved = replay_step(step, cap=memory_cap) if caching else None
    return Plan(label, step, tuple(sorted(by_category.items(), key=lambda kv: -kv[1])), tuple(rows[:top]), reserved)


_PROXY = re.compile(r"[a-z]{1,3}\d+")  # a trace's own names (t813, ft2154): their numbers are no layer's


def pattern_name(names: list[str]) -> str:
    """One name for a group: where the names differ only in numbers, those numbers as ranges
    (``block [0-31].mlp.fc.weight (gathered)``); where they differ in more, the first and how many more
    (``AdamW exp_avg of lm_head.weight and 3 more``); for a trace's own names, the first."""
    parts = [re.split(r"(\d+)", name) for name in names]
    first = parts[0]
    if _PROXY.fullmatch(names[0]):
        return names[0]
    if any(len(p) != len(first) or p[0::2] != first[0::2] for p in parts):
        return f"{names[0]} and {len(names) - 1} more"
    out = []
    for i, piece in enumerate(first):
        values = sorted({int(p[i]) for p in parts}) if i % 2 else []
        out.append(piece if len(values) <= 1 else _numbers(values))
    return "".join(out)


def _numbers(values: list[int]) -> str:
    if values == list(range(values[0], values[-1] + 1)):
        return f"[{values[0]}-{values[-1]}]"
    return "[" + ",".join(map(str, values[:4])) + (",..." if len(values) > 4 else "") + "]"


def _summary(step: StepMemory) -> list[tuple[str, str, int]]:
    """(label, JSON key, bytes) of the summary lines."""
    return [
        ("persistent (parameters, buffers, inputs)", "persistent_bytes", step.persistent_bytes),
        ("optimizer state", "optimizer_state_bytes", step.optimizer_state_bytes),
        ("forward peak", "forward_peak_bytes", step.forward_peak_bytes),
        ("saved for backward", "saved_bytes", step.saved_bytes),
        ("backward peak", "backward_peak_bytes", step.backward_peak_bytes),
        ("gradients", "gradient_bytes", step.gradient_bytes),
        ("optimizer step peak", "optimizer_peak_bytes", step.optimizer_peak_bytes),
        ("step peak", "peak_bytes", step.peak_bytes),
    ]


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
    summary = _table("step", *(p.label for p in plans))
    columns = [_summary(p.step) for p in plans]
    for i, (label, key, _) in enumerate(columns[0]):
        summary.add_row(label, *(format_bytes(c[i][2]) for c in columns), style="bold" if key == "peak_bytes" else None)
    if all(p.reserved is not None for p in plans):
        summary.add_row("reserved (caching allocator, modelled)", *(_reserved_cell(p.reserved) for p in plans))
    console.print(summary)
    console.print()
    if report.memory_cap is not None:
        for line in _cap_lines(report):
            console.print(line, soft_wrap=True)
        console.print()
    by_category = _table("at the peak, by category", *(p.label for p in plans))
    for category in dict.fromkeys(c for p in plans for c, _ in p.by_category):
        by_category.add_row(category.value, *(format_bytes(dict(p.by_category).get(category, 0)) for p in plans))
    console.print(by_category)
    console.print()
    if report.rewrites:
        _print_rewrites(console, report.rewrites)
        console.print()
        _print_recomputed(console, report)
    shown = report.shown
    console.print(
        f"Largest allocations alive at the peak ({shown.label}; top {len(shown.top)}; the same shape, dtype, "
        "symbol and source line counted once, as in repeated layers):"
    )
    console.print(_top_table(shown.top, width))
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
    if reserved.out_of_memory_bytes is not None:
        return f"out of memory ({format_bytes(reserved.peak_reserved_bytes)} reserved)"
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


# The top allocations' columns, and the order in which a narrow terminal leaves them out: a column is shown whole
# or not at all, so no figure, shape or source line is ever cut; only the name folds onto more lines.
_TOP_HEADERS = ("name", "count", "shape", "dtype", "size each", "total", "category", "symbol", "source", "trace name")
_LEFT_OUT_FIRST = ("trace name", "source", "symbol", "category", "dtype", "shape")
_NAME_WIDTH = 24  # the least width of the name column, which folds
_GAP = 3  # between two columns: a space of padding on each side of a space of border


def _top_table(top: tuple[TopAllocation, ...], width: int):
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
            _short(t.source),
            t.trace_name if t.trace_name != t.name else "",
        )
        for t in top
    ]
    need = {h: max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(_TOP_HEADERS)}
    shown = list(_TOP_HEADERS)

    def total() -> int:
        return sum(need[h] if h != "name" else _NAME_WIDTH for h in shown) + _GAP * (len(shown) - 1)

    for header in _LEFT_OUT_FIRST:
        if total() <= width:
            break
        shown.remove(header)
    table = _table(*shown)
    for column in table.columns:
        header = column.header
        if header == "name":
            column.no_wrap, column.overflow, column.min_width = False, "fold", _NAME_WIDTH
        else:
            column.no_wrap, column.min_width = True, need[header]
        column.justify = "right" if header in ("count", "size each", "total") else "left"
    for row in rows:
        table.add_row(*(row[_TOP_HEADERS.index(h)] for h in shown))
    return table


def _table(first: str, *others: str):
    """A table whose first column names the rows and whose other columns are right-aligned figures."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column(first, no_wrap=True)
    for header in others:
        table.add_column(header, justify="right", no_wrap=True)
    return table


def _print_rewrites(console, rewrites: tuple[Rewrite, ...]) -> None:
    console.print(
        "What the transform did, pass by pass (peaks estimated on the traces it saw: the loss and the "
        "optimizer state come on top):"
    )
    table = _table("pass", "trace pair", "outcome", "estimated peak", "saved for backward", "seconds")
    table.add_column("note", overflow="fold")
    for r in rewrites:
        peak = f"{format_bytes(r.peak_before)} -> {format_bytes(r.peak_after)}" if r.peak_before is not None else "-"
        saved = (
            f"{format_bytes(r.saved_before)} -> {format_bytes(r.saved_after)}" if r.saved_before is not None else "-"
        )
        table.add_row(r.pass_name, str(r.pair), r.outcome.value, peak, saved, f"{r.seconds:.2f}", r.note or "")
    console.print(table)


RECOMPUTED_ROWS = 8


def _print_recomputed(console, report: Report) -> None:
    """What the plan has the backward run again, by op and source line, the dearest first, with the predicted
    added time; and whether the budget is met."""
    for r in report.rewrites:
        if not r.recomputed or r.outcome.value != "applied":
            continue
        total = sum(g.count for g in r.recomputed)
        console.print(
            f"Recomputed in backward ({r.pass_name}, trace pair {r.pair}): {total} symbols, predicted to "
            f"add {_seconds(r.added_seconds or 0.0)} on {H200.name} (dearest first):"
        )
        table = _table("symbol", "count", "predicted time")
        table.add_column("source", overflow="fold")
        for g in r.recomputed[:RECOMPUTED_ROWS]:
            table.add_row(g.symbol, f"x{g.count}", _seconds(g.seconds), _short(g.source))
        if len(r.recomputed) > RECOMPUTED_ROWS:
            rest = r.recomputed[RECOMPUTED_ROWS:]
            table.add_row(
                f"{len(rest)} more", f"x{sum(g.count for g in rest)}", _seconds(sum(g.seconds for g in rest)), ""
            )
        console.print(table)
        console.print()
    if report.budget is not None:
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
        console.print(
            f"Budget {format_bytes(report.budget)} per rank{under}: {verdict}", style="bold" if met else "yellow"
        )
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
    table = _table("stage", "predicted", "measured", "error")
    for stage, predicted, measured in m.stages:
        error = f"{100 * (predicted - measured) / measured:+.2f}%" if measured else "-"
        table.add_row(stage, format_bytes(predicted), format_bytes(measured), error)
    if m.measured_at_predicted_peak is not None:
        table.add_row(
            "over the stretch of the predicted peak",
            format_bytes(m.predicted_peak_bytes),
            format_bytes(m.measured_at_predicted_peak),
            "",
        )
    console.print(table)
    console.print(f"  measured peak: {m.measured_peak_where}")
    if m.unpaired != (0, 0):
        console.print(
            f"  {m.unpaired[0]} measured run(s) and {m.unpaired[1]} predicted phase(s) found no partner: "
            "the measured step did not run the traces the prediction has",
            style="yellow",
        )


def render_json(report: Report) -> dict:
    """The settings and versions; the shown plan's figures at the top level (``plan`` names it: ``peak_bytes``,
    ``top``...); ``plans``: every plan's figures, categories at its peak, top allocations and timeline."""
    shown = report.shown
    out = {
        "title": report.title,
        "settings": dict(report.settings),
        "versions": dict(report.versions),
        "plan": shown.label,  # the top-level figures below are this plan's
        **_plan_json(shown),
        "plans": [{"label": p.label, **_plan_json(p), "timeline": _timeline_json(p.step)} for p in report.plans],
        "transform_passes": [{**dataclasses.asdict(r), "outcome": r.outcome.value} for r in report.rewrites],
        "budget_bytes": report.budget,
        "memory_cap_bytes": report.memory_cap,
        "advice": [{"text": a.text, "saving_bytes": a.saving_bytes} for a in report.advice],
    }
    m = report.measured
    if m is not None:
        out["measured"] = {
            "peak_bytes": m.measured_peak_bytes,
            "error": m.error,
            "rank": m.rank,
            "ranks_peak_bytes": list(m.ranks_peak_bytes),
            "step_peak_bytes": m.step_peak_bytes,
            "predicted_peak_bytes": m.predicted_peak_bytes,
            "predicted_step_peak_bytes": m.predicted_step_peak_bytes,
            "step_error": m.step_error,
            "device": m.device_type,
            "trainer": m.trainer,
            "at_predicted_peak_bytes": m.measured_at_predicted_peak,
            "peak_at": m.measured_peak_where,
            "stages": [{"stage": s, "predicted_bytes": p, "measured_bytes": b} for s, p, b in m.stages],
            "points": [list(pt) for pt in m.points],
            "paired_runs": m.paired,
            "unpaired": list(m.unpaired),
        }
    return out


def _plan_json(plan: Plan) -> dict:
    step = plan.step
    return {
        **{key: value for _, key, value in _summary(step)},
        "peak_phase": step.peak_phase,
        "peak_symbol": step.peak_symbol,
        "by_category": {c.value: v for c, v in plan.by_category},
        "reserved": None if plan.reserved is None else dataclasses.asdict(plan.reserved),
        "top": [
            {
                "name": t.name,
                "trace_name": t.trace_name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "bytes": t.nbytes,
                "count": t.count,
                "total_bytes": t.total_bytes,
                "category": t.category.value,
                "symbol": t.symbol,
                "source": t.source,
            }
            for t in plan.top
        ],
    }


def render_fit(fits: list[tuple[str, StepFit]], *, title: str, block_size: int, micro_batch_size: int) -> str:
    """``report --fit``: per plan, the largest sequence length and micro-batch that fit, and the next that does
    not, each with its predicted peak."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=180, color_system=None, highlight=False)
    capacity = fits[0][1].capacity
    console.print(
        f"{title}: the largest step whose predicted peak fits {format_bytes(capacity)} per rank ({capacity} bytes)"
    )
    console.print()

    def cell(value: int | None, peak: int | None, what: str) -> str:
        if value is None:
            return "-"
        return f"{value}{what} ({format_bytes(peak)})" if peak is not None else f"{value}{what}"

    table = _table(
        "plan",
        f"sequence length, micro-batch {micro_batch_size}",
        "next, over",
        f"micro-batch at {block_size} tokens",
        "next, over",
    )
    for label, fit in fits:
        t, m = fit.tokens, fit.micro_batch
        table.add_row(
            label,
            cell(t.value, t.peak_bytes, " tokens") if t.value else "none fits",
            cell(t.above, t.above_peak_bytes, ""),
            cell(m.value, m.peak_bytes, "") if m.value else "none fits",
            cell(m.above, m.above_peak_bytes, ""),
        )
    console.print(table)
    console.print(
        "(sequence lengths and micro-batches are powers of two; the transform runs with the size as its memory budget)"
    )
    return console.file.getvalue().rstrip("\n")


def fit_json(fits: list[tuple[str, StepFit]]) -> dict:
    return {
        "capacity_bytes": fits[0][1].capacity,
        "plans": [
            {
                "label": label,
                "tokens": dataclasses.asdict(fit.tokens),
                "micro_batch": dataclasses.asdict(fit.micro_batch),
            }
            for label, fit in fits
        ],
    }


def _timeline_json(step: StepMemory) -> dict:
    """Live bytes during each symbol of the step (``points``), split by category, and where each phase starts."""
    timeline = step.timeline()
    return {
        "points": list(timeline.points),
        "phases": [
            {"name": p.name, "stage": p.stage.value, "start": start, "peak_bytes": p.peak_bytes}
            for p, start in zip(step.phases, timeline.starts)
        ],
        "categories": {c.value: list(series) for c, series in timeline.categories},
    }


def render_plot(report: Report, path: str) -> None:
    """``plot_figure(report)`` written to ``path`` (PNG, SVG or PDF)."""
    import matplotlib.pyplot as plt

    fig = plot_figure(report)
    fig.savefig(path)
    plt.close(fig)


def plot_figure(report: Report):
    """Live memory over the step for each plan, its peak annotated; below, the shown plan's memory stacked by
    category. The y axes are in the unit of the labels, from 0; the x axis runs over the step's phases, each as
    wide in every plan (its symbols spread over it: ``phase_axis``), the stages as bands. A matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = phase_axis([p.step for p in report.plans])
    unit, size = unit_of(max(p.step.peak_bytes for p in report.plans))
    fig, (ax, stacked) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for n, (plan, xs, timeline) in enumerate(zip(report.plans, axis.xs, axis.timelines)):
        points = timeline.points
        (line,) = ax.plot(xs, [b / size for b in points], label=plan.label, linewidth=1)
        top = max(range(len(points)), key=points.__getitem__)
        right = xs[top] > 0.6 * axis.width  # the label to the left of a peak near the right edge
        ax.annotate(
            f"peak {format_bytes(points[top])} ({plan.step.peak_phase})",
            (xs[top], points[top] / size),
            textcoords="offset points",
            xytext=(-5 if right else 5, -12 - 11 * n),
            ha="right" if right else "left",
            color=line.get_color(),
            fontsize=8,
        )
    if report.measured is not None:
        m = report.measured
        xs = axis.xs[-1]
        label = (
            f"measured (rank {m.rank}), peak {format_bytes(m.measured_peak_bytes)} ({100 * m.error:+.2f}% predicted)"
        )
        ax.scatter(
            [xs[pos] for pos, _, _ in m.points],
            [b / size for _, b, _ in m.points],
            s=2,
            color="black",
            linewidths=0,
            label=label,
            zorder=3,
        )
    shown = axis.timelines[-1]
    series = [(c.value, [b / size for b in values]) for c, values in shown.categories if any(values)]
    stacked.stackplot(axis.xs[-1], *(values for _, values in series), labels=[name for name, _ in series], linewidth=0)
    for a in (ax, stacked):
        for n, (stage, start, end) in enumerate(axis.bands):
            a.axvspan(start, end, color="0.93" if n % 2 else "white", zorder=0)
            if a is ax:
                a.annotate(
                    stage,
                    ((start + end) / 2, 1.0),
                    xycoords=("data", "axes fraction"),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        for x in axis.traces:  # each trace's start (under FSDP2, each block's)
            a.axvline(x, color="0.6", linestyle=":", linewidth=0.3)
        a.set_ylim(bottom=0)
        a.set_xlim(0, axis.width)
    ax.set_ylabel(f"live memory per rank ({unit})")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(report.title, fontsize=9, pad=14)
    stacked.set_ylabel(f"{report.shown.label}, by category ({unit})", fontsize=8)
    stacked.legend(loc="upper left", fontsize=7, ncol=2)
    stacked.set_xlabel(
        "symbols of the step, phase by phase (each phase as wide in every plan; dotted: a trace starts)", fontsize=8
    )
    fig.tight_layout()
    return fig


@dataclass(frozen=True, slots=True)
class PhaseAxis:
    """A common x axis for steps of the same phases: phase k spans the same stretch in each, as wide as its most
    symbols (a phase without a trace, or with few, as wide as a fiftieth of the step), its points spread evenly
    over it. ``xs``: each step's points' positions; ``bands``: (stage, start, end) for each run of phases of one
    stage; ``traces``: where each phase with a trace starts; ``width``: the axis's end. Steps whose phases differ
    are each spread over the whole axis. ``timelines``: each step's ``StepMemory.timeline()``, made once."""

    timelines: tuple[Timeline, ...]
    xs: tuple[tuple[float, ...], ...]
    bands: tuple[tuple[str, float, float], ...]
    traces: tuple[float, ...]
    width: float


def phase_axis(steps: list[StepMemory]) -> PhaseAxis:
    timelines = tuple(s.timeline() for s in steps)
    counts = [[b - a for a, b in zip(t.starts, (*t.starts[1:], len(t.points)))] for t in timelines]
    phases = steps[-1].phases
    if any([(p.stage, p.name) for p in s.phases] != [(p.stage, p.name) for p in phases] for s in steps):
        counts = [[len(t.points)] for t in timelines]  # one stretch each, the whole axis
        widths = [float(max(len(t.points) for t in timelines))]
    else:
        widths = [float(max(c[k] for c in counts)) for k in range(len(phases))]
        least = sum(widths) / 50
        widths = [max(w, least) for w in widths]
    edges = [0.0]
    for w in widths:
        edges.append(edges[-1] + w)
    xs = tuple(
        tuple(edges[k] + (j + 0.5) * widths[k] / c for k, c in enumerate(per) for j in range(c)) for per in counts
    )
    if len(widths) != len(phases):
        return PhaseAxis(timelines, xs, (), (), edges[-1])
    bands: list[tuple[str, float, float]] = []
    for k, phase in enumerate(phases):
        if bands and bands[-1][0] == phase.stage.value:
            bands[-1] = (bands[-1][0], bands[-1][1], edges[k + 1])
        else:
            bands.append((phase.stage.value, edges[k], edges[k + 1]))
    traces = tuple(edges[k] for k, p in enumerate(phases) if p.timeline is not None and k > 0)
    return PhaseAxis(timelines, xs, tuple(bands), traces, edges[-1])


def _short(source: str | None) -> str:
    if not source:
        return "-"
    path, _, line = source.rpartition(":")
    parts = path.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{line}" if line.isdigit() else source
