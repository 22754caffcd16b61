"""training.litgpt_models: ``--override FIELD=INT`` strings become a ModelSpec's overrides, which reach litgpt's Config;
anything else is a ValueError that names it."""

import pytest

from thunder_fsdp_mem.training import litgpt_models


def test_overrides_reach_the_config():
    overrides = litgpt_models.parse_overrides(["n_embd=128", "n_head=4", "sliding_window_size=-1"])
    assert overrides == (("n_embd", 128), ("n_head", 4), ("sliding_window_size", -1))
    config = litgpt_models.ModelSpec(name="pythia-14m", overrides=overrides[:2]).config()
    assert (config.n_embd, config.n_head) == (128, 4)


@pytest.mark.parametrize("bad", ["n_embd", "n_embd=", "=128", "n_embd=1.5", "n_embd=x"])
def test_a_pair_not_of_the_form_field_int_is_named(bad):
    with pytest.raises(ValueError, match=f"FIELD=INT, got '{bad}'"):
        litgpt_models.parse_overrides(["n_head=4", bad])
