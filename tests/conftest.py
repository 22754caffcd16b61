import gc

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _what_is_imported_left_out_of_collections():
    """Everything alive once the tests are collected (torch, Thunder, litgpt and their modules) is moved out of
    the garbage collector's sight (``gc.freeze``): a full collection after each test then looks at what the tests
    made, not at millions of imported objects (0.35 s each, twice a test, before)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _no_dying_modules_in_dynamos_tracker():
    """Each test starts with Dynamo's tracker of built modules empty, and the garbage collector runs between tests only.

    Once Dynamo has run in a process, every ``nn.Module`` built from then on is recorded in a dict of weak references
    (``torch._dynamo.mutation_guard.GenerationTracker``), and litgpt's ``GPT.forward`` builds an ``nn.Identity`` at
    every call. Thunder's interpreter, tracing that call, iterates the dict; when the garbage collector frees a
    module built earlier meanwhile, its entry leaves the dict and the trace fails with "dictionary changed size
    during iteration" (seen twice in this suite, in tests that jit many litgpt models; clearing the tracker before
    each test did not end it: a CI run since failed in a test that traces pythia-14m, the message cut). So the
    collector waits for the test's end."""
    torch._dynamo.reset()
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
    from thunder_fsdp_mem.training import litgpt_models

    options = PREDICTED[request.param]
    return options, trace_step(litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32), **options)
