"""How many chunks each chunked linear cross-entropy of a forward runs in: the fewest that keep the step's
estimated peak where the most chunks put it.

``loss.rewrite`` puts the loss in the trace before autograd with the most chunks it tries (the least memory:
``chunked_loss.candidate_chunks``), so that every other pass is judged with the loss at its smallest. This pass
runs last: fewer, larger chunks run faster (larger matmuls, fewer kernel launches), and the estimator says how
few still keep the peak, which the rest of the step sets, where it was. The workspace of a chunk falls as the count
rises, so the fewest is found by bisection over the candidates.

``PASS``: the pass as the pipeline runs it (``MemoryConfig.chunk_loss``).
"""

from __future__ import annotations

from thunder.core.trace import from_trace

from thunder_fsdp_mem.analysis.chunked_loss import CHUNKS_ARG, FORWARD_WITH_GRADS, candidate_chunks
from thunder_fsdp_mem.analysis.symbols import shape, sym_id
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Context, Pair, Proposal


def with_chunks(forward, chunks: int):
    """``forward`` with every chunked loss in ``chunks`` chunks (the trace itself where none changes)."""
    changed = False
    out = []
    for b in forward.bound_symbols:
        if sym_id(b) == FORWARD_WITH_GRADS and b.args[CHUNKS_ARG] != chunks:
            b = b.from_bsym(args=b.args[:CHUNKS_ARG] + (chunks,) + b.args[CHUNKS_ARG + 1 :])
            changed = True
        out.append(b)
    if not changed:
        return forward
    new = from_trace(forward)
    new.bound_symbols = out
    return new


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    losses = [b for b in pair.forward.bound_symbols if sym_id(b) == FORWARD_WITH_GRADS]
    if not losses:
        return Proposal(pair.forward, pair.backward)
    rows = max(_rows(b) for b in losses)
    candidates = candidate_chunks(rows)
    peak = context.estimate().peak_bytes
    tried = {}
    low, high = 0, len(candidates) - 1  # the most chunks keep the peak; find the fewest that do
    while low < high:
        middle = (low + high) // 2
        trial = with_chunks(pair.forward, candidates[middle])
        tried[middle] = (trial, context.estimator(trial, pair.backward))
        if tried[middle][1].peak_bytes <= peak:
            high = middle
        else:
            low = middle + 1
    forward, estimate = tried.get(low, (with_chunks(pair.forward, candidates[low]), None))
    note = f"{candidates[low]} chunk(s) of {-(-rows // candidates[low])} rows"
    return Proposal(forward, pair.backward, note=note, estimate=estimate)


def _rows(bsym) -> int:
    out = 1
    for s in shape(bsym.args[0])[:-1]:
        out *= s
    return out


PASS = Declaration("loss chunks", ("chunk_loss",), Scope.EACH_TRACE, _propose)
