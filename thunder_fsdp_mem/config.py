"""The one typed configuration of ``FSDPMemoryTransform``; the transform, the CLI and the benchmark build it."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_RECOMPUTE_WEIGHT = 0.04
BUDGET_LOSSES = ("cross_entropy",)
BUDGET_OPTIMIZERS = ("adamw",)
DEFAULT_MAX_INFLIGHT_ALLGATHERS = 2
DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS = 2
SIZE_FIELDS = ("memory_budget", "memory_cap", "saved_budget")  # bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Options of ``FSDPMemoryTransform``.

    fold_casts: run each elementwise op that Thunder brackets between an upcast to float32 and a rounding back
        as one op in the 16-bit dtype, where ATen's kernel is known to give the same bits (``casts.py``).
    rematerialize: choose what the forward saves for backward by a minimum cut, recomputing cheap ops in
        backward (``recompute.py``).
    fusion_rematerialize: have each backward fusion recompute the cheap tail of the forward fusions it reads from,
        where Thunder's own rematerialization means to and its order of pairs stops it (``fusions.py``; under
        ThunderFX a block's second backward region, which otherwise saves float32 intermediates). On by default;
        it changes something only where a fusion executor ran (nvFuser, torch.compile). The results are then
        those of the program Thunder means to run, its rematerialized one, not bit for bit those of the run without
        the transform: a moved op runs in the backward's kernel, which can round differently. False: every pass
        keeps the untransformed run's results bit for bit.
    recompute_weight: what one byte that recomputation reads or writes costs, in bytes saved for backward. The
        cut minimises saved bytes + ``recompute_weight`` x recomputation traffic: 0 saves the least whatever the
        recomputation costs; larger values recompute only where it saves much for little traffic (a float >= 0).
    reorder: put each trace's symbols in the order of lowest estimated peak, of three list schedules and the
        trace's own (``reorder.py``); collectives keep their order.
    gathers: under Thunder's fsdp, schedule the all-gathers (``gathers.py``).
    max_inflight_allgathers: under Thunder's fsdp, how many all-gathers may be in flight ahead of the one being
        waited for (``gathers.py``; an int >= 1).
    scatters: under Thunder's fsdp, issue each gradient's reduce-scatter as soon as the gradient is complete
        (``scatters.py``).
    max_inflight_reduce_scatters: under Thunder's fsdp, how many reduce-scatters may be in flight before the
        oldest is waited for (``scatters.py``; an int >= 1).
    regather: under Thunder's fsdp, save parameter shards instead of gathered parameters and gather again in
        backward. None (the default) does so when the model is sharded with ZeRO3.
    memory_budget: a per-rank peak in bytes (an int > 0) the step must fit: rematerialization then also
        recomputes matmuls, attention and whole blocks in backward, the least time per byte of peak removed first,
        until the estimated step peak (with ``budget_loss`` and ``budget_optimizer``) fits (``budget.py``). For a
        forward/backward pair that is the whole step (``thunder.jit``, Thunder's fsdp). None: no budget.
    memory_cap: with ``memory_budget``, the most the CUDA caching allocator may reserve (an int > 0: the GPU's
        memory, or the process's share of it under ``torch.cuda.set_per_process_memory_fraction``). The budget
        bounds allocated bytes, the device reserved ones: a plan must then also run when the allocator is replayed
        over its estimated step under the cap (``caching_allocator.py``), so that cached blocks too small for a request
        do not stop it. None: allocated bytes only.
    saved_budget: the most bytes a forward may save for backward beyond its inputs (an int >= 0), the same way;
        for a pair that is part of a step (each ThunderFX block under FSDP2), set from a step's budget by the
        report's planner (``thunder-fsdp-mem report --memory-budget``). None: no budget.
    budget_loss: the loss the caller computes on the forward's output, counted in ``memory_budget``'s step (one of
        ``BUDGET_LOSSES``: eager cross-entropy on the logits, as the benchmarks run it; None: the output is the
        loss, or nothing more is computed on it).
    budget_optimizer: the optimizer counted in ``memory_budget``'s step (``adamw``: two moments of each trained
        parameter, the shard under FSDP, and the temporaries of its step as torch runs it by default on the
        traces' device: ``foreach`` on CUDA; None: none).
    chunk_loss: compute a cross-entropy on a linear layer's output inside the traced program (the model and its
        loss jitted together: ``thunder_fsdp_mem.LossModel``) as a chunked linear cross-entropy
        (``thunder_fsdp_mem.loss``): no more than one chunk of logits is alive, forward or backward, and the
        gradients of the head are computed with the loss. The chunk count is the fewest that keeps the step's
        estimated peak (or budget). Its results differ from the unchunked loss's by rounding (``docs/accuracy.md``
        gives the tolerances); False keeps Thunder's loss.
    route_attention: where the first executor listed that claims ``scaled_dot_product_attention`` has no grad rule
        for it (a fusion executor listed ahead of the attention executors, as ``benchmark_litgpt.py``'s
        ``thunder_inductor`` lists Thunder's torch.compile executor), have the first attention executor listed that
        accepts the call run its forward and backward, as it would were it listed first (``attention.py``): Thunder
        would otherwise differentiate attention's decomposition and save its (T, T) probabilities for backward. The
        results are then that attention executor's, which differ from the decomposition's by rounding; False
        leaves the program's choice.
    recompute_scores: with ``fusion_rematerialize``, where attention stays decomposed inside a fusion region (a
        soft-cap, a mask, a fusion executor that claims attention), the backward's region computes the (T, T) scores
        and probabilities again from the query and key instead of the forward keeping them (``passes/fusions.py``),
        where that is cheaper than keeping them. Recomputed in another kernel, they can round otherwise, so the
        results then differ from the run without it by rounding; False keeps them from the forward.
    strict: raise instead of warning when a trace is not understood, a rewrite fails its checks, or a budget
        cannot be met (a warning returns the trace unchanged, or rewritten to the least peak reachable).
    """

    fold_casts: bool = True
    rematerialize: bool = True
    fusion_rematerialize: bool = True
    recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT
    reorder: bool = True
    gathers: bool = True
    max_inflight_allgathers: int = DEFAULT_MAX_INFLIGHT_ALLGATHERS
    scatters: bool = True
    max_inflight_reduce_scatters: int = DEFAULT_MAX_INFLIGHT_REDUCE_SCATTERS
    regather: bool | None = None
    memory_budget: int | None = None
    memory_cap: int | None = None
    saved_budget: int | None = None
    budget_loss: str | None = "cross_entropy"
    budget_optimizer: str | None = "adamw"
    chunk_loss: bool = True
    route_attention: bool = True
    recompute_scores: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        for name in (
            "fold_casts",
            "rematerialize",
            "fusion_rematerialize",
            "reorder",
            "gathers",
            "scatters",
            "chunk_loss",
            "route_attention",
            "recompute_scores",
            "strict",
        ):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool (True or False)")
        w = self.recompute_weight
        _check("recompute_weight", w, _number(w) and math.isfinite(w) and w >= 0, "a finite number >= 0")
        for name in ("max_inflight_allgathers", "max_inflight_reduce_scatters"):
            n = getattr(self, name)
            _check(name, n, isinstance(n, int) and not isinstance(n, bool) and n >= 1, "an int >= 1")
        _check(
            "regather",
            self.regather,
            self.regather is None or isinstance(self.regather, bool),
            "True, False or None (as the sharding strategy says)",
        )
        for name, least in zip(SIZE_FIELDS, (1, 1, 0)):
            n = getattr(self, name)
            _check(
                name,
                n,
                n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= least),
                f"None or an int >= {least} (bytes)",
            )
        _check(
            "budget_loss",
            self.budget_loss,
            self.budget_loss in (None, *BUDGET_LOSSES),
            f"None or one of {', '.join(BUDGET_LOSSES)}",
        )
        _check(
            "budget_optimizer",
            self.budget_optimizer,
            self.budget_optimizer in (None, *BUDGET_OPTIMIZERS),
            f"None or one of {', '.join(BUDGET_OPTIMIZERS)}",
        )
        if self.memory_cap is not None and self.memory_budget is None:
            raise ValueError(
                "MemoryConfig.memory_cap is what memory_budget's plan must also run under: it needs "
                "memory_budget (the cap itself, if no lower one is wanted)"
            )
        if self.budgeted and not self.rematerialize:
            raise ValueError(
                "MemoryConfig.memory_budget and saved_budget are met by rematerialization: they need rematerialize=True"
            )

    @property
    def budgeted(self) -> bool:
        return self.memory_budget is not None or self.saved_budget is not None


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"MemoryConfig.{name} must be {allowed}, got {value!r}")
