"""Attention kept on an attention executor where a fusion executor listed ahead of it would have Thunder
differentiate attention's decomposition and save its (T, T) probabilities for backward.

Thunder's autograd takes the grad rule of the first executor in the program's list that can run or fuse an op
(``thunder.core.transforms._get_gradfn_and_executor``). A fusion executor listed first (Thunder's torch.compile
executor in ``benchmark_litgpt.py``'s ``thunder_inductor``) claims ``scaled_dot_product_attention`` and has no grad
rule for it, so Thunder differentiates its decomposition (matmul, softmax, matmul) and the forward saves the
softmax's output, (batch, heads, T, T): at 8192 tokens 4 GiB per bf16 layer of 32 heads, which an attention
executor's backward never holds.

``route_attention(trace, executors) -> (trace, found)``, before autograd: each such call is bound to a symbol of its
own (the same meta, hence the same decomposition where no grad is taken) whose grad rule is the first attention
executor's listed that accepts the call (its checker, on the call's shapes, dtypes and device): the forward and
backward that executor would run were it listed first. ``found`` says, per call, what claimed it and what runs it
now (``Routed``), or why nothing could (``runs_on`` None: no executor listed that accepts it has a grad rule).

The results are that attention executor's, which differ from the decomposition's by rounding (flash attention
does not compute the probabilities the decomposition rounds). Nothing else changes: the fusion executor still
fuses everything around attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import thunder.torch as ltorch
from thunder.core.symbol import Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.core.transforms import register_grad
from thunder.extend import get_all_executors

from thunder_fsdp_mem.analysis.symbols import dtype_name, shape
from thunder_fsdp_mem.units import format_bytes

_SDPA = ltorch.scaled_dot_product_attention
_ROUTED: dict[str, Symbol] = {}  # attention executor's name -> the symbol whose grad rule is that executor's


@dataclass(frozen=True, slots=True)
class Routed:
    """One attention call whose first claimant has no grad rule for it: ``claimed_by`` (that executor's name),
    ``runs_on`` (the attention executor whose forward and backward it now takes; None where no listed executor that
    accepts the call has a grad rule, the call left as it was), the query's shape (batch, heads, T, head size) and
    dtype, ``probabilities``: the bytes of the (batch, heads, Tq, Tk) matrix the decomposition saves, and
    ``unlisted``: where nothing listed could run it, the executors Thunder knows that would, with a grad rule."""

    claimed_by: str
    runs_on: str | None
    query_shape: tuple[int, ...]
    dtype: str
    probabilities: int
    unlisted: tuple[str, ...] = ()

    def describe(self, count: int = 1) -> str:
        """What was found, in one line, of ``count`` calls alike."""
        b, h, tq = self.query_shape[:3]
        calls = f"{count} calls" if count > 1 else "1 call"
        what = f"{calls} of scaled_dot_product_attention ({b}, {h}, {tq}, ...) {self.dtype}"
        probabilities = format_bytes(count * self.probabilities)
        if self.runs_on is None:
            fix = (
                f"list {' or '.join(self.unlisted)} ahead of {self.claimed_by}"
                if self.unlisted
                else "no executor Thunder knows runs it with a grad rule on these inputs"
            )
            return (
                f"{what}: claimed by {self.claimed_by}, which has no grad rule for it, so Thunder differentiates its "
                f"decomposition, with {probabilities} of (T, T) probabilities ({fix})"
            )
        return (
            f"{what} on {self.runs_on} with its grad rule, not decomposed by {self.claimed_by}: "
            f"{probabilities} of probabilities not saved for backward"
        )


def routed_symbol(executor) -> Symbol:
    """The symbol that stands for ``scaled_dot_product_attention`` with ``executor``'s grad rule: the op's meta (so
    its decomposition, where no grad is taken, is the op's), an id of its own, and that id's grad rule in Thunder's
    map, which autograd reads when the first claimant has none."""
    if executor.name not in _ROUTED:
        grad = executor.get_grad_transform(_SDPA)
        if grad is None:
            raise ValueError(f"executor {executor.name} has no grad rule for scaled_dot_product_attention")
        symbol = dataclasses.replace(_SDPA, id=f"thunder_fsdp_mem.attention.{executor.name}")
        register_grad(symbol.id, grad)
        _ROUTED[executor.name] = symbol
    return _ROUTED[executor.name]


def route_attention(trace: TraceCtx, executors) -> tuple[TraceCtx, tuple[Routed, ...]]:
    """``trace`` with each attention call whose first claimant in ``executors`` has no grad rule for it bound to the
    first attention executor's that accepts it (see the module's docstring), and what was found. The trace itself
    when nothing was bound anew."""
    found, bsyms, changed = [], [], False
    for bsym in trace.bound_symbols:
        if bsym.sym.id == _SDPA.id:
            first = next((ex for ex in executors if ex.can_execute_or_fuse(bsym)), None)
            if first is not None and first.get_grad_transform(bsym.sym) is None:
                runs_on = next(
                    (
                        ex
                        for ex in executors
                        if ex is not first and ex.get_grad_transform(bsym.sym) is not None and ex.can_execute(bsym)
                    ),
                    None,
                )
                found.append(_routed(bsym, first, runs_on, () if runs_on is not None else _unlisted(bsym, executors)))
                if runs_on is not None:
                    bsym = bsym.from_bsym(sym=routed_symbol(runs_on))
                    changed = True
        bsyms.append(bsym)
    if not changed:
        return trace, tuple(found)
    new = from_trace(trace)
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance("FSDPMemoryTransform (attention kept on its executor)"))
    return new, tuple(found)


def _unlisted(bsym, executors) -> tuple[str, ...]:
    """The executors Thunder knows, not in ``executors``, that would run ``bsym`` with a grad rule."""
    return tuple(
        ex.name
        for ex in get_all_executors()
        if ex not in executors and ex.get_grad_transform(bsym.sym) is not None and ex.can_execute(bsym)
    )


def _routed(bsym, claimed_by, runs_on, unlisted) -> Routed:
    query, key = bsym.args[0], bsym.args[1]
    q, k = shape(query), shape(key)
    probabilities = q[0] * q[1] * q[2] * k[-2] * query.dtype.bytes
    return Routed(
        claimed_by=claimed_by.name,
        runs_on=None if runs_on is None else runs_on.name,
        query_shape=q,
        dtype=dtype_name(query),
        probabilities=probabilities,
        unlisted=unlisted,
    )
