"""The passes of ``FSDPMemoryTransform``, in the order the driver runs them, as ``MemoryConfig`` chooses them.

``pipeline(config, regather=...) -> list[driver.Pass]``:
1. ``folded casts`` (``casts.fold_casts``): a 16-bit elementwise op Thunder brackets between casts, run as one op;
2. ``rematerialization`` (``recompute``): what the forward saves, by a minimum cut, the rest recomputed in backward;
3. ``folded casts after rematerialization``: the brackets of the upcasts the backward now recomputes (runs only
   where rematerialization was applied);
4. ``order`` (``reorder.reorder_pair``): the trace that holds the peak in its lowest-peak order;
5. ``all-gathers`` (``gathers``), under Thunder's fsdp: re-gathering in backward (ZeRO3, or as ``regather`` says),
   then the all-gathers of both traces in a window. Last but one: the memory-only judge of the order would move
   all-gathers next to their waits;
6. ``reduce-scatters`` (``scatters``), under Thunder's fsdp: each issued when its gradient is complete.

Each adapter here turns a pass's trace functions into a ``driver.Proposal`` and says what its checks allow.
"""

from __future__ import annotations

from thunder_fsdp_mem.analysis.symbols import ALL_GATHER, REDUCE_SCATTER, sym_id
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import casts, checks, gathers, recompute, reorder, scatters
from thunder_fsdp_mem.passes.driver import Checks, Context, Pair, Pass, Proposal

FOLD, REMATERIALIZE, ORDER = "folded casts", "rematerialization", "order"
ALL_GATHERS, REDUCE_SCATTERS = "all-gathers", "reduce-scatters"


def pipeline(config: MemoryConfig, *, regather: bool) -> list[Pass]:
    """The passes ``config`` asks for, in order; ``regather``: gather parameters again in backward (ZeRO3)."""
    passes = []
    if config.fold_casts:
        passes.append(Pass(FOLD, _fold))
    if config.rematerialize:
        passes.append(Pass(REMATERIALIZE, lambda pair, context: _rematerialize(pair, config.recompute_weight)))
        if config.fold_casts:
            passes.append(Pass(f"{FOLD} after {REMATERIALIZE}", _fold, after=REMATERIALIZE))
    if config.reorder:
        passes.append(Pass(ORDER, _reorder))
    if config.gathers:
        passes.append(Pass(ALL_GATHERS, lambda pair, context: _gathers(pair, config.max_inflight_allgathers,
                                                                       regather)))
    if config.scatters:
        passes.append(Pass(REDUCE_SCATTERS, lambda pair, context: _scatters(pair, context,
                                                                            config.max_inflight_reduce_scatters)))
    return passes


def _fold(pair: Pair, context: Context) -> Proposal:
    forward, backward = casts.fold_casts(pair.forward), casts.fold_casts(pair.backward)
    return Proposal(forward, backward)


def _rematerialize(pair: Pair, recompute_weight: float) -> Proposal:
    forward, backward = pair.forward, pair.backward
    if [t.name for t in recompute.saved_tensors(forward)] != recompute.received(backward):
        raise recompute.PlanError("the backward does not receive what the forward saves")
    plan = recompute.plan_saved(forward, recompute_weight=recompute_weight)
    if not plan.changes:
        return Proposal(forward, backward)
    new_forward, new_backward = recompute.apply_plan(forward, backward, plan)
    note = (f"saves {plan.after_bytes} bytes instead of {plan.before_bytes}; recomputes {len(plan.recompute)} "
            f"symbols ({plan.traffic_bytes} bytes read and written)")
    return Proposal(new_forward, new_backward, forward_checks=Checks(ignore_saved=True), note=note)


def _reorder(pair: Pair, context: Context) -> Proposal:
    forward, backward, estimate = reorder.reorder_pair(pair.forward, pair.backward, estimate=context.estimate())
    return Proposal(forward, backward, estimate=estimate)


def _gathers(pair: Pair, width: int, regather: bool) -> Proposal:
    forward, backward = pair.forward, pair.backward
    if not any(sym_id(b) == ALL_GATHER for b in forward.bound_symbols):
        return Proposal(forward, backward)
    new_forward, new_backward = gathers.regather(forward, backward) if regather else (forward, backward)
    again = {b.args[0].name for b in new_backward.bound_symbols if sym_id(b) == ALL_GATHER}
    added = tuple(c for c in checks.collectives(forward) if c[0] == ALL_GATHER and c[1][0] in again)
    new_forward = gathers.window(new_forward, width)
    new_backward = gathers.window(new_backward, width, clear_mutable_collections=True)
    note = f"window of {width}" + (f", {len(added)} gathered again in backward" if added else "")
    return Proposal(new_forward, new_backward, forward_checks=Checks(ignore_saved=True, ordered=False),
                    backward_checks=Checks(added=added), note=note)


def _scatters(pair: Pair, context: Context, width: int) -> Proposal:
    """Each reduce-scatter issued when its gradient is complete, in a window, where the estimate leaves room for
    what an in-flight reduce-scatter holds."""
    backward = pair.backward
    if not any(sym_id(b) == REDUCE_SCATTER for b in backward.bound_symbols):
        return Proposal(pair.forward, backward)
    before = context.estimate()
    timeline = before.backward
    headroom = before.peak_bytes - (before.backward_peak_bytes - timeline.peak_bytes)
    room, highest = [0] * len(timeline.op_peaks), 0
    for i in range(len(room) - 1, -1, -1):  # room below the step's peak from symbol i to the end
        highest = max(highest, timeline.op_peaks[i])
        room[i] = headroom - highest
    new_backward = scatters.schedule(backward, width, room=room, clear_mutable_collections=True)
    return Proposal(pair.forward, new_backward, backward_checks=Checks(ordered=False), note=f"window of {width}")
