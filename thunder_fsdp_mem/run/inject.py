"""``FSDPMemoryTransform`` added to every Thunder function a program builds, without editing the program.

Every way into Thunder ends in ``thunder.jit``: the program's own calls, ``ThunderCompiler`` (which imports
``thunder.jit`` when Dynamo hands it a graph, once per subgraph), ``thunder.compile``'s recipes and Thunder's
``fsdp`` over a jitted module. ``injected(config, executors=...)`` patches that one function for as long as it is
entered: each call gets a new ``FSDPMemoryTransform(config)`` after the transforms the program passed (none is added
where the program passed one already), and, where ``executors`` names a choice of ``training.runtime.executors``,
that list instead of the program's. A call that passes a transform of ours again (Thunder's ``fsdp`` jits the module
again with its own transform added) is the same function, not a new one. ``Injection.programs`` lists what was
compiled, in order (``Program``).

A program that imported ``thunder.jit`` under another name before the patch (``from thunder import jit`` at the top
of a module imported earlier) keeps the original; the runner patches before it runs the program, so the program's
own imports see the patch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import thunder
import torch

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.training import runtime
from thunder_fsdp_mem.transform import FSDPMemoryTransform


@dataclass(frozen=True, slots=True)
class Program:
    """One ``thunder.jit`` call of the program: ``kind`` (``thunder.jit``, or ``ThunderFX subgraph`` for a graph
    Dynamo handed to ``ThunderCompiler``), the transform it was given (None where the program passed its own
    ``FSDPMemoryTransform``, ``own`` then), and ``replaced``: the names of the program's executors where
    ``executors`` replaced them."""

    kind: str
    transform: FSDPMemoryTransform | None
    own: FSDPMemoryTransform | None = None
    replaced: tuple[str, ...] | None = None


@dataclass(slots=True)
class Injection:
    """What ``injected`` made: ``programs`` in the order compiled, ``executors`` the names of the list given instead
    of the program's (None: the program's kept)."""

    config: MemoryConfig
    executors: tuple[str, ...] | None = None
    programs: list[Program] = field(default_factory=list)


@contextmanager
def injected(config: MemoryConfig, *, executors: str | None = None) -> Iterator[Injection]:
    """Within it, every ``thunder.jit`` call takes ``FSDPMemoryTransform(config)`` (see the module's docstring);
    ``executors``: a choice of ``training.runtime.EXECUTOR_CHOICES`` given instead of the program's executors."""
    chosen = runtime.executors(executors) if executors is not None else None
    injection = Injection(config, None if chosen is None else tuple(ex.name for ex in chosen))
    original = thunder.jit

    @functools.wraps(original)
    def jit(fn, /, *args, transforms=None, executors=None, **kwargs):
        transforms = list(transforms or [])  # a fresh list: Thunder keeps and appends to the one it is given
        own = next((t for t in transforms if isinstance(t, FSDPMemoryTransform)), None)
        again = own is not None and any(p.transform is own for p in injection.programs)
        replaced = None
        if chosen is not None:
            replaced = None if again else tuple(_names(executors))
            executors = list(chosen)
        if again:  # Thunder jits a function of ours again (its fsdp adds a transform so): the same function
            return original(fn, *args, transforms=transforms, executors=executors, **kwargs)
        ours = None
        if own is None:
            ours = FSDPMemoryTransform(config)
            transforms.append(ours)
        kind = "ThunderFX subgraph" if isinstance(fn, torch.fx.GraphModule) else "thunder.jit"
        injection.programs.append(Program(kind, ours, own, replaced))
        return original(fn, *args, transforms=transforms, executors=executors, **kwargs)

    thunder.jit = jit
    try:
        yield injection
    finally:
        thunder.jit = original


def _names(executors) -> list[str]:
    """The names of a program's executors as it passed them (None: Thunder's defaults)."""
    if executors is None:
        return [f"{ex.name} (default)" for ex in thunder.get_default_executors()]
    return [ex if isinstance(ex, str) else ex.name for ex in executors]
