"""Fit a memory budget: recompute more of the forward in backward, matmuls and attention included, choosing what
to recompute by the least estimated time per byte of peak removed, until the step's estimated peak fits.

Entry point: ``cheapest_plan(forward, backward, *, excess, judge, recompute_weight, rates) -> Candidate``. As the
rematerialization pass runs it (``recompute.PASS``, under ``MemoryConfig.budgeted``): ``propose(pair, context,
config) -> Proposal``, the plan that fits ``config``'s budgets, with a warning that names the least peak reachable
where they cannot be met (``unmet_warning``). What judges the plans, and every pass: ``estimator(config, pair)``,
``step.estimate_traces`` with the loss and the optimizer state a memory budget counts; with a memory cap,
``cap_shortfall(config)`` too: the caching allocator replayed over the step under the cap
(``caching_allocator.over_cap``), which a plan must pass as well as the budget, and no later pass may make worse.

``mincut.plan_saved`` with a ``price`` is the minimum cut that trades saved bytes against the time of the
expensive ops run again (``cost.op_seconds``): each second of recomputation costs ``price`` bytes. At a high price
it is the cut without them (cheap ops only); at price 0 it saves the least the forward can save. The cut counts
saved bytes, not when the backward holds what it recomputes: where one recomputed expensive op feeds another (a
block's fused region feeding the next block's), the backward must run the whole chain before the first block it
needs, and holds every link's outputs from there on. So each price gives two candidates, the cut and the cut with
such chains broken (``segments=True``: the links' inputs saved, as activation checkpointing saves each block's
input), and the better is kept: over the budget by less, or fitting with less recomputation. The plan that
recomputes least while it fits is the one at the highest price that fits. Saving less is not always a lower peak
(what the backward recomputes is alive in backward too), so the peak is not monotone in the price: ``cheapest_plan``
tries the cut without a price, then ``GRID`` prices from the highest down to 0; if one fits, it bisects the price's
logarithm between the highest that fits and the next above it; if none fits, the budget cannot be met
(``Candidate.reached`` is False) and the plan nearest to it among those tried is the answer. Every candidate is the
pair as it came, rewritten by ``plan_rewrite.apply_plan`` and judged by ``judge`` (the transform's estimate of the
step, with the loss and the optimizer state it is told of); ``excess`` says by how many bytes an estimate is over
the budget (0: it fits). Alike expensive ops (each block's fused region) cost alike, so they flip together at one
price: the plan found is then refined to recompute the fewest of those that fit (``_fewer``: the earliest in
forward order, their number bisected). A price recomputes every op whose bytes per second beat it, so where one
dear op alone would fit beside a cheaper one that does not (a ThunderFX block, whose plan every block shares), the
price takes both: then each expensive op recomputed is kept instead, the dearest first, while the plan still fits
(``_without_the_dearest``, for plans of at most ``DROPS`` such ops). Pure: the traces given are not changed.

Cost: one cut, one rewrite and one estimate per candidate, at most ``1 + 2 * (len(GRID) + BISECTIONS + log2 n +
DROPS)`` for n alike ops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.caching_allocator import over_cap
from thunder_fsdp_mem.analysis.cost import H200, DeviceRates, op_seconds
from thunder_fsdp_mem.analysis.optimizer import anticipated_adamw, anticipated_adamw_step
from thunder_fsdp_mem.analysis.phases import StepMemory
from thunder_fsdp_mem.analysis.step import estimate_traces
from thunder_fsdp_mem.analysis.symbols import nbytes
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes.driver import Checks, Context, Estimator, Pair, Proposal, Recomputed
from thunder_fsdp_mem.passes.mincut import SavePlan, plan_saved, priced, recomputable, recomputed_groups
from thunder_fsdp_mem.passes.regions import opened
from thunder_fsdp_mem.passes.plan_rewrite import apply_plan
from thunder_fsdp_mem.units import format_bytes

BISECTIONS = 4
DROPS = 8  # expensive ops ``_without_the_dearest`` tries to keep, one by one
# Prices, in bytes of saved memory per second of recomputation, tried from the highest: at 10^15 B/s a GB is worth
# a microsecond (nothing dear is recomputed), at 10^7 B/s a millisecond of recomputation is worth 10 KB (nearly
# everything is); then 0.
GRID = tuple(10.0**e for e in range(15, 6, -1)) + (0.0,)


@dataclass(frozen=True, slots=True)
class Candidate:
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


def cheapest_plan(
    forward: TraceCtx,
    backward: TraceCtx,
    *,
    excess: Callable[[StepMemory], int],
    judge: Callable[[TraceCtx, TraceCtx], StepMemory],
    recompute_weight: float,
    rates: DeviceRates = H200,
) -> Candidate:
    """The plan whose ``excess`` is 0 recomputing least (see the module's docstring)."""

    def rank(f: Candidate) -> tuple[int, float]:  # over the budget by less; fitting, with less recomputation
        over = excess(f.estimate)
        return over, f.seconds if over <= 0 else f.estimate.peak_bytes

    searches = (False, True) if opened(forward.bound_symbols, recomputable) is not None else (False,)
    return min(
        (_search(forward, backward, rank, excess, judge, recompute_weight, rates, o) for o in searches), key=rank
    )


def _search(forward, backward, rank, excess, judge, recompute_weight, rates, open_regions: bool) -> Candidate:
    """``cheapest_plan``'s search, with the forward's mixed fusion regions priced whole or opened
    (``mincut.plan_saved``'s ``open_regions``)."""

    def attempt(price: float | None, only: frozenset[int] | None = None) -> Candidate:
        best = None
        for segments in (False, True) if price is not None else (False,):
            plan = plan_saved(
                forward,
                recompute_weight=recompute_weight,
                price=price,
                rates=rates,
                segments=segments,
                only=only,
                open_regions=open_regions if price is not None else None,
            )
            if best is not None and plan == best.plan:
                continue
            new_forward, new_backward = apply_plan(forward, backward, plan) if plan.changes else (forward, backward)
            estimate = judge(new_forward, new_backward)
            candidate = Candidate(
                plan,
                new_forward,
                new_backward,
                estimate,
                price,
                excess(estimate) <= 0,
                recomputed_groups(forward, plan, rates),
            )
            if best is None or rank(candidate) < rank(best):
                best = candidate
        return best

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
        return _without_the_dearest(best, forward, attempt, rates)
    above = tried[-2]
    low, high = math.log10(best.price), math.log10(above.price)  # low fits, high does not
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        candidate = attempt(10.0**middle)
        if candidate.reached:
            best, low = candidate, middle
        else:
            above, high = candidate, middle
    return _without_the_dearest(_fewer(best, above, forward, attempt), forward, attempt, rates)


def _fewer(best: Candidate, above: Candidate, forward: TraceCtx, attempt: Callable[..., Candidate]) -> Candidate:
    """``best`` with fewer of the expensive ops that ``above`` (the plan at the next higher price, which does not
    fit) keeps and ``best`` recomputes, where fewer fit: the first k of them in forward order (the earliest blocks,
    which the backward reaches last, when it holds least), k bisected. Alike ops (each block's region) flip at one
    price, so the price alone recomputes all of them or none."""
    dear = [i for i in best.plan.recompute if priced(best.plan.symbols(forward)[i])]
    kept = set(above.plan.recompute)
    flipped = [i for i in dear if i not in kept]
    allowed = frozenset(i for i in dear if i in kept)
    low, high = 0, len(flipped)  # high fits (best); low does not
    while high - low > 1:
        middle = (low + high) // 2
        candidate = attempt(best.price, only=allowed | frozenset(flipped[:middle]))
        if candidate.reached:
            best, high = candidate, middle
        else:
            low = middle
    return best


def _without_the_dearest(
    best: Candidate, forward: TraceCtx, attempt: Callable[..., Candidate], rates: DeviceRates
) -> Candidate:
    """``best`` with each expensive op it recomputes kept instead, the dearest first, where the plan still fits and
    recomputes less. A price recomputes every op whose bytes per second beat it: where a dear op frees more than
    the budget needs beside a cheaper one (a ThunderFX block's MLP region beside its attention region), the plan
    at the price recomputes both, and the dear one alone may be enough. At most ``DROPS`` ops are tried (beyond
    that the ops are alike, each block's, and ``_fewer`` has chosen among them)."""
    symbols = best.plan.symbols(forward)
    dear = sorted(
        (i for i in best.plan.recompute if priced(symbols[i])),
        key=lambda i: -op_seconds(symbols[i], rates),
    )
    if len(dear) > DROPS:
        return best
    allowed = set(dear)
    for i in dear:
        candidate = attempt(best.price, only=frozenset(allowed - {i}))
        if candidate.reached and candidate.seconds < best.seconds:
            best = candidate
            allowed.discard(i)
    return best


def estimator(config: MemoryConfig, pair: Pair, parameter_order: Sequence[str] = ()) -> Estimator:
    """What judges the passes on ``pair``: ``step.estimate_traces``; with a memory budget, the step it counts: the
    loss the caller computes on the forward's output (where that output is not a scalar already), the optimizer
    state (``optimizer.anticipated_adamw``) and the optimizer's step (``optimizer.anticipated_adamw_step``, the
    parameters stepped in ``parameter_order``, the model's: ``optimizer.parameter_order``)."""
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
    (``caching_allocator.over_cap``; 0: it runs), each step replayed once; None without a cap."""
    if config.memory_cap is None:
        return None
    replayed: dict[int, tuple[StepMemory, int]] = {}  # the step is kept with its figure: its id stays its own

    def short(step: StepMemory) -> int:
        if id(step) not in replayed:
            replayed[id(step)] = step, over_cap(step, config.memory_cap)
        return replayed[id(step)][1]

    return short


def propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    """The least recomputation that fits ``config``'s budgets (``cheapest_plan``); the least peak reachable, with a
    warning that names it and what is alive there, where they cannot be met."""
    excess, short_of_the_cap = _excess(config)
    found = cheapest_plan(
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
    price = (
        "cheap ops only"
        if found.price is None
        else f"recomputing what saves at least {format_bytes(int(found.price))} per second of recomputation"
    )
    note = (
        f"budget {_wanted(config)}: {'met' if found.reached else 'not met'}, {price}; saves "
        f"{format_bytes(plan.after_bytes)} for backward instead of {format_bytes(plan.before_bytes)}; recomputes "
        f"{len(plan.recompute)} symbols, an estimated {1e3 * plan.seconds:.1f} ms"
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


def unmet_warning(config: MemoryConfig, estimate: StepMemory) -> str | None:
    """The warning for ``config``'s budgets where ``estimate`` (a pair left as it is) misses them; None where it
    meets them."""
    excess, short_of_the_cap = _excess(config)
    return _unmet(config, estimate, short_of_the_cap) if excess(estimate) > 0 else None


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
    alive = ", ".join(f"{a.label} ({format_bytes(a.nbytes)}, {a.category.value})" for a in e.live_at_peak[:3])
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
