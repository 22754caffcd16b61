"""Inductor (torch 2.11, CPU) reads a mutated input after its write when a gather from it ends the fused kernel:
a reproducer.

    python reproduce_inductor_gather.py

The function reads ``z`` twice, for a row's log-sum-exp and for the value at one index of each row (a gather),
then writes ``softmax(z)`` over ``z``. Functionally both reads see ``z`` as it came in. Inductor's C++ backend
fuses all of it into one kernel whose loop nests run: the row reductions, the store over ``z``, then the gather,
which so reads the probabilities instead of the logits: the compiled sum differs from eager's. Gathering before
the compiled function (``gather_first``) gives eager's value. ``loss/operator.py``'s chunk kernel is of this form
(a chunk's loss and the gradient of its logits written over them) and gathers first.
"""

from __future__ import annotations

import torch


def as_written(z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    x = z.float()
    picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1)  # reads z before the write below
    lse = torch.logsumexp(x, dim=-1)
    z.copy_(torch.exp(x - lse.unsqueeze(-1)))  # overwrites z
    return (lse - picked).sum()


def gather_first(z: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    x = z.float()
    lse = torch.logsumexp(x, dim=-1)
    z.copy_(torch.exp(x - lse.unsqueeze(-1)))
    return (lse - picked).sum()


def run() -> tuple[float, float, float]:
    """Eager's sum, the compiled ``as_written``'s and the compiled ``gather_first``'s."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 1024, generator=g)
    idx = torch.randint(0, 1024, (64,), generator=g)
    eager = as_written(z.clone(), idx).item()
    compiled = torch.compile(as_written, fullgraph=True, dynamic=False)(z.clone(), idx).item()
    picked = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    fixed = torch.compile(gather_first, fullgraph=True, dynamic=False)(z.clone(), picked).item()
    return eager, compiled, fixed


if __name__ == "__main__":
    eager, compiled, fixed = run()
    print(f"eager {eager:.4f}  compiled as written {compiled:.4f}  compiled, gathered first {fixed:.4f}")
