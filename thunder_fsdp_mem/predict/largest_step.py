"""The largest step that fits a device (``thunder-fsdp-mem fit 80GB``).

``fit_step(spec, capacity, config=..., **options) -> StepFit``: the largest sequence length (a power of two, at the
spec's micro-batch) and the largest micro-batch (a power of two, at the spec's sequence length) whose predicted
step peak (``emulate.trace_step``, the loss and AdamW's step included) is within ``capacity`` bytes per rank.
``config``: None for Thunder without the transform; a ``MemoryConfig``, whose ``memory_budget`` is then the
capacity (the transform recomputes what it must to fit). Each candidate is one step traced on the meta device;
the search is a bisection over the candidates (``largest``), which takes the peak to grow with the step's size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.predict.emulate import plan_step, trace_step
from thunder_fsdp_mem.training import litgpt_models

SHORTEST = 256  # the first sequence length tried
LONGEST = 2**20
MICRO_BATCHES = tuple(2**k for k in range(7))  # 1 to 64


@dataclass(frozen=True, slots=True)
class Longest:
    """The longest sequence length the search tries, and why it stops there."""

    tokens: int
    why: str


def longest_for(configured: int | None, block_size: int) -> Longest:
    """The longest sequence length to try: the model's configured block size (its longest position), or the step's
    ``block_size`` where that is longer, at most ``LONGEST``."""
    if block_size > (configured or 0):
        tokens, why = block_size, "--block-size"
    else:
        tokens, why = configured, "the model's configured block size"
    if tokens >= LONGEST:
        return Longest(LONGEST, f"{LONGEST} tokens, the most the CLI takes")
    return Longest(sequence_lengths(tokens)[-1], why)


@dataclass(frozen=True, slots=True)
class Largest:
    """The largest candidate that fits (``value``, None: not even the smallest) and its predicted peak; the next
    candidate, which does not fit (``above``, None: the largest fits), and its peak."""

    value: int | None
    peak_bytes: int | None
    above: int | None
    above_peak_bytes: int | None


@dataclass(frozen=True, slots=True)
class StepFit:
    """``tokens``: the largest sequence length at the spec's micro-batch; ``micro_batch``: the largest micro-batch
    at the spec's sequence length. ``capacity``: the bytes per rank they fit."""

    capacity: int
    tokens: Largest
    micro_batch: Largest


def largest(peak_of: Callable[[int], int], candidates: Sequence[int], capacity: int) -> Largest:
    """The largest of the increasing ``candidates`` whose ``peak_of`` is at most ``capacity``, by bisection (each
    candidate's peak is taken to be at least the one before's)."""
    peaks: dict[int, int] = {}

    def fits(k: int) -> bool:
        peaks.setdefault(k, peak_of(candidates[k]))
        return peaks[k] <= capacity

    if not fits(0):
        return Largest(None, None, candidates[0], peaks[0])
    low, high = 0, len(candidates)  # low fits; high is past the end or does not fit
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    above = candidates[high] if high < len(candidates) else None
    return Largest(candidates[low], peaks[low], above, peaks.get(high))


def sequence_lengths(longest: int) -> tuple[int, ...]:
    """Powers of two from ``SHORTEST`` to ``longest`` (at least ``SHORTEST``)."""
    out = [SHORTEST]
    while out[-1] * 2 <= min(longest, LONGEST):
        out.append(out[-1] * 2)
    return tuple(out)


def fit_step(
    spec: litgpt_models.ModelSpec,
    capacity: int,
    *,
    config: MemoryConfig | None = None,
    longest: int,
    micro_batch_size: int = 1,
    on_trace: Callable[[], None] = lambda: None,
    **options,
) -> StepFit:
    """See the module's docstring. ``longest``: the longest sequence length tried; ``options``: ``trace_step``'s
    (mode, shard, world size, device type, dtype, executors); ``on_trace``: called after each traced candidate."""
    if config is not None:
        config = dataclasses.replace(config, memory_budget=capacity)

    def peak(tokens: int, micro_batch: int) -> int:
        sized = dataclasses.replace(spec, block_size=tokens)
        if config is None:
            step = trace_step(sized, micro_batch_size=micro_batch, **options)
        else:
            step, _ = plan_step(sized, config, micro_batch_size=micro_batch, **options)
        on_trace()
        return step.peak_bytes

    tokens = largest(lambda t: peak(t, micro_batch_size), sequence_lengths(longest), capacity)
    micro_batch = largest(lambda m: peak(spec.block_size, m), MICRO_BATCHES, capacity)
    return StepFit(capacity, tokens, micro_batch)
