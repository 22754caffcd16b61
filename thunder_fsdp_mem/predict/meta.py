"""The meta device as a stand-in for a target device and world size: what a trace made on the meta device would be
on CUDA or CPU, over fake ranks. The floor below the step's emulation (``emulate``) and the FSDP2 composition
(``fsdp2``).

- ``fake_ranks(world_size)``: within it, torch.distributed is torch's ``fake`` process group of ``world_size``
  ranks (collectives return at once with the right shapes) and this process is rank 0.
- ``attention_as_on(device_type)``: Thunder's sdpa executor asks CUDA which attention kernel torch would run and
  claims the op only for flash or memory-efficient attention. On the meta device there is no CUDA to ask, and
  the op would be decomposed into a T x T matrix that the GPU never allocates. For ``cuda`` the answer is the one
  torch gives on an H100 or H200 for litgpt's causal attention: flash for 16-bit inputs, memory-efficient for
  float32. For ``cpu`` it is the math kernel, which the executor does not claim, as on a CPU. ``fused``'s cuDNN
  attention (``training.cudnn_attention``) claims, for ``cuda``, what its shape and dtype rule allows (torch agrees
  on an H200 for litgpt's causal 16-bit attention), and nothing for ``cpu``.
- ``executors_as_on(device_type, executors)``: Thunder's torch.compile executors run their regions eagerly on
  meta (a region allocates its outputs, as the kernel torch.compile makes of it does on the device; inductor
  cannot compile for meta). Those that claim CUDA tensors only (``default+cat``'s rotary ``cat`` region) claim
  meta tensors too for ``cuda``; ``fused``'s, which claims every device's tensors, claims meta ones as it is.
- ``analysis.device.as_on(device_type)``: ``FSDPMemoryTransform`` takes a meta trace for one on ``device_type``:
  it folds casts with that device's tables, and a memory budget counts AdamW's step as torch runs it there.
- ``as_on(device_type, executors)``: the three above at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from thunder_fsdp_mem.analysis import device
from thunder_fsdp_mem.analysis.step import DEVICE_TYPES
from thunder_fsdp_mem.thunder_internals import implementations, sdpa_choice, set_implementations
from thunder_fsdp_mem.training import cudnn_attention


@contextmanager
def fake_ranks(world_size: int) -> Iterator[None]:
    """torch.distributed as ``world_size`` fake ranks, this process rank 0."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the report needs its own fake one")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def executors_as_on(device_type: str, executors: list) -> Iterator[None]:
    """Thunder's torch.compile executors among ``executors`` run their regions eagerly (a region allocates its
    outputs only, as the kernel torch.compile makes of it does on the device), and what they claim on CUDA tensors
    only they claim on meta tensors too when ``device_type`` is ``cuda``. Other executors are left as they are."""
    import thunder.executors.torch_compile as tc
    from thunder.extend import ImplInfo

    compiling = [ex for ex in executors if isinstance(ex, tc.TorchCompileExecutor)]
    if not compiling:
        yield
        return

    def on_cuda_or_meta(*args, **kwargs):
        from thunder.core.proxies import TensorProxy
        from torch.utils._pytree import tree_flatten

        flat, _ = tree_flatten((args, kwargs))
        return all(a.device.type in ("cuda", "meta") for a in flat if isinstance(a, TensorProxy))

    def claimed_as_on(info):
        if device_type != "cuda" or info.checker is not tc.cuda_device_checker:
            return info
        return ImplInfo(
            symbol=info.symbol,
            checker=on_cuda_or_meta,
            execution_transform=info.execution_transform,
            grad_transform=info.grad_transform,
        )

    original_maps = [implementations(ex) for ex in compiling]
    original_make = tc.make_compiled

    def make_eager(*args, **kwargs):
        compile_ = torch.compile
        torch.compile = lambda fn, **options: fn
        try:
            return original_make(*args, **kwargs)
        finally:
            torch.compile = compile_

    for ex in compiling:
        set_implementations(ex, {op: claimed_as_on(info) for op, info in implementations(ex).items()})
    tc.make_compiled = make_eager
    try:
        yield
    finally:
        tc.make_compiled = original_make
        for ex, implmap in zip(compiling, original_maps):
            set_implementations(ex, implmap)


@contextmanager
def attention_as_on(device_type: str) -> Iterator[None]:
    """Thunder's sdpa executor and ``cudnn_attention`` choose their kernels as they would on ``device_type`` (see the
    module's docstring)."""
    from thunder.executors.sdpaex import SpdaBackend as Backend

    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}; got {device_type!r}")

    def choice(query, *args, **kwargs):
        if device_type == "cpu":
            return Backend.MATH
        return Backend.FLASH_ATTENTION if query.dtype.bytes == 2 else Backend.MEMORY_EFFICIENT

    def cudnn_choice(query, key, value, attn_mask, dropout_p, is_causal, scale):
        return device_type == "cuda" and cudnn_attention.rule(query, key, value, attn_mask, dropout_p)

    original_cudnn = cudnn_attention.choose
    cudnn_attention.choose = cudnn_choice
    try:
        with sdpa_choice(choice):
            yield
    finally:
        cudnn_attention.choose = original_cudnn


@contextmanager
def as_on(device_type: str, executors: list) -> Iterator[None]:
    """Within it, a trace made on the meta device is what it would be on ``device_type``: attention's kernel,
    the torch.compile executors' claims and the casts ``FSDPMemoryTransform`` folds."""
    with attention_as_on(device_type), executors_as_on(device_type, executors), device.as_on(device_type):
        yield
