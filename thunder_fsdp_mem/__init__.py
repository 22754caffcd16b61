"""thunder_fsdp_mem: where the memory of a Thunder training step goes under FSDP, and a transform that lowers it.

- ``analyze(trace) -> MemoryTimeline``: storage liveness of one Thunder execution trace.
- ``estimate_step(fn) -> StepMemory``: peak memory of one forward and backward of a jitted module;
  ``estimate_traces(forward, backward)``: the same from two execution traces.
- ``FSDPMemoryTransform``: the Thunder transform (configured by ``MemoryConfig``).
- ``LossModel``: a model and its cross-entropy in one module, so that the compiled step ends in the loss (which
  the transform then chunks).
- ``chunked_linear_cross_entropy(hidden, weight, targets)``: the same chunked loss as a plain autograd function,
  for a loss computed after the compiled model.
- ``plan_fsdp2(model, memory_budget=..., tokens=...) -> MemoryConfig``: the transform's configuration that fits a
  per-rank budget under FSDP2 through ThunderFX; ``shard_fsdp2(gpt, shard, root=LossModel(gpt))``: FSDP2's
  ``fully_shard`` on a litgpt model as the plan models it.

The names are imported when first asked for, so that importing a module of the package (the CLI's, whose
``--help`` answers at once) does not import Thunder and torch.
"""

import importlib

from thunder_fsdp_mem import versions

versions.check()  # one line where torch, lightning-thunder or litgpt is outside the supported range

_WHERE = {
    "Category": "thunder_fsdp_mem.analysis.categories",
    "Allocation": "thunder_fsdp_mem.analysis.timeline",
    "InputSpec": "thunder_fsdp_mem.analysis.timeline",
    "MemoryTimeline": "thunder_fsdp_mem.analysis.timeline",
    "analyze": "thunder_fsdp_mem.analysis.liveness",
    "StepMemory": "thunder_fsdp_mem.analysis.phases",
    "estimate_step": "thunder_fsdp_mem.analysis.step",
    "estimate_traces": "thunder_fsdp_mem.analysis.step",
    "MemoryConfig": "thunder_fsdp_mem.config",
    "LossModel": "thunder_fsdp_mem.loss.modules",
    "vectorize_window_masks": "thunder_fsdp_mem.window_mask",
    "chunked_linear_cross_entropy": "thunder_fsdp_mem.loss.function",
    "FSDPMemoryTransform": "thunder_fsdp_mem.transform",
    "format_bytes": "thunder_fsdp_mem.units",
    "plan_fsdp2": "thunder_fsdp_mem.predict.plan",
    "shard_fsdp2": "thunder_fsdp_mem.training.modes",
    "FSDPMemoryPlugin": "thunder_fsdp_mem.plugin",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'thunder_fsdp_mem' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
