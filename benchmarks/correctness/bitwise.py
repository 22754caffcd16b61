"""Thunder with FSDPMemoryTransform against Thunder without it: the loss and every gradient, bit for bit.

    python -m benchmarks.correctness.bitwise --device cuda [--deterministic] [--model stablecode-completion-alpha-3b]
        [--n-layers 1] [--block-size 2048] [--executors default+cat|default|default+inductor|fused] [--dtype bf16|fp32]
        [--override FIELD=INT ...] [--budget-fraction 0.95] [--least-peak] [--saved-budget 60MiB] [--thunderfx]
        [--only TEXT ...]

One ``thunder.jit`` step of the litgpt model with its loss (``litgpt_models.build``), then the same step with the
transform in several configurations: folded casts alone, rematerialization without folding, both without
reordering, everything; with ``--budget-fraction`` a memory budget at that fraction of the estimated peak with
everything (the line says whether the estimate met it); with ``--least-peak`` a budget of 1 byte, which the
transform cannot meet: it warns and recomputes all it can; with ``--saved-budget`` the most each forward may save
for backward (``MemoryConfig.saved_budget``, what ``plan_fsdp2`` gives each block), without Thunder's fusion
rematerialization, which changes rounding by design. ``--thunderfx`` compiles through ThunderFX
(``torch.compile`` with ``ThunderCompiler``, FSDP2's path) instead of ``thunder.jit``: Dynamo leaves to eager
PyTorch what Thunder cannot trace (a mixture of experts' routing), and there is no estimate of the whole step.
Each line names the gradients that differ from the run without the transform; a second
run without the transform shows whether the step is deterministic at all (on CUDA, attention's backward is not
unless ``--deterministic`` sets ``torch.use_deterministic_algorithms``; export ``CUBLAS_WORKSPACE_CONFIG=:4096:8``).
"""

from __future__ import annotations

import argparse
import warnings

import thunder
import torch
from thunder.dynamo import ThunderCompiler

from benchmarks.options import add_override
from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig, estimate_step
from thunder_fsdp_mem.training import litgpt_models, runtime
from thunder_fsdp_mem.units import parse_bytes

# The chunked loss changes rounding by design (``docs/accuracy.md`` gives its tolerances): off in every variant.
EVERYTHING = "everything but the chunked loss"
VARIANTS = {
    "without the transform, again": None,
    "folded casts alone": MemoryConfig(rematerialize=False, reorder=False, chunk_loss=False, strict=True),
    "rematerialization, casts not folded": MemoryConfig(fold_casts=False, chunk_loss=False, strict=True),
    "folded casts and rematerialization, no reordering": MemoryConfig(reorder=False, chunk_loss=False, strict=True),
    EVERYTHING: MemoryConfig(chunk_loss=False, strict=True),
    # Thunder's rematerialization between fusion regions changes rounding by design (``docs/design.md``); without it
    # every other pass, the cut through opened fusion regions included, must keep the bits.
    "everything but fusion rematerialization": MemoryConfig(fusion_rematerialize=False, chunk_loss=False, strict=True),
}


def step(
    spec: litgpt_models.ModelSpec,
    device: str,
    config: MemoryConfig | None,
    executors: str,
    dtype: torch.dtype,
    thunderfx: bool = False,
):
    """The loss, every gradient by name, and the estimated peak of the step with AdamW's state and step (as a
    budget counts it: ``MemoryConfig.budget_optimizer``; None through ThunderFX)."""
    model = litgpt_models.build(spec, dtype=dtype, device=device)
    idx, targets = litgpt_models.batch(spec, device=device)
    transforms = [FSDPMemoryTransform(config)] if config is not None else []
    if thunderfx:
        torch._dynamo.reset()
        compiled = torch.compile(
            model, backend=ThunderCompiler(executors=runtime.executors(executors), transforms=transforms)
        )
    else:
        compiled = thunder.jit(model, executors=runtime.executors(executors), transforms=transforms)
    loss = compiled(idx, targets)
    loss.backward()
    peak = None if thunderfx else estimate_step(compiled, optimizer=torch.optim.AdamW(model.parameters())).peak_bytes
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--model", default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=2048)
    p.add_argument("--executors", choices=runtime.EXECUTOR_CHOICES, default="default+cat")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    add_override(p)
    p.add_argument(
        "--budget-fraction",
        type=float,
        metavar="F",
        help="also run with a memory budget of F times the estimated peak with everything (0 < F <= 1)",
    )
    p.add_argument("--least-peak", action="store_true", help="also run with a budget of 1 byte (the least reachable)")
    p.add_argument(
        "--saved-budget",
        type=parse_bytes,
        metavar="SIZE",
        help="also run with each forward saving at most SIZE for backward (60MiB; MemoryConfig.saved_budget)",
    )
    p.add_argument("--thunderfx", action="store_true", help="compile through ThunderFX instead of thunder.jit")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="run only the variants whose names contain one of these")
    args = p.parse_args(argv)
    if args.budget_fraction is not None and not 0 < args.budget_fraction <= 1:
        p.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    if args.budget_fraction is not None and args.thunderfx:
        p.error("--budget-fraction needs the step's estimate, which --thunderfx does not give; use --least-peak")
    try:
        spec = litgpt_models.ModelSpec(
            name=args.model,
            n_layers=args.n_layers,
            block_size=args.block_size,
            overrides=litgpt_models.parse_overrides(args.override),
        )
        spec.config()
    except ValueError as e:
        p.error(str(e))
    torch.use_deterministic_algorithms(args.deterministic)
    dtype = litgpt_models.DTYPES[args.dtype]
    loss, grads, _ = step(spec, args.device, None, args.executors, dtype, args.thunderfx)
    print(
        f"{args.model} {spec.overrides or ''}, {args.n_layers} layers, {args.block_size} tokens, {args.dtype}, "
        f"{args.device}, {'ThunderFX' if args.thunderfx else 'thunder.jit'}, executors {args.executors}, "
        f"deterministic algorithms: {args.deterministic}; {len(grads)} gradients"
    )
    variants = [
        (name, config, None)
        for name, config in VARIANTS.items()
        if args.only is None or any(text in name for text in args.only)
    ]
    if args.least_peak:
        variants.append(
            ("the least peak reachable (a budget of 1 B)", MemoryConfig(memory_budget=1, chunk_loss=False), None)
        )
    if args.saved_budget is not None:
        variants.append(
            (
                f"a saved budget of {args.saved_budget} B, no fusion rematerialization",
                MemoryConfig(saved_budget=args.saved_budget, fusion_rematerialize=False, chunk_loss=False),
                None,
            )
        )
    for name, config, budget in variants:  # the budget's variant is added once the default's peak is known
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_v, grads_v, peak = step(spec, args.device, config, args.executors, dtype, args.thunderfx)
        differ = [n for n in grads if not torch.equal(grads[n], grads_v[n])]
        met = "" if budget is None else f" ({'within' if peak <= budget else 'over'} the budget)"
        estimated = "" if peak is None else f"; estimated peak {peak} B{met}"
        print(
            f"{name}: loss equal {torch.equal(loss, loss_v)}; gradients that differ: {differ or 'none'}{estimated}",
            flush=True,
        )
        for w in caught:
            if "FSDPMemoryTransform" in str(w.message):
                print(f"  warning: {w.message}")
        if name == EVERYTHING and args.budget_fraction is not None:
            budget = int(args.budget_fraction * peak)
            variants.append(
                (
                    f"a memory budget of {budget} B ({args.budget_fraction:g} of that peak)",
                    MemoryConfig(memory_budget=budget, chunk_loss=False),
                    budget,
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
