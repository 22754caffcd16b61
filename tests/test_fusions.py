"""passes/fusions.py: backward fusions recompute the cheap tail of the forward fusions they read from, as Thunder's
own rematerialization does where its pair order lets it (on by default, with an opt-out).

A stablecode-3b ThunderFX block traced as on CUDA (attention between two regions, the pair order that stops
Thunder): the block saves what Thunder's rematerialization saves once ``docs/upstream/rematerialization.patch``
fixes it, and no float32 activation is left among what it saves; on the fixed Thunder's traces the pass moves
nothing. The results, run for real on CPU, are in ``tests/test_upstream.py``; here, in float32 and as FSDP2 compiles
a model (each block a ThunderFX graph of its own, attention in an operator executor as on CUDA), the default
transform's loss and gradients against eager PyTorch on three litgpt families, within ``GRADIENT_TOLERANCE``.
"""

import dataclasses
from contextlib import nullcontext
from unittest.mock import patch

import pytest
import thunder
import torch
from thunder.dynamo import ThunderCompiler

from configs import BY_NAME, SOFTCAP_TIED
from support import upstream
from thunder_fsdp_mem import FSDPMemoryTransform
from thunder_fsdp_mem.analysis.symbols import nbytes
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.loss.modules import LossModel
from thunder_fsdp_mem.passes import fusions, mincut, plan_rewrite
from thunder_fsdp_mem.passes.mincut import saved_tensors
from thunder_fsdp_mem.predict.meta import as_on
from thunder_fsdp_mem.passes.pipeline import FUSIONS, pipeline
from thunder_fsdp_mem.training import litgpt_models, runtime

GRADIENT_TOLERANCE = 1e-5  # of each gradient's largest element (measured: at most 5e-7, kernels of another order)


@pytest.mark.parametrize("family", ["neox", "llama", "gemma"])
def test_the_default_transforms_gradients_are_eagers_in_float32(family):
    spec = dataclasses.replace(BY_NAME[family], n_layers=1)
    idx, targets = litgpt_models.batch(spec)
    transform = FSDPMemoryTransform()

    def step(compiled: bool):
        torch.manual_seed(0)
        gpt = litgpt_models.build(spec, dtype=torch.float32).gpt
        if compiled:  # each block alone, as FSDP2's graph breaks leave it
            backend = ThunderCompiler(
                executors=[upstream().cpu_attention, *runtime.executors("fused")], transforms=[transform]
            )
            for i, block in enumerate(gpt.transformer.h):
                gpt.transformer.h[i] = torch.compile(block, backend=backend)
        logits = gpt(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        return loss.detach(), [p.grad for p in gpt.parameters()]

    torch._dynamo.reset()
    loss, grads = step(compiled=False)
    loss_t, grads_t = step(compiled=True)
    assert transform.rewrites and transform.config.fusion_rematerialize
    if family == "neox":  # the family whose ThunderFX block Thunder leaves float32 intermediates in
        assert any(r.pass_name == FUSIONS and r.outcome.value == "applied" for r in transform.rewrites)
    assert abs(loss_t - loss) <= GRADIENT_TOLERANCE * abs(loss)
    for g, g_t in zip(grads, grads_t, strict=True):
        assert (g_t - g).abs().max() <= GRADIENT_TOLERANCE * g.abs().max()


def test_it_is_on_by_default_with_an_opt_out():
    assert MemoryConfig().fusion_rematerialize
    assert FUSIONS in [p.name for p in pipeline(MemoryConfig(), regather=False)]
    assert FUSIONS not in [p.name for p in pipeline(MemoryConfig(fusion_rematerialize=False), regather=False)]
    with pytest.raises(ValueError, match="fusion_rematerialize"):
        MemoryConfig(fusion_rematerialize=1)


@pytest.fixture(scope="module")
def block():
    """A stablecode-3b ThunderFX block traced as on CUDA: its traces with Thunder as it is, and with Thunder's
    rematerialization fixed by ``docs/upstream/rematerialization.patch``."""
    from litgpt import GPT

    from thunder_fsdp_mem.predict.meta import as_on

    spec = litgpt_models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=1, block_size=256)
    chosen = runtime.executors("fused")

    def block_traces(fixed: bool):
        with as_on("cuda", chosen), upstream().fixed_rematerialization() if fixed else nullcontext():
            torch.manual_seed(0)
            with torch.device("meta"):
                gpt = GPT(spec.config())
            gpt = gpt.to(torch.bfloat16)
            idx, _ = litgpt_models.batch(spec, device="meta")
            cos, sin = gpt.cos[:256].unsqueeze(0), gpt.sin[:256].unsqueeze(0)
            x = gpt.transformer.wte(idx).detach().requires_grad_(True)
            torch._dynamo.reset()
            backend = ThunderCompiler(executors=chosen)
            y = torch.compile(gpt.transformer.h[0], backend=backend)(x, cos, sin)
            y.backward(torch.empty_like(y))
            torch._dynamo.reset()
            (fn,) = [f for info in backend.subgraph_infos for f in info.thunder_compiled_fns]
            return thunder.last_traces(fn)[-1], thunder.last_backward_traces(fn)[-1]

    forward, backward = block_traces(fixed=False)
    return spec, chosen, forward, backward, block_traces(fixed=True)


def test_a_thunderfx_block_as_on_cuda_saves_what_thunder_means_it_to(block):
    from thunder_fsdp_mem.predict.meta import as_on

    spec, chosen, forward, backward, (meant, _) = block
    with as_on("cuda", chosen):
        new_forward, new_backward, less = fusions.into_consumers(forward, backward)
    saved = mincut.saved_tensors(new_forward)
    assert less > 0 and sum(nbytes(t) for t in saved) == sum(nbytes(t) for t in mincut.saved_tensors(meant))
    T = spec.block_size
    assert not [t.name for t in saved if t.dtype == thunder.dtypes.float32 and t.numel() > T * 32]  # lse: (1, 32, T)
    assert plan_rewrite.received(new_backward) == [t.name for t in saved]


def test_on_a_fixed_thunders_block_as_on_cuda_the_pass_moves_nothing(block):
    from thunder_fsdp_mem.predict.meta import as_on

    _, chosen, _, _, (forward, backward) = block
    with as_on("cuda", chosen):
        new_forward, new_backward, less = fusions.into_consumers(forward, backward)
    assert less == 0 and new_forward is forward and new_backward is backward


def test_a_pair_thunders_helpers_refuse_leaves_the_traces_to_the_driver(block):
    import thunder.core.rematerialization as remat

    _, _, forward, backward, _ = block

    def refuse(*args):
        raise RuntimeError("Failed to compute the min-cut on the graph")

    with patch.object(remat, "find_cut", new=refuse), pytest.raises(fusions.FusionError, match="min-cut"):
        fusions.into_consumers(forward, backward)


def _capped(n_layers: int, block_size: int):
    """A tiny gemma-2: soft-capped attention, a sliding window on every other layer, the mask fix applied."""
    return dataclasses.replace(SOFTCAP_TIED, n_layers=n_layers, block_size=block_size, vectorized_window_masks=True)


def _saved_square(spec, config: MemoryConfig) -> list[tuple[int, ...]]:
    """The shapes of the (..., T, T) tensors the jitted forward of ``spec`` with its loss saves, traced on the meta
    device with the fused executors as on CUDA."""
    chosen = runtime.executors("fused")
    with as_on("cuda", chosen):
        with torch.device("meta"):
            model = LossModel(spec.gpt()).to(torch.bfloat16)
        jitted = thunder.jit(model, executors=chosen, transforms=[FSDPMemoryTransform(config)])
        idx, targets = litgpt_models.batch(spec, device="meta")
        jitted(idx, targets).backward()
    T = spec.block_size
    return [tuple(t.shape) for t in saved_tensors(thunder.last_traces(jitted)[-1]) if tuple(t.shape[-2:]) == (T, T)]


def test_soft_capped_attention_saves_no_t_by_t_tensor_at_8192_tokens():
    spec = _capped(2, 8192)
    assert _saved_square(spec, MemoryConfig(fusion_rematerialize=False))  # what the backward would read otherwise
    assert _saved_square(spec, MemoryConfig()) == []


def test_soft_capped_attentions_scores_computed_again_give_eagers_gradients_in_float32():
    spec = _capped(2, 256)  # long enough that (T, T) outweighs the (T, 4 x 32) query and key it comes from
    idx, targets = litgpt_models.batch(spec)
    transform = FSDPMemoryTransform()

    def step(compiled: bool):
        torch.manual_seed(0)
        model = LossModel(spec.gpt())
        run = thunder.jit(model, executors=runtime.executors("fused"), transforms=[transform]) if compiled else model
        loss = run(idx, targets)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()], run

    loss, grads, _ = step(compiled=False)
    loss_t, grads_t, jitted = step(compiled=True)
    saved = saved_tensors(thunder.last_traces(jitted)[-1])
    square = [t for t in saved if tuple(t.shape[-2:]) == (256, 256)]
    assert square == []  # the scores and probabilities are computed again in the backward's fusions
    # from the softmax's row statistics, saved: (1, heads, T, 1) each, a maximum and a sum a layer
    heads = spec.config().n_head
    assert sum(tuple(t.shape) == (1, heads, 256, 1) for t in saved) == 2 * spec.n_layers
    backward = thunder.last_backward_traces(jitted)[-1]
    assert "amax" not in _op_names(backward.bound_symbols)  # no row maximum over (T, T) again
    assert abs(loss_t - loss) <= GRADIENT_TOLERANCE * abs(loss)
    for g, g_t in zip(grads, grads_t, strict=True):
        assert (g_t - g).abs().max() <= GRADIENT_TOLERANCE * g.abs().max()


def _op_names(bsyms) -> set[str]:
    return {b.sym.name for b in bsyms} | {n for b in bsyms for n in _op_names(b.subsymbols)}
