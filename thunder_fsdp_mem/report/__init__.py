"""The memory report of one step, computed once and rendered by functions that only read it; only the CLI prints.

``build_report(step, title=...) -> Report`` (``contents``) computes the plans, their largest allocation groups at the
peak and the ``advice`` on what would lower it; ``render_text`` (``text``), ``render_json`` (``as_json``) and
``render_plot``/``plot_figure`` (``plot``) render it. ``render_fit`` and ``fit_json`` (``fit_table``) present the search
of ``predict.largest_step`` for the largest step that fits.
"""

from thunder_fsdp_mem.report.advice import ADVICE_SHARE, Advice, advice
from thunder_fsdp_mem.report.as_json import render_json
from thunder_fsdp_mem.report.fit_table import fit_json, render_fit
from thunder_fsdp_mem.report.contents import (
    VERSIONED,
    Plan,
    Report,
    TopAllocation,
    build_report,
    pattern_name,
    versions,
)
from thunder_fsdp_mem.report.plot import PhaseAxis, phase_axis, plot_figure, render_plot
from thunder_fsdp_mem.report.tables import short_source
from thunder_fsdp_mem.report.text import render_text


__all__ = [
    "ADVICE_SHARE",
    "VERSIONED",
    "Advice",
    "PhaseAxis",
    "Plan",
    "Report",
    "TopAllocation",
    "advice",
    "build_report",
    "fit_json",
    "pattern_name",
    "phase_axis",
    "plot_figure",
    "render_fit",
    "render_json",
    "render_plot",
    "render_text",
    "short_source",
    "versions",
]
