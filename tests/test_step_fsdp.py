"""estimate_step() under Thunder's fsdp on 2 gloo ranks, ZeRO2 and ZeRO3, against MemTracker on every rank."""

import pytest

from support import torchrun

pytestmark = pytest.mark.slow  # every case reads one 2-rank torchrun run (make test-slow)

TOLERANCE = 0.03


@pytest.fixture(scope="module")
def results():
    return torchrun("fsdp_worker.py", "neox:bf16", "llama:fp32")  # each family, each dtype


def test_every_configuration_ran_on_both_ranks(results):
    keys = {(r["family"], r["dtype"], r["shard"], r["rank"]) for r in results}
    assert keys == {
        (f, d, s, k) for f, d in (("neox", "bf16"), ("llama", "fp32")) for s in ("zero2", "zero3") for k in (0, 1)
    }


def test_estimate_matches_memtracker_on_every_rank(results):
    for r in results:
        assert abs(r["estimated"] - r["measured"]) <= TOLERANCE * r["measured"], r


def test_gathered_parameters_are_saved_for_backward_today(results):
    # Thunder 0.2.7's fsdp keeps gathered parameters for backward under ZeRO2 and ZeRO3 alike (SEED.md):
    # the estimate must see them, since they dominate what FSDP adds.
    for r in results:
        assert r["gathered_saved"] > 0, r
