"""Run an elementwise op in the 16-bit dtype that Thunder brackets between casts: the same bits, less traffic.

``fold_casts(trace, device_type=None) -> TraceCtx``. Without nvFuser, Thunder's torch executor runs each bf16
(or f16) elementwise op of a decomposed chain as three kernels: an upcast of each operand to float32, the op in
float32, and a rounding of the result back::

    t1 = Tensor.to(x, torch.float32, copy=True)
    t2 = torch.erf(t1)
    y = Tensor.to(t2, torch.bfloat16, copy=True)      # becomes   y = torch.erf(x)

ATen's kernel for the op on bf16 computes the same thing in one: it widens each operand to float32, runs the
float32 op and rounds the result to nearest even. That is a fact about ATen's kernels, not a rule, so it is
checked op by op: ``benchmarks/correctness/cast_check.py`` compares both forms on every bf16 and f16 value (unary ops,
ops with a number) and on every pair of values (binary ops, CUDA) or 4 million pairs (binary ops, CPU), and, on CPU,
``tests/test_casts.py`` at every length from 1 to 67, strided and broadcast (where ATen's vectorized loops leave a
scalar tail: CPU ``rsqrt`` differs there, in a third of the values, and is not folded). The tables
below hold what passed, per device type (torch 2.11 on an H200 and on CPU: ``docs/data/cast-check-*.txt``; the
CPU tables are checked again by ``tests/test_casts.py``). ``pow`` differs on both; on CPU, ``erf``, ``rsqrt``,
and f16 ``sqrt`` and ``sin``, differ. A number operand that is not exact in the 16-bit dtype is at times rounded to it
first: as the dividend of a division on both, and on CPU as either operand of an add or a subtraction and the
first of a product.

A bracket is folded only when the float32 result has no other use (nor is a trace output) and every tensor
operand is an upcast from the same 16-bit dtype; an upcast left without a use is dropped. An element then costs
4 bytes of traffic instead of 20 (a unary op), and the float32 temporaries are never allocated. The pass is
pure; ``del``s are placed again at last use (``edit.rebuilt``). Traces made on the meta device fold as on the
device type set by ``as_on`` (the report's prediction), and not at all outside it.

``PASS``: the pass as the pipeline runs it (``declaration.Declaration``): each trace of the pair folded alone.
"""

from __future__ import annotations

import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx
from thunder.executors import torchex

from thunder_fsdp_mem.analysis import device
from thunder_fsdp_mem.analysis.symbols import (
    def_use,
    dtype_name,
    names,
    shape,
    sym_id,
    symbol_name,
    tensor_outputs,
    without_dels,
)
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Context, Pair, Proposal
from thunder_fsdp_mem.passes.edit import rebuilt

_UNARY = names(
    ltorch.neg,
    ltorch.abs,
    ltorch.exp,
    ltorch.expm1,
    ltorch.log,
    ltorch.log1p,
    ltorch.tanh,
    ltorch.sigmoid,
    ltorch.reciprocal,
    ltorch.cos,
)
_ADD, _SUB, _MUL = symbol_name(ltorch.add), symbol_name(ltorch.sub), symbol_name(ltorch.mul)
_DIVIDES = names(ltorch.true_divide, torchex.div_prim_impl)
_BINARY = frozenset({_ADD, _SUB, _MUL}) | _DIVIDES | names(ltorch.maximum, ltorch.minimum)
# device type -> 16-bit dtype -> ops whose 16-bit kernel computes what upcast, op, round computes. ``rsqrt`` on
# CPU does so only in ATen's vectorized body: its scalar tail, and small tensors, differ (tests/test_casts.py).
FOLDABLE: dict[str, dict[str, frozenset[str]]] = {
    "cuda": {
        "bf16": _UNARY | _BINARY | names(ltorch.rsqrt, ltorch.erf, ltorch.sqrt, ltorch.sin),
        "f16": _UNARY | _BINARY | names(ltorch.rsqrt, ltorch.erf, ltorch.sqrt, ltorch.sin),
    },
    "cpu": {"bf16": _UNARY | _BINARY | names(ltorch.sqrt, ltorch.sin), "f16": _UNARY | _BINARY},
}
# A number operand: any number exact in the 16-bit dtype, with the ops below. One that is not exact there only at
# these (op, position) pairs; elsewhere the 16-bit kernel rounds it to the 16-bit dtype first.
_WITH_NUMBER = frozenset({_ADD, _SUB, _MUL}) | _DIVIDES
_DIVISOR = frozenset((op, 1) for op in _DIVIDES)
INEXACT_NUMBER: dict[str, frozenset[tuple[str, int]]] = {
    "cuda": _DIVISOR | {(op, i) for op in (_ADD, _SUB, _MUL) for i in (0, 1)},
    "cpu": _DIVISOR | {(_MUL, 1)},
}
_LOW = {"bf16": torch.bfloat16, "f16": torch.float16}
_CASTS = names(ltorch.to, prims.convert_element_type)


def fold_casts(trace: TraceCtx, *, device_type: str | None = None) -> TraceCtx:
    """``trace`` with each foldable upcast-op-round bracket run as one op in the 16-bit dtype (see the module's
    docstring); ``trace`` itself when there is none. ``device_type``: the device the trace runs on (None: its
    tensors' own, the meta device as ``analysis.device.as_on`` says)."""
    bsyms = without_dels(trace.bound_symbols, clears=False)
    index = def_use(bsyms)
    producer = index.producer
    uses = {name: len(at) for name, at in index.readers.items()}
    folded: dict[int, object] = {}  # index of an op -> the op on 16-bit operands
    dropped: set[int] = set()  # the roundings of the folded ops, then the upcasts left without a use
    upcasts: set[int] = set()
    for i, rounding in enumerate(bsyms):
        low = _rounding(rounding)
        if low is None:
            continue
        wide = rounding.args[0]
        j = producer.get(wide.name)
        if j is None or uses.get(wide.name) != 1:
            continue
        found = _folded(bsyms, producer, bsyms[j], low, rounding.output, device_type)
        if found is None:
            continue
        folded[j], from_upcasts = found
        dropped.add(i)
        for k in from_upcasts:
            uses[bsyms[k].output.name] -= 1
            upcasts.add(k)
    if not folded:
        return trace
    dropped |= {k for k in upcasts if uses[bsyms[k].output.name] == 0}
    return rebuilt(
        trace, [folded.get(i, b) for i, b in enumerate(bsyms) if i not in dropped], f"{len(folded)} ops run in 16 bits"
    )


def _rounding(bsym) -> str | None:
    """The 16-bit dtype's short name if ``bsym`` rounds a float32 tensor to bf16 or f16, else None."""
    cast = _cast(bsym)
    if cast is None or dtype_name(cast[0]) != "f32":
        return None
    low = dtype_name(cast[1])
    return low if low in _LOW else None


def _cast(bsym) -> tuple[TensorProxy, TensorProxy] | None:
    """(operand, result) of a cast that changes only the dtype, else None."""
    if sym_id(bsym) not in _CASTS or len(bsym.args) != 2 or set(bsym.kwargs) - {"copy"}:
        return None
    operand, out = bsym.args[0], bsym.output
    if not (isinstance(operand, TensorProxy) and isinstance(out, TensorProxy)):
        return None
    if shape(operand) != shape(out) or operand.device != out.device:
        return None
    return operand, out


def _folded(bsyms, producer, op, low: str, out: TensorProxy, device_type: str | None):
    """(the op bound to the 16-bit operands with ``out`` as its output, the indices of the upcasts it no longer
    reads), or None where the bracket cannot be folded."""
    sid = sym_id(op)
    on = device_type or device.device_type(out)
    if sid not in FOLDABLE.get(on, {}).get(low, ()) or set(op.kwargs) - {"alpha"} or op.kwargs.get("alpha", 1) != 1:
        return None
    if len(tensor_outputs(op)) != 1 or shape(op.output) != shape(out):
        return None
    args, from_upcasts = [], []
    for position, a in enumerate(op.args):
        if isinstance(a, TensorProxy):
            k = producer.get(a.name)
            cast = _cast(bsyms[k]) if k is not None else None
            if cast is None or dtype_name(cast[0]) != low or dtype_name(cast[1]) != "f32":
                return None
            args.append(cast[0])
            from_upcasts.append(k)
        elif _number(a) and sid in _WITH_NUMBER and (_exact(a, _LOW[low]) or (sid, position) in INEXACT_NUMBER[on]):
            args.append(a)
        else:
            return None
    if not from_upcasts:
        return None
    return op.from_bsym(args=tuple(args), output=out, subsymbols=[]), from_upcasts


def _number(a) -> bool:
    return isinstance(a, int | float) and not isinstance(a, bool)


def _exact(number: float, dtype: torch.dtype) -> bool:
    return float(torch.tensor(number, dtype=torch.float64).to(dtype).double()) == number


def _propose(pair: Pair, context: Context, config: MemoryConfig) -> Proposal:
    return Proposal(fold_casts(pair.forward), fold_casts(pair.backward))


PASS = Declaration("folded casts", ("fold_casts",), Scope.EACH_TRACE, _propose)
