"""``FSDPMemoryTransform``: the Thunder glue. It holds the configuration and hands each forward and its backward to
the passes (``passes.pipeline``) through the pass driver (``passes.driver``), which checks each rewrite, keeps it
only if the step's estimated peak does not rise, and records it. The traces it returns compute exactly what the
traces it received compute, except where a fusion executor ran and Thunder's own rematerialization meant a backward
fusion to recompute what it did not (``passes.fusions``): those results are Thunder's rematerialized ones.

Thunder calls ``transform_trace_post_optimization`` on a forward execution trace and right after on its
backward (under ``thunder.jit``, Thunder's ``fsdp`` and each ThunderFX subgraph alike). What the forward saves can
only be chosen with both in hand, so the forward call returns a trace of its own whose symbols the backward call
fills in, before Thunder turns either into Python.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
import warnings

from thunder.core.compile_data import get_compile_data
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform
from thunder.distributed import FSDPType

from thunder_fsdp_mem.analysis.optimizer import parameter_order
from thunder_fsdp_mem.attention import route_attention
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.loss.rewrite import rewrite_losses
from thunder_fsdp_mem.passes.driver import Outcome, Pair, Rewrite, run_passes
from thunder_fsdp_mem.passes.budget import cap_shortfall, estimator, unmet_warning
from thunder_fsdp_mem.passes.pipeline import CHUNKED_LOSS, DECLARED, ROUTED_ATTENTION, pipeline
from thunder_fsdp_mem.units import format_bytes


class FSDPMemoryTransform(Transform):
    """Lowers the memory of Thunder execution traces under FSDP, keeping the results of the program Thunder means
    to run.

    Example::

        import thunder
        from thunder_fsdp_mem import FSDPMemoryTransform

        transform = FSDPMemoryTransform()
        model = thunder.jit(model, transforms=[transform])
        model(x).sum().backward()
        print(transform.summary())   # what each pass did to each forward/backward pair
        # FSDP2 through ThunderFX:
        # torch.compile(model, backend=ThunderCompiler(transforms=[FSDPMemoryTransform()]))

    Results: with fusion executors (nvFuser, torch.compile) a backward fusion recomputes what Thunder's own
    rematerialization means it to and its order of pairs stopped (``MemoryConfig.fusion_rematerialize``, on by
    default; under ThunderFX the float32 intermediates of each block): the results are then Thunder's
    rematerialized ones, which differ from the run without the transform by rounding. Every other pass, and every
    pass with ``MemoryConfig(fusion_rematerialize=False)``, keeps the untransformed run's results bit for bit.

    Where the program ends in a cross-entropy on a linear layer's output (``LossModel``), it computes them together
    as a chunked linear cross-entropy (``MemoryConfig.chunk_loss``, on by default): one chunk of logits alive at a
    time; its results differ from Thunder's loss by rounding (``docs/accuracy.md``).

    Where a fusion executor listed ahead of the attention executors claims attention without a grad rule (Thunder
    would differentiate its decomposition and save its (T, T) probabilities), it has the first attention executor
    listed that accepts the call run it, forward and backward (``MemoryConfig.route_attention``, on by default; the
    results are that executor's). Attention that nothing can run so is decomposed, and the cut recomputes its
    probabilities in backward from the query and key, bit for bit.

    It runs each 16-bit elementwise op that Thunder brackets between float32 casts as one op where ATen gives the
    same bits (``MemoryConfig.fold_casts``); it chooses what the forward saves for backward
    (``MemoryConfig.rematerialize``, ``recompute_weight``); it orders each trace for a lower peak (``reorder``);
    under Thunder's fsdp it issues all-gathers in a window and, with ZeRO3, gathers parameters again in backward
    (``gathers``, ``max_inflight_allgathers``, ``regather``), and issues each reduce-scatter as soon as its
    gradient is complete (``scatters``, ``max_inflight_reduce_scatters``). Under Thunder's fsdp, either jit first
    and shard after, or list it after the FSDPTransform::

        model = fsdp(thunder.jit(model, transforms=[FSDPMemoryTransform()]), sharding_strategy=FSDPType.ZERO3)
        model = thunder.jit(model, transforms=[FSDPTransform(device=device, sharding_strategy=FSDPType.ZERO3),
                                               FSDPMemoryTransform()])

    ``rewrites`` lists what every pass did to every pair (``passes.driver.Rewrite``); ``summary()`` renders it.
    A pass that meets a trace it does not understand leaves it as it was, with a warning (``strict=True``: raises).

    Limitations: it holds one forward between Thunder's forward and backward calls and nothing after (ThunderFX
    shares one instance across all subgraphs).
    """

    def __init__(self, config: MemoryConfig | None = None, *, strict: bool | None = None):
        if config is None:  # MemoryConfig validates strict
            config = MemoryConfig(strict=strict) if strict is not None else MemoryConfig()
        elif strict is not None:
            raise ValueError("pass either config= or strict=, not both")
        if not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a MemoryConfig, got {type(config).__name__}")
        self.config = config
        self._pending: tuple[TraceCtx, TraceCtx] | None = None  # (the trace we returned, the forward received)
        self._pairs = 0
        self.rewrites: list[Rewrite] = []
        self._said: set[str] = set()  # the passes it has warned about

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        """Before autograd: attention kept on an attention executor where a fusion executor listed first would have
        Thunder differentiate its decomposition (``MemoryConfig.route_attention``, ``attention.route_attention``),
        and a cross-entropy on a linear layer's output made the chunked linear cross-entropy
        (``MemoryConfig.chunk_loss``), whose forward and backward Thunder then derives from its grad rule."""
        if self.config.route_attention:
            executors = kwargs.get("executors_list") or getattr(get_compile_data(), "executors_list", ())
            computation_trace = self._before_autograd(
                ROUTED_ATTENTION, computation_trace, lambda trace: _routed(trace, executors)
            )
        if self.config.chunk_loss:
            computation_trace = self._before_autograd(CHUNKED_LOSS, computation_trace, _chunked)
        return prologue_trace, computation_trace, epilogue_trace

    def _before_autograd(self, what: str, trace: TraceCtx, rewrite) -> TraceCtx:
        """``rewrite(trace) -> (trace, notes)`` recorded as ``what``: one ``Rewrite`` per (applied, note), ``APPLIED``
        or ``LEFT``; a trace the rewrite does not understand stays as it was."""
        started = time.perf_counter()
        try:
            rewritten, notes = rewrite(trace)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            self.rewrites.append(Rewrite(what, Outcome.REFUSED, self._pairs, note=why))
            self._refused(what, why)
            return trace
        seconds = time.perf_counter() - started
        for applied, note in notes:
            outcome = Outcome.APPLIED if applied else Outcome.LEFT
            self.rewrites.append(Rewrite(what, outcome, self._pairs, seconds=seconds, note=note))
        return rewritten

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        c = self.config
        if not any(declared.enabled(c) for declared in DECLARED):
            return computation_trace
        if TraceTag.AUGMENTED_FORWARD in computation_trace.tags:
            placeholder = from_trace(computation_trace)
            placeholder.bound_symbols = list(computation_trace.bound_symbols)
            placeholder.set_provenance(TraceProvenance("FSDPMemoryTransform (forward)"))
            self._pending = (placeholder, computation_trace)
            return placeholder
        if TraceTag.BACKWARD in computation_trace.tags:
            pending, self._pending = self._pending, None
            if pending is None:
                why = "a backward trace came without its forward"
                self.rewrites.append(Rewrite("transform", Outcome.REFUSED, self._pairs, note=why))
                self._refused("transform", why)
                return computation_trace
            placeholder, forward = pending
            pair = Pair(forward, computation_trace)
            cd = get_compile_data()
            judge = estimator(c, pair, parameter_order(getattr(cd, "fn", None)))
            said: list[tuple[str, str]] = []  # said once every pass has run, of the pair returned
            pair, records = run_passes(
                pair,
                pipeline(c, regather=self._regathers()),
                on_refused=self._refused,
                on_warning=lambda what, message: said.append((what, message)),
                index=self._pairs,
                estimator=judge,
                shortfall=cap_shortfall(c),
            )
            if said and c.budgeted:  # a budget missed: said of the pair returned, where that misses it too
                final = unmet_warning(c, judge(pair.forward, pair.backward))
                said = [(what, final) for what, _ in said] if final is not None else []
            for what, message in said:
                self._warned(what, message)
            self._pairs += 1
            self.rewrites.extend(records)
            placeholder.bound_symbols = pair.forward.bound_symbols
            if pair.forward is not forward:
                placeholder.set_provenance(pair.forward.get_provenance())
            return pair.backward
        return computation_trace

    def summary(self, details: bool = False) -> str:
        """What the transform did: by default one line per pass that changed or refused something (its figures
        in MiB/GiB: the step's estimated peak, what the forward saves, the estimated time recomputation adds), and
        one line for the pairs where nothing changed; ``details``: every pass on every pair, with its note."""
        if not self.rewrites:
            return "FSDPMemoryTransform: no forward/backward pair seen yet"
        lines = [f"FSDPMemoryTransform: {self._pairs} forward/backward pair(s)"]
        if details:
            return "\n".join(lines + _detailed(self.rewrites))
        pairs = dict.fromkeys(r.pair for r in self.rewrites)
        quiet = []
        for pair in pairs:
            changed = [r for r in self.rewrites if r.pair == pair and r.outcome is not Outcome.UNCHANGED]
            if not changed:
                quiet.append(pair)
            lines.extend(f"pair {pair}: {r.pass_name}: {_short(r)}" for r in changed)
        if quiet:
            lines.append(f"nothing changed in {len(quiet)} pair(s): {_ranges(quiet)}")
        return "\n".join(lines)

    @property
    def pairs(self) -> int:
        """How many forward/backward pairs the passes have run on."""
        return self._pairs

    def _regathers(self) -> bool:
        """Gather parameters again in backward: as ``regather`` says, else where the model is sharded with ZeRO3."""
        if self.config.regather is not None:
            return self.config.regather
        cd = get_compile_data()
        strategies = [getattr(t, "sharding_strategy", None) for t in getattr(cd, "transforms", None) or ()]
        return FSDPType.ZERO3 in strategies

    def _refused(self, what: str, why: str) -> None:
        self._warned(what, f"refused, its traces left as they were: {why}")

    def _warned(self, what: str, message: str) -> None:
        """Raise under ``strict``; else warn once per pass (every block of a model, every ThunderFX graph and every
        recompilation would say it again; ``summary()`` keeps each), at the user's line that compiled."""
        message = f"FSDPMemoryTransform: pass '{what}' {message}"
        if self.config.strict:
            raise RuntimeError(message)
        if what in self._said:
            return
        self._said.add(what)
        warnings.warn(message, stacklevel=_user_stacklevel())

    def __repr__(self) -> str:
        """An expression that makes this transform again with nothing but Python (ThunderFX's reproducer scripts
        write each transform of ``thunder.jit`` as its repr, under ``import thunder`` alone): the configuration's
        fields that differ from their defaults."""
        changed = ", ".join(
            f"{f.name}={getattr(self.config, f.name)!r}"
            for f in dataclasses.fields(self.config)
            if getattr(self.config, f.name) != f.default
        )
        package = '__import__("thunder_fsdp_mem")'
        return f"{package}.FSDPMemoryTransform({package}.MemoryConfig({changed}))"


_LIBRARIES = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (sys.modules["thunder"], sys.modules["torch"], sys.modules[__package__])
)


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from ``_warned``, of the first frame outside Thunder, torch and this
    package: the user's line that compiled or ran the model (the last frame where every one is inside)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARIES + ("<",)):
        frame, level = frame.f_back, level + 1
    return level


def _routed(trace: TraceCtx, executors) -> tuple[TraceCtx, list[tuple[bool, str]]]:
    trace, found = route_attention(trace, executors)
    alike = collections.Counter(found)  # one note for the calls of every layer alike
    return trace, [(r.runs_on is not None, r.describe(count)) for r, count in alike.items()]


def _chunked(trace: TraceCtx) -> tuple[TraceCtx, list[tuple[bool, str]]]:
    trace, found, left = rewrite_losses(trace)
    notes = []
    for f in found:
        rows, vocab = f.logits_shape
        softcap = f", soft-capped at {f.softcap:g}" if f.softcap is not None else ""
        notes.append(
            (True, f"{f.dtype} logits ({rows}, {vocab}){softcap}, now in chunks (how many: the loss chunks pass)")
        )
    notes.extend((False, why.describe()) for why in dict.fromkeys(left))  # once per reason, as layers repeat
    return trace, notes


def _short(r: Rewrite) -> str:
    """One pass's outcome in a few words and figures."""
    if r.outcome is not Outcome.APPLIED:
        return f"{r.outcome.value}" + (f": {r.note.split(';')[0]}" if r.note else "")
    parts = []
    if r.peak_before is not None:
        parts.append(f"peak {format_bytes(r.peak_before)} -> {format_bytes(r.peak_after)}")
        if r.saved_after != r.saved_before:
            parts.append(f"saves {format_bytes(r.saved_after)} for backward, not {format_bytes(r.saved_before)}")
    if r.added_seconds:
        parts.append(f"adds an estimated {1e3 * r.added_seconds:.2f} ms")
    if not parts and r.note:
        parts.append(r.note)
    return "; ".join(parts) or "applied"


def _detailed(rewrites: list[Rewrite]) -> list[str]:
    lines = []
    width = max(len(r.pass_name) for r in rewrites)
    pair = None
    for r in rewrites:
        if r.pair != pair:
            pair = r.pair
            lines.append(f"pair {pair}:")
        figures = ""
        if r.peak_before is not None:
            figures = (
                f"peak {format_bytes(r.peak_before)} -> {format_bytes(r.peak_after)}, saved "
                f"{format_bytes(r.saved_before)} -> {format_bytes(r.saved_after)}"
            )
        detail = "; ".join(x for x in (figures, r.note) if x)
        lines.append(
            f"  {r.pass_name:<{width}}  {r.outcome.value}{': ' + detail if detail else ''} ({r.seconds:.3f} s)"
        )
    return lines


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
