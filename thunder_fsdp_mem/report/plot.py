"""The report as a figure: ``plot_figure(report)`` (a matplotlib Figure) and ``render_plot(report, path)`` (that
figure written to PNG, SVG or PDF). Live memory over the step for each plan, its peak annotated, and below the
shown plan's memory stacked by category; ``phase_axis`` lines the plans' phases up on one x axis although the
transform changes the traces' lengths."""

from __future__ import annotations

from dataclasses import dataclass

from thunder_fsdp_mem.analysis.phases import StepMemory, Timeline
from thunder_fsdp_mem.report.contents import Report
from thunder_fsdp_mem.units import format_bytes, unit_of


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
