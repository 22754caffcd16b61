"""Checks every rewrite must pass before the transform keeps it: the trace is still a valid program (each name
defined before it is read, never read after its ``del``), it returns the same things, and it issues the same
collectives in the same order (every rank must)."""

from __future__ import annotations

from thunder.core.prims import PrimIDs
from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.symbols import COLLECTIVES, proxy_names, sym_id


class CheckError(ValueError):
    """A rewritten trace failed a check; the message says which and where."""


def check_program(trace: TraceCtx) -> None:
    """Every proxy a symbol reads is a trace argument or an earlier output, and has not been deleted."""
    alive = set(proxy_names(trace.args)) | set(proxy_names(trace.kwargs))
    deleted: dict[str, int] = {}
    for i, bsym in enumerate(trace.bound_symbols):
        for a in bsym.flat_proxy_args:
            if a.name in alive:
                continue
            if a.name in deleted:
                raise CheckError(
                    f"symbol {i} ({bsym.sym.name}) reads {a.name} after its del at symbol {deleted[a.name]}"
                )
            raise CheckError(f"symbol {i} ({bsym.sym.name}) reads {a.name} before anything defines it")
        if bsym.sym.id == PrimIDs.DEL:
            for a in bsym.flat_proxy_args:
                alive.discard(a.name)
                deleted[a.name] = i
            continue
        alive.update(o.name for o in bsym.flat_proxy_outs)


def check_same_result(before: TraceCtx, after: TraceCtx, *, ignore_saved: bool = False) -> None:
    """Both traces return the same proxies; with ``ignore_saved`` (an augmented forward), the saved-for-backward
    part of the return may differ."""

    def returned(trace):
        out = trace.bound_symbols[-1]
        if out.sym.id != PrimIDs.RETURN:
            raise CheckError("the trace does not end in its return")
        args = out.args[0] if ignore_saved else out.args
        return proxy_names(args)

    if returned(before) != returned(after):
        raise CheckError("the rewritten trace returns different values")


def collectives(trace: TraceCtx) -> list[tuple[str, tuple[str, ...]]]:
    """The trace's collectives as (op, argument names), in order."""
    return [(sym_id(b), tuple(proxy_names(b.args))) for b in trace.bound_symbols if sym_id(b) in COLLECTIVES]


def check_same_collectives(before: TraceCtx, after: TraceCtx, *, ordered: bool = True, added=()) -> None:
    """The same collectives with the same arguments: in the same order, or with ``ordered=False`` in an order of
    their own (which must then depend on the trace alone); ``added`` lists collectives the rewrite adds."""
    old, new = collectives(before), collectives(after)
    if sorted(new) != sorted([*old, *added]):
        raise CheckError("the rewritten trace issues different collectives")
    known = set(old)
    if ordered and [c for c in new if c in known] != old:
        raise CheckError("the rewritten trace issues its collectives in another order")


def check_rewrite(
    before: TraceCtx, after: TraceCtx, *, ignore_saved: bool = False, ordered: bool = True, added=()
) -> None:
    """All three checks of ``after``, the rewrite of ``before`` (see each)."""
    check_program(after)
    check_same_result(before, after, ignore_saved=ignore_saved)
    check_same_collectives(before, after, ordered=ordered, added=added)
