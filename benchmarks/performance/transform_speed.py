"""How long FSDPMemoryTransform takes against Thunder's own compilation, for a litgpt model traced on the meta
device (no memory, no compute: Thunder runs every op for its shapes only).

    python -m benchmarks.performance.transform_speed --model stablecode-completion-alpha-3b --n-layers 32 \\
        --block-size 8192

The traces are those the GPU runs (``--device-type cuda``, the benchmark's executors): attention's kernel, the
torch.compile executors' claims and the casts the transform folds are CUDA's (``meta.as_on``). Prints
Thunder's compile time of the first call without the transform, with it, the transform's own time (the seconds
the pass driver records for every pass, checks and estimates included), and what each pass did.
"""

from __future__ import annotations

import argparse
import time

import thunder

from thunder_fsdp_mem.predict import meta
from thunder_fsdp_mem.training import litgpt_models, runtime
from thunder_fsdp_mem.transform import FSDPMemoryTransform


def compile_seconds(
    spec: litgpt_models.ModelSpec, transforms: list, device_type: str, executors: str
) -> tuple[float, object]:
    chosen = runtime.executors(executors)
    with meta.as_on(device_type, chosen):
        model = litgpt_models.build(spec, dtype=litgpt_models.DTYPES["bf16"], device="meta")
        idx, targets = litgpt_models.batch(spec, device="meta")
        jitted = thunder.jit(model, executors=chosen, transforms=transforms)
        start = time.perf_counter()
        jitted(idx, targets).backward()
        return time.perf_counter() - start, jitted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda", help="the device the traces are for")
    p.add_argument("--executors", choices=runtime.EXECUTOR_CHOICES, default="default+cat")
    args = p.parse_args()
    spec = litgpt_models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    plain, _ = compile_seconds(spec, [], args.device_type, args.executors)
    transform = FSDPMemoryTransform(strict=True)
    with_it, _ = compile_seconds(spec, [transform], args.device_type, args.executors)
    seconds = sum(r.seconds for r in transform.rewrites)
    print(
        f"{args.model}, {args.n_layers} layers, {args.block_size} tokens, thunder.jit on meta as on "
        f"{args.device_type}, executors {args.executors}"
    )
    print(f"Thunder compile, first call: {plain:.1f} s without the transform, {with_it:.1f} s with it")
    print(f"transform: {seconds:.2f} s = {100 * seconds / plain:.2f}% of Thunder's compile time")
    print(transform.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
