"""Open a forward's fusion regions to the minimum cut: the cheap ops inside a region that also runs matmuls.

``opened(forward) -> Opened | None`` lists the forward's symbols with each such region replaced by its own symbols
(Thunder's fusion symbols keep the ops they fuse as subsymbols, on the same proxies); ``mincut.plan_saved`` cuts
that list, and ``closed(forward, plan) -> (forward symbols, recomputed symbols)`` turns a plan made on it back into
the forward's regions and new backward regions.

Why: where a fusion executor claims matmuls (Thunder's torch.compile executor listed first, or as the last of the
project's fused executors), a block's forward is one or two regions, matmuls inside. A region as a whole is
recomputed only at a price (a memory budget), and Thunder's rematerialization moves ops only from one region into
another that reads them (``passes.fusions``). So the region saves, beside a matmul's output, the cheap ops computed
from it: an MLP's GELU of its first matmul's output, for the second matmul's weight gradient, or the rotary
embedding of the query and key, which a non-fusion attention backward reads. Opened, the cut saves the matmul's
output and the backward recomputes the rest in a region of its own, just before its first use. At a price (a memory
budget), a matmul inside an opened region may be recomputed too, from its arguments saved (``Opened.matmul_args``):
an MLP's first matmul from its saved input, which its weight's gradient reads anyway, rather than its whole region.

Bits. A fusion compiler computes a region's ops without rounding what it does not store (Inductor computes
bfloat16 pointwise ops in float32 and rounds at the store), so a value the region stores is not in general the
value its later ops used. The backward recomputes therefore only from what the forward's kernels read from memory:
the region's arguments, and the outputs of its matmuls (which run as kernels of their own, whose output is in
memory), or views of these (``Opened.stored``). From those it runs the same ops again, elementwise ones (each
value rounded once, at its store, as in the forward), never an accumulating reduction (a new kernel may add in
another order). A value a region computes may be saved only if the region returns it already; a stored value the
region does not return is added to its outputs (it is in memory anyway). The forward's regions otherwise stay as
they are, their outputs included, so that the forward's kernels compute what they did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thunder.core.proxies import TensorProxy

from thunder_fsdp_mem.thunder_internals import update_fusion
from thunder_fsdp_mem.analysis.effects import storage_roots
from thunder_fsdp_mem.analysis.symbols import (
    MATMULS,
    RESHAPE_OPS,
    VIEW_OPS,
    accumulates,
    is_fusion,
    nbytes,
    sym_id,
    tensor_args,
)


@dataclass(frozen=True, slots=True)
class Opened:
    """A forward's symbols with its mixed regions opened.

    symbols: the forward's symbols, each opened region replaced by its subsymbols, in order.
    region: for each symbol, the index in the forward of the region it was opened from; None at the top level.
    stored: names computed inside opened regions that their kernels hold in memory (a matmul's output, views of it):
        the backward may recompute from them.
    views: those of ``stored`` that are views: never saved (a saved view holds its whole base), but viewed again
        in backward from their base, for nothing.
    returned: names the opened regions return (they may be saved; nothing else a region computes may be, but
        ``matmul_args``).
    matmul_args: names computed inside opened regions that their matmuls read: in memory as the matmul read them
        (it runs as a kernel of its own), so that a matmul recomputed at a price may read them saved; the region's
        other ops read them unrounded, and never saved.
    """

    symbols: tuple
    region: tuple[int | None, ...]
    stored: frozenset[str]
    views: frozenset[str]
    returned: frozenset[str]
    matmul_args: frozenset[str] = frozenset()

    def inside(self, i: int) -> bool:
        return self.region[i] is not None


def opened(forward_symbols: Sequence, cheap: Callable[[object], bool]) -> Opened | None:
    """``forward_symbols`` with every mixed region opened (see the module's docstring), or None where there is
    none: a region is opened where it runs matmuls and ops that are ``cheap`` (the cut's recomputable ops) and no
    accumulating reduction."""

    def recomputable(bsym) -> bool:
        return cheap(bsym) and not accumulates(bsym)

    symbols, region = [], []
    stored, views, returned, matmul_args = set(), set(), set(), set()
    for i, bsym in enumerate(forward_symbols):
        subs = bsym.subsymbols if is_fusion(bsym) else ()
        mixed = any(sym_id(s) in MATMULS for s in subs) and any(recomputable(s) for s in subs)
        if not mixed:
            symbols.append(bsym)
            region.append(None)
            continue
        in_memory, viewed = _stored(bsym)
        stored.update(in_memory)
        views.update(viewed)
        returned.update(p.name for p in bsym.flat_proxy_outs)
        made = {o.name for s in subs for o in s.flat_proxy_outs}
        matmul_args.update(a.name for s in subs if sym_id(s) in MATMULS for a in s.flat_proxy_args if a.name in made)
        symbols.extend(subs)
        region.extend([i] * len(subs))
    if len(symbols) == len(forward_symbols):
        return None
    return Opened(
        tuple(symbols),
        tuple(region),
        frozenset(stored),
        frozenset(views),
        frozenset(returned),
        frozenset(matmul_args - stored),
    )


def _stored(region) -> tuple[set[str], set[str]]:
    """Names a region's kernel holds in memory, as ``(all, views)``: its matmuls' outputs, and what views and
    reshapes make of them (a reshape copies the same values where torch cannot view its input); ``views`` are
    those that share a matmul output's storage (``effects.storage_roots``)."""
    root = storage_roots(region.subsymbols, tensor_args(region))
    stored: set[str] = set()
    views: set[str] = set()
    for s in region.subsymbols:
        sid = sym_id(s)
        if sid in MATMULS:
            stored.update(o.name for o in s.flat_proxy_outs)
        elif sid in VIEW_OPS | RESHAPE_OPS and all(a.name in stored for a in s.flat_proxy_args):
            for o in s.flat_proxy_outs:
                stored.add(o.name)
                if root.get(o.name, o.name) != o.name:
                    views.add(o.name)
    return stored, views


def regions_traffic(opened_: Opened, recompute: Sequence[int], wanted: set[str]) -> int:
    """Bytes the new regions of ``closed`` read and write: each reads its arguments and writes what ``wanted`` (the
    backward, or a recomputed symbol of another region or the top level) reads of it; what it computes in between
    stays in the kernel."""
    groups: dict[int, list] = {}
    for i in recompute:
        if opened_.region[i] is not None:
            groups.setdefault(opened_.region[i], []).append(opened_.symbols[i])
    outside = {a.name for i in recompute if opened_.region[i] is None for a in opened_.symbols[i].flat_proxy_args}
    total = 0
    for r, ops in groups.items():
        made = {o.name: o for b in ops for o in b.flat_proxy_outs}
        others = set().union(*({a.name for b in o for a in b.flat_proxy_args} for q, o in groups.items() if q != r))
        args = {a.name: a for b in ops for a in b.flat_proxy_args if a.name not in made}
        written = [o for n, o in made.items() if n in wanted or n in outside or n in others]
        total += sum(nbytes(t) for t in (*args.values(), *written) if isinstance(t, TensorProxy))
    return total


def closed(
    forward_symbols: Sequence, opened_: Opened, saved: Sequence[str], recompute: Sequence[int], wanted: set[str]
):
    """A plan on ``opened_`` turned back into traces' symbols: the forward's symbols with each region returning also
    the stored values it must save (``saved`` names them among others), and the symbols the backward runs again:
    each opened region's recomputed ops as one new region of that region's executor, returning what ``wanted``
    (the names the backward reads) or another recomputed symbol reads; top-level symbols as they are; in forward
    order. Returns ``(forward symbols, recomputed symbols)``."""
    saved = set(saved)
    extra: dict[int, list] = {}
    for i, bsym in enumerate(opened_.symbols):
        r = opened_.region[i]
        if r is not None:
            extra.setdefault(r, []).extend(
                o for o in bsym.flat_proxy_outs if o.name in saved and o.name not in opened_.returned
            )
    forward = list(forward_symbols)
    for r, outs in extra.items():
        if outs:
            region = forward[r]
            forward[r] = update_fusion(dataclasses.replace(region, output=(*region.flat_proxy_outs, *outs)))

    items: list[tuple[int | None, list]] = []  # (region or None, ops), each at its first op
    group_of: dict[int, list] = {}
    for i in sorted(recompute):
        r = opened_.region[i]
        if r is None:
            items.append((None, [opened_.symbols[i]]))
        elif r in group_of:
            group_of[r].append(opened_.symbols[i])
        else:
            group_of[r] = [opened_.symbols[i]]
            items.append((r, group_of[r]))
    reads = [{a.name for b in ops for a in b.flat_proxy_args} for _, ops in items]
    recomputed = []
    for k, (r, ops) in enumerate(items):
        if r is None:
            recomputed.extend(ops)
            continue
        outside = wanted.union(*(reads[j] for j in range(len(items)) if j != k))
        made = {o.name for b in ops for o in b.flat_proxy_outs}
        args, seen = [], set()
        for b in ops:
            for a in b.flat_proxy_args:
                if a.name not in made and a.name not in seen:
                    seen.add(a.name)
                    args.append(a)
        outs = tuple(o for b in ops for o in b.flat_proxy_outs if isinstance(o, TensorProxy) and o.name in outside)
        region = dataclasses.replace(forward_symbols[r], args=tuple(args), output=outs, subsymbols=tuple(ops))
        recomputed.append(update_fusion(region))
    return forward, recomputed
