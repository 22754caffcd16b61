"""Which elementwise ops ATen runs on bf16 and f16 exactly as "upcast to float32, the op, round back": the check
behind the tables of ``thunder_fsdp_mem/passes/casts.py``.

    python -m benchmarks.correctness.cast_check [--device cuda]

For each op it compares ``op(x)`` with ``op(x.float()).to(dtype)`` bit for bit (results that are NaN on both sides
count as equal) and prints one line per op and dtype: the number of values that differ. Unary ops and ops with a
number run on every bf16 and f16 value, contiguous and transposed; binary ops on every pair of values on CUDA (one
operand broadcast against the other), and on 4 million random pairs on CPU. Ops with a number run with the number
first and second, for numbers exact in the 16-bit dtype and numbers that are not.

    python -m benchmarks.correctness.cast_check --small-lengths [--device cuda]

checks the device's fold tables where a large tensor does not reach: every length from 1 to 67 (ATen's scalar
tails and remainder loops), strided and expanded views, broadcast operands (``small_lengths``).
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


FOLD_OPS = {  # every op of the fold tables, by the name of Thunder's symbol
    **UNARY_OPS,
    **{name: BINARY[name] for name in ("add", "sub", "mul", "true_divide", "maximum", "minimum")},
    "torch_div_prim_impl": torch.true_divide,
}


def small_lengths(
    device: str, dtype: torch.dtype, names, inexact: frozenset[tuple[str, int]], lengths=range(1, 68), seed: int = 0
) -> dict[str, int]:
    """Values that differ per op of ``names`` (and per op with a number) where ATen's kernels leave their
    vectorized body: every length of ``lengths``, contiguous, every other element and a column of an expanded view,
    a binary op also against a second operand of that length, a broadcast one-element operand and a row against a
    column; random bit patterns and random normal values. Ops with a number take exact numbers (0.5, -2.0) and,
    at the (op, position) pairs of ``inexact``, inexact ones."""
    g = torch.Generator().manual_seed(seed)
    wrong: dict[str, int] = {}

    def count(name, got, want):
        wrong[name] = wrong.get(name, 0) + differ(got, want)

    for n in lengths:
        bits = torch.randint(-32768, 32768, (2 * n + 3,), generator=g, dtype=torch.int32).to(torch.int16)
        for x in (bits.view(dtype), (torch.randn(2 * n + 3, generator=g) * 4).to(dtype)):
            x = x.to(device)
            views = (x[:n], x[1 : 2 * n + 1 : 2], x[:n].view(n, 1).expand(n, 3)[:, 1])
            for name in names:
                f = FOLD_OPS[name]
                for v in views:
                    if name in UNARY_OPS:
                        count(name, f(v), f(v.float()).to(dtype))
                        continue
                    for w in (x[n : 2 * n], x[2:3]):
                        count(name, f(v, w), f(v.float(), w.float()).to(dtype))
                    row, column = x[:n].view(n, 1), x[n : n + 3].view(1, 3)
                    count(name, f(row, column), f(row.float(), column.float()).to(dtype))
            for name in WITH_NUMBER:
                for position in (0, 1):
                    numbers = (0.5, -2.0, *(NUMBERS["inexact"] if (name, position) in inexact else ()))
                    for v, c in ((v, c) for v in views[:2] for c in numbers):
                        args = (c, v) if position == 0 else (v, c)
                        wide = (c, v.float()) if position == 0 else (v.float(), c)
                        count(f"{name} with a number", BINARY[name](*args), BINARY[name](*wide).to(dtype))
    return wrong


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--small-lengths",
        action="store_true",
        help="check the fold tables of --device at every length 1..67, strided and broadcast, instead",
    )
    args = p.parse_args(argv)
    if args.small_lengths:
        return _small_lengths(args.device)
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


def _small_lengths(device: str) -> int:
    """Every op of the device's fold tables at small lengths, and every other op of ``FOLD_OPS`` for contrast:
    one line each, 0 where the 16-bit kernel gives the bits of upcast, op, round."""
    from thunder_fsdp_mem.passes import casts

    kind = torch.device(device).type
    print(f"torch {torch.__version__}, {device}; values that differ at lengths 1..67 (0: the same bits)")
    wrong_folds = 0
    for short, dtype in DTYPES.items():
        table = casts.FOLDABLE[kind][short]
        found = small_lengths(device, dtype, list(FOLD_OPS), casts.INEXACT_NUMBER[kind])
        for name, n in found.items():
            folded = name in table or (name.endswith("with a number") and name.split()[0] in table)
            wrong_folds += n if folded else 0
            print(f"{short} {name}: {n} ({'folded' if folded else 'not folded'})", flush=True)
    print(f"values that differ in folded ops: {wrong_folds}")
    return 1 if wrong_folds else 0


if __name__ == "__main__":
    raise SystemExit(main())
