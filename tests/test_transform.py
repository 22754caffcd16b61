"""FSDPMemoryTransform under plain ``thunder.jit``: results bit for bit those of Thunder without it, and less saved
for backward than eager autograd saves, on every litgpt family we test."""

import dataclasses
import warnings

import pytest
import thunder
import torch
from thunder.core.transform_common import Transform

from configs import BY_NAME
from support import saved_bytes
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig, models


def _run(spec, dtype, transforms):
    model = models.build(spec, dtype=dtype)
    idx, targets = models.batch(spec)
    jitted = thunder.jit(model, transforms=transforms)
    loss = jitted(idx, targets)
    loss.backward()
    grads = {n: p.grad for n, p in jitted.named_parameters()}
    for p in jitted.parameters():
        p.grad = None
    saved = saved_bytes(jitted, idx, targets, held=[*model.parameters(), *model.buffers()])
    return loss.detach(), grads, saved, jitted


@pytest.mark.parametrize("family, dtype", [("neox", torch.bfloat16), ("llama", torch.float32),
                                           ("gemma", torch.bfloat16)], ids=["neox-bf16", "llama-fp32", "gemma-bf16"])
def test_bitwise_identical_and_saves_less_than_eager(family, dtype):
    spec = dataclasses.replace(BY_NAME[family], n_layers=1)  # one block has every kind of op; it compiles faster
    loss, grads, saved, _ = _run(spec, dtype, [])
    loss_t, grads_t, saved_t, jitted = _run(spec, dtype, [FSDPMemoryTransform(strict=True)])
    assert torch.equal(loss, loss_t)
    assert grads.keys() == grads_t.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_t[name]), name
    model = models.build(spec, dtype=dtype)
    idx, targets = models.batch(spec)
    eager = saved_bytes(model, idx, targets, held=[*model.parameters(), *model.buffers()])
    assert saved > eager  # the gap the transform exists for (Thunder saves float32 intermediates)...
    assert saved_t <= eager, (saved_t, eager)  # ...closed: no more than eager autograd keeps
    assert "FSDPMemoryTransform: saves" in str(thunder.last_traces(jitted)[-1])


def test_is_a_thunder_transform_with_a_validated_config():
    assert isinstance(FSDPMemoryTransform(), Transform)
    assert FSDPMemoryTransform(strict=True).config.strict is True
    with pytest.raises(ValueError, match="MemoryConfig.strict must be a bool.*'yes'"):
        MemoryConfig(strict="yes")
    with pytest.raises(ValueError, match="MemoryConfig.rematerialize must be a bool.*1"):
        MemoryConfig(rematerialize=1)
    with pytest.raises(ValueError, match="either config= or strict="):
        FSDPMemoryTransform(MemoryConfig(), strict=True)
    with pytest.raises(TypeError, match="MemoryConfig"):
        FSDPMemoryTransform({"strict": True})


@pytest.fixture(scope="module")
def plain_traces():
    spec = dataclasses.replace(BY_NAME["neox"], n_layers=1)
    jitted = thunder.jit(models.build(spec, dtype=torch.float32))
    jitted(*models.batch(spec)).backward()
    return thunder.last_traces(jitted), thunder.last_backward_traces(jitted)[-1]


def test_rematerialize_off_leaves_the_traces_alone(plain_traces):
    forward, backward = plain_traces[0][-1], plain_traces[1]
    transform = FSDPMemoryTransform(MemoryConfig(rematerialize=False))
    assert transform.transform_trace_post_optimization(forward) is forward
    assert transform.transform_trace_post_optimization(backward) is backward


def test_a_backward_without_its_forward_is_refused(plain_traces):
    # What the forward saves is chosen with both traces in hand: a lone backward comes back unchanged with a
    # warning, or raises under strict=True.
    backward = plain_traces[1]
    with pytest.warns(UserWarning, match="without its forward"):
        assert FSDPMemoryTransform().transform_trace_post_optimization(backward) is backward
    with pytest.raises(RuntimeError, match="without its forward"):
        FSDPMemoryTransform(strict=True).transform_trace_post_optimization(backward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a trace that is neither forward nor backward is not an error
        first = plain_traces[0][0]
        assert FSDPMemoryTransform().transform_trace_post_optimization(first) is first
