"""How a pass declares itself to the pipeline: its name, the ``MemoryConfig`` switches that turn it on, what it
rewrites, and the function that proposes its rewrite.

Each pass module exposes one ``Declaration`` (``PASS``); ``pipeline.DECLARED`` lists them in the order the driver runs
them, and ``Declaration.bound(config)`` gives the driver what it runs (``Bound``, a ``driver.Pass``): the name and the
order of a pass are declared here alone. A declaration's ``scope`` is checked on every proposal: a pass declared on the
backward alone that proposes a new forward is refused (``PassError``, which the driver records as ``REFUSED``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes.driver import Context, Pair, PassError, Proposal


class Scope(str, Enum):
    """What a pass rewrites."""

    EACH_TRACE = "the forward and the backward, each alone"
    PAIR = "the forward and its backward together"
    BACKWARD = "the backward alone"


@dataclass(frozen=True, slots=True)
class Declaration:
    """One pass as the pipeline lists it.

    name: its name in the driver's records and the transform's summary.
    switches: the ``MemoryConfig`` fields (bools) that must all be True for it to run.
    scope: what it rewrites (``Scope``); ``Scope.BACKWARD``: its proposals keep the forward as it came.
    propose: ``propose(pair, context, config) -> Proposal``; ``config`` with ``regather`` resolved (a bool).
    after: the name of a pass that must have been applied earlier in the same run for this one to run.
    """

    name: str
    switches: tuple[str, ...]
    scope: Scope
    propose: Callable[[Pair, Context, MemoryConfig], Proposal]
    after: str | None = None

    def enabled(self, config: MemoryConfig) -> bool:
        return all(getattr(config, switch) for switch in self.switches)

    def bound(self, config: MemoryConfig) -> Bound:
        """The driver's ``Pass``: this declaration with ``config``."""
        return Bound(self, config)

    def again_after(self, other: Declaration) -> Declaration:
        """This pass run once more after ``other``, where ``other`` was applied (both switched on): for a pass that
        finds new work in what ``other`` wrote."""
        return Declaration(
            f"{self.name} after {other.name}",
            (*self.switches, *other.switches),
            self.scope,
            self.propose,
            after=other.name,
        )


@dataclass(frozen=True, slots=True)
class Bound:
    """A declared pass with the config it runs under, what the driver runs (``driver.Pass``): its name and order
    are its declaration's; ``run`` is ``propose`` with ``config``, its scope checked."""

    declaration: Declaration
    config: MemoryConfig

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def after(self) -> str | None:
        return self.declaration.after

    def run(self, pair: Pair, context: Context) -> Proposal:
        declared = self.declaration
        proposal = declared.propose(pair, context, self.config)
        if declared.scope is Scope.BACKWARD and proposal.forward is not pair.forward:
            raise PassError(f"pass '{declared.name}' rewrites the backward alone, yet proposed a new forward")
        return proposal
