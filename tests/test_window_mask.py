"""``window_mask.vectorize_window_masks``: litgpt's sliding-window mask built by one comparison is the mask litgpt's
loop builds, value for value; a vectorized gemma-2 and Gemma-3 give litgpt's loss and gradients bit for bit, eagerly
and under ``thunder.jit`` with ``LossModel`` and the default transform; with a KV cache litgpt's forward runs as it
is; and the trace no longer grows with the sequence (the loop's T row writes were what made the first call slow)."""

import time

import pytest
import thunder
import torch
from litgpt.model import CausalSelfAttention

from test_litgpt_source import _batch, tiny_gpt
from thunder_fsdp_mem import FSDPMemoryTransform, LossModel, vectorize_window_masks
from thunder_fsdp_mem.window_mask import WindowMaskAttention, window_mask


def _loop_mask(T: int, window: int) -> torch.Tensor:
    # litgpt's CausalSelfAttention.forward, as written there.
    mask = torch.full((T, T), float("-inf"))
    for i in range(T):
        mask[i, max(0, i - window + 1) : i + 1] = 0.0
    return mask.view(1, 1, T, T)


@pytest.mark.parametrize("T, window", [(1, 1), (7, 1), (7, 3), (64, 16), (64, 64), (10, 100)])
def test_the_mask_is_litgpts(T, window):
    assert torch.equal(window_mask(T, window, dtype=torch.float32, device=torch.device("cpu")), _loop_mask(T, window))


def _step(model, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name, n_layer, changed", [("gemma-2-2b", 2, 2), ("Gemma-3-1b-it", 6, 5)])
def test_eagerly_the_step_is_litgpts_bit_for_bit(name, n_layer, changed):
    idx, targets = _batch()
    expected = _step(LossModel(tiny_gpt(name, n_layer)), idx, targets)
    gpt = tiny_gpt(name, n_layer)
    assert vectorize_window_masks(gpt) == changed
    assert sum(type(m) is WindowMaskAttention for m in gpt.modules()) == changed
    got = _step(LossModel(gpt), idx, targets)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_with_a_kv_cache_litgpts_forward_runs_as_it_is():
    outs = []
    for vectorize in (False, True):
        gpt = tiny_gpt("gemma-2-2b")
        if vectorize:
            vectorize_window_masks(gpt)
        gpt.set_kv_cache(batch_size=1)
        with torch.no_grad():
            prompt = gpt(_batch(12)[0][:1], input_pos=torch.arange(12))
            step = gpt(torch.tensor([[3]]), input_pos=torch.tensor([12]))
        outs.append((prompt, step))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _jitted_step(gpt, T: int):
    idx, targets = _batch(T)
    model = thunder.jit(LossModel(gpt), transforms=[FSDPMemoryTransform()])
    start = time.perf_counter()
    out = _step(model, idx, targets)
    return out, time.perf_counter() - start, len(thunder.last_traces(model)[-1].bound_symbols)


def test_under_thunder_the_step_is_the_loops_bit_for_bit_and_does_not_grow_with_the_sequence():
    expected, _, loop_symbols = _jitted_step(tiny_gpt("gemma-2-2b"), 64)
    gpt = tiny_gpt("gemma-2-2b")
    vectorize_window_masks(gpt)
    got, _, symbols = _jitted_step(gpt, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert symbols < loop_symbols
    # 2048 tokens (the loop's first call there took about two minutes on this machine's kind): the same trace.
    long = tiny_gpt("gemma-2-2b", block_size=2048)
    vectorize_window_masks(long)
    _, seconds, long_symbols = _jitted_step(long, 2048)
    assert long_symbols == symbols
    assert seconds < 60, f"the first step at 2048 tokens took {seconds:.0f} s"


def test_only_litgpts_own_attention_with_a_window_is_changed():
    gpt = tiny_gpt("Llama-3-8B")
    assert vectorize_window_masks(gpt) == 0
    assert all(type(m) is CausalSelfAttention for m in gpt.modules() if isinstance(m, CausalSelfAttention))
