"""The ``fully_shard`` units of a litgpt model and what FSDP2 holds around them: the vocabulary of the ledger that
``fsdp2.compose_step`` keeps, and FSDP2's own collectives.

``units(gpt, world_size) -> list[Unit]``: ``wte``, each Block, ``ln_f`` and ``lm_head`` in the order the forward
runs them, each with its parameters' shards on the rank with the most rows (the first dimension padded to a
multiple of the world size and divided by it).

``Collectives(ledger, zero3)``: FSDP2's all-gathers and reduce-scatters around each unit's compute, holding the
buffers its code in torch 2.11 holds, for as long as it holds them (``fsdp2``'s docstring says when each is freed):
``gather`` before a unit's forward, ``reshard`` after it under zero3, ``pre_backward`` (zero3: gather again,
prefetching the unit that runs next), ``post_backward`` (reshard, then the reduce-scatter into the gradient shard),
``forward_done`` and ``backward_done`` (the last buffers of each).

What the ledger (``holdings.Holdings``) holds is named by ``Held``; its holders are ``MODEL``, ``CALLER``, ``FSDP2`` and
``AUTOGRAD``; ``record``, ``tensor_record`` and ``renamed`` make its allocations. ``hold_persistent`` holds what
the step holds throughout: the shards, their AdamW moments, the model's buffers, the step's inputs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

import torch
from litgpt.model import Block

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.timeline import OUTSIDE, Allocation, MemoryTimeline
from thunder_fsdp_mem.analysis.holdings import Holder, Holdings, Key, Role, held_allocation
from thunder_fsdp_mem.analysis.optimizer import adam_state
from thunder_fsdp_mem.analysis.phases import Stage
from thunder_fsdp_mem.analysis.symbols import dtype_name


@dataclass(frozen=True, slots=True)
class Shard:
    """One parameter's shard on the rank with the most rows: its first dimension padded to a multiple of the
    world size and divided by it."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Unit:
    """One ``fully_shard`` unit: its name in the step's phases, its module's qualified name in the model
    (``path``), its parameters' shards by name, and the sizes FSDP2 gathers and scatters."""

    name: str
    path: str
    module: torch.nn.Module
    shards: dict[str, Shard] = field(hash=False)
    world_size: int

    @property
    def shard_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    @property
    def gathered_bytes(self) -> int:
        return self.shard_bytes * self.world_size

    @property
    def is_block(self) -> bool:
        return isinstance(self.module, Block)


def units(gpt, world_size: int, *, loss_in_step: bool = False) -> list[Unit]:
    """The units of a litgpt ``GPT`` wrapped as ``benchmarks/performance/compare.py`` wraps it, in the order its forward
    runs (``training.modes.shard_fsdp2``); ``loss_in_step``: under a ``LossModel`` root, whose unit holds the head (its
    hooks would otherwise break Dynamo's graph between the head and the loss), last."""
    t = gpt.transformer
    return [
        _unit("wte", "transformer.wte", t.wte, world_size),
        *[_unit(f"block {i}", f"transformer.h.{i}", b, world_size) for i, b in enumerate(t.h)],
        _unit("ln_f", "transformer.ln_f", t.ln_f, world_size),
        _unit("root" if loss_in_step else "lm_head", "lm_head", gpt.lm_head, world_size),
    ]


def _unit(name: str, path: str, module: torch.nn.Module, world_size: int) -> Unit:
    shards = {}
    for qualname, p in module.named_parameters():
        shape = tuple(p.shape) or (1,)
        rows = math.ceil(shape[0] / world_size)
        shards[qualname] = Shard((rows, *shape[1:]), dtype_name(p), rows * math.prod(shape[1:]) * p.element_size())
    return Unit(name, path, module, shards, world_size)


class Held(Enum):
    """What the ledger holds."""

    SHARD = "parameter shard"
    BUFFER = "buffer"
    INPUT = "input"
    ADAM = "AdamW moment"
    GATHERED = "gathered parameter"
    ALL_GATHER = "all-gather buffer"
    REDUCE_SCATTER = "reduce-scatter input"
    GRADIENT = "gradient shard"
    UNSHARDED_GRADIENT = "unsharded gradient"
    ACTIVATION = "a unit's output"
    SAVED = "saved for backward"
    INCOMING_GRADIENT = "the gradient of a unit's output"


MODEL, CALLER, FSDP2, AUTOGRAD = (
    Holder(Role.MODEL),
    Holder(Role.CALLER),
    Holder(Role.COMMUNICATION),
    Holder(Role.AUTOGRAD),
)


def record(name: str, nbytes: int, category: Category, shape=(), dtype: str = "", symbol: str = "FSDP2") -> Allocation:
    return held_allocation(name, nbytes, category, shape=shape, dtype=dtype, symbol=symbol)


def tensor_record(name: str, t: torch.Tensor, category: Category, symbol: str) -> Allocation:
    return record(name, t.numel() * t.element_size(), category, tuple(t.shape), dtype_name(t), symbol)


def renamed(a: Allocation, name: str, category: Category, path: str | None = None) -> Allocation:
    """A trace's allocation as the ledger holds it once its trace is done: outside the traces, never freed by one;
    its module placed in the model (``path``: the unit's, for the block graph's module names)."""
    return dataclasses.replace(placed(a, path), name=name, category=category, start=OUTSIDE, end=None, external=True)


def placed(a: Allocation, path: str | None) -> Allocation:
    """``a`` of the block graph with its module names placed under the unit at ``path`` (the graph's are the
    block's own: ``attn.qkv``, "" for the block)."""

    def under(module: str | None) -> str | None:
        if path is None or module is None:
            return module
        return f"{path}.{module}" if module else path

    return dataclasses.replace(a, module=under(a.module), after=under(a.after))


def unplaced(a: Allocation) -> Allocation:
    """``a`` known by its name alone (``output of transformer.h.3``), not by the op that made it."""
    return dataclasses.replace(a, module=None, after=None, op="", role=None)


def placed_timeline(timeline: MemoryTimeline, path: str | None) -> MemoryTimeline:
    """The block graph's timeline as the unit at ``path`` runs it: its allocations named in the model."""
    return dataclasses.replace(
        timeline,
        allocations=tuple(placed(a, path) for a in timeline.allocations),
        live_at_peak=tuple(placed(a, path) for a in timeline.live_at_peak),
    )


def hold_persistent(ledger: Holdings, model_units: list[Unit], gpt, inputs, device_type: str) -> None:
    """What the step holds throughout: each parameter's shard and its AdamW moments, the model's buffers, the
    token ids and targets (``inputs``)."""
    for unit in model_units:
        for pname, shard in unit.shards.items():
            ledger.hold(
                Key(Held.SHARD, unit.name, pname),
                record(f"{unit.path}.{pname} (shard)", shard.nbytes, Category.PARAMETER, shard.shape, shard.dtype),
                MODEL,
            )
            for j, state in enumerate(
                adam_state(
                    "AdamW", f"{unit.path}.{pname}", shard.nbytes, shard.shape, shard.dtype, device_type=device_type
                )
            ):
                ledger.hold(Key(Held.ADAM, unit.name, (pname, j)), state, Holder(Role.OPTIMIZER))
    for name, buf in gpt.named_buffers():
        ledger.hold(Key(Held.BUFFER, item=name), tensor_record(name, buf, Category.PARAMETER, "buffer"), MODEL)
    for name, t in zip(("token ids", "targets"), inputs):
        ledger.hold(Key(Held.INPUT, item=name), tensor_record(name, t, Category.INPUT, "input"), CALLER)


class Collectives:
    """FSDP2's all-gathers and reduce-scatters, and the buffers they hold in ``ledger`` (see the module's
    docstring); ``zero3``: the units are resharded after their forward and gathered again for their backward."""

    def __init__(self, ledger: Holdings, zero3: bool):
        self.ledger, self.zero3 = ledger, zero3
        self.prefetched: set[str] = set()
        self.flat: str | None = None  # the unit whose all-gather buffer the forward still holds
        self.scattering: str | None = None  # the unit whose reduce-scatter input is still held

    def gather(self, unit: Unit, *, forward: bool) -> None:
        """Unshard ``unit``: its all-gather buffer, then the copy-out into its unsharded parameters."""
        ledger = self.ledger
        if not unit.shards or ledger.keys(Held.GATHERED, unit.name):
            return
        if unit.name not in self.prefetched:
            ledger.hold(Key(Held.ALL_GATHER, unit.name), _all_gather_buffer(unit), FSDP2)
        self.prefetched.discard(unit.name)
        for pname, shard in unit.shards.items():
            ledger.hold(
                Key(Held.GATHERED, unit.name, pname),
                record(
                    f"{unit.path}.{pname} (gathered)",
                    shard.nbytes * unit.world_size,
                    Category.GATHERED_PARAMETER,
                    (shard.shape[0] * unit.world_size, *shard.shape[1:]),
                    shard.dtype,
                    "FSDP2 all-gather",
                ),
                FSDP2,
            )
        stage = Stage.FORWARD if forward else Stage.BACKWARD
        ledger.phase(stage, f"{stage.value}: copy-out of {unit.name}", symbol="FSDP2 copy-out")
        if forward:
            if self.flat is not None:  # the previous unit's buffer, freed once this copy-out is done
                ledger.release(Key(Held.ALL_GATHER, self.flat), FSDP2)
            self.flat = unit.name
        else:
            ledger.release(Key(Held.ALL_GATHER, unit.name), FSDP2)

    def reshard(self, unit: Unit) -> None:
        for key in self.ledger.keys(Held.GATHERED, unit.name):
            self.ledger.release(key, FSDP2)

    def forward_done(self) -> None:
        """The root's post-forward frees the last all-gather buffer."""
        if self.flat is not None:
            self.ledger.release(Key(Held.ALL_GATHER, self.flat), FSDP2)
            self.flat = None

    def pre_backward(self, unit: Unit, following: Unit | None) -> None:
        if not self.zero3:
            return
        self.gather(unit, forward=False)
        if following is not None and following.shards:
            self.ledger.hold(Key(Held.ALL_GATHER, following.name), _all_gather_buffer(following), FSDP2)
            self.prefetched.add(following.name)

    def post_backward(self, unit: Unit) -> None:
        """Reshard ``unit``; its unsharded gradients copied into the reduce-scatter input, the gradient shard
        allocated and kept, then the unsharded gradients freed."""
        ledger = self.ledger
        self.reshard(unit)
        if not unit.shards:
            return
        if self.scattering is not None:
            ledger.release(Key(Held.REDUCE_SCATTER, self.scattering), FSDP2)
        ledger.hold(
            Key(Held.REDUCE_SCATTER, unit.name),
            record(
                f"reduce-scatter input of {unit.name}",
                unit.gathered_bytes,
                Category.COMM_BUFFER,
                symbol="FSDP2 reduce-scatter",
            ),
            FSDP2,
        )
        self.scattering = unit.name
        ledger.hold(
            Key(Held.GRADIENT, unit.name),
            record(
                f"gradients of {unit.name} (shard)", unit.shard_bytes, Category.GRADIENT, symbol="FSDP2 reduce-scatter"
            ),
            MODEL,
        )
        ledger.phase(Stage.BACKWARD, f"backward: reduce-scatter of {unit.name}", symbol="FSDP2 reduce-scatter")
        for key in ledger.keys(Held.UNSHARDED_GRADIENT, unit.name):
            ledger.release(key, AUTOGRAD)

    def backward_done(self) -> None:
        """The last reduce-scatter input is freed at the end of the backward."""
        if self.scattering is not None:
            self.ledger.release(Key(Held.REDUCE_SCATTER, self.scattering), FSDP2)


def _all_gather_buffer(unit: Unit) -> Allocation:
    return record(
        f"all-gather buffer of {unit.name}", unit.gathered_bytes, Category.COMM_BUFFER, symbol="FSDP2 all-gather"
    )
