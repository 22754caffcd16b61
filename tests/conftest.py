import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _no_dying_modules_in_dynamos_tracker():
    """Each test starts with Dynamo's tracker of built modules empty and the garbage collected.

    Once Dynamo has run in a process, every ``nn.Module`` built from then on is recorded in a dict of weak references
    (``torch._dynamo.mutation_guard.GenerationTracker``), and litgpt's ``GPT.forward`` builds an ``nn.Identity`` at
    every call. Thunder's interpreter, tracing that call, iterates the dict; when the garbage collector frees an
    earlier test's modules meanwhile, their entries leave it and the trace fails with "dictionary changed size
    during iteration" (seen twice in this suite, in tests that jit many litgpt models)."""
    torch._dynamo.reset()
    gc.collect()
    yield
