"""The passes of ``FSDPMemoryTransform``, in the order the driver runs them, as ``MemoryConfig`` chooses them.

``pipeline(config, regather=...) -> list[driver.Pass]``:
1. ``folded casts`` (``casts.fold_casts``): a 16-bit elementwise op Thunder brackets between casts, run as one op;
2. ``fusion rematerialization`` (``fusions``; ``fusion_rematerialize``, on by default): each backward fusion
   recomputes the cheap tail of the forward fusions it reads from, as Thunder's own rematerialization means to and at
   times does not; then ``rematerialization`` (``recompute``): what the forward saves, by a minimum cut, the rest
   recomputed in backward; with a memory budget, matmuls and attention too, as ``budget.fit`` chooses;
3. ``folded casts after rematerialization``: the brackets of the upcasts the backward now recomputes (runs only
   where rematerialization was applied);
4. ``order`` (``reorder.reorder_pair``): the trace that holds the peak in its lowest-peak order;
5. ``all-gathers`` (``gathers``), under Thunder's fsdp: re-gathering in backward (ZeRO3, or as ``regather`` says),
   then the all-gathers of both traces in a window. Last but one: the memory-only judge of the order would move
   all-gathers next to their waits;
6. ``reduce-scatters`` (``scatters``), under Thunder's fsdp: each issued when its gradient is complete.

Each adapter here turns a pass's trace functions into a ``driver.Proposal`` and says what its checks allow.
``estimator(config, pair)`` is what judges them: ``step.estimate_traces``, with the loss and the optimizer state
a memory budget counts; with a memory cap, ``cap_shortfall(config)`` too: the caching allocator replayed over the
step under the cap (``reserved.over_cap``), which a plan must pass as well as the budget, and no later pass may
make worse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten

from thunder_fsdp_mem.analysis.step import StepMemory, anticipated_adamw, anticipated_adamw_step, estimate_traces
from thunder_fsdp_mem.analysis.symbols import ALL_GATHER, REDUCE_SCATTER, nbytes, sym_id
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import budget, casts, checks, fusions, gathers, recompute, reorder, scatters
from thunder_fsdp_mem.passes.driver import Checks, Context, Estimator, Pair, Pass, Proposal
from thunder_fsdp_mem.analysis.allocator import over_cap
from thunder_fsdp_mem.units import format_bytes

FOLD, FUSIONS, REMATERIALIZE, ORDER = "folded casts", "fusion rematerialization", "rematerialization", "order"
ALL_GATHERS, REDUCE_SCATTERS = "all-gathers", "reduce-scatters"


def pipeline(config: MemoryConfig, *, regather: bool) -> list[Pass]:
    """The passes ``config`` asks for, in order; ``regather``: gather parameters again in backward (ZeRO3)."""
    passes = []
    if config.fold_casts:
        passes.append(Pass(FOLD, _fold))
    if config.fusion_rematerialize:
        passes.append(Pass(FUSIONS, _fusions))
    if config.rematerialize:
        passes.append(Pass(REMATERIALIZE, lambda pair, context: _rematerialize(pair, context, config)))
        if config.fold_casts:
            passes.append(Pass(f"{FOLD} after {REMATERIALIZE}", _fold, after=REMATERIALIZE))
    if config.reorder:
        passes.append(Pass(ORDER, _reorder))
    if config.gathers:
        passes.append(Pass(ALL_GATHERS, lambda pair, context: _gathers(pair, config.max_inflight_allgathers, regather)))
    if config.scatters:
        passes.append(
            Pass(REDUCE_SCATTERS, lambda pair, context: _scatters(pair, context, config.max_inflight_reduce_scatters))
        )
    return passes


def _fold(pair: Pair, context: Context) -> Proposal:
    forward, backward = casts.fold_casts(pair.forward), casts.fold_casts(pair.backward)
    return Proposal(forward, backward)


def _fusions(pair: Pair, context: Context) -> Proposal:
    forward, backward, less = fusions.into_consumers(pair.forward, pair.backward)
    if forward is pair.forward:
        return Proposal(forward, backward)
    return Proposal(
        forward,
        backward,
        forward_checks=Checks(ignore_saved=True),
        note=f"the backward's fusions recompute what they read from the forward's: saves {less} bytes less",
    )


def estimator(config: MemoryConfig, pair: Pair, parameter_order: Sequence[str] = ()) -> Estimator:
    """What judges the passes on ``pair``: ``step.estimate_traces``; with a memory budget, the step it counts: the
    loss the caller computes on the forward's output (where that output is not a scalar already), the optimizer
    state (``step.anticipated_adamw``) and the optimizer's step (``step.anticipated_adamw_step``, the parameters
    stepped in ``parameter_order``, the model's: ``step.parameter_order``)."""
    if config.memory_budget is None:
        return estimate_traces
    adamw = config.budget_optimizer == "adamw"
    held = anticipated_adamw(pair.forward, pair.backward) if adamw else ()
    step = anticipated_adamw_step(pair.forward, pair.backward, parameter_order) if adamw else None
    value = pair.forward.bound_symbols[-1].args[0]
    outputs = (
        [p for p in tree_flatten(value["output"])[0] if isinstance(p, TensorProxy)]
        if isinstance(value, dict) and "output" in value
        else []
    )
    loss = config.budget_loss if len(outputs) == 1 and nbytes(outputs[0]) > outputs[0].dtype.bytes else None
    return functools.partial(estimate_traces, loss=loss, held=held, optimizer_step=step)


def cap_shortfall(config: MemoryConfig) -> Callable[[StepMemory], int] | None:
    """By how many bytes a step misses ``config.memory_cap`` when the caching allocator is replayed over it
    (``reserved.over_cap``; 0: it runs), each step replayed once; None without a cap."""
    if config.memory_cap is None:
        return None
    replayed: dict[int, tuple[StepMemory, int]] = {}  # the step is kept with its figure: its id stays its own

    def short(step: StepMemory) -> int:
        if id(step) not in replayed:
            replayed[id(step)] = step, over_cap(step, config.memory_cap)
        return replayed[id(step)][1]

    return short


def _rematerialize(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    forward, backward = pair.forward, pair.backward
    saved = recompute.saved_tensors(forward)
    if not saved:
        # Nothing saved for backward (one of ThunderFX's graphs can be a few casts): nothing to recompute, and the
        # backward unpacks no saved tensors. A budget its peak misses is still said.
        if not config.budgeted:
            return Proposal(forward, backward)
        excess, short_of_the_cap = _excess(config)
        e = context.estimate()
        return Proposal(forward, backward, warning=_unmet(config, e, short_of_the_cap) if excess(e) > 0 else None)
    if [t.name for t in saved] != recompute.received(backward):
        raise recompute.PlanError("the backward does not receive what the forward saves")
    if config.budgeted:
        return _fit_budget(pair, context, config)
    plan = recompute.plan_saved(forward, recompute_weight=config.recompute_weight)
    if not plan.changes:
        return Proposal(forward, backward)
    new_forward, new_backward = recompute.apply_plan(forward, backward, plan)
    note = (
        f"saves {plan.after_bytes} bytes instead of {plan.before_bytes}; recomputes {len(plan.recompute)} "
        f"symbols ({plan.traffic_bytes} bytes read and written)"
    )
    return Proposal(
        new_forward,
        new_backward,
        forward_checks=Checks(ignore_saved=True),
        note=note,
        recomputed=recompute.recomputed_groups(forward, plan),
        seconds=plan.seconds,
    )


def _excess(config: MemoryConfig) -> tuple[Callable[[StepMemory], int], Callable[[StepMemory], int] | None]:
    """By how many bytes an estimate misses ``config``'s budgets (0 or less: it meets them), and what the cap
    lacks in the allocator's replay of it (``cap_shortfall``; None without a cap)."""
    short_of_the_cap = cap_shortfall(config)

    def excess(estimate: StepMemory) -> int:
        over = [0]
        if config.memory_budget is not None:
            over.append(estimate.peak_bytes - config.memory_budget)
        if config.saved_budget is not None:
            over.append(estimate.saved_bytes - config.saved_budget)
        if short_of_the_cap is not None and max(over) <= 0:
            over.append(short_of_the_cap(estimate))
        return max(over)

    return excess, short_of_the_cap


def _wanted(config: MemoryConfig) -> str:
    return ", ".join(
        f"{what} {format_bytes(n)}"
        for what, n in (
            ("peak", config.memory_budget),
            ("saved", config.saved_budget),
            ("reserved under a cap of", config.memory_cap),
        )
        if n is not None
    )


def _unmet(config: MemoryConfig, e: StepMemory, short_of_the_cap: Callable[[StepMemory], int] | None) -> str:
    """The warning for budgets that cannot be met: the least peak reachable, ``e``, and what is alive there."""
    alive = ", ".join(f"{a.name} ({format_bytes(a.nbytes)}, {a.category.value})" for a in e.live_at_peak[:3])
    warning = (
        f"could not meet the budget ({_wanted(config)}): the least reachable is a peak of "
        f"{format_bytes(e.peak_bytes)} ({e.peak_phase}, at {e.peak_symbol}) saving "
        f"{format_bytes(e.saved_bytes)}; alive there: {alive}"
    )
    if short_of_the_cap is not None and short_of_the_cap(e):
        warning += (
            f"; the caching allocator's replay of that plan misses the cap by "
            f"{format_bytes(short_of_the_cap(e))} (no cached block holds a request)"
        )
    return warning


def _fit_budget(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    """The least recomputation that fits ``config``'s budgets (``budget.fit``); the least peak reachable, with a
    warning that names it and what is alive there, where they cannot be met."""
    excess, short_of_the_cap = _excess(config)
    found = budget.fit(
        pair.forward,
        pair.backward,
        excess=excess,
        judge=lambda f, b: context.estimator(f, b),
        recompute_weight=config.recompute_weight,
    )
    e, plan = found.estimate, found.plan
    warning = None if found.reached else _unmet(config, e, short_of_the_cap)
    if found.forward is pair.forward:
        return Proposal(pair.forward, pair.backward, warning=warning)
    price = "no price (cheap ops only)" if found.price is None else f"a price of {found.price:.3g} bytes per second"
    note = (
        f"budget {_wanted(config)}: {'met' if found.reached else 'not met'} at {price}; saves "
        f"{plan.after_bytes} bytes instead of {plan.before_bytes}; recomputes {len(plan.recompute)} symbols, an "
        f"estimated {1e3 * plan.seconds:.1f} ms"
    )
    return Proposal(
        found.forward,
        found.backward,
        forward_checks=Checks(ignore_saved=True),
        note=note,
        estimate=found.estimate,
        recomputed=found.recomputed,
        seconds=plan.seconds,
        warning=warning,
        budgeted=config.saved_budget is not None,
    )


def _reorder(pair: Pair, context: Context) -> Proposal:
    forward, backward, estimate = reorder.reorder_pair(
        pair.forward, pair.backward, estimate=context.estimate(), estimator=context.estimator
    )
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
    return Proposal(
        new_forward,
        new_backward,
        forward_checks=Checks(ignore_saved=True, ordered=False),
        backward_checks=Checks(added=added),
        note=note,
    )


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
