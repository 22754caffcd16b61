"""FSDPMemoryTransform: a Thunder transform that, for now, must leave every result bit for bit as it was."""

import pytest
import thunder
import torch
from thunder.core.transform_common import Transform

from configs import LLAMA, NEOX
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig, models


def _loss_and_grads(spec, transforms):
    model = models.build(spec, dtype=torch.float32)
    idx, targets = models.batch(spec)
    jitted = thunder.jit(model, transforms=transforms)
    loss = jitted(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in jitted.named_parameters()}


@pytest.mark.parametrize("spec", [NEOX, LLAMA], ids=["neox", "llama"])
def test_results_are_bitwise_identical_to_thunder_without_it(spec):
    loss, grads = _loss_and_grads(spec, [])
    loss_t, grads_t = _loss_and_grads(spec, [FSDPMemoryTransform()])
    assert torch.equal(loss, loss_t)
    assert grads.keys() == grads_t.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_t[name]), name


def test_is_a_thunder_transform_with_a_validated_config():
    assert isinstance(FSDPMemoryTransform(), Transform)
    assert FSDPMemoryTransform(strict=True).config.strict is True
    with pytest.raises(ValueError, match="strict"):
        MemoryConfig(strict="yes")
    with pytest.raises(ValueError, match="either config= or strict="):
        FSDPMemoryTransform(MemoryConfig(), strict=True)
    with pytest.raises(TypeError, match="MemoryConfig"):
        FSDPMemoryTransform({"strict": True})
