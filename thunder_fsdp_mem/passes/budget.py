"""Fit a memory budget: recompute more of the forward in backward, matmuls and attention included, choosing what
to recompute by the least estimated time per byte of peak removed, until the step's estimated peak fits.

Entry point: ``fit(forward, backward, *, excess, judge, recompute_weight, rates) -> Fit``.

``recompute.plan_saved`` with a ``price`` is the minimum cut that trades saved bytes against the time of the
expensive ops run again (``cost.op_seconds``): each second of recomputation costs ``price`` bytes. At a high price
it is the cut without them (cheap ops only); at price 0 it saves the least the forward can save. The plan that
recomputes least while it fits is the one at the highest price that fits. Saving less is not always a lower peak
(what the backward recomputes is alive in backward too), so the peak is not monotone in the price: ``fit`` tries
the cut without a price, then ``GRID`` prices from the highest down to 0; if one fits, it bisects the price's
logarithm between the highest that fits and the next above it; if none fits, the budget cannot be met
(``Fit.reached`` is False) and the plan nearest to it among those tried is the answer. Every candidate is the
pair as it came, rewritten by ``recompute.apply_plan`` and judged by ``judge`` (the transform's estimate of the
step, with the loss and the optimizer state it is told of); ``excess`` says by how many bytes an estimate is over
the budget (0: it fits). Pure: the traces given are not changed.

Cost: one cut, one rewrite and one estimate per candidate, at most ``2 + len(GRID) + BISECTIONS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.cost import H200, DeviceRates
from thunder_fsdp_mem.analysis.step import StepMemory
from thunder_fsdp_mem.passes.driver import Recomputed
from thunder_fsdp_mem.passes.recompute import SavePlan, apply_plan, plan_saved, recomputed_groups

BISECTIONS = 4
# Prices, in bytes of saved memory per second of recomputation, tried from the highest: at 10^15 B/s a GB is worth
# a microsecond (nothing dear is recomputed), at 10^7 B/s a millisecond of recomputation is worth 10 KB (nearly
# everything is); then 0.
GRID = tuple(10.0 ** e for e in range(15, 6, -1)) + (0.0,)


@dataclass(frozen=True, slots=True)
class Fit:
    """The plan chosen for a budget: the rewritten pair, its estimate by ``judge``, the price it was cut at (None:
    without one), whether it fits, and what the backward recomputes (grouped, with its estimated added time)."""

    plan: SavePlan
    forward: TraceCtx
    backward: TraceCtx
    estimate: StepMemory
    price: float | None
    reached: bool
    recomputed: tuple[Recomputed, ...]

    @property
    def seconds(self) -> float:
        return self.plan.seconds


def fit(forward: TraceCtx, backward: TraceCtx, *, excess: Callable[[StepMemory], int],
        judge: Callable[[TraceCtx, TraceCtx], StepMemory], recompute_weight: float,
        rates: DeviceRates = H200) -> Fit:
    """The plan whose ``excess`` is 0 recomputing least (see the module's docstring)."""

    def attempt(price: float | None) -> Fit:
        plan = plan_saved(forward, recompute_weight=recompute_weight, price=price, rates=rates)
        new_forward, new_backward = apply_plan(forward, backward, plan) if plan.changes else (forward, backward)
        estimate = judge(new_forward, new_backward)
        return Fit(plan, new_forward, new_backward, estimate, price, excess(estimate) <= 0,
                   recomputed_groups(forward, plan, rates))

    tried = [attempt(None)]
    if tried[0].reached:
        return tried[0]
    for price in GRID:
        tried.append(attempt(price))
        if tried[-1].reached:
            break
    else:
        return min(tried, key=lambda f: (excess(f.estimate), f.estimate.peak_bytes))
    best = tried[-1]
    if best.price == 0.0 or len(tried) < 3:
        return best
    low, high = math.log10(best.price), math.log10(tried[-2].price)  # low fits, high does not
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        candidate = attempt(10.0 ** middle)
        if candidate.reached:
            best, low = candidate, middle
        else:
            high = middle
    return best
