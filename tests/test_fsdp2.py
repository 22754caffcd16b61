"""fsdp2.py: the per-rank composition of an FSDP2 + ThunderFX step, checked against FSDP2's holdings computed by
hand for a model whose parameters all divide by the world size, and a step's budget under a memory cap turned into
each block's saved budget. (Its prediction against 2 measured gloo ranks: tests/test_compare.py; against 2xH200:
docs/accuracy.md.)"""

import dataclasses

import pytest
import torch

from configs import BY_NAME
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.phases import Stage
from thunder_fsdp_mem.predict import fsdp2
from thunder_fsdp_mem.analysis.caching_allocator import over_cap, replay_step
from thunder_fsdp_mem.training import litgpt_models

WORLD = 2


@pytest.fixture(scope="module")
def steps():
    return {
        shard: fsdp2.compose_step(
            BY_NAME["neox"], world_size=WORLD, shard=shard, device_type="cpu", executors="default"
        )
        for shard in ("zero2", "zero3")
    }


def _full_bytes():
    gpt = litgpt_models.build(BY_NAME["neox"], device="meta").gpt
    units = {
        "wte": gpt.transformer.wte,
        "ln_f": gpt.transformer.ln_f,
        "lm_head": gpt.lm_head,
        **{f"block {i}": b for i, b in enumerate(gpt.transformer.h)},
    }
    return {name: sum(p.numel() * p.element_size() for p in m.parameters()) for name, m in units.items()}


def _phase(step, name):
    return next(p for p in step.phases if p.name == name)


def _bytes(allocations, category, name_part=""):
    return sum(a.nbytes for a in allocations if a.category is category and name_part in a.name)


def test_persistent_state_is_the_shards_and_their_adam_moments(steps):
    full = sum(_full_bytes().values())
    parameters = len(list(litgpt_models.build(BY_NAME["neox"], device="meta").gpt.parameters()))
    for step in steps.values():  # on CPU AdamW's float32 step count of each parameter is on the device too
        assert step.optimizer_state_bytes == 2 * full // WORLD + 4 * parameters
        assert step.gradient_bytes == full // WORLD  # the sharded gradients after the backward
        loss = _phase(step, "loss")
        assert _bytes(loss.live_at_peak, Category.PARAMETER, "(shard)") == full // WORLD


def test_zero2_keeps_every_unit_gathered_until_its_backward_and_zero3_only_the_one_in_use(steps):
    units = _full_bytes()
    full = sum(units.values())
    # At the loss, zero2 holds every gathered parameter; zero3 none (each unit was resharded after its forward).
    assert _bytes(_phase(steps["zero2"], "loss").live_at_peak, Category.GATHERED_PARAMETER) == full
    assert _bytes(_phase(steps["zero3"], "loss").live_at_peak, Category.GATHERED_PARAMETER) == 0
    # A block's forward under zero3: its own parameters and its all-gather buffer (kept until the next unit's
    # copy-out), and nothing else gathered.
    phase = _phase(steps["zero3"], "forward: block 1")
    assert _bytes(phase.live_at_peak, Category.GATHERED_PARAMETER) == units["block 1"]
    assert _bytes(phase.live_at_peak, Category.COMM_BUFFER, "all-gather buffer of block 1") == units["block 1"]
    # Block 1's backward under zero3: its parameters gathered again, block 0's all-gather prefetched, and the
    # reduce-scatter input of the unit before it in the backward (ln_f) still held.
    phase = _phase(steps["zero3"], "backward: block 1")
    assert _bytes(phase.live_at_peak, Category.GATHERED_PARAMETER) == units["block 1"]
    assert _bytes(phase.live_at_peak, Category.COMM_BUFFER, "all-gather buffer of block 0") == units["block 0"]
    assert _bytes(phase.live_at_peak, Category.COMM_BUFFER, "reduce-scatter input of ln_f") == units["ln_f"]
    # After the last backward, zero2 too has resharded everything; AdamW's step then runs over the shards.
    last, optimizer = steps["zero2"].phases[-2:]
    assert last.name == "backward: reduce-scatter of wte" and optimizer.name == "optimizer step"
    assert _bytes(last.live_at_peak, Category.GATHERED_PARAMETER) == 0


def test_each_block_saves_what_the_block_graph_saves(steps):
    # Every block runs the same ThunderFX graph: at the loss each block's saved tensors are alive once.
    step = steps["zero2"]
    forward = step.forward
    per_block = sum(
        forward.allocations[i].nbytes
        for i in set(forward.outputs.values())
        if not forward.allocations[i].external and forward.allocations[i].category is Category.SAVED
    )
    loss = _phase(step, "loss")
    assert per_block > 0
    assert _bytes(loss.outside, Category.SAVED) - _bytes(loss.outside, Category.SAVED, "saved by") == 2 * per_block


def test_peak_is_the_largest_phase(steps):
    for step in steps.values():
        assert step.peak_bytes == max(p.peak_bytes for p in step.phases)
        assert sum(a.nbytes for a in step.live_at_peak) == step.peak_bytes


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="shard must be one of zero2, zero3"):
        fsdp2.compose_step(BY_NAME["neox"], world_size=2, shard="zero1")
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        fsdp2.compose_step(BY_NAME["neox"], world_size=0, shard="zero2")
    gemma2 = litgpt_models.ModelSpec(name="Gemma-2-2b", n_layers=1, block_size=16)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        fsdp2.compose_step(gemma2, world_size=2, shard="zero2", device_type="cpu")
    assert not torch.distributed.is_initialized()


def test_block_allocations_are_placed_at_litgpt_lines(steps):
    # A ThunderFX trace places its symbols in the code FX generated (<eval_with_key>.N:line); the composition
    # places them where the FX node was traced from. Each place must be a line of litgpt that exists.
    import linecache

    # (The backward trace's symbols carry no place at all.)
    forwards = [p.timeline for p in steps["zero2"].phases if p.timeline is not None and p.stage is Stage.FORWARD]
    assert len(forwards) == 2  # one per block
    for timeline in forwards:
        sources = {a.source for a in timeline.allocations if a.source}
        assert not any(s.startswith("<eval_with_key>") for s in sources), sorted(sources)[:5]
        in_litgpt = [s for s in sources if "/litgpt/" in s]
        assert len(in_litgpt) >= 3
        for source in in_litgpt:
            path, _, line = source.rpartition(":")
            assert linecache.getline(path, int(line)).strip(), source


def test_a_step_budget_under_a_cap_becomes_a_saved_budget_whose_step_runs_under_the_cap():
    # 1024 tokens, so that what the blocks save matters. The cap is 1 MiB under what the caching allocator reserves
    # for the transform's step without a budget, which then runs out in the replay; the fit turns the step's budget
    # and cap into what each block may save, and the step composed with it runs under the cap.
    spec = dataclasses.replace(BY_NAME["neox"], block_size=1024)
    options = dict(world_size=WORLD, shard="zero2", device_type="cpu", executors="default")
    unbudgeted = fsdp2.compose_step(spec, transform=FSDPMemoryTransform(), **options)
    cap = replay_step(unbudgeted).peak_reserved_bytes - 2**20
    assert over_cap(unbudgeted, cap) > 0
    step, config, _ = fsdp2.fit_budget(spec, MemoryConfig(memory_budget=cap, memory_cap=cap), **options)
    assert (config.memory_budget, config.memory_cap) == (None, None) and config.saved_budget is not None
    assert over_cap(step, cap) == 0 and step.peak_bytes <= cap
