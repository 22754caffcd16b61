"""The one typed configuration of ``FSDPMemoryTransform``; the transform, the CLI and the benchmark build it."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_RECOMPUTE_WEIGHT = 0.04
DEFAULT_MAX_INFLIGHT_ALLGATHERS = 2
DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Options of ``FSDPMemoryTransform``.

    fold_casts: run each elementwise op that Thunder brackets between an upcast to float32 and a rounding back
        as one op in the 16-bit dtype, where ATen's kernel is known to give the same bits (``casts.py``).
    rematerialize: choose what the forward saves for backward by a minimum cut, recomputing cheap ops in
        backward (``recompute.py``).
    recompute_weight: what one byte that recomputation reads or writes costs, in bytes saved for backward. The
        cut minimises saved bytes + ``recompute_weight`` x recomputation traffic: 0 saves the least whatever the
        recomputation costs; larger values recompute only where it saves much for little traffic (a float >= 0).
    reorder: put each trace's symbols in the order of lowest estimated peak, of three list schedules and the
        trace's own (``reorder.py``); collectives keep their order.
    gathers: under Thunder's fsdp, schedule the all-gathers (``gathers.py``).
    max_inflight_allgathers: under Thunder's fsdp, how many all-gathers may be in flight ahead of the one being
        waited for (``gathers.py``; an int >= 1).
    scatters: under Thunder's fsdp, issue each gradient's reduce-scatter as soon as the gradient is complete
        (``scatters.py``).
    max_inflight_reduce_scatters: under Thunder's fsdp, how many reduce-scatters may be in flight before the
        oldest is waited for (``scatters.py``; an int >= 1).
    regather: under Thunder's fsdp, save parameter shards instead of gathered parameters and gather again in
        backward. None (the default) does so when the model is sharded with ZeRO3.
    strict: raise instead of warning when a trace is not understood or a rewrite fails its checks (a warning
        returns the trace unchanged).
    """

    fold_casts: bool = True
    rematerialize: bool = True
    recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT
    reorder: bool = True
    gathers: bool = True
    max_inflight_allgathers: int = DEFAULT_MAX_INFLIGHT_ALLGATHERS
    scatters: bool = True
    max_inflight_reduce_scatters: int = DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS
    regather: bool | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        for name in ("fold_casts", "rematerialize", "reorder", "gathers", "scatters", "strict"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool (True or False)")
        w = self.recompute_weight
        _check("recompute_weight", w, _number(w) and math.isfinite(w) and w >= 0, "a finite number >= 0")
        for name in ("max_inflight_allgathers", "max_inflight_reduce_scatters"):
            n = getattr(self, name)
            _check(name, n, isinstance(n, int) and not isinstance(n, bool) and n >= 1, "an int >= 1")
        _check("regather", self.regather, self.regather is None or isinstance(self.regather, bool),
               "True, False or None (as the sharding strategy says)")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"MemoryConfig.{name} must be {allowed}, got {value!r}")
