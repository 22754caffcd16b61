"""Live tensor bytes on CPU, read from the allocations torch's profiler records.

MemTracker is a ``TorchDispatchMode``, and Dynamo runs a compiled function eagerly while such a mode is active
(torch 2.11: "non-infra torch dispatch mode present, this is not supported today in torch.compile"): under it a
step of FSDP2 through ThunderFX or Inductor is not the compiled step. The profiler is no dispatch mode. With
``profile_memory=True`` it records every allocation and free of the CPU allocator with the running total since
the profile began; the bytes alive before it began are counted from what the caller holds.

Gloo, unlike NCCL, stages collectives in buffers of its own: an all-gather allocates two copies of its output, a
reduce-scatter clones its input. Allocations made inside a collective (the profiler's ``c10d::`` and ``gloo:``
events), and their frees, are left out: what is counted is what the program's tensors hold, as on NCCL.

Under the profiler, now and then a collective's output buffer outlives its last reference, to the end of the step
(Thunder's fsdp on gloo, pythia-14m: one rank's gathered embedding in 3 of 8 profiled steps, never in 12 steps
under MemTracker). It only ever adds memory, so a measurement takes the least peak of ``REPEATS`` steps.

``CPUMemory(held)`` is a context manager: inside it, ``mark(label)`` notes a point of the program; afterwards
``peak_bytes`` is the peak of the live bytes over the context, and ``marks()`` gives, per mark, the live bytes
there and the peak since the previous mark (or the start).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_PREFIX = "thunder_fsdp_mem.mark:"
REPEATS = 3  # steps measured, the least peak kept (see above)


@dataclass(frozen=True, slots=True)
class Mark:
    label: str
    live_bytes: int
    peak_bytes: int


def held_bytes(*objects) -> int:
    """Bytes of the CPU storages of ``objects`` (modules: parameters, their gradients and buffers; optimizers:
    their state; tensors), each storage once; a DTensor counts its local shard's storage."""
    storages: dict[int, int] = {}
    for t in _tensors(objects):
        t = getattr(t, "_local_tensor", t)
        if t.device.type == "cpu":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _tensors(objects) -> Iterable[torch.Tensor]:
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            yield obj
        else:
            raise TypeError(f"held_bytes: expected modules, optimizers or tensors, got {type(obj).__name__}")


class CPUMemory:
    """Records the CPU allocations of a stretch of program (see the module's docstring). ``held``: the modules,
    optimizers and tensors alive when it starts."""

    def __init__(self, *held):
        self._held = held
        self._profile = None
        self._events: list[tuple[int, int, str | None]] = []  # (time, running total, mark label or None)
        self.baseline_bytes = 0

    def __enter__(self) -> CPUMemory:
        from torch.profiler import ProfilerActivity, profile

        # Kineto looks for GPUs and prints an error line on a machine without them; its errors are of no use here.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.baseline_bytes = held_bytes(*self._held)
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        self._events = _events(self._profile)
        self._profile = None

    @staticmethod
    def mark(label: str) -> None:
        with torch.profiler.record_function(_PREFIX + label):
            pass

    @property
    def peak_bytes(self) -> int:
        return self.baseline_bytes + max([0, *(total for _, total, label in self._events if label is None)])

    def marks(self) -> list[Mark]:
        out, total, peak = [], 0, 0
        for _, value, label in self._events:
            if label is None:
                total = value
                peak = max(peak, value)
            else:
                out.append(Mark(label, self.baseline_bytes + total, self.baseline_bytes + peak))
                peak = total
        return out


def _events(profile) -> list[tuple[int, int, str | None]]:
    """The profile's CPU allocations (time, running total) and marks (time, 0, label), in time order. Buffers
    gloo allocates inside a collective, and their frees, are left out (see ``CPUMemory``)."""
    raw = []  # (time, bytes allocated or freed, address, made inside a collective, mark label)
    stack = [(event, False) for event in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, inside = stack.pop()
        inside = inside or event.name.startswith(_COLLECTIVES)
        stack.extend((child, inside) for child in event.children)
        fields = event.typed[1]
        if hasattr(fields, "total_allocated"):
            if fields.device.type == "cpu":
                raw.append((event.start_time_ns, fields.alloc_size, fields.ptr, inside, None))
        elif event.name.startswith(_PREFIX):
            raw.append((event.start_time_ns, 0, 0, False, event.name[len(_PREFIX):]))
    raw.sort(key=lambda e: e[0])
    found, total, internal = [], 0, set()
    for time, size, address, inside, label in raw:
        if label is not None:
            found.append((time, 0, label))
            continue
        if size > 0 and inside:
            internal.add(address)
            continue
        if size < 0 and address in internal:
            internal.discard(address)
            continue
        total += size
        found.append((time, total, None))
    return found


_COLLECTIVES = ("c10d::", "gloo:")  # the profiler's names of torch.distributed's collectives and gloo's own
