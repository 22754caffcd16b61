"""``chunked_linear_cross_entropy``: the chunked operator the transform puts in a trace, as a plain function for a
loss computed outside every trace (after a model compiled by ``thunder.jit``, ThunderFX or ``torch.compile``, or in
an eager FSDP2 module)::

    from thunder_fsdp_mem import chunked_linear_cross_entropy

    hidden = model_up_to_the_final_norm(idx)                      # (B, T, n_embd)
    loss = chunked_linear_cross_entropy(hidden, gpt.lm_head.weight, targets)
    loss.backward()

It returns what ``F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, V), targets.reshape(-1))`` returns (with
``softcap``: of the soft-capped logits), in ``hidden``'s dtype, without ever holding more than one chunk of logits:
the forward computes the loss and the gradients of ``hidden``, ``weight`` and ``bias`` together (the way Liger's
fused linear cross-entropy does) and the backward multiplies them by the loss's cotangent, in place (on CUDA not at
all when it is one: ``loss.scale``). Each chunk is
computed in float32, on CUDA by a ``torch.compile``'d kernel pair (``loss.operator``).

``torch.compile`` (and ThunderFX) leave the call out of their graphs and run it as it is. Inside a ``thunder.jit``
program, write the loss as ``F.cross_entropy`` instead: the transform chunks that, choosing the chunk count with its
estimator. Under FSDP2 call it where the head's weight is unsharded (in the root module's forward, as the head
itself runs), as any function that takes a parameter must.
"""

from __future__ import annotations

import math

import torch

from thunder_fsdp_mem.analysis.chunked_loss import candidate_chunks, chunk_rows
from thunder_fsdp_mem.loss.operator import run_chunks
from thunder_fsdp_mem.loss.scale import scale_by_cotangent_

REDUCTIONS = ("mean", "sum")


FAST_ROWS = 512  # the fewest rows whose chunk's matmuls outlast their traffic of the head's weight (below)


def default_chunks(rows: int) -> int:
    """The chunk count when none is given: the most (of ``candidate_chunks``) whose chunks keep ``FAST_ROWS`` rows
    (one chunk when there are fewer rows). Each chunk's three matmuls move the whole head's weight: two read it and
    the weight's gradient is read and written, about 8 x vocab x hidden bytes, for 6 x rows x vocab x hidden
    multiply-adds. The ratio of the two does not depend on the head's shape: on an H100 (3.35 TB/s, about 750
    TFLOP/s reached in bf16) the traffic outlasts the multiplications below about 300 rows, so 512-row chunks run
    near full speed while holding the least logits that do."""
    counts = candidate_chunks(rows)
    return max((count for count in counts if chunk_rows(rows, count) >= FAST_ROWS), default=1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks):
        wants = ctx.needs_input_grad[:3]
        if not any(wants):
            return run_chunks(hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, hidden.dtype)
        loss, *grads = run_chunks(
            hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, hidden.dtype, grads=True
        )
        ctx.grads = [grad if want else None for grad, want in zip(grads + [None], wants)]
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("chunked_linear_cross_entropy: its backward runs once (the gradients are freed)")
        for g in grads:
            if g is not None:
                scale_by_cotangent_(g, grad_loss.to(g.dtype))
        return (*grads, None, None, None, None, None)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    chunks: int | None = None,
) -> torch.Tensor:
    """The cross-entropy of ``softcap(linear(hidden, weight, bias))`` against ``targets`` (the module docstring).

    ``hidden``: (..., n_embd); ``weight``: (vocabulary, n_embd); ``targets``: ``hidden``'s leading shape, class
    indices, ``ignore_index`` where no loss is wanted. ``reduction``: "mean" over the counted targets (nan when
    none counts, as torch's) or "sum". ``chunks``: how many chunks of rows (default: ``default_chunks``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked_linear_cross_entropy: reduction must be one of {REDUCTIONS}, not {reduction!r}")
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"chunked_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not "
            "make a linear layer (weight: (vocabulary, hidden[-1]))"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"chunked_linear_cross_entropy: targets {tuple(targets.shape)} must have hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    rows = math.prod(hidden.shape[:-1])
    if chunks is None:
        chunks = default_chunks(rows)
    elif chunks < 1:
        raise ValueError(f"chunked_linear_cross_entropy: chunks must be at least 1, not {chunks}")
    return _apply(hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks)


@torch._dynamo.disable
def _apply(*args):
    # Out of Dynamo's graphs: the chunks' compiled kernels are their own.
    return _ChunkedLinearCrossEntropy.apply(*args)
