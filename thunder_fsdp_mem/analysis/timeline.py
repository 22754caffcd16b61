"""What the liveness analysis returns: the allocations of a trace and its live bytes over time.

Entry points: ``MemoryTimeline`` (what ``liveness.analyze`` returns), ``Allocation`` (one storage, with where it was
allocated and freed), ``InputSpec`` (how a caller says a trace's input is held), ``OpMemory`` (what one bound symbol
does to memory, from ``MemoryTimeline.ops``).

Sizes are ``int`` bytes of the allocation (``numel * itemsize``, no allocator rounding); indices are positions in the
trace's ``bound_symbols``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.symbols import MATMULS


@dataclass(frozen=True, slots=True)
class InputSpec:
    """How a trace input's storage is held, for traces whose inputs come from elsewhere (a backward's saved
    tensors come from its forward).

    ``storage``: inputs with equal keys share one allocation. ``external``: held outside the trace (a module
    parameter, the caller's input), so the trace never frees it. ``nbytes``: the allocation's size when it is
    larger than this tensor (a view of a bigger storage); None means the tensor's own size.
    """

    storage: Hashable
    category: Category
    external: bool
    nbytes: int | None = None


_HEAD_OPS = MATMULS  # the ops a language-model head runs
_TRACE_NAME = re.compile(r"[a-z_]{1,4}\d+")


def is_trace_name(name: str) -> bool:
    """Whether ``name`` is one Thunder made up for a proxy (``t521``, ``ft2154``, ``bw_t3``): it tells no reader
    anything, and its number is no layer's."""
    return _TRACE_NAME.fullmatch(name) is not None


OUTSIDE = -1  # the ``start`` of an allocation held outside the traces (parameters, optimizer state, FSDP2's buffers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """One storage: who made it, how big, and the bound-symbol indices where it was allocated and freed.

    ``start``: the index of the symbol that allocated it (0 for the trace's inputs, which the caller passes);
    ``OUTSIDE`` for an allocation held outside the traces. ``end``: the index where it was freed, None when it
    outlives the trace. ``external``: held by someone other than the trace, which never frees it. ``module``:
    the model's module whose op made it (for a gradient or a parameter, the parameter); ``after``: where no module
    owns the op, the module whose output it reads; ``op``: the op that computed it (inside a fusion, the fused op,
    not the fusion); ``role``: ``logits``, ``loss`` (computed from the logits outside the model), ``gradient`` (of
    the parameter ``module``), ``parameter`` (the parameter ``module``: a trace's input, or gathered, reshaped or
    cast), ``cotangent`` (the gradient of the forward's ``op``, as a backward receives it). None where the trace
    does not tell; ``provenance`` finds them."""

    name: str
    nbytes: int
    category: Category
    shape: tuple[int, ...] = ()
    dtype: str = ""
    symbol: str = ""
    source: str | None = None
    start: int = OUTSIDE
    end: int | None = None
    external: bool = False
    module: str | None = None
    after: str | None = None
    op: str = ""
    role: str | None = None

    @property
    def label(self) -> str:
        """What a reader can place: the logits (``logits (lm_head)``), the loss's temporaries (``loss:
        log_softmax``), a parameter's gradient, the module and its op (``transformer.h.3.mlp.fc: linear``), an op
        after a module (``to after transformer.h.3.mlp.fc``), a gathered parameter by its name; where nothing is
        known, a tensor the trace named by its dtype, shape and op (``float32 (8192, 49152) log_softmax``), else
        the allocation's own name (``lm_head.weight (shard)``)."""
        op = self.op or self.symbol
        if self.role == "parameter" and self.module is not None:
            if self.category is Category.GATHERED_PARAMETER:
                return f"{self.module} (gathered)"
            return f"{self.module}: {self.op}" if self.op else self.module
        if self.role == "cotangent":
            return f"gradient of the {self.op}"
        if self.role == "gradient" and self.module is not None:
            return f"gradient of {self.module}"
        if self.role == "logits":
            return f"logits ({self.module})" if op in _HEAD_OPS else f"logits: {op}"
        if self.role == "loss":
            return f"loss: {op}"
        if self.module is not None:
            if self.category is Category.GATHERED_PARAMETER:
                return f"{self.module} (gathered)"
            return f"{self.module or 'model'}: {op}"
        if self.after is not None:
            return f"{op} after {self.after or 'model'}"
        if is_trace_name(self.name) and op not in ("", "input"):
            return f"{self.dtype} ({', '.join(map(str, self.shape))}) {op}"
        return self.name

    def live_at(self, index: int) -> bool:
        return self.start <= index and (self.end is None or index < self.end)


@dataclass(frozen=True, slots=True)
class OpMemory:
    """What one bound symbol does to memory: the allocations it ``made`` and those ``freed`` at it (indices into
    ``MemoryTimeline.allocations``), whether they were freed while it ran (``freed_first``: before its peak, as a
    wait releases the input it held) or after it (a ``del``), and its ``workspace`` bytes at its peak."""

    made: tuple[int, ...]
    freed: tuple[int, ...]
    freed_first: bool
    workspace: int


@dataclass(frozen=True, slots=True)
class MemoryTimeline:
    """Result of ``analyze``. Indices are positions in ``trace.bound_symbols``.

    ``timeline[i]``: live bytes after bound symbol i (frees of a ``del`` at i included); the trace's inputs count
    from the start, wherever the trace unpacks them.
    ``op_peaks[i]``: live bytes while bound symbol i runs: what was live, its outputs and its workspace.
    ``peak_bytes`` is ``max(op_peaks)``; ``live_at_peak`` lists the allocations alive then, its workspace
    included, so their sizes add up to ``peak_bytes``.
    ``outputs`` maps each name the trace returns to its index in ``allocations``.
    """

    peak_bytes: int
    peak_index: int
    peak_symbol: str
    timeline: tuple[int, ...]
    op_peaks: tuple[int, ...]
    live_at_peak: tuple[Allocation, ...]
    allocations: tuple[Allocation, ...]
    outputs: Mapping[str, int]
    symbols: tuple[str, ...]
    unknown_symbols: tuple[str, ...] = ()
    origins: Mapping[str, object] = field(default_factory=dict)  # name -> provenance.Origin of what the trace made

    @property
    def final_bytes(self) -> int:
        return self.timeline[-1] if self.timeline else 0

    def live_at(self, index: int) -> tuple[Allocation, ...]:
        return tuple(a for a in self.allocations if a.live_at(index))

    def ops(self) -> tuple[OpMemory, ...]:
        """What each bound symbol does to memory, in order (the trace's inputs are alive before the first)."""
        made: dict[int, list[int]] = {}
        freed: dict[int, list[int]] = {}
        live = 0
        for j, a in enumerate(self.allocations):
            if a.symbol == "input":
                live += a.nbytes
            else:
                made.setdefault(a.start, []).append(j)
            if a.end is not None:
                freed.setdefault(a.end, []).append(j)
        out = []
        for i, peak in enumerate(self.op_peaks):
            made_i, freed_i = tuple(made.get(i, ())), tuple(freed.get(i, ()))
            new = sum(self.allocations[j].nbytes for j in made_i)
            gone = sum(self.allocations[j].nbytes for j in freed_i)
            first = live + new > peak  # released while the symbol ran (a wait's held input), not after it
            out.append(OpMemory(made_i, freed_i, first, max(0, peak - (live + new - (gone if first else 0)))))
            live += new - gone
        return tuple(out)

    def bytes_by_category(self, allocations: tuple[Allocation, ...] | None = None) -> dict[Category, int]:
        out: dict[Category, int] = {}
        for a in self.live_at_peak if allocations is None else allocations:
            out[a.category] = out.get(a.category, 0) + a.nbytes
        return out
