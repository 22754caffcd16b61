"""Order a trace's symbols for a lower peak: list schedules over its data flow, each judged by the estimator.

``reorder(trace, judge) -> (trace, order)`` builds the dependency graph of the trace's symbols (a symbol after
every symbol whose outputs it reads), keeps the symbols whose order is part of the program's meaning in their order
(every collective and wait, in-place copies, symbols with no tensor outputs, symbols of executors we do not know),
and tries three list schedules, as Inductor's ``reorder_for_peak_memory`` tries several:

- ``frees-first``: of the symbols ready to run, one that frees more than it allocates (the arguments it reads
  last, less its outputs), the most first; otherwise the first in the trace's order;
- ``depth-first``: a symbol made ready by the one scheduled last, so that a chain runs to its end and frees its
  intermediates; otherwise the first in the trace's order;
- ``as-late-as-possible``: the same list schedule run from the return backwards, always the latest symbol whose
  readers are placed: every symbol runs just before it is needed, what it allocates lives least.

Each order that differs from the trace's own gets its ``del``s placed again at last use (``edit.rebuilt``) and is
judged by ``judge(trace)``, the caller's estimator (bytes, or a tuple of them compared in order); every candidate
and its figure is logged. The lowest is kept if it beats the trace's own order, the trace as it came otherwise.
The unpacking of arguments stays first and the return last. ``reorder_pair`` does this for whichever of a forward
and its backward holds the step's peak, judged by ``step.estimate_traces``, the estimator of the whole step.
The passes are pure: they return new traces. ``PASS``: ``reorder_pair`` as the pipeline runs it
(``declaration.Declaration``), judged by the driver's estimator.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable

from thunder.core.prims import PrimIDs
from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.phases import Stage, StepMemory
from thunder_fsdp_mem.analysis.step import estimate_traces
from thunder_fsdp_mem.analysis.symbols import (
    COLLECTIVES,
    KNOWN_EXECUTORS,
    RESHAPE_OPS,
    UNPACK_IDS,
    UPDATE_ALIASES,
    VIEW_OPS,
    WAITS,
    def_use,
    is_copy_into,
    is_fusion,
    nbytes,
    sym_id,
    tensor_args,
    tensor_outputs,
    without_dels,
)
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Context, Pair, Proposal
from thunder_fsdp_mem.passes.edit import rebuilt

log = logging.getLogger(__name__)

ORDERS = ("frees-first", "depth-first", "as-late-as-possible")
AS_GIVEN = "as given"


def reorder(
    trace: TraceCtx, judge: Callable[[TraceCtx], object], *, clear_mutable_collections: bool = False, current=None
) -> tuple[TraceCtx, str]:
    """The lowest-peak order of ``trace`` by ``judge``, and the name of the order that won (``"as given"`` when
    none beats the trace's own). ``current``: ``judge(trace)``, when the caller has it."""
    bsyms = without_dels(trace.bound_symbols)
    start = next((i for i, b in enumerate(bsyms) if b.sym.id not in UNPACK_IDS), len(bsyms))
    head, body = bsyms[:start], bsyms[start:-1]
    if not bsyms or bsyms[-1].sym.id != PrimIDs.RETURN or any(b.sym.id in UNPACK_IDS for b in body):
        return trace, AS_GIVEN  # not shaped as a trace we order: unpacking first, return last
    preds = _dependencies(body)
    best_score = current if current is not None else judge(trace)
    best, won = trace, AS_GIVEN
    for name in ORDERS:
        order = _schedule(body, preds, name)
        candidate = rebuilt(
            trace,
            [*head, *(body[i] for i in order), bsyms[-1]],
            f"reordered ({name})",
            clear_mutable_collections=clear_mutable_collections,
        )
        if candidate is trace:
            log.info("reorder: %s is the trace's own order", name)
            continue
        score = judge(candidate)
        log.info("reorder: %s order, estimated %s (best so far: %s, %s)", name, score, won, best_score)
        if score < best_score:
            best_score, best, won = score, candidate, name
    return best, won


def reorder_pair(
    forward: TraceCtx, backward: TraceCtx, *, estimate: StepMemory | None = None, estimator=estimate_traces
) -> tuple[TraceCtx, TraceCtx, StepMemory]:
    """A forward and its backward with the trace that holds the step's peak (by ``estimator``, the step's
    estimate: ``step.estimate_traces``) in its best order: the step's peak first, then that trace's own. The other
    trace cannot lower the step's peak, so it is left as it is (ordering it would cost time and win nothing). Also
    returns the estimate of the pair returned. ``estimate``: the pair's, when the caller has it."""
    base = estimate if estimate is not None else estimator(forward, backward)
    judged: dict[int, StepMemory] = {}
    # The backward's phase does not depend on the forward's order (it receives the same saved tensors), nor the
    # forward's phase on the backward's: a candidate needs only its own trace analysed.
    if base.peak_stage is Stage.FORWARD:

        def judge_forward(trace):
            own = estimator(trace)  # the forward's phases: the forward, and the loss where one is counted
            return max(own.peak_bytes, base.backward_peak_bytes), own.forward_peak_bytes

        new_forward, _ = reorder(forward, judge_forward, current=(base.peak_bytes, base.forward_peak_bytes))
        if new_forward is forward:
            return forward, backward, base
        return new_forward, backward, estimator(new_forward, backward)
    if base.peak_stage is Stage.BACKWARD:

        def judge_backward(trace):
            step = judged[id(trace)] = estimator(forward, trace, reuse=base)
            return step.peak_bytes, step.backward_peak_bytes

        new_backward, _ = reorder(
            backward,
            judge_backward,
            clear_mutable_collections=True,
            current=(base.peak_bytes, base.backward_peak_bytes),
        )
        return forward, new_backward, judged.get(id(new_backward), base)
    return forward, backward, base


def pinned(bsym) -> bool:
    """Symbols whose order among themselves is part of the program: collectives and their waits (every rank must
    issue the same collectives in the same order), in-place copies, symbols with no tensor outputs (their effect
    is not data), and symbols of executors we do not know."""
    sid = sym_id(bsym)
    if sid in COLLECTIVES or sid in WAITS or _writes(bsym):
        return True
    if not tensor_outputs(bsym):
        return True
    executor = getattr(bsym.sym.executor, "name", None)
    return not is_fusion(bsym) and executor is not None and executor not in KNOWN_EXECUTORS


def _writes(bsym) -> bool:
    """Symbols that change an argument in place: copies, and Thunder's ``update_aliases``."""
    return is_copy_into(bsym) or sym_id(bsym) == UPDATE_ALIASES


def _dependencies(body: list) -> list[set[int]]:
    """For each symbol, the symbols that must run before it: the producers of what it reads, the previous pinned
    symbol if it is pinned, and every earlier reader of a tensor an in-place copy writes."""
    index = def_use(body)
    preds: list[set[int]] = []
    last_pinned = None
    for i, b in enumerate(body):
        mine = {p for a in b.flat_proxy_args if (p := index.producer.get(a.name, i)) < i}
        if pinned(b):
            if last_pinned is not None:
                mine.add(last_pinned)
            last_pinned = i
            if _writes(b):
                mine.update(j for a in b.flat_proxy_args for j in index.readers.get(a.name, ()) if j < i)
        preds.append(mine)
    return preds


def _schedule(body: list, preds: list[set[int]], name: str) -> list[int]:
    """A topological order of ``body`` chosen by the list schedule ``name``: one list schedule, three keys."""
    n = len(body)
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    if name == "as-late-as-possible":  # from the return backwards: the latest symbol whose readers are placed
        return _list_schedule(succs, preds, key=lambda i: (-i,))[::-1]
    if name == "depth-first":  # symbols made ready by the symbol scheduled last come first
        count = 0

        def made_ready_last(i: int) -> tuple:
            return -count, i

        def counted(i: int) -> None:
            nonlocal count
            count += 1

        return _list_schedule(preds, succs, key=made_ready_last, placed=counted)
    uses = _remaining_uses(body)

    def frees_first(i: int) -> tuple:
        growth = _growth(body[i], uses)
        return (0, growth, i) if growth < 0 else (1, 0, i)

    def read(i: int) -> None:
        for a in body[i].flat_proxy_args:
            if a.name in uses:
                uses[a.name] -= 1

    return _list_schedule(preds, succs, key=frees_first, placed=read)


def _list_schedule(
    preds: list, succs: list, *, key: Callable[[int], tuple], placed: Callable[[int], None] = lambda i: None
) -> list[int]:
    """Kahn's topological sort: of the symbols whose ``preds`` are all placed, the one with the least ``key``
    (taken when it became ready) goes next; ``placed(i)`` is told of each symbol placed."""
    waiting = [len(ps) for ps in preds]
    ready = [(*key(i), i) for i in range(len(preds)) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)[-1]
        order.append(i)
        placed(i)
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (*key(s), s))
    if len(order) != len(preds):
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
    sid = sym_id(bsym)
    made = 0 if sid in VIEW_OPS or sid in RESHAPE_OPS else sum(map(nbytes, tensor_outputs(bsym)))
    freed = sum(nbytes(a) for a in tensor_args(bsym) if uses.get(a.name) == 1)
    return made - freed


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    forward, backward, estimate = reorder_pair(
        pair.forward, pair.backward, estimate=context.estimate(), estimator=context.estimator
    )
    return Proposal(forward, backward, estimate=estimate)


PASS = Declaration("order", ("reorder",), Scope.PAIR, _propose)
