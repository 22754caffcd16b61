"""How long ``analyze`` takes on a large trace: the backward of a 32-layer stablecode-3b at 8192 tokens
(about 14,000 bound symbols), traced on the meta device (no memory, no compute; Thunder's compilation of the
model dominates the run time, the analysis is timed alone).

    python -m benchmarks.performance.analyze_speed [--n-layers 32] [--block-size 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import thunder
import torch

from thunder_fsdp_mem import analyze
from thunder_fsdp_mem.training import litgpt_models


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    spec = litgpt_models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    model = litgpt_models.build(spec, dtype=torch.bfloat16, device="meta")
    idx, targets = litgpt_models.batch(spec, device="meta")
    t0 = time.perf_counter()
    jitted = thunder.jit(model)
    jitted(idx, targets).backward()
    compile_s = time.perf_counter() - t0
    for name, trace in (
        ("forward", thunder.last_traces(jitted)[-1]),
        ("backward", thunder.last_backward_traces(jitted)[-1]),
    ):
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            analyze(trace)
            times.append(time.perf_counter() - start)
        print(
            f"{name}: {len(trace.bound_symbols)} bound symbols, analyze min {min(times):.3f} s, "
            f"median {sorted(times)[len(times) // 2]:.3f} s (of {args.repeat})"
        )
    print(f"(Thunder compilation on meta: {compile_s:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
