"""``loss.function.chunked_linear_cross_entropy``, the chunked loss as a plain autograd function: the loss and every
gradient against eager PyTorch in float32 (within ``docs/accuracy.md``'s float32 tolerance: every gradient within
1e-5 of its largest magnitude, the loss within 1e-6 relative), soft-cap, bias, ignored tokens, the sum, a cotangent
other than 1; the chunk count it chooses by hand; its refusals; torch.compile leaves it out of its graph."""

import pytest
import torch
import torch.nn.functional as F

from support import memtracker_peak
from thunder_fsdp_mem import chunked_linear_cross_entropy
from thunder_fsdp_mem.loss.function import default_chunks

pytestmark = pytest.mark.smoke
V, H = 700, 48


def _inputs(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 333, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, V, (2, 333), generator=g)
    targets[0, :40] = -100
    return hidden, weight, b, targets


def _eager(hidden, weight, bias, targets, softcap, reduction):
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.reshape(-1, V), targets.reshape(-1), reduction=reduction)


def _grads(tensors):
    out = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize(
    "softcap, bias, reduction, chunks, cotangent",
    [(None, False, "mean", 3, 1.0), (30.0, True, "sum", 5, 0.5), (None, True, "mean", None, 3.0)],
)
def test_the_loss_and_every_gradient_match_eager_pytorch(softcap, bias, reduction, chunks, cotangent):
    hidden, weight, b, targets = _inputs(bias)
    params = [t for t in (hidden, weight, b) if t is not None]
    expected = _eager(hidden, weight, b, targets, softcap, reduction)
    (expected * cotangent).backward()
    expected_grads = _grads(params)
    got = chunked_linear_cross_entropy(hidden, weight, targets, b, softcap=softcap, reduction=reduction, chunks=chunks)
    (got * cotangent).backward()
    assert got.dtype == expected.dtype == torch.float32
    assert abs(got.item() - expected.item()) <= 1e-6 * abs(expected.item())
    for grad, want in zip(_grads(params), expected_grads):
        assert (grad - want).abs().max() <= 1e-5 * want.abs().max()


def test_every_token_ignored_gives_torchs_nan_and_finite_gradients():
    hidden, weight, _, targets = _inputs(False)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full_like(targets, -100), chunks=2)
    assert torch.isnan(loss) and torch.isnan(_eager(hidden, weight, None, torch.full_like(targets, -100), None, "mean"))
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_without_gradients_it_gives_the_loss_alone():
    hidden, weight, _, targets = _inputs(False)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(hidden, weight, targets, chunks=4)
        expected = _eager(hidden, weight, None, targets, None, "mean")
    assert not loss.requires_grad
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())


def test_it_never_holds_the_logits():
    # 4 chunks of 2048 rows of a 4096-token vocabulary: the whole logits in float32 are 128 MiB, a chunk's 32 MiB.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8192, 64, generator=g, requires_grad=True)
    weight = torch.randn(4096, 64, generator=g, requires_grad=True)
    targets = torch.randint(0, 4096, (8192,), generator=g)
    logits_bytes = 8192 * 4096 * 4

    def loss():
        return chunked_linear_cross_entropy(hidden, weight, targets, chunks=4)

    assert memtracker_peak(loss, tracked=(hidden, weight)) < logits_bytes / 2


def test_the_default_chunk_count_keeps_chunks_of_512_rows():
    # 8192 rows (Llama-3.2-1B or gemma-2-2b at 8192 tokens): 16 chunks of 512; 8191 rows: 16 of at most 512.
    assert default_chunks(8192) == 16 and default_chunks(8191) == 16
    # 16384 rows: 32 chunks of 512; 1000 rows: one (two chunks would be of 500).
    assert default_chunks(16384) == 32 and default_chunks(1000) == 1 and default_chunks(1024) == 2
    # Never more than candidate_chunks' 64, never fewer than one.
    assert default_chunks(1 << 20) == 64 and default_chunks(3) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reduction="none"), "reduction must be one of"),
        (dict(chunks=0), "chunks must be at least 1"),
        (dict(weight=torch.zeros(V, H + 1)), "do not make a linear layer"),
        (dict(targets=torch.zeros(2, 5, dtype=torch.long)), "must have hidden's leading shape"),
    ],
)
def test_bad_input_is_refused_with_what_is_wrong(kwargs, message):
    hidden, weight, _, targets = _inputs(False)
    args = dict(weight=weight, targets=targets)
    args.update({k: kwargs.pop(k) for k in ("weight", "targets") if k in kwargs})
    with pytest.raises(ValueError, match=message):
        chunked_linear_cross_entropy(hidden, args["weight"], args["targets"], **kwargs)


def test_torch_compile_runs_it_outside_its_graph():
    hidden, weight, _, targets = _inputs(False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(h):
        return chunked_linear_cross_entropy(torch.nn.functional.layer_norm(h, (H,)), weight, targets, chunks=2)

    got = torch.compile(step, backend=backend)(hidden)
    expected = _eager(torch.nn.functional.layer_norm(hidden, (H,)), weight, None, targets, None, "mean")
    assert abs(got.item() - expected.item()) <= 1e-6 * abs(expected.item())
    assert graphs and not any("ChunkedLinearCrossEntropy" in gm.code for gm in graphs)
