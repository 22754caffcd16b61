"""Choose what the forward saves for backward, and recompute the rest in backward.

``plan_saved(forward) -> SavePlan`` reads a forward execution trace (Thunder's augmented forward, which returns
``(outputs, (saved tensors, saved others))``) and finds the set of tensors to save that minimises saved bytes,
such that everything the backward receives today can be rebuilt in backward from the saved tensors by cheap ops.
It is a minimum cut over the forward's data flow:

- every tensor ``v`` is two nodes, ``v.in`` and ``v.out``, joined by an edge whose capacity is the cost of saving
  ``v`` (its bytes; nothing for the forward's inputs, which the caller holds anyway: parameters, under FSDP2 the
  gathered parameters that FSDP2 itself frees and re-gathers, the step's inputs);
- a recomputable op joins each tensor argument's ``out`` to each output's ``in`` with unbounded capacity: a
  tensor recomputed in backward needs its arguments there;
- the source feeds the ``in`` of every tensor that cannot be recomputed (inputs; outputs of matmuls, attention,
  collectives, random and unknown ops); every tensor the backward receives today feeds the sink.

Cut edges ``v.in -> v.out`` are the tensors to save; tensors whose ``in`` falls on the sink's side are
recomputed in backward, in forward order, by copies of the forward's own bound symbols: the same executor
calls on the same values, so the backward computes bit for bit what it did before. Ties go to the tensors saved
today, so nothing is recomputed for nothing.

Recomputation costs time: ops outside fusions each read and write whole tensors. With ``recompute_weight``
w > 0, each recomputable symbol is also a node ``("op", i)`` between its arguments and outputs, fed by the source
with capacity w x its traffic (``cost.op_traffic``): the cut pays it when the symbol runs again, once however
many of its outputs are needed. The cut then minimises saved bytes + w x recomputation traffic.

With a ``price`` (bytes of saved memory one second of recomputation is worth), the expensive deterministic ops
become recomputable too: matmuls, attention without dropout, embeddings, and fusion regions made of them and cheap
ops (``priced``). Each is such a node, fed with capacity price x its time (``cost.op_seconds``), so that the cut
minimises saved bytes + w x traffic + price x the time of the expensive ops run again. A high price gives the cut
without them; price 0 saves the least the forward can save. ``passes.budget`` chooses the price that fits a
memory budget. With ``segments=True``, an argument of a recomputed expensive op that would itself be rebuilt from
another recomputed expensive op is saved instead, so that each is recomputed from saved tensors and cheap ops
alone, just before the backward needs it (as activation checkpointing recomputes a block from its saved input).

``apply_plan(forward, backward, plan) -> (forward, backward)`` rewrites both traces: the forward returns the new
saved tensors; the backward unpacks them and recomputes the rest just before their first use; a recomputed
symbol that repeats one the backward runs anyway (the same cast of a saved tensor) is dropped, and ``del``s and
collection clears are placed again as Thunder's ``del_last_used`` places them (``edit.dels_at_last_use``). Both
functions are pure.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov
from thunder.core.prims import PrimIDs
from thunder.core.proxies import Proxy, TensorProxy, variableify
from thunder.core.pytree import tree_map
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_fsdp_mem.analysis.cost import (
    ATTENTION,
    H200,
    MATMULS,
    DeviceRates,
    attention_options,
    op_seconds,
    op_traffic,
)
from thunder_fsdp_mem.analysis.symbols import (
    ELEMENTWISE_OPS,
    RESHAPE_OPS,
    UNPACK_IDS,
    VIEW_OPS,
    WAITS,
    def_use,
    is_copy_into,
    is_fusion,
    nbytes,
    sym_id,
    without_dels,
)
from thunder_fsdp_mem.passes.driver import PassError, Recomputed
from thunder_fsdp_mem.passes.edit import PROVENANCE, dels_at_last_use, fusion_for

# Cheap to recompute, and deterministic: elementwise ops and casts, views and reshapes, concatenation and padding,
# factories without randomness, and reductions (whose outputs are small and whose cost is one read of the input).
RECOMPUTABLE_OPS = (
    ELEMENTWISE_OPS
    | (VIEW_OPS - WAITS)
    | RESHAPE_OPS
    | frozenset(
        {
            "convert_element_type",
            "broadcast_in_dim",
            "cat",
            "torch_pad_prim_impl",
            "pad",
            "arange",
            "full",
            "sum",
            "var_mean",
            "mean",
            "var",
            "amax",
            "amin",
            "prod",
            "contiguous",
        }
    )
)

# Deterministic too, but dear: recomputed only at a price (a memory budget).
PRICED_OPS = MATMULS | ATTENTION | {"embedding"}
_SOURCE, _SINK = "source", "sink"


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What the forward saves and what the backward recomputes.

    saved: names of the tensors the forward returns for backward, in order.
    recompute: indices, in the forward's bound symbols, of the symbols the backward runs again (forward order).
    before_bytes / after_bytes: saved bytes beyond the forward's inputs, today and with the plan.
    traffic_bytes: what the recomputation reads and writes (``cost.op_traffic``), its cost.
    seconds: its estimated time on the device the plan was priced for (``cost.op_seconds``).
    """

    saved: tuple[str, ...]
    recompute: tuple[int, ...]
    before_bytes: int
    after_bytes: int
    traffic_bytes: int = 0
    seconds: float = 0.0

    @property
    def changes(self) -> bool:
        return bool(self.recompute)


class PlanError(PassError):
    """The trace is not a forward this pass understands, or the plan does not hold together."""


def saved_tensors(forward: TraceCtx) -> tuple[TensorProxy, ...]:
    """The tensors an augmented forward returns for backward."""
    ret = forward.bound_symbols[-1]
    if (
        ret.sym.id != PrimIDs.RETURN
        or len(ret.args) != 2
        or not isinstance(ret.args[1], tuple | list)
        or len(ret.args[1]) != 2
    ):
        raise PlanError("the forward trace does not end in return(outputs, (saved tensors, saved others))")
    return tuple(ret.args[1][0])


def recomputable(bsym) -> bool:
    """True for ops this pass may run again in backward: a cheap deterministic op, or a fusion of such ops, whose
    arguments are all tensors or constants."""
    if any(not isinstance(a, TensorProxy) for a in bsym.flat_proxy_args):
        return False  # futures, numbers and collections the backward would not have
    if is_fusion(bsym):
        return bool(bsym.subsymbols) and all(recomputable(s) for s in bsym.subsymbols)
    return sym_id(bsym) in RECOMPUTABLE_OPS


def priced(bsym) -> bool:
    """True for the expensive deterministic ops the cut may recompute at a price: matmuls, attention without
    dropout, embeddings, and fusion regions made of them and cheap ops, whose arguments are all tensors or
    constants."""
    if any(not isinstance(a, TensorProxy) for a in bsym.flat_proxy_args):
        return False
    if is_fusion(bsym):
        return bool(bsym.subsymbols) and all(recomputable(s) or priced(s) for s in bsym.subsymbols)
    sid = sym_id(bsym)
    if sid in ATTENTION:
        return attention_options(bsym)[0] == 0.0
    return sid in PRICED_OPS


def plan_saved(
    forward: TraceCtx,
    *,
    recompute_weight: float = 0.0,
    price: float | None = None,
    rates: DeviceRates = H200,
    segments: bool = False,
    only: frozenset[int] | None = None,
) -> SavePlan:
    """The minimum-cut choice of saved tensors for ``forward`` (see the module's docstring): it minimises saved
    bytes plus ``recompute_weight`` times the bytes the recomputation reads and writes, and, with a ``price``,
    plus ``price`` times the seconds the expensive ops run again take on a device of ``rates``. ``segments``: no
    expensive op is recomputed from another (see the module's docstring); ``only``: the indices of the expensive
    ops the price may recompute (None: all)."""
    saved = saved_tensors(forward)
    bsyms = forward.bound_symbols
    producer: dict[str, int] = {}
    inputs: set[str] = set()
    written: set[str] = set()  # destinations of in-place copies: their value changes, never recompute from them
    tensors: dict[str, TensorProxy] = {}
    can = [False] * len(bsyms)  # recomputable(bsyms[i]), or priced at a price, decided once
    dear = [False] * len(bsyms)  # recomputed at the price
    for i, bsym in enumerate(bsyms):
        tensors.update(
            (p.name, p) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs) if isinstance(p, TensorProxy)
        )
        sid = bsym.sym.id
        if sid in UNPACK_IDS:
            inputs.update(o.name for o in bsym.flat_proxy_outs)
            continue
        if sid in (PrimIDs.DEL, PrimIDs.RETURN):
            continue
        if is_copy_into(bsym):
            written.update(a.name for a in bsym.flat_proxy_args)
        can[i] = recomputable(bsym)
        if not can[i] and price is not None and priced(bsym) and (only is None or i in only):
            can[i] = dear[i] = True
        for o in bsym.flat_proxy_outs:
            producer.setdefault(o.name, i)
    inputs.update(a.name for a in forward.args if isinstance(a, Proxy))
    # A symbol that reads what an in-place copy writes would see another value in backward.
    can = [c and not any(a.name in written for a in b.flat_proxy_args) for c, b in zip(can, bsyms)]

    required = {t.name for t in saved}
    today = sum(nbytes(t) for t in saved if t.name not in inputs)
    graph = nx.DiGraph()
    for name, t in tensors.items():
        free = name in inputs
        # Doubled sizes, less one for what is saved today: ties keep today's choice.
        graph.add_edge(
            (name, "in"), (name, "out"), capacity=0 if free else 2 * nbytes(t) - (1 if name in required else 0)
        )
        if free or name not in producer or not can[producer[name]]:
            graph.add_edge(_SOURCE, (name, "in"))
    for i, bsym in enumerate(bsyms):
        if not can[i]:
            continue
        # The symbol is a node of its own, cut from the source (at its traffic's price) when it runs again.
        if dear[i]:
            cost = max(1, round(2 * price * op_seconds(bsym, rates)))
        else:
            cost = round(2 * recompute_weight * op_traffic(bsym))
        if cost:
            graph.add_edge(_SOURCE, ("op", i), capacity=cost)
        for a in bsym.flat_proxy_args:
            graph.add_edge((a.name, "out"), ("op", i))
        for o in bsym.flat_proxy_outs:
            if isinstance(o, TensorProxy) and o.name not in inputs:
                graph.add_edge(("op", i), (o.name, "in"))
    for name in required:
        graph.add_edge((name, "out"), _SINK)

    _, (source_side, _) = nx.minimum_cut(graph, _SOURCE, _SINK, flow_func=boykov_kolmogorov)
    chosen = {n for n in tensors if (n, "in") in source_side and (n, "out") not in source_side}
    recompute = _recomputed(bsyms, required, chosen, producer, can)
    if segments and any(dear[i] for i in recompute):
        chosen |= _segment_inputs(bsyms, recompute, chosen, producer, dear, inputs)
        recompute = _recomputed(bsyms, required, chosen, producer, can)
    needed = {a.name for i in recompute for a in bsyms[i].flat_proxy_args} | required
    order = {t.name: k for k, t in enumerate(saved)}
    kept = sorted((n for n in chosen if n in needed), key=lambda n: (order.get(n, len(order)), producer.get(n, -1)))
    after = sum(nbytes(tensors[n]) for n in kept if n not in inputs)
    traffic = sum(op_traffic(bsyms[i]) for i in recompute)
    seconds = sum(op_seconds(bsyms[i], rates) for i in recompute)
    return SavePlan(
        saved=tuple(kept),
        recompute=tuple(sorted(recompute)),
        before_bytes=today,
        after_bytes=after,
        traffic_bytes=traffic,
        seconds=seconds,
    )


def _recomputed(bsyms, required: set[str], chosen: set[str], producer: dict[str, int], can: list[bool]) -> set[int]:
    """The symbols to run again: walk back from what the backward needs to what is saved."""
    recompute: set[int] = set()
    stack = [n for n in required if n not in chosen]
    seen = set(stack)
    while stack:
        name = stack.pop()
        i = producer.get(name)
        if i is None or not can[i]:
            raise PlanError(f"{name} would be neither saved nor recomputable")
        recompute.add(i)
        for a in bsyms[i].flat_proxy_args:
            if a.name not in chosen and a.name not in seen:
                seen.add(a.name)
                stack.append(a.name)
    return recompute


def _segment_inputs(
    bsyms, recompute: set[int], chosen: set[str], producer: dict[str, int], dear: list[bool], inputs: set[str]
) -> set[str]:
    """The arguments of recomputed expensive symbols that would themselves be rebuilt from another recomputed
    expensive symbol: saved instead, each expensive symbol then recomputed from saved tensors and cheap ops alone
    (as activation checkpointing recomputes a block from its saved input), just before the backward needs it."""
    behind: dict[str, bool] = {}  # a recomputed tensor -> rebuilt from a recomputed expensive symbol

    def rebuilt_from_dear(a) -> bool:
        return a.name not in chosen and a.name not in inputs and behind.get(a.name, False)

    boundary = set()
    for i in sorted(recompute):  # forward order: producers first
        args = [a for a in bsyms[i].flat_proxy_args if isinstance(a, TensorProxy)]
        if dear[i]:
            boundary.update(a.name for a in args if rebuilt_from_dear(a))
        made = dear[i] or any(rebuilt_from_dear(a) for a in args)
        for o in bsyms[i].flat_proxy_outs:
            behind[o.name] = made
    return boundary


def recomputed_groups(forward: TraceCtx, plan: SavePlan, rates: DeviceRates = H200) -> tuple[Recomputed, ...]:
    """What ``plan`` has the backward run again, grouped by op and source line (one group per line of a model's
    block), the dearest first, with each group's estimated time on a device of ``rates``."""
    groups: dict[tuple[str, str | None], list[float]] = {}
    for i in plan.recompute:
        bsym = forward.bound_symbols[i]
        line = bsym.source_positions.lineno if bsym.source_positions else None
        source = f"{bsym.source_filename}:{line}" if bsym.source_filename else None
        groups.setdefault((bsym.sym.name, source), []).append(op_seconds(bsym, rates))
    rows = [Recomputed(symbol, source, len(times), sum(times)) for (symbol, source), times in groups.items()]
    return tuple(sorted(rows, key=lambda r: -r.seconds))


def apply_plan(forward: TraceCtx, backward: TraceCtx, plan: SavePlan) -> tuple[TraceCtx, TraceCtx]:
    """Both traces rewritten for ``plan``: the forward returns ``plan.saved``; the backward unpacks them and runs
    the forward's symbols ``plan.recompute`` again, each just before the first use of what it computes."""
    fw_bsyms = without_dels(forward.bound_symbols)
    by_name = {}
    for b in forward.bound_symbols:
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

    bw = without_dels(backward.bound_symbols)
    unpack_at = _receive(bw, new_saved)
    new_backward = from_trace(backward)
    new_backward.args = ([list(new_saved), *backward.args[0][1:]], *backward.args[1:])
    defined = {p.name for b in bw[: unpack_at + 1] for p in b.flat_proxy_outs}
    read = {p.name for b in (*bw, *(forward.bound_symbols[i] for i in plan.recompute)) for p in b.flat_proxy_args}
    clones = []
    with tracectx(new_backward):
        for i in plan.recompute:
            clones.append(_clone(_what_is_read(forward.bound_symbols[i], read - defined), defined, new_backward))
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
    them already), as a fusion that computes those alone (``edit.fusion_for``); any other symbol as it is."""
    if not is_fusion(bsym):
        return bsym
    wanted = [p for p in bsym.flat_proxy_outs if p.name in read]
    if not wanted or len(wanted) == len(bsym.flat_proxy_outs):
        return bsym
    return fusion_for(bsym, wanted)


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

    A symbol whose output the trace returns is never dropped: the rewrite must return what the backward returned
    (``checks.check_same_result``), and two outputs equal by construction stay two tensors. Under a parallel
    residual in float32, the gradients of the attention's and the MLP's output biases are both ``sum(g, (0, 1))``
    of the block's output gradient ``g``; dropping the second would return the first for both."""
    written = {a.name for b in bsyms if is_copy_into(b) for a in b.flat_proxy_args}
    returned = {a.name for b in bsyms if b.sym.id == PrimIDs.RETURN for a in b.flat_proxy_args}
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
