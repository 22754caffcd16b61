"""Peak memory of one training step (forward and backward), the one estimator that judges every rewrite and every
prediction.

Entry points: ``estimate_step(fn) -> StepMemory``, for a ``thunder.jit`` module or function that has run at least
once, plain or wrapped by ``thunder.distributed.fsdp``; ``estimate_traces(forward, backward)``, the same from two
execution traces (what a transform sees).

A step is a sequence of phases (``Phase``): a trace's timeline (``liveness.analyze``), or a step without a trace
(the caller's eager loss, a collective's buffers), each beside what is alive outside it. What is alive outside the
traces is kept in ``Holdings``: allocations by key, each alive while anyone holds it. ``estimate_step`` holds:
- before the step, the module's parameters and buffers (its shards, under FSDP) and the step's inputs;
- the forward trace runs, keeping what it returns: its output, which the caller holds until backward, and what
  it saves for backward;
- the backward trace runs on the saved tensors, which it frees as it goes (Thunder clears the list it passes),
  and on the cotangents of the outputs; the gradients it returns stay (``param.grad``).
``predict.fsdp2`` composes an FSDP2 step from the same pieces.

Two things the caller does are modelled on request: ``loss="cross_entropy"`` is an eager
``cross_entropy(output.reshape(-1, V), targets)`` on the forward's output between forward and backward (what
Thunder's and litgpt's benchmarks do): its ``log_softmax`` is kept for its backward, which allocates the
gradient of ``nll_loss`` and the gradient of the logits (the backward trace's cotangent) while both are alive.
``optimizer=`` adds the optimizer's state, alive through the whole step (before its first step Adam and AdamW
have none yet, and the state they will create is counted instead), and, for Adam and AdamW, the optimizer's step
after the backward (``adam_step_bytes``): the parameters, their gradients, the state, the output the caller still
holds (``modes.Trainer.step`` holds the logits until it returns), and the step's own temporaries.

The quantity is live tensor bytes, as ``torch.distributed._tools.mem_tracker.MemTracker`` counts them on CPU and
``torch.cuda.max_memory_allocated`` on GPU (less allocator rounding).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import thunder

from thunder_fsdp_mem.analysis import device
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.liveness import Allocation, InputSpec, MemoryTimeline, analyze
from thunder_fsdp_mem.analysis.symbols import dtype_name, nbytes, parameter_path, proxy_names


class Stage(str, Enum):
    """The part of a step a phase belongs to."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer step"


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of the step: a trace's timeline, or a step without a trace (the caller's loss, a collective's
    buffers), plus what is alive outside it. ``name``: what a report calls it (``forward``, ``backward: block 3``);
    ``extra``: allocations of a phase without a trace, alive at its peak; ``symbol``: what such a phase runs;
    ``inside``: the allocations held before the phase that its timeline counts (among its inputs)."""

    stage: Stage
    name: str
    timeline: MemoryTimeline | None
    outside: tuple[Allocation, ...]
    extra: tuple[Allocation, ...] = ()
    symbol: str = ""
    inside: tuple[Allocation, ...] = ()

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

    def category_points(self) -> dict[Category, list[int]]:
        """``points`` split by category (an op's workspace is temporary)."""
        live: dict[Category, int] = {}
        for a in (
            *self.outside,
            *self.extra,
            *(() if self.timeline is None else (a for a in self.timeline.allocations if a.symbol == "input")),
        ):
            live[a.category] = live.get(a.category, 0) + a.nbytes
        if self.timeline is None:
            return {c: [b] for c, b in live.items()}
        allocations = self.timeline.allocations
        out: dict[Category, list[int]] = {}

        def add(indices, sign: int) -> None:
            for j in indices:
                live[allocations[j].category] = live.get(allocations[j].category, 0) + sign * allocations[j].nbytes

        for i, op in enumerate(self.timeline.ops()):
            if op.freed_first:
                add(op.freed, -1)
            add(op.made, 1)
            for c in {*live, Category.TEMPORARY}:
                out.setdefault(c, [0] * i).append(live.get(c, 0) + (op.workspace if c is Category.TEMPORARY else 0))
            if not op.freed_first:
                add(op.freed, -1)
        return out


@dataclass(frozen=True, slots=True)
class Timeline:
    """Live bytes over the step, one point per bound symbol of each traced phase (the memory inside each op) and one
    per phase without a trace; ``starts[k]`` is the index of phase k's first point; ``categories``: the points
    split by category (each series as long as ``points``, adding up to them)."""

    points: tuple[int, ...]
    starts: tuple[int, ...]
    categories: tuple[tuple[Category, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Memory of one training step (forward, loss, backward, optimizer step), per rank. All sizes in bytes.

    ``persistent_bytes``: parameters, buffers and inputs alive before the step.
    ``forward_peak_bytes`` / ``backward_peak_bytes`` / ``loss_peak_bytes`` / ``optimizer_peak_bytes``: the peak of
    each stage, everything alive counted (the loss's with ``loss=``, the optimizer step's with an Adam ``optimizer``).
    ``training_peak_bytes``: the peak of the forward and the backward, the loss included: what the traces hold.
    ``saved_bytes``: what the forward keeps for backward beyond its own inputs (parameters and inputs that are
    saved cost nothing extra).
    ``gradient_bytes``: the gradients alive after backward; ``optimizer_state_bytes``: with ``optimizer=``.
    ``peak_stage`` / ``peak_phase``: the stage and the name of the phase that holds the peak; ``peak_index``: the
    bound symbol there (-1 in a phase without a trace).
    ``live_at_peak``: allocations alive at the peak, the ones no trace mentions included; they add up to
    ``peak_bytes``.
    ``forward`` / ``backward``: the timelines of the traces. ``phases``: the step in the order it runs.
    """

    peak_bytes: int
    peak_stage: Stage
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
    live_at_peak: tuple[Allocation, ...]
    loss_peak_bytes: int = 0
    optimizer_state_bytes: int = 0
    phases: tuple[Phase, ...] = ()
    optimizer_peak_bytes: int = 0

    @property
    def training_peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases if p.stage is not Stage.OPTIMIZER), default=0)

    def timeline(self) -> Timeline:
        points: list[int] = []
        starts = []
        categories: dict[Category, list[int]] = {}
        for phase in self.phases:
            starts.append(len(points))
            n = len(points)
            points += phase.points()
            for c, series in phase.category_points().items():
                categories.setdefault(c, [0] * n).extend(series)
            for series in categories.values():
                series.extend([0] * (len(points) - len(series)))
        order = sorted(categories, key=list(Category).index)
        return Timeline(tuple(points), tuple(starts), tuple((c, tuple(categories[c])) for c in order))


def step_memory(
    phases: Iterable[Phase],
    *,
    forward: MemoryTimeline,
    backward: MemoryTimeline | None,
    persistent_bytes: int,
    saved_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
) -> StepMemory:
    """The ``StepMemory`` of a step that runs ``phases`` in order; the peak is the first phase's of the highest."""
    phases = tuple(phases)
    peak = max(phases, key=lambda p: p.peak_bytes)

    def stage_peak(stage: Stage) -> int:
        return max((p.peak_bytes for p in phases if p.stage is stage), default=0)

    return StepMemory(
        peak_bytes=peak.peak_bytes,
        peak_stage=peak.stage,
        peak_phase=peak.name,
        peak_index=peak.peak_index,
        peak_symbol=peak.peak_symbol,
        persistent_bytes=persistent_bytes,
        forward_peak_bytes=stage_peak(Stage.FORWARD),
        saved_bytes=saved_bytes,
        backward_peak_bytes=stage_peak(Stage.BACKWARD),
        gradient_bytes=gradient_bytes,
        forward=forward,
        backward=backward,
        live_at_peak=tuple(sorted(peak.live_at_peak, key=lambda a: -a.nbytes)),
        loss_peak_bytes=stage_peak(Stage.LOSS),
        optimizer_state_bytes=optimizer_state_bytes,
        phases=phases,
        optimizer_peak_bytes=stage_peak(Stage.OPTIMIZER),
    )


# --- the optimizer's step ------------------------------------------------------------------------------------

ADAM_KINDS = ("foreach", "single tensor", "fused")


def adam_kind(optimizer: torch.optim.Optimizer, device_type: str) -> str:
    """How torch runs ``optimizer.step()`` of Adam or AdamW on ``device_type``: ``fused`` when asked; else
    ``foreach`` (one kernel over every tensor of a device and dtype) where torch defaults to it, on CUDA, unless
    ``foreach=False``; else ``single tensor`` (a loop over the parameters; torch's default on CPU)."""
    if optimizer.defaults.get("fused"):
        return "fused"
    foreach = optimizer.defaults.get("foreach")
    return "foreach" if foreach or (foreach is None and device_type == "cuda") else "single tensor"


def adam_step_bytes(sizes: list[tuple[int, str]], kind: str) -> int:
    """The most bytes Adam's and AdamW's step (torch 2.11, ``torch/optim/adam.py``) holds beyond the parameters,
    gradients and state, for parameters of ``sizes`` (bytes, dtype) in the optimizer's order:

    - ``single tensor``: ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: the square root and
      the quotient of one parameter at once, while the previous parameter's ``denom`` is still bound;
    - ``foreach``: ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`` for every parameter of a dtype at once,
      while the previous dtype's list is still bound;
    - ``fused``: one kernel in place, nothing.
    """
    if kind not in ADAM_KINDS:
        raise ValueError(f"kind must be one of {', '.join(ADAM_KINDS)}; got {kind!r}")
    if kind == "fused" or not sizes:
        return 0
    if kind == "single tensor":
        previous, most = 0, 0
        for size, _ in sizes:
            most = max(most, previous + 2 * size)
            previous = size
        return most
    groups: dict[str, int] = {}
    for size, dtype in sizes:
        groups[dtype] = groups.get(dtype, 0) + size
    totals = list(groups.values())
    return max(a + b for a, b in zip([0, *totals], totals))


def adam_step_allocation(optimizer: str, sizes: list[tuple[int, str]], kind: str) -> Allocation:
    """The temporaries of ``optimizer``'s step over parameters of ``sizes`` at its peak (``adam_step_bytes``), as
    one allocation a report names, in the dtype of most of the parameters."""
    by_dtype: dict[str, int] = {}
    for size, dtype in sizes:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    dtype = max(by_dtype, key=by_dtype.__getitem__, default="")
    return Allocation(
        name=f"{optimizer} step temporaries ({kind})",
        nbytes=adam_step_bytes(sizes, kind),
        category=Category.TEMPORARY,
        dtype=dtype,
        symbol=f"{optimizer}.step ({kind})",
    )


# --- what is alive outside the traces --------------------------------------------------------------------------


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
        phase = Phase(stage, name, timeline, outside, extra, symbol, counted)
        self.phases.append(phase)
        return phase


# --- a jitted function's step ------------------------------------------------------------------------------------


class _Held(Enum):
    PERSISTENT = "persistent"
    OPTIMIZER_STATE = "optimizer state"
    RETURNED = "returned by the forward"
    GRADIENT = "gradient"


LOSSES = ("cross_entropy",)
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
    if loss is not None and loss not in LOSSES:
        raise ValueError(f"loss must be None or one of {', '.join(LOSSES)}; got {loss!r}")
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
        _optimizer_state(optimizer, qualnames, device_type),
        loss,
        device_type=device_type,
        parameter_names={"t_" + q.replace(".", "_"): q for q in qualnames.values()},
        optimizer_step=_optimizer_step(optimizer, device_type),
    )


def _optimizer_step(optimizer, device_type: str | None) -> Allocation | None:
    """What Adam's or AdamW's step adds at its peak (``adam_step_bytes``); None for no optimizer or another."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return None
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    on = device_type or (params[0].device.type if params else "cpu")
    kind = adam_kind(optimizer, on)
    sizes = [(p.numel() * p.element_size(), dtype_name(p)) for p in params]
    return adam_step_allocation(type(optimizer).__name__, sizes, kind)


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
    if loss is not None and loss not in LOSSES:
        raise ValueError(f"loss must be None or one of {', '.join(LOSSES)}; got {loss!r}")
    return _compose(
        forward_trace,
        backward_trace,
        _persistent_tensors(None, forward_trace),
        list(held),
        loss,
        forward=reuse.forward if reuse is not None else None,
        optimizer_step=optimizer_step,
    )


def anticipated_adamw(forward_trace, backward_trace) -> tuple[Allocation, ...]:
    """The state AdamW will hold for the parameters a forward/backward pair trains (``_trained``), as
    ``estimate_step`` anticipates an optimizer's state (``adam_state``): two moments the size of each parameter (the
    shard, under FSDP) and, on CPU, its step count."""
    trained = _trained(forward_trace, backward_trace)
    on = device.device_type(trained[0]) if trained else "cpu"
    return tuple(
        a
        for arg in trained
        for a in adam_state(
            "AdamW",
            parameter_path(arg.name) or arg.name,
            nbytes(arg),
            tuple(arg.shape),
            dtype_name(arg),
            device_type=on,
        )
    )


def adam_state(
    optimizer: str,
    parameter: str,
    nbytes_: int,
    shape: tuple,
    dtype: str,
    *,
    device_type: str,
    amsgrad: bool = False,
    step_on_device: bool = False,
) -> list[Allocation]:
    """The state Adam and AdamW (torch 2.11) create for one parameter in their first step, as the device of
    ``device_type`` holds it: ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) shaped like the
    parameter, and a float32 ``step`` count, which lives on the host unless the optimizer is fused or capturable
    (``step_on_device``): counted on CPU, or where it is on the device."""
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    state = [
        held_allocation(
            optimizer_state_name(optimizer, key, parameter),
            nbytes_,
            Category.OPTIMIZER_STATE,
            shape=shape,
            dtype=dtype,
            symbol="anticipated",
        )
        for key in keys
    ]
    if step_on_device or device_type == "cpu":
        state.append(
            held_allocation(
                optimizer_state_name(optimizer, "step", parameter),
                4,
                Category.OPTIMIZER_STATE,
                dtype="f32",
                symbol="anticipated",
            )
        )
    return state


def anticipated_adamw_step(forward_trace, backward_trace, order: Sequence[str] = ()) -> Allocation | None:
    """What AdamW's step will add at its peak over the parameters the pair trains (``adam_step_allocation``, the
    function ``estimate_step`` counts an optimizer's step with), run as torch runs it by default on the pair's
    device (``analysis.device``): ``foreach`` on CUDA, else ``single tensor``, whose temporaries depend on the order
    it steps the parameters in. ``order``: the trace names of the model's parameters in the optimizer's order
    (``parameter_order``); the pair's parameters are stepped in it, those it does not name after them in the pair's
    order. None where the pair trains nothing."""
    trained = _trained(forward_trace, backward_trace)
    if not trained:
        return None
    rank = {name: i for i, name in enumerate(order)}
    trained.sort(key=lambda a: rank.get(a.name, len(rank)))  # stable: the rest keep the pair's order
    kind = "foreach" if device.device_type(trained[0]) == "cuda" else "single tensor"
    return adam_step_allocation("AdamW", [(nbytes(a), dtype_name(a)) for a in trained], kind)


def parameter_order(module) -> tuple[str, ...]:
    """The names ``thunder.jit`` gives ``module``'s parameters in its traces (``t_`` + qualified name, ``_`` for
    ``.``), in the order of ``module.parameters()``: the order an optimizer built on them steps them in. Nothing for
    what is not an ``nn.Module``."""
    if not isinstance(module, torch.nn.Module):
        return ()
    return tuple("t_" + q.replace(".", "_") for q, _ in module.named_parameters())


def _trained(forward_trace, backward_trace) -> list:
    """The parameters a pair trains: the forward's inputs the backward returns a gradient for, told by Thunder's
    names for them: ``t_`` + qualified name (``thunder.jit``, Thunder's fsdp), or a ``_parameters_`` path (a
    ThunderFX graph)."""
    inputs = _flat_args(forward_trace)
    gradients = backward_trace.bound_symbols[-1].args[0] if backward_trace is not None else ()
    pairs = zip(inputs, gradients if isinstance(gradients, tuple | list) else ())
    return [arg for arg, grad in pairs if grad is not None and hasattr(arg, "dtype") and _is_parameter(arg)]


def _is_parameter(arg) -> bool:
    name = getattr(arg, "name", "")
    return name.startswith("t_") or "_parameters_" in name


def _flat_args(forward_trace) -> list:
    """The forward's inputs in the order its backward returns their gradients (its return's ``flat_args``)."""
    ret = forward_trace.bound_symbols[-1]
    value = ret.args[0] if len(ret.args) == 2 else None
    if isinstance(value, dict) and "flat_args" in value:
        return list(value["flat_args"])
    return []


def _compose(
    forward_trace,
    backward_trace,
    persistent: dict,
    state: list[Allocation],
    loss: str | None,
    forward: MemoryTimeline | None = None,
    device_type: str | None = None,
    parameter_names: dict[str, str] | None = None,
    optimizer_step: Allocation | None = None,
) -> StepMemory:
    forward_args = _arg_names(forward_trace)
    if forward is None:
        forward = analyze(
            forward_trace,
            inputs={
                name: InputSpec(held.key, held.record.category, external=True, nbytes=held.record.nbytes)
                for name, held in persistent.items()
                if name in forward_args
            },
            device_type=device_type,
            parameter_names=parameter_names,
        )
    holdings = Holdings()
    model, caller = Holder(Role.MODEL), Holder(Role.CALLER)
    for held in _unique(persistent.values()):
        holdings.hold(Key(_Held.PERSISTENT, item=held.key), held.record, model)
    for i, a in enumerate(state):
        holdings.hold(Key(_Held.OPTIMIZER_STATE, item=i), a, Holder(Role.OPTIMIZER))

    def persistent_key(name: str) -> Key:
        return Key(_Held.PERSISTENT, item=persistent[name].key)

    holdings.phase(
        Stage.FORWARD, "forward", forward, inside=[persistent_key(n) for n in forward_args if n in persistent]
    )
    returned = sorted(set(forward.outputs.values()))
    saved_bytes = 0
    for i in returned:
        a = forward.allocations[i]
        if a.external:
            continue
        output = a.category is Category.OUTPUT
        saved_bytes += 0 if output else a.nbytes
        holdings.hold(Key(_Held.RETURNED, item=i), a, caller if output else Holder(Role.SAVED))
    if loss is not None:
        outputs = [forward.allocations[i] for i in returned if forward.allocations[i].category is Category.OUTPUT]
        if len(outputs) != 1:
            raise ValueError(f"loss='cross_entropy' needs a forward with one output; this one has {len(outputs)}")
        extra = loss_allocations(outputs[0])
        holdings.phase(Stage.LOSS, "loss", extra=extra, symbol=extra[-1].symbol)  # the logits' gradient ends it

    backward = None
    gradient_bytes = 0
    if backward_trace is not None:
        backward = analyze(
            backward_trace, inputs=_saved_specs(forward), device_type=device_type, parameter_names=parameter_names
        )
        received = {forward.outputs[n] for n in _arg_names(backward_trace) if n in forward.outputs}
        inside = [Key(_Held.RETURNED, item=i) for i in received]
        inside += [
            persistent_key(forward.allocations[i].name) for i in received if forward.allocations[i].name in persistent
        ]
        holdings.phase(Stage.BACKWARD, "backward", backward, inside=inside)
        gradients = [
            (i, a) for i, a in enumerate(backward.allocations) if a.category is Category.GRADIENT and a.end is None
        ]
        gradient_bytes = sum(a.nbytes for _, a in gradients)
        if optimizer_step is not None:  # the backward freed what it was saved; the gradients stay for the step
            for key in holdings.held_by(Role.SAVED):
                holdings.release(key, Holder(Role.SAVED))
            for i, a in gradients:
                holdings.hold(Key(_Held.GRADIENT, item=i), a, model)
            holdings.phase(
                Stage.OPTIMIZER, Stage.OPTIMIZER.value, extra=(optimizer_step,), symbol=optimizer_step.symbol
            )
    return step_memory(
        holdings.phases,
        forward=forward,
        backward=backward,
        persistent_bytes=sum(held.record.nbytes for held in _unique(persistent.values())),
        saved_bytes=saved_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=sum(a.nbytes for a in state),
    )


def loss_allocations(logits: Allocation) -> tuple[Allocation, ...]:
    """What eager ``cross_entropy`` on ``logits`` holds at the end of its backward, beside the logits: the
    ``log_softmax`` it saved, the gradient of ``nll_loss`` and the logits' gradient, each the logits' size."""
    return tuple(
        Allocation(
            name=name,
            nbytes=logits.nbytes,
            category=Category.TEMPORARY,
            shape=logits.shape,
            dtype=logits.dtype,
            symbol=symbol,
        )
        for name, symbol in (
            ("log_softmax of the logits", "log_softmax (eager loss)"),
            ("gradient of nll_loss", "nll_loss_backward (eager loss)"),
            ("gradient of the logits", "log_softmax_backward (eager loss)"),
        )
    )


def held_allocation(
    name: str, nbytes: int, category: Category, *, shape=(), dtype: str = "", symbol: str = "held outside the trace"
) -> Allocation:
    """An allocation held outside the traces (a parameter, optimizer state, a buffer of FSDP's)."""
    return Allocation(
        name=name, nbytes=nbytes, category=category, shape=tuple(shape), dtype=dtype, symbol=symbol, external=True
    )


def _qualnames(fn) -> list[tuple[int, str]]:
    """(id of each parameter, its qualified name) of a module (nothing for a function)."""
    return [(id(p), q) for q, p in fn.named_parameters()] if isinstance(fn, torch.nn.Module) else []


def optimizer_state_name(optimizer: torch.optim.Optimizer | str, key: str, parameter: str) -> str:
    """How every mode names a piece of optimizer state: ``AdamW exp_avg of transformer.h.3.mlp.fc.weight``."""
    kind = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    return f"{kind} {key} of {parameter}"


def _optimizer_state(optimizer, qualnames: dict[int, str], device_type: str | None) -> list[Allocation]:
    if optimizer is None:
        return []
    if not optimizer.state:
        return _anticipated_adam_state(optimizer, qualnames, device_type)
    records: dict[object, Allocation] = {}
    for i, (param, per_param) in enumerate(optimizer.state.items()):
        for key, t in per_param.items():
            if isinstance(t, torch.Tensor):
                records[_storage_key(t)] = held_allocation(
                    optimizer_state_name(optimizer, key, qualnames.get(id(param), f"parameter #{i}")),
                    t.untyped_storage().nbytes(),
                    Category.OPTIMIZER_STATE,
                    shape=t.shape,
                    dtype=dtype_name(t),
                )
    return list(records.values())


def _anticipated_adam_state(optimizer, qualnames: dict[int, str], device_type: str | None) -> list[Allocation]:
    """The state Adam and AdamW create in their first step (``adam_state``) for each parameter that requires a
    gradient, on ``device_type`` (None: the parameters'). Other optimizers without state yet: none, with a warning
    (their state is counted once it exists)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        warnings.warn(
            f"estimate_step: {type(optimizer).__name__} has no state yet and its state is not "
            "anticipated; run one optimizer step first to count it",
            stacklevel=3,
        )
        return []
    records = []
    params = [(group, p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for i, (group, param) in enumerate(params):
        records += adam_state(
            type(optimizer).__name__,
            qualnames.get(id(param), f"parameter #{i}"),
            param.numel() * param.element_size(),
            tuple(param.shape),
            dtype_name(param),
            device_type=device_type or param.device.type,
            amsgrad=bool(group.get("amsgrad")),
            step_on_device=bool(group.get("fused") or group.get("capturable")),
        )
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
class _Persistent:
    """A tensor alive before the step: its storage identity and its record."""

    key: object
    record: Allocation


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
            out[name] = _Persistent(_storage_key(t), record)
    for a in trace.args:
        if hasattr(a, "shape") and hasattr(a, "dtype") and a.name not in out:
            category = Category.PARAMETER if a.name.startswith("t_") else Category.INPUT
            out[a.name] = _Persistent(
                a.name, held_allocation(a.name, nbytes(a), category, shape=a.shape, dtype=dtype_name(a))
            )
    return out


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    if t.device.type == "meta":
        return ("meta", id(t))
    return (t.device.type, storage.data_ptr())


def _arg_names(trace) -> set[str]:
    """Names of the tensors a trace receives, directly or inside its argument lists."""
    return set(proxy_names(trace.args))


def _unique(helds) -> list[_Persistent]:
    return list({held.key: held for held in helds}.values())
