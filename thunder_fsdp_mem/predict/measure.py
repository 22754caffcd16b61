"""One real training step, probed (``thunder-fsdp-mem report --measure``), set beside the prediction.

``measure_step(spec, rank, mode=..., ...) -> Measurement`` runs on every rank of a ``torchrun`` job (one process
for ``jit``). It builds the step ``modes.build`` makes for the report's mode, with ``MemoryProbeTransform`` after
every other transform, so that a probe follows each bound symbol of every execution trace. ``WARMUP`` steps
compile and create the optimizer state; the next step is recorded:
- on CUDA, after each symbol, ``memory_allocated`` and the peak since the previous probe (``max_memory_allocated``,
  then a reset). The peak of the forward and backward is the largest of those peaks and of the stretch from the
  last probe to the end of the backward; the whole step's, the optimizer step's included, is read apart (what
  ``benchmarks/performance/compare.py`` measures). With ``snapshot=True`` rank 0 also records the allocator's history of
  the step (``torch.cuda.memory._record_memory_history``) and keeps its ``_snapshot()``;
- on CPU the same figures, from the allocations torch's profiler records (``cpu_memory``: MemTracker, a dispatch
  mode, would have Dynamo run the FSDP2 step eagerly); of ``cpu_memory.REPEATS`` recorded steps the one with the
  least peak is kept (the profiler does not see the frees on gloo's worker thread).

``comparison.compare`` sets the measurements beside the prediction.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

import torch.distributed as dist

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.predict.cpu_memory import REPEATS, CPUMemory
from thunder_fsdp_mem.predict.probes import MemoryProbeTransform
from thunder_fsdp_mem.training import litgpt_models, modes, runtime

WARMUP = 2
# The report's mode, with or without FSDPMemoryTransform -> the set-up ``modes.build`` makes.
TRAINERS = {
    ("fsdp2", False): "fsdp2-thunder",
    ("fsdp2", True): "fsdp2-thunder+mem",
    ("thunder-fsdp", False): "thunder-fsdp",
    ("thunder-fsdp", True): "thunder-fsdp+mem",
    ("jit", False): "thunder",
    ("jit", True): "thunder+mem",
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
    ``step_peak_bytes``: with the optimizer step, what ``benchmarks/performance/compare.py`` measures.
    ``after_probes_bytes``: the peak after the last probe until the optimizer step (the end of the backward);
    ``optimizer_peak_bytes``: from there to the end of the step (the optimizer's step). ``snapshot``: the CUDA
    allocator's ``torch.cuda.memory._snapshot()`` of the recorded step, where asked for (rank 0, CUDA)."""

    rank: int
    world_size: int
    device_type: str
    trainer: str
    peak_bytes: int
    step_peak_bytes: int
    after_probes_bytes: int
    runs: tuple[Run, ...]
    loss: float
    snapshot: dict | None = None
    optimizer_peak_bytes: int = 0


def measure_step(
    spec: litgpt_models.ModelSpec,
    rank: runtime.Rank,
    *,
    mode: str,
    shard: str | None = None,
    executors: str = "default+cat",
    dtype: torch.dtype = torch.bfloat16,
    micro_batch_size: int = 1,
    memory: MemoryConfig | None = None,
    snapshot: bool = False,
    loss: str = "eager",
) -> Measurement:
    """This rank's measurement of one step of ``spec`` in the report's ``mode`` (``fsdp2``, ``thunder-fsdp``,
    ``jit``), with ``FSDPMemoryTransform`` configured by ``memory`` (None: without it). ``snapshot``: on CUDA, rank
    0 records the allocator's history of the step (``Measurement.snapshot``). ``loss``: where the step computes its
    loss (``eager`` or ``trace``: ``modes.build``'s)."""
    if (mode, memory is not None) not in TRAINERS:
        raise ValueError(f"mode must be one of fsdp2, thunder-fsdp, jit; got {mode!r}")
    recorder = _Recorder(rank.device)
    probe = MemoryProbeTransform(recorder)
    name = TRAINERS[mode, memory is not None]
    configured = {"memory": memory} if memory is not None else {}
    trainer = modes.build(
        name,
        spec,
        rank,
        shard=shard or "zero2",
        executors=executors,
        dtype=dtype,
        probe=probe,
        loss=loss,
        **configured,
    )
    idx, targets = litgpt_models.batch(spec, micro_batch_size=micro_batch_size, device=rank.device, seed=rank.rank)
    for _ in range(WARMUP):
        trainer.step(idx, targets)
    best = None
    history = snapshot and recorder.cuda and rank.rank == 0
    for _ in range(1 if recorder.cuda else REPEATS):
        with _allocator_history(history) as recorded, recorder.recording(trainer, idx, targets):
            loss = trainer.step(idx, targets, after_backward=recorder.backward_done)
        got = Measurement(
            rank.rank,
            rank.world_size,
            rank.device.type,
            name,
            recorder.peak,
            recorder.step_peak,
            recorder.after_probes,
            _runs(recorder.samples, probe),
            float(loss),
            recorded.get("snapshot"),
            recorder.optimizer_peak,
        )
        if best is None or got.peak_bytes < best.peak_bytes:
            best = got
    return best


@contextmanager
def _allocator_history(on: bool):
    """Records the CUDA allocator's history while open (``on``); the snapshot lands in the yielded dict."""
    out: dict = {}
    if not on:
        yield out
        return
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        yield out
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def gather(measurement: Measurement) -> list[Measurement] | None:
    """Every rank's measurement on rank 0 (None on the others); the one alone without a process group."""
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
        self.peak = self.step_peak = self.after_probes = self.optimizer_peak = 0

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
            self.optimizer_peak = torch.cuda.max_memory_allocated(self.device)  # since the end of the backward
            self.step_peak = max(self.peak, self.optimizer_peak)
            return
        with CPUMemory(trainer.model, trainer.optimizer, idx, targets) as self.cpu_memory:
            self.active = True
            yield
            self.cpu_memory.mark("step done")
        *probes, done, end = self.cpu_memory.marks()
        self.optimizer_peak = end.peak_bytes
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
