"""Finds ``linear`` -> (soft-cap) -> ``cross_entropy`` in a computation trace before autograd and puts the chunked
linear cross-entropy (``operator.linear_cross_entropy``) in its place, so that Thunder's autograd derives its
forward and backward from the operator's grad rule.

``rewrite_losses(trace, chunks=None) -> (trace, found, left)``: the trace with every such loss replaced, what was
replaced (``Found``), and each ``cross_entropy`` left as it was, with the reason and what the user can change
(``Left``). The pattern, as Thunder traces litgpt and the usual training losses:
``linear(h, W, b)``, optionally ``true_divide(., c)``, ``tanh``, ``mul(., c)`` (gemma-2's
``final_logit_softcapping``) and an upcast (``.to(torch.float32)`` or ``.float()``), any reshapes, views or
flattenings (or ``transpose(1, 2)``, the classes second), then ``cross_entropy(., targets)`` with
class indices, no class weights, no label smoothing and the mean or sum reduction. Each intermediate must be read
by the next alone (a shape query aside) and not returned: the logits must die in the loss, or chunking them
would save nothing. litgpt's ``chunked_cross_entropy`` at its default (the rows split into chunks, each chunk's
unreduced loss, their sum) is taken too, its sum replaced (``_match_split``). Anything else stays as it was.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import thunder.torch as ltorch
from thunder.core import dtypes, prims
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace

from thunder_fsdp_mem.analysis.chunked_loss import CHUNKS_ARG, candidate_chunks
from thunder_fsdp_mem.analysis.symbols import UNPACK_IDS, dtype_name, nbytes, proxy_names, shape
from thunder_fsdp_mem.units import format_bytes
from thunder_fsdp_mem.loss.operator import linear_cross_entropy

_CE_SIGNATURE = inspect.signature(ltorch.cross_entropy.meta)
_UPCASTS = {ltorch.to.id, prims.PrimIDs.CONVERT_ELEMENT_TYPE}  # .to(torch.float32); .float(), traced as the prim
_CHAIN = {
    ltorch.reshape.id,
    ltorch.view.id,
    ltorch.flatten.id,
    *_UPCASTS,
    ltorch.true_divide.id,
    ltorch.tanh.id,
    ltorch.mul.id,
}


@dataclass(frozen=True, slots=True)
class Found:
    """One loss replaced: the logits' shape (rows, vocabulary), their dtype, the soft-cap (None: none), whether
    the head has a bias, and the chunks it starts with."""

    logits_shape: tuple[int, int]
    dtype: str
    softcap: float | None
    bias: bool
    chunks: int


@dataclass(frozen=True, slots=True)
class Left:
    """One ``cross_entropy`` left as it was: why, and what the user can change so that it is chunked."""

    reason: str
    fix: str

    def describe(self) -> str:
        return f"cross_entropy not chunked: {self.reason} (to have it chunked: {self.fix})"


def rewrite_losses(trace: TraceCtx, chunks: int | None = None) -> tuple[TraceCtx, tuple[Found, ...], tuple[Left, ...]]:
    """``trace`` with each linear cross-entropy chunked (``chunks``: how many chunks; None: the most
    ``chunked_loss.candidate_chunks`` tries, the least memory, which ``passes.chunks`` then lowers where the peak
    allows), what it chunked, and the cross-entropies it left. The trace itself when it chunks none."""
    bsyms = list(trace.bound_symbols)
    producer = {o.name: i for i, b in enumerate(bsyms) for o in b.flat_proxy_outs}
    readers: dict[str, list[int]] = {}
    for i, b in enumerate(bsyms):
        for name in set(proxy_names(b.args) + proxy_names(b.kwargs)):
            readers.setdefault(name, []).append(i)
    returned = set()
    for b in bsyms:
        if b.sym.id == PrimIDs.RETURN:
            returned.update(proxy_names(b.args))
    replace: dict[int, object] = {}
    dropped: set[int] = set()
    found, left = [], []

    def take(i: int, match) -> None:
        if isinstance(match, Left):
            left.append(match)
            return
        new, chain, record = match
        if chunks is not None:
            new = new.from_bsym(args=new.args[:CHUNKS_ARG] + (chunks,) + new.args[CHUNKS_ARG + 1 :])
            record = dataclasses.replace(record, chunks=chunks)
        replace[i] = new
        dropped.update(chain)
        found.append(record)

    consumed: set[int] = set()  # the per-chunk cross-entropies of a summed form, said or replaced with their sum
    for i, b in enumerate(bsyms):  # litgpt's chunked_cross_entropy first: its losses are summed rows
        if b.sym.id == ltorch.sum.id and (parts := _summed(bsyms, i, producer)) is not None:
            consumed.update(parts)
            take(i, _match_split(bsyms, i, parts, producer, readers, returned))
    for i, b in enumerate(bsyms):
        if b.sym.id == ltorch.cross_entropy.id and i not in consumed:
            take(i, _match(bsyms, i, producer, readers, returned))
    if not found and not left:
        left.extend(_outside(bsyms, producer))
    if not found:
        return trace, (), tuple(left)
    removed = {o.name for j in dropped for o in bsyms[j].flat_proxy_outs}
    out = []
    for i, b in enumerate(bsyms):
        if i in dropped:
            continue
        if b.sym.id == PrimIDs.SHAPE and set(proxy_names(b.args)) & removed:
            continue  # a query of the logits' shape; its result is a plain int in the trace
        out.append(replace.get(i, b))
    new_trace = from_trace(trace)
    new_trace.bound_symbols = out
    new_trace.set_provenance(TraceProvenance(f"FSDPMemoryTransform: chunked linear cross-entropy ({len(found)})"))
    return new_trace, tuple(found), tuple(left)


_RETURN_LOSS = "return the loss alone (the logits must die in the loss to be chunked)"
_IN_STEP = "compute the loss in the compiled function (thunder_fsdp_mem.LossModel)"
_HEAD_IN_CHUNKS = "the head runs in chunks whose logits the loss reads apart or concatenated (lm_head_chunk_size)"
_ONE_HEAD = "call the model with lm_head_chunk_size=0: the chunked loss chunks the head with the loss"


def _match(bsyms, i, producer, readers, returned):
    """(the chunked symbol, the chain it replaces, what it is) for the ``cross_entropy`` at ``i``, or ``Left``."""
    ce = bsyms[i]
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return Left("its arguments are not F.cross_entropy's", "call F.cross_entropy(logits, targets)")
    bound.apply_defaults()
    a, target = bound.arguments["a"], bound.arguments["target"]
    p = bound.arguments
    if p["weight"] is not None:
        return Left("it has class weights", "drop weight= (the chunked loss weighs every class alike)")
    if p["label_smoothing"] != 0.0:
        return Left("it smooths labels", "set label_smoothing=0.0")
    if p["reduction"] not in ("mean", "sum"):
        fix = "reduce inside the loss (litgpt's chunked_cross_entropy: chunk_size=0)"
        return Left(f"reduction={p['reduction']!r}", fix)
    logits, reader, moved = a, i, []
    if isinstance(a, TensorProxy) and isinstance(target, TensorProxy) and len(shape(a)) == 3:
        # (B, V, T) logits, the classes second as F.cross_entropy takes them: logits.transpose(1, 2) of (B, T, V).
        j = producer.get(a.name)
        if j is not None and bsyms[j].sym.id == ltorch.transpose.id and sorted(bsyms[j].args[1:3]) == [1, 2]:
            if shape(target) == (shape(a)[0], shape(a)[2]) and readers[a.name] == [i]:
                logits, reader, moved = bsyms[j].args[0], j, [j]
    if (
        not isinstance(logits, TensorProxy)
        or not isinstance(target, TensorProxy)
        or not (len(shape(logits)) == 2 or moved)
        or (not moved and shape(target) != shape(logits)[:1])
        or not dtypes.is_integer_dtype(target.dtype)
    ):
        return Left(
            "its logits are not (rows, classes) with one class index per row",
            "reshape the logits to (-1, vocabulary) and the targets to (-1,)",
        )
    match = _replacement(
        bsyms, logits, reader, target, p["ignore_index"], p["reduction"], ce.output, producer, readers, returned
    )
    if isinstance(match, Left):
        return match
    new, chain, record = match
    return new, [*moved, *chain], record


def _replacement(bsyms, logits, reader, targets, ignore_index, reduction, output, producer, readers, returned):
    """The chunked operator in place of the loss of ``logits`` (read by the symbol at ``reader``) and ``targets``,
    bound to the loss's ``output``: ``(new symbol, the chain it replaces, what it is)``, or ``Left``."""
    head = _head(bsyms, logits, reader, producer, readers, returned)
    if isinstance(head, Left):
        return head
    chain, softcap, (hidden, weight, bias) = head
    chunks = candidate_chunks(_rows(hidden))[-1]
    new = linear_cross_entropy.bind(
        hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, logits.dtype, output=output
    )
    record = Found((_rows(logits), shape(logits)[-1]), dtype_name(logits), softcap, bias is not None, chunks)
    return new, chain, record


def _outside(bsyms, producer) -> list[Left]:
    """Where a function computes no cross-entropy and returns its head's logits (a ``linear``'s output, reshaped or
    not, wider than its input): the loss is computed after it, eagerly, out of the transform's reach."""
    ret = next((b for b in bsyms if b.sym.id == PrimIDs.RETURN), None)
    out = []
    for t in (a for a in ret.flat_proxy_args if isinstance(a, TensorProxy)) if ret is not None else ():
        j = producer.get(t.name)
        while j is not None and bsyms[j].sym.id in (ltorch.reshape.id, ltorch.view.id):
            j = producer.get(bsyms[j].args[0].name) if isinstance(bsyms[j].args[0], TensorProxy) else None
        if j is None or bsyms[j].sym.id != ltorch.linear.id or len(shape(t)) < 2:
            continue
        hidden, weight = bsyms[j].args[:2]
        if isinstance(weight, TensorProxy) and len(shape(weight)) == 2 and shape(weight)[0] > 4 * shape(weight)[1]:
            reason = (
                f"the compiled function returns its head's logits, {shape(t)} {dtype_name(t)}"
                f" ({format_bytes(nbytes(t))}): the loss is computed after it"
            )
            out.append(Left(reason, _IN_STEP))
    return out


def _summed(bsyms, i, producer) -> list[int] | None:
    """The indices of the cross-entropies whose per-row losses the ``sum`` at ``i`` adds up whole (``sum(cat([...]))``,
    as litgpt's ``chunked_cross_entropy`` does), or None for any other sum."""
    total = bsyms[i]
    x, *rest = total.args
    if any(a is not None and a is not False for a in (*rest, *total.kwargs.values())):
        return None  # a sum over some dimensions, kept, or in another dtype
    j = producer.get(x.name) if isinstance(x, TensorProxy) else None
    if j is None or bsyms[j].sym.id != ltorch.cat.id:
        return None
    parts, *dim = bsyms[j].args
    if (dim[0] if dim else bsyms[j].kwargs.get("dim", 0)) != 0:
        return None
    ces = [producer.get(t.name) for t in parts if isinstance(t, TensorProxy)]
    if len(ces) != len(parts) or any(k is None or bsyms[k].sym.id != ltorch.cross_entropy.id for k in ces):
        return None
    return [j, *ces]


def _match_split(bsyms, i, parts, producer, readers, returned):
    """litgpt's ``chunked_cross_entropy(logits, targets, chunk_size)``: the logits (rows, V) and the targets split alike
    into chunks of rows, ``cross_entropy(..., reduction='none')`` of each, their losses concatenated and summed
    (``_summed``). The sum is the chunked operator's with the ``sum`` reduction over the whole logits and targets;
    what litgpt divides it by (the count of counted rows, at least 1) stays. ``(new, chain, record)`` or ``Left``."""
    cat, *ces = parts
    total = bsyms[i]
    if readers[bsyms[cat].output.name] != [i] or any(readers[bsyms[k].output.name] != [cat] for k in ces):
        return Left("its per-chunk losses are read by more than their sum", "sum them alone")
    bound = []
    for k in ces:
        try:
            b = _CE_SIGNATURE.bind(*bsyms[k].args, **bsyms[k].kwargs)
        except TypeError:
            return Left("its arguments are not F.cross_entropy's", "call F.cross_entropy(logits, targets)")
        b.apply_defaults()
        bound.append(b.arguments)
    first = bound[0]
    if any(b["weight"] is not None or b["label_smoothing"] != 0.0 or b["reduction"] != "none" for b in bound) or any(
        b["ignore_index"] != first["ignore_index"] for b in bound
    ):
        return Left("its chunks' losses differ or are weighted", "use litgpt's chunked_cross_entropy as it is")
    splits = []
    for key in ("a", "target"):
        pieces = [b[key] for b in bound]
        s = producer.get(pieces[0].name) if isinstance(pieces[0], TensorProxy) else None
        names = [p.name if isinstance(p, TensorProxy) else None for p in pieces]
        if s is None or bsyms[s].sym.id != ltorch.split.id or [o.name for o in bsyms[s].flat_proxy_outs] != names:
            if key == "a":
                return Left(_HEAD_IN_CHUNKS, _ONE_HEAD)
            return Left("its targets are not one split", "split the targets as the logits")
        if any(r not in ces and bsyms[r].sym.id != PrimIDs.SHAPE for p in pieces for r in readers[p.name]):
            return Left("its chunks are read by more than their losses", _RETURN_LOSS)
        splits.append(s)
    (s_logits, s_targets) = splits
    if bsyms[s_logits].args[1:] != bsyms[s_targets].args[1:] or bsyms[s_logits].kwargs != bsyms[s_targets].kwargs:
        return Left("the logits and the targets are split differently", "split them alike")
    logits, targets = bsyms[s_logits].args[0], bsyms[s_targets].args[0]
    if (
        len(shape(logits)) != 2
        or shape(targets) != shape(logits)[:1]
        or not dtypes.is_integer_dtype(targets.dtype)
        or (bsyms[s_logits].args[2:] or (bsyms[s_logits].kwargs.get("dim", 0),))[0] != 0
    ):
        return Left("its logits are not split by rows", "split the (rows, vocabulary) logits along the rows")
    match = _replacement(
        bsyms, logits, s_logits, targets, first["ignore_index"], "sum", total.output, producer, readers, returned
    )
    if isinstance(match, Left):
        return match
    new, chain, record = match
    gone = [s_logits, *parts]
    if all(r in ces for p in bsyms[s_targets].flat_proxy_outs for r in readers[p.name]):
        gone.append(s_targets)
    return new, [*chain, *gone], record


def _rows(hidden) -> int:
    rows = 1
    for s in shape(hidden)[:-1]:
        rows *= s
    return rows


def _head(bsyms, logits, reader: int, producer, readers, returned):
    """Walk from the loss's ``logits`` (read by the symbol at ``reader``) back to the head: ``(the chain of symbols
    from the head on, the soft-cap or None, (hidden, weight, bias))``, or ``Left``."""
    chain, softcap, current = [], None, logits
    while True:
        j = producer.get(current.name)
        if j is None or bsyms[j].sym.id in UNPACK_IDS:
            return Left("the logits are an input of the compiled function: its head is outside", _IN_STEP)
        if current.name in returned:
            return Left("the compiled function returns the logits too", _RETURN_LOSS)
        allowed = chain[-1] if chain else reader
        if any(k != allowed and bsyms[k].sym.id != PrimIDs.SHAPE for k in readers[current.name]):
            return Left("the logits are read by more than the loss", _RETURN_LOSS)
        b = bsyms[j]
        if b.sym.id == ltorch.linear.id:
            chain.append(j)
            break
        if b.sym.id == ltorch.cat.id:
            return Left(_HEAD_IN_CHUNKS, _ONE_HEAD)
        if b.sym.id not in _CHAIN:
            return Left(
                f"the logits pass through {b.sym.name} between the head and the loss",
                "apply it to the head's input instead (slice the hidden states, not the logits), or reshape them",
            )
        chain.append(j)
        source = b.args[0]
        if b.sym.id in _UPCASTS and not (isinstance(source, TensorProxy) and b.output.dtype == dtypes.float32):
            return Left(f"the logits are cast to {dtype_name(b.output)}", "upcast them to float32, or not at all")
        if b.sym.id == ltorch.mul.id:
            softcap, source = _softcap(bsyms, b, producer, readers, chain)
            if softcap is None:
                return Left("the logits are scaled, not soft-capped as tanh(x / c) * c", "scale the head's input")
        if not isinstance(source, TensorProxy):
            return Left(f"the logits come from {b.sym.name} of a number", "compute them by a linear head")
        current = source
    linear = bsyms[chain[-1]]
    hidden, weight, *rest = linear.args
    bias = rest[0] if rest else linear.kwargs.get("bias")
    if (
        not isinstance(hidden, TensorProxy)
        or len(shape(weight)) != 2
        or hidden.dtype != weight.dtype
        or (bias is not None and bias.dtype != weight.dtype)
        or not dtypes.is_float_dtype(weight.dtype)
    ):
        return Left("the head's input, weight and bias differ in dtype", "run the head in one floating dtype")
    if (_rows(hidden), shape(weight)[0]) != (_rows(logits), shape(logits)[-1]):
        return Left("the logits' rows are not the head's", "reshape the logits, not slice them")
    return chain, softcap, (hidden, weight, bias)


def _softcap(bsyms, mul, producer, readers, chain):
    """``tanh(x / c) * c``: (c, x) with the divide and the tanh added to ``chain``, or (None, None)."""
    t, c = mul.args
    if not isinstance(t, TensorProxy) or not isinstance(c, int | float):
        return None, None
    j = producer.get(t.name)
    if j is None or bsyms[j].sym.id != ltorch.tanh.id or readers[t.name] != [chain[-1]]:
        return None, None
    (u,) = bsyms[j].args
    k = producer.get(u.name) if isinstance(u, TensorProxy) else None
    if k is None or bsyms[k].sym.id != ltorch.true_divide.id or readers[u.name] != [j]:
        return None, None
    x, c2 = bsyms[k].args
    if c2 != c or not isinstance(x, TensorProxy):
        return None, None
    chain.extend((j, k))
    return float(c), x
