"""One training step traced on the meta device as it would run on a target device and world size: no GPU, no
memory for the model and no other ranks needed.

- ``fake_ranks(world_size)``: within it, torch.distributed is torch's ``fake`` process group of ``world_size``
  ranks (collectives return at once with the right shapes) and this process is rank 0.
- ``attention_as_on(device_type)``: Thunder's sdpa executor asks CUDA which attention kernel torch would run and
  claims the op only for flash or memory-efficient attention. On the meta device there is no CUDA to ask, and
  the op would be decomposed into a T x T matrix that the GPU never allocates. For ``cuda`` the answer is the one
  torch gives on an H100 or H200 for litgpt's causal attention: flash for 16-bit inputs, memory-efficient for
  float32. For ``cpu`` it is the math kernel, which the executor does not claim, as on a CPU.
- ``executors_as_on(device_type, executors)``: Thunder's torch.compile executors (``default+cat``'s rotary
  ``cat`` region) claim CUDA tensors only; for ``cuda`` they claim meta tensors too, and their regions run
  eagerly on meta (a region allocates its outputs, as the kernel torch.compile makes of it does on the GPU).
- ``casts.as_on(device_type)``: ``FSDPMemoryTransform`` folds casts with the tables of the device a trace runs on;
  a meta trace folds as on ``device_type``.
- ``as_on(device_type, executors)``: the three above at once.
- ``trace_step(spec, ...) -> StepMemory``: builds the litgpt model on the meta device, wraps it as the mode says
  (``thunder.jit``, or Thunder's fsdp over the fake ranks), runs one forward, the eager cross-entropy and the
  backward, and returns ``estimate_step`` of it with the AdamW state the step would hold. ``mode="fsdp2"`` is
  composed by ``fsdp2.compose_step`` instead (FSDP2 cannot run on meta).

For Thunder's fsdp on stablecode-3b and Llama-3-8B the estimate is the one the GPU run's own traces give, to the
byte; under FSDP2, the transform's record on meta is the GPU run's (docs/accuracy.md). Without the ``cat``
region, ThunderFX's block took another recomputation plan and the fsdp2+mem prediction was 27% high.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from thunder_fsdp_mem import casts, models

MODES = ("fsdp2", "thunder-fsdp", "jit")
SHARDS = ("zero2", "zero3")
DEVICE_TYPES = ("cuda", "cpu")


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
    """Thunder's torch.compile executors among ``executors`` claim meta tensors as they claim CUDA ones when
    ``device_type`` is ``cuda``, and run their regions eagerly (a region allocates its outputs only, as the
    kernel torch.compile makes of it does on the GPU). Other executors are left as they are."""
    import thunder.executors.torch_compile as tc
    from thunder.extend import ImplInfo

    claiming = [ex for ex in executors if isinstance(ex, tc.TorchCompileExecutor)] if device_type == "cuda" else []
    if not claiming:
        yield
        return

    def on_cuda_or_meta(*args, **kwargs):
        from thunder.core.proxies import TensorProxy
        from torch.utils._pytree import tree_flatten

        flat, _ = tree_flatten((args, kwargs))
        return all(a.device.type in ("cuda", "meta") for a in flat if isinstance(a, TensorProxy))

    original_maps = [ex._implmap for ex in claiming]
    original_make = tc.make_compiled

    def make_eager(*args, **kwargs):
        compile_ = torch.compile
        torch.compile = lambda fn, **options: fn
        try:
            return original_make(*args, **kwargs)
        finally:
            torch.compile = compile_

    for ex in claiming:
        ex._implmap = {op: ImplInfo(symbol=info.symbol, checker=on_cuda_or_meta,
                                    execution_transform=info.execution_transform, grad_transform=info.grad_transform)
                       for op, info in ex._implmap.items()}
    tc.make_compiled = make_eager
    try:
        yield
    finally:
        tc.make_compiled = original_make
        for ex, implmap in zip(claiming, original_maps):
            ex._implmap = implmap


@contextmanager
def attention_as_on(device_type: str) -> Iterator[None]:
    """Thunder's sdpa executor chooses its kernel as it would on ``device_type`` (see the module's docstring)."""
    import thunder.executors.sdpaex as sdpaex

    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}; got {device_type!r}")
    Backend = sdpaex.SpdaBackend

    def choice(query, *args, **kwargs):
        if device_type == "cpu":
            return Backend.MATH
        return Backend.FLASH_ATTENTION if query.dtype.bytes == 2 else Backend.MEMORY_EFFICIENT

    original = sdpaex._fused_sdp_choice
    sdpaex._fused_sdp_choice = choice
    try:
        yield
    finally:
        sdpaex._fused_sdp_choice = original


@contextmanager
def as_on(device_type: str, executors: list) -> Iterator[None]:
    """Within it, a trace made on the meta device is what it would be on ``device_type``: attention's kernel,
    the torch.compile executors' claims and the casts ``FSDPMemoryTransform`` folds."""
    with attention_as_on(device_type), executors_as_on(device_type, executors), casts.as_on(device_type):
        yield


def trace_step(spec: models.ModelSpec, *, mode: str = "jit", shard: str | None = None, world_size: int = 1,
               device_type: str = "cuda", dtype: torch.dtype = torch.bfloat16, micro_batch_size: int = 1,
               executors: str = "default+cat", memory=None):
    """The estimated memory of one step (``StepMemory``) of ``spec`` on ``world_size`` ranks of ``device_type``,
    traced on the meta device. ``mode``: ``jit`` (one process), ``thunder-fsdp`` (Thunder's fsdp) or ``fsdp2``
    (FSDP2 through ThunderFX, composed by ``fsdp2.compose_step``); ``shard`` zero2 or zero3 for the last two.
    ``executors``: ``runtime.executors``' choice. ``memory``: a ``MemoryConfig`` to run ``FSDPMemoryTransform``
    with, None for none."""
    import thunder

    from thunder_fsdp_mem import fsdp2, runtime
    from thunder_fsdp_mem.step import estimate_step
    from thunder_fsdp_mem.transform import FSDPMemoryTransform

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "jit" and (shard is not None or world_size != 1):
        raise ValueError("mode jit runs one process: no shard and a world size of 1")
    if mode != "jit" and shard not in SHARDS:
        raise ValueError(f"shard must be one of {', '.join(SHARDS)}; got {shard!r}")
    if mode == "fsdp2":
        return fsdp2.compose_step(spec, world_size=world_size, shard=shard, device_type=device_type, dtype=dtype,
                                  micro_batch_size=micro_batch_size, executors=executors, memory=memory)
    transforms = [FSDPMemoryTransform(memory)] if memory is not None else []
    ranks = fake_ranks(world_size) if mode == "thunder-fsdp" else nullcontext()
    chosen = runtime.executors(executors)
    with ranks, as_on(device_type, chosen):
        torch.manual_seed(0)
        with torch.device("meta"):
            from litgpt import GPT

            gpt = GPT(spec.config())
        gpt = gpt.to(dtype)
        jitted = thunder.jit(gpt, executors=chosen, transforms=transforms)
        if mode == "thunder-fsdp":
            jitted = runtime.thunder_fsdp(jitted, shard=shard, device=torch.device("meta"))
        idx, targets = models.batch(spec, micro_batch_size=micro_batch_size, device="meta")
        logits = jitted(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        optimizer = torch.optim.AdamW(jitted.parameters(), lr=1e-4)
        return estimate_step(jitted, loss="cross_entropy", optimizer=optimizer, device_type=device_type)
