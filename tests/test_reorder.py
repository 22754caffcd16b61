"""reorder.reorder on small programs whose peaks are computed by hand: a trace in a bad order gets a better one,
the same results, and symbols whose order matters keep it."""

import thunder
import thunder.torch as ltorch
import torch
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor

from thunder_fsdp_mem.analysis import liveness
from thunder_fsdp_mem.passes import checks, reorder

KB256 = 256 * 256 * 4  # one float32 [256, 256] tensor


def two_branches(x):
    a = torch.exp(x)
    b = torch.sin(x)  # Thunder's order: both branches' big tensors are alive at once
    return a.sum() + b.sum()


def _execution_trace(fn, *args):
    jitted = thunder.jit(fn)
    jitted(*args)
    return thunder.last_traces(jitted)[-1]


def _peak(trace):
    return liveness.analyze(trace).peak_bytes


def test_a_branch_at_a_time_lowers_the_peak_by_one_tensor():
    x = torch.randn(256, 256)
    trace = _execution_trace(two_branches, x)
    # Thunder runs exp, sin, then the sums: x (the caller's), both branches' tensors and the first 4-byte sum are
    # alive while the first sum runs.
    assert _peak(trace) == 3 * KB256 + 4
    new, order = reorder.reorder(trace, _peak)
    # exp, its sum (exp's output freed), sin, its sum: at most x, one branch's tensor and the two sums.
    assert _peak(new) == 2 * KB256 + 2 * 4
    assert order in reorder.ORDERS
    checks.check_rewrite(trace, new)
    (got,), (want,) = new.python_callable()(x), trace.python_callable()(x)
    assert torch.equal(got, want)
    assert "reordered" in str(new)


def test_a_trace_no_order_improves_comes_back_as_it_was():
    def chain(x):
        return torch.exp(torch.sin(x)).sum()

    trace = _execution_trace(chain, torch.randn(256, 256))
    new, order = reorder.reorder(trace, _peak)
    assert new is trace and order == "as given"


_ex = OperatorExecutor("thunder_fsdp_mem_reorder_test_ex", version="0.1")
_log = []
_note = _ex.register_operator("note", meta=lambda a: TensorProxy(like=a), fn=lambda a: _log.append(a.sum()) or a)


def test_symbols_whose_order_matters_keep_it_in_every_schedule():
    # `note` belongs to an executor we do not know, like a collective it is pinned: whatever the schedule, the
    # two notes run in the trace's order, though no data joins them.
    def f(x):
        a = ltorch.exp(x)
        n1 = _note(ltorch.sin(x))
        n2 = _note(a)
        return ltorch.add(ltorch.sum(n1), ltorch.sum(n2))

    trace = thunder.trace()(f, torch.randn(8, 8))
    body = [b for b in trace.bound_symbols if b.sym.name not in ("unpack_trivial", "return")]
    notes = [i for i, b in enumerate(body) if b.sym.name == "note"]
    assert all(reorder.pinned(body[i]) for i in notes) and not reorder.pinned(body[0])
    preds = reorder._dependencies(body)
    for name in reorder.ORDERS:
        order = reorder._schedule(body, preds, name)
        assert sorted(order) == list(range(len(body)))
        placed = {i: k for k, i in enumerate(order)}
        assert placed[notes[0]] < placed[notes[1]], name
        assert all(placed[p] < placed[i] for i in range(len(body)) for p in preds[i]), name
