"""What would lower a step's peak: ``advice(step) -> tuple[Advice, ...]``, a line or two the report prints after
its tables. A peak in a phase without a trace (the eager loss, the optimizer's step) is advised against with what
that phase holds and what the peak would fall to without it; a category that holds ``ADVICE_SHARE`` of the peak or
more (saved activations, gathered parameters) with the option that trades it away."""

from __future__ import annotations

from dataclasses import dataclass

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.phases import Stage, StepMemory
from thunder_fsdp_mem.units import format_bytes


@dataclass(frozen=True, slots=True)
class Advice:
    """What would lower a step's peak, and by how much at most (``saving_bytes``, predicted: the peak would move
    to the next highest phase if that is higher)."""

    text: str
    saving_bytes: int


ADVICE_SHARE = 0.1  # what a category must hold of the peak for advice about it

# A peak in one of these phases: what holds it ({held}, {symbol}: the peak's symbol) and what would remove it.
_PHASE_ADVICE = {
    Stage.LOSS: (
        "The peak is in the eager cross-entropy: its log_softmax, the nll_loss gradient and the logits' gradient "
        "hold {held}. Compute the loss in the compiled step (thunder_fsdp_mem.LossModel; --loss trace): the "
        "transform chunks it with the head's matmul, so that one chunk of logits is alive at a time (or, with the "
        "loss kept after the model, thunder_fsdp_mem.chunked_linear_cross_entropy on the final norm's output)"
    ),
    Stage.OPTIMIZER: (
        "The peak is in the optimizer's step ({symbol}): its temporaries hold {held}. AdamW(..., fused=True) "
        "updates in place"
    ),
}
_PHASE_SAVING = ": the peak would fall by up to {saving}, to {after}."

# A category holding ADVICE_SHARE of the peak or more ({held}): the option that trades it away.
_CATEGORY_ADVICE = {
    Category.SAVED: (
        "Saved activations hold {held} at the peak: --memory-budget trades them for recomputation in backward "
        "(the report shows what it would recompute and the time that adds)."
    ),
    Category.GATHERED_PARAMETER: (
        "Gathered parameters hold {held} at the peak: with --shard zero3 and --transform they are gathered again "
        "in backward instead of kept from the forward."
    ),
}


def advice(step: StepMemory) -> tuple[Advice, ...]:
    """One or two lines on what holds the peak and what would remove it: the eager loss (a chunked
    cross-entropy), the optimizer's temporaries (a fused AdamW), saved activations (a memory budget), gathered
    parameters (ZeRO3 with the transform)."""
    out = []
    for stage, text in _PHASE_ADVICE.items():
        found = _peak_held_by(step, stage)
        if found is None:
            continue
        held, saving = found
        line = (text + _PHASE_SAVING).format(
            held=format_bytes(held),
            symbol=step.peak_symbol,
            saving=format_bytes(saving),
            after=format_bytes(step.peak_bytes - saving),
        )
        out.append(Advice(line, saving))
    at_peak = bytes_by_category(step)
    for category, text in _CATEGORY_ADVICE.items():
        held = at_peak.get(category, 0)
        if held >= ADVICE_SHARE * step.peak_bytes:
            out.append(Advice(text.format(held=format_bytes(held)), held))
    return tuple(out)


def bytes_by_category(step: StepMemory) -> dict[Category, int]:
    """The bytes alive at the step's peak, by category (in the order the categories first appear)."""
    out: dict[Category, int] = {}
    for a in step.live_at_peak:
        out[a.category] = out.get(a.category, 0) + a.nbytes
    return out


def _peak_held_by(step: StepMemory, stage: Stage) -> tuple[int, int] | None:
    """Where the peak is in a phase of ``stage`` without a trace (the eager loss, the optimizer's step): what that
    phase itself holds, and how much the peak would fall without it (to the next highest phase at most)."""
    phase = next((p for p in step.phases if p.stage is stage), None)
    if step.peak_stage is not stage or phase is None:
        return None
    held = sum(a.nbytes for a in phase.extra)
    others = max((p.peak_bytes for p in step.phases if p is not phase), default=0)
    return held, step.peak_bytes - max(others, phase.peak_bytes - held)
