"""``FSDPMemoryTransform``: the Thunder glue. It holds the configuration and hands each execution trace to the
passes; the traces it returns compute exactly what the traces it received compute.

Thunder calls ``transform_trace_post_optimization`` on a forward execution trace and right after on its
backward (under ``thunder.jit``, Thunder's ``fsdp`` and each ThunderFX subgraph alike). What the forward saves can
only be chosen with both in hand, so the forward call returns a trace of its own whose symbols the backward call
fills in, before Thunder turns either into Python. Every rewrite passes ``checks.check_rewrite`` and is kept only
if ``step.estimate_traces``, the estimator of the whole step, says its peak did not rise: rematerialization
(``recompute.py``) first, then the order of each trace (``reorder.py``).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform

from thunder_fsdp_mem import checks, recompute, reorder
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.step import estimate_traces

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What the transform did to one forward/backward pair: saved-for-backward bytes (beyond the forward's
    inputs) before and after, the bytes its recomputation reads and writes, and the estimated peak of the step
    before and after; ``kept`` is False where the rewrite would have raised the peak."""

    saved_before: int
    saved_after: int
    traffic: int
    peak_before: int
    peak_after: int
    kept: bool


class FSDPMemoryTransform(Transform):
    """Lowers the memory of Thunder execution traces under FSDP without changing their results.

    Example::

        import thunder
        from thunder_fsdp_mem import FSDPMemoryTransform

        model = thunder.jit(model, transforms=[FSDPMemoryTransform()])
        # FSDP2 through ThunderFX:
        # torch.compile(model, backend=ThunderCompiler(transforms=[FSDPMemoryTransform()]))

    It chooses what the forward saves for backward (``MemoryConfig.rematerialize``, ``recompute_weight``), then
    orders each trace for a lower peak (``MemoryConfig.reorder``).

    Limitations:
        - The all-gather schedule (re-gathering and prefetching parameters) is not built yet.
        - It holds one forward between Thunder's forward and backward calls and nothing after: ThunderFX shares
          one instance across all subgraphs.
    """

    def __init__(self, config: MemoryConfig | None = None, *, strict: bool | None = None):
        if config is None:
            config = MemoryConfig(strict=bool(strict)) if strict is not None else MemoryConfig()
        elif strict is not None:
            raise ValueError("pass either config= or strict=, not both")
        if not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a MemoryConfig, got {type(config).__name__}")
        self.config = config
        self._pending: tuple[TraceCtx, TraceCtx] | None = None  # (the trace we returned, the forward received)
        self.rewrites: list[Rewrite] = []  # a record for reports; nothing reads it back

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        if not (self.config.rematerialize or self.config.reorder):
            return computation_trace
        if TraceTag.AUGMENTED_FORWARD in computation_trace.tags:
            placeholder = from_trace(computation_trace)
            placeholder.bound_symbols = list(computation_trace.bound_symbols)
            placeholder.set_provenance(TraceProvenance("FSDPMemoryTransform (forward)"))
            self._pending = (placeholder, computation_trace)
            return placeholder
        if TraceTag.BACKWARD in computation_trace.tags:
            pending, self._pending = self._pending, None
            if pending is None:
                return self._refuse(computation_trace, "a backward trace came without its forward")
            placeholder, forward = pending
            try:
                new_forward, new_backward = self._rewrite(forward, computation_trace)
            except (recompute.PlanError, checks.CheckError, ValueError) as e:
                return self._refuse(computation_trace, str(e))
            placeholder.bound_symbols = new_forward.bound_symbols
            if new_forward is not forward:
                placeholder.set_provenance(new_forward.get_provenance())
            return new_backward
        return computation_trace

    def _rewrite(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        """The passes the configuration asks for, each checked and kept only if the estimated peak does not
        rise."""
        if self.config.rematerialize:
            forward, backward = self._rematerialize(forward, backward)
        if self.config.reorder:
            forward, backward = self._reorder(forward, backward)
        return forward, backward

    def _rematerialize(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        if [t.name for t in recompute.saved_tensors(forward)] != recompute.received(backward):
            raise recompute.PlanError("the backward does not receive what the forward saves")
        plan = recompute.plan_saved(forward, recompute_weight=self.config.recompute_weight)
        if not plan.changes:
            return forward, backward
        new_forward, new_backward = recompute.apply_plan(forward, backward, plan)
        checks.check_rewrite(forward, new_forward, ignore_saved=True)
        checks.check_rewrite(backward, new_backward)
        before = estimate_traces(forward, backward).peak_bytes
        after = estimate_traces(new_forward, new_backward).peak_bytes
        self.rewrites.append(Rewrite(plan.before_bytes, plan.after_bytes, plan.traffic_bytes, before, after,
                                     kept=after <= before))
        if after > before:
            log.info("FSDPMemoryTransform: recomputation kept out, it would raise the peak from %d to %d bytes",
                     before, after)
            return forward, backward
        new_forward.set_provenance(TraceProvenance(
            f"FSDPMemoryTransform: saves {plan.after_bytes} bytes for backward instead of {plan.before_bytes}; "
            f"estimated peak {after} bytes instead of {before}"))
        return new_forward, new_backward

    def _reorder(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        new_forward, new_backward, _ = reorder.reorder_pair(forward, backward)
        checks.check_rewrite(forward, new_forward)
        checks.check_rewrite(backward, new_backward)
        return new_forward, new_backward

    def _refuse(self, trace: TraceCtx, why: str) -> TraceCtx:
        if self.config.strict:
            raise RuntimeError(f"FSDPMemoryTransform: {why}")
        warnings.warn(f"FSDPMemoryTransform: {why}; the trace is left unchanged", stacklevel=3)
        return trace

    def __repr__(self) -> str:
        return f"FSDPMemoryTransform({self.config})"

