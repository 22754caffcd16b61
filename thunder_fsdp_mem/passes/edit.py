"""How a pass builds the trace it returns, the same way in every pass.

- ``rebuilt(trace, bsyms, note) -> TraceCtx``: ``trace`` with ``bsyms`` (its symbols, edited, without ``del``s) as
  its program, the ``del``s placed again at last use and the pass's note on its provenance line; ``trace`` itself
  when ``bsyms`` are its own symbols in its own order (a pass that changes nothing returns its input).
- ``dels_at_last_use(trace)``: the ``del``s of ``trace`` placed as Thunder's ``del_last_used`` places them.
- ``noted(trace, note)``: the provenance line of a trace the transform rewrote, what earlier passes said kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from thunder.core.prims import PrimIDs, python_del
from thunder.core.proxies import CollectionProxy, Proxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.executors.passes import clear_mutable_collection, comment_symbols

from thunder_fsdp_mem.analysis.symbols import without_dels

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
