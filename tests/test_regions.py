"""The cut through opened fusion regions (``passes/regions.py``): where one fusion region runs a block's matmuls and
the cheap ops between them, the forward saves a matmul's output and the backward recomputes the GELU and the rotary
embedding from it, bit for bit what the forward computed; and where that recomputation runs (``passes/fold.py``):
inside the region that reads it, or with its reader's matmul in the region of the GELU's derivative.

FSDP2's path (a ThunderFX graph per block) with Thunder's torch.compile executor after an attention executor (on CPU
the upstream reproducer's, torch's CPU flash kernels; on CUDA cuDNN's), so that the block's forward is two regions
around attention, as on a GPU: bfloat16, where a fusing compiler rounds only what it stores."""

import dataclasses

import pytest
import thunder
import torch
from litgpt import GPT
from thunder.core.proxies import TensorProxy
from thunder.dynamo import ThunderCompiler

from configs import NEOX
from support import upstream
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.analysis.symbols import is_fusion
from thunder_fsdp_mem.passes import budget, fold
from thunder_fsdp_mem.passes.mincut import recomputable
from thunder_fsdp_mem.passes.regions import opened
from thunder_fsdp_mem.predict.meta import as_on
from thunder_fsdp_mem.training import litgpt_models, runtime

SPEC = dataclasses.replace(NEOX, n_layers=1)  # C 128, 4 heads of 32, MLP 512, T 64
LONGER = dataclasses.replace(SPEC, block_size=256)


def _executors():
    return [upstream().cpu_attention, *runtime.executors("fused")]


def _block(config: MemoryConfig | None, spec=SPEC):
    torch.manual_seed(0)
    torch._dynamo.reset()
    gpt = GPT(spec.config()).to(torch.bfloat16)
    transforms = [FSDPMemoryTransform(config)] if config is not None else []
    backend = ThunderCompiler(executors=_executors(), transforms=transforms)
    block = gpt.transformer.h[0]
    T = spec.block_size
    x = torch.randn(1, T, gpt.config.n_embd, dtype=torch.bfloat16, requires_grad=True)
    y = torch.compile(block, backend=backend)(x, gpt.cos[:T].unsqueeze(0), gpt.sin[:T].unsqueeze(0))
    y.backward(torch.randn_like(y))
    (fn,) = [fn for info in backend.subgraph_infos for fn in (info.thunder_compiled_fns or [])]
    forward, backward = thunder.last_traces(fn)[-1], thunder.last_backward_traces(fn)[-1]
    grads = [x.grad, *(p.grad for p in block.parameters())]
    return y.detach(), grads, forward, backward


def _activations(forward) -> list[tuple[int, ...]]:
    """Shapes of the saved tensors the forward computes (not its arguments: the block's input, its parameters)."""
    arguments = {a.name for a in forward.args if isinstance(a, TensorProxy)}
    saved = forward.bound_symbols[-1].args[1][0]
    return sorted(tuple(t.shape) for t in saved if isinstance(t, TensorProxy) and t.name not in arguments)


def _opened_budget_block():
    """The block under a saved budget that only recomputing the MLP's first matmul meets, its search kept to opened
    regions: at this size a whole region costs as little as one matmul, and the budget would recompute it whole."""
    search = budget._search
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget, "_search", lambda *args: search(*args[:-1], True))
        return _block(MemoryConfig(fusion_rematerialize=False, saved_budget=150 * 1024, strict=True))


def _folded_block():
    """The default block with the fold pass made to fold every recomputed region into its reader, never to carry it
    along into a later region (the estimator has it carry the GELU at these sizes)."""
    fold_all = fold.fold
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fold, "fold", lambda bsyms, recomputed, carry=True: fold_all(bsyms, recomputed, carry=False))
        return _block(MemoryConfig(strict=True))


@pytest.fixture(scope="module")
def runs():
    return {
        "plain": _block(None),
        "no fusion remat": _block(MemoryConfig(fusion_rematerialize=False, strict=True)),
        "fusion remat alone": _block(MemoryConfig(rematerialize=False, strict=True)),
        "default": _block(MemoryConfig(strict=True)),
        "default, folded": _folded_block(),
        "budget, opened": _opened_budget_block(),
        "fusion remat alone, T 256": _block(MemoryConfig(rematerialize=False, strict=True), LONGER),
        "default, T 256": _block(MemoryConfig(strict=True), LONGER),
    }


def _equal(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_recomputing_inside_regions_keeps_the_bits(runs):
    assert _equal(runs["plain"], runs["no fusion remat"])  # every pass but Thunder's own fusion rematerialization
    assert _equal(runs["fusion remat alone"], runs["default"])  # the cut adds no rounding to Thunder's
    assert _equal(runs["fusion remat alone"], runs["default, folded"])  # nor the GELU folded into its reader
    assert _equal(runs["fusion remat alone, T 256"], runs["default, T 256"])  # nor the GELU carried along
    forward = runs["plain"][2]
    assert sum(is_fusion(b) for b in forward.bound_symbols) == 2  # two regions, attention between them


def test_the_block_saves_the_matmul_outputs_not_what_is_computed_from_them(runs):
    C, H, T, hs, mlp = 128, 4, 64, 32, 512
    # Thunder alone saves, among others, the GELU's input and output, and the rotated query and key.
    plain = _activations(runs["fusion remat alone"][2])
    assert plain.count((1, T, mlp)) == 2 and plain.count((1, H, T, hs)) == 4
    # With the cut: the two matmuls' outputs the backward recomputes from (qkv, the MLP's first), the attention's
    # output and log-sum-exp, and the layer norms' statistics.
    big = [s for s in _activations(runs["default"][2]) if len(s) > 2 and s[-1] > 1]
    assert big == sorted([(1, T, 3 * C), (1, T, mlp), (1, H, T, hs), (1, H, T)]), big
    backward = runs["default"][3]
    recomputing = [
        b for b in backward.bound_symbols if is_fusion(b) and not any(s.sym.name == "linear" for s in b.subsymbols)
    ]
    ops = {s.sym.name for b in recomputing for s in b.subsymbols}
    assert {"erf", "cat"} <= ops, ops  # the GELU, the rotary embedding's concatenation


def test_the_recomputed_gelu_runs_inside_a_region_that_reads_it(runs):
    # The GELU of the MLP's first matmul's output, recomputed for the second matmul's weight gradient. Folded, it runs
    # in the region of that matmul, after the region's first matmul; by default the estimator lets it go, with that
    # matmul, into the region that computes the GELU's derivative from the same saved output, so that one region
    # reads it. Neither leaves a region of its own.
    backward = runs["default, folded"][3]
    ops = [[s.sym.name for s in b.subsymbols] for b in backward.bound_symbols if is_fusion(b)]
    (names,) = [names for names in ops if "erf" in names and "exp" not in names]  # the GELU, not its derivative
    assert names.index("matmul") < names.index("erf"), names

    for run, T in (("default", SPEC.block_size), ("default, T 256", LONGER.block_size)):
        _assert_carried(*runs[run][2:], T)
    for run in ("default", "default, folded", "default, T 256"):
        backward = runs[run][3]
        for b in backward.bound_symbols:  # every region left without a matmul feeds attention's backward
            if is_fusion(b) and not _matmuls(b):
                outs = {o.name for o in b.flat_proxy_outs}
                read = [r for r in backward.bound_symbols if any(a.name in outs for a in r.flat_proxy_args)]
                assert any(not is_fusion(r) and r.sym.name not in ("del", "return") for r in read), b.sym.name


def _assert_carried(forward, backward, T: int) -> None:
    """The MLP's first matmul's output, saved, is read by one region: the GELU's derivative, the GELU and the second
    matmul's weight gradient from it."""
    C, mlp = 128, 512
    saved_by_forward = forward.bound_symbols[-1].args[1][0]
    (saved,) = [t for t in saved_by_forward if isinstance(t, TensorProxy) and t.shape == (1, T, mlp)]
    readers = [b for b in backward.bound_symbols if any(a.name == saved.name for a in b.flat_proxy_args)]
    (region,) = [b for b in readers if b.sym.name not in ("del", "python_del")]
    assert {"erf", "exp", "matmul"} <= {s.sym.name for s in region.subsymbols}
    assert (C, mlp) in [tuple(o.shape) for o in region.flat_proxy_outs]  # the second matmul's weight gradient


def _matmuls(region) -> list:
    return [s for s in region.subsymbols if s.sym.name == "matmul"]


def test_a_budget_recomputes_a_matmul_inside_its_region_bit_for_bit(runs):
    T, mlp = 64, 512
    assert _equal(runs["plain"], runs["budget, opened"])
    assert (1, T, mlp) in _activations(runs["no fusion remat"][2])
    assert (1, T, mlp) not in _activations(runs["budget, opened"][2])  # the MLP's first matmul's output
    backward = runs["budget, opened"][3]
    recomputing = [[s.sym.name for s in b.subsymbols] for b in backward.bound_symbols if is_fusion(b)]
    # A new region runs the matmul again from its saved input, then the GELU; no layer norm's reduction is rerun.
    (again,) = [ops for ops in recomputing if "erf" in ops]
    assert again.count("linear") == 1 and "var_mean" not in again, again


def test_a_trace_without_mixed_regions_is_not_opened(runs):
    forward = runs["plain"][2]
    regions = opened(forward.bound_symbols, recomputable)
    assert regions is not None and regions.stored and regions.views
    unfused = [b for b in forward.bound_symbols if not is_fusion(b)]
    assert opened(unfused, recomputable) is None


def _stablecode_block(transform):
    """stablecode-3b's block at 8192 tokens as FSDP2 runs it, traced on the meta device with the project's fused
    executors as on one H100: (the forward's saved tensors beyond its arguments, the transform)."""
    spec = litgpt_models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=1, block_size=8192)
    executors = runtime.executors("fused")
    with as_on("cuda", executors):
        with torch.device("meta"):
            gpt = GPT(spec.config()).to(torch.bfloat16)
        torch._dynamo.reset()
        backend = ThunderCompiler(executors=executors, transforms=[transform])
        T = spec.block_size
        x = torch.empty(1, T, 2560, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = torch.compile(gpt.transformer.h[0], backend=backend)(x, gpt.cos[:T].unsqueeze(0), gpt.sin[:T].unsqueeze(0))
        y.backward(torch.empty_like(y))
    (fn,) = [fn for info in backend.subgraph_infos for fn in (info.thunder_compiled_fns or [])]
    forward = thunder.last_traces(fn)[-1]
    arguments = {a.name for a in forward.args if isinstance(a, TensorProxy)}
    saved = [t for t in forward.bound_symbols[-1].args[1][0] if isinstance(t, TensorProxy) and t.name not in arguments]
    return saved, transform


MiB = 2**20


def test_stablecode_block_at_8192_tokens_saves_what_the_default_executors_do():
    # The forward saves (beyond its arguments) qkv's output (1, T, 3C), the MLP's first matmul's output (1, T, 4C),
    # the attention's output and log-sum-exp, and the layer norms' statistics: 321 MiB, as with Thunder's default
    # executors, where 561 MiB were saved before (the GELU's output and the rotated query and key, 240 MiB).
    T = 8192
    saved, _ = _stablecode_block(FSDPMemoryTransform())
    assert sorted(tuple(t.shape) for t in saved if t.numel * t.dtype.bytes >= MiB) == sorted(
        [(1, T, 7680), (1, T, 10240), (1, 32, T, 80), (1, 32, T, 1)]
    )
    assert sum(t.numel * t.dtype.bytes for t in saved) == (120 + 160 + 40 + 1) * MiB + 4 * T * 4


@pytest.mark.parametrize(
    "budget_mib, dropped, matmuls",
    [(300, [(1, 8192, 7680)], 1), (200, [(1, 8192, 7680), (1, 8192, 10240)], 2)],
)
def test_stablecode_block_under_a_saved_budget_recomputes_single_matmuls(budget_mib, dropped, matmuls):
    # Each budget gives up the matmul outputs that fit it at the least time, qkv's first (0.41 ms for 120 MiB at
    # H200 rates), then the MLP's (0.54 ms, 160 MiB), each recomputed alone from its saved input; a whole region
    # (norm, qkv and the rotary embedding; or the MLP's three matmuls) would cost more time for what it frees.
    saved, transform = _stablecode_block(FSDPMemoryTransform(MemoryConfig(saved_budget=budget_mib * MiB)))
    shapes = [tuple(t.shape) for t in saved]
    assert all(shape not in shapes for shape in dropped), shapes
    assert sum(t.numel * t.dtype.bytes for t in saved) <= budget_mib * MiB
    (rewrite,) = [r for r in transform.rewrites if r.pass_name == "rematerialization" and r.recomputed]
    again = [r.symbol for r in rewrite.recomputed for _ in range(r.count)]  # grouped by symbol and source line
    assert again.count("linear") == matmuls and not any(name.startswith("TorchCompile") for name in again), again
