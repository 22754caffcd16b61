"""Thunder's strongest configuration, ``runtime.executors("fused")`` (torch's cuDNN attention and Thunder's sdpa
executor, then one fusion executor:
nvFuser where installed, else its torch.compile executor without the distributed prims), and the transform on the
traces it makes. On CPU the torch.compile executor fuses whole layers (sdpa does not claim CPU attention).

- One device: with the transform (attention's scores kept from the forward: ``recompute_scores=False``), the step is
  bit for bit Thunder's; the estimate of the real run is what the
  report predicts on the meta device.
- Thunder's fsdp on 2 gloo ranks, ZeRO2 and ZeRO3: bit for bit, and the FSDP passes still rewrite the traces
  between the fused regions: fewer gathered parameters at once, none saved and all gathered again in backward
  under ZeRO3, the reduce-scatters in their window.
"""

import dataclasses

import pytest
import thunder
import torch

from configs import BY_NAME
from support import torchrun
from thunder_fsdp_mem import estimate_step
from thunder_fsdp_mem.analysis.symbols import is_fusion
from thunder_fsdp_mem.config import DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS, MemoryConfig
from thunder_fsdp_mem.passes.driver import Outcome
from thunder_fsdp_mem.predict.emulate import trace_step
from thunder_fsdp_mem.training import litgpt_models, modes, runtime

SPEC = dataclasses.replace(BY_NAME["neox"], n_layers=1)
CPU = runtime.Rank(0, 1, torch.device("cpu"))


def _step(mode: str):
    # On CPU no attention executor claims attention: the fusion executor fuses it decomposed, whose (T, T) scores
    # the default transform computes again in backward (another kernel, other rounding); without that, bit for bit.
    memory = MemoryConfig(recompute_scores=False)
    trainer = modes.build(mode, SPEC, CPU, executors="fused", dtype=torch.bfloat16, memory=memory)
    idx, targets = litgpt_models.batch(SPEC)
    logits = trainer.model(idx)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters()]
    return trainer, loss.detach(), grads


@pytest.fixture(scope="module")
def steps():
    return _step("thunder"), _step("thunder+mem")


def test_the_choice_is_attention_then_one_fusion_executor():
    names = [ex.name for ex in runtime.executors("fused")]
    assert names[:3] in (["sdpa_cudnn", "sdpa", "torchcompile_fused"], ["sdpa_cudnn", "sdpa", "nvfuser"])
    assert "torchcompile_xentropy" not in names  # the fusion executor fuses the loss; the names would clash
    from thunder.distributed.prims import PrimIDs as DistributedPrimIDs

    fusion = runtime.executors("fused")[2]
    assert not any(isinstance(op, DistributedPrimIDs) for op in fusion._implmap)  # collectives stay symbols


def test_the_transform_keeps_fused_results_bit_for_bit(steps):
    (plain, loss, grads), (transformed, loss_t, grads_t) = steps
    traces = [thunder.last_traces(transformed.jitted)[-1], thunder.last_backward_traces(transformed.jitted)[-1]]
    assert all(any(is_fusion(b) for b in t.bound_symbols) for t in traces)  # fused forward and backward
    assert torch.equal(loss, loss_t)
    assert len(grads) == len(grads_t) and all(torch.equal(a, b) for a, b in zip(grads, grads_t))
    records = transformed.transform.rewrites
    assert records and all(r.outcome is not Outcome.REFUSED for r in records)


def test_the_report_predicts_the_fused_runs_estimate(steps):
    (plain, _, _), _ = steps
    measured_traces = estimate_step(plain.jitted, loss="cross_entropy", optimizer=plain.optimizer)
    predicted = trace_step(SPEC, mode="jit", device_type="cpu", executors="fused")
    assert predicted.peak_bytes == measured_traces.peak_bytes
    assert predicted.saved_bytes == measured_traces.saved_bytes


@pytest.fixture(scope="module")
def fsdp_results():
    return torchrun("gather_worker.py", "neox", "--executors=fused")


@pytest.mark.slow
def test_thunder_fsdp_with_fused_regions_is_bitwise_and_still_scheduled(fsdp_results):
    assert {(r["shard"], r["rank"]) for r in fsdp_results} == {(s, k) for s in runtime.SHARDS for k in (0, 1)}
    for r in fsdp_results:
        assert r["executors"] == "fused" and r["fusions"] > 0, r
        assert r["loss_equal"] and r["grads_equal"] and r["n_grads"] > 0, r
        assert r["at_once_mem"] < r["at_once"] == r["gathers"], r  # Thunder gathers all at once; the window fewer
        assert r["scatters_at_once_mem"] == DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS < r["scatters_at_once"], r
        if r["shard"] == "zero3":
            assert r["saved"] > 0 and r["saved_mem"] == 0 and r["gathered_again"] > 0, r
        else:
            assert r["saved_mem"] > 0 and r["gathered_again"] == 0, r
