"""Finds ``linear`` -> (soft-cap) -> ``cross_entropy`` in a computation trace before autograd and puts the chunked
linear cross-entropy (``operator.linear_cross_entropy``) in its place, so that Thunder's autograd derives its
forward and backward from the operator's grad rule.

``rewrite_losses(trace, chunks=None) -> (trace, found)``: the trace with every such loss replaced, and what was
replaced (``Found``). The pattern, as Thunder traces litgpt and the usual training losses:
``linear(h, W, b)``, optionally ``true_divide(., c)``, ``tanh``, ``mul(., c)`` (gemma-2's
``final_logit_softcapping``) and an upcast (``.to(torch.float32)`` or ``.float()``), any reshapes, views or
flattenings, then ``cross_entropy(., targets)`` with
class indices, no class weights, no label smoothing and the mean or sum reduction. Each intermediate must be read
by the next alone (a shape query aside) and not returned: the logits must die in the loss, or chunking them
would save nothing. Anything else stays as it was.
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
from thunder_fsdp_mem.analysis.symbols import dtype_name, proxy_names, shape
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


def rewrite_losses(trace: TraceCtx, chunks: int | None = None) -> tuple[TraceCtx, tuple[Found, ...]]:
    """``trace`` with each linear cross-entropy chunked (``chunks``: how many chunks; None: the most
    ``chunked_loss.candidate_chunks`` tries, the least memory, which ``passes.chunks`` then lowers where the peak
    allows). The trace itself when there is none."""
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
    found = []
    for i, b in enumerate(bsyms):
        if b.sym.id != ltorch.cross_entropy.id:
            continue
        match = _match(bsyms, i, producer, readers, returned)
        if match is None:
            continue
        new, chain, record = match
        if chunks is not None:
            new = new.from_bsym(args=new.args[:CHUNKS_ARG] + (chunks,) + new.args[CHUNKS_ARG + 1 :])
            record = dataclasses.replace(record, chunks=chunks)
        replace[i] = new
        dropped.update(chain)
        found.append(record)
    if not found:
        return trace, ()
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
    return new_trace, tuple(found)


def _match(bsyms, i, producer, readers, returned):
    ce = bsyms[i]
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a, target = bound.arguments["a"], bound.arguments["target"]
    p = bound.arguments
    if (
        not isinstance(a, TensorProxy)
        or not isinstance(target, TensorProxy)
        or p["weight"] is not None
        or p["label_smoothing"] != 0.0
        or p["reduction"] not in ("mean", "sum")
        or len(shape(a)) != 2
        or shape(target) != shape(a)[:1]
        or not dtypes.is_integer_dtype(target.dtype)
    ):
        return None
    chain, softcap, current = [], None, a
    while True:
        j = producer.get(current.name)
        if j is None or current.name in returned:
            return None
        if any(k != (chain[-1] if chain else i) and bsyms[k].sym.id != PrimIDs.SHAPE for k in readers[current.name]):
            return None
        b = bsyms[j]
        if b.sym.id == ltorch.linear.id:
            chain.append(j)
            break
        if b.sym.id not in _CHAIN:
            return None
        chain.append(j)
        source = b.args[0]
        if b.sym.id in _UPCASTS and not (isinstance(source, TensorProxy) and b.output.dtype == dtypes.float32):
            return None
        if b.sym.id == ltorch.mul.id:
            softcap, source = _softcap(bsyms, b, producer, readers, chain)
            if softcap is None:
                return None
        if not isinstance(source, TensorProxy):
            return None
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
        return None
    rows = 1
    for s in shape(hidden)[:-1]:
        rows *= s
    if (rows, shape(weight)[0]) != shape(a):
        return None
    chunks = candidate_chunks(rows)[-1]
    new = linear_cross_entropy.bind(
        hidden, weight, bias, target, p["ignore_index"], softcap, p["reduction"], chunks, a.dtype, output=ce.output
    )
    record = Found(shape(a), dtype_name(a), softcap, bias is not None, chunks)
    return new, chain, record


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
