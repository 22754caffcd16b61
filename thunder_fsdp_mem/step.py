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

Two things the caller does are modelled on request: ``loss="cross_entropy"`` is an eager
``cross_entropy(output.reshape(-1, V), targets)`` on the forward's output between forward and backward (what
Thunder's and litgpt's benchmarks do): its ``log_softmax`` is kept for its backward, which allocates the
gradient of ``nll_loss`` and the gradient of the logits (the backward trace's cotangent) while both are alive.
``optimizer=`` adds the optimizer's state, alive through the whole step; before its first step Adam and AdamW
have none yet, and the state they will create is counted instead. The optimizer step itself is not modelled.

The quantity is live tensor bytes, as ``torch.distributed._tools.mem_tracker.MemTracker`` counts them on CPU and
``torch.cuda.max_memory_allocated`` on GPU (less allocator rounding).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import thunder

from thunder_fsdp_mem.categories import Category
from thunder_fsdp_mem.liveness import Allocation, InputSpec, MemoryTimeline, analyze
from thunder_fsdp_mem.ops import dtype_name, proxy_names


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
    ``loss_peak_bytes``: the peak of the eager loss (with ``loss=``); ``optimizer_state_bytes``: with
    ``optimizer=``. ``phases``: the step in the order it runs (what a timeline plots).
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
    loss_peak_bytes: int = 0
    optimizer_state_bytes: int = 0
    phases: tuple[Phase, ...] = ()


LOSSES = ("cross_entropy",)


def estimate_step(fn, *, loss: str | None = None, optimizer: torch.optim.Optimizer | None = None,
                  device_type: str | None = None) -> StepMemory:
    """Estimate the peak live tensor bytes of one forward and backward of ``fn``, a ``thunder.jit`` module or
    function that has run at least once (its last run's traces are used).

    ``loss``: None when the loss is part of ``fn``; ``"cross_entropy"`` when the caller computes it eagerly on
    ``fn``'s output. ``optimizer``: whose state is alive through the step (None: no state). ``device_type``: the
    device the step would run on (``"cuda"``, ``"cpu"``), for traces made on the meta device; None: the traces'
    own."""
    if loss is not None and loss not in LOSSES:
        raise ValueError(f"loss must be None or one of {', '.join(LOSSES)}; got {loss!r}")
    forward_trace, backward_trace = _last_traces(fn)
    return _compose(forward_trace, backward_trace, _persistent_tensors(fn, forward_trace),
                    _optimizer_state(optimizer), loss, device_type=device_type)


def estimate_traces(forward_trace, backward_trace=None, *, reuse: StepMemory | None = None) -> StepMemory:
    """The same estimate from a forward execution trace and its backward alone (what a transform sees): the
    tensors alive before the step are the forward's tensor arguments; no loss outside the traces, no optimizer.
    ``reuse``: an earlier estimate with this same forward trace, whose analysis of the forward is taken as it is
    (a pass that tries several backwards against one forward analyses it once)."""
    return _compose(forward_trace, backward_trace, _persistent_tensors(None, forward_trace), [], None,
                    forward=reuse.forward if reuse is not None else None)


def _compose(forward_trace, backward_trace, persistent: dict, state: list[Allocation], loss: str | None,
             forward: MemoryTimeline | None = None, device_type: str | None = None) -> StepMemory:
    forward_args = _arg_names(forward_trace)
    if forward is None:
        forward = analyze(forward_trace, inputs={
            name: InputSpec(held.key, held.record.category, external=True, nbytes=held.record.nbytes)
            for name, held in persistent.items() if name in forward_args
        }, device_type=device_type)
    forward_outside = _outside(persistent, reached={persistent[n].key for n in forward_args if n in persistent})
    saved_bytes = sum(
        forward.allocations[i].nbytes
        for i in set(forward.outputs.values())
        if forward.allocations[i].category is not Category.OUTPUT and not forward.allocations[i].external
    )
    phases = [Phase("forward", forward, (*forward_outside, *state))]
    if loss is not None:
        phases.append(_loss_phase(forward, (*forward_outside, *state)))

    backward = None
    gradient_bytes = 0
    if backward_trace is not None:
        backward = analyze(backward_trace, inputs=_saved_specs(forward), device_type=device_type)
        received = {forward.outputs[n] for n in _arg_names(backward_trace) if n in forward.outputs}
        reached = {persistent[forward.allocations[i].name].key for i in received
                   if forward.allocations[i].name in persistent}
        held_outputs = [forward.allocations[i] for i in set(forward.outputs.values()) - received
                        if forward.allocations[i].category is Category.OUTPUT]
        phases.append(Phase("backward", backward, (*_outside(persistent, reached), *held_outputs, *state)))
        gradient_bytes = sum(
            a.nbytes for a in backward.allocations if a.category is Category.GRADIENT and a.end is None
        )

    by_name = {p.name: p for p in phases}
    peak = max(phases, key=lambda p: p.peak_bytes)
    return StepMemory(
        peak_bytes=peak.peak_bytes,
        peak_phase=peak.name,
        peak_index=peak.peak_index,
        peak_symbol=peak.peak_symbol,
        persistent_bytes=sum(held.record.nbytes for held in _unique(persistent.values())),
        forward_peak_bytes=by_name["forward"].peak_bytes,
        saved_bytes=saved_bytes,
        backward_peak_bytes=by_name["backward"].peak_bytes if "backward" in by_name else 0,
        gradient_bytes=gradient_bytes,
        forward=forward,
        backward=backward,
        forward_outside_bytes=by_name["forward"].outside_bytes,
        backward_outside_bytes=by_name["backward"].outside_bytes if "backward" in by_name else 0,
        live_at_peak=tuple(sorted(peak.live_at_peak, key=lambda a: -a.nbytes)),
        loss_peak_bytes=by_name["loss"].peak_bytes if "loss" in by_name else 0,
        optimizer_state_bytes=sum(a.nbytes for a in state),
        phases=tuple(phases),
    )


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of the step: a trace's timeline, or a step without a trace (the caller's loss, a collective's
    buffers), plus what is alive outside it. ``extra``: allocations of a phase without a trace, alive at its
    peak; ``symbol``: what such a phase runs."""

    name: str
    timeline: MemoryTimeline | None
    outside: tuple[Allocation, ...]
    extra: tuple[Allocation, ...] = ()
    symbol: str = ""

    @property
    def outside_bytes(self) -> int:
        return sum(a.nbytes for a in self.outside)

    @property
    def peak_bytes(self) -> int:
        inside = self.timeline.peak_bytes if self.timeline is not None else 0
        return inside + self.outside_bytes + sum(a.nbytes for a in self.extra)

    @property
    def peak_index(self) -> int:
        return self.timeline.peak_index if self.timeline is not None else -1

    @property
    def peak_symbol(self) -> str:
        return self.timeline.peak_symbol if self.timeline is not None else self.symbol

    @property
    def live_at_peak(self) -> tuple[Allocation, ...]:
        inside = self.timeline.live_at_peak if self.timeline is not None else ()
        return (*inside, *self.outside, *self.extra)

    def points(self) -> list[int]:
        """Live bytes while each bound symbol runs, what is outside included; one point without a trace."""
        if self.timeline is None:
            return [self.peak_bytes]
        base = self.outside_bytes + sum(a.nbytes for a in self.extra)
        return [b + base for b in self.timeline.op_peaks]


def _loss_phase(forward: MemoryTimeline, outside: tuple[Allocation, ...]) -> Phase:
    """Eager ``cross_entropy`` on the forward's output, at the end of its backward: everything the forward left
    alive, the ``log_softmax`` it saved, the ``nll_loss`` gradient and the logits' gradient (same size each)."""
    left = tuple(a for a in forward.allocations if a.end is None)
    outputs = [a for a in left if a.category is Category.OUTPUT]
    if len(outputs) != 1:
        raise ValueError(f"loss='cross_entropy' needs a forward with one output; this one has {len(outputs)}")
    logits = outputs[0]
    extra = loss_allocations(logits)
    return Phase("loss", None, (*left, *outside), extra, extra[-1].symbol)  # the logits' gradient ends it


def loss_allocations(logits: Allocation) -> tuple[Allocation, ...]:
    """What eager ``cross_entropy`` on ``logits`` holds at the end of its backward, beside the logits: the
    ``log_softmax`` it saved, the gradient of ``nll_loss`` and the logits' gradient, each the logits' size."""
    return tuple(
        Allocation(name, logits.nbytes, Category.TEMPORARY, logits.shape, logits.dtype, symbol, None, -1, None)
        for name, symbol in (("log_softmax of the logits", "log_softmax (eager loss)"),
                             ("gradient of nll_loss", "nll_loss_backward (eager loss)"),
                             ("gradient of the logits", "log_softmax_backward (eager loss)"))
    )


def _optimizer_state(optimizer) -> list[Allocation]:
    if optimizer is None:
        return []
    if not optimizer.state:
        return _anticipated_adam_state(optimizer)
    records: dict[object, Allocation] = {}
    for i, per_param in enumerate(optimizer.state.values()):
        for key, t in per_param.items():
            if isinstance(t, torch.Tensor):
                records[_storage_key(t)] = Allocation(
                    f"optimizer state {key} #{i}", t.untyped_storage().nbytes(), Category.OPTIMIZER_STATE,
                    tuple(t.shape), dtype_name(t), "held outside the trace", None, -1, None,
                    True)
    return list(records.values())


def _anticipated_adam_state(optimizer) -> list[Allocation]:
    """The state Adam and AdamW create in their first step: ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq``
    with amsgrad) shaped like each parameter that requires a gradient, and a float32 ``step``. Other optimizers
    without state yet: none, with a warning (their state is counted once it exists)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        warnings.warn(f"estimate_step: {type(optimizer).__name__} has no state yet and its state is not "
                      "anticipated; run one optimizer step first to count it", stacklevel=3)
        return []
    records = []
    params = [(group, p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for i, (group, param) in enumerate(params):
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
        for key in keys:
            records.append(Allocation(
                f"optimizer state {key} #{i}", param.numel() * param.element_size(), Category.OPTIMIZER_STATE,
                tuple(param.shape), dtype_name(param), "anticipated", None, -1, None, True))
        records.append(Allocation(f"optimizer state step #{i}", 4, Category.OPTIMIZER_STATE, (), "f32",
                                  "anticipated", None, -1, None, True))
    return records


def _saved_specs(forward: MemoryTimeline) -> dict[str, InputSpec]:
    """What the forward returns, as the backward receives it: the same storages, with their categories; those
    the caller holds (parameters, inputs, the forward's output) are never freed by the backward."""
    specs = {}
    for name, i in forward.outputs.items():
        a = forward.allocations[i]
        held = a.external or a.category is Category.OUTPUT
        specs[name] = InputSpec(("forward", i), a.category, external=held, nbytes=a.nbytes)
    return specs


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


@dataclass(frozen=True, slots=True)
class _Held:
    """A tensor alive before the step: its storage identity and its record."""

    key: object
    record: Allocation


def _persistent_tensors(fn, trace) -> dict[str, _Held]:
    """Tensors alive before the step, by trace argument name: parameters and buffers (``t_`` + qualified name,
    as Thunder names them) and the remaining tensor arguments of the forward trace (the step's inputs)."""
    out: dict[str, _Held] = {}
    if isinstance(fn, torch.nn.Module):
        for qualname, t in [*fn.named_parameters(), *fn.named_buffers()]:
            name = "t_" + qualname.replace(".", "_")
            record = _held_record(qualname, t.untyped_storage().nbytes(), Category.PARAMETER, tuple(t.shape),
                                  dtype_name(t))
            out[name] = _Held(_storage_key(t), record)
    for a in trace.args:
        if hasattr(a, "shape") and hasattr(a, "dtype") and a.name not in out:
            category = Category.PARAMETER if a.name.startswith("t_") else Category.INPUT
            out[a.name] = _Held(a.name, _held_record(a.name, _proxy_bytes(a), category, tuple(a.shape),
                                                      a.dtype.shortname()))
    return out


def _held_record(name: str, nbytes: int, category: Category, shape, dtype: str) -> Allocation:
    return Allocation(name, nbytes, category, shape, dtype, "held outside the trace", None, -1, None, True)


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


def _arg_names(trace) -> set[str]:
    """Names of the tensors a trace receives, directly or inside its argument lists."""
    return set(proxy_names(trace.args))


def _outside(persistent: dict[str, _Held], reached: set) -> list[Allocation]:
    """Records of the persistent storages a trace does not receive (each storage once)."""
    return [held.record for held in _unique(persistent.values()) if held.key not in reached]


def _unique(helds) -> list[_Held]:
    return list({held.key: held for held in helds}.values())
