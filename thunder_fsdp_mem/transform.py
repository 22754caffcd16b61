"""``FSDPMemoryTransform``: the Thunder glue. It holds the configuration and hands each execution trace to the
passes; the traces it returns compute exactly what the traces it received compute.

Thunder calls ``transform_trace_post_optimization`` on a forward execution trace and right after on its
backward (under ``thunder.jit``, Thunder's ``fsdp`` and each ThunderFX subgraph alike). What the forward saves can
only be chosen with both in hand, so the forward call returns a trace of its own whose symbols the backward call
fills in, before Thunder turns either into Python. Every rewrite passes ``checks.check_rewrite`` and is kept only
if ``step.estimate_traces``, the estimator of the whole step, says its peak did not rise.
"""

from __future__ import annotations

import logging
import warnings

from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform

from thunder_fsdp_mem import checks, recompute
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.step import estimate_traces

log = logging.getLogger(__name__)


class FSDPMemoryTransform(Transform):
    """Lowers the memory of Thunder execution traces under FSDP without changing their results.

    Example::

        import thunder
        from thunder_fsdp_mem import FSDPMemoryTransform

        model = thunder.jit(model, transforms=[FSDPMemoryTransform()])
        # FSDP2 through ThunderFX:
        # torch.compile(model, backend=ThunderCompiler(transforms=[FSDPMemoryTransform()]))

    Limitations:
        - Peak-aware reordering and all-gather scheduling are being built; today it chooses what the forward
          saves (``MemoryConfig.rematerialize``).
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

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        if not self.config.rematerialize:
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
            return self._rematerialize(*pending, computation_trace)
        return computation_trace

    def _rematerialize(self, placeholder: TraceCtx, forward: TraceCtx, backward: TraceCtx) -> TraceCtx:
        try:
            if [t.name for t in recompute.saved_tensors(forward)] != recompute.received(backward):
                raise recompute.PlanError("the backward does not receive what the forward saves")
            plan = recompute.plan_saved(forward)
            if not plan.changes:
                return backward
            new_forward, new_backward = recompute.apply_plan(forward, backward, plan)
            checks.check_rewrite(forward, new_forward, ignore_saved=True)
            checks.check_rewrite(backward, new_backward)
        except (recompute.PlanError, checks.CheckError) as e:
            return self._refuse(backward, str(e))
        before = estimate_traces(forward, backward).peak_bytes
        after = estimate_traces(new_forward, new_backward).peak_bytes
        if after > before:
            log.info("FSDPMemoryTransform: recomputation kept out, it would raise the peak from %d to %d bytes",
                     before, after)
            return backward
        placeholder.bound_symbols = new_forward.bound_symbols
        placeholder.set_provenance(TraceProvenance(
            f"FSDPMemoryTransform: saves {plan.after_bytes} bytes for backward instead of {plan.before_bytes}; "
            f"estimated peak {after} bytes instead of {before}"))
        return new_backward

    def _refuse(self, trace: TraceCtx, why: str) -> TraceCtx:
        if self.config.strict:
            raise RuntimeError(f"FSDPMemoryTransform: {why}")
        warnings.warn(f"FSDPMemoryTransform: {why}; the trace is left unchanged", stacklevel=3)
        return trace

    def __repr__(self) -> str:
        return f"FSDPMemoryTransform({self.config})"

