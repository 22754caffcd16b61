"""The rematerialization pass: choose what the forward saves for backward, and recompute the rest in backward.

Its two halves are modules of their own, which the other passes import from where each name is defined:
- ``mincut``: ``plan_saved(forward) -> SavePlan``, the set of tensors to save that minimises saved bytes (plus,
  with ``recompute_weight``, the traffic of what is recomputed; with a ``price``, the time of the expensive ops
  run again) by a minimum cut over the forward's data flow; ``recomputable``, ``priced``, ``recomputed_groups``;
- ``plan_rewrite``: ``apply_plan(forward, backward, plan) -> (forward, backward)``, the forward returning the
  plan's saved tensors and the backward recomputing the rest just before their first use.

``PASS``: the pass as the pipeline runs it (``declaration.Declaration``). Without a budget it applies the cut at
``MemoryConfig.recompute_weight``; with a memory budget or a saved budget (``MemoryConfig.budgeted``), the plan
that fits them, and a memory cap with them, recomputing least (``budget.propose``). Pure: new traces are returned.
"""

from __future__ import annotations

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import budget
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.units import format_bytes
from thunder_fsdp_mem.passes.driver import Checks, Context, Pair, Proposal
from thunder_fsdp_mem.passes.mincut import PlanError, plan_saved, recomputed_groups, saved_tensors
from thunder_fsdp_mem.passes.plan_rewrite import apply_plan, received


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    forward, backward = pair.forward, pair.backward
    saved = saved_tensors(forward)
    if not saved:
        # Nothing saved for backward (one of ThunderFX's graphs can be a few casts): nothing to recompute, and the
        # backward unpacks no saved tensors. A budget its peak misses is still said.
        if not config.budgeted:
            return Proposal(forward, backward)
        return Proposal(forward, backward, warning=budget.unmet_warning(config, context.estimate()))
    if [t.name for t in saved] != received(backward):
        raise PlanError("the backward does not receive what the forward saves")
    if config.budgeted:
        return budget.propose(pair, context, config)
    plan = plan_saved(forward, recompute_weight=config.recompute_weight)
    if not plan.changes:
        return Proposal(forward, backward)
    new_forward, new_backward = apply_plan(forward, backward, plan)
    note = (
        f"saves {format_bytes(plan.after_bytes)} for backward instead of {format_bytes(plan.before_bytes)}; "
        f"recomputes {len(plan.recompute)} symbols ({format_bytes(plan.traffic_bytes)} read and written)"
    )
    return Proposal(
        new_forward,
        new_backward,
        forward_checks=Checks(ignore_saved=True),
        note=note,
        recomputed=recomputed_groups(forward, plan),
        seconds=plan.seconds,
    )


PASS = Declaration("rematerialization", ("rematerialize",), Scope.PAIR, _propose)
