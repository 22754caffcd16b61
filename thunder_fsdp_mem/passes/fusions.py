"""Recompute in a backward fusion the cheap tail of the forward fusion that feeds it, as Thunder means to.

``into_consumers(forward, backward) -> (forward, backward, bytes the forward saves less)``. Thunder fuses the
joint forward and backward trace and then rematerializes between each producer fusion and each consumer fusion
(``thunder.core.rematerialization.rematerialize``): the producer returns a minimum cut of its values (never
past a matmul, a reduction or a random op) and the consumer recomputes the rest from it. The pairs are taken in
order, and a consumer updated by an earlier pair stays, under its old identity, among the "other consumers" of
every later producer (the global check of ``find_external_producer_outputs`` compares the updated consumer with
the map of the original symbols). So once a backward fusion has taken recomputation from one forward fusion, no
later forward fusion can move anything into it: everything it reads from them is saved as computed. Under
``thunder.jit`` the regions of stablecode-3b's blocks pair in an order this does not stop (12 layers, fused:
nothing left to move); under ThunderFX (FSDP2's path) the second backward region of a block reads from both
forward regions, and the block saves the float32 upcasts and layer norm intermediates of its MLP half (several
times what it saves with them recomputed; the figures in ``docs/design.md``).

This pass takes the pairs again on the split traces, forward fusion to backward fusion, with each output's other
readers counted by the original symbols, and applies Thunder's own cut and rewrite (``find_cut``,
``apply_rematerialization_for_producer`` and ``..._for_consumer``) where the consumer does not read the cut
already (where it does, Thunder took the pair). The producer and consumer fusions get new callables from their
executor (``thunder_internals.update_fusion``), the forward saves the new cut, the backward unpacks it. The moved
symbols are Thunder's: elementwise ops, casts and reshapes, computed in the backward fusion from the same values.

The results are then those of Thunder's rematerialization, bit for bit those of a Thunder whose rematerialization
takes the same pair (``tests/test_upstream.py``, CPU), and not those of the run without it: a value computed in
another kernel can round differently (``docs/design.md``, "Fusion rematerialization"). It is on by default, as
Thunder's own rematerialization is wherever a fusion executor runs; ``MemoryConfig(fusion_rematerialize=False)``
turns it off, and with it every pass keeps the untransformed run's results bit for bit. Where Thunder's
rematerialization took every pair (``thunder.jit``, or a Thunder with the check corrected, ``docs/upstream/``),
nothing moves.

``PASS``: the pass as the pipeline runs it (``declaration.Declaration``); the forward it proposes saves other
tensors.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from thunder.core import rematerialization as remat
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx, from_trace
from thunder import torch as ltorch

from thunder_fsdp_mem.analysis.cost import op_flops, traffic_equivalent
from thunder_fsdp_mem.analysis.symbols import is_fusion, names, nbytes, numel, sym_id, without_dels
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import mincut, plan_rewrite
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.units import format_bytes
from thunder_fsdp_mem.passes.driver import Checks, Context, Pair, PassError, Proposal
from thunder_fsdp_mem.passes.mincut import EXPANSION, expanding, recomputable
from thunder_fsdp_mem.thunder_internals import softmax_symbol, update_fusion


SOFTMAXES = names(softmax_symbol())
REDUCTIONS = names(ltorch.amax, ltorch.amin, ltorch.sum)


class FusionError(PassError):
    """Thunder's rematerialization helpers did not take a pair of these traces' fusions."""


def into_consumers(
    forward: TraceCtx, backward: TraceCtx, *, scores: bool = True, statistics: bool = True
) -> tuple[TraceCtx, TraceCtx, int]:
    """``forward`` and ``backward`` with each forward fusion's cut to each backward fusion taken again (see the
    module's docstring), and the bytes the forward saves less; the traces themselves and 0 where nothing moves.
    ``scores``: the cut also crosses attention's expanding matmul (``_through_expansions``,
    ``MemoryConfig.recompute_scores``); ``statistics``: it keeps row statistics rather than reduce over (T, T)
    again (``_through_expansions``). Raises ``FusionError`` where Thunder's helpers fail on them (the driver then
    keeps the traces, with a warning)."""
    try:
        return _into_consumers(forward, backward, scores, statistics)
    except (RuntimeError, AssertionError, ValueError, KeyError, NotImplementedError) as e:
        if isinstance(e, PassError):
            raise
        raise FusionError(f"Thunder's rematerialization did not take these fusions: {type(e).__name__}: {e}") from e


def _into_consumers(
    forward: TraceCtx, backward: TraceCtx, scores: bool, statistics: bool
) -> tuple[TraceCtx, TraceCtx, int]:
    saved = mincut.saved_tensors(forward)
    fw = without_dels(forward.bound_symbols)
    bw = without_dels(backward.bound_symbols)
    readers: dict[str, list] = defaultdict(list)  # proxy name -> the symbols that read it, original identities
    for b in (*fw, *bw):
        if b.sym.id == PrimIDs.RETURN:
            continue
        for name in {p.name for p in b.flat_proxy_args}:
            readers[name].append(b)
    returned = {p.name for p in tree_flatten(fw[-1].args[0])[0] if isinstance(p, TensorProxy)}
    saved_names = {t.name for t in saved}
    producers = [b for b in fw if is_fusion(b)]
    consumers = [b for b in bw if is_fusion(b)]
    at = {id(b): i for i, b in enumerate(consumers)}
    current = {id(b): b for b in (*producers, *consumers)}
    for producer in producers:
        readers_of = {o.name: readers[o.name] for o in producer.flat_proxy_outs}
        mine = sorted(
            {
                id(c)
                for o in producer.flat_proxy_outs
                if o.name in saved_names
                for c in readers_of[o.name]
                if id(c) in at
            },
            key=at.get,
        )
        kept: tuple = ()
        for c_id in mine:
            consumer = consumers[at[c_id]]
            p_now, c_now = current[id(producer)], current[c_id]
            if scores and statistics:
                p_now = _softmax_opened(p_now)
            external = tuple(
                o
                for o in p_now.output
                if isinstance(o, TensorProxy)
                and (o.name in returned or any(r is not consumer for r in readers_of.get(o.name, ())))
            )
            cut = remat.find_cut(external, p_now, c_now)
            if scores:
                cut = _through_expansions(p_now, c_now, cut, saved_names, statistics)
            if not cut:
                continue
            c_new = remat.apply_rematerialization_for_consumer(p_now, c_now, cut)
            if c_new is c_now:  # it reads the cut already: Thunder took this pair
                continue
            current[id(producer)] = remat.apply_rematerialization_for_producer(external + kept, p_now, cut)
            current[c_id] = c_new
            kept += tuple(cut)
    originals = {id(b): b for b in (*producers, *consumers)}
    updated = {k: update_fusion(b) for k, b in current.items() if b is not originals[k]}
    if not updated:
        return forward, backward, 0
    new_fw = [updated.get(id(b), b) for b in fw]
    new_bw = [updated.get(id(b), b) for b in bw]
    return _resaved(forward, backward, new_fw, new_bw, saved)


def _through_expansions(producer, consumer, cut, saved_names: set[str], statistics: bool = True) -> list:
    """Thunder's ``cut`` of ``producer`` for ``consumer`` (or, where it has none, what ``consumer`` reads from
    ``producer``) with each value that is cheaper to compute again than to keep replaced by what it is computed
    from: a value larger than the values it comes from (attention's (T, T) scores and probabilities, computed by an
    expanding matmul from the query and key the backward reads anyway; ``mincut.expanding``), whose recomputation
    costs no more than its bytes written and read once (``cost.traffic_equivalent`` of the matmuls it runs again) and
    adds fewer bytes to what the forward saves than it removes. Thunder's own cut never crosses a matmul; attention
    decomposed inside one fusion (a soft-cap, a mask, a fusion executor that claims attention) keeps its (T, T)
    tensors alive from forward to backward without this. The walk keeps row statistics (``_statistic``: the
    softmax's maximum and sum, once ``_softmax_opened`` exposes them) rather than reduce over (T, T) again."""
    inputs = {a.name for a in producer.flat_proxy_args}
    produced, proxies = {}, {a.name: a for a in producer.flat_proxy_args}  # proxies: Thunder's cut may name values
    for b in producer.subsymbols:
        for o in b.flat_proxy_outs:
            produced[o.name], proxies[o.name] = b, o
    reads = (
        [proxies[c] if isinstance(c, str) else c for c in cut]
        if cut
        else [a for a in consumer.flat_proxy_args if a.name in produced or a.name in inputs]
    )
    held = {t.name for t in reads} | inputs | saved_names  # what the backward has without recomputing
    replaced: set[str] = set()
    changed = True
    while changed:  # replacing one value can make another worth replacing (it no longer stops the walk)
        changed = False
        for value in reads:
            if value.name in replaced:
                continue
            found = _recomputation(value, produced, held - replaced - {value.name}, statistics)
            if found is not None and _worth(value, *found, held=held - replaced):
                replaced.add(value.name)
                changed = True
    if not replaced:
        return cut
    widened = {t.name: t for t in reads if t.name not in replaced}
    for value in reads:
        if value.name in replaced:
            _, frontier = _recomputation(value, produced, held - replaced - {value.name}, statistics)
            widened.update((t.name, t) for t in frontier)
    return list(widened.values())


def _softmax_opened(region):
    """``region`` with each softmax over the output of an expanding matmul (attention's probabilities) replaced by
    the ops it is made of (the row maximum, the exponentials, their row sum, the division), so that a cut may keep
    the two row statistics, a few hundred KiB at 8192 tokens, and the backward compute the probabilities again
    elementwise from the scores, as flash attention's backward does, instead of both reductions over (T, T) again.
    On CUDA Inductor's post-grad patterns turn the ops into the one-pass online softmax its lowering of the softmax
    gives. ``region`` itself where it has no such softmax."""
    subs = list(region.subsymbols)
    expanded = {o.name for s in subs if expanding(s) for o in s.flat_proxy_outs}
    for s in subs:  # what is computed from the expanding matmuls' outputs
        if any(a.name in expanded for a in s.flat_proxy_args):
            expanded.update(o.name for o in s.flat_proxy_outs)
    opened = []
    for s in subs:
        if sym_id(s) in SOFTMAXES and s.subsymbols and any(a.name in expanded for a in s.flat_proxy_args):
            opened.extend(s.subsymbols)
        else:
            opened.append(s)
    if len(opened) == len(subs):
        return region
    return dataclasses.replace(region, subsymbols=tuple(opened))


def _statistic(bsym) -> bool:
    """A reduction whose output is a row statistic: at most 1/``EXPANSION`` of its input's elements."""
    if sym_id(bsym) not in REDUCTIONS:
        return False
    ins = [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
    outs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
    return bool(ins and outs) and EXPANSION * sum(numel(o) for o in outs) <= numel(ins[0])


def _worth(value, chain: list, frontier: list, *, held: set[str]) -> bool:
    """Whether computing ``value`` again by ``chain`` from ``frontier`` beats keeping it: the chain runs an expanding
    matmul, costs no more than ``value``'s bytes written and read once, and the frontier adds fewer bytes than
    ``value`` holds to what the backward reads."""
    added = sum(nbytes(t) for t in frontier if t.name not in held)
    price = sum(traffic_equivalent(s) for s in chain if op_flops(s)[0])
    return any(expanding(s) for s in chain) and added < nbytes(value) and price <= 2 * nbytes(value)


def _recomputation(value, produced: dict, stop: set[str], statistics: bool = True) -> tuple[list, list] | None:
    """The symbols of a fusion region that compute ``value`` from values in ``stop`` (saved anyway, or the region's
    inputs), and those values; None where the walk meets an op the cut may not recompute (a matmul that does not
    expand, a random op, an in-place copy)."""
    chain, frontier, seen, todo = {}, {}, set(), [value]
    while todo:
        t = todo.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        if t is not value and t.name in stop or t.name not in produced:
            frontier[t.name] = t
            continue
        bsym = produced[t.name]
        if statistics and t is not value and _statistic(bsym):
            frontier[t.name] = t  # kept: a row statistic costs little to save and a pass over its input to rerun
            continue
        if not (recomputable(bsym) or expanding(bsym)):
            return None
        chain.setdefault(id(bsym), bsym)
        todo.extend(a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy))
    return list(chain.values()), list(frontier.values())


def _resaved(forward, backward, new_fw: list, new_bw: list, saved) -> tuple[TraceCtx, TraceCtx, int]:
    """The traces with the rewritten symbols, the forward saving what the backward now reads from it: the tensors
    saved before that it still reads, in their order, then the new ones in the forward's order."""
    unpacking = plan_rewrite.unpacking(new_bw)["C0"]  # the saved tensors: defined there, received from the forward
    defined_in_bw = {p.name for i, b in enumerate(new_bw) if i != unpacking for p in b.flat_proxy_outs}
    read_in_bw = {p.name for b in new_bw for p in b.flat_proxy_args} - defined_in_bw
    produced = {}
    for b in new_fw:
        for p in b.flat_proxy_outs:
            produced.setdefault(p.name, p)
    for p in forward.args:
        if isinstance(p, TensorProxy):
            produced.setdefault(p.name, p)
    kept = [t.name for t in saved if t.name in read_in_bw]
    new = [n for n in produced if n in read_in_bw and n not in kept and isinstance(produced[n], TensorProxy)]
    plan = mincut.SavePlan(
        saved=(*kept, *new),
        recompute=(),
        before_bytes=sum(nbytes(t) for t in saved),
        after_bytes=sum(nbytes(produced[n]) for n in (*kept, *new)),
    )
    fw_trace, bw_trace = _with(forward, new_fw), _with(backward, new_bw)
    new_forward, new_backward = plan_rewrite.apply_plan(fw_trace, bw_trace, plan)
    return new_forward, new_backward, plan.before_bytes - plan.after_bytes


def _with(trace: TraceCtx, bsyms: list) -> TraceCtx:
    new = from_trace(trace)
    new.bound_symbols = list(bsyms)
    return new


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    forward, backward, less = into_consumers(pair.forward, pair.backward, scores=config.recompute_scores)
    if forward is pair.forward:
        return Proposal(forward, backward)
    estimate = context.estimator(forward, backward)
    if config.recompute_scores and estimate.peak_bytes > context.estimate().peak_bytes:
        # Where the peak holds all that the forward saves, the row statistics raise it: the cut without them
        forward, backward, less = into_consumers(pair.forward, pair.backward, statistics=False)
        estimate = None
    return Proposal(
        forward,
        backward,
        forward_checks=Checks(ignore_saved=True),
        note=f"the backward's fusions recompute what they read from the forward's: saves {format_bytes(less)} less",
        estimate=estimate,
    )


PASS = Declaration("fusion rematerialization", ("fusion_rematerialize",), Scope.PAIR, _propose)
