"""layout.py against torch itself: the strides torch gives views, and whether torch can view or must copy."""

import itertools

import pytest
import torch

from thunder_fsdp_mem.analysis import layout


def _layouts():
    base = torch.empty(2, 3, 4, 5)
    yield base
    for perm in itertools.permutations(range(4)):
        yield base.permute(perm)
    yield base[:, 1:, ::2]
    yield base.unsqueeze(2).expand(2, 3, 6, 4, 5)
    yield torch.empty(1, 8, 1, 6).transpose(1, 3)
    yield torch.empty(4, 1, 6)[:, :, 1:]


def _targets(t):
    n, shape = t.numel(), tuple(t.shape)
    out = {(n,), (1, n), (shape[0], n // shape[0]), (n // shape[-1], shape[-1]), shape + (1,)}
    if len(shape) >= 2:
        out.add(shape[:-2] + (shape[-2] * shape[-1],))
        out.add((shape[0] * shape[1],) + shape[2:])
    return sorted(out)


@pytest.mark.parametrize("t", list(_layouts()), ids=lambda t: f"{tuple(t.shape)}:{t.stride()}")
def test_view_strides_matches_torch(t):
    for new_shape in _targets(t):
        ours = layout.view_strides(tuple(t.shape), t.stride(), new_shape)
        try:
            theirs = t.view(new_shape).stride()
        except RuntimeError:
            theirs = None
        assert ours == theirs, (tuple(t.shape), t.stride(), new_shape)


@pytest.mark.parametrize("t", list(_layouts()), ids=lambda t: f"{tuple(t.shape)}:{t.stride()}")
def test_contiguity_and_density_match_torch(t):
    assert layout.is_contiguous(tuple(t.shape), t.stride()) == t.is_contiguous()
    dense = torch.empty_like(t)  # preserve_format keeps the dense layout, or goes contiguous
    ours = layout.dense_like(tuple(t.shape), t.stride())
    # The stride of a size-1 dimension is arbitrary (it never moves through memory): compare the others.
    assert [s for s, n in zip(ours, t.shape) if n != 1] == [s for s, n in zip(dense.stride(), t.shape) if n != 1]


def test_view_ops_strides_match_torch():
    t = torch.empty(2, 3, 4)
    assert layout.permuted(t.stride(), (2, 0, 1)) == t.permute(2, 0, 1).stride()
    assert layout.unsqueezed(tuple(t.shape), t.stride(), 1) == t.unsqueeze(1).stride()
    assert layout.unsqueezed(tuple(t.shape), t.stride(), -1) == t.unsqueeze(-1).stride()
    e = torch.empty(3, 1)
    assert layout.expanded((3, 1), e.stride(), (2, 3, 4)) == e.expand(2, 3, 4).stride()
    assert layout.sliced(t.stride(), (1, 2, 1)) == t[:, ::2, :].stride()
