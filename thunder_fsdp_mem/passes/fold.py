"""Where the backward runs what it recomputes: inside the fusion regions that read it.

A recomputed region is a backward fusion region of elementwise ops that reads only what the forward saved (the
rematerialization pass makes them, where its cut opened a forward region). One whose outputs one later region of the
same executor reads (its reader) is

- carried into a later region of that executor that reads the recomputed ops' inputs too, with the reader's ops
  that depend on it, where nothing in between reads what they compute and what they read is there: an MLP's GELU,
  recomputed from its first matmul's output for the second matmul's weight gradient, goes with that matmul into the
  region that reads the first matmul's output anyway for the GELU's derivative, whose compiler can then compute
  both from one read of it;
- or folded into its reader, its ops placed before the first of the reader's ops that reads them (as Thunder's own
  rematerialization moves ops into the fusion that reads them): the backward calls one region fewer.

``fold(bsyms, recomputed, carry=...) -> Folded``, ``recomputing(backward)``; ``PASS``: the pass as the pipeline
runs it, after rematerialization. It proposes the carried backward where the estimator keeps the pair's peak (a
carried value is computed where that region's own buffers are alive), else the folded one.

Bits. The ops are the same ops on the same values, and a fusion compiler rounds each value where the trace converts
it, whichever kernel computes it; a matmul carried along reads the same operands (a value the reader computes by the
same op as one it returns is read from that output) and runs as a kernel of its own in either region. Accumulating
reductions are never moved: a new kernel may add in another order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from thunder.core import dtypes, prims
from thunder.core.proxies import Proxy, TensorProxy, variableify
from thunder.core.trace import TraceCtx, from_trace

from thunder_fsdp_mem.analysis.symbols import (
    MATMULS,
    RESHAPE_OPS,
    VIEW_OPS,
    accumulates,
    is_fusion,
    names,
    sym_id,
    without_dels,
)
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import plan_rewrite, recompute
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Context, Pair, Proposal
from thunder_fsdp_mem.passes.edit import dels_at_last_use
from thunder_fsdp_mem.passes.mincut import PlanError, recomputable
from thunder_fsdp_mem.thunder_internals import update_fusion


@dataclass(frozen=True, slots=True)
class Folded:
    """The backward's symbols after ``fold``, and how many recomputed regions were carried and folded."""

    bsyms: tuple
    carried: int = 0
    folded: int = 0


def fold(bsyms: Sequence, recomputed: set[int], *, carry: bool = True) -> Folded:
    """``bsyms`` with each recomputed elementwise region (``id`` in ``recomputed``) carried (with ``carry``) or
    folded (the module's docstring)."""
    out = list(bsyms)
    carried = folded = 0
    i = 0
    while i < len(out):
        region = out[i]
        j = _reader(out, i) if id(region) in recomputed and _elementwise(region) else None
        moved = _carried(out, i, j) if j is not None and carry else None
        if moved is not None:
            k, reader, target = moved
            out[j], out[k] = reader, target
            carried += 1
        elif j is not None and (into := _folded(out[j], region)) is not None:
            out[j] = into
            folded += 1
        else:
            i += 1
            continue
        del out[i]
    return Folded(tuple(out), carried, folded)


def recomputing(backward: TraceCtx) -> set[int]:
    """The ``id``s of ``backward``'s fusion regions that read only what the forward saved for it (none where the
    backward receives nothing the way Thunder's backward traces do)."""
    try:
        saved = set(plan_rewrite.received(backward))
    except PlanError:
        return set()
    return {
        id(b)
        for b in backward.bound_symbols
        if is_fusion(b) and b.flat_proxy_args and all(a.name in saved for a in b.flat_proxy_args)
    }


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    backward = pair.backward
    ids = recomputing(backward)
    if not ids:
        return Proposal(pair.forward, backward)
    bsyms = without_dels(backward.bound_symbols)
    peak = context.estimate().peak_bytes
    chosen = None
    for carry in (True, False):
        done = fold(bsyms, ids, carry=carry)
        if not done.carried and not done.folded:
            continue
        trial = _with(backward, done.bsyms)
        estimate = context.estimator(pair.forward, trial)
        chosen = (trial, estimate, done)
        if estimate.peak_bytes <= peak:
            break
    if chosen is None:
        return Proposal(pair.forward, backward)
    trial, estimate, done = chosen
    parts = [f"{done.carried} carried into the region that reads their inputs"] if done.carried else []
    parts += [f"{done.folded} folded into the region that reads them"] if done.folded else []
    return Proposal(pair.forward, trial, note=", ".join(parts), estimate=estimate)


def _with(backward: TraceCtx, bsyms: Sequence) -> TraceCtx:
    new = from_trace(backward)
    new.bound_symbols = list(bsyms)
    return dels_at_last_use(new, clear_mutable_collections=True)


def _elementwise(region) -> bool:
    return is_fusion(region) and recomputable(region) and not accumulates(region)


def _reader(bsyms: list, i: int) -> int | None:
    """The index of the one symbol that reads what ``bsyms[i]`` computes, where it is a later region of the same
    executor; else None."""
    outs = {o.name for o in bsyms[i].flat_proxy_outs}
    readers = {j for j, b in enumerate(bsyms) if any(a.name in outs for a in b.flat_proxy_args)}
    if len(readers) != 1:
        return None
    (j,) = readers
    b = bsyms[j]
    return j if j > i and is_fusion(b) and b.sym.executor is bsyms[i].sym.executor else None


def _folded(region, recomputed):
    """``region`` computing also ``recomputed``'s ops, placed before the first of its ops that reads them; None where
    the region computes one of their names otherwise."""
    outs = {o.name for o in recomputed.flat_proxy_outs}
    subs = list(region.subsymbols)
    for name in outs:
        readers = [s for s in subs if any(a.name == name for a in s.flat_proxy_args)]
        if not _as_stored(name, list(recomputed.subsymbols), readers):
            return None
    at = next(k for k, s in enumerate(subs) if any(a.name in outs for a in s.flat_proxy_args))
    merged = _inserted(subs, list(recomputed.subsymbols), at)
    if merged is None:
        return None
    args = _unique(a for a in (*region.args, *recomputed.args) if a.name not in outs)
    return update_fusion(dataclasses.replace(region, args=tuple(args), subsymbols=tuple(merged)))


def _inserted(subs: list, ops: list, at: int) -> list | None:
    """``ops`` inserted into ``subs`` at ``at``, less those that repeat an op of ``subs`` before ``at`` (the same op
    on the same arguments, to the same name: Thunder's backward may compute a forward value again itself, as a
    GELU's derivative does its argument's casts); None where ``subs`` computes one of their names otherwise."""
    defined = {o.name: (k, s) for k, s in enumerate(subs) for o in s.flat_proxy_outs}
    fresh = []
    for op in ops:
        clashes = [defined[o.name] for o in op.flat_proxy_outs if o.name in defined]
        if not clashes:
            fresh.append(op)
        elif all(k < at and _key(s) == _key(op) for k, s in clashes):
            continue
        else:
            return None
    return [*subs[:at], *fresh, *subs[at:]]


def _key(s):
    """The op and its arguments, as Thunder's common-subexpression elimination compares symbols (``_drop_repeats``
    in ``plan_rewrite`` too)."""
    return s.rhs


def _carried(bsyms: list, i: int, j: int):
    """For the recomputed region ``bsyms[i]`` and its reader ``bsyms[j]``: ``(k, reader, target)``, the reader
    without the ops that depend on the recomputed ones and the later region ``bsyms[k]`` of the same executor that
    reads the recomputed ops' inputs, computing them all; None where no such region takes them."""
    recomputed, reader = bsyms[i], bsyms[j]
    inputs = {a.name for a in recomputed.flat_proxy_args}
    k = next(
        (
            k
            for k in range(j + 1, len(bsyms))
            if is_fusion(bsyms[k])
            and bsyms[k].sym.executor is reader.sym.executor
            and inputs <= {a.name for a in bsyms[k].flat_proxy_args}
        ),
        None,
    )
    if k is None:
        return None
    target = bsyms[k]
    made = {o.name for o in recomputed.flat_proxy_outs}
    moved, kept = [], []
    for s in reader.subsymbols:  # the reader's ops that depend on the recomputed ones
        if any(a.name in made for a in s.flat_proxy_args):
            moved.append(s)
            made.update(o.name for o in s.flat_proxy_outs)
        else:
            kept.append(s)
    if not all(_movable(s) for s in moved):
        return None
    for name in {o.name for o in recomputed.flat_proxy_outs}:
        readers = [s for s in moved if any(a.name == name for a in s.flat_proxy_args)]
        if not _as_stored(name, list(recomputed.subsymbols), readers):
            return None
    if any(a.name in made for s in kept for a in s.flat_proxy_args):
        return None  # the reader's other ops read what would move
    returned = {o.name for o in reader.flat_proxy_outs}
    between = {a.name for b in bsyms[j + 1 : k] for a in b.flat_proxy_args}
    if made & returned & between:
        return None  # read before the target region runs
    if made & {a.name for a in target.flat_proxy_args}:
        return None  # the target's own ops read it: they run before what is carried
    there = {a.name: a for a in target.flat_proxy_args}
    same = _same_as_returned(kept, returned)
    swap, pulled = {}, []
    for name, proxy in _read_from_outside(moved, made).items():
        readers = [s for s in moved if any(a.name == name for a in s.flat_proxy_args)]
        if not _as_stored(name, kept, readers):
            return None  # the reader's ops read it unrounded, the target would read it stored
        found = _at_target(name, proxy, kept, there, same, pulled)
        if found is None:
            return None
        if found is not proxy:
            swap[variableify(proxy)] = found
    ops = [*pulled, *recomputed.subsymbols, *(s.from_bsym_swap_proxies(swap) if swap else s for s in moved)]
    merged = _inserted(list(target.subsymbols), ops, len(target.subsymbols))  # after the region's own ops
    if merged is None:
        return None
    later = {a.name for b in bsyms[k + 1 :] for a in b.flat_proxy_args}
    outputs = tuple(o for o in reader.flat_proxy_outs if o.name not in made)
    kept = _live(kept, {o.name for o in outputs})
    reader_args = {a.name for a in reader.flat_proxy_args}
    new_reader = dataclasses.replace(
        reader,
        args=tuple(_unique(a for s in kept for a in s.flat_proxy_args if a.name in reader_args)),
        output=outputs,
        subsymbols=tuple(kept),
    )
    computed = {o.name for s in ops for o in s.flat_proxy_outs}
    new_target = dataclasses.replace(
        target,
        args=tuple(
            _unique(
                a
                for a in (*target.args, *(a for s in ops for a in s.flat_proxy_args))
                if isinstance(a, Proxy) and a.name not in computed
            )
        ),
        output=(*target.flat_proxy_outs, *(o for s in moved for o in s.flat_proxy_outs if o.name in later)),
        subsymbols=tuple(merged),
    )
    return k, update_fusion(new_reader), update_fusion(new_target)


_CONVERT = names(prims.convert_element_type)


def _as_stored(name: str, ops: list, readers: list) -> bool:
    """Whether the ``readers`` (ops of one kernel) get the value ``name`` as it would be stored: a matmul reads its
    operands from memory; an elementwise op reads the kernel's value, which a fusion compiler keeps unrounded where
    a 16-bit op computed it (Inductor computes them in float32 and rounds at the store), but rounds where the trace
    converts it, and a 32-bit value has nothing to round. ``ops``: where ``name`` may be computed (views of it are
    followed to what they view)."""
    if all(sym_id(r) in MATMULS for r in readers):
        return True
    producer = next((s for s in ops if any(o.name == name for o in s.flat_proxy_outs)), None)
    while producer is not None and sym_id(producer) in VIEW_OPS | RESHAPE_OPS:
        base = next((a.name for a in producer.flat_proxy_args if isinstance(a, TensorProxy)), None)
        producer = next((s for s in ops if any(o.name == base for o in s.flat_proxy_outs)), None)
    if producer is None:
        return True  # read from memory: an argument of the region
    out = next(o for o in producer.flat_proxy_outs if isinstance(o, TensorProxy))
    return sym_id(producer) in _CONVERT or not (dtypes.is_float_dtype(out.dtype) and out.dtype.bytes < 4)


def _movable(s) -> bool:
    """An op that may run in another region: elementwise (no accumulating reduction), a view or a matmul."""
    return sym_id(s) in MATMULS or (recomputable(s) and not accumulates(s))


def _read_from_outside(ops: list, made: set[str]) -> dict:
    return {a.name: a for s in ops for a in s.flat_proxy_args if a.name not in made}


def _same_as_returned(ops: list, returned: set[str]) -> dict[str, object]:
    """Names the ops compute by the same op on the same arguments as a value they return -> that value's proxy."""
    returning = {}
    for s in ops:
        if len(s.flat_proxy_outs) == 1 and s.flat_proxy_outs[0].name in returned:
            returning.setdefault(_key(s), s.flat_proxy_outs[0])
    found = {}
    for s in ops:
        same = returning.get(_key(s))
        if same is not None and len(s.flat_proxy_outs) == 1 and s.flat_proxy_outs[0].name != same.name:
            found[s.flat_proxy_outs[0].name] = same
    return found


def _at_target(name, proxy, kept, there, same, pulled):
    """What the target region reads for ``name``: its own argument, the reader's output of the same value, or a
    view or reshape of one of these (its op copied into ``pulled``); None where it has none."""
    if name in there:
        return proxy
    if name in same and same[name].name in there:
        return same[name]
    if any(o.name == name for s in pulled for o in s.flat_proxy_outs):
        return proxy
    producer = next((s for s in kept if any(o.name == name for o in s.flat_proxy_outs)), None)
    if producer is None or sym_id(producer) not in VIEW_OPS | RESHAPE_OPS:
        return None
    swap = {}
    for a in producer.flat_proxy_args:
        found = _at_target(a.name, a, kept, there, same, pulled)
        if found is None:
            return None
        if found is not a:
            swap[variableify(a)] = found
    pulled.append(producer.from_bsym_swap_proxies(swap) if swap else producer)
    return proxy


def _live(ops: list, wanted: set[str]) -> list:
    """``ops`` without those whose outputs neither ``wanted`` nor a later op reads (what moved out left unread)."""
    needed, out = set(wanted), []
    for s in reversed(ops):
        if any(o.name in needed for o in s.flat_proxy_outs):
            out.append(s)
            needed.update(a.name for a in s.flat_proxy_args)
    return out[::-1]


def _unique(proxies) -> list:
    out, seen = [], set()
    for p in proxies:
        if isinstance(p, Proxy) and p.name not in seen:
            seen.add(p.name)
            out.append(p)
    return out


PASS = Declaration("recomputed regions", ("rematerialize",), Scope.BACKWARD, _propose, after=recompute.PASS.name)
