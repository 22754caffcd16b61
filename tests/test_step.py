"""estimate_step() against MemTracker's measured peak of the same forward and backward (plain thunder.jit)."""

import pytest
import thunder
import torch

from configs import BY_NAME
from support import memtracker_peak
from thunder_fsdp_mem import estimate_step, models

TOLERANCE = 0.03


def _jitted_step(spec, dtype):
    model = models.build(spec, dtype=dtype)
    idx, targets = models.batch(spec)
    jitted = thunder.jit(model)
    jitted(idx, targets).backward()  # compile, and leave the traces of a run
    for p in jitted.parameters():
        p.grad = None
    return jitted, idx, targets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["neox", "llama", "gemma"])
def test_estimate_matches_memtracker(family, dtype):
    jitted, idx, targets = _jitted_step(BY_NAME[family], dtype)
    measured = memtracker_peak(jitted, idx, targets, tracked=(jitted,))
    estimate = estimate_step(jitted)
    assert abs(estimate.peak_bytes - measured) <= TOLERANCE * measured, (estimate.peak_bytes, measured)
    # The breakdown is consistent with the peak it explains.
    assert estimate.peak_bytes == max(estimate.forward_peak_bytes, estimate.backward_peak_bytes)
    assert sum(a.nbytes for a in estimate.live_at_peak) == estimate.peak_bytes
    params = sum(p.numel() * p.element_size() for p in jitted.parameters())
    assert estimate.gradient_bytes == params
    assert estimate.saved_bytes > 0


def test_function_that_has_not_run_is_an_error():
    jitted = thunder.jit(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="call the jitted function once first"):
        estimate_step(jitted)


def test_plain_function_is_a_type_error():
    with pytest.raises(TypeError, match="thunder.jit"):
        estimate_step(lambda x: x)
