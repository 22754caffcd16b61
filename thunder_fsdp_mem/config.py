"""The one typed configuration of ``FSDPMemoryTransform``; the transform, the CLI and the benchmark build it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Options of ``FSDPMemoryTransform``.

    rematerialize: choose what the forward saves for backward by a minimum cut, recomputing cheap ops in
        backward (``recompute.py``).
    strict: raise instead of warning when a trace is not understood or a rewrite fails its checks (a warning
        returns the trace unchanged).
    """

    rematerialize: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"MemoryConfig.{f.name} must be a bool (True or False), got {value!r}")
