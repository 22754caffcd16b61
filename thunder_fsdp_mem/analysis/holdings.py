"""What is alive outside the trace that runs: the ledger a step is composed with.

Entry points: ``Holdings`` (allocations by ``Key``, each alive while any ``Holder`` holds it, and the step's
phases in order, each with what was alive outside it then), ``held_allocation`` (an allocation held outside the
traces), ``storage_key`` (a torch tensor's storage identity, so that tensors on one storage are held once).

``step.estimate_step`` composes a traced step with it, ``predict.fsdp2`` an FSDP2 step; each names what it holds
with an enum of its own (``Key.kind``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from enum import Enum

import torch

from thunder_fsdp_mem.analysis.timeline import Allocation, MemoryTimeline
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.phases import Phase, Stage


class Role(Enum):
    """Who holds an allocation outside the traces."""

    MODEL = "model"  # parameters, buffers and their shards, the gradients the step keeps
    CALLER = "caller"  # the step's inputs, a module's output until its reader is done with it
    OPTIMIZER = "optimizer"
    AUTOGRAD = "autograd"  # a gradient on its way to the next backward, an unsharded gradient until reduced
    SAVED = "saved for backward"  # by the unit named in ``Holder.owner``
    COMMUNICATION = "communication"  # FSDP's gathered parameters and collective buffers


@dataclass(frozen=True, slots=True)
class Holder:
    role: Role
    owner: str = ""


@dataclass(frozen=True, slots=True)
class Key:
    """One allocation held outside the traces: what it is (``kind``, an enum of the composer's), whose it is
    (``owner``: a unit of the model, or ""), and which (``item``)."""

    kind: Enum
    owner: str = ""
    item: Hashable = None


class Holdings:
    """What is alive outside the phase that runs: allocations by key, each alive while anyone holds it, and the
    phases of the step in order, each with what is alive outside it then."""

    def __init__(self) -> None:
        self._live: dict[Key, Allocation] = {}
        self._holders: dict[Key, set[Holder]] = {}
        self.phases: list[Phase] = []

    def hold(self, key: Key, alloc: Allocation, holder: Holder) -> None:
        self._live.setdefault(key, alloc)
        self._holders.setdefault(key, set()).add(holder)

    def release(self, key: Key, holder: Holder) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.discard(holder)
        if not holders:
            del self._holders[key], self._live[key]

    def __getitem__(self, key: Key) -> Allocation:
        return self._live[key]

    def keys(self, kind: Enum, owner: str | None = None) -> list[Key]:
        """The live keys of ``kind`` (and ``owner``), in the order they were first held."""
        return [k for k in self._live if k.kind is kind and (owner is None or k.owner == owner)]

    def held_by(self, role: Role, owner: str | None = None) -> list[Key]:
        """The live keys that a holder of ``role`` (and ``owner``) holds, in the order they were first held."""
        return [
            k
            for k, holders in self._holders.items()
            if any(h.role is role and (owner is None or h.owner == owner) for h in holders)
        ]

    def bytes(self, *kinds: Enum) -> int:
        return sum(a.nbytes for k, a in self._live.items() if k.kind in kinds)

    def phase(
        self,
        stage: Stage,
        name: str,
        timeline: MemoryTimeline | None = None,
        *,
        inside: Iterable[Key] = (),
        extra: tuple[Allocation, ...] = (),
        symbol: str = "",
    ) -> Phase:
        """A phase whose timeline (or ``extra``) counts the allocations of keys ``inside``; the rest is outside."""
        skip = set(inside)
        outside = tuple(a for k, a in self._live.items() if k not in skip)
        counted = tuple(a for k, a in self._live.items() if k in skip)
        phase = Phase(
            stage=stage, name=name, timeline=timeline, outside=outside, extra=extra, symbol=symbol, inside=counted
        )
        self.phases.append(phase)
        return phase


def held_allocation(
    name: str, nbytes: int, category: Category, *, shape=(), dtype: str = "", symbol: str = "held outside the trace"
) -> Allocation:
    """An allocation held outside the traces (a parameter, optimizer state, a buffer of FSDP's)."""
    return Allocation(
        name=name, nbytes=nbytes, category=category, shape=tuple(shape), dtype=dtype, symbol=symbol, external=True
    )


def storage_key(t: torch.Tensor):
    """What tells ``t``'s storage apart from others: its device and address (on the meta device, which has no
    addresses, the tensor itself)."""
    storage = t.untyped_storage()
    if t.device.type == "meta":
        return ("meta", id(t))
    return (t.device.type, storage.data_ptr())
