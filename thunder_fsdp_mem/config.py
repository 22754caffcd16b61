"""The one typed configuration of ``FSDPMemoryTransform``; the transform, the CLI and the benchmark build it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

DEFAULT_RECOMPUTE_WEIGHT = 0.04


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Options of ``FSDPMemoryTransform``.

    rematerialize: choose what the forward saves for backward by a minimum cut, recomputing cheap ops in
        backward (``recompute.py``).
    recompute_weight: what one byte that recomputation reads or writes costs, in bytes saved for backward. The
        cut minimises saved bytes + ``recompute_weight`` x recomputation traffic: 0 saves the least whatever the
        recomputation costs; larger values recompute only where it saves much for little traffic (a float >= 0).
    reorder: put each trace's symbols in the order of lowest estimated peak, of three list schedules and the
        trace's own (``reorder.py``); collectives keep their order.
    strict: raise instead of warning when a trace is not understood or a rewrite fails its checks (a warning
        returns the trace unchanged).
    """

    rematerialize: bool = True
    recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT
    reorder: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
                    and value >= 0
                if not ok:
                    raise ValueError(f"MemoryConfig.{f.name} must be a finite number >= 0, got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"MemoryConfig.{f.name} must be a bool (True or False), got {value!r}")
