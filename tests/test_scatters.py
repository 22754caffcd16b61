"""scatters.schedule on a hand-built backward whose order is worked out by hand: each reduce-scatter moves up, with
the division that prepares its input, to where its gradient is complete, and is waited for in the window; the
results are those of the trace as it came (the ops of ``fake_collectives`` compute on one process). The same pass on
Thunder's own fsdp backward, on 2 gloo ranks, is in ``test_gathers.py`` (``gather_worker.py``)."""

import pytest
import thunder
import thunder.torch as ltorch
import torch

from fake_collectives import collectives, reduce_scatter, wait
from thunder_fsdp_mem.analysis.symbols import without_dels
from thunder_fsdp_mem.passes import checks, scatters


def backward_like(x, w1, w2):
    g1 = ltorch.matmul(x, w1)  # the first gradient is complete here
    h = ltorch.sin(ltorch.cos(x))
    g2 = ltorch.matmul(h, w2)
    f1 = reduce_scatter(ltorch.true_divide(g1, 2))  # Thunder issues every reduce-scatter at the end
    f2 = reduce_scatter(ltorch.true_divide(g2, 2))
    return wait(f1), wait(f2)


ARGS = (torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8))


@pytest.fixture(scope="module")
def trace():
    jitted = thunder.jit(backward_like, executors=[collectives, *thunder.get_default_executors()])
    jitted(*ARGS)
    return thunder.last_traces(jitted)[-1]


def _names(trace):
    return [b.sym.name for b in without_dels(trace.bound_symbols) if b.sym.name != "unpack_trivial"]


def test_each_reduce_scatter_is_issued_when_its_gradient_is_complete(trace):
    rs, w = "torch_reduce_scatter_prim_impl", "torch_wait_prim_impl"
    assert _names(trace) == [
        "matmul",
        "cos",
        "sin",
        "matmul",
        "true_divide",
        rs,
        "true_divide",
        rs,
        w,
        w,
        "python_return",
    ]
    new = scatters.schedule(trace, max_inflight=1)
    # By hand: the first division (cheap, read by the reduce-scatter alone) and reduce-scatter right after the
    # first gradient's matmul; with one in flight, the first is waited for just before the second is issued.
    assert _names(new) == [
        "matmul",
        "true_divide",
        rs,
        "cos",
        "sin",
        "matmul",
        w,
        "true_divide",
        rs,
        w,
        "python_return",
    ]
    checks.check_rewrite(trace, new, ordered=False)
    got, want = new.python_callable()(*ARGS), trace.python_callable()(*ARGS)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_no_room_leaves_a_reduce_scatter_where_it_was(trace):
    # Room for nothing anywhere: the reduce-scatters are issued where Thunder put them, the trace comes back as it was.
    new = scatters.schedule(trace, max_inflight=2, room=[0] * len(trace.bound_symbols))
    assert new is trace


def test_a_future_read_by_something_else_is_refused(trace):
    bsyms = without_dels(trace.bound_symbols)
    first = next(i for i, b in enumerate(bsyms) if b.sym.name == "torch_wait_prim_impl")
    cos = next(b for b in bsyms if b.sym.name == "cos")
    bsyms[first] = bsyms[first].from_bsym(sym=cos.sym)
    with pytest.raises(scatters.ScatterError, match="is not read by one wait"):
        scatters.match(bsyms)
