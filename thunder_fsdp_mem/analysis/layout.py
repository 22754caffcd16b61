"""Strides of tensors as torch lays them out, to tell a view from a copy.

Thunder proxies carry shapes and dtypes, not strides, yet whether ``reshape`` returns a view or a copy, and
whether ``matmul`` copies an operand before its batched multiply, depends on strides. This module follows the
strides torch gives each tensor: new tensors are contiguous or keep the dense layout of their input (as
TensorIterator's ``preserve_format`` does), and view ops compute their strides exactly.

Everything here works on plain tuples of ints and is independent of Thunder.
"""

from __future__ import annotations

from collections.abc import Sequence

Shape = tuple[int, ...]
Strides = tuple[int, ...]


def contiguous_strides(shape: Sequence[int]) -> Strides:
    """Row-major strides of ``shape`` (torch's default layout)."""
    strides = [1] * len(shape)
    running = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = running
        running *= max(int(shape[d]), 1)
    return tuple(strides)


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_contiguous``: dimensions of size 1 may have any stride."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def is_non_overlapping_and_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when the tensor covers its storage exactly once in some order of its dimensions."""
    dims = sorted((s, sz) for s, sz in zip(strides, shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def dense_like(shape: Sequence[int], strides: Sequence[int]) -> Strides:
    """Dense strides with the dimension order of ``strides`` (``empty_like`` with ``preserve_format``)."""
    if not is_non_overlapping_and_dense(shape, strides) or is_contiguous(shape, strides):
        return contiguous_strides(shape)
    order = sorted(range(len(shape)), key=lambda d: (strides[d], -d))
    out = [0] * len(shape)
    running = 1
    for d in order:
        out[d] = running
        running *= max(int(shape[d]), 1)
    return tuple(out)


def view_strides(old_shape: Sequence[int], old_strides: Sequence[int], new_shape: Sequence[int]) -> Strides | None:
    """Strides of ``view(new_shape)``, or None when torch would have to copy (``reshape`` then copies).

    This is the chunking rule of torch's ``computeStride``: the new shape must split or merge only dimensions
    that are laid out contiguously with respect to each other.
    """
    new_shape = tuple(int(s) for s in new_shape)
    numel = 1
    for s in old_shape:
        numel *= int(s)
    if numel == 0 or len(old_shape) == 0:
        return contiguous_strides(new_shape)
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = int(old_strides[-1])
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= int(old_shape[tensor_d])
        chunk_ends = tensor_d == 0 or (
            old_shape[tensor_d - 1] != 1 and old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        )
        if not chunk_ends:
            continue
        while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
            new_strides[view_d] = view_numel * chunk_base_stride
            view_numel *= new_shape[view_d]
            view_d -= 1
        if view_numel != tensor_numel:
            return None
        if tensor_d > 0:
            chunk_base_stride = int(old_strides[tensor_d - 1])
            tensor_numel = 1
            view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_strides)


def permuted(strides: Sequence[int], dims: Sequence[int]) -> Strides:
    return tuple(strides[int(d) % len(strides)] for d in dims)


def expanded(shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]) -> Strides:
    """Strides of ``expand(new_shape)``: broadcast dimensions get stride 0."""
    lead = len(new_shape) - len(shape)
    out = []
    for d, size in enumerate(new_shape):
        if d < lead:
            out.append(0)
            continue
        old = shape[d - lead]
        out.append(0 if (old == 1 and size != 1) else strides[d - lead])
    return tuple(out)


def broadcast_in_dim(
    shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int], broadcast_dims: Sequence[int]
) -> Strides:
    """Strides of Thunder's ``broadcast_in_dim``: input dim i lands on ``broadcast_dims[i]``; every other output
    dimension, and every input dimension of size 1 that grows, has stride 0."""
    out = [0] * len(new_shape)
    for i, d in enumerate(broadcast_dims):
        if not (shape[i] == 1 and new_shape[d] != 1):
            out[d] = strides[i]
    return tuple(out)


def unsqueezed(shape: Sequence[int], strides: Sequence[int], dim: int) -> Strides:
    dim = dim % (len(shape) + 1)
    inner = strides[dim] * shape[dim] if dim < len(shape) else 1
    return tuple(strides[:dim]) + (inner,) + tuple(strides[dim:])


def sliced(strides: Sequence[int], steps: Sequence[int] | None) -> Strides:
    if steps is None:
        return tuple(strides)
    return tuple(s * int(st) for s, st in zip(strides, steps))
