"""The loss the caller computes eagerly between the forward and the backward, as a phase without a trace.

Entry points: ``loss_allocations(logits)``, what ``cross_entropy`` holds at its peak beside the logits;
``check_loss(loss)``, which names the losses modelled (``LOSSES``).

``loss="cross_entropy"`` is ``cross_entropy(output.reshape(-1, V), targets)`` on the forward's output (what
Thunder's and litgpt's benchmarks do): its ``log_softmax`` is kept for its backward, which allocates the gradient
of ``nll_loss`` and the gradient of the logits (the backward trace's cotangent) while both are alive.
"""

from __future__ import annotations

from thunder_fsdp_mem.analysis.timeline import Allocation
from thunder_fsdp_mem.analysis.categories import Category

LOSSES = ("cross_entropy",)


def check_loss(loss: str | None) -> None:
    """A ``ValueError`` naming the losses modelled unless ``loss`` is one of them or None (a loss inside the
    traces)."""
    if loss is not None and loss not in LOSSES:
        raise ValueError(f"loss must be None or one of {', '.join(LOSSES)}; got {loss!r}")


def loss_allocations(logits: Allocation) -> tuple[Allocation, ...]:
    """What eager ``cross_entropy`` on ``logits`` holds at the end of its backward, beside the logits: the
    ``log_softmax`` it saved, the gradient of ``nll_loss`` and the logits' gradient, each the logits' size."""
    return tuple(
        Allocation(
            name=name,
            nbytes=logits.nbytes,
            category=Category.TEMPORARY,
            shape=logits.shape,
            dtype=logits.dtype,
            symbol=symbol,
        )
        for name, symbol in (
            ("log_softmax of the logits", "log_softmax (eager loss)"),
            ("gradient of nll_loss", "nll_loss_backward (eager loss)"),
            ("gradient of the logits", "log_softmax_backward (eager loss)"),
        )
    )
