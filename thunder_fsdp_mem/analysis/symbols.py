"""The vocabulary every module shares for reading Thunder execution traces: what a bound symbol is called, which
tensors it reads and writes, how big a tensor is, and where each name is defined and read.

- ``sym_id(bsym)``: the op's name as the tables of this package know it (the executor's id, or the short name of a
  ``thunder.torch`` symbol, or the torch op with a view prim's semantics); ``symbol_name(sym)``, the same of a
  Thunder symbol, and ``names(*syms)``, of several: every table of op names is built from Thunder's own objects
  (``names(ltorch.add, ltorch.sub)``), so that a release that renames or removes an op fails at import instead of
  never matching; a literal stays only where no Thunder object has the name, and says why.
- The op families: ``VIEW_OPS`` (Thunder's own set of symbols that return views, plus the executor ops and prims
  with the same semantics), ``RESHAPE_OPS``, ``ELEMENTWISE_OPS``, ``MATMULS``, ``REDUCTIONS``, the collectives and
  their waits, Thunder's attention kernels, the unpacks.
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

import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.prims import PrimIDs
from thunder.core.proxies import CollectionProxy, FutureTensorProxy, Proxy, TensorProxy
from thunder.executors import pythonex, sdpaex, torchex

from thunder_fsdp_mem.thunder_internals import view_symbol_names

TensorLike = TensorProxy | FutureTensorProxy
Shape = tuple[int, ...]


# Thunder prims that are views -> the op with the same semantics, by whose name the tables know them.
_PRIM_VIEWS = {
    PrimIDs.SLICE: torchex.slice_prim_impl,
    PrimIDs.BROADCAST_IN_DIM: ltorch.expand,
    PrimIDs.TRANSPOSE: ltorch.permute,
    PrimIDs.RESHAPE: ltorch.reshape,
    PrimIDs.VIEW: ltorch.view,
    PrimIDs.SQUEEZE: ltorch.squeeze,
    PrimIDs.SHALLOW_COPY: torchex.shallow_copy,
}


def symbol_name(sym) -> str:
    """The name the tables of this package know the Thunder symbol ``sym`` by (``sym_id`` of its bound symbols):
    the executor's id for executor ops (``torch_all_gather_prim_impl``), the short name for ``thunder.torch``
    symbols (``add`` for the id ``torch.add``), the op with the same semantics for view prims, the name of other
    prims."""
    sid = sym.id
    if isinstance(sid, str):
        return sym.name if sid.startswith("torch.") else sid
    view = _PRIM_VIEWS.get(sid)
    return sym.name if view is None else symbol_name(view)


def sym_id(bsym) -> str:
    """The op's name as this package's tables know it (``symbol_name`` of its symbol)."""
    return symbol_name(bsym.sym)


def names(*syms) -> frozenset[str]:
    """The names of Thunder's symbols ``syms`` (``symbol_name``): the tables are built from Thunder's own objects,
    so that a release that renames or removes an op fails at import, not by never matching."""
    return frozenset(symbol_name(s) for s in syms)


def registered(executor, *ids: str) -> frozenset[str]:
    """``ids``, each an op ``executor`` registers (a KeyError at import where it no longer does): for the ops
    Thunder registers with its torch executor from its list of torch functions, which no module attribute holds."""
    return names(*(executor.opmap[i] for i in ids))


# The torch executor registers its collectives where torch.distributed is available (the FSDP paths need it).
ALL_GATHER = symbol_name(torchex.all_gather_prim_impl)
REDUCE_SCATTER = symbol_name(torchex.reduce_scatter_prim_impl)
ALL_REDUCE = symbol_name(torchex.all_reduce_prim_impl)
BROADCAST = symbol_name(torchex.broadcast_prim_impl)
COLLECTIVES = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST})
WAIT = symbol_name(torchex.wait_prim_impl)
WAITS = frozenset({WAIT})
PACKS = names(torchex.pack_prim_impl, torchex.pack_for_fsdp_prim_impl)
CLEAR = pythonex.clear_mutable_collection.id  # compared with a symbol's id
SLICE = symbol_name(torchex.slice_prim_impl)
UPDATE_ALIASES = symbol_name(torchex.update_aliases)
MATMULS = names(ltorch.matmul, ltorch.linear)
# Reductions, whose results a fusing compiler writes to memory (the kernels that read them run after them).
_REDUCED = ("sum", "amax", "amin", "prod", "var", "var_mean", "argmax", "argmin")
REDUCTIONS = names(ltorch.mean, *(getattr(module, op) for module in (ltorch, prims) for op in _REDUCED))
# The forwards (with what backward needs) of Thunder's sdpa executor: the memory-efficient kernel's and the flash
# kernel's.
EFFICIENT_ATTENTION = symbol_name(sdpaex.sdpea_gradfwd)
FLASH_ATTENTION = symbol_name(sdpaex.sdpfa_gradfwd)

# Outputs share the storage of the first tensor argument: Thunder's own set of symbols that return views, and
# the executor ops with the same semantics that it does not list (the torch executor's slice, the wait of a
# collective, which returns the tensor its future holds, Thunder's alias bookkeeping). ``alias``, ``broadcast_to``
# and ``mT`` are torch's names, which no op of Thunder 0.2.6 or 0.2.7 bears (it traces ``broadcast_to`` as
# ``expand``, ``mT`` as a transpose prim): literals, kept from the first tables.
VIEW_OPS = view_symbol_names() | frozenset({SLICE, UPDATE_ALIASES, WAIT}) | frozenset({"alias", "broadcast_to", "mT"})
# Outputs are views when torch can view the input, copies otherwise.
RESHAPE_OPS = names(ltorch.reshape, torchex.torch_prims_reshape_impl, ltorch.flatten) | registered(
    torchex.ex, "reshape_as"
)
# New tensors laid out like their (same-shaped) input: TensorIterator's preserve_format. ``float``: no op of Thunder
# 0.2.6 or 0.2.7 bears the name (it traces ``Tensor.float()`` as ``convert_element_type``), kept from the first
# table.
ELEMENTWISE_OPS = (
    names(
        ltorch.to,
        ltorch.clone,
        ltorch.add,
        ltorch.sub,
        ltorch.mul,
        ltorch.true_divide,
        ltorch.div,
        torchex.div_prim_impl,
        ltorch.neg,
        ltorch.exp,
        ltorch.log,
        ltorch.erf,
        ltorch.tanh,
        ltorch.sigmoid,
        ltorch.where,
        ltorch.pow,
        ltorch.rsqrt,
        ltorch.sqrt,
        ltorch.abs,
        ltorch.gelu,
        ltorch.silu,
        ltorch.relu,
        ltorch.maximum,
        ltorch.minimum,
        ltorch.ge,
        ltorch.gt,
        ltorch.le,
        ltorch.lt,
        ltorch.eq,
        ltorch.ne,
        ltorch.logical_not,
        ltorch.reciprocal,
        ltorch.masked_fill,
        ltorch.sin,
        ltorch.cos,
        ltorch.type_as,
        ltorch.log1p,
        ltorch.expm1,
        ltorch.clamp,
        ltorch.square,
        ltorch.bitwise_and,
        ltorch.bitwise_or,
        ltorch.bitwise_xor,
        ltorch.bitwise_not,
        ltorch.triu,
        ltorch.tril,
    )
    | registered(torchex.ex, "bfloat16", "half")
    | frozenset({"float"})
)
# Reductions that add or multiply many values: their rounding follows the order the kernel accumulates in, which a
# fusion compiler chooses per region (Triton's block sizes and autotuned launch configurations, nvFuser's scheduler).
ACCUMULATING_OPS = names(
    ltorch.sum, ltorch.mean, ltorch.var, ltorch.var_mean, ltorch.prod, ltorch.cumsum, ltorch.cumprod
)
# In-place copies. ``torch_copy__prim_impl``: no op of Thunder 0.2.6 or 0.2.7 bears the name, kept from the first
# table.
_COPIES = names(ltorch.copy_) | frozenset({"torch_copy__prim_impl"})
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
    return bsym.sym.id == PrimIDs.COPY_ or sym_id(bsym) in _COPIES


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
