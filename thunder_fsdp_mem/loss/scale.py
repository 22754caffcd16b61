"""The chunked loss's backward: its gradients multiplied by the loss's cotangent, in place, and on CUDA not at all
when that cotangent is one.

The chunked loss computes the gradients of its inputs in the forward, as if the cotangent were one; the backward
only multiplies them by the cotangent it receives. ``loss.backward()`` passes exactly one, and ``x * 1 == x`` bit
for bit in IEEE arithmetic (a zero keeps its sign, a NaN stays a NaN), so that multiplication only reads and
writes every gradient, the head's weight among them (vocabulary x hidden). On CUDA one Triton kernel reads the
cotangent on the device and returns at once when it is one; otherwise it multiplies in float32 and rounds to the
gradient's dtype, which is what torch's multiplication of the same tensors gives. The host never waits for the
device. Elsewhere (CPU, the meta device, CUDA without Triton) ``mul_``.

In place: the gradients are the loss's own buffers, which nothing else reads (the plain function frees them in its
backward, Thunder's backward clears what the forward saved), and a backward runs once.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

_BLOCK = 4096  # elements a program handles at a time
_PROGRAMS_PER_SM = 4  # the grid: enough programs to keep every SM loading, each over a span of blocks
_MOST_ELEMENTS = 2**30  # a launch's extent, so that int32 offsets never overflow
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_by_cotangent_(x: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    """``x`` multiplied by ``cotangent`` (a 0-dim tensor) in place; returns ``x``."""
    if _on_kernel(x, cotangent):
        launch(x, cotangent)
    else:
        x.mul_(cotangent)
    return x


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _on_kernel(x: torch.Tensor, cotangent: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and _has_triton()
        and cotangent.device == x.device
        and cotangent.numel() == 1
        and x.dtype in _DTYPES
        and cotangent.dtype in _DTYPES
        and x.is_contiguous()
    )


def launch(x: torch.Tensor, cotangent: torch.Tensor, *, programs: int | None = None) -> None:
    """The kernel on ``x`` (contiguous), whatever its device: ``tests/test_loss_scale.py`` runs it on CPU tensors
    under Triton's interpreter. ``programs``: the grid (default: ``_PROGRAMS_PER_SM`` per SM of ``x``'s device)."""
    flat = x.view(-1)
    if programs is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        programs = _PROGRAMS_PER_SM * sms
    kernel = _kernel()
    for start in range(0, flat.numel(), _MOST_ELEMENTS):
        part = flat[start : start + _MOST_ELEMENTS]
        blocks = -(-part.numel() // _BLOCK)
        grid = max(1, min(programs, blocks))
        kernel[(grid,)](part, cotangent, part.numel(), blocks_each=-(-blocks // grid), BLOCK=_BLOCK)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_unless_one(x_ptr, g_ptr, n, blocks_each: tl.constexpr, BLOCK: tl.constexpr):
        # Program p handles blocks p * blocks_each to (p + 1) * blocks_each - 1, the last ones masked past n.
        g = tl.load(g_ptr).to(tl.float32)
        if g != 1.0:
            first = tl.program_id(0) * blocks_each
            for i in range(0, blocks_each):
                offsets = (first + i) * BLOCK + tl.arange(0, BLOCK)
                inside = offsets < n
                x = tl.load(x_ptr + offsets, mask=inside)
                tl.store(x_ptr + offsets, (x.to(tl.float32) * g).to(x.dtype), mask=inside)

    return scale_unless_one
