"""docs/upstream/: the proposed changes to Thunder and litgpt, and what the package does beside them.

The update_aliases patch leads the first name of a chain of in-place updates to the newest in one step and keeps
the reproducer's result; litgpt patched with the vectorized window mask gives litgpt's logits bit for bit.

On the reproducer's NeoX block, compiled by ThunderFX on CPU with attention in an operator executor (two fusions
each way, as on CUDA), run for real:
- Thunder with the patch saves less than Thunder as it is (the reproducer shows what it claims);
- our default transform on Thunder as it is saves what the patched Thunder saves and computes its output and
  gradients bit for bit: its results are those of the program Thunder means to run;
- with ``fusion_rematerialize=False`` the transform saves what Thunder as it is saves and keeps its results bit for
  bit (the default's may round otherwise: a moved op runs in another kernel; on this CPU block they happen not to);
- on the patched Thunder's traces the pass finds nothing to move: when Thunder is fixed, it steps aside;
- a saved budget that makes the backward recompute a forward fusion recomputes only what the backward reads of it
  (a fusion of fewer ops), and the results stay bit for bit.
"""

import types
from pathlib import Path
from unittest.mock import patch

import pytest
import thunder
import thunder.core.update_aliases as update_aliases
import torch

from support import upstream
from thunder_fsdp_mem.analysis.symbols import accumulates, is_fusion, nbytes
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import fusions, mincut
from thunder_fsdp_mem.passes.driver import Outcome
from thunder_fsdp_mem.passes.pipeline import FUSIONS
from thunder_fsdp_mem.transform import FSDPMemoryTransform

SIZE = dict(tokens=64, width=128)
UPSTREAM = Path(__file__).parents[1] / "docs" / "upstream"


def _saved(forward_trace) -> int:
    return sum(nbytes(t) for t in mincut.saved_tensors(forward_trace))


def _bitwise(a, b) -> bool:
    return torch.equal(a[2], b[2]) and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))


@pytest.fixture(scope="module")
def runs():
    repro = upstream()
    stock = repro.run_block(**SIZE)
    with repro.fixed_rematerialization():
        fixed = repro.run_block(**SIZE)
    default = FSDPMemoryTransform()
    ours = repro.run_block([default], **SIZE)
    opted_out = repro.run_block([FSDPMemoryTransform(MemoryConfig(fusion_rematerialize=False))], **SIZE)
    alone = repro.run_block([FSDPMemoryTransform(MemoryConfig(rematerialize=False))], **SIZE)  # the fusion pass
    return stock, fixed, ours, opted_out, default, alone


def test_the_patch_makes_thunder_save_less(runs):
    stock, fixed, *_ = runs
    assert _saved(fixed[0]) < _saved(stock[0])


def test_the_default_transform_computes_what_the_patched_thunder_computes_bit_for_bit(runs):
    stock, fixed, ours, _, transform, alone = runs
    (record,) = [r for r in transform.rewrites if r.pass_name == FUSIONS]
    assert record.outcome is Outcome.APPLIED
    assert _saved(alone[0]) == _saved(fixed[0])  # the fusion pass saves what the patched Thunder saves
    assert _bitwise(alone, fixed)
    # The cut through the regions then saves less (the GELU and the rotary embedding recomputed from the matmuls'
    # outputs, ``passes/regions.py``), with the same bits.
    assert _saved(ours[0]) < _saved(fixed[0])
    assert _bitwise(ours, fixed)


def test_the_opt_out_keeps_thunders_results_bit_for_bit(runs):
    stock, _, _, opted_out, *_ = runs
    assert _saved(opted_out[0]) < _saved(stock[0])  # the cut through the regions, not the fusion pass
    assert _bitwise(opted_out, stock)


def test_on_a_fixed_thunder_the_pass_finds_nothing_to_move(runs):
    _, fixed, *_ = runs
    forward, backward, less = fusions.into_consumers(fixed[0], fixed[1])
    assert less == 0 and forward is fixed[0] and backward is fixed[1]


def test_a_recomputed_fusion_that_holds_a_layer_norm_runs_again_whole_bit_for_bit(runs):
    # The budget has the backward recompute the block's second region (attention projection, residual, layer norm,
    # MLP) for the norm's and GELU's outputs; they need the norm's var_mean, so the region runs again whole, by the
    # forward's own callable (a region of those ops alone would be a new kernel, free to add in another order).
    stock = runs[0]
    transform = FSDPMemoryTransform(MemoryConfig(saved_budget=150_000, fusion_rematerialize=False, strict=True))
    forward, backward, *results = upstream().run_block([transform], **SIZE)
    (record,) = [r for r in transform.rewrites if r.pass_name == "rematerialization"]
    assert record.outcome is Outcome.APPLIED and record.saved_after <= 150_000
    regions = {b.sym.name: b for b in forward.bound_symbols if is_fusion(b)}
    again = [b for b in backward.bound_symbols if is_fusion(b) and b.sym.name in regions]
    assert again and all(b._call_ctx == regions[b.sym.name]._call_ctx for b in again)
    assert all(accumulates(b) and len(b.subsymbols) == len(regions[b.sym.name].subsymbols) for b in again)
    assert _bitwise((forward, backward, *results), stock)


# --- docs/upstream/update_aliases.patch and litgpt_window_mask.patch -------------------------------------------


def _beside(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"thunder_fsdp_mem_upstream_{name}", UPSTREAM / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_update_aliases_patch_leads_the_first_name_to_the_newest_in_one_step_and_keeps_results():
    from thunder.core.proxies import TensorProxy, variableify
    from thunder.core.trace import TraceCtx, tracectx

    repro = _beside("reproduce_update_aliases")
    fixed = repro.patched_update_swap_map()
    with tracectx(TraceCtx()):
        proxy = thunder.core.proxies.proxy(torch.zeros(2))
        names = [TensorProxy(like=proxy) for _ in range(4)]
    stock_map, fixed_map = {}, {}
    for new in names[1:]:  # three in-place updates of names[0]
        update_aliases._update_swap_map(stock_map, variableify(names[0]), new)
        fixed(fixed_map, variableify(names[0]), new)
    assert stock_map[variableify(names[0])] is names[1]  # as it is: a chain, walked again at each update
    assert fixed_map[variableify(names[0])] is names[3]  # patched: the first name leads to the newest in one step

    def end(name):
        while variableify(name) in fixed_map:
            name = fixed_map[variableify(name)]
        return name

    assert all(end(n) is names[3] for n in names)
    with patch.object(update_aliases, "_update_swap_map", new=fixed):
        _, same = repro.first_call(48)
    assert same


def test_litgpts_patched_window_mask_gives_litgpts_logits_bit_for_bit():
    import litgpt.model

    from test_litgpt_source import _batch, tiny_gpt

    apply_patch = _beside("patching").apply_patch
    source = Path(litgpt.model.__file__).read_text()
    patched = types.ModuleType("litgpt_model_patched")
    patched.__file__ = litgpt.model.__file__
    diff = (UPSTREAM / "litgpt_window_mask.patch").read_text()
    exec(compile(apply_patch(source, diff), litgpt.model.__file__, "exec"), patched.__dict__)
    stock = tiny_gpt("gemma-2-2b")
    fixed = patched.GPT(stock.config)
    fixed.load_state_dict(stock.state_dict())
    idx, _ = _batch()
    assert torch.equal(fixed(idx), stock(idx))


# --- docs/upstream/reproduce_inductor_gather.py -----------------------------------------------------------------


def test_inductor_reads_a_mutated_input_after_its_write_unless_the_gather_comes_first():
    eager, compiled, fixed = _beside("reproduce_inductor_gather").run()
    assert fixed == pytest.approx(eager, rel=1e-6)
    if torch.__version__.startswith("2.11."):  # the version the report is made against
        assert abs(compiled - eager) > 0.1
