"""Memory probes: a Thunder transform that calls back after chosen bound symbols of the execution traces, so a
real step can be measured op by op and set beside ``analyze``'s prediction.

``MemoryProbeTransform(callback, every=1)`` inserts, after every ``every``-th bound symbol of each trace it
sees (and always before the return), a call ``callback(trace_tag, index)``: ``trace_tag`` counts the traces the
transform has seen (0 = forward, 1 = backward for ``thunder.jit``), ``index`` is the position of the bound symbol
just executed in the trace the transform received, as ``analyze`` numbers it there (``traces[trace_tag]``; its
kind, forward, backward or a trace without a backward, in ``kinds[trace_tag]``). A probe has no tensor inputs or
outputs: it changes no result and no lifetime (``analyze`` treats it as a no-op).

List it after every other transform: it sees the traces as they will run.

Typical callbacks: ``torch.cuda.memory_allocated()`` and ``max_memory_allocated()`` with a peak reset (on GPU),
or MemTracker's current snapshot (on CPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from thunder.core.prims import PrimIDs
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform
from thunder.extend import OperatorExecutor, register_executor

_probe_ex = OperatorExecutor("thunder_fsdp_mem_probe", version="0.1")
register_executor(_probe_ex)
_callbacks: dict[int, Callable[[int, int], None]] = {}
_ids = itertools.count()


def _probe_meta(callback_id: int, trace_tag: int, index: int) -> None:
    return None


def _probe_impl(callback_id: int, trace_tag: int, index: int) -> None:
    _callbacks[callback_id](trace_tag, index)


memory_probe = _probe_ex.register_operator("memory_probe", meta=_probe_meta, fn=_probe_impl)


class MemoryProbeTransform(Transform):
    """Calls ``callback(trace_tag, index)`` after every ``every``-th bound symbol of each execution trace.

    Example::

        samples = []
        probe = MemoryProbeTransform(lambda tag, i: samples.append((tag, i, torch.cuda.memory_allocated())))
        jitted = thunder.jit(model, transforms=[probe])

    Limitations: it keeps a reference to ``callback`` for the life of the process; use one instance per model.
    """

    def __init__(self, callback: Callable[[int, int], None], *, every: int = 1):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.callback_id = next(_ids)
        _callbacks[self.callback_id] = callback
        self.traces: list[TraceCtx] = []  # by trace tag: the trace received, before the probes
        self.kinds: list[str] = []  # by trace tag: "forward", "backward" or "computation" (no backward)

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        tag = len(self.traces)
        self.traces.append(computation_trace)
        self.kinds.append(trace_kind(computation_trace))
        return insert_probes(computation_trace, self.callback_id, tag, self.every)


def trace_kind(trace: TraceCtx) -> str:
    """``forward`` (a forward with a backward), ``backward``, or ``computation`` (a trace without a backward)."""
    if TraceTag.AUGMENTED_FORWARD in trace.tags:
        return "forward"
    if TraceTag.BACKWARD in trace.tags:
        return "backward"
    return "computation"


def insert_probes(trace: TraceCtx, callback_id: int, tag: int, every: int) -> TraceCtx:
    """A copy of ``trace`` with a probe after every ``every``-th bound symbol and one before the return; each probe
    names the position in ``trace`` of the symbol before it."""
    new = from_trace(trace)
    bsyms = []
    for index, bsym in enumerate(trace.bound_symbols):
        is_return = bsym.sym.id == PrimIDs.RETURN
        if not is_return:
            bsyms.append(bsym)
        if is_return and index % every != 0:  # the last symbol before the return, where no probe follows it yet
            bsyms.append(memory_probe.bind(callback_id, tag, index - 1, output=None))
        elif not is_return and (index + 1) % every == 0:
            bsyms.append(memory_probe.bind(callback_id, tag, index, output=None))
        if is_return:
            bsyms.append(bsym)
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance("Memory probes (thunder_fsdp_mem)"))
    return new
