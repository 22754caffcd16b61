"""Thunder with FSDPMemoryTransform against Thunder without it: the loss and every gradient, bit for bit.

    python benchmarks/bitwise.py --device cuda [--deterministic] [--model stablecode-completion-alpha-3b]
        [--n-layers 1] [--block-size 2048] [--executors default+cat|default|fused]

One ``thunder.jit`` step of the litgpt model with its loss (``models.build``, bf16), then the same step
with the transform in several configurations: folded casts alone, rematerialization without folding, both without
reordering, and everything. Each line names the gradients that differ from the run without the transform; a second
run without the transform shows whether the step is deterministic at all (on CUDA, attention's backward is not
unless ``--deterministic`` sets ``torch.use_deterministic_algorithms``; export ``CUBLAS_WORKSPACE_CONFIG=:4096:8``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import thunder  # noqa: E402
import torch  # noqa: E402

from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig  # noqa: E402
from thunder_fsdp_mem.training import models, runtime  # noqa: E402

VARIANTS = {
    "without the transform, again": None,
    "folded casts alone": MemoryConfig(rematerialize=False, reorder=False, strict=True),
    "rematerialization, casts not folded": MemoryConfig(fold_casts=False, strict=True),
    "folded casts and rematerialization, no reordering": MemoryConfig(reorder=False, strict=True),
    "everything (the default)": MemoryConfig(strict=True),
}


def step(spec: models.ModelSpec, device: str, config: MemoryConfig | None, executors: str):
    model = models.build(spec, dtype=torch.bfloat16, device=device)
    idx, targets = models.batch(spec, device=device)
    transforms = [FSDPMemoryTransform(config)] if config is not None else []
    jitted = thunder.jit(model, executors=runtime.executors(executors), transforms=transforms)
    loss = jitted(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--model", default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=2048)
    p.add_argument("--executors", choices=runtime.EXECUTOR_CHOICES, default="default+cat")
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(args.deterministic)
    spec = models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    loss, grads = step(spec, args.device, None, args.executors)
    print(f"{args.model}, {args.n_layers} layers, {args.block_size} tokens, {args.device}, executors "
          f"{args.executors}, deterministic algorithms: {args.deterministic}; {len(grads)} gradients")
    for name, config in VARIANTS.items():
        loss_v, grads_v = step(spec, args.device, config, args.executors)
        differ = [n for n in grads if not torch.equal(grads[n], grads_v[n])]
        print(f"{name}: loss equal {torch.equal(loss, loss_v)}; gradients that differ: {differ or 'none'}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
