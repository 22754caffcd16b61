"""How a pass builds the trace it returns, the same way in every pass.

- ``rebuilt(trace, bsyms, note) -> TraceCtx``: ``trace`` with ``bsyms`` (its symbols, edited, without ``del``s) as
  its program, the ``del``s placed again at last use and the pass's note on its provenance line; ``trace`` itself
  when ``bsyms`` are its own symbols in its own order (a pass that changes nothing returns its input).
- ``dels_at_last_use(trace)``: the ``del``s of ``trace`` placed as Thunder's ``del_last_used`` places them.
- ``noted(trace, note)``: the provenance line of a trace the transform rewrote, what earlier passes said kept.
- ``fusion_for(fusion, outputs)``: a fusion that computes only ``outputs`` of ``fusion``, from the inputs they need.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

from thunder.core import utils
from thunder.core.prims import PrimIDs, python_del
from thunder.core.proxies import CollectionProxy, Proxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.executors.passes import clear_mutable_collection, comment_symbols

from thunder_fsdp_mem.analysis.symbols import without_dels
from thunder_fsdp_mem.thunder_internals import update_fusion

PROVENANCE = "FSDPMemoryTransform"


def rebuilt(trace: TraceCtx, bsyms: Sequence, note: str, *, clear_mutable_collections: bool = False) -> TraceCtx:
    """``trace`` with the program ``bsyms`` (see the module's docstring). ``clear_mutable_collections``: also clear
    each collection after its last use (a backward, which owns the lists it receives)."""
    own = without_dels(trace.bound_symbols, clears=clear_mutable_collections)
    if len(own) == len(bsyms) and all(a is b for a, b in zip(own, bsyms)):
        return trace
    new = from_trace(trace)
    new.bound_symbols = list(bsyms)
    new = dels_at_last_use(new, clear_mutable_collections=clear_mutable_collections)
    return noted(new, note, earlier=trace)


def noted(trace: TraceCtx, note: str, *, earlier: TraceCtx | None = None) -> TraceCtx:
    """``trace`` with ``note`` on its provenance line, after what the transform said of ``earlier`` (or of
    ``trace``) where it said anything. Sets the provenance in place on a trace the pass made itself."""
    before = (earlier if earlier is not None else trace).get_provenance()
    ours = before is not None and before.pss.startswith(PROVENANCE)
    trace.set_provenance(TraceProvenance(f"{before.pss}; {note}" if ours else f"{PROVENANCE}: {note}"))
    return trace


def dels_at_last_use(trace: TraceCtx, *, clear_mutable_collections: bool = False) -> TraceCtx:
    """``trace`` with its ``del``s dropped and placed again after each proxy's last use, as Thunder's
    ``del_last_used`` places them (same rule, same order), at a fraction of its cost: Thunder binds every new
    ``del`` through the symbol's signature, this copies one bound ``del``."""
    handled = {p.name for p in tree_flatten(trace.output)[0] if isinstance(p, Proxy)}
    template = None
    out = deque()
    for bsym in reversed(trace.bound_symbols):
        if bsym.sym.id in comment_symbols:
            out.appendleft(bsym)
            continue
        if bsym.sym.id == PrimIDs.DEL:
            continue
        to_del = []
        for x in (*bsym.flat_proxy_outs, *bsym.flat_proxy_args):
            if x.name not in handled:
                handled.add(x.name)
                to_del.append(x)
        if to_del and bsym.sym.id is not PrimIDs.RETURN:
            if template is None:
                template = python_del.bind(*to_del, output=None)
                out.appendleft(template)
            else:
                out.appendleft(template.from_bsym(args=tuple(to_del)))
            if clear_mutable_collections:
                for x in to_del:
                    if isinstance(x, CollectionProxy):
                        out.appendleft(clear_mutable_collection.bind(x, output=None))
        out.appendleft(bsym)
    new = from_trace(trace)
    new.bound_symbols = list(out)
    return new


def fusion_for(fusion, outputs: Sequence[Proxy]):
    """A fusion symbol that computes ``outputs`` (some of ``fusion``'s, in its order) and nothing else: the
    subsymbols they need, the inputs those read, a new callable from the fusion's executor (``fuse``, as Thunder's
    rematerialization makes its fusions). The needed subsymbols are the same ops on the same values as in
    ``fusion``. Where a backward recomputes a forward fusion for some of its outputs, the rest is not run again
    (``plan_rewrite._what_is_read`` says when a region must run again whole instead)."""
    region = TraceCtx(None)
    region.bound_symbols = list(fusion.subsymbols)
    needed = utils.find_producer_symbols(region, tuple(outputs), tuple(fusion.flat_proxy_args))
    read = {p.name for b in needed for p in b.flat_proxy_args}
    args = tuple(a for a in fusion.args if isinstance(a, Proxy) and a.name in read)
    pruned = dataclasses.replace(fusion, args=args, output=tuple(outputs), subsymbols=tuple(needed))
    return update_fusion(pruned)
