"""passes/fusions.py: backward fusions recompute the cheap tail of the forward fusions they read from, as Thunder's
own rematerialization does where its pair order lets it (on by default, with an opt-out).

A stablecode-3b ThunderFX block traced as on CUDA (attention between two regions, the pair order that stops
Thunder): the block saves what Thunder's rematerialization saves once ``docs/upstream/rematerialization.patch``
fixes it, and no float32 activation is left among what it saves; on the fixed Thunder's traces the pass moves
nothing. The results, run for real on CPU, are in ``tests/test_upstream.py``.
"""

from contextlib import nullcontext
from unittest.mock import patch

import pytest
import thunder
import torch

from support import upstream
from thunder_fsdp_mem.analysis.symbols import nbytes
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import fusions, recompute
from thunder_fsdp_mem.passes.pipeline import FUSIONS, pipeline
from thunder_fsdp_mem.training import models, runtime



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
    from thunder.dynamo import ThunderCompiler

    from thunder_fsdp_mem.predict.meta import as_on

    spec = models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=1, block_size=256)
    chosen = runtime.executors("fused")

    def block_traces(fixed: bool):
        with as_on("cuda", chosen), upstream().fixed_rematerialization() if fixed else nullcontext():
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

    forward, backward = block_traces(fixed=False)
    return spec, chosen, forward, backward, block_traces(fixed=True)


def test_a_thunderfx_block_as_on_cuda_saves_what_thunder_means_it_to(block):
    from thunder_fsdp_mem.predict.meta import as_on

    spec, chosen, forward, backward, (meant, _) = block
    with as_on("cuda", chosen):
        new_forward, new_backward, less = fusions.into_consumers(forward, backward)
    saved = recompute.saved_tensors(new_forward)
    assert less > 0 and sum(nbytes(t) for t in saved) == sum(nbytes(t) for t in recompute.saved_tensors(meant))
    T = spec.block_size
    assert not [t.name for t in saved if t.dtype == thunder.dtypes.float32 and t.numel() > T * 32]  # lse: (1, 32, T)
    assert recompute.received(new_backward) == [t.name for t in saved]


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
