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
from thunder.executors.torch_compile import torch_compile_ex

from configs import SOFTCAP_TIED
from support import upstream
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.predict.meta import as_on
from thunder_fsdp_mem.training import litgpt_models, runtime

# An attention executor for CPU tensors, as Thunder's sdpa executor is for CUDA ones (torch's CPU flash attention and
# its backward, which saves the log-sum-exp and never the probabilities): the upstream reproducer's, registered with
# Thunder when it is loaded, as an installed executor is (not among the defaults).
cpu_attention_ex = upstream().cpu_attention


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
    assert "1 call of scaled_dot_product_attention (1, 2, 128, ...) f32 on cpu_attention" in (transform.summary())
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
    assert "list cpu_attention ahead of torch" in note  # registered, accepts it, not listed


@pytest.mark.parametrize(
    "route, scores", [(True, True), (False, True), (False, False)], ids=["routed", "scores-again", "as-listed"]
)
def test_torch_compile_executor_first_saves_no_t_by_t_matrix_at_8192_tokens(route, scores):
    # benchmark_litgpt.py's thunder_inductor (runtime's default+inductor): Thunder's torch.compile executor ahead of
    # the defaults, on the meta device as on an H100 (sdpa's flash kernel for bf16), stablecode-3b's block at 8192.
    spec = litgpt_models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=1, block_size=8192)
    executors = runtime.executors("default+inductor")
    assert executors[0] is torch_compile_ex
    transform = FSDPMemoryTransform(MemoryConfig(route_attention=route, recompute_scores=scores))
    with as_on("cuda", executors):
        with torch.device("meta"):
            gpt = GPT(spec.config()).to(torch.bfloat16)
        jitted = thunder.jit(gpt, executors=executors, transforms=[transform])
        idx, targets = litgpt_models.batch(spec, device="meta")
        logits = jitted(idx)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
    saved = thunder.last_traces(jitted)[-1].bound_symbols[-1].args[1][0]
    square = [tuple(s.shape) for s in saved if isinstance(s, TensorProxy) and tuple(s.shape)[-2:] == (8192, 8192)]
    # Routed, attention runs on its executor; decomposed, the backward's fusion computes the scores again.
    assert (square == []) is (route or scores), square
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
    spec = litgpt_models.ModelSpec(
        name="gemma-2-2b", n_layers=1, block_size=8192, overrides=(("sliding_window_size", None),)
    )
    executors = list(thunder.get_default_executors())

    def saved(transforms):
        with as_on("cuda", executors):
            with torch.device("meta"):
                gpt = GPT(spec.config()).to(torch.bfloat16)
            jitted = thunder.jit(gpt, executors=executors, transforms=transforms)
            idx, targets = litgpt_models.batch(spec, device="meta")
            logits = jitted(idx)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
        tensors = thunder.last_traces(jitted)[-1].bound_symbols[-1].args[1][0]
        return [tuple(s.shape) for s in tensors if isinstance(s, TensorProxy) and tuple(s.shape)[-2:] == (8192, 8192)]

    assert (1, 8, 8192, 8192) in saved([])  # the scores, their soft-cap and the probabilities, per head
    # With the transform none is saved: not per head, and not litgpt's causal mask, (1, 1, T, T), which it builds per
    # block with an in-place fill (``ones(T, T).triu(1)``, then ``masked_fill_``): the backward builds it again.
    assert saved([FSDPMemoryTransform()]) == []


def test_soft_capped_attention_and_its_mask_are_rebuilt_in_backward_bit_for_bit():
    # The same attention on CPU at 128 tokens (2 heads of 32): Thunder saves the scores, their soft-cap and the
    # probabilities, per head, and the causal mask; with the transform the backward builds them all again from the
    # saved query and key (the mask with its in-place fill, into a tensor it makes for it), and computes the loss and
    # every gradient bit for bit, in float32 and in bfloat16.
    spec = dataclasses.replace(SOFTCAP_TIED, overrides=(*SOFTCAP_TIED.overrides, ("sliding_window_size", None)))
    T = spec.block_size

    def step(transforms, dtype):
        torch.manual_seed(0)
        gpt = GPT(spec.config()).to(dtype)
        jitted = thunder.jit(gpt, executors=list(thunder.get_default_executors()), transforms=transforms)
        idx, targets = litgpt_models.batch(spec)
        logits = jitted(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        loss.backward()
        saved = thunder.last_traces(jitted)[-1].bound_symbols[-1].args[1][0]
        square = [s for s in (tuple(t.shape) for t in saved if isinstance(t, TensorProxy)) if s[-2:] == (T, T)]
        return loss.detach(), [p.grad for p in gpt.parameters()], [s for s in square if len(s) == 4]  # not (1, T, C)

    for dtype in (torch.float32, torch.bfloat16):
        loss, grads, square = step([], dtype)
        loss_t, grads_t, square_t = step([FSDPMemoryTransform(MemoryConfig(strict=True))], dtype)
        assert (1, 2, T, T) in square and square_t == [], (square, square_t)
        assert torch.equal(loss, loss_t) and all(torch.equal(a, b) for a, b in zip(grads, grads_t))


def test_routed_symbols_are_one_per_attention_executor():
    from thunder_fsdp_mem.attention import routed_symbol

    a, b = routed_symbol(cpu_attention_ex), routed_symbol(cpu_attention_ex)
    assert a is b and a.id != ltorch.scaled_dot_product_attention.id
    assert dataclasses.replace(a, id=ltorch.scaled_dot_product_attention.id) == ltorch.scaled_dot_product_attention
    with pytest.raises(ValueError, match="executor torch has no grad rule"):
        routed_symbol(thunder.extend.get_executor("torch"))
