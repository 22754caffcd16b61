import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _no_dying_modules_in_dynamos_tracker():
    """Each test starts with Dynamo's tracker of built modules empty, and the garbage collector runs between tests only.

    Once Dynamo has run in a process, every ``nn.Module`` built from then on is recorded in a dict of weak references
    (``torch._dynamo.mutation_guard.GenerationTracker``), and litgpt's ``GPT.forward`` builds an ``nn.Identity`` at
    every call. Thunder's interpreter, tracing that call, iterates the dict; when the garbage collector frees a
    module built earlier meanwhile, its entry leaves the dict and the trace fails with "dictionary changed size
    during iteration" (seen three times in this suite, in tests that jit litgpt models; the third time in a test
    that had started with the dict empty, so modules built by the test itself died mid-trace)."""
    torch._dynamo.reset()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


PREDICTED = {  # (mode, options): one step of each FSDP path, traced on the meta device
    "jit": dict(mode="jit", device_type="cpu"),
    "thunder-fsdp-zero3-cuda": dict(mode="thunder-fsdp", shard="zero3", world_size=2, device_type="cuda"),
    "fsdp2-zero2": dict(mode="fsdp2", shard="zero2", world_size=2, device_type="cpu"),
}


@pytest.fixture(scope="session", params=list(PREDICTED))
def predicted_step(request):
    """(options, StepMemory) of pythia-14m, 1 layer, 32 tokens, in each of ``PREDICTED``'s set-ups (on CUDA a
    reduce-scatter's input lives until its wait, which frees it while it runs)."""
    from thunder_fsdp_mem.predict.emulate import trace_step
    from thunder_fsdp_mem.training import models

    options = PREDICTED[request.param]
    return options, trace_step(models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32), **options)
