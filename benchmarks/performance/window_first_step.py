"""The first step of a model with sliding-window attention under ``thunder.jit`` (``LossModel`` and the default
``FSDPMemoryTransform``), with litgpt's mask loop and with ``vectorize_window_masks``, at growing sequence lengths:
the time Thunder takes to trace, transform and run it once. Each measurement in a fresh process::

    python -m benchmarks.performance.window_first_step [--model gemma-2-2b] [--layers 2] [--tokens 512 1024 2048] \\
        [--out f.jsonl]

The model is narrowed (64 wide, a 16-token window) so that the step itself is negligible beside the tracing: what
grows with the sequence is the loop's T in-place row writes, each traced and walked by Thunder's alias updates.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

NARROW = dict(
    n_embd=64, n_head=4, head_size=16, intermediate_size=128, n_query_groups=1, padded_vocab_size=512, vocab_size=500
)


def one(model: str, layers: int, tokens: int, mask: str) -> dict:
    """One first step in this process: ``mask`` is ``loop`` (litgpt's) or ``vectorized``."""
    import thunder
    import torch
    from litgpt import GPT, Config

    from thunder_fsdp_mem import FSDPMemoryTransform, LossModel, vectorize_window_masks

    torch.manual_seed(0)
    gpt = GPT(Config.from_name(model, n_layer=layers, block_size=tokens, sliding_window_size=16, **NARROW))
    if mask == "vectorized":
        vectorize_window_masks(gpt)
    idx = torch.randint(0, 500, (1, tokens))
    jitted = thunder.jit(LossModel(gpt), transforms=[FSDPMemoryTransform()])
    start = time.perf_counter()
    jitted(idx, torch.roll(idx, -1, dims=1)).backward()
    return {
        "model": model,
        "layers": layers,
        "tokens": tokens,
        "mask": mask,
        "first_step_s": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-2-2b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--out", type=Path)
    p.add_argument("--one", nargs=2, metavar=("TOKENS", "MASK"), help=argparse.SUPPRESS)  # the child's measurement
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, args.layers, int(args.one[0]), args.one[1])))
        return 0
    print("| tokens | litgpt's mask loop | vectorize_window_masks |\n|---|---|---|")
    for tokens in args.tokens:
        row = {}
        for mask in ("loop", "vectorized"):
            cmd = [sys.executable, "-m", "benchmarks.performance.window_first_step", "--model", args.model]
            cmd += ["--layers", str(args.layers), "--one", str(tokens), mask]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row[mask] = json.loads(proc.stdout.strip().splitlines()[-1])
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(row[mask]) + "\n")
        print(f"| {tokens} | {row['loop']['first_step_s']:.1f} s | {row['vectorized']['first_step_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
