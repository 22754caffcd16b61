"""Order a trace's symbols for a lower peak: list schedules over its data flow, each judged by the estimator.

``reorder(trace, judge) -> trace`` builds the dependency graph of the trace's symbols (a symbol after every symbol
whose outputs it reads), keeps the symbols whose order is part of the program's meaning in their order (every
collective and wait, in-place copies, symbols with no tensor outputs, symbols of executors we do not know), and
tries three list schedules, as Inductor's ``reorder_for_peak_memory`` tries several:

- ``frees-first``: of the symbols ready to run, one that frees more than it allocates (the arguments it reads
  last, less its outputs), the most first; otherwise the first in the trace's order;
- ``depth-first``: a symbol made ready by the one scheduled last, so that a chain runs to its end and frees its
  intermediates; otherwise the first in the trace's order;
- ``as-late-as-possible``: the same list schedule run from the return backwards, always the latest symbol whose
  readers are placed: every symbol runs just before it is needed, what it allocates lives least.

The orders are ranked by a rough count of live bytes; the best, if it beats the trace's own by that count, gets
its ``del``s placed again at last use (``ops.dels_at_last_use``, Thunder's rule) and ``judge(trace)`` (the
caller's estimator: bytes, or a tuple of them compared in order) decides: it is kept only if lower, the trace as
it came otherwise. The unpacking of arguments stays first and the return last. ``reorder_pair`` does this for
whichever of a forward and its backward holds the step's peak, with the estimator of the step. The passes are
pure: they return new traces.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable

from thunder.core.prims import PrimIDs
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace

from thunder_fsdp_mem import ops

ORDERS = ("frees-first", "depth-first", "as-late-as-possible")


def reorder(trace: TraceCtx, judge: Callable[[TraceCtx], object], *, clear_mutable_collections: bool = False,
            current=None) -> tuple[TraceCtx, str]:
    """The lowest-peak order of ``trace`` by ``judge``, and the name of the order that won (``"as given"`` when
    none beats the trace's own). ``current``: ``judge(trace)``, when the caller has it.

    Judging an order means analysing a whole trace, so the orders are first ranked by a rough count (bytes each
    symbol allocates, views aside, freed after their last reader) and only the best, if it beats the trace's own
    order by that count, is judged."""
    bsyms = [b for b in trace.bound_symbols if b.sym.id not in (PrimIDs.DEL, "clear_mutable_collection")]
    start = next((i for i, b in enumerate(bsyms) if b.sym.id not in ops.UNPACK_IDS), len(bsyms))
    head, body = bsyms[:start], bsyms[start:-1]
    if not bsyms or bsyms[-1].sym.id != PrimIDs.RETURN or any(b.sym.id in ops.UNPACK_IDS for b in body):
        return trace, "as given"  # not shaped as a trace we order: unpacking first, return last
    preds = _dependencies(body)
    returned = {a.name for a in bsyms[-1].flat_proxy_args}
    ranked = []
    for name in ORDERS:
        order = _schedule(body, preds, name)
        ranked.append((_rough_peak([body[i] for i in order], returned), name, order))
    rough, name, order = min(ranked, key=lambda r: r[0])
    if rough >= _rough_peak(body, returned):
        return trace, "as given"
    candidate = from_trace(trace)
    candidate.bound_symbols = [*head, *(body[i] for i in order), bsyms[-1]]
    candidate = ops.dels_at_last_use(candidate, clear_mutable_collections=clear_mutable_collections)
    if judge(candidate) >= (current if current is not None else judge(trace)):
        return trace, "as given"
    before = trace.get_provenance()
    ours = before is not None and before.pss.startswith("FSDPMemoryTransform")
    candidate.set_provenance(TraceProvenance(
        f"{before.pss}; reordered ({name})" if ours else f"FSDPMemoryTransform: reordered ({name})"))
    return candidate, name


def _rough_peak(seq: list, returned: set[str]) -> int:
    """Most bytes alive at once over ``seq`` by a rough count: what each symbol allocates (views and reshapes
    nothing), alive until its last reader, returned tensors to the end; the trace's inputs are left out (the
    same in every order)."""
    last: dict[str, int] = {}
    for i, b in enumerate(seq):
        for a in b.flat_proxy_args:
            last[a.name] = i
    free_at: dict[int, int] = defaultdict(int)
    live = peak = 0
    for i, b in enumerate(seq):
        sid = ops.sym_id(b)
        if not (sid in ops.VIEW_OPS or sid in ops.RESHAPE_OPS):
            for o in ops.tensor_outputs(b):
                size = ops.nbytes(o)
                live += size
                if o.name not in returned:
                    free_at[last.get(o.name, i)] += size
        peak = max(peak, live)
        live -= free_at.pop(i, 0)
    return peak


def reorder_pair(forward: TraceCtx, backward: TraceCtx, *, estimate=None
                 ) -> tuple[TraceCtx, TraceCtx, tuple[str, str]]:
    """A forward and its backward with the trace that holds the step's peak (by ``step.estimate_traces`` of the
    pair) in its best order: the step's peak first, then that trace's own. The other trace cannot lower the
    step's peak, so it is left as it is (ordering it would cost time and win nothing). Also returns the name of
    each trace's order. ``estimate``: the pair's ``estimate_traces``, when the caller has it."""
    from thunder_fsdp_mem.step import estimate_traces

    base = estimate if estimate is not None else estimate_traces(forward, backward)
    # The backward's phase does not depend on the forward's order (it receives the same saved tensors), nor the
    # forward's phase on the backward's: a candidate needs only its own trace analysed.
    if base.peak_phase == "forward":
        def judge_forward(trace):
            own = estimate_traces(trace).forward_peak_bytes
            return max(own, base.backward_peak_bytes), own

        new_forward, won = reorder(forward, judge_forward, current=(base.peak_bytes, base.forward_peak_bytes))
        return new_forward, backward, (won, "as given")
    if base.peak_phase == "backward":
        def judge_backward(trace):
            estimate = estimate_traces(forward, trace, reuse=base)
            return estimate.peak_bytes, estimate.backward_peak_bytes

        new_backward, won = reorder(backward, judge_backward, clear_mutable_collections=True,
                                    current=(base.peak_bytes, base.backward_peak_bytes))
        return forward, new_backward, ("as given", won)
    return forward, backward, ("as given", "as given")


def pinned(bsym) -> bool:
    """Symbols whose order among themselves is part of the program: collectives and their waits (every rank must
    issue the same collectives in the same order), in-place copies, symbols with no tensor outputs (their effect
    is not data), and symbols of executors we do not know."""
    sid = ops.sym_id(bsym)
    if sid in ops.COLLECTIVES or sid in ops.WAITS or _writes(bsym):
        return True
    if not ops.tensor_outputs(bsym):
        return True
    executor = getattr(bsym.sym.executor, "name", None)
    return not ops.is_fusion(bsym) and executor is not None and executor not in ops.KNOWN_EXECUTORS


def _writes(bsym) -> bool:
    """Symbols that change an argument in place: copies, and Thunder's ``update_aliases``."""
    return ops.is_copy_into(bsym) or ops.sym_id(bsym) == "update_aliases"


def _dependencies(body: list) -> list[set[int]]:
    """For each symbol, the symbols that must run before it: the producers of what it reads, the previous pinned
    symbol if it is pinned, and every earlier reader of a tensor an in-place copy writes."""
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    preds: list[set[int]] = []
    last_pinned = None
    for i, b in enumerate(body):
        mine = {producer[a.name] for a in b.flat_proxy_args if a.name in producer}
        if pinned(b):
            if last_pinned is not None:
                mine.add(last_pinned)
            last_pinned = i
            if _writes(b):
                mine.update(j for a in b.flat_proxy_args for j in readers.get(a.name, ()))
        preds.append(mine)
        for a in b.flat_proxy_args:
            readers.setdefault(a.name, []).append(i)
        for o in b.flat_proxy_outs:
            producer.setdefault(o.name, i)
    return preds


def _schedule(body: list, preds: list[set[int]], name: str) -> list[int]:
    """A topological order of ``body`` chosen by the list schedule ``name``."""
    n = len(body)
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    if name == "as-late-as-possible":  # the same list schedule run backwards from the return
        return _latest_first(n, preds, succs)[::-1]
    waiting = [len(ps) for ps in preds]
    uses = _remaining_uses(body)
    ready: list[tuple] = []
    generation = 0  # depth-first: symbols made ready by the symbol scheduled last come first

    def push(i):
        if name == "frees-first":
            growth = _growth(body[i], uses)
            key = (0, growth, i) if growth < 0 else (1, 0, i)
        else:
            key = (-generation, i)
        heapq.heappush(ready, (*key, i))

    for i in range(n):
        if waiting[i] == 0:
            push(i)
    order = []
    while ready:
        i = heapq.heappop(ready)[-1]
        order.append(i)
        generation += 1
        for a in body[i].flat_proxy_args:
            if a.name in uses:
                uses[a.name] -= 1
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                push(s)
    if len(order) != n:
        raise ValueError("the trace's symbols have a dependency cycle")
    return order


def _latest_first(n: int, preds: list[set[int]], succs: list[list[int]]) -> list[int]:
    """Symbols from last to first: each time, the latest symbol (in the trace's order) whose readers are all
    placed. Read forwards, every symbol runs as late as its readers allow, so what it allocates lives least."""
    waiting = [len(s) for s in succs]
    ready = [-i for i in range(n) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = -heapq.heappop(ready)
        order.append(i)
        for p in preds[i]:
            waiting[p] -= 1
            if waiting[p] == 0:
                heapq.heappush(ready, -p)
    if len(order) != n:
        raise ValueError("the trace's symbols have a dependency cycle")
    return order


def _remaining_uses(body: list) -> dict[str, int]:
    uses: dict[str, int] = {}
    for b in body:
        for a in b.flat_proxy_args:
            uses[a.name] = uses.get(a.name, 0) + 1
    return uses


def _growth(bsym, uses: dict[str, int]) -> int:
    """Bytes ``bsym`` allocates (views allocate nothing) less the bytes of tensors it is the last reader of, as of
    when it became ready."""
    sid = ops.sym_id(bsym)
    made = 0 if sid in ops.VIEW_OPS or sid in ops.RESHAPE_OPS else sum(map(ops.nbytes, ops.tensor_outputs(bsym)))
    freed = sum(ops.nbytes(a) for a in ops.tensor_args(bsym) if uses.get(a.name) == 1)
    return made - freed
