"""The memory report of one step: computed once (``build_report``), rendered as text, JSON or a plot by
functions that only read it. Only the CLI prints.

A report holds one plan, or two side by side: the step without ``FSDPMemoryTransform`` and with it; and with
``--measure``, the measured step beside the plan shown (``measure.Comparison``). The top
allocations at the peak are grouped: allocations of the same shape, dtype, category, producing symbol and source
line (one per block of a litgpt model) are one row with a count.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thunder_fsdp_mem.categories import Category
from thunder_fsdp_mem.step import StepMemory
from thunder_fsdp_mem.units import format_bytes

if TYPE_CHECKING:
    from thunder_fsdp_mem.measure import Comparison


@dataclass(frozen=True, slots=True)
class TopAllocation:
    """Allocations alive at the peak that share a pattern: ``count`` of them, ``nbytes`` each; ``name`` is the
    first one's."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    category: Category
    symbol: str
    source: str | None
    count: int = 1

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


@dataclass(frozen=True, slots=True)
class Report:
    """What the report shows. ``plans``: one, or (without the transform, with it); the last is the one whose
    top allocations and peak the report lists, and the one ``measured`` was run with."""

    title: str
    plans: tuple[Plan, ...]
    measured: Comparison | None = None

    @property
    def shown(self) -> Plan:
        return self.plans[-1]


def build_report(step: StepMemory, *, title: str, top: int = 10, baseline: StepMemory | None = None,
                 measured: Comparison | None = None) -> Report:
    """``step``: the plan the report lists; ``baseline``: the same step without the transform, shown beside;
    ``measured``: ``step`` beside a real run of it."""
    plans = [] if baseline is None else [_plan("without transform", baseline, top)]
    plans.append(_plan("with transform" if baseline is not None else "estimate", step, top))
    return Report(title=title, plans=tuple(plans), measured=measured)


def _plan(label: str, step: StepMemory, top: int) -> Plan:
    by_category: dict[Category, int] = {}
    for a in step.live_at_peak:
        by_category[a.category] = by_category.get(a.category, 0) + a.nbytes
    groups: dict[tuple, list] = {}
    for a in step.live_at_peak:
        key = (a.shape, a.dtype, a.category, a.symbol, a.source, a.nbytes)
        groups.setdefault(key, []).append(a)
    rows = [TopAllocation(g[0].name, g[0].shape, g[0].dtype, g[0].nbytes, g[0].category, g[0].symbol, g[0].source,
                          len(g)) for g in groups.values()]
    rows.sort(key=lambda t: -t.total_bytes)
    return Plan(label, step, tuple(sorted(by_category.items(), key=lambda kv: -kv[1])), tuple(rows[:top]))


def _summary(step: StepMemory) -> list[tuple[str, str, int]]:
    """(label, JSON key, bytes) of the summary lines."""
    return [
        ("persistent (parameters, buffers, inputs)", "persistent_bytes", step.persistent_bytes),
        ("optimizer state", "optimizer_state_bytes", step.optimizer_state_bytes),
        ("forward peak", "forward_peak_bytes", step.forward_peak_bytes),
        ("saved for backward", "saved_bytes", step.saved_bytes),
        ("backward peak", "backward_peak_bytes", step.backward_peak_bytes),
        ("gradients", "gradient_bytes", step.gradient_bytes),
        ("step peak", "peak_bytes", step.peak_bytes),
    ]


def render_text(report: Report) -> str:
    plans = report.plans
    labels = [label for label, _, _ in _summary(plans[0].step)]
    width = max(len(label) for label in labels + [c.value for p in plans for c, _ in p.by_category])
    header = f"  {'':<{width}}" + "".join(f"  {p.label:>18}" for p in plans)
    lines = [report.title, "", header]
    columns = [_summary(p.step) for p in plans]
    for i, label in enumerate(labels):
        lines.append(f"  {label:<{width}}" + "".join(f"  {format_bytes(c[i][2]):>18}" for c in columns))
    lines += ["", "At the peak, by category:"]
    categories = list(dict.fromkeys(c for p in plans for c, _ in p.by_category))
    for category in categories:
        values = [dict(p.by_category).get(category, 0) for p in plans]
        lines.append(f"  {category.value:<{width}}" + "".join(f"  {format_bytes(v):>18}" for v in values))
    shown = report.shown
    lines += ["", f"Largest allocations alive at the peak ({shown.label}; top {len(shown.top)}; the same shape, "
                  f"dtype, symbol and source line counted once, as in repeated layers):"]
    lines.append(f"  {'name':<26} {'count':>5} {'shape':<20} {'dtype':<9} {'size each':>11} {'total':>11}  "
                 f"{'category':<20} {'symbol':<26} source")
    for t in shown.top:
        shape = "x".join(str(s) for s in t.shape) or "-"
        lines.append(
            f"  {t.name[:26]:<26} {'x' + str(t.count):>5} {shape[:20]:<20} {t.dtype[:9]:<9} "
            f"{format_bytes(t.nbytes):>11} {format_bytes(t.total_bytes):>11}  {t.category.value:<20} "
            f"{t.symbol[:26]:<26} {_short(t.source)}"
        )
    step = shown.step
    last = f"Peak per rank: {format_bytes(step.peak_bytes)} in {step.peak_phase}, at {step.peak_symbol}"
    if report.measured is not None:
        m = report.measured
        lines += ["", *_measured_lines(m, width)]
        last += f"; measured {format_bytes(m.measured_peak_bytes)} ({100 * m.error:+.2f}%)"
    lines += ["", last]
    return "\n".join(lines)


def _measured_lines(m: Comparison, width: int) -> list[str]:
    n = len(m.ranks_peak_bytes)
    where = (f"one {m.device_type} process" if n == 1 else
             f"{n} {m.device_type} ranks, a probe after every symbol; rank {m.rank} has the highest peak (per rank: "
             f"{', '.join(format_bytes(b) for b in m.ranks_peak_bytes)})")
    if n == 1:
        where += ", a probe after every symbol"
    lines = [f"Measured: one step of {m.trainer} on {where}:",
             f"  {'':<{width}}  {'predicted':>18}  {'measured':>18}  {'error':>8}"]
    for stage, predicted, measured in m.stages:
        error = f"{100 * (predicted - measured) / measured:+.2f}%" if measured else "-"
        lines.append(f"  {stage:<{width}}  {format_bytes(predicted):>18}  {format_bytes(measured):>18}  {error:>8}")
    if m.measured_at_predicted_peak is not None:
        lines.append(f"  {'over the stretch of the predicted peak':<{width}}  {format_bytes(m.predicted_peak_bytes):>18}"
                     f"  {format_bytes(m.measured_at_predicted_peak):>18}")
    lines.append(f"  {'with the optimizer step (not predicted)':<{width}}  {'':>18}  {format_bytes(m.step_peak_bytes):>18}")
    lines.append(f"  measured peak: {m.measured_peak_where}")
    if m.unpaired != (0, 0):
        lines.append(f"  {m.unpaired[0]} measured run(s) and {m.unpaired[1]} predicted phase(s) found no partner: the "
                     "measured step did not run the traces the prediction has")
    return lines


def render_json(report: Report) -> dict:
    """The shown plan at the top level (``peak_bytes``, ``top``...); with two plans, also ``plans`` with each one's
    summary."""
    shown = report.shown
    out = {
        "title": report.title,
        **_plan_json(shown),
        "plans": [{"label": p.label, **{key: value for _, key, value in _summary(p.step)}} for p in report.plans],
    }
    m = report.measured
    if m is not None:
        out["measured"] = {
            "peak_bytes": m.measured_peak_bytes, "error": m.error, "rank": m.rank,
            "ranks_peak_bytes": list(m.ranks_peak_bytes), "step_peak_bytes": m.step_peak_bytes,
            "device": m.device_type, "trainer": m.trainer, "at_predicted_peak_bytes": m.measured_at_predicted_peak,
            "peak_at": m.measured_peak_where,
            "stages": [{"stage": s, "predicted_bytes": p, "measured_bytes": b} for s, p, b in m.stages],
            "points": [list(pt) for pt in m.points], "paired_runs": m.paired, "unpaired": list(m.unpaired),
        }
    return out


def _plan_json(plan: Plan) -> dict:
    step = plan.step
    return {
        **{key: value for _, key, value in _summary(step)},
        "peak_phase": step.peak_phase,
        "peak_symbol": step.peak_symbol,
        "by_category": {c.value: v for c, v in plan.by_category},
        "top": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes, "count": t.count,
             "total_bytes": t.total_bytes, "category": t.category.value, "symbol": t.symbol, "source": t.source}
            for t in plan.top
        ],
    }


_BLOCK = re.compile(r": block \d+$")


def timeline(step: StepMemory) -> tuple[list[int], list[tuple[str, int]]]:
    """Live bytes over the step, one point per bound symbol (the memory inside each op) and one per phase without
    a trace, with what is alive outside the traces added; and (phase, index of its first point)."""
    points: list[int] = []
    marks = []
    for phase in step.phases:
        marks.append((phase.name, len(points)))
        points += phase.points()
    return points, marks


def render_plot(report: Report, path: str) -> None:
    """Live memory over the step for each plan, phases marked (the forward, the loss, the backward, and under
    FSDP2 each block's), each plan's peak annotated (PNG, SVG or PDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for plan in report.plans:
        points, marks = timeline(plan.step)
        xs = [i / max(1, len(points) - 1) for i in range(len(points))]  # the step's progress, 0 to 1
        gib = [p / 2**30 for p in points]
        line, = ax.plot(xs, gib, label=plan.label, linewidth=1)
        top = max(range(len(gib)), key=gib.__getitem__)
        ax.annotate(f"peak {format_bytes(points[top])} ({plan.step.peak_phase})", (xs[top], gib[top]),
                    textcoords="offset points", xytext=(5, 5), color=line.get_color(), fontsize=8)
        stage, labelled = None, -1.0
        for name, start in marks:
            if start >= len(xs):
                continue
            if _BLOCK.search(name):  # a block of the model: a light tick
                ax.axvline(xs[start], color=line.get_color(), linestyle=":", linewidth=0.3, alpha=0.5)
            now = name.split(":")[0]
            if now != stage and start > 0:  # the forward, the loss, the backward: a line, labelled where room
                ax.axvline(xs[start], color=line.get_color(), linestyle="--", linewidth=0.8)
                if xs[start] - labelled > 0.05:
                    ax.annotate(now, (xs[start], 0.01), xycoords=("data", "axes fraction"),
                                textcoords="offset points", xytext=(2, 0), fontsize=7, color=line.get_color())
                    labelled = xs[start]
            stage = now
    if report.measured is not None:
        points, _ = timeline(report.shown.step)
        scale = max(1, len(points) - 1)
        m = report.measured
        label = f"measured (rank {m.rank}), peak {format_bytes(m.measured_peak_bytes)} ({100 * m.error:+.2f}% predicted)"
        ax.scatter([pos / scale for pos, _, _ in m.points], [b / 2**30 for _, b, _ in m.points], s=2, color="black",
                   linewidths=0, label=label, zorder=3)
    ax.set_xlabel("progress through the step (symbols of the forward, the loss, the backward; dotted: blocks)")
    ax.set_ylabel("live memory per rank (GiB)")
    ax.set_title(report.title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _short(source: str | None) -> str:
    if not source:
        return "-"
    path, _, line = source.rpartition(":")
    parts = path.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{line}" if line.isdigit() else source
