"""gathers.py and scatters.py under Thunder's fsdp on 2 gloo ranks, with and without FSDPMemoryTransform (jit
then fsdp, and listed after an FSDPTransform): bit for bit the same step, ZeRO3 saves no gathered parameter and
holds at most max_inflight_allgathers + 1 at once, ZeRO2 keeps saving them, at most
max_inflight_reduce_scatters reduce-scatters in flight; a future read by anything but a wait is refused."""

import pytest

from support import torchrun
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.config import DEFAULT_MAX_INFLIGHT_ALLGATHERS, DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS

pytestmark = pytest.mark.slow  # every case reads one 2-rank torchrun run (make test-slow)

FAMILIES = ("neox", "llama")


@pytest.fixture(scope="module")
def results():
    return torchrun("gather_worker.py", *FAMILIES)


def test_every_family_and_strategy_ran_on_both_ranks(results):
    assert {(r["family"], r["shard"], r["rank"]) for r in results} == {
        (f, s, k) for f in FAMILIES for s in ("zero2", "zero3") for k in (0, 1)
    }


def test_loss_and_every_gradient_shard_are_bitwise_identical(results):
    for r in results:
        assert r["loss_equal"] and r["grads_equal"] and r["n_grads"] > 0, r


def test_listed_after_fsdp_transform_gives_the_same_step(results):
    for r in results:
        assert r["listed_equal"], r
        if r["shard"] == "zero3":
            assert r["listed_saved"] == 0, r


def test_reduce_scatters_are_waited_for_in_the_window(results):
    for r in results:
        assert r["scatters_at_once"] == r["scatters"] > DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS, r  # Thunder: all
        assert r["scatters_at_once_mem"] == DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS, r


def test_zero3_saves_shards_and_holds_the_window(results):
    for r in results:
        assert r["at_once"] == r["gathers"] > DEFAULT_MAX_INFLIGHT_ALLGATHERS + 1, r  # Thunder: all at once
        if r["shard"] == "zero3":
            assert r["saved"] > 0 and r["saved_mem"] == 0, r
            assert r["at_once_mem"] <= DEFAULT_MAX_INFLIGHT_ALLGATHERS + 1, r
        else:  # ZeRO2 keeps gathered parameters for backward, by definition
            assert r["saved_mem"] > 0 and r["at_once_mem"] < r["at_once"], r


def test_a_future_read_by_another_symbol_is_refused(results):
    assert all(r["refuses"] and r["scatters_refuse"] for r in results)


def test_reduce_scatter_inputs_are_held_until_their_waits_on_cuda(results):
    assert all(r["held"] for r in results)


def test_the_transform_warns_once_and_leaves_unmatched_gathers(results):
    assert all(r["warns"] for r in results)


def test_the_window_is_a_validated_option():
    assert FSDPMemoryTransform().config.max_inflight_allgathers == DEFAULT_MAX_INFLIGHT_ALLGATHERS
    for bad in (0, -1, 1.5, True, "2"):
        for name in ("max_inflight_allgathers", "max_inflight_reduce_scatters"):
            with pytest.raises(ValueError, match=f"MemoryConfig.{name} must be an int >= 1, got"):
                MemoryConfig(**{name: bad})
    with pytest.raises(ValueError, match="MemoryConfig.regather must be True, False or None"):
        MemoryConfig(regather="zero3")
