"""emulate.py: the meta trace takes the attention kernels of the device it predicts, and Thunder's fsdp over fake
ranks shards as over real ones. (Its estimates against measured runs: tests/test_cli.py, tests/test_compare.py.)"""

import pytest
import thunder
import torch

from configs import BY_NAME
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.predict import emulate, meta
from thunder_fsdp_mem.training import litgpt_models, runtime


def _attention_symbols(device_type: str) -> set[str]:
    """The sdpa executor's symbols in the forward of a 1-block model traced on meta for ``device_type``."""
    spec = BY_NAME["neox"]
    with meta.attention_as_on(device_type):
        jitted = thunder.jit(litgpt_models.build(spec, dtype=torch.bfloat16, device="meta"))
        jitted(*litgpt_models.batch(spec, device="meta")).backward()
    return {b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols if "sdpa" in b.sym.name}


def test_attention_is_claimed_for_cuda_and_decomposed_for_cpu():
    cuda_symbols = _attention_symbols("cuda")
    cpu_symbols = _attention_symbols("cpu")
    assert cuda_symbols, "on CUDA Thunder's sdpa executor runs flash attention"
    assert not cpu_symbols, "on CPU the executor does not claim the op"
    with pytest.raises(ValueError, match="device_type must be one of cuda, cpu"):
        with meta.attention_as_on("tpu"):
            pass


def test_fake_ranks_shard_like_real_ones():
    # Four fake ranks: every parameter is sharded to a quarter of its first dimension (the test model's are all
    # divisible by 4), and the estimate's parameters are those shards, beside the unsharded buffers (RoPE's
    # cos and sin).
    spec = BY_NAME["llama"]
    model = litgpt_models.build(spec, dtype=torch.bfloat16, device="meta")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    step = emulate.trace_step(spec, mode="thunder-fsdp", shard="zero3", world_size=4, device_type="cpu")
    parameters = sum(a.nbytes for a in step.live_at_peak if a.category is Category.PARAMETER)
    assert buffers > 0 and parameters == full // 4 + buffers
    assert not torch.distributed.is_initialized()  # the fake group is gone after the trace


def test_bad_combinations_are_refused():
    spec = BY_NAME["neox"]
    with pytest.raises(ValueError, match="mode jit runs one process"):
        emulate.trace_step(spec, mode="jit", shard="zero2")
    with pytest.raises(ValueError, match="shard must be one of zero2, zero3"):
        emulate.trace_step(spec, mode="thunder-fsdp", shard=None, world_size=2)


def _fusions(device_type: str) -> set[str]:
    """The fusion symbols in the forward of a 1-block NeoX model traced on meta with ``default+cat``."""
    spec = BY_NAME["neox"]
    chosen = runtime.executors("default+cat")
    with meta.attention_as_on(device_type), meta.executors_as_on(device_type, chosen):
        jitted = thunder.jit(litgpt_models.build(spec, dtype=torch.bfloat16, device="meta"), executors=chosen)
        jitted(*litgpt_models.batch(spec, device="meta")).backward()
    return {b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols if b.sym.is_fusion}


def test_torch_compile_regions_are_claimed_for_cuda_only():
    # The cat executor claims rotary's cat on CUDA tensors; on meta for cuda it must too, and the region runs.
    assert any(name.startswith("TorchCompileCat") for name in _fusions("cuda"))
    assert not any(name.startswith("TorchCompileCat") for name in _fusions("cpu"))
