"""The passes of ``FSDPMemoryTransform``, in the order the driver runs them, as ``MemoryConfig`` chooses them.

Each pass declares itself (``declaration.Declaration``: its name, the ``MemoryConfig`` switches that turn it on,
what it rewrites, the function that proposes its rewrite); ``DECLARED`` lists them in order, and
``pipeline(config, regather=...) -> list[driver.Pass]`` keeps those ``config`` switches on:
1. ``folded casts`` (``casts.PASS``: ``fold_casts``): a 16-bit elementwise op Thunder brackets between casts, run
   as one op;
2. ``fusion rematerialization`` (``fusions.PASS``; ``fusion_rematerialize``, on by default): each backward fusion
   recomputes the cheap tail of the forward fusions it reads from, as Thunder's own rematerialization means to and at
   times does not;
3. ``rematerialization`` (``recompute.PASS``; ``rematerialize``): what the forward saves, by a minimum cut, the
   rest recomputed in backward; with a memory budget, matmuls and attention too, as ``budget.cheapest_plan`` chooses;
4. ``folded casts after rematerialization`` (``fold_casts`` and ``rematerialize``): the brackets of the upcasts
   the backward now recomputes (runs only where rematerialization was applied);
   ``recomputed regions`` (``fold.PASS``; ``rematerialize``, after it): the backward's regions that recompute
   elementwise ops run inside the regions that read them;
5. ``order`` (``reorder.PASS``; ``reorder``): the trace that holds the peak in its lowest-peak order;
6. ``all-gathers`` (``gathers.PASS``; ``gathers``), under Thunder's fsdp: re-gathering in backward (ZeRO3, or as
   ``regather`` says), then the all-gathers of both traces in a window. Last but one: the memory-only judge of the
   order would move all-gathers next to their waits;
7. ``reduce-scatters`` (``scatters.PASS``; ``scatters``), under Thunder's fsdp: each issued when its gradient is
   complete;
8. ``loss chunks`` (``chunks.PASS``; ``chunk_loss``): the fewest chunks of each chunked linear cross-entropy
   (put in the trace before autograd by ``loss.rewrite``) that keep the estimated peak.

What judges them is ``budget.estimator(config, pair)``, and with a memory cap ``budget.cap_shortfall(config)``.
"""

from __future__ import annotations

import dataclasses

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import casts, chunks, fold, fusions, gathers, recompute, reorder, scatters
from thunder_fsdp_mem.passes.declaration import Declaration
from thunder_fsdp_mem.passes.driver import Pass

DECLARED: tuple[Declaration, ...] = (
    casts.PASS,
    fusions.PASS,
    recompute.PASS,
    casts.PASS.again_after(recompute.PASS),
    fold.PASS,
    reorder.PASS,
    gathers.PASS,
    scatters.PASS,
    chunks.PASS,
)
FOLD, FUSIONS, REMATERIALIZE, ORDER = casts.PASS.name, fusions.PASS.name, recompute.PASS.name, reorder.PASS.name
ALL_GATHERS, REDUCE_SCATTERS = gathers.PASS.name, scatters.PASS.name
CHUNKED_LOSS = "chunked loss"  # before autograd (``loss.rewrite``), recorded beside the passes
ROUTED_ATTENTION = "attention executor"  # before autograd (``attention``), recorded beside the passes


def pipeline(config: MemoryConfig, *, regather: bool) -> list[Pass]:
    """The passes ``config`` asks for, in order; ``regather``: gather parameters again in backward (ZeRO3), what
    the passes read as ``config.regather``."""
    resolved = dataclasses.replace(config, regather=regather)
    return [declared.bound(resolved) for declared in DECLARED if declared.enabled(config)]
