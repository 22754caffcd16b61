"""Bytes saved for backward by eager autograd, by Thunder, and by Thunder with FSDPMemoryTransform, on the test
configurations of each litgpt family (CPU; parameters and inputs excluded; counted with
``torch.autograd.graph.saved_tensors_hooks``, which sees eager autograd and Thunder's autograd function alike).

    python -m benchmarks.performance.saved_vs_eager [--n-layers 2]

The configurations and the count are the tests' (``tests/configs.py``, ``tests/support.py``, read from the
repository root as the namespace package ``tests``).
"""

from __future__ import annotations

import argparse
import dataclasses

import thunder
import torch

from tests.configs import BY_NAME
from tests.support import saved_bytes
from thunder_fsdp_mem import FSDPMemoryTransform
from thunder_fsdp_mem.training import litgpt_models


def measure(spec, dtype, transforms=None) -> int:
    model = litgpt_models.build(spec, dtype=dtype)
    idx, targets = litgpt_models.batch(spec)
    fn = model if transforms is None else thunder.jit(model, transforms=transforms)
    if transforms is not None:
        fn(idx, targets)  # compile first
    return saved_bytes(fn, idx, targets, held=[*model.parameters(), *model.buffers()])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layers", type=int, default=2)
    args = p.parse_args()
    print("| model | eager autograd | Thunder | Thunder + FSDPMemoryTransform |")
    print("|---|---|---|---|")
    for family, spec in BY_NAME.items():
        spec = dataclasses.replace(spec, n_layers=args.n_layers)
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            eager = measure(spec, dtype)
            plain = measure(spec, dtype, [])
            mem = measure(spec, dtype, [FSDPMemoryTransform(strict=True)])
            print(
                f"| {family}, {name}, {args.n_layers} blocks | {eager:,} | {plain:,} ({plain / eager:.2f}x) | "
                f"{mem:,} ({mem / eager:.2f}x) |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
