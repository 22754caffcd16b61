"""The pass driver: every pass of ``FSDPMemoryTransform`` is run, checked, judged and recorded the same way.

A pass (``Pass``, a ``declaration.Declaration`` bound to a config) takes a forward and its backward (``Pair``) and
proposes a new pair (``Proposal``); it may read the estimate of the pair it is given (``Context.estimate``).
``run_passes(pair, passes, on_refused, estimator)`` runs each in order and, for each:
- times it;
- where the proposal is the pair itself, records ``UNCHANGED``;
- checks each rewritten trace (``checks.check_rewrite``, with what the pass says may differ: the saved tensors,
  the order of collectives it schedules itself, the collectives it adds);
- estimates the proposal with ``estimator`` (``step.estimate_traces``, the one estimator, with the loss and the
  optimizer state a memory budget counts; a pass that already judged its proposal with it hands the estimate
  over; a proposal with the forward unchanged reuses the forward's analysis), and keeps it only if the step's
  estimated peak does not rise (``APPLIED``, else ``RAISES_PEAK``) and, given ``shortfall`` (by how many bytes a
  step misses the device's memory cap when the caching allocator is replayed over it), only if that does not
  rise either (else ``MISSES_CAP``: another order of the same allocations can leave no cached block large enough);
- where the pass raises ``PassError`` (a trace it does not understand) or a check fails, records ``REFUSED`` with
  the reason and calls ``on_refused`` (the transform warns, or raises under ``strict``); the next pass goes on from
  the pair as it was;
- where the pass has something to say of a proposal it makes anyway (a budget it could not meet), calls
  ``on_warning``. A proposal that meets a budget of saved bytes (``Proposal.budgeted``: a ThunderFX block's, set
  from the step's budget, whose own peak is not the step's) is kept though the pair's own peak rises.
Every run of every pass leaves one typed ``Rewrite``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.phases import StepMemory
from thunder_fsdp_mem.analysis.step import estimate_traces
from thunder_fsdp_mem.passes.checks import CheckError, check_rewrite

log = logging.getLogger(__name__)


class PassError(ValueError):
    """A pass met a trace it does not understand; the message says what did not match."""


@dataclass(frozen=True, slots=True)
class Pair:
    """A forward execution trace and its backward."""

    forward: TraceCtx
    backward: TraceCtx


@dataclass(frozen=True, slots=True)
class Checks:
    """What a rewritten trace may do differently (``checks.check_rewrite``): return other saved tensors
    (``ignore_saved``), issue its collectives in an order of its own (``ordered=False``), issue ``added`` ones."""

    ignore_saved: bool = False
    ordered: bool = True
    added: tuple = ()


@dataclass(frozen=True, slots=True)
class Recomputed:
    """Symbols the backward runs again that share an op and a source line (one per layer of a model): how many,
    and their estimated time together (``cost.op_seconds``)."""

    symbol: str
    source: str | None
    count: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Proposal:
    """A pass's new pair, what its checks allow, what it says it did (``note``; what it recomputes, and the
    estimated time that adds), and, where the pass judged it with the estimator already, its ``estimate``.
    ``warning``: what the pass has to say of it (a budget not met); ``budgeted``: it meets a budget of saved bytes,
    and is kept though the pair's own peak rises."""

    forward: TraceCtx
    backward: TraceCtx
    forward_checks: Checks = Checks()
    backward_checks: Checks = Checks()
    note: str = ""
    estimate: StepMemory | None = None
    recomputed: tuple[Recomputed, ...] = ()
    seconds: float | None = None
    warning: str | None = None
    budgeted: bool = False


Estimator = Callable[..., StepMemory]  # (forward, backward=None, *, reuse=None) -> StepMemory


class Context:
    """What a pass may read besides the pair: the estimate of the pair it is given, made once when first asked,
    and the estimator that judges the run."""

    def __init__(self, pair: Pair, estimator: Estimator = estimate_traces, estimate: StepMemory | None = None):
        self.pair = pair
        self.estimator = estimator
        self._estimate = estimate

    def estimate(self) -> StepMemory:
        if self._estimate is None:
            self._estimate = self.estimator(self.pair.forward, self.pair.backward)
        return self._estimate

    @property
    def estimated(self) -> StepMemory | None:
        return self._estimate


class Pass(Protocol):
    """What the driver runs of one pass: its ``name``, ``after`` (the name of a pass that must have been applied
    earlier in the same run for this one to run: a pass that only finds work after another's) and
    ``run(pair, context) -> Proposal``. A pass declares its name and order once, in its ``declaration.Declaration``;
    ``Declaration.bound(config)`` is what the driver is given."""

    @property
    def name(self) -> str: ...

    @property
    def after(self) -> str | None: ...

    def run(self, pair: Pair, context: Context) -> Proposal: ...


class Outcome(str, Enum):
    """What became of one pass on one pair. ``LEFT``: it found what it acts on and could not act on it (the note
    says why and what would let it)."""

    APPLIED = "applied"
    UNCHANGED = "nothing to change"
    LEFT = "left as it was"
    RAISES_PEAK = "kept out: it would raise the estimated peak"
    MISSES_CAP = "kept out: the caching allocator would miss the memory cap by more"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Rewrite:
    """One pass on one forward/backward pair: what became of it, the step's estimated peak and saved-for-backward
    bytes before and after (None where nothing was estimated), the seconds it took (checks and estimates
    included), and ``note``: what the pass did, or why it was refused. ``pair``: which pair the transform saw (0 for
    the first). ``recomputed``, ``added_seconds``: what a rematerialization has the backward run again, and its
    estimated time on the device."""

    pass_name: str
    outcome: Outcome
    pair: int = 0
    peak_before: int | None = None
    peak_after: int | None = None
    saved_before: int | None = None
    saved_after: int | None = None
    seconds: float = 0.0
    note: str = ""
    recomputed: tuple[Recomputed, ...] = ()
    added_seconds: float | None = None


def run_passes(
    pair: Pair,
    passes: Sequence[Pass],
    *,
    on_refused: Callable[[str, str], None],
    on_warning: Callable[[str, str], None] | None = None,
    index: int = 0,
    estimator: Estimator = estimate_traces,
    shortfall: Callable[[StepMemory], int] | None = None,
) -> tuple[Pair, tuple[Rewrite, ...]]:
    """The pair after every pass of ``passes`` (see the module's docstring), and one ``Rewrite`` per pass that ran.
    ``on_refused(pass name, reason)`` is called for each refusal, ``on_warning(pass name, what)`` for each warning
    (None: ``on_refused``); ``index``: the pair's number in the records; ``shortfall``: see the module's
    docstring (None: no cap)."""
    records: list[Rewrite] = []
    applied: set[str] = set()
    context = Context(pair, estimator)
    warn = on_warning if on_warning is not None else on_refused
    for p in passes:
        if p.after is not None and p.after not in applied:
            continue
        start = time.perf_counter()
        record, pair, context = _run_one(p, pair, context, index, warn, shortfall)
        record = replace(record, seconds=time.perf_counter() - start)
        records.append(record)
        if record.outcome is Outcome.APPLIED:
            applied.add(p.name)
        elif record.outcome is Outcome.REFUSED:
            on_refused(p.name, record.note)
        log.debug(
            "FSDPMemoryTransform pass %s on pair %d: %s (peak %s -> %s) in %.3f s",
            p.name,
            index,
            record.outcome.value,
            record.peak_before,
            record.peak_after,
            record.seconds,
        )
    return pair, tuple(records)


def _run_one(
    p: Pass,
    pair: Pair,
    context: Context,
    index: int,
    warn: Callable[[str, str], None],
    shortfall: Callable[[StepMemory], int] | None,
) -> tuple[Rewrite, Pair, Context]:
    try:
        proposal = p.run(pair, context)
        if proposal.warning is not None:
            warn(p.name, proposal.warning)
        if proposal.forward is pair.forward and proposal.backward is pair.backward:
            return Rewrite(p.name, Outcome.UNCHANGED, index, note=proposal.note), pair, context
        if proposal.forward is not pair.forward:
            check_rewrite(pair.forward, proposal.forward, **_kwargs(proposal.forward_checks))
        if proposal.backward is not pair.backward:
            check_rewrite(pair.backward, proposal.backward, **_kwargs(proposal.backward_checks))
    except (PassError, CheckError) as e:
        return Rewrite(p.name, Outcome.REFUSED, index, note=str(e)), pair, context
    before = context.estimate()
    after = proposal.estimate
    if after is None:
        reuse = before if proposal.forward is pair.forward else None
        after = context.estimator(proposal.forward, proposal.backward, reuse=reuse)
    figures = dict(
        peak_before=before.peak_bytes,
        peak_after=after.peak_bytes,
        saved_before=before.saved_bytes,
        saved_after=after.saved_bytes,
        note=proposal.note,
        recomputed=proposal.recomputed,
        added_seconds=proposal.seconds,
    )
    if after.peak_bytes > before.peak_bytes and not proposal.budgeted:
        log.info(
            "FSDPMemoryTransform: %s kept out, it would raise the estimated peak from %d to %d bytes",
            p.name,
            before.peak_bytes,
            after.peak_bytes,
        )
        return Rewrite(p.name, Outcome.RAISES_PEAK, index, **figures), pair, context
    if shortfall is not None and shortfall(after) > shortfall(before):
        log.info(
            "FSDPMemoryTransform: %s kept out, the allocator's replay would miss the cap by %d bytes, not %d",
            p.name,
            shortfall(after),
            shortfall(before),
        )
        return Rewrite(p.name, Outcome.MISSES_CAP, index, **figures), pair, context
    new = Pair(proposal.forward, proposal.backward)
    return Rewrite(p.name, Outcome.APPLIED, index, **figures), new, Context(new, context.estimator, after)


def _kwargs(checks: Checks) -> dict:
    return {"ignore_saved": checks.ignore_saved, "ordered": checks.ordered, "added": checks.added}
