"""Which elementwise ops ATen runs on bf16 and f16 exactly as "upcast to float32, the op, round back": the check
behind the tables of ``thunder_fsdp_mem/passes/casts.py``.

    python -m benchmarks.cast_check [--device cuda]

For each op it compares ``op(x)`` with ``op(x.float()).to(dtype)`` bit for bit (results that are NaN on both sides
count as equal) and prints one line per op and dtype: the number of values that differ. Unary ops and ops with a
number run on every bf16 and f16 value, contiguous and transposed; binary ops on every pair of values on CUDA (one
operand broadcast against the other), and on 4 million random pairs on CPU. Ops with a number run with the number
first and second, for numbers exact in the 16-bit dtype and numbers that are not.
"""

from __future__ import annotations

import argparse

import torch

UNARY_OPS = {  # one tensor in, one out; by the name of Thunder's symbol (as ``casts.FOLDABLE`` names them)
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "expm1": torch.expm1,
    "log": torch.log,
    "log1p": torch.log1p,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "cos": torch.cos,
    "sin": torch.sin,
    "sqrt": torch.sqrt,
    "erf": torch.erf,
}
UNARY = {**UNARY_OPS, "pow": lambda x: torch.pow(x, 3.0)}
BINARY = {
    "add": lambda a, b: torch.add(a, b, alpha=1),
    "sub": lambda a, b: torch.sub(a, b, alpha=1),
    "mul": torch.mul,
    "true_divide": torch.true_divide,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}
WITH_NUMBER = ("add", "sub", "mul", "true_divide")
NUMBERS = {"exact": (0.5, 2.0, -0.25, 3.0), "inexact": (1.4142135623730951, 0.42044820762685725, 1e-05, 0.044715)}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def every_value(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).to(device)


def differ(got: torch.Tensor, want: torch.Tensor) -> int:
    both_nan = torch.isnan(got) & torch.isnan(want)
    return int(((got.view(torch.int16) != want.view(torch.int16)) & ~both_nan).sum())


def check_unary(f, x: torch.Tensor) -> int:
    layouts = (x, x.view(256, 256).t())
    return sum(differ(f(v), f(v.float()).to(x.dtype)) for v in layouts)


def check_binary(f, x: torch.Tensor) -> int:
    if x.device.type == "cuda":  # every pair, in slices of 4096 first operands
        return sum(
            differ(
                f(x[i : i + 4096, None], x[None, :]), f(x[i : i + 4096, None].float(), x[None, :].float()).to(x.dtype)
            )
            for i in range(0, x.numel(), 4096)
        )
    g = torch.Generator().manual_seed(0)
    a = x[torch.randint(0, x.numel(), (1 << 22,), generator=g).to(x.device)]
    b = x[torch.randint(0, x.numel(), (1 << 22,), generator=g).to(x.device)]
    return differ(f(a, b), f(a.float(), b.float()).to(x.dtype))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {args.device}; values that differ (0: the same bits)")
    for short, dtype in DTYPES.items():
        x = every_value(dtype, args.device)
        for name, f in UNARY.items():
            print(f"{short} {name}: {check_unary(f, x)}", flush=True)
        for name, f in BINARY.items():
            print(f"{short} {name}: {check_binary(f, x)}", flush=True)
        for name in WITH_NUMBER:
            f = BINARY[name]
            for kind, numbers in NUMBERS.items():
                first = sum(check_unary(lambda v, n=n: f(n, v), x) for n in numbers)
                second = sum(check_unary(lambda v, n=n: f(v, n), x) for n in numbers)
                print(f"{short} {name} {kind} number first: {first}, second: {second}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
