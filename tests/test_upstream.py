"""docs/upstream/: the proposed change to Thunder's rematerialization, and our fusion pass beside it.

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

import pytest
import torch

from support import upstream
from thunder_fsdp_mem.analysis.symbols import accumulates, is_fusion, nbytes
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import fusions, recompute
from thunder_fsdp_mem.passes.driver import Outcome
from thunder_fsdp_mem.passes.pipeline import FUSIONS
from thunder_fsdp_mem.transform import FSDPMemoryTransform

SIZE = dict(tokens=64, width=128)


def _saved(forward_trace) -> int:
    return sum(nbytes(t) for t in recompute.saved_tensors(forward_trace))


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
