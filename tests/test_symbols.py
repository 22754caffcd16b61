"""symbols: the trace vocabulary every module shares, against hand-counted traces and Thunder's own tables."""

import thunder
import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.prims import PrimIDs
from thunder.core.symbol import Symbol
from thunder.distributed import prims as distributed_prims
from thunder.executors.passes import del_last_used
from thunder.extend import get_all_executors

from thunder_fsdp_mem.analysis import cost, effects, provenance, symbols, timeline
from thunder_fsdp_mem.loss import operator as loss_operator
from thunder_fsdp_mem.passes import casts, mincut
from thunder_fsdp_mem.training import cudnn_attention


def square_of_exp(x):
    a = ltorch.exp(x)
    return ltorch.sum(ltorch.mul(a, a))


def test_def_use_lists_each_read_at_its_position():
    trace = thunder.trace()(square_of_exp, torch.randn(4, 8))
    # unpack x (0), exp (1), mul (2), sum (3), return (4)
    assert [b.sym.name for b in trace.bound_symbols] == ["unpack_trivial", "exp", "mul", "sum", "python_return"]
    x, a = trace.bound_symbols[0].output.name, trace.bound_symbols[1].output.name
    index = symbols.def_use(trace.bound_symbols)
    assert index.producer[a] == 1
    assert index.readers[a] == (2, 2)  # mul reads it twice
    assert index.uses(a) == 2 and index.first_reader(a) == 2 and index.last_reader(a) == 2
    assert index.readers[x] == (1,)
    assert index.last_reader("no such name", -1) == -1


def test_without_dels_drops_what_del_last_used_added():
    trace = thunder.trace()(square_of_exp, torch.randn(4, 8))
    with_dels = del_last_used(trace)
    dels = [b for b in with_dels.bound_symbols if b.sym.id == PrimIDs.DEL]
    assert dels  # Thunder placed some
    assert symbols.without_dels(with_dels.bound_symbols) == list(trace.bound_symbols)


def test_sizes_shapes_and_names_by_hand():
    trace = thunder.trace()(square_of_exp, torch.randn(4, 8, dtype=torch.bfloat16))
    a = trace.bound_symbols[1].output
    assert symbols.shape(a) == (4, 8)
    assert symbols.nbytes(a) == 4 * 8 * 2
    assert symbols.dtype_name(a) == "bf16"
    assert symbols.dtype_name(torch.empty(2, dtype=torch.float32)) == "f32"  # held tensors are spelled alike
    assert symbols.sym_id(trace.bound_symbols[1]) == "exp"  # a thunder.torch symbol by its short name


def test_view_ops_are_thunders_and_the_waits():
    # Thunder's own set of symbols that return views is taken as it is; a collective's wait returns a view too.
    assert {s.name for s in ltorch._syms_returning_views} <= symbols.VIEW_OPS
    assert symbols.WAIT in symbols.VIEW_OPS
    assert not {"reshape", "contiguous", "to"} & symbols.VIEW_OPS  # views only where torch can view: RESHAPE_OPS


def test_view_prims_are_named_for_the_torch_op_with_their_semantics():
    def f(x):
        return thunder.prims.broadcast_in_dim(x, (3, 4, 8), (1, 2))

    trace = thunder.trace()(f, torch.randn(4, 8))
    prim = next(b for b in trace.bound_symbols if b.sym.id == PrimIDs.BROADCAST_IN_DIM)
    assert symbols.sym_id(prim) == "expand"


def test_proxy_names_walk_nested_arguments():
    trace = thunder.trace()(square_of_exp, torch.randn(4, 8))
    a = trace.bound_symbols[1].output
    assert symbols.proxy_names({"k": [a, (a, 3)], "n": None}) == [a.name, a.name]


def test_accumulating_reductions_are_found_inside_composite_symbols():
    def f(x):
        return ltorch.softmax(x, -1), ltorch.amax(x, -1), ltorch.exp(x), ltorch.var_mean(x, -1)

    trace = thunder.trace()(f, torch.randn(4, 8))
    by_name = {b.sym.name: symbols.accumulates(b) for b in trace.bound_symbols}
    assert by_name["_softmax"] and "sum" not in by_name  # the sum is inside softmax's own symbols
    assert by_name["var_mean"]
    assert not by_name["amax"] and not by_name["exp"]  # a maximum is exact in any order; exp is elementwise


def test_the_tables_built_from_thunder_hold_the_names_they_replaced():
    # The literal tables as they were before they were built from Thunder's objects (lightning-thunder 0.2.7).
    assert symbols.COLLECTIVES == {
        "torch_all_gather_prim_impl",
        "torch_reduce_scatter_prim_impl",
        "torch_all_reduce_prim_impl",
        "torch_broadcast_prim_impl",
    }
    assert (
        symbols.ALL_GATHER == "torch_all_gather_prim_impl"
        and symbols.REDUCE_SCATTER == "torch_reduce_scatter_prim_impl"
    )
    assert symbols.WAITS == {"torch_wait_prim_impl"}
    assert symbols.PACKS == {"torch_pack_prim_impl", "torch_pack_for_fsdp_prim_impl"}
    assert symbols.CLEAR == "clear_mutable_collection"
    assert symbols.MATMULS == {"matmul", "linear"}
    assert {symbols.EFFICIENT_ATTENTION, symbols.FLASH_ATTENTION} == {
        "sdpaex_grad_forward_scaled_dot_product_efficient_attention",
        "sdpafx_grad_forward_scaled_dot_product_efficient_attention",
    }
    extra_views = {"torch_slice_prim_impl", "alias", "update_aliases", "torch_wait_prim_impl", "broadcast_to", "mT"}
    assert symbols.VIEW_OPS == symbols.view_symbol_names() | extra_views
    assert symbols.RESHAPE_OPS == {"reshape", "torch_prims_reshape_impl", "flatten", "reshape_as"}
    assert symbols.ACCUMULATING_OPS == {"sum", "mean", "var", "var_mean", "prod", "cumsum", "cumprod"}
    assert symbols._COPIES == {"copy_", "torch_copy__prim_impl"}
    assert symbols.ELEMENTWISE_OPS == set(
        "to clone add sub mul true_divide div torch_div_prim_impl neg exp log erf tanh sigmoid where pow rsqrt sqrt "
        "abs gelu silu relu maximum minimum ge gt le lt eq ne logical_not reciprocal masked_fill sin cos type_as "
        "float bfloat16 half log1p expm1 clamp square bitwise_and bitwise_or bitwise_xor bitwise_not triu tril".split()
    )
    prim_views = {prim: symbols.symbol_name(op) for prim, op in symbols._PRIM_VIEWS.items()}
    assert prim_views == {
        PrimIDs.SLICE: "torch_slice_prim_impl",
        PrimIDs.BROADCAST_IN_DIM: "expand",
        PrimIDs.TRANSPOSE: "permute",
        PrimIDs.RESHAPE: "reshape",
        PrimIDs.VIEW: "view",
        PrimIDs.SQUEEZE: "squeeze",
        PrimIDs.SHALLOW_COPY: "shallow_copy",
    }


# The names the tables keep as literals though no op of this Thunder bears them (``sym_id`` never gives them), each
# with a comment where it stands; checked absent, so that a Thunder that brings one in makes this list change.
UNMATCHED = {"alias", "broadcast_to", "mT", "float", "torch_copy__prim_impl", "broadcast_in_dim", "_log_softmax"}


def _thunder_op_names() -> frozenset[str]:
    """Every name ``sym_id`` gives a symbol of Thunder's: ``thunder.torch``'s, the prims (and the distributed
    ones), the ops of every registered executor (the package's own loss and attention executors among them)."""
    assert loss_operator.loss_ex.name in {ex.name for ex in get_all_executors()}
    assert cudnn_attention.cudnn_attention_ex.name in {ex.name for ex in get_all_executors()}
    found = [s for module in (ltorch, prims, distributed_prims) for s in vars(module).values() if isinstance(s, Symbol)]
    found += [s for ex in get_all_executors() for s in ex.opmap.values()]
    return symbols.names(*found)


def _tables() -> dict[str, frozenset[str]]:
    """The package's tables of op names, and the single names it compares with, by where they stand."""
    families = "COLLECTIVES WAITS PACKS MATMULS VIEW_OPS RESHAPE_OPS ELEMENTWISE_OPS ACCUMULATING_OPS _COPIES"
    tables = {f"symbols.{name}": getattr(symbols, name) for name in families.split()}
    tables["symbols._PRIM_VIEWS"] = symbols.names(*symbols._PRIM_VIEWS.values())
    tables["symbols (one op)"] = frozenset(
        {symbols.CLEAR, symbols.SLICE, symbols.UPDATE_ALIASES, symbols.EFFICIENT_ATTENTION, symbols.FLASH_ATTENTION}
    )
    for device_type, by_dtype in casts.FOLDABLE.items():
        for low, ops in by_dtype.items():
            tables[f"casts.FOLDABLE[{device_type}][{low}]"] = ops
    for device_type, pairs in casts.INEXACT_NUMBER.items():
        tables[f"casts.INEXACT_NUMBER[{device_type}]"] = frozenset(op for op, _ in pairs)
    tables["casts._WITH_NUMBER"], tables["casts._CASTS"] = casts._WITH_NUMBER, casts._CASTS
    for name in "_SAME_STRIDES _EXPANDS _TRANSPOSES _SQUEEZES _SELECTS _SOFTMAXES".split():
        tables[f"effects.{name}"] = getattr(effects, name)
    tables["effects (one op)"] = frozenset(
        {effects._CONTIGUOUS, effects._TO, effects._LINEAR, effects._UNSQUEEZE, effects._PERMUTE}
    )
    for name in "RECOMPUTABLE_OPS _ALLOCATING PRICED_OPS".split():
        tables[f"mincut.{name}"] = getattr(mincut, name)
    tables["mincut (one op)"] = frozenset({mincut._MATMUL})
    tables["cost.ATTENTION"], tables["cost._NO_KERNEL"] = cost.ATTENTION, cost._NO_KERNEL
    for name in "_MOVES _SHAPES _NO_CODE _IN_TRANSIT".split():
        tables[f"provenance.{name}"] = getattr(provenance, name)
    tables["timeline._HEAD_OPS"] = timeline._HEAD_OPS
    return tables


def test_every_table_of_op_names_holds_names_thunder_gives_its_ops():
    known = _thunder_op_names()
    assert not UNMATCHED & known  # a Thunder op bears one now: its table's comment, and this list, must change
    for where, table in _tables().items():
        assert table, where
        assert table <= known | UNMATCHED, (where, sorted(table - known - UNMATCHED))
