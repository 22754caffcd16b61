"""casts: the CPU tables checked against ATen on every 16-bit value, and folded traces that compute the bits the
traces they came from compute, with fewer casts and less memory."""

import dataclasses

import pytest
import thunder
import torch
from thunder.core.pytree import tree_flatten

from benchmarks.correctness.cast_check import UNARY_OPS, differ, every_value, small_lengths
from configs import BY_NAME
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.analysis import device
from thunder_fsdp_mem.analysis import symbols as ops
from thunder_fsdp_mem.analysis.step import estimate_traces
from thunder_fsdp_mem.passes import casts
from thunder_fsdp_mem.training import litgpt_models

TORCH_OPS = {
    **UNARY_OPS,
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "true_divide": torch.true_divide,
    "torch_div_prim_impl": torch.true_divide,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}
BINARY = ("add", "sub", "mul", "true_divide", "torch_div_prim_impl", "maximum", "minimum")
INEXACT = (1.4142135623730951, 0.42044820762685725, 1e-05)


def test_the_tables_built_from_thunder_hold_the_names_they_replaced():
    # The literal tables as they were before they were built from Thunder's objects (lightning-thunder 0.2.7).
    unary = {"neg", "abs", "exp", "expm1", "log", "log1p", "tanh", "sigmoid", "reciprocal", "cos"}
    both = unary | set(BINARY)
    assert casts.FOLDABLE == {
        "cuda": {"bf16": both | {"rsqrt", "erf", "sqrt", "sin"}, "f16": both | {"rsqrt", "erf", "sqrt", "sin"}},
        "cpu": {"bf16": both | {"sqrt", "sin"}, "f16": both},
    }
    divisor = {("true_divide", 1), ("torch_div_prim_impl", 1)}
    assert casts.INEXACT_NUMBER == {
        "cuda": divisor | {(op, i) for op in ("add", "sub", "mul") for i in (0, 1)},
        "cpu": divisor | {("mul", 1)},
    }
    assert casts._WITH_NUMBER == {"add", "sub", "mul", "true_divide", "torch_div_prim_impl"}
    assert casts._CASTS == {"to", "convert_element_type"}


@pytest.mark.parametrize("low, dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_the_cpu_tables_hold_for_every_value(low, dtype):
    # What the table lets fold computes the same bits in 16 bits as upcast, op, round, on this CPU as on every CPU
    # the table was built on. What it leaves out differs on some CPU (f16 sqrt on an AMD EPYC, not on an Intel
    # Xeon), so only the first direction holds everywhere.
    x = every_value(dtype, "cpu")
    pairs = x[torch.randint(0, x.numel(), (2, 1 << 20), generator=torch.Generator().manual_seed(0))]
    for name, f in TORCH_OPS.items():
        if name in BINARY:
            wrong = differ(f(pairs[0], pairs[1]), f(pairs[0].float(), pairs[1].float()).to(dtype))
        else:
            wrong = differ(f(x), f(x.float()).to(dtype))
        if name in casts.FOLDABLE["cpu"][low]:
            assert wrong == 0, (name, wrong)
    for name in ("add", "sub", "mul", "true_divide"):
        for position in (0, 1):

            def f(v, n):
                return TORCH_OPS[name](*((n, v) if position == 0 else (v, n)))

            wrong = sum(differ(f(x, n), f(x.float(), n).to(dtype)) for n in INEXACT)
            if (name, position) in casts.INEXACT_NUMBER["cpu"]:
                assert wrong == 0, (name, position, wrong)
            assert sum(differ(f(x, n), f(x.float(), n).to(dtype)) for n in (0.5, -2.0)) == 0


@pytest.mark.parametrize("low, dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_the_cpu_tables_hold_at_every_small_length_strided_and_broadcast(low, dtype):
    # ATen's CPU kernels run a vectorized body and a scalar tail: one large tensor checks the body only. Every
    # length from 1 to 67, contiguous, strided and an expanded view, binary ops also against a broadcast operand,
    # ops with a number with exact numbers and the inexact ones the table allows. CPU rsqrt, out of the table,
    # differs here (in about a third of the values): it is counted too, to show the check can fail.
    wrong = small_lengths("cpu", dtype, [*casts.FOLDABLE["cpu"][low], "rsqrt"], casts.INEXACT_NUMBER["cpu"])
    assert wrong.pop("rsqrt") > 0  # the check sees what took rsqrt out of the table
    assert {k: v for k, v in wrong.items() if v} == {}


def _gelu_product(x):
    return torch.nn.functional.gelu(x) * x  # Thunder: div by sqrt(2), erf, mul by 0.5, add 0.5, mul, mul


def _forward(f, x):
    """Thunder's forward trace of ``f`` (decomposed for autodiff: each bf16 op between casts)."""
    jitted = thunder.jit(f)
    jitted(x.requires_grad_())
    return thunder.last_traces(jitted)[-1]


def _casts(trace) -> int:
    return sum(ops.sym_id(b) == "to" for b in trace.bound_symbols)


def _same_bits(trace, folded, x) -> bool:
    want, got = tree_flatten(trace.python_callable()(x))[0], tree_flatten(folded.python_callable()(x))[0]
    return len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_gelu_chain_runs_in_bf16_with_the_same_bits():
    x = torch.randn(64, 256).to(torch.bfloat16)
    trace = _forward(_gelu_product, x)
    folded = casts.fold_casts(trace)
    # 14 casts: 6 ops, each between upcasts and a rounding. On CPU erf keeps its 2; the other 4 upcasts the
    # forward saves for backward stay (they are outputs of the trace); the other 8 casts go.
    assert _casts(trace) == 14 and _casts(folded) == 6
    assert _same_bits(trace, folded, x)  # the output and every tensor saved for backward
    assert estimate_traces(folded).peak_bytes < estimate_traces(trace).peak_bytes  # no float32 temporaries
    # On CUDA erf folds too, its saved upcast stays (not run here: the tensors are on the CPU).
    assert _casts(casts.fold_casts(trace, device_type="cuda")) == 5
    assert casts.fold_casts(folded) is folded  # nothing left to fold


def test_meta_traces_fold_as_on_says():
    trace = _forward(_gelu_product, torch.randn(64, 256, device="meta").to(torch.bfloat16))
    assert casts.fold_casts(trace) is trace  # a meta trace runs nowhere: no table
    with device.as_on("cpu"):
        assert _casts(casts.fold_casts(trace)) == 6
    with device.as_on("cuda"):
        assert _casts(casts.fold_casts(trace)) == 5


def test_an_inexact_number_first_in_a_product_is_left_between_casts_on_cpu():
    # torch.mul(0.42, x) on CPU rounds 0.42 to bf16 first (with it folded, the gradients of litgpt's attention
    # differed); torch.mul(x, 0.42) does not.
    x = torch.randn(64, 256).to(torch.bfloat16)
    for f, folds in (
        (lambda v: 0.42044820762685725 * v.exp(), False),
        (lambda v: v.exp() * 0.42044820762685725, True),
        (lambda v: 0.5 * v.exp(), True),
    ):
        trace = _forward(f, x)
        folded = casts.fold_casts(trace)
        assert (_casts(folded) < _casts(trace)) == folds
        assert _same_bits(trace, folded, x)


def test_the_transform_folds_and_keeps_every_bit():
    spec = dataclasses.replace(BY_NAME["neox"], n_layers=1)
    results = []
    for config in (
        None,
        MemoryConfig(rematerialize=False, reorder=False, chunk_loss=False, strict=True),
        MemoryConfig(fold_casts=False, chunk_loss=False, strict=True),
        MemoryConfig(chunk_loss=False, strict=True),
    ):
        model = litgpt_models.build(spec, dtype=torch.bfloat16)
        jitted = thunder.jit(model, transforms=[FSDPMemoryTransform(config)] if config else [])
        loss = jitted(*litgpt_models.batch(spec))
        loss.backward()
        traces = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
        results.append((loss.detach(), [p.grad for p in jitted.parameters()], traces))
    (loss, grads, plain), (_, _, folded), (_, _, remat), (_, _, both) = results
    for loss_t, grads_t, _ in results[1:]:
        assert torch.equal(loss, loss_t)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_t, strict=True))
    assert _casts(folded[0]) < _casts(plain[0]) and _casts(folded[1]) < _casts(plain[1])
    # Rematerialization makes the backward recompute upcasts the forward saved; their brackets fold in a second
    # pass, so nothing is left to fold.
    assert casts.fold_casts(remat[1]) is not remat[1]
    assert casts.fold_casts(both[1]) is both[1] and casts.fold_casts(both[0]) is both[0]
