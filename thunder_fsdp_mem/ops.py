"""What each bound symbol does to memory: which outputs are new allocations, which alias an input, and what
workspace the op allocates that the trace does not show.

Rules, by symbol id (the name Thunder's executors register):
- view ops (``unsqueeze``, ``expand``, ``permute``, ``split``, slicing, ``shallow_copy``, the wait of a
  collective...) alias their first tensor argument;
- ``reshape``-like ops alias when torch can view the input (see ``layout.view_strides``) and copy otherwise;
  ``to``/``contiguous`` alias when they change nothing;
- fusion regions (``TorchCompile*``, ``nvFusion*``) allocate their outputs, except outputs that their own
  subsymbols reach from an input through views alone;
- collectives allocate their result at the call (an all-gather's output exists from the all-gather on, not
  from the wait);
- every other symbol allocates its tensor outputs (the general rule). Symbols from executors this module does
  not know are reported once by name.

Workspace is modelled where an op materialises tensors it does not return: ``matmul``/``linear`` copying an
operand that cannot be viewed as the batched or folded shape, and ``softmax``/``log_softmax`` converting their
input to another dtype. (Thunder 0.2.7 shows the rest in the trace: on CPU it decomposes SDPA into ``matmul`` and
``softmax``, and ``cross_entropy`` into ``log_softmax`` and ``nll_loss``; on CUDA its sdpa executor calls the
memory-efficient or flash kernels, whose outputs it lists.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from thunder.core.prims import PrimIDs
from thunder.core.proxies import CollectionProxy, FutureTensorProxy, Proxy, TensorProxy

from thunder_fsdp_mem import layout
from thunder_fsdp_mem.categories import Category

TensorLike = TensorProxy | FutureTensorProxy


class Kind(Enum):
    COMPUTE = "compute"
    UNPACK = "unpack"
    DEL = "del"
    CLEAR = "clear"
    RETURN = "return"
    NOOP = "noop"


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
    kind: Kind
    outputs: tuple[Output, ...] = ()
    workspace: int = 0
    known: bool = True


# Outputs share the storage of the first tensor argument.
VIEW_OPS = frozenset(
    {
        "shallow_copy", "unsqueeze", "expand", "expand_as", "permute", "transpose", "t", "squeeze", "view",
        "view_as", "unflatten", "movedim", "select", "diagonal", "split", "tensor_split", "chunk", "unbind",
        "getitem", "torch_slice_prim_impl", "real", "imag", "narrow", "unfold", "detach", "alias",
        "update_aliases", "torch_wait_prim_impl", "broadcast_to", "swapaxes", "mT",
    }
)
# Outputs are views when torch can view the input, copies otherwise.
RESHAPE_OPS = frozenset({"reshape", "torch_prims_reshape_impl", "flatten", "reshape_as"})
# New tensors laid out like their (same-shaped) input: TensorIterator's preserve_format.
ELEMENTWISE_OPS = frozenset(
    {
        "to", "clone", "add", "sub", "mul", "true_divide", "div", "torch_div_prim_impl", "neg", "exp", "log",
        "erf", "tanh", "sigmoid", "where", "pow", "rsqrt", "sqrt", "abs", "gelu", "silu", "relu", "maximum",
        "minimum", "ge", "gt", "le", "lt", "eq", "ne", "logical_not", "reciprocal", "masked_fill", "sin", "cos",
        "type_as", "float", "bfloat16", "half", "log1p", "expm1", "clamp", "square", "bitwise_and", "bitwise_or",
    }
)
ALL_GATHER = "torch_all_gather_prim_impl"
REDUCE_SCATTER = "torch_reduce_scatter_prim_impl"
ALL_REDUCE = "torch_all_reduce_prim_impl"
BROADCAST = "torch_broadcast_prim_impl"
COLLECTIVES = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST})
WAITS = frozenset({"torch_wait_prim_impl"})
PACKS = frozenset({"torch_pack_prim_impl", "torch_pack_for_fsdp_prim_impl"})
UNPACK_IDS = frozenset(
    {
        PrimIDs.UNPACK_TRIVIAL, PrimIDs.UNPACK_SEQUENCE, PrimIDs.UNPACK_KEY, PrimIDs.UNPACK_ATTR,
        PrimIDs.UNPACK_DICT_KEY, PrimIDs.UNPACK_EMPTY_DICT, PrimIDs.UNPACK_ITER, PrimIDs.UNPACK_FUNCTION_OBJ,
        PrimIDs.UNPACK_CACHE_INFO, PrimIDs.UNPACK_BUFFER, PrimIDs.UNPACK_PARAMETER, PrimIDs.UNPACK_SUBMODULE,
        PrimIDs.UNPACK_THUNDER_MODULE,
    }
)
# Executors whose symbols follow torch's semantics op by op: the general rule is right for them.
KNOWN_EXECUTORS = frozenset({"torch", "python", "sdpa", "cudnn", "fa3", "custom_op"})

StridesOf = Callable[[str], layout.Strides]


def tensor_args(bsym) -> list[TensorLike]:
    return [a for a in bsym.flat_proxy_args if isinstance(a, (TensorProxy, FutureTensorProxy))]


def tensor_outputs(bsym) -> list[TensorLike]:
    return [o for o in bsym.flat_proxy_outs if isinstance(o, (TensorProxy, FutureTensorProxy))]


def nbytes(t: TensorLike) -> int:
    numel = 1
    for s in t.shape:
        numel *= int(s)
    return numel * t.dtype.bytes


def dtype_name(t) -> str:
    """Thunder's short name of the dtype of a proxy or of a torch tensor (``bf16``, ``f32``...), so that the report
    spells the dtypes of traced and held tensors alike."""
    dtype = t.dtype
    if isinstance(dtype, torch.dtype):
        from thunder.core.dtypes import to_dtype

        dtype = to_dtype(dtype)
    short = getattr(dtype, "shortname", None)
    return short() if callable(short) else str(dtype)


def shape(t: TensorLike) -> layout.Shape:
    # The stored shape: the ``shape`` property asks the compile data whether values are symbolic on every call.
    return tuple(int(s) for s in getattr(t, "_shape", None) or t.shape)


def dels_at_last_use(trace, *, clear_mutable_collections: bool = False):
    """``trace`` with its ``del``s dropped and placed again after each proxy's last use, as Thunder's
    ``del_last_used`` places them (same rule, same order), at a fraction of its cost: Thunder binds every new
    ``del`` through the symbol's signature, this copies one bound ``del``."""
    from collections import deque

    from thunder.core.prims import python_del
    from thunder.core.pytree import tree_flatten
    from thunder.core.trace import from_trace
    from thunder.executors.passes import clear_mutable_collection, comment_symbols

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


def is_copy_into(bsym) -> bool:
    """An in-place copy: it writes its destination argument, whose value then changes."""
    return bsym.sym.id == PrimIDs.COPY_ or sym_id(bsym) in ("copy_", "torch_copy__prim_impl")


def is_fusion(bsym) -> bool:
    return bool(getattr(bsym.sym, "is_fusion", False))


# Thunder prims that are views, by the name of the torch-executor op with the same semantics.
_PRIM_VIEWS = {
    PrimIDs.SLICE: "torch_slice_prim_impl",
    PrimIDs.BROADCAST_IN_DIM: "expand",
    PrimIDs.TRANSPOSE: "permute",
    PrimIDs.RESHAPE: "reshape",
    PrimIDs.VIEW: "view",
    PrimIDs.SQUEEZE: "squeeze",
    PrimIDs.SHALLOW_COPY: "shallow_copy",
}


def sym_id(bsym) -> str:
    """The op's name as this module's tables know it: the executor's id for executor symbols, the short name
    for ``thunder.torch`` symbols, the torch op with the same semantics for view prims."""
    sid = bsym.sym.id
    if isinstance(sid, str):
        return bsym.sym.name if sid.startswith("torch.") else sid
    return _PRIM_VIEWS.get(sid) or bsym.sym.name


def classify(bsym, strides_of: StridesOf) -> Effect:
    """The memory effect of ``bsym``. ``strides_of(name)`` gives the strides of a live tensor."""
    sid = bsym.sym.id
    if sid == PrimIDs.DEL:
        return Effect(Kind.DEL)
    if sid == PrimIDs.RETURN:
        return Effect(Kind.RETURN)
    if sid in UNPACK_IDS:
        return Effect(Kind.UNPACK)
    if sid == "clear_mutable_collection":
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
    if sid in RESHAPE_OPS and first is not None:
        new = layout.view_strides(shape(first), strides_of(first.name), shape(outs[0]))
        if new is None:
            return Effect(Kind.COMPUTE, (Output(outs[0], None, layout.contiguous_strides(shape(outs[0]))),))
        return Effect(Kind.COMPUTE, (Output(outs[0], first.name, new),))
    if sid == "contiguous" and first is not None:
        st = strides_of(first.name)
        if layout.is_contiguous(shape(first), st):
            return Effect(Kind.COMPUTE, (Output(outs[0], first.name, st),))
        return Effect(Kind.COMPUTE, (Output(outs[0], None, layout.contiguous_strides(shape(first))),))
    if sid == "to" and first is not None and _to_is_noop(bsym, first, outs[0]):
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
    if sid in ("shallow_copy", "detach", "alias", "update_aliases", "split", "tensor_split", "chunk"):
        return st if len(st) == len(out_shape) else layout.contiguous_strides(out_shape)
    if bsym.sym.id == PrimIDs.BROADCAST_IN_DIM:
        return layout.broadcast_in_dim(in_shape, st, out_shape, bsym.args[2])
    if sid in ("expand", "expand_as", "broadcast_to"):
        return layout.expanded(in_shape, st, out_shape)
    if sid == "unsqueeze":
        return layout.unsqueezed(in_shape, st, int(bsym.args[1]))
    if sid == "permute":
        dims = bsym.args[1] if len(bsym.args) == 2 and isinstance(bsym.args[1], Sequence) else bsym.args[1:]
        return layout.permuted(st, dims)
    if sid in ("transpose", "swapaxes", "t", "mT"):
        d0, d1 = (int(bsym.args[1]), int(bsym.args[2])) if len(bsym.args) >= 3 else (-2, -1)
        out = list(st)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)
    if sid == "torch_slice_prim_impl":
        steps = bsym.args[3] if len(bsym.args) > 3 else bsym.kwargs.get("strides")
        return layout.sliced(st, steps)
    if sid in ("squeeze", "select", "unbind"):
        if len(out_shape) < len(in_shape):
            keep = _dims_kept(in_shape, out_shape, bsym, sid)
            return tuple(st[d] for d in keep)
        return st
    viewed = layout.view_strides(in_shape, st, out_shape)
    return viewed if viewed is not None else layout.contiguous_strides(out_shape)


def _dims_kept(in_shape, out_shape, bsym, sid) -> list[int]:
    if sid in ("select", "unbind"):
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
    share one allocation of that buffer's size)."""
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
    return Effect(Kind.COMPUTE, tuple(outputs))


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
    if sid in ("matmul", "linear") and len(args) >= 2:
        return _matmul_workspace(sid, args[0], args[1], strides_of)
    if sid in ("softmax", "log_softmax") and args:
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
    if sid == "linear":
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


def proxy_names(obj) -> list[str]:
    """Names of the proxies in a (possibly nested) argument."""
    out: list[str] = []
    _walk(obj, out)
    return out


def _walk(obj, out: list[str]) -> None:
    if isinstance(obj, Proxy):
        out.append(obj.name)
        if isinstance(obj, CollectionProxy):
            return
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _walk(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out)
