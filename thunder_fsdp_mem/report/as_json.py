"""The report as JSON-ready data: ``render_json(report) -> dict``, bytes as integers. It carries the settings and
the versions, the shown plan's figures at the top level, and per plan its figures, the categories and top
allocations at its peak and its timeline (live bytes per symbol, split by category, phases marked)."""

from __future__ import annotations

import dataclasses

from thunder_fsdp_mem.analysis.phases import StepMemory
from thunder_fsdp_mem.report.contents import Plan, Report, summary_rows


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
        **{key: value for _, key, value in summary_rows(step)},
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
