"""passes/fusions.py: backward fusions recompute the cheap tail of the forward fusions they read from, as Thunder's
own rematerialization does where its pair order lets it.

- On CPU (fused executors: one torch.compile region per forward and per backward), with Thunder's rematerialization
  switched off while it compiles: the forward saves what Thunder's rematerialization saves when it runs, and the
  loss and every gradient are bit for bit those of Thunder with it (not those of Thunder without it: a moved op
  runs in another kernel, which rounds differently; hence off by default).
- A ThunderFX block traced as on CUDA (attention between two regions, the pair order that stops Thunder): the
  block saves what Thunder's rematerialization saves once its check of the other readers compares original
  symbols, and no float32 activation is left among what it saves.
"""

import dataclasses
from contextlib import ExitStack, nullcontext
from unittest.mock import patch

import pytest
import thunder
import torch

from configs import BY_NAME
from thunder_fsdp_mem.analysis.symbols import nbytes
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import fusions, recompute
from thunder_fsdp_mem.passes.driver import Outcome
from thunder_fsdp_mem.passes.pipeline import FUSIONS, pipeline
from thunder_fsdp_mem.training import models, modes, runtime

SPEC = dataclasses.replace(BY_NAME["neox"], n_layers=1)
CPU = runtime.Rank(0, 1, torch.device("cpu"))
THUNDERS_REMAT = "thunder.executors.torch_compile.rematerialize"


def _saved_bytes(jitted) -> int:
    return sum(nbytes(t) for t in recompute.saved_tensors(thunder.last_traces(jitted)[-1]))


def _run(mode: str, *, thunder_remat: bool):
    off = patch(THUNDERS_REMAT, new=lambda trace: trace) if not thunder_remat else nullcontext()
    trainer = modes.build(mode, SPEC, CPU, executors="fused", dtype=torch.bfloat16,
                          memory=MemoryConfig(fusion_rematerialize=True))
    idx, targets = models.batch(SPEC)
    with off:  # Thunder compiles at the first call
        logits = trainer.model(idx)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    return trainer, loss.detach(), [p.grad for p in trainer.model.parameters()]


def test_without_thunders_rematerialization_the_pass_computes_what_it_would_bit_for_bit():
    reference, loss, grads = _run("thunder", thunder_remat=True)
    transformed, loss_t, grads_t = _run("thunder+mem", thunder_remat=False)
    (record,) = [r for r in transformed.transform.rewrites if r.pass_name == FUSIONS]
    assert record.outcome is Outcome.APPLIED and record.saved_after < record.saved_before  # work there to do
    assert _saved_bytes(transformed.jitted) == _saved_bytes(reference.jitted)
    assert torch.equal(loss_t, loss)
    assert all(torch.equal(a, b) for a, b in zip(grads_t, grads, strict=True))


def test_it_is_off_unless_asked():
    assert not MemoryConfig().fusion_rematerialize
    assert FUSIONS not in [p.name for p in pipeline(MemoryConfig(), regather=False)]
    assert FUSIONS in [p.name for p in pipeline(MemoryConfig(fusion_rematerialize=True), regather=False)]
    with pytest.raises(ValueError, match="fusion_rematerialize"):
        MemoryConfig(fusion_rematerialize=1)


@pytest.fixture(scope="module")
def block():
    """A stablecode-3b ThunderFX block traced as on CUDA: its traces, and the forward Thunder's rematerialization
    gives when each consumer's other readers are counted by the original symbols (the consumer a pair updated is
    mapped back to the one it replaced)."""
    import thunder.core.rematerialization as remat
    from litgpt import GPT
    from thunder.dynamo import ThunderCompiler

    from thunder_fsdp_mem.predict.meta import as_on

    spec = models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=1, block_size=256)
    chosen = runtime.executors("fused")

    def block_traces(corrected: bool):
        original = {}
        find, consumer = remat.find_external_producer_outputs, remat.apply_rematerialization_for_consumer

        def find_external(readers, later, producer, consumer_now):
            back = tuple(original.get(id(c), c) for c in later)
            return find(readers, back, producer, original.get(id(consumer_now), consumer_now))

        def rewrite_consumer(producer, consumer_now, cut):
            new = consumer(producer, consumer_now, cut)
            original[id(new)] = original.get(id(consumer_now), consumer_now)
            return new

        with as_on("cuda", chosen), ExitStack() as fixes:
            if corrected:
                fixes.enter_context(patch.object(remat, "find_external_producer_outputs", new=find_external))
                fixes.enter_context(patch.object(remat, "apply_rematerialization_for_consumer", new=rewrite_consumer))
            torch.manual_seed(0)
            with torch.device("meta"):
                gpt = GPT(spec.config())
            gpt = gpt.to(torch.bfloat16)
            idx, _ = models.batch(spec, device="meta")
            cos, sin = gpt.cos[:256].unsqueeze(0), gpt.sin[:256].unsqueeze(0)
            x = gpt.transformer.wte(idx).detach().requires_grad_(True)
            torch._dynamo.reset()
            backend = ThunderCompiler(executors=chosen)
            y = torch.compile(gpt.transformer.h[0], backend=backend)(x, cos, sin)
            y.backward(torch.empty_like(y))
            torch._dynamo.reset()
            (fn,) = [f for info in backend.subgraph_infos for f in info.thunder_compiled_fns]
            return thunder.last_traces(fn)[-1], thunder.last_backward_traces(fn)[-1]

    forward, backward = block_traces(corrected=False)
    meant, _ = block_traces(corrected=True)
    return spec, chosen, forward, backward, meant


def test_a_thunderfx_block_as_on_cuda_saves_what_thunder_means_it_to(block):
    from thunder_fsdp_mem.predict.meta import as_on

    spec, chosen, forward, backward, meant = block
    with as_on("cuda", chosen):
        new_forward, new_backward, less = fusions.into_consumers(forward, backward)
    saved = recompute.saved_tensors(new_forward)
    assert less > 0 and sum(nbytes(t) for t in saved) == sum(nbytes(t) for t in recompute.saved_tensors(meant))
    T = spec.block_size
    assert not [t.name for t in saved if t.dtype == thunder.dtypes.float32 and t.numel() > T * 32]  # lse: (1, 32, T)
    assert recompute.received(new_backward) == [t.name for t in saved]


def test_a_pair_thunders_helpers_refuse_leaves_the_traces_to_the_driver(block):
    import thunder.core.rematerialization as remat

    _, _, forward, backward, _ = block

    def refuse(*args):
        raise RuntimeError("Failed to compute the min-cut on the graph")

    with patch.object(remat, "find_cut", new=refuse), pytest.raises(fusions.FusionError, match="min-cut"):
        fusions.into_consumers(forward, backward)
