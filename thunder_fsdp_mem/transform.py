"""``FSDPMemoryTransform``: the Thunder glue. It holds the configuration and hands each execution trace to the
passes; the trace it returns computes exactly what the trace it received computes.

Today it analyses nothing and rewrites nothing: the passes that choose what the forward saves, order ops for
peak memory and schedule all-gathers land in later changes (issues 4 and 5).
"""

from __future__ import annotations

from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform

from thunder_fsdp_mem.config import MemoryConfig


class FSDPMemoryTransform(Transform):
    """Lowers the memory of Thunder execution traces under FSDP without changing their results.

    Example::

        import thunder
        from thunder_fsdp_mem import FSDPMemoryTransform

        model = thunder.jit(model, transforms=[FSDPMemoryTransform()])
        # FSDP2 through ThunderFX:
        # torch.compile(model, backend=ThunderCompiler(transforms=[FSDPMemoryTransform()]))

    Limitations:
        - For now the transform returns every trace unchanged (rematerialisation, reordering and all-gather
          scheduling are being built).
        - It is stateless across traces: ThunderFX shares one instance across all subgraphs.
    """

    def __init__(self, config: MemoryConfig | None = None, *, strict: bool | None = None):
        if config is None:
            config = MemoryConfig(strict=bool(strict)) if strict is not None else MemoryConfig()
        elif strict is not None:
            raise ValueError("pass either config= or strict=, not both")
        if not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a MemoryConfig, got {type(config).__name__}")
        self.config = config

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        return computation_trace

    def __repr__(self) -> str:
        return f"FSDPMemoryTransform({self.config})"
