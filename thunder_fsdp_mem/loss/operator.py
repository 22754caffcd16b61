"""The chunked linear cross-entropy as a Thunder operator: the loss of ``cross_entropy(softcap(linear(h, W, b)),
targets)`` without ever holding more than one chunk of logits, forward or backward.

Each chunk of rows computes its logits (one cuBLAS matmul), its share of the loss and, at once, the gradient of
those logits (softmax minus the one-hot of the target, over the tokens counted, through the soft-cap's derivative),
from which it adds its part of the gradients of the hidden states, the weight and the bias (two more matmuls): the
three matmuls of the unchunked program, no more. The gradients are kept for backward, which only multiplies them by
the loss's cotangent (exact when that is 1, as ``loss.backward()`` gives; the parameters' in place, on CUDA skipped
when it is 1: ``loss.scale``).

- ``linear_cross_entropy(h, W, b, targets, ignore_index, softcap, reduction, chunks)``: the loss (a Thunder
  symbol with a grad rule, what ``rewrite`` puts in the trace); run without autograd it computes the loss alone.
- ``linear_cross_entropy_with_grads(...)``: the loss and the gradients (what the forward runs under autograd).

On CUDA the chunk's logits go into one buffer that every chunk reuses (the matmul's ``out``), and a
``torch.compile``d function (one reduction and one pointwise kernel) reads them and writes their gradient over
them; on CPU a chunk runs as eager torch ops, in place where they can be. The gradient of the weight is accumulated
over chunks in the weight's dtype (one rounding per chunk, as Liger's fused loss does); ``docs/accuracy.md`` gives
the tolerances against eager PyTorch.
"""

from __future__ import annotations

import functools

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad, register_grad
from thunder.extend import OperatorExecutor, register_executor

from thunder_fsdp_mem.analysis.chunked_loss import EXECUTOR, FORWARD, FORWARD_WITH_GRADS, SCALE, row_chunks
from thunder_fsdp_mem.loss.scale import scale_by_cotangent_

loss_ex = OperatorExecutor(EXECUTOR, version="0.1")
register_executor(loss_ex)


def _loss_meta(hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, loss_dtype):
    return TensorProxy(like=hidden, shape=(), dtype=loss_dtype)


def _with_grads_meta(hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, loss_dtype):
    loss = TensorProxy(like=hidden, shape=(), dtype=loss_dtype)
    grads = [TensorProxy(like=hidden), TensorProxy(like=weight)]
    if bias is not None:
        grads.append(TensorProxy(like=bias))
    return (loss, *grads)


def _chunk_math(rows, weight, bias, targets, ignore_index: int, softcap, scale):
    """For one chunk of hidden states ``rows``: the loss summed over the rows that count (float32) and the gradient
    of the mean (or summed) loss with respect to the chunk's logits (``scale``: 1/tokens counted, or 1), in the
    weight's dtype. In place where it can, so that the chunk's logits die at their float32 copy."""
    z = torch.addmm(bias, rows, weight.t()) if bias is not None else rows @ weight.t()
    if z.dtype != torch.float32:
        z = z.float()
    derivative = None
    if softcap is not None:
        z.div_(softcap).tanh_()
        derivative = torch.square(z).neg_().add_(1.0)
        z.mul_(softcap)
    valid = targets != ignore_index
    safe = targets.masked_fill(~valid, 0).unsqueeze(-1)
    z.sub_(z.amax(dim=-1, keepdim=True))
    picked = z.gather(-1, safe)
    z.exp_()
    total = z.sum(dim=-1, keepdim=True)
    loss_sum = torch.where(valid, (total.log() - picked).squeeze(-1), 0.0).sum()
    z.div_(total)
    z.scatter_add_(-1, safe, torch.full_like(picked, -1.0))
    z.mul_((valid.to(z.dtype) * scale).unsqueeze(-1))
    if derivative is not None:
        z.mul_(derivative)
        del derivative
    return loss_sum, z.to(weight.dtype)


def _chunk_grad_in_place(z, picked, targets, ignore_index: int, softcap, scale):
    """For one chunk's logits ``z`` (its matmul's output, in the weight's dtype) and each row's logit at its target
    (``picked``, gathered before): the loss summed over the rows that count (float32), with the gradient of the
    mean (or summed) loss with respect to those logits written over ``z``. Written for ``torch.compile``: no op in
    place but the last copy and the one-hot as a comparison with an iota, so that Inductor reads the logits in one
    reduction kernel and writes their gradient over them from one pointwise kernel. The chunk then holds its logits
    and nothing of their size besides (as Liger's kernel does). ``picked`` comes in because Inductor may fuse a
    gather from ``z`` after the write over ``z`` (it does on CPU), reading the gradient instead of the logit."""
    x = z.float()
    target_logit = picked.float()
    if softcap is not None:
        capped = torch.tanh(x / softcap)
        x = capped * softcap
        target_logit = torch.tanh(target_logit / softcap) * softcap
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
    one_hot = torch.arange(x.shape[-1], device=x.device) == safe.unsqueeze(-1)
    grad = (torch.exp(x - lse.unsqueeze(-1)) - one_hot.to(x.dtype)) * (valid.to(x.dtype) * scale).unsqueeze(-1)
    if softcap is not None:
        grad = grad * (1.0 - capped * capped)
    z.copy_(grad)
    return loss_sum


@functools.cache
def _compiled_grad_in_place():
    return torch.compile(_chunk_grad_in_place, dynamic=False, fullgraph=True)


def run_chunks(
    hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, loss_dtype, *, grads=False, compiled=None
):
    """The loss (``grads`` False), or the loss and the gradients of ``hidden``, ``weight`` and ``bias`` (with respect
    to the loss, as a tuple), chunk by chunk: what both the Thunder operator and the plain function run.
    ``compiled``: each chunk through one logits buffer and ``_chunk_grad_in_place`` (None: on CUDA), else eager."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    counted = (t != ignore_index).sum()
    # The mean over no counted token is nan, as torch's is; a scale of 0 then keeps the gradients finite.
    scale = (1.0 / counted.clamp(min=1).to(torch.float32)) if reduction == "mean" else torch.ones((), device=h.device)
    grad_h = torch.empty_like(h) if grads else None
    grad_w = torch.empty_like(weight) if grads else None  # the first chunk writes it, the others add to it
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if grads and bias is not None else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    # On CUDA one buffer of a chunk's logits, which each chunk's gradient then overwrites (``_chunk_grad_in_place``).
    spans = row_chunks(h.shape[0], chunks)  # the first chunk is the largest
    compiled = h.is_cuda if compiled is None else compiled
    logits = torch.empty(spans[0][1], weight.shape[0], dtype=h.dtype, device=h.device) if compiled and spans else None
    safe = t.masked_fill(t == ignore_index, 0) if logits is not None else None  # the targets to gather
    if grads and not spans:
        grad_w.zero_()
    for start, stop in spans:
        rows = h[start:stop]
        if logits is not None:
            grad = logits[: stop - start]
            if bias is not None:
                torch.addmm(bias, rows, weight.t(), out=grad)
            else:
                torch.mm(rows, weight.t(), out=grad)
            picked = grad.gather(1, safe[start:stop].unsqueeze(1)).squeeze(1)
            loss_sum = _compiled_grad_in_place()(grad, picked, t[start:stop], ignore_index, softcap, scale)
        else:
            loss_sum, grad = _chunk_math(rows, weight, bias, t[start:stop], ignore_index, softcap, scale)
        total += loss_sum
        if grads:
            torch.mm(grad, weight, out=grad_h[start:stop])
            if start == 0:
                torch.mm(grad.t(), rows, out=grad_w)
            else:
                grad_w.addmm_(grad.t(), rows)
            if grad_b is not None:
                grad_b += grad.sum(dim=0, dtype=torch.float32)
        del grad
    if reduction == "mean":
        total = torch.where(counted > 0, total * scale, torch.nan)
    loss = total.to(loss_dtype)
    if not grads:
        return loss
    out = [loss, grad_h.view(hidden.shape), grad_w]
    if grad_b is not None:
        out.append(grad_b.to(bias.dtype))
    return tuple(out)


def _loss_impl(*args):
    return run_chunks(*args[:-1], dtypes.to_torch_dtype(args[-1]), grads=False)


def _with_grads_impl(*args):
    return run_chunks(*args[:-1], dtypes.to_torch_dtype(args[-1]), grads=True)


def _scale_meta(grad, cotangent):
    return TensorProxy(like=grad)


linear_cross_entropy = loss_ex.register_operator(FORWARD, meta=_loss_meta, fn=_loss_impl)
linear_cross_entropy_with_grads = loss_ex.register_operator(
    FORWARD_WITH_GRADS, meta=_with_grads_meta, fn=_with_grads_impl
)
# A gradient from the forward times the loss's cotangent, written over it (``loss.scale``).
scaled_by_cotangent = loss_ex.register_operator(SCALE, meta=_scale_meta, fn=scale_by_cotangent_)


def _grad(hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, loss_dtype):
    loss, grad_hidden, *grads = linear_cross_entropy_with_grads(
        hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, loss_dtype
    )
    g = get_grad(loss)
    # The hidden states' gradient flows on through the model's backward, whose fusion takes the multiplication in;
    # the parameters' are the trace's outputs, scaled in place and not at all when the cotangent is one.
    put_grad(hidden, grad_hidden * g)
    for primal, grad in zip((weight, bias), grads):
        put_grad(primal, scaled_by_cotangent(grad, g))
    return loss


register_grad(linear_cross_entropy.id, _grad)
