"""Saved bytes against recomputation traffic, per layer, for several ``recompute_weight`` values: the plan's own
figures (``mincut.plan_saved``) on a litgpt model traced on the meta device, no GPU and no memory needed.

    python -m benchmarks.performance.recompute_tradeoff --model stablecode-completion-alpha-3b --block-size 8192 \\
        [--no-fold]

It traces the model with 1 and with 2 layers and prints the difference (one layer's worth), then what
``reorder`` makes of the 2-layer pair at the default weight. On the meta device
the sdpa executor cannot ask CUDA which attention kernel it would run, so it is told flash attention, as on an
H200; without that, attention is decomposed and saves its whole score matrix.
"""

from __future__ import annotations

import argparse

import thunder
import thunder.executors.sdpaex as sdpaex

from thunder_fsdp_mem.passes import casts, mincut, plan_rewrite, reorder
from thunder_fsdp_mem.thunder_internals import sdpa_choice
from thunder_fsdp_mem.training import litgpt_models
from thunder_fsdp_mem.config import DEFAULT_RECOMPUTE_WEIGHT
from thunder_fsdp_mem.analysis.step import estimate_traces

WEIGHTS = (0.0, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.2, 0.3, 1.0)


def traces(spec: litgpt_models.ModelSpec, fold: bool):
    model = litgpt_models.build(spec, dtype=litgpt_models.DTYPES["bf16"], device="meta")
    jitted = thunder.jit(model)
    jitted(*litgpt_models.batch(spec, device="meta")).backward()
    pair = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    return tuple(casts.fold_casts(t, device_type="cuda") for t in pair) if fold else pair


def figures(forward, backward, weights) -> dict:
    """{weight or None (no transform): (saved bytes, estimated peak bytes, traffic bytes)}"""
    out = {None: (mincut.plan_saved(forward).before_bytes, estimate_traces(forward, backward).peak_bytes, 0)}
    for w in weights:
        plan = mincut.plan_saved(forward, recompute_weight=w)
        new_forward, new_backward = plan_rewrite.apply_plan(forward, backward, plan)
        out[w] = (plan.after_bytes, estimate_traces(new_forward, new_backward).peak_bytes, plan.traffic_bytes)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="stablecode-completion-alpha-3b")
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument(
        "--no-fold",
        dest="fold",
        action="store_false",
        help="leave the casts as Thunder makes them (the transform folds them first, as on CUDA)",
    )
    args = p.parse_args()
    with sdpa_choice(lambda *a, **k: sdpaex.SpdaBackend.FLASH_ATTENTION):
        pairs = [
            traces(litgpt_models.ModelSpec(name=args.model, n_layers=n, block_size=args.block_size), args.fold)
            for n in (1, 2)
        ]
    one, two = (figures(*pair, WEIGHTS) for pair in pairs)
    folded = "casts folded as on CUDA" if args.fold else "casts as Thunder makes them"
    print(f"{args.model}, {args.block_size} tokens, bf16, {folded}, per layer (2 layers less 1 layer)")
    print("| recompute_weight | saved | estimated peak | recomputation traffic |\n|---|---|---|---|")
    for w in (None, *WEIGHTS):
        saved, peak, traffic = (b - a for a, b in zip(one[w], two[w]))
        print(
            f"| {'no transform' if w is None else w} | {saved / 1e6:.0f} MB | {peak / 1e6:.0f} MB | "
            f"{traffic / 1e9:.2f} GB |"
        )
    forward, backward = pairs[1]
    forward, backward = plan_rewrite.apply_plan(
        forward, backward, mincut.plan_saved(forward, recompute_weight=DEFAULT_RECOMPUTE_WEIGHT)
    )
    before = estimate_traces(forward, backward).peak_bytes
    new_forward, new_backward, (won_forward, won_backward) = reorder.reorder_pair(forward, backward)
    after = estimate_traces(new_forward, new_backward).peak_bytes
    print(
        f"reorder, 2 layers, weight {DEFAULT_RECOMPUTE_WEIGHT}: estimated peak {before:,} -> {after:,} bytes "
        f"(forward: {won_forward}, backward: {won_backward})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
