"""mincut.plan_saved / plan_rewrite.apply_plan on a small hand-checked program: what Thunder saves, what the cut saves
instead (figures computed by hand), and that the rewritten pair runs to the same results."""

import pytest
import thunder
import thunder.torch as ltorch
import torch
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor

from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.analysis.cost import op_traffic
from thunder_fsdp_mem.analysis.symbols import is_copy_into, is_fusion
from thunder_fsdp_mem.passes import checks, mincut, plan_rewrite
from thunder_fsdp_mem.passes.driver import Outcome
from thunder_fsdp_mem.predict.emulate import plan_step
from thunder_fsdp_mem.training import litgpt_models


def f(x, w):
    y = x @ w  # bf16 [8, 32]: a matmul, never recomputed
    z = torch.tanh(y.float())  # float32 [8, 32]: what Thunder saves for tanh's backward
    return (z * 2).to(torch.bfloat16).sum()


@pytest.fixture(scope="module")
def traces():
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    jitted = thunder.jit(f)
    jitted(x, w).backward()
    return thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1], x, w


def test_the_cut_saves_the_bf16_matmul_output_instead_of_the_float32_tanh(traces):
    forward, _, _, _ = traces
    today = {t.name: t for t in mincut.saved_tensors(forward)}
    (tanh_out,) = [t for n, t in today.items() if n not in ("x", "w")]
    assert tanh_out.dtype.bytes == 4 and tuple(tanh_out.shape) == (8, 32)
    plan = mincut.plan_saved(forward)
    assert plan.before_bytes == 8 * 32 * 4  # the float32 tanh output
    assert plan.after_bytes == 8 * 32 * 2  # the bf16 matmul output
    symbols = forward.bound_symbols
    (matmul_out,) = [n for n in plan.saved if n not in ("x", "w")]
    assert any(b.sym.name == "matmul" and b.output.name == matmul_out for b in symbols)
    assert sorted(symbols[i].sym.name for i in plan.recompute) == ["tanh", "to"]


def test_recompute_traffic_is_what_a_kernel_reads_and_writes(traces):
    forward, _, _, _ = traces
    by_name = {b.sym.name: op_traffic(b) for b in forward.bound_symbols}
    assert by_name["to"] == 8 * 32 * (2 + 4)  # reads the bf16 matmul output, writes float32
    assert by_name["tanh"] == 8 * 32 * (4 + 4)
    reshape = thunder.trace()(lambda a: ltorch.reshape(a, (16,)), torch.randn(4, 4)).bound_symbols
    assert [op_traffic(b) for b in reshape if b.sym.name == "reshape"] == [0]  # a view


def test_a_weight_on_traffic_saves_what_is_dear_to_recompute(traces):
    # Saving the bf16 matmul output (512 bytes) means recomputing to and tanh (3584 bytes of traffic); saving
    # the float32 tanh output (1024 bytes) means recomputing nothing. The first wins while 512 + w * 3584 < 1024,
    # that is for w < 1/7.
    forward, _, _, _ = traces
    cheap = mincut.plan_saved(forward, recompute_weight=0.1)
    assert (cheap.after_bytes, cheap.traffic_bytes) == (512, 3584)
    assert cheap == mincut.plan_saved(forward)
    dear = mincut.plan_saved(forward, recompute_weight=0.2)
    assert (dear.after_bytes, dear.traffic_bytes, dear.changes) == (1024, 0, False)


def test_a_repeated_cheap_symbol_runs_once_and_its_readers_read_the_first():
    def g(a):
        return ltorch.to(a, torch.float32) * 2 + ltorch.to(a, torch.float32)

    a = torch.randn(4, 4, dtype=torch.bfloat16)
    trace = thunder.trace()(g, a)
    kept = plan_rewrite._drop_repeats(list(trace.bound_symbols))
    assert [b.sym.name for b in trace.bound_symbols].count("to") == 2
    assert [b.sym.name for b in kept].count("to") == 1
    deduped = thunder.core.trace.from_trace(trace)
    deduped.bound_symbols = kept
    checks.check_program(deduped)
    (cast,) = [b.output.name for b in kept if b.sym.name == "to"]
    mul, add = [b for b in kept if b.sym.name in ("mul", "add")]
    assert mul.args[0].name == cast and add.args[1].name == cast  # both readers read the one cast


def test_a_repeated_symbol_the_trace_returns_is_kept():
    # Two gradients computed the same way, as the output biases' under a float32 parallel residual: both are
    # returned, so both stay and the return is unchanged; a third repeat, which nothing returns, reads the first.
    def g(a):
        return ltorch.sum(a, (0, 1)), ltorch.sum(a, (0, 1)), ltorch.sum(a, (0, 1)) * 2

    trace = thunder.trace()(g, torch.randn(2, 4, 8))
    kept = plan_rewrite._drop_repeats(list(trace.bound_symbols))
    deduped = thunder.core.trace.from_trace(trace)
    deduped.bound_symbols = kept
    checks.check_program(deduped)
    checks.check_same_result(trace, deduped)
    assert [b.sym.name for b in kept].count("sum") == 2


@pytest.mark.parametrize("shard", ["zero2", "zero3"])
def test_float32_under_thunder_fsdp_keeps_each_gradient_its_own_reduce_scatter(shard):
    # pythia-14m in float32 (a parallel residual: the attention's and the MLP's output-bias gradients are computed
    # alike, each divided and reduce-scattered apart), traced on the meta device over 2 fake ranks. Dropping the
    # second division as a repeat reduce-scattered the first twice: the checks refused the rematerialization, and
    # under ZeRO3 the all-gathers after it.
    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=64)
    options = dict(mode="thunder-fsdp", shard=shard, world_size=2, device_type="cpu", dtype=torch.float32)
    _, transform = plan_step(spec, MemoryConfig(strict=True), **options)  # strict: a refusal raises
    done = {r.pass_name: r.outcome for r in transform.rewrites}
    assert done["rematerialization"] is Outcome.APPLIED and done["all-gathers"] is Outcome.APPLIED


def test_the_rewritten_pair_passes_the_checks_and_computes_the_same_gradients(traces):
    forward, backward, x, w = traces
    new_forward, new_backward = plan_rewrite.apply_plan(forward, backward, mincut.plan_saved(forward))
    checks.check_rewrite(forward, new_forward, ignore_saved=True)
    checks.check_rewrite(backward, new_backward)

    def run(fw, bw):
        out, (saved, other) = fw.python_callable()(x.detach(), w.detach())
        return out["output"], bw.python_callable()([list(saved), list(other)], [torch.ones((), dtype=torch.bfloat16)])

    (loss,), grads = run(forward, backward)
    (loss_t,), grads_t = run(new_forward, new_backward)
    assert torch.equal(loss, loss_t)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_t)) and len(grads) == 2


def test_the_tables_built_from_thunder_hold_the_names_they_replaced():
    # The literal names as they were before they were built from Thunder's objects (lightning-thunder 0.2.7).
    factories = {"arange", "full", "full_like", "ones", "ones_like", "zeros", "zeros_like"}
    cheap = set(
        "convert_element_type broadcast_in_dim cat torch_pad_prim_impl pad bool float half bfloat16 double sum "
        "var_mean mean var amax amin prod contiguous softmax _softmax log_softmax _log_softmax".split()
    )
    elementwise, views = mincut.ELEMENTWISE_OPS, mincut.VIEW_OPS
    assert mincut.RECOMPUTABLE_OPS == elementwise | (views - mincut.WAITS) | mincut.RESHAPE_OPS | factories | cheap
    assert mincut._ALLOCATING == (elementwise - views - {"to", "type_as"}) | factories
    assert mincut.PRICED_OPS == mincut.MATMULS | mincut.ATTENTION | {"embedding"}
    assert mincut._MATMUL == "matmul"


_ex = OperatorExecutor("thunder_fsdp_mem_recompute_test_ex", version="0.1")
_opaque = _ex.register_operator("opaque_twice", meta=lambda a: TensorProxy(like=a), fn=lambda a: a * 2)


def test_only_cheap_deterministic_ops_are_recomputable():
    def g(a, b):
        return ltorch.matmul(ltorch.tanh(ltorch.to(a, torch.float32)), b), _opaque(a)

    trace = thunder.trace()(g, torch.randn(4, 4), torch.randn(4, 4))
    by_name = {b.sym.name: mincut.recomputable(b) for b in trace.bound_symbols if b.sym.name != "return"}
    assert by_name["tanh"] and by_name["to"]
    assert not by_name["matmul"]
    assert not by_name["opaque_twice"]  # a symbol we do not know is never recomputed


def test_a_rewrite_that_reads_a_deleted_tensor_fails_the_check(traces):
    forward, _, _, _ = traces
    bsyms = list(forward.bound_symbols)
    delete_at = next(i for i, b in enumerate(bsyms) if b.sym.id == PrimIDs.DEL)
    broken = thunder.core.trace.from_trace(forward)
    # the del moved above the symbol before it, which reads the deleted tensor
    broken.bound_symbols = [*bsyms[: delete_at - 1], bsyms[delete_at], bsyms[delete_at - 1], *bsyms[delete_at + 1 :]]
    with pytest.raises(checks.CheckError, match="after its del"):
        checks.check_program(broken)


def test_only_a_matmul_that_expands_its_arguments_is_recomputed_without_a_price():
    q = torch.randn(1, 2, 64, 8)  # attention's scores: (64, 64) per head from (64, 8) and (8, 64): 4x
    scores = thunder.trace()(lambda a, b: ltorch.matmul(a, b), q, q.mT).bound_symbols[-2]
    assert scores.sym.name == "matmul" and mincut.expanding(scores) and not mincut.recomputable(scores)
    narrower = thunder.trace()(lambda a, b: ltorch.matmul(a, b), q[..., :60, :], q.mT).bound_symbols[-2]
    assert not mincut.expanding(narrower)  # 60 x 64 outputs from 60 x 8 + 8 x 64 inputs: 3.9x
    x, w = torch.randn(64, 128), torch.randn(512, 128)
    linear = thunder.trace()(lambda a, b: ltorch.linear(a, b), x, w).bound_symbols[-2]
    assert not mincut.expanding(linear)


def test_dear_ops_are_recomputed_only_at_a_price_and_attention_only_without_dropout():
    from thunder.executors.sdpaex import sdpfa_gradfwd

    from thunder_fsdp_mem.training.cudnn_attention import cudnn_forward

    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)

    def attention(p, kernel=sdpfa_gradfwd):
        trace = thunder.trace()(lambda a, b, c: kernel(a, b, c, p, True), q, q, q)
        return next(b for b in trace.bound_symbols if "attention" in b.sym.name or "sdpa" in b.sym.name)

    x, w = torch.randn(4, 8), torch.randn(16, 8)
    linear = next(
        b for b in thunder.trace()(lambda a, b: ltorch.linear(a, b), x, w).bound_symbols if b.sym.name == "linear"
    )

    def cudnn(a, b, c, p, causal):
        return cudnn_forward(a, b, c, p, causal, None)

    for dear in (linear, attention(0.0), attention(0.0, cudnn)):
        assert mincut.priced(dear) and not mincut.recomputable(dear)
    assert not mincut.priced(attention(0.1))  # its random mask would differ in backward
    assert not mincut.priced(attention(0.1, cudnn))


def two_blocks(x, w1, w2):
    h1 = torch.tanh(x @ w1)  # block 1: bf16 [8, 32]
    h2 = torch.tanh(h1 @ w2)  # block 2 reads block 1's output
    return h2.float().sum()


@pytest.fixture(scope="module")
def chain():
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
    jitted = thunder.jit(two_blocks)
    jitted(x, w1, w2).backward()
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    matmuls = [i for i, b in enumerate(forward.bound_symbols) if b.sym.name == "matmul"]
    assert len(matmuls) == 2
    return forward, backward, matmuls, (x, w1, w2)


def test_segments_recompute_each_matmul_from_saved_tensors(chain):
    forward, backward, (first, second), _ = chain
    h1 = forward.bound_symbols[second].flat_proxy_args[0]  # what block 2's matmul reads: tanh(x @ w1)
    # At price 0 the plain cut saves nothing beyond the inputs and rebuilds h1 by running block 1 again, so block 2
    # can only be recomputed after block 1: a chain.
    plain = mincut.plan_saved(forward, price=0.0)
    assert plain.after_bytes == 0 and {first, second} <= set(plain.recompute)
    # With segments, h1 (8 x 32 bf16: 512 bytes) is saved instead, and each matmul run again reads saved tensors
    # only (block 1's still runs again, from x and w1, for the float32 tanh its backward reads).
    segmented = mincut.plan_saved(forward, price=0.0, segments=True)
    assert h1.name in segmented.saved and segmented.after_bytes == 8 * 32 * 2
    assert second in segmented.recompute
    for i in (first, second):
        assert i not in segmented.recompute or all(
            a.name in segmented.saved for a in forward.bound_symbols[i].flat_proxy_args
        )
    # Only the expensive ops in `only` may be recomputed: block 2's output is then saved, block 1 recomputed.
    only_first = mincut.plan_saved(forward, price=0.0, only=frozenset({first}))
    assert first in only_first.recompute and second not in only_first.recompute


def test_a_segmented_plan_computes_the_same_gradients(chain):
    forward, backward, _, (x, w1, w2) = chain
    plan = mincut.plan_saved(forward, price=0.0, segments=True)
    new_forward, new_backward = plan_rewrite.apply_plan(forward, backward, plan)
    checks.check_rewrite(forward, new_forward, ignore_saved=True)
    checks.check_rewrite(backward, new_backward)

    def run(fw, bw):
        out, (saved, other) = fw.python_callable()(x.detach(), w1.detach(), w2.detach())
        return out["output"], bw.python_callable()([list(saved), list(other)], [torch.ones(())])

    (loss,), grads = run(forward, backward)
    (loss_s,), grads_s = run(new_forward, new_backward)
    assert torch.equal(loss, loss_s)
    assert len(grads) == 3 and all(torch.equal(a, b) for a, b in zip(grads, grads_s))


def _fused(fn, *args, transforms=()):
    """``fn`` jitted with the fused executors (on CPU, Thunder's torch.compile regions), run forward and backward
    once: the outputs, the gradients, and the last forward and backward traces."""
    from thunder_fsdp_mem.training import runtime

    args = [a.detach().clone().requires_grad_() for a in args]
    jitted = thunder.jit(fn, executors=runtime.executors("fused"), transforms=list(transforms))
    out = jitted(*args)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.full_like(o, 0.3) for o in outs])
    return outs, [a.grad for a in args], thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]


@pytest.fixture(scope="module")
def fused_sum():
    """The OpInfo sweep's float32 ``sum`` sample 0 in its pair: a region computes the sum and its product with the
    weight; the backward reads the sum, which the cut rebuilds from the (free) input instead of saving it."""
    args = (torch.randn(4, 4), torch.randn(()))
    pair = lambda x, w: x.sum() * w  # noqa: E731
    return _fused(pair, *args), _fused(pair, *args, transforms=[FSDPMemoryTransform()])


def test_a_fusion_recomputed_for_a_sum_runs_again_whole_by_its_own_callable(fused_sum):
    (outs, grads, _, _), (outs_t, grads_t, forward, backward) = fused_sum
    [region] = [b for b in forward.bound_symbols if is_fusion(b)]
    again = [b for b in backward.bound_symbols if is_fusion(b) and b.sym.name == region.sym.name]
    # The same region, outputs and callable: the kernel that added the 16 values in the forward adds them again.
    assert len(again) == 1 and again[0]._call_ctx == region._call_ctx
    assert [o.name for o in again[0].flat_proxy_outs] == [o.name for o in region.flat_proxy_outs]
    assert all(torch.equal(a, b) for a, b in zip((*outs, *grads), (*outs_t, *grads_t)))


def test_a_fusion_recomputed_for_elementwise_outputs_runs_only_what_they_need():
    _, _, forward, _ = _fused(lambda x, w: (torch.exp(x) * w, torch.exp(x)), torch.randn(4, 4), torch.randn(()))
    [region] = [b for b in forward.bound_symbols if is_fusion(b)]
    made_by = {b.output.name: b.sym.name for b in region.subsymbols}
    [exp] = [o for o in region.flat_proxy_outs if made_by[o.name] == "exp"]  # the other is the product
    pruned = plan_rewrite._what_is_read(region, {exp.name})
    assert [o.name for o in pruned.flat_proxy_outs] == [exp.name]
    assert [b.sym.name for b in pruned.subsymbols] == ["exp"] and pruned._call_ctx != region._call_ctx


def _masked(q, k):
    # litgpt's soft-capped attention's causal mask: made in the forward, then filled in place.
    mask = torch.ones(q.size(2), q.size(2), dtype=q.dtype).triu(diagonal=1)
    mask.masked_fill_(mask.bool(), torch.finfo(q.dtype).min)
    return torch.softmax(q @ k.mT + mask, dim=-1) @ k


def _into_input(q, k):
    # The same fill, into a buffer the caller passes: its storage is not the forward's to write again.
    k.masked_fill_(k > 1, 0.0)
    return torch.softmax(q @ k.mT, dim=-1) @ k


@pytest.mark.parametrize("fn, fresh", [(_masked, True), (_into_input, False)], ids=["made-here", "an-input"])
def test_an_in_place_copy_runs_again_only_into_a_tensor_the_forward_made_for_it(fn, fresh):
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    k = torch.randn(1, 2, 16, 8)
    jitted = thunder.jit(fn, executors=[thunder.extend.get_executor("torch")])
    jitted(q, k).sum().backward()
    forward = thunder.last_traces(jitted)[-1]
    bsyms = forward.bound_symbols
    producer = {o.name: i for i, b in reversed(list(enumerate(bsyms))) for o in b.flat_proxy_outs}
    can = [mincut.recomputable(b) or mincut.expanding(b) for b in bsyms]
    copies = mincut._fresh_copies(bsyms, producer, can, lambda i: False)
    assert any(is_copy_into(b) for b in bsyms)
    assert bool(copies) is fresh
