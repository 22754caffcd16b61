"""When Thunder's fsdp reduce-scatters each gradient: as soon as it is complete, waited for within a window.

Thunder's fsdp backward computes every gradient, then divides and reduce-scatters them all at its end, and waits
for them all just before it returns: every unsharded gradient is alive at once, and the process group holds each
until its wait.

``schedule(trace, max_inflight) -> trace``: each reduce-scatter, with the cheap ops that only prepare its input
(the division by the world size, casts, views: ``mincut.recomputable`` symbols whose outputs nothing else
reads), moves up to just after the symbol that completes the last of their inputs; the wait of reduce-scatter
``j`` runs just before reduce-scatter ``j + max_inflight`` is issued (at most ``max_inflight`` in flight), or,
for the last ones, where it was; ``del``s are placed again at last use. An in-flight reduce-scatter costs its
output shard and holds its input until its wait: where the transform's estimate leaves no room for that
(``room``, near the backward's peak), the reduce-scatter is issued where Thunder put it. Reduce-scatters issued
together keep the trace's order. Everything depends on the trace alone, so every rank issues the same collectives
in the same order.
Pure: returns a new trace, or ``trace`` itself when nothing moves. ``PASS``: ``schedule`` as the pipeline runs it
(``declaration.Declaration``), ``MemoryConfig.max_inflight_reduce_scatters`` wide, with the room the driver's
estimate of the pair leaves below the step's peak.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.symbols import (
    REDUCE_SCATTER,
    WAITS,
    DefUse,
    def_use,
    nbytes,
    sym_id,
    tensor_args,
    tensor_outputs,
    without_dels,
)
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import mincut
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Checks, Context, Pair, PassError, Proposal
from thunder_fsdp_mem.passes.edit import rebuilt


class ScatterError(PassError):
    """The trace's reduce-scatters are not in a form this pass knows; the message names what did not match."""


@dataclass(frozen=True, slots=True)
class Scatter:
    """One reduce-scatter: the indices of the symbols that prepare its input, of itself, and of its wait."""

    prepare: tuple[int, ...]
    scatter: int
    wait: int


def match(bsyms: list) -> tuple[Scatter, ...]:
    """Every reduce-scatter of ``bsyms`` (no ``del``s) with its one wait and its preparing symbols, in order."""
    index = def_use(bsyms)
    found = []
    for i, b in enumerate(bsyms):
        if sym_id(b) != REDUCE_SCATTER:
            continue
        if len(b.flat_proxy_outs) != 1:
            raise ScatterError(f"reduce-scatter at symbol {i} does not return one future")
        future = b.flat_proxy_outs[0].name
        waits = index.readers.get(future, ())
        if len(waits) != 1 or sym_id(bsyms[waits[0]]) not in WAITS:
            raise ScatterError(f"the future {future} of the reduce-scatter at symbol {i} is not read by one wait")
        found.append(Scatter(_preparing(bsyms, i, index), i, waits[0]))
    return tuple(found)


def _preparing(bsyms: list, scatter: int, index: DefUse) -> tuple[int, ...]:
    """The symbols before ``scatter`` that compute its input and whose outputs only it (or another of them)
    reads: cheap, recomputable ops, so moving them changes no result."""
    chain = {scatter}
    frontier = [scatter]
    while frontier:
        for a in bsyms[frontier.pop()].flat_proxy_args:
            p = index.producer.get(a.name)
            if p is None or p in chain or not mincut.recomputable(bsyms[p]):
                continue
            if all(r in chain for o in bsyms[p].flat_proxy_outs for r in index.readers.get(o.name, ())):
                chain.add(p)
                frontier.append(p)
    chain.discard(scatter)
    return tuple(sorted(chain))


def schedule(trace: TraceCtx, max_inflight: int, *, room=None, clear_mutable_collections: bool = False) -> TraceCtx:
    """``trace`` with its reduce-scatters issued early and waited for in a window (see the module's docstring).
    ``room``: for each bound symbol of ``trace``, the bytes the step may still allocate from there on without
    raising its peak; a reduce-scatter whose output and input do not fit where its gradient is complete is
    issued where it was (and waited for in the window). None: room everywhere."""
    position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    bsyms = without_dels(trace.bound_symbols)
    found = match(bsyms)
    if not found:
        return trace
    producer = def_use(bsyms).producer
    # Each reduce-scatter goes right after the last symbol (not its own) that defines one of its group's inputs,
    # if there is room there for what it and the ones still in flight hold (input and output); ``room`` never
    # shrinks along the trace, so room where it is issued is room until it is waited for. All are waited for in
    # the window.
    ready_at = {}
    for s in found:
        group = {*s.prepare, s.scatter}
        ready_at[s] = max(
            (
                producer[a.name]
                for i in group
                for a in bsyms[i].flat_proxy_args
                if a.name in producer and producer[a.name] not in group
            ),
            default=-1,
        )
    after: dict[int, list[Scatter]] = defaultdict(list)
    in_place: dict[int, Scatter] = {}  # reduce-scatters left where they are, by index
    in_flight: list[int] = []  # the costs of the reduce-scatters issued early
    for s in sorted(found, key=lambda s: (ready_at[s], s.scatter)):
        ready = ready_at[s]
        held = [tensor_args(bsyms[s.scatter])[0], *tensor_outputs(bsyms[s.scatter])]
        cost = sum(nbytes(t) for t in held)
        others = sum(in_flight[max(0, len(in_flight) - max_inflight + 1) :])
        if room is None or ready < 0 or cost + others <= room[position[id(bsyms[ready])]]:
            after[ready].append(s)
            in_flight.append(cost)
        else:
            in_place[s.scatter] = s
    moved = {i for group in after.values() for s in group for i in (*s.prepare, s.scatter)}
    waits = {s.wait for s in found}
    issued: list[Scatter] = []
    out: list = []
    waited: set[int] = set()

    def issue(s: Scatter, *, group: bool) -> None:
        if len(issued) >= max_inflight:
            done = issued[len(issued) - max_inflight]
            if done.wait not in waited:
                waited.add(done.wait)
                out.append(bsyms[done.wait])
        if group:
            out.extend(bsyms[k] for k in s.prepare)
        out.append(bsyms[s.scatter])
        issued.append(s)

    for s in after.get(-1, ()):
        issue(s, group=True)
    for i, b in enumerate(bsyms):
        if i in waits:
            if i not in waited:
                waited.add(i)
                out.append(b)
        elif i in in_place:
            issue(in_place[i], group=False)
        elif i not in moved:
            out.append(b)
        for s in after.get(i, ()):
            issue(s, group=True)
    return rebuilt(
        trace,
        out,
        f"reduce-scatters issued when their gradient is complete, {max_inflight} in flight",
        clear_mutable_collections=clear_mutable_collections,
    )


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    """Each reduce-scatter issued when its gradient is complete, in a window, where the estimate leaves room for
    what an in-flight reduce-scatter holds."""
    backward, width = pair.backward, config.max_inflight_reduce_scatters
    if not any(sym_id(b) == REDUCE_SCATTER for b in backward.bound_symbols):
        return Proposal(pair.forward, backward)
    before = context.estimate()
    timeline = before.backward
    headroom = before.peak_bytes - (before.backward_peak_bytes - timeline.peak_bytes)
    room, highest = [0] * len(timeline.op_peaks), 0
    for i in range(len(room) - 1, -1, -1):  # room below the step's peak from symbol i to the end
        highest = max(highest, timeline.op_peaks[i])
        room[i] = headroom - highest
    new_backward = schedule(backward, width, room=room, clear_mutable_collections=True)
    return Proposal(pair.forward, new_backward, backward_checks=Checks(ordered=False), note=f"window of {width}")


PASS = Declaration("reduce-scatters", ("scatters",), Scope.BACKWARD, _propose)
