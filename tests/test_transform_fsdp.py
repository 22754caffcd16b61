"""FSDPMemoryTransform under Thunder's fsdp and under FSDP2 through ThunderFX, 2 gloo ranks: one step with it is
bit for bit the step without it, on every rank, and saves less for backward."""

import pytest

from support import torchrun

pytestmark = pytest.mark.slow  # every case reads one 2-rank torchrun run (make test-slow)


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def results(request):  # fp32: the bias gradients a parallel residual computes alike, reduce-scattered apart
    return torchrun("remat_worker.py", "neox", request.param)


def test_both_modes_ran_on_both_ranks(results):
    assert {(r["mode"], r["rank"]) for r in results} == {
        (m, k) for m in ("thunder-fsdp", "fsdp2-thunder") for k in (0, 1)
    }


def test_loss_and_every_gradient_shard_are_bitwise_identical(results):
    for r in results:
        assert r["loss_equal"] and r["grads_equal"] and r["n_grads"] > 0, r


def test_saves_less_for_backward(results):
    for r in results:
        assert r["saved_mem"] < r["saved"], r
