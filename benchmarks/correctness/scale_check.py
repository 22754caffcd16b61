"""``loss.scale`` on a GPU: the compiled Triton kernel against torch's multiplication, bit for bit, in float32,
bfloat16 and float16 for several cotangents (the CPU tests run it under Triton's interpreter, which rounds bfloat16
otherwise), and its time against ``mul_`` on a gradient of gemma-2-2b's head (256000 x 2304, bf16) for a cotangent
of one and of another value. Exits 1 where a product differs.

    python -m benchmarks.correctness.scale_check
"""

from __future__ import annotations

import sys

import torch

from thunder_fsdp_mem.loss.scale import scale_by_cotangent_

COTANGENTS = (1.0, 0.25, 1 / 3, 3.7, -0.0, float("inf"), float("nan"))
HEAD = (256000, 2304)


def _same(want: torch.Tensor, got: torch.Tensor) -> bool:
    nan = torch.isnan(want)
    ints = {4: torch.int32, 2: torch.int16}[want.element_size()]
    return torch.equal(nan, torch.isnan(got)) and torch.equal(want[~nan].view(ints), got[~nan].view(ints))


def _time_ms(fn, repeats: int = 20) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def main() -> int:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    wrong = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for c in COTANGENTS:
            for n in (7, 4096 * 3 + 5, 1 << 22):
                x = torch.randn(n, device=device, generator=gen).to(dtype)
                for cotangent_dtype in {dtype, torch.float32}:
                    cotangent = torch.tensor(c, device=device, dtype=cotangent_dtype)
                    got = x.clone()
                    scale_by_cotangent_(got, cotangent)
                    ok = _same(x * cotangent, got)
                    if not ok:
                        wrong.append(f"{dtype} x {c} ({cotangent_dtype}), {n} elements")
    print(f"products that differ from torch's: {', '.join(wrong) or 'none'}")
    grad = torch.randn(HEAD, device=device, generator=gen).to(torch.bfloat16)
    for c in (1.0, 0.5):
        cotangent = torch.tensor(c, device=device, dtype=torch.bfloat16)
        ours = _time_ms(lambda: scale_by_cotangent_(grad, cotangent))
        torchs = _time_ms(lambda: grad.mul_(cotangent))
        print(f"{HEAD} bf16, cotangent {c}: loss.scale {ours:.3f} ms, mul_ {torchs:.3f} ms")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
