"""The optimizer's memory: the state it holds through the step, and what its step adds after the backward.

Entry points, for a torch optimizer (what ``step.estimate_step`` is given): ``optimizer_state(optimizer, ...)``,
its state, or before its first step the state Adam and AdamW will create (``adam_state``);
``optimizer_step_allocation``, what Adam's or AdamW's step holds at its peak (``adam_step_bytes``). For a
forward/backward pair of traces (what a transform sees): ``anticipated_adamw`` and ``anticipated_adamw_step``, the
same for AdamW over the parameters the pair trains, stepped in ``parameter_order``.

The state is held outside the traces (``holdings.held_allocation``, category ``OPTIMIZER_STATE``); the step's
temporaries are one allocation that names the kind of step (``foreach``, ``single tensor``, ``fused``), as torch
2.11's ``torch/optim/adam.py`` runs them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from thunder_fsdp_mem.analysis import device
from thunder_fsdp_mem.analysis.timeline import Allocation
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.holdings import held_allocation, storage_key
from thunder_fsdp_mem.analysis.symbols import dtype_name, nbytes, parameter_path

# --- the state --------------------------------------------------------------------------------------------------------


def optimizer_state_name(optimizer: torch.optim.Optimizer | str, key: str, parameter: str) -> str:
    """How every mode names a piece of optimizer state: ``AdamW exp_avg of transformer.h.3.mlp.fc.weight``."""
    kind = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    return f"{kind} {key} of {parameter}"


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


def optimizer_state(optimizer, qualnames: dict[int, str], device_type: str | None) -> list[Allocation]:
    """The state ``optimizer`` holds (None: none), each tensor named for its parameter (``qualnames``: id of each
    parameter -> its qualified name); before its first step, the state it will create
    (``_anticipated_adam_state``)."""
    if optimizer is None:
        return []
    if not optimizer.state:
        return _anticipated_adam_state(optimizer, qualnames, device_type)
    records: dict[object, Allocation] = {}
    for i, (param, per_param) in enumerate(optimizer.state.items()):
        for key, t in per_param.items():
            if isinstance(t, torch.Tensor):
                records[storage_key(t)] = held_allocation(
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


# --- the step ---------------------------------------------------------------------------------------------------------

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


def optimizer_step_allocation(optimizer, device_type: str | None) -> Allocation | None:
    """What Adam's or AdamW's step adds at its peak (``adam_step_bytes``); None for no optimizer or another."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return None
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    on = device_type or (params[0].device.type if params else "cpu")
    kind = adam_kind(optimizer, on)
    sizes = [(p.numel() * p.element_size(), dtype_name(p)) for p in params]
    return adam_step_allocation(type(optimizer).__name__, sizes, kind)


# --- AdamW over the parameters a pair of traces trains ----------------------------------------------------------------


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
