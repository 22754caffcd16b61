"""A memory budget (``MemoryConfig.memory_budget``, ``passes/budget.py``): on three litgpt families the transform
fits a budget below what it reaches without one, by recomputing matmuls, with Thunder's results bit for bit; the
estimate it fits is ``estimate_step``'s of the step that runs (the eager loss and AdamW's state included); a budget
that cannot be met warns, names the least peak reachable, and raises under ``strict``; with a memory cap the plan
also runs in the caching allocator's replay under it."""

import dataclasses
import re
import functools
import warnings
from pathlib import Path

import pytest
import thunder
import torch
from litgpt import GPT

from configs import BY_NAME
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig, estimate_step
from thunder_fsdp_mem.analysis.symbols import MATMULS
from thunder_fsdp_mem.passes.driver import Outcome
from thunder_fsdp_mem.passes.pipeline import REMATERIALIZE
from thunder_fsdp_mem.analysis.caching_allocator import over_cap, replay_step
from thunder_fsdp_mem.training import litgpt_models


def _spec(family: str) -> litgpt_models.ModelSpec:
    return dataclasses.replace(BY_NAME[family], n_layers=4, block_size=256)  # saved activations dominate


def _step(spec: litgpt_models.ModelSpec, config: MemoryConfig | None):
    """One step as the benchmarks run it (the GPT jitted, eager cross-entropy on its logits), and the estimate of
    the step with the AdamW state it will hold."""
    torch.manual_seed(0)
    gpt = GPT(spec.config()).to(torch.bfloat16)
    transform = FSDPMemoryTransform(config) if config is not None else None
    jitted = thunder.jit(gpt, transforms=[transform] if transform is not None else [])
    idx, targets = litgpt_models.batch(spec)
    logits = jitted(idx)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    step = estimate_step(jitted, loss="cross_entropy", optimizer=torch.optim.AdamW(jitted.parameters()))
    return loss.detach(), [p.grad for p in gpt.parameters()], step, transform


@functools.cache
def _runs(family: str):
    spec = _spec(family)
    plain = _step(spec, None)
    unbudgeted = _step(spec, MemoryConfig(strict=True))
    budget = int(0.95 * unbudgeted[2].peak_bytes)  # the least reachable: 0.87 to 0.91 of it
    return plain, unbudgeted, budget, _step(spec, MemoryConfig(memory_budget=budget, strict=True))


@pytest.mark.parametrize("family", ["neox", "llama", "gemma"])
def test_a_reachable_budget_is_met_bit_for_bit(family):
    (loss, grads, _, _), (_, _, unbudgeted, _), budget, (loss_b, grads_b, step, transform) = _runs(family)
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b, strict=True))
    assert step.peak_bytes <= budget < unbudgeted.peak_bytes
    (remat,) = [r for r in transform.rewrites if r.pass_name == REMATERIALIZE]
    assert remat.outcome is Outcome.APPLIED and "met, recomputing what saves at least" in remat.note
    # The plan records what the backward runs again: matmuls among it, and its estimated time.
    assert any(g.symbol in MATMULS for g in remat.recomputed), remat.recomputed
    assert remat.added_seconds == pytest.approx(sum(g.seconds for g in remat.recomputed))


def test_an_unreachable_budget_warns_with_the_least_peak_and_raises_under_strict():
    spec = dataclasses.replace(_spec("neox"), n_layers=2, block_size=64)  # no budget of 1 byte is reachable
    loss, grads, _, _ = _step(spec, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_b, grads_b, step, _ = _step(spec, MemoryConfig(memory_budget=1))
    ours = [w for w in caught if "FSDPMemoryTransform" in str(w.message)]
    assert len(ours) == 1 and "could not meet the budget (peak 1 B)" in str(ours[0].message)
    assert "least reachable" in str(ours[0].message)
    # Said where the user's code called into Thunder, naming what is alive by what made it, not by trace names.
    assert ours[0].filename.startswith(str(Path(__file__).parent)), ours[0].filename
    assert not re.search(r"\bt\d+\b|\bl_self_", str(ours[0].message)), ours[0].message
    # Rewritten to the least peak it found: no higher than without a budget, and still bit for bit.
    assert step.peak_bytes <= _step(spec, MemoryConfig())[2].peak_bytes
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b, strict=True))
    with pytest.raises(RuntimeError, match="could not meet the budget"):
        _step(spec, MemoryConfig(memory_budget=1, strict=True))


def test_with_a_cap_the_plan_also_runs_in_the_allocators_replay():
    # The cap is 1 MiB under what the caching allocator reserves for neox's step without a budget (replayed over
    # ``estimate_step``'s estimate of the step that ran), which then runs out; the budget is the cap, which that step
    # meets in allocated bytes. With the cap the plan recomputes until the replay runs under it, bit for bit.
    spec = _spec("neox")
    (loss, grads, _, _), (_, _, unbudgeted, _), _, _ = _runs("neox")
    cap = replay_step(unbudgeted).peak_reserved_bytes - 2**20
    assert unbudgeted.peak_bytes <= cap and over_cap(unbudgeted, cap) > 0
    loss_c, grads_c, step, transform = _step(spec, MemoryConfig(memory_budget=cap, memory_cap=cap, strict=True))
    assert torch.equal(loss, loss_c) and all(torch.equal(a, b) for a, b in zip(grads, grads_c, strict=True))
    assert over_cap(step, cap) == 0
    (remat,) = [r for r in transform.rewrites if r.pass_name == REMATERIALIZE]
    assert remat.outcome is Outcome.APPLIED and "reserved under a cap of" in remat.note and ": met, " in remat.note


def test_budgets_are_validated():
    for bad in (0, -1, 1.5, True, "60GB"):
        with pytest.raises(ValueError, match=r"MemoryConfig.memory_budget must be None or an int >= 1 \(bytes\)"):
            MemoryConfig(memory_budget=bad)
    with pytest.raises(ValueError, match="MemoryConfig.saved_budget must be None or an int >= 0"):
        MemoryConfig(saved_budget=-1)
    with pytest.raises(ValueError, match="MemoryConfig.budget_loss must be None or one of cross_entropy"):
        MemoryConfig(budget_loss="mse")
    with pytest.raises(ValueError, match="MemoryConfig.budget_optimizer must be None or one of adamw"):
        MemoryConfig(budget_optimizer="sgd")
    with pytest.raises(ValueError, match="MemoryConfig.memory_cap must be None or an int >= 1"):
        MemoryConfig(memory_budget=10**9, memory_cap=0)
    with pytest.raises(ValueError, match="memory_cap is what memory_budget's plan must also run under"):
        MemoryConfig(memory_cap=10**9)
    with pytest.raises(ValueError, match="they need rematerialize=True"):
        MemoryConfig(memory_budget=10**9, rematerialize=False)
