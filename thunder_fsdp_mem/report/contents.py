"""What the report shows, computed once from a step: ``build_report(step, title=...) -> Report``.

A report holds one plan, or two side by side: the step without ``FSDPMemoryTransform`` and with it; and with
``--measure``, the measured step beside the plan shown (``comparison.Comparison``). The top allocations at the peak
are grouped: allocations of the same shape, dtype, category, producing symbol (and op in it) and source line (one
per block of a litgpt model) are one row with a count, named by ``pattern_name``. Everything here is frozen data;
the renderers (``text``, ``as_json``, ``plot``) only read it.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from dataclasses import dataclass

from thunder_fsdp_mem.analysis.timeline import is_trace_name
from thunder_fsdp_mem.analysis.caching_allocator import Reserved, replay_step
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.phases import StepMemory
from thunder_fsdp_mem.passes.driver import Rewrite
from thunder_fsdp_mem.predict.comparison import Comparison
from thunder_fsdp_mem.report.advice import Advice, advice, bytes_by_category
from thunder_fsdp_mem.units import format_bytes


@dataclass(frozen=True, slots=True)
class TopAllocation:
    """Allocations alive at the peak that share a pattern: ``count`` of them, ``nbytes`` each; ``name`` is
    ``pattern_name`` of their labels (what made them, the layers' numbers as a range: ``Allocation.label``);
    ``trace_name``: the first one's name in its trace, for whoever reads traces."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    category: Category
    symbol: str
    source: str | None
    count: int = 1
    trace_name: str = ""

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
    reserved: Reserved | None = None  # the caching allocator replayed over the step (CUDA runs)


@dataclass(frozen=True, slots=True)
class Report:
    """What the report shows. ``plans``: one, or (without the transform, with it); the last is the one whose
    top allocations and peak the report lists, and the one ``measured`` was run with. ``rewrites``: the
    transform's record of that plan (``FSDPMemoryTransform.rewrites``)."""

    title: str
    plans: tuple[Plan, ...]
    measured: Comparison | None = None
    rewrites: tuple[Rewrite, ...] = ()  # what each pass of the transform did, for the plan with it
    budget: int | None = None  # the per-rank peak the plan with the transform was asked to fit
    advice: tuple[Advice, ...] = ()  # what would lower the shown plan's peak
    settings: tuple[tuple[str, object], ...] = ()  # what the step was made of (model, tokens, mode...), by name
    versions: tuple[tuple[str, str], ...] = ()  # of this package and what it predicts with
    memory_cap: int | None = None  # the per-rank limit the caching allocator was replayed under

    @property
    def shown(self) -> Plan:
        return self.plans[-1]


def build_report(
    step: StepMemory,
    *,
    title: str,
    top: int = 10,
    baseline: StepMemory | None = None,
    measured: Comparison | None = None,
    rewrites: tuple[Rewrite, ...] = (),
    budget: int | None = None,
    settings: dict[str, object] | None = None,
    caching: bool = False,
    memory_cap: int | None = None,
) -> Report:
    """``step``: the plan the report lists; ``baseline``: the same step without the transform, shown beside;
    ``measured``: ``step`` beside a real run of it; ``rewrites``: what the transform did to make ``step``;
    ``budget``: the per-rank peak it was asked to fit; ``settings``: what the step was made of, by name;
    ``caching``: replay CUDA's caching allocator over each plan (``reserved.replay_step``), under ``memory_cap``
    per rank where given."""
    if memory_cap is not None and not caching:
        raise ValueError("memory_cap needs caching=True: a cap limits what the CUDA caching allocator reserves")
    plans = [] if baseline is None else [_plan("without transform", baseline, top, caching, memory_cap)]
    label = (
        "estimate"
        if baseline is None
        else ("with transform" if budget is None else f"with transform, budget {format_bytes(budget)}")
    )
    plans.append(_plan(label, step, top, caching, memory_cap))
    return Report(
        title=title,
        plans=tuple(plans),
        measured=measured,
        rewrites=tuple(rewrites),
        budget=budget,
        advice=advice(step),
        settings=tuple((settings or {}).items()),
        versions=versions(),
        memory_cap=memory_cap,
    )


# distribution -> its module: the module's own ``__version__`` where it is imported (torch's names its CUDA build)
VERSIONED = {
    "thunder-fsdp-mem": "thunder_fsdp_mem",
    "lightning-thunder": "thunder",
    "torch": "torch",
    "litgpt": "litgpt",
    "nvfuser": "nvfuser",
}


def versions() -> tuple[tuple[str, str], ...]:
    """The versions of ``VERSIONED``'s distributions that are installed."""
    out = []
    for name, module in VERSIONED.items():
        version = getattr(sys.modules.get(module), "__version__", None)
        try:
            out.append((name, str(version or importlib.metadata.version(name))))
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(out)


def summary_rows(step: StepMemory) -> list[tuple[str, str, int]]:
    """(label, JSON key, bytes) of the summary lines, as the text and the JSON both show them."""
    return [
        ("persistent (parameters, buffers, inputs)", "persistent_bytes", step.persistent_bytes),
        ("optimizer state", "optimizer_state_bytes", step.optimizer_state_bytes),
        ("forward peak", "forward_peak_bytes", step.forward_peak_bytes),
        ("saved for backward", "saved_bytes", step.saved_bytes),
        ("backward peak", "backward_peak_bytes", step.backward_peak_bytes),
        ("gradients", "gradient_bytes", step.gradient_bytes),
        ("optimizer step peak", "optimizer_peak_bytes", step.optimizer_peak_bytes),
        ("step peak", "peak_bytes", step.peak_bytes),
    ]


def _plan(label: str, step: StepMemory, top: int, caching: bool = False, memory_cap: int | None = None) -> Plan:
    groups: dict[tuple, list] = {}
    for a in step.live_at_peak:
        key = (a.shape, a.dtype, a.category, a.symbol, a.op, a.role, a.source, a.nbytes)
        groups.setdefault(key, []).append(a)
    rows = [
        TopAllocation(
            pattern_name([a.label for a in g]),
            g[0].shape,
            g[0].dtype,
            g[0].nbytes,
            g[0].category,
            g[0].symbol,
            g[0].source,
            len(g),
            g[0].name,
        )
        for g in groups.values()
    ]
    rows.sort(key=lambda t: -t.total_bytes)
    reserved = replay_step(step, cap=memory_cap) if caching else None
    by_category = tuple(sorted(bytes_by_category(step).items(), key=lambda kv: -kv[1]))
    return Plan(label, step, by_category, tuple(rows[:top]), reserved)


def pattern_name(names: list[str]) -> str:
    """One name for a group: where the names differ only in numbers, those numbers as ranges
    (``block [0-31].mlp.fc.weight (gathered)``); where they also differ in one word, its variants joined by ``/``
    (``AdamW exp_avg/exp_avg_sq of transformer.h.[0-11].mlp.fc.weight``); where they differ in more, the first and
    how many more (``AdamW exp_avg of lm_head.weight and 3 more``); for a trace's own names, the first."""
    if is_trace_name(names[0]):
        return names[0]
    ranged = _ranged(names)
    if ranged is not None:
        return ranged
    words = [name.split(" ") for name in names]
    alike = all(len(w) == len(words[0]) for w in words)
    differing = [i for i in range(len(words[0])) if alike and len({re.sub(r"\d+", "#", w[i]) for w in words}) > 1]
    if alike and len(differing) == 1:
        (k,) = differing
        ranged = _ranged([" ".join([*w[:k], "\0", *w[k + 1 :]]) for w in words])
        if ranged is not None:
            return ranged.replace("\0", "/".join(dict.fromkeys(w[k] for w in words)))
    return f"{names[0]} and {len(names) - 1} more"


def _ranged(names: list[str]) -> str | None:
    """The names as one, their differing numbers as ranges; None where they differ in more than numbers."""
    parts = [re.split(r"(\d+)", name) for name in names]
    first = parts[0]
    if any(len(p) != len(first) or p[0::2] != first[0::2] for p in parts):
        return None
    out = []
    for i, piece in enumerate(first):
        values = sorted({int(p[i]) for p in parts}) if i % 2 else []
        out.append(piece if len(values) <= 1 else _numbers(values))
    return "".join(out)


def _numbers(values: list[int]) -> str:
    if values == list(range(values[0], values[-1] + 1)):
        return f"[{values[0]}-{values[-1]}]"
    return "[" + ",".join(map(str, values[:4])) + (",..." if len(values) > 4 else "") + "]"
