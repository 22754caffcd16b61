"""Choose what the forward saves for backward: a minimum cut over the forward's data flow.

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
  collectives, random and unknown ops); every tensor the backward receives today feeds the sink. A matmul that
  expands its arguments (``expanding``: attention's scores where attention is decomposed) is recomputable, so that
  the (T, T) probabilities are rebuilt in backward from the query and key rather than saved.

Cut edges ``v.in -> v.out`` are the tensors to save; tensors whose ``in`` falls on the sink's side are
recomputed in backward (``plan_rewrite.apply_plan``). Ties go to the tensors saved today, so nothing is recomputed
for nothing.

Recomputation costs time: ops outside fusions each read and write whole tensors. With ``recompute_weight``
w > 0, each recomputable symbol is also a node ``("op", i)`` between its arguments and outputs, fed by the source
with capacity w x its traffic (``cost.op_traffic``): the cut pays it when the symbol runs again, once however
many of its outputs are needed (an expanding matmul: the bytes a memory-bound op of its time would move,
``cost.traffic_equivalent``). The cut then minimises saved bytes + w x recomputation traffic.

With a ``price`` (bytes of saved memory one second of recomputation is worth), the expensive deterministic ops
become recomputable too: matmuls, attention without dropout, embeddings, and fusion regions made of them and cheap
ops (``priced``). Each is such a node, fed with capacity price x its time (``cost.op_seconds``), so that the cut
minimises saved bytes + w x traffic + price x the time of the expensive ops run again. A high price gives the cut
without them; price 0 saves the least the forward can save. ``passes.budget`` chooses the price that fits a
memory budget. With ``segments=True``, an argument of a recomputed expensive op that would itself be rebuilt from
another recomputed expensive op is saved instead, so that each is recomputed from saved tensors and cheap ops
alone, just before the backward needs it (as activation checkpointing recomputes a block from its saved input).

Fusion regions that run matmuls and cheap ops both are opened (``regions.opened``, without a price): the cut runs
on their subsymbols, recomputes cheap ops only from what the region's kernels hold in memory (its arguments, its
matmuls' outputs and views of them), saves only what the region returns or stores, never a view of a matmul's
output, and prices each op at what the new backward region writes of the region's outputs (``regions``' docstring
says why each rule keeps the bits). With a price they are opened where ``open_regions`` says: each matmul inside is
then priced alone and may be recomputed from its arguments saved as its kernel read them (``Opened.matmul_args``),
not the region's reductions; without, a region is priced whole.

``recomputed_groups(forward, plan)`` says what a plan has the backward run again, by op and source line;
``recomputable`` and ``priced`` say which symbols the cut may recompute, without and with a price. The plan is
applied by ``plan_rewrite.apply_plan``. Pure: the trace is read, not changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import thunder.torch as ltorch
from networkx.algorithms.flow import boykov_kolmogorov
from thunder.core import prims
from thunder.core.prims import PrimIDs
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.trace import TraceCtx
from thunder.executors import torchex

from thunder_fsdp_mem.analysis.cost import (
    ATTENTION,
    H200,
    DeviceRates,
    attention_options,
    op_seconds,
    op_traffic,
    traffic_equivalent,
)
from thunder_fsdp_mem.analysis.symbols import (
    ELEMENTWISE_OPS,
    MATMULS,
    RESHAPE_OPS,
    UNPACK_IDS,
    VIEW_OPS,
    WAITS,
    accumulates,
    is_copy_into,
    is_fusion,
    names,
    nbytes,
    numel,
    registered,
    sym_id,
    symbol_name,
)
from thunder_fsdp_mem.passes.driver import PassError, Recomputed
from thunder_fsdp_mem.passes.regions import Opened, opened, regions_traffic
from thunder_fsdp_mem.thunder_internals import softmax_symbol

# Factories without randomness.
_FACTORIES = names(
    ltorch.arange, ltorch.full, ltorch.full_like, ltorch.ones, ltorch.ones_like, ltorch.zeros, ltorch.zeros_like
)
# Cheap to recompute, and deterministic: elementwise ops and casts (``Tensor.bool()`` and ``.double()`` too, which
# Thunder registers from its list of torch functions), views and reshapes, concatenation and padding, factories
# without randomness, and reductions (whose outputs are small and whose cost is one read of the input). Two names no op
# of Thunder 0.2.6 or 0.2.7 bears, kept from the first table: ``broadcast_in_dim`` (the prim's own name; ``sym_id``
# names it ``expand``) and ``_log_softmax`` (Thunder's ``log_softmax`` is a symbol of its own, unlike ``softmax``).
RECOMPUTABLE_OPS = (
    ELEMENTWISE_OPS
    | (VIEW_OPS - WAITS)
    | RESHAPE_OPS
    | _FACTORIES
    | names(
        prims.convert_element_type,
        ltorch.cat,
        torchex.pad_prim_impl,
        ltorch.pad,
        ltorch.sum,
        ltorch.var_mean,
        ltorch.mean,
        ltorch.var,
        ltorch.amax,
        ltorch.amin,
        ltorch.prod,
        ltorch.contiguous,
        torchex.softmax,
        softmax_symbol(),
        ltorch.log_softmax,
    )
    | registered(torchex.ex, "bool", "double")
    | frozenset({"broadcast_in_dim", "_log_softmax"})
)
# A matmul whose output holds at least this many times the elements of its arguments together: attention's scores
# (q @ k^T over a head's few dimensions), (T, T) from (T, d). The cut may recompute it without a price (``expanding``).
EXPANSION = 4

# Ops whose output is always a new tensor (never a view of an argument; ``to`` returns its argument when it changes
# nothing): what an in-place copy recomputed in backward may write into (``_fresh_copies``).
_ALLOCATING = (ELEMENTWISE_OPS - VIEW_OPS - names(ltorch.to, ltorch.type_as)) | _FACTORIES

# Deterministic too, but dear: recomputed only at a price (a memory budget).
PRICED_OPS = MATMULS | ATTENTION | names(ltorch.embedding)
_MATMUL = symbol_name(ltorch.matmul)
_SOURCE, _SINK = "source", "sink"


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What the forward saves and what the backward recomputes.

    saved: names of the tensors the forward returns for backward, in order.
    recompute: indices, in the forward's bound symbols (in ``opened.symbols`` where the cut opened the forward's
        fusion regions), of the symbols the backward runs again (forward order).
    before_bytes / after_bytes: saved bytes beyond the forward's inputs, today and with the plan.
    traffic_bytes: what the recomputation reads and writes (``cost.op_traffic``), its cost.
    seconds: its estimated time on the device the plan was priced for (``cost.op_seconds``).
    opened: the forward's regions as the cut opened them (``regions.opened``), None where it did not.
    """

    saved: tuple[str, ...]
    recompute: tuple[int, ...]
    before_bytes: int
    after_bytes: int
    traffic_bytes: int = 0
    seconds: float = 0.0
    opened: Opened | None = None

    def symbols(self, forward: TraceCtx):
        """The symbols ``recompute`` indexes: the forward's, or, where the cut opened its regions, those it cut."""
        return self.opened.symbols if self.opened is not None else forward.bound_symbols

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


def expanding(bsym) -> bool:
    """True for a matmul whose output has at least ``EXPANSION`` times the elements of its tensor arguments together,
    or a batched ``matmul`` whose output is square in its last two dimensions and larger than what it contracts over:
    attention's scores, where no attention executor runs attention (a fusion executor listed ahead of it, a mask, a
    soft-cap), q @ k^T, (T, d) by (d, T). What the forward would save of it grows as T x T while its arguments grow as
    T. The cut may recompute it like a cheap op, at the price of the bytes a memory-bound op of its time would move
    (``cost.traffic_equivalent``), so that the backward runs it again from the saved query and key rather than keep
    the (T, T) probabilities alive from the forward (as flash attention's backward recomputes them), at any T."""
    if sym_id(bsym) not in MATMULS or is_fusion(bsym):
        return False
    args = bsym.flat_proxy_args
    if not args or any(not isinstance(a, TensorProxy) for a in args):
        return False
    outs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
    if sum(numel(o) for o in outs) >= EXPANSION * sum(numel(a) for a in args):
        return True
    out, first = (outs[0].shape, args[0].shape) if len(outs) == 1 else ((), ())
    return sym_id(bsym) == _MATMUL and len(out) >= 3 and out[-1] == out[-2] > first[-1]


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


def _dear_inside(bsym) -> bool:
    """A matmul inside an opened region that a price may recompute (from its arguments, as they are in memory)."""
    return sym_id(bsym) in MATMULS and priced(bsym)


def plan_saved(
    forward: TraceCtx,
    *,
    recompute_weight: float = 0.0,
    price: float | None = None,
    rates: DeviceRates = H200,
    segments: bool = False,
    only: frozenset[int] | None = None,
    open_regions: bool | None = None,
) -> SavePlan:
    """The minimum-cut choice of saved tensors for ``forward`` (see the module's docstring): it minimises saved
    bytes plus ``recompute_weight`` times the bytes the recomputation reads and writes, and, with a ``price``,
    plus ``price`` times the seconds the expensive ops run again take on a device of ``rates``. ``segments``: no
    expensive op is recomputed from another (see the module's docstring); ``only``: the indices of the expensive
    ops the price may recompute (None: all); ``open_regions``: cut through the forward's mixed fusion regions
    (``regions.opened``), each matmul inside them priced alone, rather than price each region whole (None: open
    them only without a price)."""
    saved = saved_tensors(forward)
    if open_regions is None:
        open_regions = price is None
    regions = opened(forward.bound_symbols, recomputable) if open_regions else None
    bsyms = regions.symbols if regions is not None else forward.bound_symbols
    inside = regions.inside if regions is not None else (lambda i: False)
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
        if inside(i):
            can[i] = recomputable(bsym) and not accumulates(bsym)  # a new kernel may add in another order
            if not can[i] and price is not None and _dear_inside(bsym) and (only is None or i in only):
                can[i] = dear[i] = True
            for o in bsym.flat_proxy_outs:
                producer.setdefault(o.name, i)
            continue
        can[i] = recomputable(bsym) or expanding(bsym)
        if not can[i] and price is not None and priced(bsym) and (only is None or i in only):
            can[i] = dear[i] = True
        for o in bsym.flat_proxy_outs:
            producer.setdefault(o.name, i)
    inputs.update(a.name for a in forward.args if isinstance(a, Proxy))
    # A copy into a tensor the forward made for it runs again with that tensor (``_fresh_copies``); any other
    # in-place copy changes a value some symbol reads, which would see another value in backward.
    fresh = _fresh_copies(bsyms, producer, can, inside)
    for i in fresh:
        can[i] = True
        written.difference_update(a.name for a in bsyms[i].flat_proxy_args)
    can = [c and not any(a.name in written for a in b.flat_proxy_args) for c, b in zip(can, bsyms)]

    required = {t.name for t in saved}
    today = sum(nbytes(t) for t in saved if t.name not in inputs)
    graph = nx.DiGraph()
    computed = set()  # made inside an opened region, not in memory as the region's ops used it: never recompute from
    if regions is not None:
        computed = {n for n, i in producer.items() if inside(i) and n not in regions.stored}
    matmul_args = regions.matmul_args if regions is not None else frozenset()
    for name, t in tensors.items():
        free = name in inputs
        savable = (name in regions.returned or name in matmul_args) if regions is not None else True
        if (name in computed and not savable) or (regions is not None and name in regions.views):
            graph.add_edge((name, "in"), (name, "out"))  # unbounded: stored anew by the region, or a view
        else:
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
        elif inside(i):  # one kernel runs the region's recomputed ops: what it writes of what the region returns
            returned = sum(nbytes(o) for o in bsym.flat_proxy_outs if o.name in regions.returned)
            cost = round(2 * recompute_weight * returned)
        else:
            cost = round(2 * recompute_weight * traffic_equivalent(bsym, rates))
        if cost:
            graph.add_edge(_SOURCE, ("op", i), capacity=cost)
        for a in bsym.flat_proxy_args:
            # A value an opened region computed is recomputed with the op that reads it, never read saved; but a
            # matmul reads its arguments from memory, as they would be saved.
            unrounded = inside(i) and a.name in computed and not (dear[i] and a.name in matmul_args)
            graph.add_edge((a.name, "in" if unrounded else "out"), ("op", i))
        for name in fresh.get(i, ()):  # a copy's destination runs again with it: never written once saved
            graph.add_edge((name, "in"), ("op", i))
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
    top = [i for i in recompute if not inside(i)]
    traffic = sum(op_traffic(bsyms[i]) for i in top)
    seconds = sum(op_seconds(bsyms[i], rates) for i in top)
    if regions is not None:  # the opened regions' recomputed ops run as one kernel per region
        fused = regions_traffic(regions, sorted(recompute), required)
        traffic, seconds = traffic + fused, seconds + fused / rates.bandwidth
        seconds += sum(op_seconds(bsyms[i], rates) for i in recompute if inside(i) and dear[i])
    return SavePlan(
        saved=tuple(kept),
        recompute=tuple(sorted(recompute)),
        before_bytes=today,
        after_bytes=after,
        traffic_bytes=traffic,
        seconds=seconds,
        opened=regions,
    )


def _fresh_copies(bsyms, producer: dict[str, int], can: list[bool], inside) -> dict[int, frozenset[str]]:
    """The in-place copies the backward may run again, each with the names of its destination's storage before it:
    a copy whose destination the forward made for it by cheap ops (litgpt's soft-capped attention builds its causal
    mask so: ``ones(T, T).triu(1)``, then ``masked_fill_``), where everything that reads that storage before the copy
    is computed on the way to the copy's source (so that the backward, running the symbols in the forward's order
    before each first use, reads it before the copy too), and nothing else writes into it. Recomputed, the copy
    writes into the destination recomputed with it, never into a saved tensor (the cut's edges say so)."""
    copies = [i for i, b in enumerate(bsyms) if is_copy_into(b) and not inside(i)]
    fresh: dict[int, frozenset[str]] = {}
    for i in copies:
        args = bsyms[i].flat_proxy_args
        if len(args) != 2 or not all(isinstance(a, TensorProxy) for a in args):
            continue
        source, destination = args
        chain = [destination.name]  # back through views to the tensor that owns the storage
        while producer.get(chain[-1]) is not None and sym_id(bsyms[producer[chain[-1]]]) in VIEW_OPS:
            view_args = bsyms[producer[chain[-1]]].flat_proxy_args
            if not view_args:
                break
            chain.append(view_args[0].name)
        owner = producer.get(chain[-1])
        if owner is None or not can[owner] or inside(owner) or sym_id(bsyms[owner]) not in _ALLOCATING:
            continue  # the storage must be one the forward allocated here, never an input's or a saved tensor's
        aliases = set(chain)  # the storage's names before the copy, by views of it made before the copy
        for j in range(owner + 1, i):
            if sym_id(bsyms[j]) in VIEW_OPS and any(a.name in aliases for a in bsyms[j].flat_proxy_args[:1]):
                aliases.update(o.name for o in bsyms[j].flat_proxy_outs)
        if any(is_copy_into(bsyms[j]) and j != i and bsyms[j].flat_proxy_args[-1].name in aliases for j in copies):
            continue
        ancestors = _ancestors(bsyms, producer, source.name)
        readers = [
            j
            for j in range(owner + 1, len(bsyms))
            if j != i and bsyms[j].sym.id != PrimIDs.DEL and any(a.name in aliases for a in bsyms[j].flat_proxy_args)
        ]
        if all(j in ancestors or (j < i and sym_id(bsyms[j]) in VIEW_OPS) for j in readers):
            fresh[i] = frozenset(aliases)
    return fresh


def _ancestors(bsyms, producer: dict[str, int], name: str) -> set[int]:
    """Indices of the symbols ``name`` is computed from."""
    seen: set[int] = set()
    stack = [name]
    while stack:
        j = producer.get(stack.pop())
        if j is None or j in seen:
            continue
        seen.add(j)
        stack.extend(a.name for a in bsyms[j].flat_proxy_args)
    return seen


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
        bsym = plan.symbols(forward)[i]
        line = bsym.source_positions.lineno if bsym.source_positions else None
        source = f"{bsym.source_filename}:{line}" if bsym.source_filename else None
        groups.setdefault((bsym.sym.name, source), []).append(op_seconds(bsym, rates))
    rows = [Recomputed(symbol, source, len(times), sum(times)) for (symbol, source), times in groups.items()]
    return tuple(sorted(rows, key=lambda r: -r.seconds))
