"""``litgpt_source`` and the litgpt code the package reproduces: ``LossModel``'s run of the layers is ``GPT.forward``
bit for bit on every family below (float32, eager), and a litgpt whose ``GPT.forward`` differs from the one checked
is run through litgpt's own forward, with one warning."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT, Config
from litgpt.model import CausalSelfAttention

from thunder_fsdp_mem import LossModel, litgpt_source

TINY = dict(n_embd=64, n_head=4, head_size=16, intermediate_size=128, padded_vocab_size=512, vocab_size=500)
# Every family the tests build, and more: soft-capped and tied heads, sliding windows and two rope caches, biases,
# parallel residual, multi-query and grouped-query attention, mixtures of experts, q/k norms and post-norms.
FAMILIES = {
    "stablecode-completion-alpha-3b": {},
    "pythia-14m": {},
    "Llama-3-8B": dict(n_query_groups=2),
    "gemma-2b": dict(n_query_groups=1),
    "gemma-2-2b": dict(n_query_groups=1, sliding_window_size=16),
    "Gemma-3-1b-it": dict(n_query_groups=1, sliding_window_size=16),
    "phi-2": {},
    "Qwen2.5-0.5B": dict(n_query_groups=2),
    "falcon-7b": dict(n_query_groups=1),
    "Mixtral-8x7B-v0.1": dict(n_query_groups=2, n_expert=4, n_expert_per_token=2),
    "Qwen3-30B-A3B": dict(n_query_groups=2, moe_intermediate_size=32, n_expert=4, n_expert_per_token=2),
    "OLMo-2-1124-7B": dict(n_query_groups=4),
}


def tiny_gpt(name: str, n_layer: int = 2, block_size: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(Config.from_name(name, n_layer=n_layer, block_size=block_size, **TINY, **FAMILIES[name]))


def _batch(T: int = 64):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 500, (2, T), generator=g)
    targets = torch.randint(0, 500, (2, T), generator=g)
    targets[:, :5] = -100
    return idx, targets


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_loss_models_layers_are_gpt_forward_bit_for_bit(name):
    gpt = tiny_gpt(name, n_layer=6 if name.startswith("Gemma-3") else 2)  # Gemma-3: one global layer in six
    idx, targets = _batch()
    logits = gpt(idx)
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    assert torch.equal(LossModel(gpt)(idx, targets), expected)


def test_a_gpt_forward_other_than_the_one_checked_is_litgpts_own_with_one_warning(monkeypatch):
    monkeypatch.setitem(litgpt_source.CHECKED, "GPT.forward", "0" * 16)
    litgpt_source.is_checked.cache_clear()
    gpt = tiny_gpt("gemma-2-2b")
    idx, targets = _batch()
    calls = []
    gpt.register_forward_hook(lambda module, args, out: calls.append(out))
    try:
        with pytest.warns(UserWarning, match=r"GPT.forward is not the one checked \(litgpt 0.5.13\)"):
            loss = LossModel(gpt)(idx, targets)
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            LossModel(gpt)(idx, targets)
    finally:
        litgpt_source.is_checked.cache_clear()
    assert not again
    assert len(calls) == 2  # GPT.forward itself ran
    assert torch.equal(loss, F.cross_entropy(calls[0].reshape(-1, 512), targets.reshape(-1)))


def test_the_digests_are_of_the_installed_litgpt():
    assert litgpt_source.digest(GPT.forward) == litgpt_source.CHECKED["GPT.forward"]
    assert litgpt_source.digest(CausalSelfAttention.forward) == litgpt_source.CHECKED["CausalSelfAttention.forward"]
