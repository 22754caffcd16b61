"""Peak memory of one training step (forward and backward) of a ``thunder.jit`` module or function.

Entry point: ``estimate_step(fn) -> StepMemory``, for a jitted callable that has run at least once, plain or
wrapped by ``thunder.distributed.fsdp``.

The step is composed from the two execution traces of the last run:
- before the step, the module's parameters and buffers (its shards, under FSDP) and the step's inputs are live;
- the forward trace runs (``liveness.analyze``), keeping what it returns: its output, which the caller holds
  until backward, and what it saves for backward;
- the backward trace runs on the saved tensors, which it frees as it goes (Thunder clears the list it passes),
  and on the cotangents of the outputs; the gradients it returns stay (``param.grad``).
Tensors alive but not arguments of a trace (parameters that backward does not read, the caller's output) are
added to that trace's timeline as a constant.

The quantity is live tensor bytes, as ``torch.distributed._tools.mem_tracker.MemTracker`` counts them on CPU and
``torch.cuda.max_memory_allocated`` on GPU (less allocator rounding). It ignores the optimizer step and any
memory the caller allocates outside the jitted function (a loss computed eagerly on the logits, say): jit the
loss with the model to account for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import thunder

from thunder_fsdp_mem.categories import Category
from thunder_fsdp_mem.liveness import Allocation, InputSpec, MemoryTimeline, analyze


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Memory of one forward and backward, per rank. All sizes in bytes.

    ``persistent_bytes``: parameters, buffers and inputs alive before the step.
    ``forward_peak_bytes`` / ``backward_peak_bytes``: the peak of each phase, everything alive counted.
    ``saved_bytes``: what the forward keeps for backward beyond its own inputs (parameters and inputs that are
    saved cost nothing extra).
    ``gradient_bytes``: the gradients alive after backward.
    ``live_at_peak``: allocations alive at the peak, the ones no trace mentions included; they add up to
    ``peak_bytes``.
    """

    peak_bytes: int
    peak_phase: str
    peak_index: int
    peak_symbol: str
    persistent_bytes: int
    forward_peak_bytes: int
    saved_bytes: int
    backward_peak_bytes: int
    gradient_bytes: int
    forward: MemoryTimeline
    backward: MemoryTimeline | None
    forward_outside_bytes: int
    backward_outside_bytes: int
    live_at_peak: tuple[Allocation, ...]


def estimate_step(fn) -> StepMemory:
    """Estimate the peak live tensor bytes of one forward and backward of ``fn``, a ``thunder.jit`` module or
    function that has run at least once (its last run's traces are used)."""
    forward_trace, backward_trace = _last_traces(fn)
    persistent = _persistent_tensors(fn, forward_trace)
    param_specs = {
        name: InputSpec(key, category, external=True, nbytes=nbytes)
        for name, (key, category, nbytes) in persistent.items()
        if name in _arg_names(forward_trace)
    }
    forward = analyze(forward_trace, inputs=param_specs)
    persistent_bytes = _unique_bytes(persistent.values())
    forward_seen = {a.name for a in forward.allocations if a.external}
    fwd_outside = _outside(persistent, exclude=forward_seen)
    fwd_outside_bytes = _unique_bytes(fwd_outside.values())

    saved_bytes = sum(
        forward.allocations[i].nbytes
        for i in {forward.outputs[n] for n in forward.outputs}
        if forward.allocations[i].category is not Category.OUTPUT and not forward.allocations[i].external
    )
    output_allocs = {i for i in forward.outputs.values() if forward.allocations[i].category is Category.OUTPUT}

    backward = None
    bwd_outside_bytes = 0
    bwd_peak = 0
    gradient_bytes = 0
    if backward_trace is not None:
        specs = {}
        for name, i in forward.outputs.items():
            a = forward.allocations[i]
            held = a.external or a.category is Category.OUTPUT
            specs[name] = InputSpec(("forward", i), a.category, external=held, nbytes=a.nbytes)
        backward = analyze(backward_trace, inputs=specs)
        in_backward = {n for n in _arg_names(backward_trace, nested=True) if n in specs}
        seen_allocs = {forward.outputs[n] for n in in_backward}
        outside_outputs = sum(forward.allocations[i].nbytes for i in output_allocs - seen_allocs)
        seen_persistent = {forward.allocations[i].name for i in seen_allocs if forward.allocations[i].external}
        bwd_outside_bytes = _unique_bytes(_outside(persistent, exclude=seen_persistent).values()) + outside_outputs
        bwd_peak = backward.peak_bytes + bwd_outside_bytes
        gradient_bytes = sum(
            a.nbytes for a in backward.allocations if a.category is Category.GRADIENT and a.end is None
        )

    fwd_peak = forward.peak_bytes + fwd_outside_bytes
    if backward is not None and bwd_peak > fwd_peak:
        phase, timeline, outside_bytes = "backward", backward, bwd_outside_bytes
        outside = _outside(persistent, exclude=seen_persistent)
    else:
        phase, timeline, outside_bytes = "forward", forward, fwd_outside_bytes
        outside = fwd_outside
    live = list(timeline.live_at_peak) + [
        Allocation(name, nbytes, category, (), "", "held outside the trace", None, -1, None, True)
        for name, (_, category, nbytes) in outside.items()
    ]
    if phase == "backward":
        live += [forward.allocations[i] for i in output_allocs - seen_allocs]
    live.sort(key=lambda a: -a.nbytes)
    return StepMemory(
        peak_bytes=max(fwd_peak, bwd_peak),
        peak_phase=phase,
        peak_index=timeline.peak_index,
        peak_symbol=timeline.peak_symbol,
        persistent_bytes=persistent_bytes,
        forward_peak_bytes=fwd_peak,
        saved_bytes=saved_bytes,
        backward_peak_bytes=bwd_peak,
        gradient_bytes=gradient_bytes,
        forward=forward,
        backward=backward,
        forward_outside_bytes=fwd_outside_bytes,
        backward_outside_bytes=bwd_outside_bytes,
        live_at_peak=tuple(live),
    )


def _last_traces(fn):
    if thunder.compile_stats(fn) is None:
        raise TypeError(
            f"estimate_step() expects a function or module compiled with thunder.jit; got {type(fn).__name__}"
        )
    try:
        forward = thunder.last_traces(fn)
    except TypeError as e:
        raise RuntimeError("estimate_step() needs the traces of a run: call the jitted function once first") from e
    if not forward:
        raise RuntimeError("estimate_step() needs the traces of a run: call the jitted function once first")
    backward = thunder.last_backward_traces(fn)
    return forward[-1], (backward[-1] if backward else None)


def _persistent_tensors(fn, trace) -> dict[str, tuple[object, Category, int]]:
    """Tensors alive before the step, by trace argument name: parameters and buffers (``t_`` + qualified name,
    as Thunder names them) and the remaining tensor arguments of the forward trace (the step's inputs)."""
    out: dict[str, tuple[object, Category, int]] = {}
    if isinstance(fn, torch.nn.Module):
        for qualname, t in [*fn.named_parameters(), *fn.named_buffers()]:
            name = "t_" + qualname.replace(".", "_")
            out[name] = (_storage_key(t), Category.PARAMETER, t.untyped_storage().nbytes())
    for a in trace.args:
        if hasattr(a, "shape") and hasattr(a, "dtype") and a.name not in out:
            category = Category.PARAMETER if a.name.startswith("t_") else Category.INPUT
            out[a.name] = (a.name, category, _proxy_bytes(a))
    return out


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    if t.device.type == "meta":
        return ("meta", id(t))
    return (t.device.type, storage.data_ptr())


def _proxy_bytes(p) -> int:
    n = 1
    for s in p.shape:
        n *= int(s)
    return n * p.dtype.bytes


def _arg_names(trace, nested: bool = False) -> set[str]:
    from thunder_fsdp_mem.ops import proxy_names

    names: set[str] = set()
    for a in trace.args:
        if nested and hasattr(a, "coll"):
            names.update(proxy_names(a.coll))
        elif nested and isinstance(a, (list, tuple)):
            for item in a:
                names.update(proxy_names(item.coll if hasattr(item, "coll") else item))
        elif hasattr(a, "name"):
            names.add(a.name)
    return names


def _outside(persistent, exclude: set[str]) -> dict[str, tuple[object, Category, int]]:
    excluded_keys = {persistent[n][0] for n in exclude if n in persistent}
    return {n: v for n, v in persistent.items() if n not in exclude and v[0] not in excluded_keys}


def _unique_bytes(values) -> int:
    seen: dict[object, int] = {}
    for key, _, nbytes in values:
        seen[key] = nbytes
    return sum(seen.values())
