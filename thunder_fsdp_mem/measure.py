"""One real training step, probed (``thunder-fsdp-mem report --measure``), set beside the prediction.

``measure_step(spec, rank, mode=..., ...) -> Measurement`` runs on every rank of a ``torchrun`` job (one process
for ``jit``). It builds the step ``modes.build`` makes for the report's mode, with ``MemoryProbeTransform`` after
every other transform, so that a probe follows each bound symbol of every execution trace. ``WARMUP`` steps
compile and create the optimizer state; the next step is recorded:
- on CUDA, after each symbol, ``memory_allocated`` and the peak since the previous probe (``max_memory_allocated``,
  then a reset). The peak of the forward and backward is the largest of those peaks and of the stretch from the
  last probe to the end of the backward; the optimizer step's is read apart (the prediction does not model it;
  ``benchmarks/compare.py``'s peak covers both);
- on CPU the same figures, from the allocations torch's profiler records (``cpu_memory``: MemTracker, a dispatch
  mode, would have Dynamo run the FSDP2 step eagerly); of ``cpu_memory.REPEATS`` recorded steps the one with the
  least peak is kept (the profiler does not see the frees on gloo's worker thread).

``compare(step, measurements) -> Comparison`` sets the prediction (a ``StepMemory``) beside the rank with the
highest measured peak. Each run of a forward or backward trace is paired, in order, with the next phase of the
prediction of the same kind that has a trace (under FSDP2, block after block). A sample then has a position on the
prediction's timeline (``report.timeline``), and its peak covers the predicted points since the previous sample:
the first probe of the backward also sees the eager loss and, under FSDP2, the eager units' backward before the
first block. Runs of traces without a backward (ThunderFX's graph of the root's rotary slices) pair with no phase;
their peaks count towards the next paired sample.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from thunder_fsdp_mem import models, modes, runtime
from thunder_fsdp_mem.cpu_memory import REPEATS
from thunder_fsdp_mem.probes import MemoryProbeTransform
from thunder_fsdp_mem.report import timeline
from thunder_fsdp_mem.step import StepMemory

WARMUP = 2
# The report's mode, with or without FSDPMemoryTransform -> the set-up ``modes.build`` makes.
TRAINERS = {
    ("fsdp2", False): "fsdp2-thunder", ("fsdp2", True): "fsdp2-thunder+mem",
    ("thunder-fsdp", False): "thunder-fsdp", ("thunder-fsdp", True): "thunder-fsdp+mem",
    ("jit", False): "thunder", ("jit", True): "thunder+mem",
}


@dataclass(frozen=True, slots=True)
class Sample:
    """After bound symbol ``index``: the live bytes, and the peak since the previous probe."""

    index: int
    live_bytes: int
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class Run:
    """One execution of a probed trace: its tag (``MemoryProbeTransform.traces``), kind (forward, backward,
    computation), the names of its bound symbols, and its samples in order."""

    tag: int
    kind: str
    symbols: tuple[str, ...]
    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Measurement:
    """One rank's recorded step. ``peak_bytes``: the peak of the forward and backward, what the prediction covers;
    ``step_peak_bytes``: with the optimizer step, what ``benchmarks/compare.py`` measures. ``after_probes_bytes``:
    the peak after the last probe until the optimizer step (the end of the backward)."""

    rank: int
    world_size: int
    device_type: str
    trainer: str
    peak_bytes: int
    step_peak_bytes: int
    after_probes_bytes: int
    runs: tuple[Run, ...]
    loss: float


def measure_step(spec: models.ModelSpec, rank: runtime.Rank, *, mode: str, shard: str | None = None,
                 executors: str = "default+cat", dtype: torch.dtype = torch.bfloat16, micro_batch_size: int = 1,
                 memory=None) -> Measurement:
    """This rank's measurement of one step of ``spec`` in the report's ``mode`` (``fsdp2``, ``thunder-fsdp``,
    ``jit``), with ``FSDPMemoryTransform`` configured by ``memory`` (None: without it)."""
    if (mode, memory is not None) not in TRAINERS:
        raise ValueError(f"mode must be one of fsdp2, thunder-fsdp, jit; got {mode!r}")
    recorder = _Recorder(rank.device)
    probe = MemoryProbeTransform(recorder)
    name = TRAINERS[mode, memory is not None]
    trainer = modes.build(name, spec, rank, shard=shard or "zero2", executors=executors, dtype=dtype, memory=memory,
                          probe=probe)
    idx, targets = models.batch(spec, micro_batch_size=micro_batch_size, device=rank.device, seed=rank.rank)
    for _ in range(WARMUP):
        trainer.step(idx, targets)
    best = None
    for _ in range(1 if recorder.cuda else REPEATS):
        with recorder.recording(trainer, idx, targets):
            loss = trainer.step(idx, targets, after_backward=recorder.backward_done)
        got = Measurement(rank.rank, rank.world_size, rank.device.type, name, recorder.peak, recorder.step_peak,
                          recorder.after_probes, _runs(recorder.samples, probe), float(loss))
        if best is None or got.peak_bytes < best.peak_bytes:
            best = got
    return best


def gather(measurement: Measurement) -> list[Measurement] | None:
    """Every rank's measurement on rank 0 (None on the others); the one alone without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [measurement]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(measurement, out, dst=0)
    return out


class _Recorder:
    """The probes' callback, recording while ``recording``; ``backward_done`` closes the forward and backward.
    On CPU the probes are marks in a ``cpu_memory.CPUMemory`` profile, read once the step is over."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.cpu_memory = None
        self.active = False
        self.samples: list[tuple[int, int, int, int]] = []  # (tag, index, live, peak); on CPU 0, 0 until read
        self.peak = self.step_peak = self.after_probes = 0

    def __call__(self, tag: int, index: int) -> None:
        if not self.active:
            return
        if self.cuda:
            live, peak = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.samples.append((tag, index, live, peak))
        else:
            self.cpu_memory.mark("probe")
            self.samples.append((tag, index, 0, 0))

    def backward_done(self) -> None:
        self.active = False
        if self.cuda:
            self.after_probes = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.cpu_memory.mark("backward done")

    @contextmanager
    def recording(self, trainer: modes.Trainer, idx: torch.Tensor, targets: torch.Tensor):
        self.samples.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.active = True
            yield
            torch.cuda.synchronize(self.device)
            self.peak = max([self.after_probes, *(s[3] for s in self.samples)])
            self.step_peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
            return
        from thunder_fsdp_mem.cpu_memory import CPUMemory

        with CPUMemory(trainer.model, trainer.optimizer, idx, targets) as self.cpu_memory:
            self.active = True
            yield
        *probes, done = self.cpu_memory.marks()
        self.samples = [(tag, index, m.live_bytes, m.peak_bytes) for (tag, index, _, _), m in zip(self.samples, probes)]
        self.after_probes = done.peak_bytes
        self.peak = max([done.peak_bytes, *(m.peak_bytes for m in probes)])
        self.step_peak = self.cpu_memory.peak_bytes
        self.cpu_memory = None


def _runs(samples: list[tuple[int, int, int, int]], probe: MemoryProbeTransform) -> tuple[Run, ...]:
    """The samples cut into runs: a new run where the trace changes or its symbols start again."""
    runs: list[tuple[int, list[Sample]]] = []
    for tag, index, live, peak in samples:
        if not runs or runs[-1][0] != tag or runs[-1][1][-1].index >= index:
            runs.append((tag, []))
        runs[-1][1].append(Sample(index, live, peak))
    return tuple(
        Run(tag, probe.kinds[tag], tuple(b.sym.name for b in probe.traces[tag].bound_symbols), tuple(got))
        for tag, got in runs
    )


# --- the prediction beside the measurement -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Comparison:
    """The prediction beside the measured rank (the one with the highest peak).

    ``points``: one per paired sample, (position on the prediction's timeline, measured, predicted): the peaks
    over the stretch since the previous sample.
    ``measured_at_predicted_peak``: the measured peak over the
    stretch that holds the predicted peak. ``stages``: (stage, predicted, measured) peaks over the stretches of
    the forward's samples, of the backward's (from the end of the forward: the loss included), and of both.
    ``step_peak_bytes``: the measured peak with the optimizer step, which the prediction does not model.
    ``paired``: runs paired with a phase; ``unpaired``: runs of traces with a backward, and phases with a trace,
    left without a partner ((0, 0) when the measured step ran the traces the prediction has)."""

    predicted_peak_bytes: int
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
        """(predicted - measured) / measured at the step's peak."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes


def compare(step: StepMemory, measurements: list[Measurement]) -> Comparison:
    """``step``'s prediction beside the rank of ``measurements`` with the highest peak."""
    measured = max(measurements, key=lambda m: m.peak_bytes)
    predicted, marks = timeline(step)
    starts = [start for _, start in marks] + [len(predicted)]
    traced = [(i, _kind(p.name)) for i, p in enumerate(step.phases) if p.timeline is not None]
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
            points.append((pos, max(s.peak_bytes, pending), max(predicted[since:pos + 1], default=0)))
            kinds.append(run.kind)
            where.append(f"{step.phases[phase_index].name}, symbol {s.index} ({run.symbols[s.index]})")
            pending = 0
    peak_pos = max(range(len(predicted)), key=predicted.__getitem__) if predicted else 0
    at_peak = next((b for pos, b, _ in points if pos >= peak_pos), measured.after_probes_bytes or None)
    top = max(range(len(points)), key=lambda i: points[i][1], default=None)
    if top is None or measured.after_probes_bytes > points[top][1]:
        where_peak = "after the last probe, before the optimizer step (the end of the backward)"
    else:
        where_peak = f"in the stretch up to the probe after {where[top]}"

    def stage(kind: str) -> tuple[int, int]:
        chosen = [pt for pt, k in zip(points, kinds) if k == kind]
        return max((pt[2] for pt in chosen), default=0), max((pt[1] for pt in chosen), default=0)

    return Comparison(
        predicted_peak_bytes=step.peak_bytes, measured_peak_bytes=measured.peak_bytes, rank=measured.rank,
        ranks_peak_bytes=tuple(m.peak_bytes for m in sorted(measurements, key=lambda m: m.rank)),
        device_type=measured.device_type, trainer=measured.trainer, measured_at_predicted_peak=at_peak,
        measured_peak_where=where_peak, step_peak_bytes=measured.step_peak_bytes,
        stages=(("forward", *stage("forward")), ("backward (the loss included)", *stage("backward")),
                ("forward and backward", step.peak_bytes, measured.peak_bytes)),
        points=tuple(points), paired=paired, unpaired=(unpaired_runs, len(traced) - paired),
    )


def _kind(phase_name: str) -> str:
    return "backward" if phase_name.startswith("backward") else "forward"
