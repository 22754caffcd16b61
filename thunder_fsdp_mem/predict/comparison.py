"""A measured step beside its prediction (``thunder-fsdp-mem report --measure``).

``compare(step, measurements) -> Comparison`` sets the prediction (a ``StepMemory``) beside the rank with the
highest measured peak (``measure.Measurement``). Each run of a forward or backward trace is paired, in order, with
the next phase of the prediction of the same stage that has a trace (under FSDP2, block after block). A sample then
has a position on the prediction's timeline (``StepMemory.timeline``), and its peak covers the predicted points
since the previous sample: the first probe of the backward also sees the eager loss and, under FSDP2, the eager
units' backward before the first block. Runs of traces without a backward (ThunderFX's graph of the root's rotary
slices) pair with no phase; their peaks count towards the next paired sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunder_fsdp_mem.analysis.phases import Stage, StepMemory
from thunder_fsdp_mem.predict.measure import Measurement


@dataclass(frozen=True, slots=True)
class Comparison:
    """The prediction beside the measured rank (the one with the highest peak).

    ``points``: one per paired sample, (position on the prediction's timeline, measured, predicted): the peaks
    over the stretch since the previous sample.
    ``predicted_peak_bytes`` / ``measured_peak_bytes``: of the forward and the backward (the loss included), what
    the probes measure; ``measured_at_predicted_peak``: the measured peak over the stretch that holds the
    predicted one. ``predicted_step_peak_bytes`` / ``step_peak_bytes``: of the whole step, the optimizer step
    included (what ``max_memory_allocated`` over a step says). ``stages``: (stage, predicted, measured) peaks over
    the stretches of the forward's samples, of the backward's (from the end of the forward: the loss included), of
    both, of the optimizer's step (from the end of the backward; where the prediction models it) and of the whole
    step.
    ``paired``: runs paired with a phase; ``unpaired``: runs of traces with a backward, and phases with a trace,
    left without a partner ((0, 0) when the measured step ran the traces the prediction has)."""

    predicted_peak_bytes: int
    predicted_step_peak_bytes: int
    measured_peak_bytes: int
    rank: int
    ranks_peak_bytes: tuple[int, ...]
    device_type: str
    trainer: str
    measured_at_predicted_peak: int | None
    measured_peak_where: str
    step_peak_bytes: int
    stages: tuple[tuple[str, int, int], ...]
    points: tuple[tuple[int, int, int], ...]
    paired: int
    unpaired: tuple[int, int]

    @property
    def error(self) -> float:
        """(predicted - measured) / measured at the peak of the forward and backward."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured at the whole step's peak, the optimizer step included."""
        return (self.predicted_step_peak_bytes - self.step_peak_bytes) / self.step_peak_bytes


def compare(step: StepMemory, measurements: list[Measurement]) -> Comparison:
    """``step``'s prediction beside the rank of ``measurements`` with the highest peak."""
    measured = max(measurements, key=lambda m: m.peak_bytes)
    timeline = step.timeline()
    predicted = timeline.points
    starts = [*timeline.starts, len(predicted)]
    traced = [(i, p.stage) for i, p in enumerate(step.phases) if p.timeline is not None]
    points: list[tuple[int, int, int]] = []
    kinds: list[str] = []
    where: list[str] = []
    pending = 0  # peaks of unpaired runs, counted towards the next paired sample
    next_phase, paired, unpaired_runs = 0, 0, 0
    for run in measured.runs:
        match = next((j for j in range(next_phase, len(traced)) if traced[j][1] == run.kind), None)
        if match is None:
            unpaired_runs += run.kind != "computation"
            pending = max([pending, *(s.peak_bytes for s in run.samples)])
            continue
        phase_index = traced[match][0]
        next_phase, paired = match + 1, paired + 1
        start, size = starts[phase_index], starts[phase_index + 1] - starts[phase_index]
        for s in run.samples:
            if run.symbols[s.index].startswith("unpack"):  # the prediction counts an input from its unpacking on
                pending = max(pending, s.peak_bytes)
                continue
            pos = start + min(size - 1, s.index * size // len(run.symbols))
            since = points[-1][0] + 1 if points else 0
            points.append((pos, max(s.peak_bytes, pending), max(predicted[since : pos + 1], default=0)))
            kinds.append(run.kind)
            where.append(f"{step.phases[phase_index].name}, symbol {s.index} ({run.symbols[s.index]})")
            pending = 0
    training = next((starts[i] for i, p in enumerate(step.phases) if p.stage is Stage.OPTIMIZER), len(predicted))
    peak_pos = max(range(training), key=predicted.__getitem__) if training else 0
    at_peak = next((b for pos, b, _ in points if pos >= peak_pos), measured.after_probes_bytes or None)
    top = max(range(len(points)), key=lambda i: points[i][1], default=None)
    if top is None or measured.after_probes_bytes > points[top][1]:
        where_peak = "after the last probe, before the optimizer step (the end of the backward)"
    else:
        where_peak = f"in the stretch up to the probe after {where[top]}"

    def stage(of: Stage) -> tuple[int, int]:
        chosen = [pt for pt, k in zip(points, kinds) if k == of]
        return max((pt[2] for pt in chosen), default=0), max((pt[1] for pt in chosen), default=0)

    return Comparison(
        predicted_peak_bytes=step.training_peak_bytes,
        predicted_step_peak_bytes=step.peak_bytes,
        measured_peak_bytes=measured.peak_bytes,
        rank=measured.rank,
        ranks_peak_bytes=tuple(m.peak_bytes for m in sorted(measurements, key=lambda m: m.rank)),
        device_type=measured.device_type,
        trainer=measured.trainer,
        measured_at_predicted_peak=at_peak,
        measured_peak_where=where_peak,
        step_peak_bytes=measured.step_peak_bytes,
        stages=(
            ("forward", *stage(Stage.FORWARD)),
            ("backward (the loss included)", *stage(Stage.BACKWARD)),
            ("forward and backward", step.training_peak_bytes, measured.peak_bytes),
            *(
                [("the optimizer step", step.optimizer_peak_bytes, measured.optimizer_peak_bytes)]
                if step.optimizer_peak_bytes
                else []
            ),
            ("the whole step, the optimizer step included", step.peak_bytes, measured.step_peak_bytes),
        ),
        points=tuple(points),
        paired=paired,
        unpaired=(unpaired_runs, len(traced) - paired),
    )
