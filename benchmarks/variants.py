"""A mode with its own options, ``thunder-fsdp+mem@w=0.1@ag=1@ex=fused``, as ``compare``, ``curves`` and
``profile_step`` take them (``compare``'s docstring lists the options).

Entry points: ``split_variant(mode) -> Variant``; ``chosen_modes(modes, valid)``, the checked list of a ``--modes``
argument. Bad input raises ``UsageError`` naming the mode, the option and what it takes.
"""

from __future__ import annotations

import dataclasses

from benchmarks.options import UsageError
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.training import modes as mode_table
from thunder_fsdp_mem.training import loss_placement, runtime
from thunder_fsdp_mem.units import parse_bytes

VARIANT_KEYS = {
    "w": "recompute_weight",
    "ag": "max_inflight_allgathers",
    "rs": "max_inflight_reduce_scatters",
    "fold": "fold_casts",
    "fr": "fusion_rematerialize",
    "chunk": "chunk_loss",
    "budget": "memory_budget",
    "ex": "executors",
    "amb": "amb",
    "loss": "loss",
}


def _executor_choice(value: str) -> str:
    if value not in runtime.EXECUTOR_CHOICES:
        raise ValueError(value)
    return value


def _loss_choice(value: str) -> str:
    if value not in loss_placement.LOSSES:
        raise ValueError(value)
    return value


def _fraction(value: str) -> float:
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(value)
    return fraction


_PARSE = {
    "w": float,
    "ag": int,
    "rs": int,
    "fold": lambda v: {"0": False, "1": True}[v],
    "fr": lambda v: {"0": False, "1": True}[v],
    "chunk": lambda v: {"0": False, "1": True}[v],
    "ex": _executor_choice,
    "budget": parse_bytes,
    "amb": _fraction,
    "loss": _loss_choice,
}
_EXPECTED = {
    "fold": "0 or 1",
    "fr": "0 or 1",
    "chunk": "0 or 1",
    "ex": f"one of {', '.join(runtime.EXECUTOR_CHOICES)}",
    "amb": "a number from 0 to 1",
    "budget": "a size (60GB, 55.9GiB)",
    "loss": f"one of {', '.join(loss_placement.LOSSES)}",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """A mode with its own options: ``base``, the mode; ``memory``, ``MemoryConfig`` options of a +mem mode;
    ``executors``, a Thunder mode's executors (None: ``--executors``'); ``amb``: a torch.compile mode's
    ``activation_memory_budget`` (None: its default); ``loss``: where the step computes its loss
    (``loss_placement.LOSSES``)."""

    base: str
    memory: dict
    executors: str | None = None
    amb: float | None = None
    loss: str = "eager"


def split_variant(mode: str) -> Variant:
    """``thunder-fsdp+mem@w=0.1@ag=1@ex=fused`` -> ``Variant``: a mode with its own executors (``ex``), where its step
    computes the loss (``loss``: eager, trace, liger, cce), and for a +mem mode its own recompute weight (``w``),
    windows (``ag``: all-gathers, ``rs``: reduce-scatters), folded casts (``fold``: 0 or 1), fusion
    rematerialization (``fr``: 0 or 1), the chunked loss (``chunk``: 0 or 1) or memory budget (``budget``), so that
    one table can hold several."""
    base, *parts = mode.split("@")
    options = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in VARIANT_KEYS:
            raise UsageError(f"mode {mode!r}: unknown option {key!r}; known: {', '.join(VARIANT_KEYS)}")
        try:
            options[VARIANT_KEYS[key]] = _PARSE[key](value)
        except (KeyError, ValueError):
            raise UsageError(f"mode {mode!r}: {key} must be {_EXPECTED.get(key, 'a number')}, got {value!r}") from None
    executors = options.pop("executors", None)
    amb = options.pop("amb", None)
    loss = options.pop("loss", "eager")
    return Variant(base, options, executors, amb, loss)


def chosen_modes(modes: str, valid: tuple[str, ...]) -> list[str]:
    """The modes of ``--modes`` (``all``: every valid one), each a valid mode with options that mode takes."""
    if modes == "all":
        return list(valid)
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in chosen if split_variant(m).base not in valid]
    if unknown or not chosen:
        raise UsageError(f"unknown mode {', '.join(unknown) or repr(modes)}; valid modes: {', '.join(valid)}")
    for m in chosen:
        variant = split_variant(m)
        if variant.memory and not variant.base.endswith("+mem"):
            raise UsageError(
                f"mode {m!r}: only +mem modes take the transform's options "
                f"({', '.join(k for k in VARIANT_KEYS if k not in ('ex', 'amb', 'loss'))})"
            )
        if variant.executors is not None and variant.base not in mode_table.THUNDER_MODES:
            raise UsageError(f"mode {m!r}: only Thunder's modes take @ex")
        if variant.amb is not None and variant.base not in mode_table.INDUCTOR_MODES:
            raise UsageError(f"mode {m!r}: only torch.compile's modes take @amb")
        if variant.loss in loss_placement.OUTSIDE and variant.base in (
            "thunder-fsdp",
            "thunder-fsdp+mem",
            "fsdp1-inductor",
        ):
            raise UsageError(f"mode {m!r}: {variant.base} shards the head where an external loss cannot gather it")
        if variant.loss != "eager" and variant.base == "fsdp1-inductor":
            raise UsageError(f"mode {m!r}: fsdp1-inductor runs the eager loss only")
        try:
            MemoryConfig(**variant.memory)
        except (TypeError, ValueError) as e:
            raise UsageError(f"mode {m!r}: {e}") from None
    return chosen
