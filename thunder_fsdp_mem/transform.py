"""``FSDPMemoryTransform``: the Thunder glue. It holds the configuration and hands each execution trace to the
passes; the traces it returns compute exactly what the traces it received compute.

Thunder calls ``transform_trace_post_optimization`` on a forward execution trace and right after on its
backward (under ``thunder.jit``, Thunder's ``fsdp`` and each ThunderFX subgraph alike). What the forward saves can
only be chosen with both in hand, so the forward call returns a trace of its own whose symbols the backward call
fills in, before Thunder turns either into Python. Every rewrite passes ``checks.check_rewrite`` and is kept only
if ``step.estimate_traces``, the estimator of the whole step, says its peak did not rise: folded casts
(``casts.py``) first, then rematerialization (``recompute.py``) and folded casts again (the brackets of upcasts
the forward no longer saves, which the backward now recomputes), then the order of each trace (``reorder.py``),
then the all-gather schedule under Thunder's fsdp (``gathers.py``).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from thunder.core.prims import PrimIDs
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform

from thunder_fsdp_mem import casts, checks, gathers, ops, recompute, reorder, scatters
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

    It runs each 16-bit elementwise op that Thunder brackets between float32 casts as one op where ATen gives the
    same bits (``casts``, ``MemoryConfig.fold_casts``); it chooses what the forward saves for backward
    (``MemoryConfig.rematerialize``, ``recompute_weight``); under Thunder's fsdp it issues all-gathers in a window
    and, with ZeRO3, gathers parameters again in backward (``gathers``, ``max_inflight_allgathers``,
    ``regather``), and issues each reduce-scatter as soon as its
    gradient is complete (``scatters``, ``max_inflight_reduce_scatters``); it orders each trace for a lower peak
    (``reorder``). Under Thunder's fsdp, either jit first and shard after, or list it after the FSDPTransform::

        model = fsdp(thunder.jit(model, transforms=[FSDPMemoryTransform()]), sharding_strategy=FSDPType.ZERO3)
        model = thunder.jit(model, transforms=[FSDPTransform(device=device, sharding_strategy=FSDPType.ZERO3),
                                               FSDPMemoryTransform()])

    Limitation: it holds one forward between Thunder's forward and backward calls and nothing after (ThunderFX
    shares one instance across all subgraphs).
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
        c = self.config
        if not (c.fold_casts or c.rematerialize or c.gathers or c.scatters or c.reorder):
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
            except (recompute.PlanError, checks.CheckError) as e:
                return self._refuse(computation_trace, str(e))
            placeholder.bound_symbols = new_forward.bound_symbols
            if new_forward is not forward:
                placeholder.set_provenance(new_forward.get_provenance())
            return new_backward
        return computation_trace

    def _rewrite(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        """The passes the configuration asks for, each checked and kept only if the estimated peak does not
        rise."""
        estimate = None  # of the pair as it stands, where a pass has it
        if self.config.fold_casts:
            forward, backward, estimate = self._fold_casts(forward, backward, estimate)
        if self.config.rematerialize:
            received = backward
            forward, backward, estimate = self._rematerialize(forward, backward, estimate)
            if self.config.fold_casts and backward is not received:  # the brackets the backward now recomputes
                forward, backward, estimate = self._fold_casts(forward, backward, estimate)
        if self.config.reorder:
            forward, backward = self._reorder(forward, backward, estimate)
        # Last: the memory-only judge of the reordering would move all-gathers next to their waits.
        if self.config.gathers and any(ops.sym_id(b) == ops.ALL_GATHER for b in forward.bound_symbols):
            try:
                forward, backward = self._schedule_gathers(forward, backward)
            except gathers.GatherError as e:  # the other passes still apply
                self._warn(f"all-gathers left as they were: {e}")
        if self.config.scatters and any(ops.sym_id(b) == ops.REDUCE_SCATTER for b in backward.bound_symbols):
            try:
                backward = self._schedule_scatters(forward, backward)
            except scatters.ScatterError as e:
                self._warn(f"reduce-scatters left as they were: {e}")
        return forward, backward

    def _fold_casts(self, forward: TraceCtx, backward: TraceCtx, estimate):
        """Each trace with its upcast-op-round brackets folded (``casts``): it computes the same bits and holds
        less, and is kept only if the estimated peak does not rise. ``estimate``: the pair's, or None; returned
        with the estimate of what it returns (None when nothing was estimated)."""
        new_forward, new_backward = casts.fold_casts(forward), casts.fold_casts(backward)
        if new_forward is forward and new_backward is backward:
            return forward, backward, estimate
        checks.check_rewrite(forward, new_forward)
        checks.check_rewrite(backward, new_backward)
        before, after = _estimates(forward, backward, new_forward, new_backward, estimate)
        if after.peak_bytes > before.peak_bytes:
            log.info("FSDPMemoryTransform: folded casts kept out, they would raise the peak from %d to %d bytes",
                     before.peak_bytes, after.peak_bytes)
            return forward, backward, before
        if new_forward is not forward:  # what an earlier pass said of the forward stays on its provenance line
            earlier = forward.get_provenance()
            if earlier is not None and earlier.pss.startswith("FSDPMemoryTransform"):
                new_forward.set_provenance(TraceProvenance(f"{earlier.pss}; {new_forward.get_provenance().pss}"))
        return new_forward, new_backward, after

    def _rematerialize(self, forward: TraceCtx, backward: TraceCtx, estimate):
        """The pair rewritten by ``recompute``, or as it came; with the estimate of what it returns (None when
        nothing was estimated). ``estimate``: the pair's, or None."""
        if [t.name for t in recompute.saved_tensors(forward)] != recompute.received(backward):
            raise recompute.PlanError("the backward does not receive what the forward saves")
        plan = recompute.plan_saved(forward, recompute_weight=self.config.recompute_weight)
        if not plan.changes:
            return forward, backward, estimate
        new_forward, new_backward = recompute.apply_plan(forward, backward, plan)
        checks.check_rewrite(forward, new_forward, ignore_saved=True)
        checks.check_rewrite(backward, new_backward)
        before, after = _estimates(forward, backward, new_forward, new_backward, estimate)
        self.rewrites.append(Rewrite(plan.before_bytes, plan.after_bytes, plan.traffic_bytes, before.peak_bytes,
                                     after.peak_bytes, kept=after.peak_bytes <= before.peak_bytes))
        if after.peak_bytes > before.peak_bytes:
            log.info("FSDPMemoryTransform: recomputation kept out, it would raise the peak from %d to %d bytes",
                     before.peak_bytes, after.peak_bytes)
            return forward, backward, before
        new_forward.set_provenance(TraceProvenance(
            f"FSDPMemoryTransform: saves {plan.after_bytes} bytes for backward instead of {plan.before_bytes}; "
            f"estimated peak {after.peak_bytes} bytes instead of {before.peak_bytes}"))
        return new_forward, new_backward, after

    def _schedule_gathers(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        """Under Thunder's fsdp: re-gather in backward (ZeRO3, or as ``regather`` says), then issue the
        all-gathers of both traces in a window."""
        new_forward, new_backward = forward, backward
        if self._regathers():
            new_forward, new_backward = gathers.regather(forward, backward)
        again = {b.args[0].name for b in new_backward.bound_symbols if ops.sym_id(b) == ops.ALL_GATHER}
        added = [c for c in checks.collectives(forward) if c[0] == ops.ALL_GATHER and c[1][0] in again]
        width = self.config.max_inflight_allgathers
        new_forward = gathers.window(new_forward, width)
        new_backward = gathers.window(new_backward, width, clear_mutable_collections=True)
        checks.check_rewrite(forward, new_forward, ignore_saved=True, ordered=False)
        checks.check_rewrite(backward, new_backward, added=added)
        before = estimate_traces(forward, backward).peak_bytes
        after = estimate_traces(new_forward, new_backward).peak_bytes
        if after > before:
            log.info("FSDPMemoryTransform: all-gather schedule kept out, it would raise the peak from %d to %d "
                     "bytes", before, after)
            return forward, backward
        return new_forward, new_backward

    def _schedule_scatters(self, forward: TraceCtx, backward: TraceCtx) -> TraceCtx:
        """Under Thunder's fsdp: each reduce-scatter issued when its gradient is complete, in a window, where the
        estimate leaves room for what an in-flight reduce-scatter holds; kept if the estimated peak does not
        rise."""
        before = estimate_traces(forward, backward)
        timeline = before.backward
        headroom = before.peak_bytes - (before.backward_peak_bytes - timeline.peak_bytes)
        room, highest = [0] * len(timeline.op_peaks), 0
        for i in range(len(room) - 1, -1, -1):  # room below the step's peak from symbol i to the end
            highest = max(highest, timeline.op_peaks[i])
            room[i] = headroom - highest
        new_backward = scatters.schedule(backward, self.config.max_inflight_reduce_scatters, room=room,
                                         clear_mutable_collections=True)
        if new_backward is backward:
            return backward
        checks.check_rewrite(backward, new_backward, ordered=False)
        after = estimate_traces(forward, new_backward, reuse=before).peak_bytes
        if after > before.peak_bytes:
            log.info("FSDPMemoryTransform: reduce-scatter schedule kept out, it would raise the peak from %d to %d "
                     "bytes", before.peak_bytes, after)
            return backward
        return new_backward

    def _regathers(self) -> bool:
        if self.config.regather is not None:
            return self.config.regather
        from thunder.core.compile_data import get_compile_data
        from thunder.distributed import FSDPType

        cd = get_compile_data()
        strategies = [getattr(t, "sharding_strategy", None) for t in getattr(cd, "transforms", None) or ()]
        return FSDPType.ZERO3 in strategies

    def _reorder(self, forward: TraceCtx, backward: TraceCtx, estimate) -> tuple[TraceCtx, TraceCtx]:
        new_forward, new_backward, _ = reorder.reorder_pair(forward, backward, estimate=estimate)
        checks.check_rewrite(forward, new_forward)
        checks.check_rewrite(backward, new_backward)
        return new_forward, new_backward

    def _refuse(self, trace: TraceCtx, why: str) -> TraceCtx:
        self._warn(f"{why}; the trace is left unchanged")
        return trace

    def _warn(self, why: str) -> None:
        if self.config.strict:
            raise RuntimeError(f"FSDPMemoryTransform: {why}")
        warnings.warn(f"FSDPMemoryTransform: {why}", stacklevel=4)

    def __repr__(self) -> str:
        return f"FSDPMemoryTransform({self.config})"


def _estimates(forward: TraceCtx, backward: TraceCtx, new_forward: TraceCtx, new_backward: TraceCtx, estimate):
    """The estimates that judge a rewrite: of the pair before it (``estimate`` where the caller has it) and after
    it; a rewrite that left the forward as it was reuses the forward's analysis."""
    before = estimate if estimate is not None else estimate_traces(forward, backward)
    return before, estimate_traces(new_forward, new_backward, reuse=before if new_forward is forward else None)
