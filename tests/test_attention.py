"""Attention kept on an attention executor (``thunder_fsdp_mem.attention``): where a fusion executor listed first
claims ``scaled_dot_product_attention`` without a grad rule, the forward no longer saves the (T, T) probabilities,
and the results are those the attention executor gives when listed first, bit for bit."""

import dataclasses

import pytest
import thunder
import thunder.torch as ltorch
import torch
import torch.nn.functional as F
from litgpt import GPT
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.executors.torch_compile import torch_compile_ex
from thunder.extend import OperatorExecutor, deregister_executor, register_executor

from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.predict.meta import as_on
from thunder_fsdp_mem.training import models, runtime

# An attention executor for CPU tensors, as Thunder's sdpa executor is for CUDA ones: torch's CPU flash attention
# and its backward, which saves the log-sum-exp and never the probabilities.
cpu_attention_ex = OperatorExecutor("test_cpu_flash_attention", version="0.1")


@pytest.fixture(scope="module", autouse=True)
def _known_to_thunder():
    """Registered (not among the defaults), as an installed executor is, while this module's tests run: other test
    files in the same process must not find it."""
    register_executor(cpu_attention_ex)
    yield
    deregister_executor(cpu_attention_ex)


def _forward_meta(q, k, v, is_causal, scale):
    return TensorProxy(like=q), TensorProxy(like=q, shape=q.shape[:-1], dtype=thunder.dtypes.float32)


def _forward_impl(q, k, v, is_causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal, scale=scale)
    return out, lse


def _backward_impl(g, q, k, v, out, lse, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )


_forward = cpu_attention_ex.register_operator("test_cpu_flash_forward", meta=_forward_meta, fn=_forward_impl)
_backward = cpu_attention_ex.register_operator(
    "test_cpu_flash_backward",
    meta=lambda g, q, k, v, out, lse, is_causal, scale: (TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)),
    fn=_backward_impl,
)


def _accepts(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    return attn_mask is None and dropout_p == 0.0


def _grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = _forward(query, key, value, is_causal, scale)
    put_grads((query, key, value), _backward(get_grad(out), query, key, value, out, lse, is_causal, scale))
    return out


cpu_attention_ex.register_implementation(
    ltorch.scaled_dot_product_attention,
    checker=_accepts,
    execution_transform=lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None: _forward(
        q, k, v, is_causal, scale
    )[0],
    grad_transform=_grad,
)


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _step(executors, transforms):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    jitted = thunder.jit(_attention, executors=executors, transforms=transforms)
    out = jitted(q, k, v)
    out.backward(torch.ones_like(out))
    saved = thunder.last_traces(jitted)[-1].bound_symbols[-1].args[1][0]
    shapes = [tuple(s.shape) for s in saved if isinstance(s, TensorProxy)]
    return out.detach(), [t.grad for t in (q, k, v)], shapes


def test_attention_claimed_first_without_a_grad_rule_runs_on_the_attention_executor_bit_for_bit():
    torch_ex = thunder.extend.get_executor("torch")
    out, grads, shapes = _step([torch_ex, cpu_attention_ex], [])
    assert (1, 2, 128, 128) in shapes  # the decomposition saves its probabilities
    first, first_grads, _ = _step([cpu_attention_ex, torch_ex], [])  # the attention executor listed first
    transform = FSDPMemoryTransform(MemoryConfig(strict=True))
    routed, routed_grads, routed_shapes = _step([torch_ex, cpu_attention_ex], [transform])
    assert (1, 2, 128, 128) not in routed_shapes
    assert torch.equal(routed, first) and all(torch.equal(a, b) for a, b in zip(routed_grads, first_grads))
    assert not torch.equal(routed_grads[0], grads[0]) or not torch.equal(routed, out)  # another kernel's rounding
    assert "1 call of scaled_dot_product_attention (1, 2, 128, ...) f32 on test_cpu_flash_attention" in (
        transform.summary()
    )
    left = FSDPMemoryTransform(MemoryConfig(route_attention=False, rematerialize=False))
    _, _, kept = _step([torch_ex, cpu_attention_ex], [left])
    assert (1, 2, 128, 128) in kept


def test_decomposed_attention_rebuilds_its_probabilities_in_backward_bit_for_bit():
    # No attention executor takes CPU tensors: Thunder differentiates the decomposition, and the cut recomputes
    # the scores' matmul and the softmax in backward from the saved query and key (``mincut.expanding``).
    torch_ex = thunder.extend.get_executor("torch")
    out, grads, shapes = _step([torch_ex], [])
    transform = FSDPMemoryTransform(MemoryConfig(strict=True))
    out_t, grads_t, shapes_t = _step([torch_ex], [transform])
    assert (1, 2, 128, 128) in shapes and not any(s[-2:] == (128, 128) for s in shapes_t), shapes_t
    assert torch.equal(out, out_t) and all(torch.equal(a, b) for a, b in zip(grads, grads_t))
    (remat,) = [r for r in transform.rewrites if r.pass_name == "rematerialization"]
    assert {g.symbol for g in remat.recomputed} >= {"matmul", "softmax"}


def test_no_attention_executor_that_accepts_it_is_said():
    transform = FSDPMemoryTransform()
    _step([thunder.extend.get_executor("torch")], [transform])
    (note,) = [r.note for r in transform.rewrites if r.pass_name == "attention executor"]
    assert "claimed by torch, which has no grad rule for it" in note and "128.00 KiB of (T, T) probabilities" in note
    assert "list test_cpu_flash_attention ahead of torch" in note  # registered, accepts it, not listed


@pytest.mark.parametrize("route", [True, False], ids=["routed", "as-listed"])
def test_torch_compile_executor_first_saves_no_t_by_t_matrix_at_8192_tokens(route):
    # benchmark_litgpt.py's thunder_inductor (runtime's default+inductor): Thunder's torch.compile executor ahead of
    # the defaults, on the meta device as on an H100 (sdpa's flash kernel for bf16), stablecode-3b's block at 8192.
    spec = models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=1, block_size=8192)
    executors = runtime.executors("default+inductor")
    assert executors[0] is torch_compile_ex
    transform = FSDPMemoryTransform(MemoryConfig(route_attention=route))
    with as_on("cuda", executors):
        with torch.device("meta"):
            gpt = GPT(spec.config()).to(torch.bfloat16)
        jitted = thunder.jit(gpt, executors=executors, transforms=[transform])
        idx, targets = models.batch(spec, device="meta")
        logits = jitted(idx)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
    saved = thunder.last_traces(jitted)[-1].bound_symbols[-1].args[1][0]
    square = [tuple(s.shape) for s in saved if isinstance(s, TensorProxy) and tuple(s.shape)[-2:] == (8192, 8192)]
    assert (square == []) is route, square
    if route:
        (record,) = [r for r in transform.rewrites if r.pass_name == "attention executor"]
        assert record.outcome.value == "applied" and "on sdpa with its grad rule, not decomposed by torchcompile" in (
            record.note
        )
        assert "4.00 GiB of probabilities not saved" in record.note


def test_soft_capped_attention_saves_no_probabilities_at_8192_tokens():
    # litgpt's gemma-2 attention (soft-capped: computed by matmul, tanh and softmax, never by an attention
    # executor), one block on the meta device as on an H100 with Thunder's default executors. The sliding window is
    # off: litgpt builds its mask with a Python loop of T writes, which takes Thunder minutes to trace.
    spec = models.ModelSpec(name="gemma-2-2b", n_layers=1, block_size=8192, overrides=(("sliding_window_size", None),))
    executors = list(thunder.get_default_executors())

    def saved(transforms):
        with as_on("cuda", executors):
            with torch.device("meta"):
                gpt = GPT(spec.config()).to(torch.bfloat16)
            jitted = thunder.jit(gpt, executors=executors, transforms=transforms)
            idx, targets = models.batch(spec, device="meta")
            logits = jitted(idx)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
        tensors = thunder.last_traces(jitted)[-1].bound_symbols[-1].args[1][0]
        return [tuple(s.shape) for s in tensors if isinstance(s, TensorProxy) and tuple(s.shape)[-2:] == (8192, 8192)]

    assert (1, 8, 8192, 8192) in saved([])  # the scores, their soft-cap and the probabilities, per head
    # With the transform none per head is saved. What stays is litgpt's causal mask, (1, 1, T, T), which it builds
    # per block with an in-place fill: the cut does not recompute what an in-place copy writes.
    assert saved([FSDPMemoryTransform()]) == [(1, 1, 8192, 8192)]


def test_routed_symbols_are_one_per_attention_executor():
    from thunder_fsdp_mem.attention import routed_symbol

    a, b = routed_symbol(cpu_attention_ex), routed_symbol(cpu_attention_ex)
    assert a is b and a.id != ltorch.scaled_dot_product_attention.id
    assert dataclasses.replace(a, id=ltorch.scaled_dot_product_attention.id) == ltorch.scaled_dot_product_attention
    with pytest.raises(ValueError, match="executor torch has no grad rule"):
        routed_symbol(thunder.extend.get_executor("torch"))
