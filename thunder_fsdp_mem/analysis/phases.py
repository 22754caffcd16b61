"""The phases of a training step and the memory of the whole step, per rank.

Entry points: ``step_memory(phases, ...) -> StepMemory``, the step that runs ``phases`` in order; ``Phase`` (one
phase: a trace's timeline, or a step without a trace, beside what is alive outside it), ``Stage`` (the part of a
step a phase belongs to), ``Timeline`` (live bytes over the whole step, from ``StepMemory.timeline``).

The peak of a phase is its timeline's (or its own allocations') plus what is alive outside it; the step's peak is
the highest phase's, the first of them on a tie. ``step.estimate_step`` and ``predict.fsdp2`` build their phases
with ``holdings.Holdings``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from thunder_fsdp_mem.analysis.timeline import Allocation, MemoryTimeline
from thunder_fsdp_mem.analysis.categories import Category


class Stage(str, Enum):
    """The part of a step a phase belongs to."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer step"


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One phase of the step: a trace's timeline, or a step without a trace (the caller's loss, a collective's
    buffers), plus what is alive outside it. ``name``: what a report calls it (``forward``, ``backward: block 3``);
    ``extra``: allocations of a phase without a trace, alive at its peak; ``symbol``: what such a phase runs;
    ``inside``: the allocations held before the phase that its timeline counts (among its inputs)."""

    stage: Stage
    name: str
    timeline: MemoryTimeline | None
    outside: tuple[Allocation, ...]
    extra: tuple[Allocation, ...] = ()
    symbol: str = ""
    inside: tuple[Allocation, ...] = ()

    @property
    def outside_bytes(self) -> int:
        return sum(a.nbytes for a in self.outside)

    @property
    def peak_bytes(self) -> int:
        inside = self.timeline.peak_bytes if self.timeline is not None else 0
        return inside + self.outside_bytes + sum(a.nbytes for a in self.extra)

    @property
    def peak_index(self) -> int:
        return self.timeline.peak_index if self.timeline is not None else -1

    @property
    def peak_symbol(self) -> str:
        return self.timeline.peak_symbol if self.timeline is not None else self.symbol

    @property
    def live_at_peak(self) -> tuple[Allocation, ...]:
        inside = self.timeline.live_at_peak if self.timeline is not None else ()
        return (*inside, *self.outside, *self.extra)

    def points(self) -> list[int]:
        """Live bytes while each bound symbol runs, what is outside included; one point without a trace."""
        if self.timeline is None:
            return [self.peak_bytes]
        base = self.outside_bytes + sum(a.nbytes for a in self.extra)
        return [b + base for b in self.timeline.op_peaks]

    def category_points(self) -> dict[Category, list[int]]:
        """``points`` split by category (an op's workspace is temporary)."""
        live: dict[Category, int] = {}
        for a in (
            *self.outside,
            *self.extra,
            *(() if self.timeline is None else (a for a in self.timeline.allocations if a.symbol == "input")),
        ):
            live[a.category] = live.get(a.category, 0) + a.nbytes
        if self.timeline is None:
            return {c: [b] for c, b in live.items()}
        allocations = self.timeline.allocations
        out: dict[Category, list[int]] = {}

        def add(indices, sign: int) -> None:
            for j in indices:
                live[allocations[j].category] = live.get(allocations[j].category, 0) + sign * allocations[j].nbytes

        for i, op in enumerate(self.timeline.ops()):
            if op.freed_first:
                add(op.freed, -1)
            add(op.made, 1)
            for c in {*live, Category.TEMPORARY}:
                out.setdefault(c, [0] * i).append(live.get(c, 0) + (op.workspace if c is Category.TEMPORARY else 0))
            if not op.freed_first:
                add(op.freed, -1)
        return out


@dataclass(frozen=True, slots=True)
class Timeline:
    """Live bytes over the step, one point per bound symbol of each traced phase (the memory inside each op) and one
    per phase without a trace; ``starts[k]`` is the index of phase k's first point; ``categories``: the points
    split by category (each series as long as ``points``, adding up to them)."""

    points: tuple[int, ...]
    starts: tuple[int, ...]
    categories: tuple[tuple[Category, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Memory of one training step (forward, loss, backward, optimizer step), per rank. All sizes in bytes.

    ``persistent_bytes``: parameters, buffers and inputs alive before the step.
    ``forward_peak_bytes`` / ``backward_peak_bytes`` / ``loss_peak_bytes`` / ``optimizer_peak_bytes``: the peak of
    each stage, everything alive counted (the loss's with ``loss=``, the optimizer step's with an Adam ``optimizer``).
    ``training_peak_bytes``: the peak of the forward and the backward, the loss included: what the traces hold.
    ``saved_bytes``: what the forward keeps for backward beyond its own inputs (parameters and inputs that are
    saved cost nothing extra).
    ``gradient_bytes``: the gradients alive after backward; ``optimizer_state_bytes``: with ``optimizer=``.
    ``peak_stage`` / ``peak_phase``: the stage and the name of the phase that holds the peak; ``peak_index``: the
    bound symbol there (-1 in a phase without a trace).
    ``live_at_peak``: allocations alive at the peak, the ones no trace mentions included; they add up to
    ``peak_bytes``.
    ``forward`` / ``backward``: the timelines of the traces. ``phases``: the step in the order it runs.
    """

    peak_bytes: int
    peak_stage: Stage
    peak_phase: str
    peak_index: int
    peak_symbol: str
    persistent_bytes: int
    forward_peak_bytes: int
    saved_bytes: int
    backward_peak_bytes: int
    gradient_bytes: int
    forward: MemoryTimeline
    backward: MemoryTimeline | None
    live_at_peak: tuple[Allocation, ...]
    loss_peak_bytes: int = 0
    optimizer_state_bytes: int = 0
    phases: tuple[Phase, ...] = ()
    optimizer_peak_bytes: int = 0

    @property
    def training_peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases if p.stage is not Stage.OPTIMIZER), default=0)

    def timeline(self) -> Timeline:
        points: list[int] = []
        starts = []
        categories: dict[Category, list[int]] = {}
        for phase in self.phases:
            starts.append(len(points))
            n = len(points)
            points += phase.points()
            for c, series in phase.category_points().items():
                categories.setdefault(c, [0] * n).extend(series)
            for series in categories.values():
                series.extend([0] * (len(points) - len(series)))
        order = sorted(categories, key=list(Category).index)
        return Timeline(tuple(points), tuple(starts), tuple((c, tuple(categories[c])) for c in order))


def step_memory(
    phases: Iterable[Phase],
    *,
    forward: MemoryTimeline,
    backward: MemoryTimeline | None,
    persistent_bytes: int,
    saved_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
) -> StepMemory:
    """The ``StepMemory`` of a step that runs ``phases`` in order; the peak is the first phase's of the highest."""
    phases = tuple(phases)
    peak = max(phases, key=lambda p: p.peak_bytes)

    def stage_peak(stage: Stage) -> int:
        return max((p.peak_bytes for p in phases if p.stage is stage), default=0)

    return StepMemory(
        peak_bytes=peak.peak_bytes,
        peak_stage=peak.stage,
        peak_phase=peak.name,
        peak_index=peak.peak_index,
        peak_symbol=peak.peak_symbol,
        persistent_bytes=persistent_bytes,
        forward_peak_bytes=stage_peak(Stage.FORWARD),
        saved_bytes=saved_bytes,
        backward_peak_bytes=stage_peak(Stage.BACKWARD),
        gradient_bytes=gradient_bytes,
        forward=forward,
        backward=backward,
        live_at_peak=tuple(sorted(peak.live_at_peak, key=lambda a: -a.nbytes)),
        loss_peak_bytes=stage_peak(Stage.LOSS),
        optimizer_state_bytes=optimizer_state_bytes,
        phases=phases,
        optimizer_peak_bytes=stage_peak(Stage.OPTIMIZER),
    )
