"""When Thunder's fsdp gathers each parameter: a prefetch window, and under ZeRO3 a second gather in backward.

Thunder's fsdp issues every all-gather at the top of the forward and waits for each just before its first use,
so every gathered parameter is in flight or alive at once; under ZeRO3 as under ZeRO2 the forward saves the
gathered parameters for backward.

- ``match(bsyms) -> tuple[Gather, ...]``: each ``future = torch_all_gather_prim_impl(shard, group, ...)`` and its
  one ``gathered = torch_wait_prim_impl(future)``. Anything else reading a future is a ``GatherError``.
- ``window(trace, max_inflight) -> trace``: the all-gathers issued in the order their waits run, each just early
  enough that at most ``max_inflight`` are in flight ahead of the one being waited for: the first
  ``max_inflight + 1`` where the first all-gather was, gather ``j`` right after the wait of gather
  ``j - max_inflight - 1``, or after its last use where the trace frees it (so that at most ``max_inflight + 1``
  gathered parameters exist at once when each is used before the next), and never after its own wait. Each wait
  first moves down to just before the first symbol that reads what it returns (Thunder waits in the order it
  gathers, which is the order of the parameters' names); ``del``s are placed again at last use.
- ``regather(forward, backward) -> (forward, backward)``: the forward saves each gathered parameter's shard (a
  forward input: saving it costs nothing) instead of the parameter, and the backward gathers it again just before
  its first use, with copies of the forward's own all-gather and wait (``plan_rewrite.apply_plan``).

Both depend on the trace alone, so every rank issues the same collectives in the same order. Both are pure.
``PASS``: both as the pipeline runs them (``declaration.Declaration``): ``regather`` where ``MemoryConfig.regather``
(resolved by the transform) says, then ``window`` on each trace, ``MemoryConfig.max_inflight_allgathers`` wide.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from thunder.core.prims import PrimIDs
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.trace import TraceCtx, TraceProvenance

from thunder_fsdp_mem.analysis.symbols import (
    ALL_GATHER,
    UNPACK_IDS,
    WAIT,
    def_use,
    is_del,
    nbytes,
    sym_id,
    without_dels,
)
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import checks, mincut, plan_rewrite
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Checks, Context, Pair, PassError, Proposal
from thunder_fsdp_mem.passes.edit import PROVENANCE, rebuilt


class GatherError(PassError):
    """The trace's all-gathers are not in a form these passes know; the message names what did not match."""


@dataclass(frozen=True, slots=True)
class Gather:
    """One all-gather: the indices of its symbol and of its wait, the shard it gathers, what the wait returns."""

    gather: int
    wait: int
    shard: str
    gathered: str


def match(bsyms: list) -> tuple[Gather, ...]:
    """Every all-gather of ``bsyms`` with its one wait, in the order of the all-gathers."""
    issued: dict[str, tuple[int, str]] = {}  # future -> (index, shard)
    waited: dict[str, tuple[int, str]] = {}  # future -> (index of its wait, gathered)
    for i, b in enumerate(bsyms):
        if is_del(b, clears=False):
            continue
        sid = sym_id(b)
        if sid == ALL_GATHER:
            shard = b.args[0] if b.args else None
            if not isinstance(shard, TensorProxy) or len(b.flat_proxy_outs) != 1:
                raise GatherError(f"all-gather at symbol {i} does not gather one tensor into one future")
            issued[b.flat_proxy_outs[0].name] = (i, shard.name)
            continue
        for a in b.flat_proxy_args:
            if a.name not in issued:
                continue
            if sid != WAIT or a.name in waited or len(b.flat_proxy_outs) != 1:
                raise GatherError(f"the future {a.name} of an all-gather is read by {b.sym.name} at symbol {i}")
            waited[a.name] = (i, b.flat_proxy_outs[0].name)
    missing = sorted(set(issued) - set(waited))
    if missing:
        raise GatherError(f"the all-gather future {missing[0]} is never waited for")
    return tuple(
        Gather(issued[f][0], waited[f][0], issued[f][1], waited[f][1])
        for f in sorted(issued, key=lambda f: issued[f][0])
    )


def window(trace: TraceCtx, max_inflight: int, *, clear_mutable_collections: bool = False) -> TraceCtx:
    """``trace`` with its all-gathers issued just early enough (see the module's docstring)."""
    bsyms = without_dels(trace.bound_symbols)
    found = match(bsyms)
    if not found:
        return trace
    bsyms = _sink_waits(bsyms, found)
    gathers = match(bsyms)  # the same all-gathers, at their new indices
    by_wait = sorted(gathers, key=lambda g: g.wait)
    returned = {a.name for a in bsyms[-1].flat_proxy_args} if bsyms[-1].sym.id == PrimIDs.RETURN else set()
    index = def_use(bsyms[:-1])
    top = min(g.gather for g in gathers)
    before: dict[int, list[int]] = defaultdict(list)
    after: dict[int, list[int]] = defaultdict(list)
    before[top] = [g.gather for g in by_wait[: max_inflight + 1]]
    for j in range(max_inflight + 1, len(by_wait)):
        done = by_wait[j - max_inflight - 1]
        # After gather j - max_inflight - 1 is waited for, and after its last use where this trace frees it.
        anchor = done.wait if done.gathered in returned else max(done.wait, index.last_reader(done.gathered, 0))
        if anchor < by_wait[j].wait:
            after[anchor].append(by_wait[j].gather)
        else:
            before[by_wait[j].wait].append(by_wait[j].gather)
    moved = {g.gather for g in gathers}
    out = []
    for i, b in enumerate(bsyms):
        out.extend(bsyms[k] for k in before.get(i, ()))
        if i not in moved:
            out.append(b)
        out.extend(bsyms[k] for k in after.get(i, ()))
    return rebuilt(
        trace, out, f"all-gathers in a window of {max_inflight}", clear_mutable_collections=clear_mutable_collections
    )


def _sink_waits(bsyms: list, gathers: tuple[Gather, ...]) -> list:
    """``bsyms`` with each wait moved down to just before the first symbol that reads what it returns."""
    waits = {g.wait: g.gathered for g in gathers}
    index = def_use(bsyms)
    before: dict[int, list[int]] = defaultdict(list)
    for i, name in sorted(waits.items()):
        before[index.first_reader(name, len(bsyms) - 1)].append(i)
    out = []
    for i, b in enumerate(bsyms):
        out.extend(bsyms[k] for k in before.get(i, ()))
        if i not in waits:
            out.append(b)
    return out


def regather(forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
    """The forward saves shards instead of the gathered parameters it saves today; the backward gathers them
    again. Returns the traces unchanged when the forward saves no gathered parameter of a forward input."""
    bsyms = forward.bound_symbols
    inputs = {a.name for a in forward.args if isinstance(a, Proxy)}
    inputs.update(o.name for b in bsyms if b.sym.id in UNPACK_IDS for o in b.flat_proxy_outs)
    saved = [t.name for t in mincut.saved_tensors(forward)]
    by_gathered = {g.gathered: g for g in match(bsyms) if g.shard in inputs}
    again = [by_gathered[n] for n in saved if n in by_gathered]
    if not again:
        return forward, backward
    new_saved = []
    for name in saved:
        name = by_gathered[name].shard if name in by_gathered else name
        if name not in new_saved:
            new_saved.append(name)
    tensors = {p.name: p for b in bsyms for p in (*b.flat_proxy_args, *b.flat_proxy_outs)}
    before = sum(nbytes(tensors[n]) for n in saved if n not in inputs)
    after = sum(nbytes(tensors[n]) for n in new_saved if n not in inputs)
    plan = mincut.SavePlan(
        saved=tuple(new_saved),
        recompute=tuple(sorted(i for g in again for i in (g.gather, g.wait))),
        before_bytes=before,
        after_bytes=after,
    )
    new_forward, new_backward = plan_rewrite.apply_plan(forward, backward, plan)
    new_backward.set_provenance(TraceProvenance(f"{PROVENANCE}: gathers {len(again)} parameters again in backward"))
    return new_forward, new_backward


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    forward, backward, width = pair.forward, pair.backward, config.max_inflight_allgathers
    if not any(sym_id(b) == ALL_GATHER for b in forward.bound_symbols):
        return Proposal(forward, backward)
    new_forward, new_backward = regather(forward, backward) if config.regather else (forward, backward)
    again = {b.args[0].name for b in new_backward.bound_symbols if sym_id(b) == ALL_GATHER}
    added = tuple(c for c in checks.collectives(forward) if c[0] == ALL_GATHER and c[1][0] in again)
    new_forward = window(new_forward, width)
    new_backward = window(new_backward, width, clear_mutable_collections=True)
    note = f"window of {width}" + (f", {len(added)} gathered again in backward" if added else "")
    return Proposal(
        new_forward,
        new_backward,
        forward_checks=Checks(ignore_saved=True, ordered=False),
        backward_checks=Checks(added=added),
        note=note,
    )


PASS = Declaration("all-gathers", ("gathers",), Scope.PAIR, _propose)
