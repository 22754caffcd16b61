"""The memory report of one step: computed once (``build_report``), rendered as text or JSON by pure functions.
Only the CLI prints."""

from __future__ import annotations

import os
from dataclasses import dataclass

from thunder_fsdp_mem.categories import Category
from thunder_fsdp_mem.step import StepMemory
from thunder_fsdp_mem.units import format_bytes


@dataclass(frozen=True, slots=True)
class TopAllocation:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    category: Category
    symbol: str
    source: str | None


@dataclass(frozen=True, slots=True)
class Report:
    """What the report shows: the step's estimate, the bytes at the peak by category, the largest allocations."""

    title: str
    step: StepMemory
    by_category: tuple[tuple[Category, int], ...]
    top: tuple[TopAllocation, ...]


def build_report(step: StepMemory, *, title: str, top: int = 10) -> Report:
    by_category: dict[Category, int] = {}
    for a in step.live_at_peak:
        by_category[a.category] = by_category.get(a.category, 0) + a.nbytes
    return Report(
        title=title,
        step=step,
        by_category=tuple(sorted(by_category.items(), key=lambda kv: -kv[1])),
        top=tuple(
            TopAllocation(a.name, a.shape, a.dtype, a.nbytes, a.category, a.symbol, a.source)
            for a in step.live_at_peak[:top]
        ),
    )


def _summary(step: StepMemory) -> list[tuple[str, str, int]]:
    """(label, JSON key, bytes) of the summary lines."""
    return [
        ("persistent (parameters, buffers, inputs)", "persistent_bytes", step.persistent_bytes),
        ("forward peak", "forward_peak_bytes", step.forward_peak_bytes),
        ("saved for backward", "saved_bytes", step.saved_bytes),
        ("backward peak", "backward_peak_bytes", step.backward_peak_bytes),
        ("gradients", "gradient_bytes", step.gradient_bytes),
        ("step peak", "peak_bytes", step.peak_bytes),
    ]


def render_text(report: Report) -> str:
    step = report.step
    summary = _summary(step)
    width = max(len(label) for label, _, _ in summary)
    lines = [report.title, ""]
    lines += [f"  {label:<{width}}  {format_bytes(v):>12}" for label, _, v in summary]
    lines += ["", "At the peak, by category:"]
    lines += [f"  {c.value:<{width}}  {format_bytes(v):>12}" for c, v in report.by_category]
    lines += ["", f"Largest allocations alive at the peak (top {len(report.top)}):"]
    lines.append(f"  {'name':<24} {'shape':<22} {'dtype':<10} {'size':>12}  {'category':<20} {'symbol':<28} source")
    for t in report.top:
        shape = "x".join(str(s) for s in t.shape) or "-"
        lines.append(
            f"  {t.name[:24]:<24} {shape[:22]:<22} {t.dtype[:10]:<10} {format_bytes(t.nbytes):>12}  "
            f"{t.category.value:<20} {t.symbol[:28]:<28} {_short(t.source)}"
        )
    lines += ["", f"Peak per rank: {format_bytes(step.peak_bytes)} in the {step.peak_phase} at {step.peak_symbol}"]
    return "\n".join(lines)


def render_json(report: Report) -> dict:
    step = report.step
    return {
        "title": report.title,
        **{key: value for _, key, value in _summary(step)},
        "peak_phase": step.peak_phase,
        "peak_symbol": step.peak_symbol,
        "by_category": {c.value: v for c, v in report.by_category},
        "top": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes,
             "category": t.category.value, "symbol": t.symbol, "source": t.source}
            for t in report.top
        ],
    }


def _short(source: str | None) -> str:
    if not source:
        return "-"
    path, _, line = source.rpartition(":")
    parts = path.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{line}" if line.isdigit() else source
