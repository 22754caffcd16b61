"""thunder_fsdp_mem: where the memory of a Thunder training step goes under FSDP, and a transform that lowers it.

- ``analyze(trace) -> MemoryTimeline``: storage liveness of one Thunder execution trace.
- ``estimate_step(fn) -> StepMemory``: peak memory of one forward and backward of a jitted module;
  ``estimate_traces(forward, backward)``: the same from two execution traces.
- ``FSDPMemoryTransform``: the Thunder transform (configured by ``MemoryConfig``).
"""

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.liveness import Allocation, InputSpec, MemoryTimeline, analyze
from thunder_fsdp_mem.analysis.step import StepMemory, estimate_step, estimate_traces
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.transform import FSDPMemoryTransform
from thunder_fsdp_mem.units import format_bytes

__all__ = [
    "Allocation",
    "Category",
    "FSDPMemoryTransform",
    "InputSpec",
    "MemoryConfig",
    "MemoryTimeline",
    "StepMemory",
    "analyze",
    "estimate_step",
    "estimate_traces",
    "format_bytes",
]
