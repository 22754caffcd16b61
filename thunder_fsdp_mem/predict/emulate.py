"""One training step traced on the meta device as it would run on a target device and world size: no GPU, no
memory for the model and no other ranks needed.

``trace_step(spec, ...) -> StepMemory`` builds the litgpt model on the meta device, wraps it as the mode says
(``thunder.jit``, or Thunder's fsdp over ``meta.fake_ranks``), runs one forward, the eager cross-entropy and the
backward under ``meta.as_on`` (the traces as on the target device), and returns ``estimate_step`` of it with the
AdamW state the step would hold. ``mode="fsdp2"`` is composed by ``fsdp2.compose_step`` instead (FSDP2 cannot run
on meta). ``plan_step(spec, config, ...)`` is the step with ``FSDPMemoryTransform(config)``, a memory budget
included: under FSDP2 each block's transform gets its share of it (``fsdp2.fit_budget``).

For Thunder's fsdp on stablecode-3b and Llama-3-8B the estimate is the one the GPU run's own traces give, to the
byte; under FSDP2, the transform's record on meta is the GPU run's (docs/accuracy.md). The executors must be
the run's, ``cat`` region included: without it ThunderFX's block takes another recomputation plan.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import thunder

from thunder_fsdp_mem.analysis.phases import StepMemory
from thunder_fsdp_mem.analysis.step import estimate_step
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.loss.modules import LossModel
from thunder_fsdp_mem.predict import fsdp2
from thunder_fsdp_mem.predict.meta import as_on, fake_ranks
from thunder_fsdp_mem.training import litgpt_models, runtime
from thunder_fsdp_mem.transform import FSDPMemoryTransform

MODES = ("fsdp2", "thunder-fsdp", "jit")
SHARDS = runtime.SHARDS
LOSSES = ("eager", "trace")


def trace_step(
    spec: litgpt_models.ModelSpec,
    *,
    mode: str = "jit",
    shard: str | None = None,
    world_size: int = 1,
    device_type: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    micro_batch_size: int = 1,
    executors: str = "default+cat",
    transform: FSDPMemoryTransform | None = None,
    loss: str = "eager",
) -> StepMemory:
    """The estimated memory of one step (``StepMemory``) of ``spec`` on ``world_size`` ranks of ``device_type``,
    traced on the meta device. ``mode``: ``jit`` (one process), ``thunder-fsdp`` (Thunder's fsdp) or ``fsdp2``
    (FSDP2 through ThunderFX, composed by ``fsdp2.compose_step``); ``shard`` zero2 or zero3 for the last two.
    ``executors``: ``runtime.executors``' choice. ``transform``: the ``FSDPMemoryTransform`` to compile with, None
    for none (its ``rewrites`` then say what it did). ``loss``: ``eager``, cross-entropy after the compiled model,
    or ``trace``, the model and its loss compiled together (``LossModel``; which the transform chunks)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "jit" and (shard is not None or world_size != 1):
        raise ValueError("mode jit runs one process: no shard and a world size of 1")
    if mode != "jit" and shard not in SHARDS:
        raise ValueError(f"shard must be one of {', '.join(SHARDS)}; got {shard!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}")
    if mode == "fsdp2":
        return fsdp2.compose_step(
            spec,
            world_size=world_size,
            shard=shard,
            device_type=device_type,
            dtype=dtype,
            micro_batch_size=micro_batch_size,
            executors=executors,
            transform=transform,
            loss=loss,
        )
    transforms = [transform] if transform is not None else []  # fresh: thunder.jit keeps the list
    ranks = fake_ranks(world_size) if mode == "thunder-fsdp" else nullcontext()
    chosen = runtime.executors(executors)
    with ranks, as_on(device_type, chosen):
        torch.manual_seed(0)
        with torch.device("meta"):
            gpt = spec.gpt()
        gpt = gpt.to(dtype)
        model = LossModel(gpt) if loss == "trace" else gpt
        jitted = thunder.jit(model, executors=chosen, transforms=transforms)
        if mode == "thunder-fsdp":
            jitted = runtime.thunder_fsdp(jitted, shard=shard, device=torch.device("meta"))
        idx, targets = litgpt_models.batch(spec, micro_batch_size=micro_batch_size, device="meta")
        if loss == "trace":
            value = jitted(idx, targets)
        else:
            logits = jitted(idx)
            value = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        value.backward()
        optimizer = torch.optim.AdamW(jitted.parameters(), lr=1e-4)
        eager = "cross_entropy" if loss == "eager" else None
        return estimate_step(jitted, loss=eager, optimizer=optimizer, device_type=device_type)


def plan_step(spec: litgpt_models.ModelSpec, config: MemoryConfig, **options) -> tuple[StepMemory, FSDPMemoryTransform]:
    """``trace_step(spec, **options)`` with ``FSDPMemoryTransform(config)``, and that transform (its ``rewrites``
    say what it did). With a ``memory_budget`` under FSDP2 the blocks run with the ``saved_budget`` that
    ``fsdp2.fit_budget`` finds for the step."""
    if options.get("mode", "jit") == "fsdp2" and config.memory_budget is not None:
        options = {k: v for k, v in options.items() if k != "mode"}
        step, _, transform = fsdp2.fit_budget(spec, config, **options)
        return step, transform
    transform = FSDPMemoryTransform(config)
    return trace_step(spec, transform=transform, **options), transform
