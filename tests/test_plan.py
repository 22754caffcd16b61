"""predict/plan.py: ``plan_fsdp2``, a memory budget for FSDP2 through ThunderFX from Python in one call, checked on
2 gloo ranks against the peak measured there (``cpu_memory``), the loss eager and in the step: the planned step fits
the budget, the step without it did not; and what the plan reads from a model under ``fully_shard``."""

import pytest
import torch

from configs import BY_NAME
from support import torchrun
from thunder_fsdp_mem import MemoryConfig, plan_fsdp2
from thunder_fsdp_mem.training import litgpt_models


@pytest.fixture(scope="module")
def ranks():
    return torchrun("plan_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["eager", "trace"])
def test_a_budget_planned_from_python_is_met_on_two_ranks(ranks, loss):
    # trace: LossModel as the root, the plan told where the loss is by the model it is given.
    ranks = [r for r in ranks if r["loss"] == loss]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["saved_budget"] is not None
        assert r["unbudgeted"] > r["budget"], r  # without the plan the step does not fit
        assert r["budgeted"] <= r["budget"], r  # with it, it does, as measured
        assert abs(r["planned"] - r["budgeted"]) <= 0.03 * r["budgeted"], r  # and as predicted
    assert len({r["saved_budget"] for r in ranks}) == 1  # every rank plans the same


def test_the_spec_of_a_litgpt_config_is_the_config():
    from litgpt import Config

    config = Config.from_name("pythia-14m", n_layer=3, n_embd=64, intermediate_size=128)
    spec = litgpt_models.ModelSpec.from_config(config, block_size=128)
    assert spec.config() == Config.from_name("pythia-14m", n_layer=3, n_embd=64, intermediate_size=128, block_size=128)
    with pytest.raises(ValueError, match="not known by name"):
        litgpt_models.ModelSpec.from_config(Config(name="mine", n_layer=1, n_embd=64, n_head=4), block_size=16)


def test_bad_input_is_refused():
    config = BY_NAME["neox"].config()
    with pytest.raises(TypeError, match="a litgpt GPT, a LossModel of one, or a litgpt Config"):
        plan_fsdp2(torch.nn.Linear(2, 2), memory_budget=10**9, tokens=64)
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
        plan_fsdp2(config, memory_budget=0.5, tokens=64)
    with pytest.raises(ValueError, match="cannot read '60 apples' as a size"):
        plan_fsdp2(config, memory_budget="60 apples", tokens=64)
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        plan_fsdp2(config, memory_budget=10**9, tokens=0)


def test_an_unreachable_budget_warns_with_the_predicted_peak_and_raises_under_strict():
    config = BY_NAME["neox"].config()
    options = dict(tokens=64, world_size=2, device_type="cpu", executors="default")
    with pytest.warns(
        UserWarning, match="could not meet the budget of 1.00 KiB: the plan nearest to it has a predicted peak of"
    ):
        planned = plan_fsdp2(config, memory_budget=1024, **options)
    assert planned.saved_budget is not None and planned.memory_budget is None
    with pytest.raises(RuntimeError, match="could not meet the budget"):
        plan_fsdp2(config, memory_budget=1024, config=MemoryConfig(strict=True), **options)
