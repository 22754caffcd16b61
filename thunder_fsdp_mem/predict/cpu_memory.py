"""Live tensor bytes on CPU, read from the allocations torch's profiler records.

MemTracker is a ``TorchDispatchMode``, and Dynamo runs a compiled function eagerly while such a mode is active
(torch 2.11: "non-infra torch dispatch mode present, this is not supported today in torch.compile"): under it a
step of FSDP2 through ThunderFX or Inductor is not the compiled step. The profiler is no dispatch mode. With
``profile_memory=True`` it records every allocation and free of the CPU allocator with the running total since
the profile began; the bytes alive before it began are counted from what the caller holds.

Gloo, unlike NCCL, stages collectives in buffers of its own: an all-gather allocates two copies of its output, a
reduce-scatter clones its input. Allocations made inside a collective (the profiler's ``c10d::`` and ``gloo:``
events), and their frees, are left out: what is counted is what the program's tensors hold, as on NCCL.

The profiler records the allocations and frees of the thread that profiles (and of the threads autograd lends it),
not those of gloo's worker thread. A collective's work holds its tensors until that thread drops it, which now and
then comes after the program dropped its last reference: that free goes unrecorded. Each address therefore keeps
its occupant, and an allocation at an occupied address frees the occupant first. So a gloo buffer freed unseen
never takes a later tensor's free with it, and a program tensor freed unseen is freed late (at the reuse of its
address) or never (pythia-14m under FSDP2 or Thunder's fsdp on gloo: a gathered embedding, a reduce-scatter
input, in about 1 of 6 profiled steps per rank on one shared core). That only ever adds memory, so a measurement
takes the least peak of ``REPEATS`` steps; and inside the context each collective's wait is followed by a short
pause, so that the worker thread is done with the work before the program frees its tensors.

A matmul's workspace is left out too: an allocation made inside ``aten::mm``, ``addmm``, ``bmm`` or ``baddbmm``
and freed before the op returns. Where the CPU has bf16 instructions (avx512_bf16, AMX), a bf16 matmul runs on
oneDNN, which takes a scratchpad from torch's allocator at each call (tens to hundreds of KiB at pythia-14m's
sizes, set by the CPU model, not by the program) and may copy an operand to a layout of its own first; the
estimate counts what ops return, as on CUDA, where cuBLAS's workspace is no tensor either. (oneDNN stays on:
ATen's own bf16 matmul, without it, is two orders of magnitude slower on CPU; ``docs/accuracy.md``.)

``CPUMemory(held)`` is a context manager: inside it, ``mark(label)`` notes a point of the program; afterwards
``peak_bytes`` is the peak of the live bytes over the context, and ``marks()`` gives, per mark, the live bytes
there and the peak since the previous mark (or the start).
"""

from __future__ import annotations

import os
from time import sleep
from collections.abc import Iterable
from contextlib import contextmanager
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
        self._settling = _settled_waits()
        self._settling.__enter__()
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._profile.__exit__(*exc)
            self._events = _events(self._profile)
        finally:
            self._settling.__exit__(*exc)
            self._profile = self._settling = None

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


SETTLE_S = 0.002  # after a collective's wait, time for gloo's worker thread to drop its references


@contextmanager
def _settled_waits():
    """Each ``Work.wait()`` followed by a pause of ``SETTLE_S``: gloo's worker thread holds the collective's tensors
    until it has marked the work done and dropped it, and when it drops the last reference there the free is one
    the profiler does not see (a gathered embedding stayed counted to the end of a step, 12.9 MB, in one run of
    the suite in three). With the pause the worker is done first, and the program's own ``del`` frees them."""
    work = torch.distributed.distributed_c10d.Work
    wait = work.wait

    def settled(self, *args, **kwargs):
        out = wait(self, *args, **kwargs)
        sleep(SETTLE_S)
        return out

    work.wait = settled
    try:
        yield
    finally:
        work.wait = wait


def _events(profile) -> list[tuple[int, int, str | None]]:
    """The profile's CPU allocations (time, running total) and marks (time, 0, label), in time order."""
    raw = []  # [time, bytes allocated or freed, address, left out, mark label]
    owners = []  # per raw entry: the matmul it was made inside (its event's id), or None
    stack = [(event, False, None) for event in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, inside, owner = stack.pop()
        inside = inside or event.name.startswith(_COLLECTIVES)
        owner = id(event) if event.name in _WORKSPACE_OPS else owner
        stack.extend((child, inside, owner) for child in event.children)
        fields = event.typed[1]
        if hasattr(fields, "total_allocated"):
            if fields.device.type == "cpu":
                raw.append([event.start_time_ns, fields.alloc_size, fields.ptr, inside, None])
                owners.append(owner)
        elif event.name.startswith(_PREFIX):
            raw.append([event.start_time_ns, 0, 0, False, event.name[len(_PREFIX) :]])
            owners.append(None)
    order = sorted(range(len(raw)), key=lambda i: raw[i][0])
    made: dict[tuple[int, int], int] = {}  # (matmul, address) -> the allocation made there, not yet freed
    for i in order:
        if owners[i] is None:
            continue
        key = (owners[i], raw[i][2])
        if raw[i][1] > 0:
            made[key] = i
        elif key in made:  # freed inside the matmul that made it: its workspace
            raw[made.pop(key)][3] = raw[i][3] = True
    return running_totals([tuple(raw[i]) for i in order])


def running_totals(raw) -> list[tuple[int, int, str | None]]:
    """``raw``: (time, bytes allocated (> 0) or freed (< 0), address, left out (a collective's buffer or a
    matmul's workspace), mark label or None), in time order. Returns (time, bytes the program's tensors hold since
    the start, None) per allocation or free, and (time, 0, label) per mark. What is left out, and its free, is not
    counted; an
    allocation at an address still occupied frees the occupant first (its free went unrecorded, see the module's
    docstring). A free of an address allocated before the start is counted: it was a tensor of the baseline."""
    found, total = [], 0
    occupant: dict[int, int] = {}  # address -> bytes counted for the tensor there (0: left out)
    for time, size, address, inside, label in raw:
        if label is not None:
            found.append((time, 0, label))
            continue
        counted = occupant.pop(address, None)
        if size > 0:
            total -= counted or 0
            occupant[address] = 0 if inside else size
            total += occupant[address]
        elif counted != 0:
            total += size
        found.append((time, total, None))
    return found


_COLLECTIVES = ("c10d::", "gloo:")  # the profiler's names of torch.distributed's collectives and gloo's own
_WORKSPACE_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
