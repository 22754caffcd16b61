"""The one typed configuration of ``FSDPMemoryTransform``; the transform, the CLI and the benchmark build it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Options of ``FSDPMemoryTransform``.

    strict: raise instead of warning when a trace is not understood or a rewrite fails its checks (a warning
        returns the trace unchanged).
    """

    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"MemoryConfig.strict must be a bool, got {self.strict!r}")
