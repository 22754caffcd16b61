"""Rewrite a forward and its backward for a ``SavePlan``: the forward saves what the plan says, the backward
recomputes the rest.

``apply_plan(forward, backward, plan) -> (forward, backward)`` rewrites both traces: the forward returns the new
saved tensors; the backward unpacks them and recomputes the rest just before their first use, by copies of the
forward's own bound symbols (the same executor calls on the same values, so the backward computes bit for bit what
it did before), or, where the cut opened the forward's fusion regions, by new regions of their recomputed ops
(``regions.closed``; the pass ``fold`` may then run them inside the regions that read them); a recomputed symbol
that repeats one the backward runs anyway (the same cast of a saved tensor) is dropped, and ``del``s and collection
clears are placed again as Thunder's ``del_last_used`` places them (``edit.dels_at_last_use``).
``received(backward)`` and ``unpacking(bsyms)`` read where a backward unpacks its saved tensors. The plan comes from
``mincut.plan_saved`` (rematerialization), or is built by a pass that moves collectives (``gathers.regather``) or
fusions (``fusions``). Pure: new traces are returned.
"""

from __future__ import annotations

import copy

from thunder.core.prims import PrimIDs
from thunder.core.proxies import Proxy, variableify
from thunder.core.pytree import tree_map
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_fsdp_mem.analysis.symbols import (
    COLLECTIVES,
    accumulates,
    def_use,
    is_copy_into,
    is_fusion,
    sym_id,
    without_dels,
)
from thunder_fsdp_mem.passes.edit import PROVENANCE, dels_at_last_use, fusion_for
from thunder_fsdp_mem.passes.mincut import PlanError, SavePlan, recomputable
from thunder_fsdp_mem.passes.regions import closed


def apply_plan(forward: TraceCtx, backward: TraceCtx, plan: SavePlan) -> tuple[TraceCtx, TraceCtx]:
    """Both traces rewritten for ``plan``: the forward returns ``plan.saved``; the backward unpacks them and runs
    the forward's symbols ``plan.recompute`` again, each just before the first use of what it computes."""
    bw = without_dels(backward.bound_symbols)
    if plan.opened is None:
        fw_all, recomputed = forward.bound_symbols, [forward.bound_symbols[i] for i in plan.recompute]
    else:  # the regions the cut opened: closed again, their recomputed ops as new regions
        wanted = {p.name for b in bw for p in b.flat_proxy_args}
        fw_all, recomputed = closed(forward.bound_symbols, plan.opened, plan.saved, plan.recompute, wanted)
    fw_bsyms = without_dels(fw_all)
    by_name = {}
    for b in fw_all:
        for p in (*b.flat_proxy_args, *b.flat_proxy_outs):
            by_name.setdefault(p.name, p)
    ret = fw_bsyms[-1]
    outputs, (_, others) = ret.args
    new_saved = tuple(by_name[n] for n in plan.saved)
    new_forward = from_trace(forward)
    new_forward.bound_symbols = [*fw_bsyms[:-1], ret.from_bsym(args=(outputs, (new_saved, others)))]
    new_forward = dels_at_last_use(new_forward)
    new_forward.set_provenance(
        TraceProvenance(f"{PROVENANCE}: saves {plan.after_bytes} bytes for backward instead of {plan.before_bytes}")
    )

    unpack_at = _receive(bw, new_saved)
    new_backward = from_trace(backward)
    new_backward.args = ([list(new_saved), *backward.args[0][1:]], *backward.args[1:])
    defined = {p.name for b in bw[: unpack_at + 1] for p in b.flat_proxy_outs}
    read = {p.name for b in (*bw, *recomputed) for p in b.flat_proxy_args}
    clones = []
    with tracectx(new_backward):
        for bsym in recomputed:
            clones.append(_clone(_what_is_read(bsym, read - defined), defined, new_backward))
    new_backward.bound_symbols = _insert_before_first_use(bw, clones, start=unpack_at + 1)
    new_backward.bound_symbols = _drop_repeats(new_backward.bound_symbols)
    new_backward = dels_at_last_use(new_backward, clear_mutable_collections=True)
    new_backward.set_provenance(TraceProvenance(f"{PROVENANCE}: recomputes {len(plan.recompute)} forward symbols"))
    return new_forward, new_backward


def received(backward: TraceCtx) -> list[str]:
    """Names of the saved tensors a backward trace unpacks, in order."""
    return [o.name for o in backward.bound_symbols[unpacking(backward.bound_symbols)["C0"]].flat_proxy_outs]


def unpacking(bsyms) -> dict[str, int]:
    """Where Thunder's backward unpacks its saved tensors: ``saved_for_backward`` (``trivial``), its split into
    ``C0, C1`` (``split``), and ``C0`` into the tensors (``C0``)."""
    at = {}
    for i, b in enumerate(bsyms):
        first = b.args[0] if b.args else None
        if b.sym.id == PrimIDs.UNPACK_TRIVIAL and getattr(b.output, "name", None) == "saved_for_backward":
            at["trivial"] = i
        elif b.sym.id == PrimIDs.UNPACK_SEQUENCE and getattr(first, "name", None) == "saved_for_backward":
            at["split"] = i
        elif b.sym.id == PrimIDs.UNPACK_SEQUENCE and getattr(first, "name", None) == "C0":
            at["C0"] = i
    if len(at) != 3:
        raise PlanError("the backward trace does not unpack its saved tensors as saved_for_backward -> C0")
    return at


def _receive(bsyms: list, saved: tuple) -> int:
    """Make the backward's symbols receive ``saved``, in place in the list ``bsyms``. The collections are proxies
    that list their members, so each is replaced by a copy that lists the new ones. Returns the index of
    ``... = C0``."""
    at = unpacking(bsyms)
    old_whole = bsyms[at["trivial"]].output
    old_c0, *rest = old_whole.coll
    c0 = copy.copy(old_c0)
    c0.coll = list(saved)
    whole = copy.copy(old_whole)
    whole.coll = [c0, *rest]
    bsyms[at["trivial"]] = bsyms[at["trivial"]].from_bsym(output=whole)
    split = bsyms[at["split"]]
    bsyms[at["split"]] = split.from_bsym(args=(whole, *split.args[1:]), output=[c0, *rest])
    bsyms[at["C0"]] = bsyms[at["C0"]].from_bsym(args=(c0, len(saved)), output=list(saved))
    return at["C0"]


def _what_is_read(bsym, read: set[str]):
    """A fusion recomputed for some of its outputs (those in ``read``: the backward reads them and does not have
    them already), as a fusion that computes those alone (``edit.fusion_for``); any other symbol as it is.

    Where those outputs need an accumulating reduction (``symbols.accumulates``: a sum, a mean, a variance), the
    fusion is run again whole, by its own callable: a new region is a new kernel, whose compiler chooses anew
    the order it adds in, and the backward would get other bits than the forward computed (``docs/design.md``).
    Elementwise ops round each value on their own, so a region of them alone computes what the forward did."""
    if not is_fusion(bsym):
        return bsym
    wanted = [p for p in bsym.flat_proxy_outs if p.name in read]
    if not wanted or len(wanted) == len(bsym.flat_proxy_outs):
        return bsym
    pruned = fusion_for(bsym, wanted)
    return bsym if any(accumulates(s) for s in pruned.subsymbols) else pruned


def _clone(bsym, defined: set[str], trace: TraceCtx):
    """A copy of a forward symbol for the backward; outputs the backward already has (saved ones, when a symbol
    with several outputs is run again for one of them) get fresh names."""

    def fresh(p):
        if isinstance(p, Proxy) and p.name in defined:
            return p.replace_name(p.name, disambiguate=True)
        return p

    clone = (
        bsym.from_bsym(output=tree_map(fresh, bsym.output))
        if any(p.name in defined for p in bsym.flat_proxy_outs)
        else bsym.from_bsym()
    )
    defined.update(p.name for p in clone.flat_proxy_outs)
    return clone


def _drop_repeats(bsyms: list) -> list:
    """``bsyms`` with each cheap deterministic symbol (``recomputable``, not a fusion) that repeats an earlier one
    (same op, same executor, same arguments) dropped, and its outputs' readers reading the earlier outputs instead.
    Thunder's ``cse`` does this too but refuses traces with fusions, and tells forward from backward symbols.

    A symbol whose output the trace returns, or a collective reads, is never dropped: the rewrite must return what
    the backward returned (``checks.check_same_result``) and issue the collectives it issued on the same tensors
    (``checks.check_same_collectives``), and two outputs equal by construction stay two tensors. Under a parallel
    residual in float32, the gradients of the attention's and the MLP's output biases are both ``sum(g, (0, 1))``
    of the block's output gradient ``g``; dropping the second would return the first for both, or, under Thunder's
    fsdp, reduce-scatter the first twice."""
    written = {a.name for b in bsyms if is_copy_into(b) for a in b.flat_proxy_args}
    returned = {
        a.name for b in bsyms if b.sym.id == PrimIDs.RETURN or sym_id(b) in COLLECTIVES for a in b.flat_proxy_args
    }
    first: dict[tuple, object] = {}
    swap: dict = {}
    out = []
    swapped: set[str] = set()
    for b in bsyms:
        if swapped and any(a.name in swapped for a in b.flat_proxy_args):
            b = b.from_bsym_swap_proxies(swap, skip_output=True)
        if (
            not is_fusion(b)
            and b.flat_proxy_outs
            and recomputable(b)
            and not any(a.name in written for a in b.flat_proxy_args)
        ):
            rhs = b.rhs
            key = (rhs.sym, rhs.args, rhs.kwargs, b.sym.executor)
            earlier = first.get(key)
            if earlier is not None and not any(o.name in returned for o in b.flat_proxy_outs):
                swap.update((variableify(o), e) for o, e in zip(b.flat_proxy_outs, earlier.flat_proxy_outs))
                swapped.update(o.name for o in b.flat_proxy_outs)
                continue
            first.setdefault(key, b)
        out.append(b)
    return out


def _insert_before_first_use(bsyms: list, clones: list, *, start: int) -> list:
    """``bsyms`` with each clone placed just before the first symbol that reads one of its outputs (or before a
    later clone that does), keeping the clones' own order."""
    first_use = def_use(bsyms)
    readers: dict[str, list[int]] = {}  # clones that read a name
    for j, clone in enumerate(clones):
        for a in clone.flat_proxy_args:
            readers.setdefault(a.name, []).append(j)
    position = [len(bsyms) - 1] * len(clones)  # before the return at the latest
    for k in range(len(clones) - 1, -1, -1):  # later clones first: a clone goes no later than its readers
        names = [o.name for o in clones[k].flat_proxy_outs]
        at = min((first_use.first_reader(n) for n in names if n in first_use.readers), default=len(bsyms) - 1)
        at = min([at, *(position[j] for n in names for j in readers.get(n, ()) if j > k)])
        position[k] = max(at, start)
    out = []
    pending = sorted(range(len(clones)), key=lambda k: (position[k], k))
    p = 0
    for i, b in enumerate(bsyms):
        while p < len(pending) and position[pending[p]] == i:
            out.append(clones[pending[p]])
            p += 1
        out.append(b)
    return out
