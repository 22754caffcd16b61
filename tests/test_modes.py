"""modes: the training set-ups compared. torch.compile's memory options: every block checkpointed, and the
partitioner's activation memory budget, set where torch reads it and refused for modes that do not compile with
torch.compile."""

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from configs import BY_NAME, SOFTCAP_TIED
from thunder_fsdp_mem.training import litgpt_models, modes, runtime

CPU = runtime.Rank(0, 1, torch.device("cpu"))
SPEC = dataclasses.replace(BY_NAME["llama"], n_layers=2, block_size=32)


def test_checkpointed_blocks_compute_what_the_plain_model_computes():
    idx, targets = litgpt_models.batch(SPEC)
    plain = modes.build("eager", SPEC, CPU, dtype=torch.float32)
    checkpointed = modes.build("inductor+ckpt", SPEC, CPU, dtype=torch.float32)
    assert all(isinstance(b, CheckpointWrapper) for b in checkpointed.model._orig_mod.transformer.h)
    losses = [trainer.step(idx, targets) for trainer in (plain, checkpointed)]
    torch.testing.assert_close(losses[0], losses[1])  # one step apart: the same start, the same first loss


def test_the_activation_memory_budget_is_torch_compiles():
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    try:
        modes.build("inductor", SPEC, CPU, activation_memory_budget=0.3)
        assert functorch_config.activation_memory_budget == 0.3
    finally:
        functorch_config.activation_memory_budget = before
    with pytest.raises(ValueError, match="mode thunder does not compile with torch.compile"):
        modes.build("thunder", SPEC, CPU, activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="activation_memory_budget must be between 0 and 1, got 1.5"):
        modes.build("inductor", SPEC, CPU, activation_memory_budget=1.5)


@pytest.mark.parametrize("loss", ["trace", "view", "litgpt"])
def test_the_losses_compiled_with_the_model_are_the_cross_entropy_of_its_logits(loss):
    idx, targets = litgpt_models.batch(SPEC)
    trainer = modes.build("eager", SPEC, CPU, dtype=torch.float32, loss=loss)
    gpt = modes._gpt(SPEC, CPU, torch.float32)  # the same seed: the same weights
    logits = gpt(idx)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    torch.testing.assert_close(trainer.step(idx, targets), expected.detach(), rtol=1e-6, atol=1e-6)


def test_a_spec_with_vectorized_window_masks_gives_the_same_model_with_the_fixed_mask():
    from thunder_fsdp_mem.window_mask import WindowMaskAttention

    spec = dataclasses.replace(
        SOFTCAP_TIED, n_layers=2, block_size=32, overrides=(*SOFTCAP_TIED.overrides, ("sliding_window_size", 8))
    )
    fixed = dataclasses.replace(spec, vectorized_window_masks=True)
    torch.manual_seed(0)
    plain = spec.gpt()
    torch.manual_seed(0)
    vectorized = fixed.gpt()
    assert any(isinstance(m, WindowMaskAttention) for m in vectorized.modules())
    assert not any(isinstance(m, WindowMaskAttention) for m in plain.modules())
    idx, _ = litgpt_models.batch(spec)
    assert torch.equal(plain(idx), vectorized(idx))
