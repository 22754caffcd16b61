"""analyze() against hand-computed figures of small traces and against MemTracker running the same trace."""

import logging

import pytest
import thunder
import torch
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor, register_executor

from support import memtracker_peak
from thunder_fsdp_mem import Category, analyze

KB4 = 4096  # bytes of 1024 float32


def views_and_copies(a, w):
    b = a * 2  # new: 4 KiB
    d = b.view(32, 32).t()  # views of b
    e = d.reshape(1024)  # a transposed tensor cannot be viewed flat: a copy, 4 KiB
    x = torch.matmul(b.view(4, 16, 16), w)  # new: 4 KiB
    return e.sum() + x.sum()


def test_views_share_storage_and_copies_allocate():
    a, w = torch.randn(1024), torch.randn(16, 16)
    jf = thunder.jit(views_and_copies)
    jf(a, w)
    result = analyze(thunder.last_traces(jf)[-1])
    # By hand: a (4 KiB) + w (1 KiB) + b + e + x (4 KiB each), all alive at the matmul.
    assert result.peak_bytes == KB4 + 1024 + 3 * KB4
    assert result.peak_symbol == "matmul"
    assert result.timeline[0] == KB4 + 1024  # a and w, alive from the start: the caller passed them
    assert sum(a.nbytes for a in result.live_at_peak) == result.peak_bytes
    cats = result.bytes_by_category()
    assert cats[Category.INPUT] == KB4 + 1024
    assert cats[Category.TEMPORARY] == 3 * KB4
    # At the end only the inputs and the scalar result remain.
    assert result.final_bytes == KB4 + 1024 + 4
    assert memtracker_peak(jf, a, w, backward=False) == result.peak_bytes


def batched_matmul_of_a_permuted_operand(q, v):
    return torch.matmul(q, v.permute(0, 2, 3, 1)).sum()


def test_peak_inside_matmul_counts_the_operand_copy():
    q = torch.randn(2, 4, 8, 16)
    v = torch.randn(2, 8, 4, 16)
    jf = thunder.jit(batched_matmul_of_a_permuted_operand)
    jf(q, v)
    result = analyze(thunder.last_traces(jf)[-1])
    operand = 2 * 4 * 8 * 16 * 4
    out = 2 * 4 * 8 * 8 * 4
    # matmul reshapes the permuted v to (8, 16, 8): not a view, so torch copies it for the bmm.
    assert result.peak_bytes == 2 * operand + out + operand
    measured = memtracker_peak(jf, q, v, backward=False)
    assert measured == result.peak_bytes


def test_backward_frees_saved_tensors_as_it_goes():
    def f(x, w):
        return torch.tanh(x @ w).sum()

    x = torch.randn(64, 32)
    w = torch.randn(32, 16, requires_grad=True)
    jf = thunder.jit(f)
    jf(x, w).backward()
    backward = thunder.last_backward_traces(jf)[-1]
    result = analyze(backward)
    saved = [a for a in result.allocations if a.category is Category.SAVED]
    assert saved, "the tanh output is saved and arrives in saved_for_backward"
    assert all(a.end is not None for a in saved), "the backward frees what it was given once it is done with it"
    grads = [a for a in result.allocations if a.category is Category.GRADIENT]
    assert [a.nbytes for a in grads] == [32 * 16 * 4]


def test_non_trace_argument_is_a_type_error():
    with pytest.raises(TypeError, match="Thunder execution trace"):
        analyze(lambda x: x)


_ex = OperatorExecutor("thunder_fsdp_mem_test_ex", version="0.1")
register_executor(_ex)
_twice = _ex.register_operator("unknown_twice", meta=lambda a: TensorProxy(like=a), fn=lambda a: a * 2)


def test_unknown_symbol_allocates_its_outputs_and_is_logged_once(caplog):
    def f(a):
        return _twice(a) + 1

    a = torch.randn(256)
    jf = thunder.jit(f, executors=[_ex])
    jf(a)
    trace = thunder.last_traces(jf)[-1]
    with caplog.at_level(logging.WARNING, logger="thunder_fsdp_mem"):
        first = analyze(trace)
        analyze(trace)
    assert first.unknown_symbols == ("unknown_twice",)
    assert sum("unknown_twice" in r.getMessage() for r in caplog.records) <= 1
    # a + the op's output + the add's output, all 1 KiB, alive together at the add.
    assert first.peak_bytes == 3 * 1024


def softmax_in_float32(x):
    return torch.softmax(x, -1, dtype=torch.float32).sum()


def test_peak_inside_softmax_counts_the_converted_input():
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    jf = thunder.jit(softmax_in_float32)
    jf(x)
    result = analyze(thunder.last_traces(jf)[-1])
    # By hand: x (bf16) + its float32 copy inside softmax + the float32 result, at once.
    assert result.peak_bytes == 64 * 512 * (2 + 4 + 4)
    assert memtracker_peak(jf, x, backward=False) == result.peak_bytes
