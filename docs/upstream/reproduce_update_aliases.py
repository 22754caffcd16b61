"""Thunder's first call of a function that writes one tensor in place T times grows as T squared: a reproducer.

    python reproduce_update_aliases.py     # lightning-thunder 0.2.7 (tested with 0.2.7.dev20260201), torch 2.11

litgpt's sliding-window attention (gemma-2, Gemma-3) builds its (T, T) mask on every training forward by a loop of
T row writes into one tensor. ``thunder.jit`` traces each write as an in-place op, and ``update_aliases`` (run on
every trace) gives the tensor a new name after each: ``_update_swap_map`` records old name -> new name and, to add
an entry, walks the chain from the first name to the newest; ``BoundSymbol.from_bsym_swap_proxies`` walks the same
chain for every later reader of the first name. Each of the T writes walks a chain as long as the writes before
it. This prints the first call's seconds at growing T, with ``update_aliases`` as it is and with
``update_aliases.patch`` (beside this file: each walk leaves every name of the chain pointing at the newest),
and checks that both give the same result as eager PyTorch, bit for bit.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path
from unittest.mock import patch

import thunder
import thunder.core.update_aliases as update_aliases
import torch

sys.path.insert(0, str(Path(__file__).parent))
from patching import apply_patch  # noqa: E402  (beside this file)

PATCH = Path(__file__).with_name("update_aliases.patch")
WINDOW = 64


def window_mask(x: torch.Tensor) -> torch.Tensor:
    """litgpt's loop (``CausalSelfAttention.forward``), added to ``x``."""
    T = x.size(-1)
    mask = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device)
    for i in range(T):
        mask[i, max(0, i - WINDOW + 1) : i + 1] = 0.0
    return x + mask


def patched_update_swap_map():
    """``_update_swap_map`` of Thunder's ``update_aliases`` with ``update_aliases.patch`` applied."""
    source = Path(update_aliases.__file__).read_text()
    module = types.ModuleType("update_aliases_patched")
    module.__file__ = update_aliases.__file__
    exec(compile(apply_patch(source, PATCH.read_text()), update_aliases.__file__, "exec"), module.__dict__)
    return module._update_swap_map


def first_call(T: int) -> tuple[float, bool]:
    x = torch.randn(T, T)
    start = time.perf_counter()
    out = thunder.jit(window_mask)(x)
    return time.perf_counter() - start, torch.equal(out, window_mask(x))


def main(lengths=(256, 512, 1024)) -> None:
    fixed = patched_update_swap_map()
    for T in lengths:
        stock, stock_ok = first_call(T)
        with patch.object(update_aliases, "_update_swap_map", new=fixed):
            patched, patched_ok = first_call(T)
        print(
            f"T={T:5d}  first call: as it is {stock:6.1f} s, with update_aliases.patch {patched:6.1f} s; "
            f"results as eager's: {stock_ok and patched_ok}"
        )


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (256, 512, 1024))
