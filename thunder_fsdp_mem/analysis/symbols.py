"""The vocabulary every module shares for reading Thunder execution traces: what a bound symbol is called, which
tensors it reads and writes, how big a tensor is, and where each name is defined and read.

- ``sym_id(bsym)``: the op's name as the tables of this package know it (the executor's id, or the short name of a
  ``thunder.torch`` symbol, or the torch op with a view prim's semantics).
- The op families: ``VIEW_OPS`` (Thunder's own set of symbols that return views, plus the executor ops and prims
  with the same semantics), ``RESHAPE_OPS``, ``ELEMENTWISE_OPS``, the collectives and their waits, the unpacks.
- ``def_use(bsyms) -> DefUse``: which position defines each name and which positions read it, the one index the
  passes build (Thunder's ``producers``/``consumers`` map proxies to bound symbols; the passes need positions).
- ``without_dels(bsyms)``: a trace's symbols without its ``del``s (and collection clears), as every rewrite
  starts.

Nothing here depends on the rest of the package.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from thunder.core.prims import PrimIDs
from thunder.core.proxies import CollectionProxy, FutureTensorProxy, Proxy, TensorProxy

from thunder_fsdp_mem.thunder_internals import view_symbol_names

TensorLike = TensorProxy | FutureTensorProxy
Shape = tuple[int, ...]

ALL_GATHER = "torch_all_gather_prim_impl"
REDUCE_SCATTER = "torch_reduce_scatter_prim_impl"
ALL_REDUCE = "torch_all_reduce_prim_impl"
BROADCAST = "torch_broadcast_prim_impl"
COLLECTIVES = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST})
WAIT = "torch_wait_prim_impl"
WAITS = frozenset({WAIT})
PACKS = frozenset({"torch_pack_prim_impl", "torch_pack_for_fsdp_prim_impl"})
CLEAR = "clear_mutable_collection"

# Outputs share the storage of the first tensor argument: Thunder's own set of symbols that return views, and
# the executor ops with the same semantics that it does not list (the torch executor's slice, the wait of a
# collective, which returns the tensor its future holds, Thunder's alias bookkeeping, broadcast_to, mT).
VIEW_OPS = view_symbol_names() | frozenset(
    {"torch_slice_prim_impl", "alias", "update_aliases", WAIT, "broadcast_to", "mT"}
)
# Outputs are views when torch can view the input, copies otherwise.
RESHAPE_OPS = frozenset({"reshape", "torch_prims_reshape_impl", "flatten", "reshape_as"})
# New tensors laid out like their (same-shaped) input: TensorIterator's preserve_format.
ELEMENTWISE_OPS = frozenset(
    {
        "to",
        "clone",
        "add",
        "sub",
        "mul",
        "true_divide",
        "div",
        "torch_div_prim_impl",
        "neg",
        "exp",
        "log",
        "erf",
        "tanh",
        "sigmoid",
        "where",
        "pow",
        "rsqrt",
        "sqrt",
        "abs",
        "gelu",
        "silu",
        "relu",
        "maximum",
        "minimum",
        "ge",
        "gt",
        "le",
        "lt",
        "eq",
        "ne",
        "logical_not",
        "reciprocal",
        "masked_fill",
        "sin",
        "cos",
        "type_as",
        "float",
        "bfloat16",
        "half",
        "log1p",
        "expm1",
        "clamp",
        "square",
        "bitwise_and",
        "bitwise_or",
    }
)
# Reductions that add or multiply many values: their rounding follows the order the kernel accumulates in, which a
# fusion compiler chooses per region (Triton's block sizes and autotuned launch configurations, nvFuser's scheduler).
ACCUMULATING_OPS = frozenset({"sum", "mean", "var", "var_mean", "prod", "cumsum", "cumprod"})
UNPACK_IDS = frozenset(
    {
        PrimIDs.UNPACK_TRIVIAL,
        PrimIDs.UNPACK_SEQUENCE,
        PrimIDs.UNPACK_KEY,
        PrimIDs.UNPACK_ATTR,
        PrimIDs.UNPACK_DICT_KEY,
        PrimIDs.UNPACK_EMPTY_DICT,
        PrimIDs.UNPACK_ITER,
        PrimIDs.UNPACK_FUNCTION_OBJ,
        PrimIDs.UNPACK_CACHE_INFO,
        PrimIDs.UNPACK_BUFFER,
        PrimIDs.UNPACK_PARAMETER,
        PrimIDs.UNPACK_SUBMODULE,
        PrimIDs.UNPACK_THUNDER_MODULE,
    }
)
# Executors whose symbols follow torch's semantics op by op.
KNOWN_EXECUTORS = frozenset({"torch", "python", "sdpa", "sdpa_cudnn", "cudnn", "fa3", "custom_op", "fsdp_mem_loss"})

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
    """The op's name as this package's tables know it: the executor's id for executor symbols, the short name
    for ``thunder.torch`` symbols, the torch op with the same semantics for view prims."""
    sid = bsym.sym.id
    if isinstance(sid, str):
        return bsym.sym.name if sid.startswith("torch.") else sid
    return _PRIM_VIEWS.get(sid) or bsym.sym.name


def tensor_args(bsym) -> list[TensorLike]:
    return [a for a in bsym.flat_proxy_args if isinstance(a, (TensorProxy, FutureTensorProxy))]


def tensor_outputs(bsym) -> list[TensorLike]:
    return [o for o in bsym.flat_proxy_outs if isinstance(o, (TensorProxy, FutureTensorProxy))]


def shape(t: TensorLike) -> Shape:
    # The stored shape: the ``shape`` property asks the compile data whether values are symbolic on every call.
    return tuple(int(s) for s in getattr(t, "_shape", None) or t.shape)


def numel(t: TensorLike) -> int:
    """Elements of a tensor proxy."""
    n = 1
    for s in shape(t):
        n *= s
    return n


def nbytes(t: TensorLike) -> int:
    """Bytes of a tensor proxy: ``numel * itemsize``."""
    return numel(t) * t.dtype.bytes


def dtype_name(t) -> str:
    """Thunder's short name of the dtype of a proxy or of a torch tensor (``bf16``, ``f32``...), so that traced and
    held tensors are spelled alike."""
    dtype = t.dtype
    if isinstance(dtype, torch.dtype):
        from thunder.core.dtypes import to_dtype

        dtype = to_dtype(dtype)
    short = getattr(dtype, "shortname", None)
    return short() if callable(short) else str(dtype)


def is_fusion(bsym) -> bool:
    return bool(getattr(bsym.sym, "is_fusion", False))


def accumulates(bsym) -> bool:
    """True if ``bsym`` or a symbol it is made of is an accumulating reduction (``ACCUMULATING_OPS``)."""
    return sym_id(bsym) in ACCUMULATING_OPS or any(accumulates(s) for s in bsym.subsymbols)


def is_copy_into(bsym) -> bool:
    """An in-place copy: it writes its destination argument, whose value then changes."""
    return bsym.sym.id == PrimIDs.COPY_ or sym_id(bsym) in ("copy_", "torch_copy__prim_impl")


def is_del(bsym, *, clears: bool = True) -> bool:
    """A ``del`` (or, with ``clears``, a ``clear_mutable_collection``): what frees names, placed by rule."""
    return bsym.sym.id == PrimIDs.DEL or (clears and bsym.sym.id == CLEAR)


def without_dels(bsyms: Iterable, *, clears: bool = True) -> list:
    """The symbols of a trace without its ``del``s (and collection clears, with ``clears``): what a rewrite
    reorders or edits before the ``del``s are placed again."""
    return [b for b in bsyms if not is_del(b, clears=clears)]


_THUNDERFX_PARAMETER = re.compile(r"^l_self_(?:modules_)?(.+?)_parameters_(\w+?)_$")


def parameter_path(name: str, names: Mapping[str, str] | None = None) -> str | None:
    """The qualified name of the parameter a trace argument is (``transformer.h.3.mlp.fc.weight``), or None:
    from ``names`` (trace name -> qualified name, where the module is known: ``thunder.jit`` names a parameter
    ``t_`` + its qualified name with ``_`` for ``.``, which cannot be read back), else from the name ThunderFX
    gives a graph's parameter (``l_self_modules_attn_modules_qkv_parameters_weight_``: ``attn.qkv.weight``)."""
    if names is not None and name in names:
        return names[name]
    found = _THUNDERFX_PARAMETER.match(name)
    if found is None:
        return None
    return ".".join([*found.group(1).split("_modules_"), found.group(2)])


def proxy_names(obj) -> list[str]:
    """Names of the proxies in a (possibly nested) argument; a collection is one name."""
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


@dataclass(frozen=True, slots=True)
class DefUse:
    """Where each name is defined and read in a list of bound symbols, by position.

    ``producer[name]``: the first symbol that outputs ``name``; ``readers[name]``: every position that reads it, in
    order, once per read (a symbol that reads a name twice is listed twice)."""

    producer: Mapping[str, int]
    readers: Mapping[str, tuple[int, ...]]

    def first_reader(self, name: str, default: int | None = None) -> int | None:
        found = self.readers.get(name)
        return found[0] if found else default

    def last_reader(self, name: str, default: int | None = None) -> int | None:
        found = self.readers.get(name)
        return found[-1] if found else default

    def uses(self, name: str) -> int:
        return len(self.readers.get(name, ()))


def def_use(bsyms: Sequence) -> DefUse:
    """The ``DefUse`` index of ``bsyms`` (one pass)."""
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, b in enumerate(bsyms):
        for a in b.flat_proxy_args:
            readers.setdefault(a.name, []).append(i)
        for o in b.flat_proxy_outs:
            producer.setdefault(o.name, i)
    return DefUse(producer, {name: tuple(at) for name, at in readers.items()})
