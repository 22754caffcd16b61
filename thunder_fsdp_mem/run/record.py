"""What a run did, computed once at its end (``record(injection, exit_code) -> Record``) and rendered as the short
block the runner prints (``render``) or as JSON (``as_json``): for each Thunder function the program built, one line
of what its transform did (the estimated peak and saved bytes of its last forward/backward pair before and after,
the passes applied, what was left and why), alike lines of consecutive functions once (a model's blocks under
ThunderFX); the executors given instead of the program's; the memory CUDA measured over the whole run
(``max_memory_allocated``/``max_memory_reserved`` since the process started, or since the program last reset them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from thunder_fsdp_mem.config import SIZE_FIELDS, MemoryConfig
from thunder_fsdp_mem.passes.driver import Outcome, Rewrite
from thunder_fsdp_mem.run.inject import Injection
from thunder_fsdp_mem.transform import FSDPMemoryTransform
from thunder_fsdp_mem.units import format_bytes


@dataclass(frozen=True, slots=True)
class Compiled:
    """One Thunder function: its ``kind`` (``inject.Program.kind``), the forward/backward pairs its transform saw,
    the estimated step peak and saved bytes of the last pair before the passes and after (None where nothing was
    estimated), the passes applied to it, and ``notes``: what a pass left, refused or did before autograd, as
    ``pass: what``. ``own``: the program passed its own transform, which this is."""

    kind: str
    pairs: int
    peak_before: int | None
    peak_after: int | None
    saved_before: int | None
    saved_after: int | None
    applied: tuple[str, ...]
    notes: tuple[str, ...]
    own: bool = False

    def line(self) -> str:
        if self.pairs == 0 and not self.notes:
            return "no forward/backward pair (no backward ran through it)"
        parts = []
        if self.peak_before is not None:
            parts.append(f"estimated peak {format_bytes(self.peak_before)} -> {format_bytes(self.peak_after)}")
            parts.append(f"saved {format_bytes(self.saved_before)} -> {format_bytes(self.saved_after)}")
        parts.append("applied: " + (", ".join(self.applied) if self.applied else "nothing"))
        return "; ".join([*parts, *self.notes])


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """What CUDA's caching allocator measured on this process's device."""

    device: str
    max_allocated: int
    max_reserved: int
    alloc_retries: int


@dataclass(frozen=True, slots=True)
class Record:
    """A run: its exit code, the configuration's fields that differ from the defaults, the executors given instead
    of the program's (and the program's, as its first function passed them), every function compiled, and CUDA's
    measurement (None where the program did not use CUDA)."""

    exit_code: int
    config: dict[str, object]
    executors: tuple[str, ...] | None
    program_executors: tuple[str, ...] | None
    compiled: tuple[Compiled, ...]
    cuda: CudaMemory | None


def record(injection: Injection, exit_code: int) -> Record:
    compiled = []
    for program in injection.programs:
        transform = program.transform or program.own
        compiled.append(_compiled(program.kind, transform, own=program.transform is None))
    replaced = next((p.replaced for p in injection.programs if p.replaced is not None), None)
    return Record(
        exit_code=exit_code,
        config=_changed(injection.config),
        executors=injection.executors,
        program_executors=replaced,
        compiled=tuple(compiled),
        cuda=_cuda(),
    )


def render(r: Record) -> str:
    """The block the runner prints: a heading, then one line per run of alike functions, then CUDA's figures."""
    config = ", ".join(f"{k}={_value(k, v)}" for k, v in r.config.items()) or "the defaults"
    lines = [f"thunder-fsdp-mem run: FSDPMemoryTransform ({config}) in {len(r.compiled)} Thunder function(s)"]
    if r.executors is not None:
        lines.append(
            f"  executors changed from the program's: [{', '.join(r.program_executors or ())}] replaced by "
            f"[{', '.join(r.executors)}]"
        )
    if not r.compiled:
        lines.append("  the program built no Thunder function: nothing was transformed")
    for first, last, c in _alike(r.compiled):
        where = f"function {first}" if first == last else f"functions {first}-{last} ({last - first + 1} alike)"
        own = ", the program's own transform" if c.own else ""
        lines.append(f"  {where} ({c.kind}{own}): {c.line()}")
    if r.cuda is not None:
        m = r.cuda
        lines.append(
            f"  CUDA ({m.device}): max allocated {format_bytes(m.max_allocated)}, max reserved "
            f"{format_bytes(m.max_reserved)}, {m.alloc_retries} allocation retries"
        )
    if r.exit_code != 0:
        lines.append(f"  the program exited with {r.exit_code}")
    return "\n".join(lines)


def as_json(r: Record) -> dict:
    out = dataclasses.asdict(r)
    out["compiled"] = [{**dataclasses.asdict(c), "line": c.line()} for c in r.compiled]
    return out


def _compiled(kind: str, transform: FSDPMemoryTransform, *, own: bool) -> Compiled:
    """The last pair's figures (the first estimate of the passes, before any, and the last applied one's, after), the
    passes applied to it, and what the passes said that the figures do not: what one before autograd did, what one
    left or refused, and why."""
    last_pair = max((r.pair for r in transform.rewrites), default=0)
    last = [r for r in transform.rewrites if r.pair == last_pair]
    estimated = [r for r in last if r.peak_before is not None]
    kept = [r for r in estimated if r.outcome is Outcome.APPLIED]
    peak = saved = (None, None)
    if estimated:
        first = estimated[0]
        peak = (first.peak_before, kept[-1].peak_after if kept else first.peak_before)
        saved = (first.saved_before, kept[-1].saved_after if kept else first.saved_before)
    said = [r for r in last if r.note and (r.outcome in (Outcome.LEFT, Outcome.REFUSED) or r.peak_before is None)]
    return Compiled(
        kind=kind,
        pairs=transform.pairs,
        peak_before=peak[0],
        peak_after=peak[1],
        saved_before=saved[0],
        saved_after=saved[1],
        applied=tuple(dict.fromkeys(r.pass_name for r in last if r.outcome is Outcome.APPLIED)),
        notes=tuple(_note(r) for r in said if r.outcome is not Outcome.UNCHANGED),
        own=own,
    )


def _note(r: Rewrite) -> str:
    if r.outcome is Outcome.APPLIED:
        return f"{r.pass_name}: {r.note}"
    return f"{r.pass_name} {r.outcome.value}: {r.note}"


def _alike(compiled: tuple[Compiled, ...]):
    """(first index, last index, the function) of each run of consecutive functions that render alike."""
    runs = []
    for i, c in enumerate(compiled):
        if runs and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], i, c)
        else:
            runs.append((i, i, c))
    return runs


def _value(field: str, value) -> str:
    return format_bytes(value) if field in SIZE_FIELDS and value is not None else repr(value)


def _changed(config: MemoryConfig) -> dict[str, object]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if getattr(config, f.name) != f.default}


def _cuda() -> CudaMemory | None:
    if not torch.cuda.is_initialized():
        return None
    stats = torch.cuda.memory_stats()
    return CudaMemory(
        device=torch.cuda.get_device_name(),
        max_allocated=torch.cuda.max_memory_allocated(),
        max_reserved=torch.cuda.max_memory_reserved(),
        alloc_retries=stats.get("num_alloc_retries", 0),
    )
