"""``loss.scale``: the chunked loss's backward multiplying its gradients by the cotangent in place. Its Triton kernel
runs here on CPU tensors under Triton's interpreter (a subprocess: the interpreter is chosen when the kernel is
defined) and must give ``x * cotangent`` bit for bit, leave the tensor untouched for a cotangent of one, and cover
every element whatever the grid. The interpreter rounds float32 to bfloat16 by truncation where the compiled kernel
rounds to nearest even (torch's rounding), so in bfloat16 only cotangents whose products are exact are compared."""

import json
import os
import subprocess
import sys

import pytest
import torch

from support import ROOT
from thunder_fsdp_mem.loss.scale import scale_by_cotangent_

pytestmark = pytest.mark.smoke

_INTERPRETED = r"""
import json, torch
from thunder_fsdp_mem.loss import scale

cases = {
    "float32": (1.0, 0.25, 3.7, -0.0, float("inf"), float("nan")),
    "float16": (1.0, 0.25, 3.7, -0.0, float("nan")),
    "bfloat16": (1.0, 0.25, -2.0),
}
results = []
gen = torch.Generator().manual_seed(0)
for name, cotangents in cases.items():
    dtype = getattr(torch, name)
    for c in cotangents:
        for n, programs in ((10000, 2), (4096, 7), (5, 1)):
            x = torch.randn(n, generator=gen).to(dtype)
            x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])[:n].to(dtype)
            cotangent = torch.tensor(c, dtype=dtype)
            want = x * cotangent
            got = x.clone()
            scale.launch(got, cotangent, programs=programs)
            nan = torch.isnan(want)
            ints = torch.int32 if dtype == torch.float32 else torch.int16
            results.append({
                "case": f"{name} x {c}, {n} elements, {programs} programs",
                "same_nans": bool(torch.equal(nan, torch.isnan(got))),
                "same_bits": bool(torch.equal(want[~nan].view(ints), got[~nan].view(ints))),
                "untouched": bool(torch.equal(x.view(ints), got.view(ints))),
                "one": c == 1.0,
            })
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_kernel_gives_the_product_bit_for_bit(interpreted):
    wrong = [r["case"] for r in interpreted if not (r["same_nans"] and r["same_bits"])]
    assert not wrong, wrong


def test_a_cotangent_of_one_leaves_the_gradient_untouched(interpreted):
    ones = [r for r in interpreted if r["one"]]
    assert ones and all(r["untouched"] for r in ones)
    assert not any(r["untouched"] for r in interpreted if not r["one"])  # the others do write (every element)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_off_cuda_it_multiplies_in_place_as_torch_does(dtype):
    x = torch.randn(3, 5).to(dtype)
    want = x * torch.tensor(0.3, dtype=dtype)
    before = x.data_ptr()
    scale_by_cotangent_(x, torch.tensor(0.3, dtype=dtype))
    assert x.data_ptr() == before and torch.equal(x, want)
