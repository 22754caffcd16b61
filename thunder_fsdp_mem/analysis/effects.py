"""What each bound symbol does to memory: which outputs are new allocations, which alias an input, and what
workspace the op allocates that the trace does not show.

Entry point: ``classify(bsym, strides_of) -> Effect``. Rules, by ``symbols.sym_id``:
- view ops (``symbols.VIEW_OPS``: Thunder's symbols that return views, slicing, the wait of a collective...) alias
  their first tensor argument, as does the chunked loss's backward scaling (``chunked_loss.SCALE``, in place);
- ``reshape``-like ops alias when torch can view the input (see ``layout.view_strides``) and copy otherwise;
  ``to``/``contiguous`` alias when they change nothing;
- fusion regions (``TorchCompile*``, ``nvFusion*``) allocate their outputs, except outputs that their own
  subsymbols reach from an input through views alone;
- collectives allocate their result at the call (an all-gather's output exists from the all-gather on, not
  from the wait);
- every other symbol allocates its tensor outputs (the general rule). Symbols of executors not in
  ``symbols.KNOWN_EXECUTORS`` are marked unknown.

Workspace is modelled where an op materialises tensors it does not return: ``matmul``/``linear`` copying an
operand that cannot be viewed as the batched or folded shape, ``softmax``/``log_softmax`` converting their input
to another dtype, and a fusion region's matmul results and computed operands (``_region_workspace``). (Thunder
0.2.7 shows the rest in the trace: on CPU it decomposes SDPA into ``matmul`` and ``softmax``, and
``cross_entropy`` into ``log_softmax`` and ``nll_loss``; on CUDA its sdpa executor calls the memory-efficient or
flash kernels, whose outputs it lists.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto

import thunder.torch as ltorch
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy
from thunder.executors import torchex

from thunder_fsdp_mem.analysis import chunked_loss, device, layout
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.symbols import (
    ALL_GATHER,
    ALL_REDUCE,
    CLEAR,
    COLLECTIVES,
    ELEMENTWISE_OPS,
    KNOWN_EXECUTORS,
    MATMULS,
    PACKS,
    REDUCE_SCATTER,
    REDUCTIONS,
    RESHAPE_OPS,
    SLICE,
    UNPACK_IDS,
    VIEW_OPS,
    WAITS,
    TensorLike,
    is_fusion,
    names,
    nbytes,
    shape,
    sym_id,
    symbol_name,
    tensor_args,
    tensor_outputs,
)

_CONTIGUOUS = symbol_name(ltorch.contiguous)
_TO = symbol_name(ltorch.to)
_LINEAR = symbol_name(ltorch.linear)
# View ops by how their strides follow from their base's (``_view_strides``). ``alias``, ``broadcast_to`` and ``mT``:
# names no op of Thunder bears, as in ``symbols.VIEW_OPS``.
_SAME_STRIDES = names(
    torchex.shallow_copy,
    ltorch.detach,
    torchex.update_aliases,
    ltorch.split,
    ltorch.split_with_sizes,
    ltorch.tensor_split,
    ltorch.hsplit,
    ltorch.vsplit,
    ltorch.chunk,
) | frozenset({"alias"})
_EXPANDS = names(ltorch.expand, ltorch.expand_as) | frozenset({"broadcast_to"})
_UNSQUEEZE = symbol_name(ltorch.unsqueeze)
_PERMUTE = symbol_name(ltorch.permute)
_TRANSPOSES = names(ltorch.transpose, ltorch.swapaxes, ltorch.swapdims, ltorch.t, ltorch.adjoint) | frozenset({"mT"})
_SELECTS = names(ltorch.select, ltorch.unbind)  # drop the one dimension they index
_SQUEEZES = names(ltorch.squeeze) | _SELECTS
# Ops that convert their input to the ``dtype`` they are given first (``_workspace``).
_SOFTMAXES = names(torchex.softmax, ltorch.log_softmax)


class Kind(Enum):
    """What a bound symbol is to the walk: an op, the unpacking of an input, a ``del``, a collection clear, the
    return, or nothing that touches tensors."""

    COMPUTE = auto()
    UNPACK = auto()
    DEL = auto()
    CLEAR = auto()
    RETURN = auto()
    NOOP = auto()


@dataclass(frozen=True, slots=True)
class Output:
    """One tensor output of a bound symbol: ``base`` is the name of the tensor whose storage it shares, or None
    when the op allocates it."""

    proxy: TensorLike
    base: str | None
    strides: layout.Strides
    category: Category = Category.TEMPORARY
    nbytes: int | None = None  # size of the allocation when larger than the tensor (views of one buffer)


@dataclass(frozen=True, slots=True)
class Effect:
    """The memory effect of one bound symbol: its outputs, the workspace it allocates while it runs, and whether
    its executor is one whose memory behaviour is known."""

    kind: Kind
    outputs: tuple[Output, ...] = ()
    workspace: int = 0
    known: bool = True


StridesOf = Callable[[str], layout.Strides]


def classify(bsym, strides_of: StridesOf) -> Effect:
    """The memory effect of ``bsym``. ``strides_of(name)`` gives the strides of a live tensor."""
    sid = bsym.sym.id
    if sid == PrimIDs.DEL:
        return Effect(Kind.DEL)
    if sid == PrimIDs.RETURN:
        return Effect(Kind.RETURN)
    if sid in UNPACK_IDS:
        return Effect(Kind.UNPACK)
    if sid == CLEAR:
        return Effect(Kind.CLEAR)
    outs = tensor_outputs(bsym)
    if not outs:
        return Effect(Kind.NOOP)
    if is_fusion(bsym):
        return _fusion(bsym, outs, strides_of)
    sid = sym_id(bsym)
    args = tensor_args(bsym)
    first = args[0] if args else None
    if sid in VIEW_OPS and first is not None:
        return Effect(Kind.COMPUTE, tuple(_view(bsym, sid, first, o, strides_of) for o in outs))
    if sid == chunked_loss.SCALE and first is not None:  # writes its result over its input (``loss.scale``)
        return Effect(Kind.COMPUTE, (Output(outs[0], first.name, strides_of(first.name)),))
    if sid in RESHAPE_OPS and first is not None:
        new = layout.view_strides(shape(first), strides_of(first.name), shape(outs[0]))
        if new is None:
            return Effect(Kind.COMPUTE, (Output(outs[0], None, layout.contiguous_strides(shape(outs[0]))),))
        return Effect(Kind.COMPUTE, (Output(outs[0], first.name, new),))
    if sid == _CONTIGUOUS and first is not None:
        st = strides_of(first.name)
        if layout.is_contiguous(shape(first), st):
            return Effect(Kind.COMPUTE, (Output(outs[0], first.name, st),))
        return Effect(Kind.COMPUTE, (Output(outs[0], None, layout.contiguous_strides(shape(first))),))
    if sid == _TO and first is not None and _to_is_noop(bsym, first, outs[0]):
        return Effect(Kind.COMPUTE, (Output(outs[0], first.name, strides_of(first.name)),))
    if sid in COLLECTIVES:
        return _collective(bsym, sid, first, outs)
    category = Category.COMM_BUFFER if sid in PACKS else Category.TEMPORARY
    outputs = tuple(Output(o, None, _new_strides(sid, o, args, strides_of), category) for o in outs)
    return Effect(Kind.COMPUTE, outputs, _workspace(bsym, sid, args, strides_of), known=_known(bsym, sid))


def _known(bsym, sid: str) -> bool:
    executor = bsym.sym.executor
    name = getattr(executor, "name", None)
    return name is None or name in KNOWN_EXECUTORS or sid in PACKS


def _to_is_noop(bsym, first: TensorLike, out: TensorLike) -> bool:
    if bsym.kwargs.get("copy", False) or any(a is True for a in bsym.args[1:] if isinstance(a, bool)):
        return False
    return out.dtype == first.dtype and out.device == first.device


def _view(bsym, sid: str, base: TensorLike, out: TensorLike, strides_of: StridesOf) -> Output:
    if sid in WAITS:
        return Output(out, base.name, layout.contiguous_strides(shape(out)))
    return Output(out, base.name, _view_strides(bsym, sid, base, out, strides_of(base.name)))


def _view_strides(bsym, sid: str, base: TensorLike, out: TensorLike, st: layout.Strides) -> layout.Strides:
    in_shape, out_shape = shape(base), shape(out)
    if sid in _SAME_STRIDES:
        return st if len(st) == len(out_shape) else layout.contiguous_strides(out_shape)
    if bsym.sym.id == PrimIDs.BROADCAST_IN_DIM:
        return layout.broadcast_in_dim(in_shape, st, out_shape, bsym.args[2])
    if sid in _EXPANDS:
        return layout.expanded(in_shape, st, out_shape)
    if sid == _UNSQUEEZE:
        return layout.unsqueezed(in_shape, st, int(bsym.args[1]))
    if sid == _PERMUTE:
        dims = bsym.args[1] if len(bsym.args) == 2 and isinstance(bsym.args[1], Sequence) else bsym.args[1:]
        return layout.permuted(st, dims)
    if sid in _TRANSPOSES:
        d0, d1 = (int(bsym.args[1]), int(bsym.args[2])) if len(bsym.args) >= 3 else (-2, -1)
        out = list(st)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)
    if sid == SLICE:
        steps = bsym.args[3] if len(bsym.args) > 3 else bsym.kwargs.get("strides")
        return layout.sliced(st, steps)
    if sid in _SQUEEZES:
        if len(out_shape) < len(in_shape):
            keep = _dims_kept(in_shape, out_shape, bsym, sid)
            return tuple(st[d] for d in keep)
        return st
    viewed = layout.view_strides(in_shape, st, out_shape)
    return viewed if viewed is not None else layout.contiguous_strides(out_shape)


def _dims_kept(in_shape, out_shape, bsym, sid) -> list[int]:
    if sid in _SELECTS:
        dim = int(bsym.args[1]) if len(bsym.args) > 1 else 0
        dim %= len(in_shape)
        return [d for d in range(len(in_shape)) if d != dim]
    keep, j = [], 0
    for d, size in enumerate(in_shape):
        if j < len(out_shape) and size == out_shape[j] and (size != 1 or len(in_shape) - d == len(out_shape) - j):
            keep.append(d)
            j += 1
    return keep if len(keep) == len(out_shape) else list(range(len(out_shape)))


def _new_strides(sid: str, out: TensorLike, args: Sequence[TensorLike], strides_of: StridesOf) -> layout.Strides:
    out_shape = shape(out)
    if sid in ELEMENTWISE_OPS:
        for a in args:
            if isinstance(a, TensorProxy) and shape(a) == out_shape:
                return layout.dense_like(out_shape, strides_of(a.name))
    return layout.contiguous_strides(out_shape)


def _collective(bsym, sid: str, first: TensorLike | None, outs: Sequence[TensorLike]) -> Effect:
    out = outs[0]
    if sid == ALL_GATHER:
        category = Category.GATHERED_PARAMETER
    elif sid == REDUCE_SCATTER:
        category = Category.GRADIENT
    else:
        category = Category.COMM_BUFFER
    skip_clone = sid == ALL_REDUCE and bool(bsym.kwargs.get("skip_clone", len(bsym.args) > 4 and bsym.args[4]))
    if skip_clone and first is not None:
        return Effect(Kind.COMPUTE, (Output(out, first.name, layout.contiguous_strides(shape(out)), category),))
    return Effect(Kind.COMPUTE, (Output(out, None, layout.contiguous_strides(shape(out)), category),))


def _fusion(bsym, outs: Sequence[TensorLike], strides_of: StridesOf) -> Effect:
    """A fusion region allocates each output, except outputs that its subsymbols reach from one of the region's
    inputs through views alone (they alias that input) and outputs that are views of one internal buffer (they
    share one allocation of that buffer's size). Its workspace is what ``_region_workspace`` finds."""
    inputs = {a.name for a in tensor_args(bsym)}
    strides = {name: strides_of(name) for name in inputs}
    root = {name: name for name in inputs}
    size = {}
    _trace_views(bsym.subsymbols, strides, root, size)
    outputs: list[Output] = []
    first_of_root: dict[str, str] = {}
    for o in outs:
        r = root.get(o.name, o.name)
        st = strides.get(o.name) or layout.contiguous_strides(shape(o))
        if r in inputs and r != o.name:
            outputs.append(Output(o, r, st))
        elif r in first_of_root:
            outputs.append(Output(o, first_of_root[r], st))
        else:
            first_of_root[r] = o.name
            outputs.append(Output(o, None, st, nbytes=max(size.get(r, 0), nbytes(o))))
    allocated = {root.get(o.proxy.name, o.proxy.name): o.nbytes or nbytes(o.proxy) for o in outputs if o.base is None}
    return Effect(Kind.COMPUTE, tuple(outputs), _region_workspace(bsym.subsymbols, inputs, root, size, allocated))


def _region_workspace(subsymbols, inputs: set[str], root: dict, size: dict, allocated: dict[str, int]) -> int:
    """Bytes a fusion region holds while it runs beyond its outputs: the buffers its compiled program materializes
    and frees inside. A fusing compiler (Inductor, nvFuser) keeps chains of elementwise ops in registers, but a
    matmul is a kernel of its own: its result and each operand the region computes are buffers in memory, and so
    is a reduction's result. A value of a chain has no buffer: each kernel that reads it computes it again from
    the buffers it comes from, so a buffer lives from the subsymbol that makes it to the last one that reads it, a
    view of it, or a chain value computed from it (a softmax's scores until its gradient is computed from them).
    Outputs count from the subsymbol that makes them. The workspace is the most those buffers and the outputs made
    so far hold at one subsymbol, less all the outputs (which the region's effect counts already)."""
    made: dict[str, int] = {}
    born: dict[str, int] = {}
    for i, sub in enumerate(subsymbols):
        sid = sym_id(sub)
        if sid in MATMULS:
            for a in tensor_args(sub):
                r = root.get(a.name, a.name)
                if r not in inputs:
                    born.setdefault(r, made.get(r, i))
        for out in tensor_outputs(sub):
            r = root.get(out.name, out.name)
            made.setdefault(r, i)
            if r in allocated or (r == out.name and (sid in MATMULS or sid in REDUCTIONS)):
                born.setdefault(r, i)
    chain: dict[str, frozenset[str]] = {}  # a value without a buffer: the buffers and inputs it is computed from
    last: dict[str, int] = {}
    for i, sub in enumerate(subsymbols):
        reads: set[str] = set()
        for a in tensor_args(sub):
            r = root.get(a.name, a.name)
            reads |= chain.get(r, {r})
        for r in reads:
            last[r] = i
        for out in tensor_outputs(sub):
            r = root.get(out.name, out.name)
            if r == out.name and r not in born and r not in inputs:
                chain[r] = frozenset(reads)
    internal = {r: b for r, b in born.items() if r not in allocated}
    if not internal:
        return 0
    change = [0] * (len(subsymbols) + 1)  # bytes made (+) and freed (-) at each subsymbol
    for r, n in allocated.items():
        change[born.get(r, 0)] += n
    for r, b in internal.items():
        d = max(last.get(r, b), b)
        change[b] += size.get(r, 0)
        change[d + 1 if sym_id(subsymbols[d]) in MATMULS else d] -= size.get(r, 0)
    held = most = 0
    for delta in change:
        held += delta
        most = max(most, held)
    return max(0, most - sum(allocated.values()))


def storage_roots(subsymbols, inputs: Sequence[TensorLike]) -> dict[str, str]:
    """For each tensor a region's ``subsymbols`` make or read, the tensor whose storage it uses (itself where it is
    a new allocation), its inputs taken as contiguous: a view or a viewable reshape shares its base's root."""
    strides = {a.name: layout.contiguous_strides(shape(a)) for a in inputs}
    root = {a.name: a.name for a in inputs}
    _trace_views(subsymbols, strides, root, {})
    return root


def _trace_views(bsyms, strides: dict, root: dict, size: dict) -> None:
    """Follow views through a region's subsymbols: ``root[name]`` is the tensor whose storage ``name`` uses."""
    for sub in bsyms:
        outs = tensor_outputs(sub)
        if not outs:
            continue
        effect = classify(sub, lambda n: strides.get(n) or _unknown_strides(sub, n))
        if effect.kind is not Kind.COMPUTE:
            continue
        for out in effect.outputs:
            name = out.proxy.name
            strides[name] = out.strides
            if out.base is not None and out.base in root:
                root[name] = root[out.base]
            else:
                root[name] = name
                size[name] = nbytes(out.proxy)


def _unknown_strides(bsym, name: str) -> layout.Strides:
    for a in tensor_args(bsym):
        if a.name == name:
            return layout.contiguous_strides(shape(a))
    raise KeyError(name)


def _workspace(bsym, sid: str, args: Sequence[TensorLike], strides_of: StridesOf) -> int:
    if sid in chunked_loss.SYMBOLS:
        hidden, weight = bsym.args[0], bsym.args[1]
        return chunked_loss.workspace_bytes(
            _prod(shape(hidden)[:-1]),
            shape(weight)[0],
            bsym.args[chunked_loss.CHUNKS_ARG],
            weight_bytes=weight.dtype.bytes,
            softcap=bsym.args[chunked_loss.SOFTCAP_ARG] is not None,
            device_type=device.device_type(hidden) or "cpu",  # a meta trace: the device ``as_on`` names
        )
    if sid in MATMULS and len(args) >= 2:
        return _matmul_workspace(sid, args[0], args[1], strides_of)
    if sid in _SOFTMAXES and args:
        dtype = bsym.kwargs.get("dtype", bsym.args[2] if len(bsym.args) > 2 else None)
        if dtype is not None and _dtype_bytes(dtype) is not None and _dtype_bytes(dtype) != args[0].dtype.bytes:
            return nbytes(args[0]) // args[0].dtype.bytes * _dtype_bytes(dtype)
        return 0
    return 0


def _dtype_bytes(dtype) -> int | None:
    size = getattr(dtype, "bytes", None)
    if size is not None:
        return int(size)
    itemsize = getattr(dtype, "itemsize", None)
    return int(itemsize) if itemsize is not None else None


def _matmul_workspace(sid: str, a: TensorLike, b: TensorLike, strides_of: StridesOf) -> int:
    """Bytes of the operand copies ``torch.matmul`` makes before its mm/bmm (CompositeImplicit decomposition)."""
    sa, sb = shape(a), shape(b)
    sta, stb = strides_of(a.name), strides_of(b.name)
    if sid == _LINEAR:
        sb, stb = (sb[1], sb[0]) if len(sb) == 2 else sb, (stb[1], stb[0]) if len(stb) == 2 else stb
    if len(sa) <= 2 and len(sb) <= 2:
        return 0
    if len(sa) >= 3 and len(sb) <= 2:
        folded = layout.view_strides(sa, sta, (_prod(sa[:-1]), sa[-1]))
        return 0 if folded is not None else nbytes(a)
    if len(sb) >= 3 and len(sa) <= 2:
        return 0
    batch = _broadcast(sa[:-2], sb[:-2])
    total = 0
    for s, st, t in ((sa, sta, a), (sb, stb, b)):
        full = batch + s[-2:]
        exp_st = layout.expanded(s, st, full)
        if layout.view_strides(full, exp_st, (_prod(batch),) + s[-2:]) is None:
            total += _prod(full) * t.dtype.bytes
    return total


def _broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    return tuple(max(x, y) for x, y in zip(a, b))


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
