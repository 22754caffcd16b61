"""Peak memory of one training step (forward and backward), the one estimator that judges every rewrite and every
prediction.

Entry points: ``estimate_step(fn) -> StepMemory``, for a ``thunder.jit`` module or function that has run at least
once, plain or wrapped by ``thunder.distributed.fsdp``; ``estimate_traces(forward, backward)``, the same from two
execution traces (what a transform sees).

A step is a sequence of phases (``phases.Phase``): a trace's timeline (``liveness.analyze``), or a step without a
trace (the caller's eager loss, a collective's buffers), each beside what is alive outside it. What is alive outside
the traces is kept in ``holdings.Holdings``: allocations by key, each alive while anyone holds it. ``estimate_step``
holds (``_compose``):
- before the step, the module's parameters and buffers (its shards, under FSDP) and the step's inputs;
- the forward trace runs, keeping what it returns: its output, which the caller holds until backward, and what
  it saves for backward;
- the backward trace runs on the saved tensors, which it frees as it goes (Thunder clears the list it passes),
  and on the cotangents of the outputs; the gradients it returns stay (``param.grad``).
``predict.fsdp2`` composes an FSDP2 step from the same pieces.

Two things the caller does are modelled on request (``eager_loss`` and ``optimizer`` model them):
``loss="cross_entropy"`` is an eager ``cross_entropy(output.reshape(-1, V), targets)`` on the forward's output between
forward and backward (what Thunder's and litgpt's benchmarks do): its ``log_softmax`` is kept for its backward, which
allocates the gradient of ``nll_loss`` and the gradient of the logits (the backward trace's cotangent) while both are
alive. ``optimizer=`` adds the optimizer's state, alive through the whole step (before its first step Adam and AdamW
have none yet, and the state they will create is counted instead), and, for Adam and AdamW, the optimizer's step
after the backward (``adam_step_bytes``): the parameters, their gradients, the state, the output the caller still
holds (``modes.Trainer.step`` holds the logits until it returns), and the step's own temporaries.

The quantity is live tensor bytes, as ``torch.distributed._tools.mem_tracker.MemTracker`` counts them on CPU and
``torch.cuda.max_memory_allocated`` on GPU (less allocator rounding).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch
import thunder

from thunder_fsdp_mem.analysis.timeline import Allocation, InputSpec, MemoryTimeline
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.holdings import Holder, Holdings, Key, Role, held_allocation, storage_key
from thunder_fsdp_mem.thunder_internals import original_module
from thunder_fsdp_mem.analysis.liveness import analyze
from thunder_fsdp_mem.analysis.eager_loss import check_loss, loss_allocations
from thunder_fsdp_mem.analysis.optimizer import optimizer_state, optimizer_step_allocation
from thunder_fsdp_mem.analysis.provenance import Scopes, backward_names, scopes_of
from thunder_fsdp_mem.analysis.phases import Stage, StepMemory, step_memory
from thunder_fsdp_mem.analysis.symbols import dtype_name, nbytes, proxy_names


DEVICE_TYPES = ("cuda", "cpu")


def estimate_step(
    fn, *, loss: str | None = None, optimizer: torch.optim.Optimizer | None = None, device_type: str | None = None
) -> StepMemory:
    """Estimate the peak live tensor bytes of one forward and backward of ``fn``, a ``thunder.jit`` module or
    function that has run at least once (its last run's traces are used).

    ``loss``: None when the loss is part of ``fn``; ``"cross_entropy"`` when the caller computes it eagerly on
    ``fn``'s output. ``optimizer``: whose state is alive through the step (None: no state). ``device_type``: the
    device the step would run on (``"cuda"``, ``"cpu"``), for traces made on the meta device; None: the traces'
    own."""
    check_loss(loss)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}")
    if device_type is not None and device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be None or one of {', '.join(DEVICE_TYPES)}; got {device_type!r}")
    forward_trace, backward_trace = _last_traces(fn)
    qualnames = dict(_qualnames(fn))
    return _compose(
        forward_trace,
        backward_trace,
        _persistent_tensors(fn, forward_trace),
        optimizer_state(optimizer, qualnames, device_type),
        loss,
        device_type=device_type,
        parameter_names={"t_" + q.replace(".", "_"): q for q in qualnames.values()},
        optimizer_step=optimizer_step_allocation(optimizer, device_type),
        scopes=scopes_of(original_module(fn)) if isinstance(fn, torch.nn.Module) else None,
    )


def estimate_traces(
    forward_trace,
    backward_trace=None,
    *,
    reuse: StepMemory | None = None,
    loss: str | None = None,
    held: tuple[Allocation, ...] = (),
    optimizer_step: Allocation | None = None,
) -> StepMemory:
    """The same estimate from a forward execution trace and its backward alone (what a transform sees): the
    tensors alive before the step are the forward's tensor arguments. ``loss``: as ``estimate_step``'s, the loss
    the caller computes on the forward's output (None: none); ``held``: allocations alive through the step besides
    the traces' (an optimizer's state, as ``anticipated_adamw`` makes it); ``optimizer_step``: what the optimizer's
    step adds at its peak (``anticipated_adamw_step``; None: no step counted). ``reuse``: an earlier estimate with this
    same forward trace, whose analysis of the forward is taken as it is (a pass that tries several backwards
    against one forward analyses it once)."""
    check_loss(loss)
    return _compose(
        forward_trace,
        backward_trace,
        _persistent_tensors(None, forward_trace),
        list(held),
        loss,
        forward=reuse.forward if reuse is not None else None,
        optimizer_step=optimizer_step,
    )


# --- the composition of the step -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Persistent:
    """A tensor alive before the step: its storage identity and its record."""

    key: object
    record: Allocation


class _Held(Enum):
    PERSISTENT = "persistent"
    OPTIMIZER_STATE = "optimizer state"
    RETURNED = "returned by the forward"
    GRADIENT = "gradient"


_MODEL, _CALLER, _SAVED = Holder(Role.MODEL), Holder(Role.CALLER), Holder(Role.SAVED)


def _compose(
    forward_trace,
    backward_trace,
    persistent: dict[str, _Persistent],
    state: list[Allocation],
    loss: str | None,
    forward: MemoryTimeline | None = None,
    device_type: str | None = None,
    parameter_names: dict[str, str] | None = None,
    optimizer_step: Allocation | None = None,
    scopes: Scopes | None = None,
) -> StepMemory:
    """The step's phases in order: the forward, the loss (with ``loss``), the backward (with a backward trace)
    and the optimizer's step (with ``optimizer_step``), each beside what is held outside it then."""
    forward_args = _arg_names(forward_trace)
    if forward is None:
        inputs = {
            name: InputSpec(held.key, held.record.category, external=True, nbytes=held.record.nbytes)
            for name, held in persistent.items()
            if name in forward_args
        }
        forward = analyze(
            forward_trace, inputs=inputs, device_type=device_type, parameter_names=parameter_names, scopes=scopes
        )
    holdings = Holdings()
    for held in _unique(persistent.values()):
        holdings.hold(Key(_Held.PERSISTENT, item=held.key), held.record, _MODEL)
    for i, a in enumerate(state):
        holdings.hold(Key(_Held.OPTIMIZER_STATE, item=i), a, Holder(Role.OPTIMIZER))
    holdings.phase(Stage.FORWARD, "forward", forward, inside=_persistent_keys(persistent, forward_args))
    saved_bytes = _hold_returned(holdings, forward)
    if loss is not None:
        _loss_phase(holdings, forward)
    backward = None
    gradient_bytes = 0
    if backward_trace is not None:
        named = scopes is not None or parameter_names is not None  # a report's estimate: every allocation named
        backward = analyze(
            backward_trace,
            inputs=_saved_specs(forward),
            device_type=device_type,
            parameter_names=parameter_names,
            **(backward_names(forward_trace, backward_trace, forward.origins, parameter_names) if named else {}),
        )
        gradient_bytes = _backward_phases(holdings, forward, backward, backward_trace, persistent, optimizer_step)
    return step_memory(
        holdings.phases,
        forward=forward,
        backward=backward,
        persistent_bytes=sum(held.record.nbytes for held in _unique(persistent.values())),
        saved_bytes=saved_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=sum(a.nbytes for a in state),
    )


def _hold_returned(holdings: Holdings, forward: MemoryTimeline) -> int:
    """What the forward returns stays: its output, which the caller holds, and what it saves for backward; the
    bytes saved (those of the trace's own storages that are not its output)."""
    saved_bytes = 0
    for i in sorted(set(forward.outputs.values())):
        a = forward.allocations[i]
        if a.external:
            continue
        output = a.category is Category.OUTPUT
        saved_bytes += 0 if output else a.nbytes
        holdings.hold(Key(_Held.RETURNED, item=i), a, _CALLER if output else _SAVED)
    return saved_bytes


def _loss_phase(holdings: Holdings, forward: MemoryTimeline) -> None:
    """The caller's eager loss on the forward's one output (``eager_loss.loss_allocations``)."""
    returned = sorted(set(forward.outputs.values()))
    outputs = [forward.allocations[i] for i in returned if forward.allocations[i].category is Category.OUTPUT]
    if len(outputs) != 1:
        raise ValueError(f"loss='cross_entropy' needs a forward with one output; this one has {len(outputs)}")
    extra = loss_allocations(outputs[0])
    holdings.phase(Stage.LOSS, "loss", extra=extra, symbol=extra[-1].symbol)  # the logits' gradient ends it


def _backward_phases(
    holdings: Holdings,
    forward: MemoryTimeline,
    backward: MemoryTimeline,
    backward_trace,
    persistent: dict[str, _Persistent],
    optimizer_step: Allocation | None,
) -> int:
    """The backward, whose timeline counts what the forward returned to it, then the optimizer's step (with
    ``optimizer_step``) beside the gradients; the bytes of the gradients alive after the backward."""
    received = {forward.outputs[n] for n in _arg_names(backward_trace) if n in forward.outputs}
    inside = [Key(_Held.RETURNED, item=i) for i in received]
    inside += _persistent_keys(persistent, (forward.allocations[i].name for i in received))
    holdings.phase(Stage.BACKWARD, "backward", backward, inside=inside)
    gradients = [
        (i, a) for i, a in enumerate(backward.allocations) if a.category is Category.GRADIENT and a.end is None
    ]
    if optimizer_step is not None:  # the backward freed what it was saved; the gradients stay for the step
        for key in holdings.held_by(Role.SAVED):
            holdings.release(key, _SAVED)
        for i, a in gradients:
            holdings.hold(Key(_Held.GRADIENT, item=i), a, _MODEL)
        holdings.phase(Stage.OPTIMIZER, Stage.OPTIMIZER.value, extra=(optimizer_step,), symbol=optimizer_step.symbol)
    return sum(a.nbytes for _, a in gradients)


def _persistent_keys(persistent: dict[str, _Persistent], names: Iterable[str]) -> list[Key]:
    """The keys of the persistent tensors among ``names``."""
    return [Key(_Held.PERSISTENT, item=persistent[n].key) for n in names if n in persistent]


def _saved_specs(forward: MemoryTimeline) -> dict[str, InputSpec]:
    """What the forward returns, as the backward receives it: the same storages, with their categories; those
    the caller holds (parameters, inputs, the forward's output) are never freed by the backward."""
    specs = {}
    for name, i in forward.outputs.items():
        a = forward.allocations[i]
        held = a.external or a.category is Category.OUTPUT
        specs[name] = InputSpec(("forward", i), a.category, external=held, nbytes=a.nbytes)
    return specs


# --- what a jitted function gives ----------------------------------------------------------------------------------


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


def _qualnames(fn) -> list[tuple[int, str]]:
    """(id of each parameter, its qualified name) of a module (nothing for a function)."""
    return [(id(p), q) for q, p in fn.named_parameters()] if isinstance(fn, torch.nn.Module) else []


def _persistent_tensors(fn, trace) -> dict[str, _Persistent]:
    """Tensors alive before the step, by trace argument name: parameters and buffers (``t_`` + qualified name,
    as Thunder names them) and the remaining tensor arguments of the forward trace (the step's inputs)."""
    out: dict[str, _Persistent] = {}
    if isinstance(fn, torch.nn.Module):
        for qualname, t in [*fn.named_parameters(), *fn.named_buffers()]:
            name = "t_" + qualname.replace(".", "_")
            record = held_allocation(
                qualname, t.untyped_storage().nbytes(), Category.PARAMETER, shape=t.shape, dtype=dtype_name(t)
            )
            out[name] = _Persistent(storage_key(t), record)
    for a in trace.args:
        if hasattr(a, "shape") and hasattr(a, "dtype") and a.name not in out:
            category = Category.PARAMETER if a.name.startswith("t_") else Category.INPUT
            out[a.name] = _Persistent(
                a.name, held_allocation(a.name, nbytes(a), category, shape=a.shape, dtype=dtype_name(a))
            )
    return out


def _arg_names(trace) -> set[str]:
    """Names of the tensors a trace receives, directly or inside its argument lists."""
    return set(proxy_names(trace.args))


def _unique(helds: Iterable[_Persistent]) -> list[_Persistent]:
    return list({held.key: held for held in helds}.values())
