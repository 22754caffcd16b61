"""A Thunder executor for attention through torch's cuDNN kernels, the kernels torch itself runs.

On an H200 with torch 2.11, ``F.scaled_dot_product_attention`` (eager, and what torch.compile calls) runs cuDNN's
fused attention for litgpt's causal 16-bit attention; Thunder's ``sdpa`` executor calls torch's flash (or
memory-efficient) kernels directly, which are slower there (profiled with ``benchmarks/performance/profile_step.py``;
the figures in ``docs/results.md``, Table 13). Thunder's own ``cudnn`` executor needs the
``cudnn`` frontend package, which is not installed with torch. This executor claims
``ltorch.scaled_dot_product_attention`` where torch would choose cuDNN and calls the same ATen ops torch's
autograd calls (``aten._scaled_dot_product_cudnn_attention`` and its backward): the kernels, their results and the
tensors saved for backward are torch's.

- ``cudnn_attention_ex``: the executor (name ``sdpa_cudnn``); ``runtime.executors("fused")`` lists it first.
- ``FORWARD`` / ``BACKWARD``: its symbols' names. The forward takes ``(query, key, value, dropout_p, is_causal,
  scale)`` and returns the output and the log-sum-exp (float32, ``(B, H, Tq, 1)``), what the backward needs.
- ``choose``: whether a call goes to cuDNN. It claims causal or unmasked attention without dropout on 16-bit CUDA
  tensors whose head size cuDNN takes, where torch's own check agrees and deterministic algorithms are not asked
  for; ``predict.meta`` replaces it on the meta device with the rule alone (there is no device to ask).
"""

from __future__ import annotations

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

import thunder.torch as ltorch

FORWARD = "cudnn_sdpa_forward"
BACKWARD = "cudnn_sdpa_backward"
MAX_HEAD_SIZE = 128  # cuDNN's fused attention on Hopper: head sizes up to 128, multiples of 8

cudnn_attention_ex = OperatorExecutor("sdpa_cudnn", version="0.1")
register_executor(cudnn_attention_ex)


def _forward_meta(query, key, value, dropout_p, is_causal, scale):
    batch, heads, tq, _ = query.shape
    out = TensorProxy(like=query, shape=(batch, heads, tq, value.shape[-1]))
    lse = TensorProxy(like=query, shape=(batch, heads, tq, 1), dtype=dtypes.float32)
    return out, lse


def _forward_impl(query, key, value, dropout_p, is_causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, dropout_p, is_causal, False, scale=scale
    )
    return out, lse


def _backward_meta(grad, query, key, value, out, lse, dropout_p, is_causal, scale):
    return TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value)


def _backward_impl(grad, query, key, value, out, lse, dropout_p, is_causal, scale):
    # No dropout (``choose``): the random state's seed and offset are not read; torch's forward returns empty ones.
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    offset = torch.empty((), dtype=torch.int64, device=query.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad,
        query,
        key,
        value,
        out,
        lse,
        seed,
        offset,
        None,
        None,
        None,
        query.shape[2],
        key.shape[2],
        dropout_p,
        is_causal,
        scale=scale,
    )


cudnn_forward = cudnn_attention_ex.register_operator(FORWARD, meta=_forward_meta, fn=_forward_impl)
cudnn_backward = cudnn_attention_ex.register_operator(BACKWARD, meta=_backward_meta, fn=_backward_impl)


def rule(query, key, value, attn_mask, dropout_p) -> bool:
    """What cuDNN's fused attention takes, from shapes and dtypes alone: 16-bit inputs of four dimensions with as
    many heads in key and value as in query, a head size up to ``MAX_HEAD_SIZE`` and a multiple of 8, no mask
    tensor, no dropout."""
    tensors = (query, key, value)
    if attn_mask is not None or dropout_p != 0.0:
        return False
    if any(t.dtype not in (dtypes.bfloat16, dtypes.float16) or len(t.shape) != 4 for t in tensors):
        return False
    if len({t.dtype for t in tensors}) != 1 or not query.shape[1] == key.shape[1] == value.shape[1]:
        return False
    return all(t.shape[-1] <= MAX_HEAD_SIZE and t.shape[-1] % 8 == 0 for t in tensors)


def torch_agrees(query, key, value, is_causal, debug: bool = False) -> bool:
    """torch's own check (``torch.backends.cuda.can_use_cudnn_attention``) on fake CUDA tensors of the same shapes
    (no memory); ``debug``: torch says why not."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, cudnn_sdp_enabled

    if not (torch.cuda.is_available() and cudnn_sdp_enabled()):
        return False
    with FakeTensorMode() as mode:
        fake = [
            FakeTensor(mode, torch.empty(t.shape, dtype=ltorch.to_torch_dtype(t.dtype), device="meta"), device="cuda")
            for t in (query, key, value)
        ]
    try:
        return bool(can_use_cudnn_attention(SDPAParams(*fake, None, 0.0, bool(is_causal), False), debug))
    except (RuntimeError, TypeError):
        return False


def choose(query, key, value, attn_mask, dropout_p, is_causal, scale) -> bool:
    """True where this executor takes the call: CUDA tensors, ``rule``, and torch's check; never under
    ``torch.use_deterministic_algorithms(True)`` (cuDNN's backward accumulates the query's gradient in an order that
    varies from run to run; Thunder's flash backward then runs instead)."""
    if any(t.device.type != "cuda" for t in (query, key, value)) or torch.are_deterministic_algorithms_enabled():
        return False
    return rule(query, key, value, attn_mask, dropout_p) and torch_agrees(query, key, value, is_causal)


def _checker(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> bool:
    return choose(query, key, value, attn_mask, dropout_p, is_causal, scale)


def _execution(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    return cudnn_forward(query, key, value, dropout_p, is_causal, scale)[0]


def _grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = cudnn_forward(query, key, value, dropout_p, is_causal, scale)
    grads = cudnn_backward(get_grad(out), query, key, value, out, lse, dropout_p, is_causal, scale)
    put_grads((query, key, value), grads)
    return out


cudnn_attention_ex.register_implementation(
    ltorch.scaled_dot_product_attention, checker=_checker, execution_transform=_execution, grad_transform=_grad
)
