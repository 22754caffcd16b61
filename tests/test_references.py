"""references.References: Python's reference counting over a trace's names, driven by hand on proxies, with the
bytes alive and the index where each storage is freed counted by hand."""

from thunder.core import devices, dtypes
from thunder.core.proxies import CollectionProxy, TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_fsdp_mem.analysis import layout
from thunder_fsdp_mem.analysis.timeline import InputSpec
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.references import References

SIZE = 4 * 2 * 4  # a (4, 2) float32 tensor


def _tensors(*names):
    with tracectx(TraceCtx()):
        return [TensorProxy(name=n, shape=(4, 2), dtype=dtypes.float32, device=devices.cpu) for n in names]


def test_a_storage_is_freed_where_its_last_reference_drops():
    refs = References({})
    (y,) = _tensors("y")
    refs.index = 1
    record = refs.allocate(y, Category.TEMPORARY, "exp", None)
    refs.add_tensor("y", record, layout.contiguous_strides((4, 2)))
    refs.add_tensor("v", record, (1, 4))  # a view of y: the same storage, counted once
    assert refs.live == SIZE
    refs.index = 2
    refs.drop("y")
    assert refs.live == SIZE and refs.records[record].end is None
    refs.index = 3
    refs.drop("v")
    assert refs.live == 0 and refs.records[record].end == 3
    assert refs.storage_of("v") is None


def test_inputs_of_one_storage_share_it_and_external_ones_are_never_freed():
    shared = InputSpec("weight", Category.PARAMETER, external=True)
    refs = References({"a": shared, "b": shared})
    a, b, c = _tensors("a", "b", "c")
    for t in (a, b, c):
        refs.bind(t, root=t.name)
    # a and b: one storage; c: the caller's input (a name without ``t_``), held by the caller too.
    assert [(r.name, r.category, r.external) for r in refs.records] == [
        ("a", Category.PARAMETER, True),
        ("c", Category.INPUT, True),
    ]
    assert refs.live == 2 * SIZE
    for name in ("a", "b", "c"):
        refs.drop(name)
    assert refs.live == 2 * SIZE and all(r.end is None for r in refs.records)


def test_a_cleared_saved_list_frees_the_members_no_name_holds():
    s0, s1 = _tensors("s0", "s1")
    with tracectx(TraceCtx()):
        saved = CollectionProxy([s0, s1], name="saved_for_backward")
    refs = References({})
    refs.bind(saved, root=saved.name)
    refs.bind(s0, root=saved.name)  # the backward unpacks s0 only
    assert [r.category for r in refs.records] == [Category.SAVED, Category.SAVED]
    assert refs.live == 2 * SIZE
    refs.index = 5
    refs.clear(refs.object_of["saved_for_backward"])
    assert refs.live == SIZE and [r.end for r in refs.records] == [None, 5]
    refs.index = 6
    refs.drop("s0")
    assert refs.live == 0 and [r.end for r in refs.records] == [6, 5]
    assert refs.keep("s0") is None  # a name deleted is no longer bound
