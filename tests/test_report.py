"""report: the name of a group of allocations alive at the peak (the layers' numbers as a range). The rendered
report is checked through the CLI (tests/test_cli.py, tests/test_measure.py)."""

import pytest

from thunder_fsdp_mem.report import pattern_name


@pytest.mark.parametrize(
    "names, expected",
    [
        ([f"block {i}.mlp.fc.weight (gathered)" for i in range(32)], "block [0-31].mlp.fc.weight (gathered)"),
        ([f"t_transformer_h_{i}_attn_qkv_weight" for i in (3, 1, 2)], "t_transformer_h_[1-3]_attn_qkv_weight"),
        ([f"block {i}.norm_{j}.weight" for i in (0, 2, 4, 6, 8) for j in (1, 2)], "block [0,2,4,6,...].norm_[1-2].weight"),
        (["block 7.attn.proj.weight (shard)"], "block 7.attn.proj.weight (shard)"),
        # a trace's own names carry no layer; names that differ in more than numbers keep the first
        (["t813", "t802"], "t813"),
        (["AdamW exp_avg of block 0.mlp.fc.weight", "AdamW exp_avg_sq of block 0.mlp.fc.weight"],
         "AdamW exp_avg of block 0.mlp.fc.weight"),
    ],
)
def test_pattern_name(names, expected):
    assert pattern_name(names) == expected
