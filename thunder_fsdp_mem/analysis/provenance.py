"""Where each tensor of a trace comes from: the model's module whose code computed it, and the op.

Entry points: ``scopes_of(model, root="") -> Scopes`` (which modules' code lies at which source lines),
``Provenance(trace, parameters, scopes)``, which the liveness walk asks for the ``Origin`` of each output as it
visits the trace, and ``gradients(forward, backward, parameters)`` (which parameter a backward's output is the
gradient of, also while it is reduced on its way out).

A fusion's output is named after the op inside the fusion that computes it (``TorchCompile12`` says nothing), and
that op is placed by:
1. the parameters it reads (``transformer.h.3.mlp.fc.weight``: the module ``transformer.h.3.mlp.fc``), else
2. the line of the model's code Thunder recorded for it: the class whose source holds the line, and of that
   class's instances in the model the one whose parameters the trace reads nearest to it (a norm's first ops come
   before its weight is read, an attention's core between its two projections), else
3. what it reads: an op after a module (``to after transformer.h.3.mlp.fc``), as in a backward, which records no
   lines.
The output of the language-model head is the logits; what is computed from them outside the model is the loss.
Lines inside Thunder (a decomposition's) are not the user's and place nothing.
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch
import thunder
import thunder.torch as ltorch
from thunder.core import prims

from thunder_fsdp_mem.analysis.symbols import (
    ALL_GATHER,
    CLEAR,
    MATMULS,
    REDUCE_SCATTER,
    WAITS,
    names,
    parameter_path,
    proxy_names,
    sym_id,
    tensor_args,
)

HEAD = "lm_head"  # litgpt's language-model head, whose output is the logits


@dataclass(frozen=True, slots=True)
class Origin:
    """What made a tensor. ``module``: the module's qualified name ("" for the model itself; for a gradient or a
    gathered parameter, the parameter's); ``op``: the op that computed it; ``own``: the op is the module's (it
    reads its parameters or lies in its code), not merely after it; ``role``: ``logits``, ``loss``, ``gradient``
    (of the parameter ``module``), ``parameter`` (the parameter ``module``, gathered, reshaped or cast),
    ``cotangent`` (what a backward receives: the gradient of its forward's ``op``, ``logits`` or ``output``) or None;
    ``source``: the user's line of the op (``file:line``), None where Thunder recorded none outside its own code."""

    module: str | None
    op: str
    own: bool = True
    role: str | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class Scopes:
    """Source lines of the model's module classes: ``spans[file]`` holds (first line, last line, class) for each
    class of a module in the model (its bases included, for inherited methods), ``instances[class]`` the qualified
    names of the modules that are one."""

    spans: Mapping[str, tuple[tuple[int, int, type], ...]]
    instances: Mapping[type, tuple[str, ...]]

    def at(self, filename: str | None, line: int | None) -> tuple[str, ...]:
        """The modules whose class's code holds ``filename:line`` (the innermost class), or ()."""
        if filename is None or line is None:
            return ()
        spans = self.spans.get(_real(filename), ())
        inside = [(last - first, cls) for first, last, cls in spans if first <= line <= last]
        return self.instances[min(inside, key=lambda s: s[0])[1]] if inside else ()


def scopes_of(model: torch.nn.Module, root: str = "") -> Scopes:
    """The ``Scopes`` of ``model``'s modules, their names prefixed with ``root`` (the path of ``model`` in a larger
    one, for a graph compiled per block)."""
    spans: dict[str, set[tuple[int, int, type]]] = {}
    instances: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        qualname = ".".join(p for p in (root, name) if p)
        for cls in type(module).__mro__:
            if cls in (torch.nn.Module, object):
                continue
            span = _span(cls)
            if span is None:
                continue
            instances.setdefault(cls, []).append(qualname)
            spans.setdefault(span[0], set()).add((span[1], span[2], cls))
    return Scopes(
        {f: tuple(sorted(s, key=lambda t: t[:2])) for f, s in spans.items()},
        {cls: tuple(names) for cls, names in instances.items()},
    )


class Provenance:
    """The ``Origin`` of every tensor a trace makes, found as the trace is walked in order (``visit``).

    ``parameters``: trace name -> the parameter's qualified name where the name does not tell (``thunder.jit``'s
    ``t_`` names); ``scopes``: the model's, None when unknown (then only parameters and inputs place an op);
    ``inherited``: the origins of tensors the trace receives (a backward's saved tensors: the forward's);
    ``gradients``: names the trace returns -> the parameter each is the gradient of."""

    def __init__(
        self,
        trace,
        parameters: Mapping[str, str] | None,
        scopes: Scopes | None,
        inherited: Mapping[str, Origin] | None = None,
        gradients: Mapping[str, str] | None = None,
    ):
        self.parameters = parameters
        self.scopes = scopes
        self.origins: dict[str, Origin] = dict(inherited or {})
        self.gradients = dict(gradients or {})
        self.params: dict[str, str] = {}  # trace name -> parameter qualified name (gathered ones too)
        self.reads: dict[str, list[float]] = {}  # module (and each of its parents) -> indices that read its parameters
        self.head: str | None = None  # the language-model head, once an op visited has read its weight
        self._read_positions(trace)

    def visit(self, index: int, bsym) -> None:
        """Find the origins of what ``bsym``, the trace's ``index``-th symbol, makes (a fusion's, op by op)."""
        for at, op in _ops(index, bsym):
            self._place(at, op)

    def of(self, name: str) -> Origin | None:
        return self.origins.get(name)

    def _read_positions(self, trace) -> None:
        """Where the trace reads each module's parameters: a fusion's ops at positions within it, in order, so
        that a fusion spanning two blocks places each op by the block it reads nearest."""
        for i, bsym in enumerate(trace.bound_symbols):
            if bsym.sym.name in _NO_CODE or bsym.sym.name.startswith("unpack"):
                continue
            for at, op in _ops(i, bsym):
                read = self._parameters_read(op)
                if read and self._moves(op):  # a gathered parameter (or a view of one) is the parameter
                    for out in op.flat_proxy_outs:
                        self.params[out.name] = read[0]
                    continue
                for q in dict.fromkeys(read):
                    for module in _ancestors(q.rpartition(".")[0]):
                        self.reads.setdefault(module, []).append(at)

    def _moves(self, bsym) -> bool:
        """Whether ``bsym`` only gathers, waits for, reshapes or casts a parameter: no module's code runs there
        (Thunder's fsdp gathers and prepares the weights before the ops that use them)."""
        sid = sym_id(bsym)
        return sid in _MOVES or (sid in _SHAPES and all(a.name in self.params for a in tensor_args(bsym)))

    def _parameters_read(self, bsym) -> list[str]:
        out = []
        for a in tensor_args(bsym):
            q = self.params.get(a.name) or parameter_path(a.name, self.parameters)
            if q is not None:
                self.params.setdefault(a.name, q)
                out.append(q)
        return out

    def _place(self, index: float, op) -> None:
        outs = [o.name for o in op.flat_proxy_outs if o.name not in self.origins]
        if not outs:
            return
        name = op.sym.name
        origin = self._origin(index, op, name) or Origin(None, name, own=False)  # at least the op
        source = _line_of(op)
        if source is not None:
            origin = dataclasses.replace(origin, source=source)
        for o in outs:
            parameter = self.gradients.get(o)
            self.origins[o] = Origin(parameter, name, role="gradient", source=source) if parameter else origin

    def _origin(self, index: float, op, name: str) -> Origin | None:
        sid = sym_id(op)
        read = [self.params[a.name] for a in tensor_args(op) if a.name in self.params]
        if read and self._moves(op):
            return Origin(read[0], name, role="parameter")
        if read:
            module = read[0].rpartition(".")[0]
            if not is_head(module):
                return Origin(module, name)
            self.head = module
            return Origin(module, name, role="logits" if name in MATMULS else "loss")
        inputs = [o for o in map(self.origins.get, (a.name for a in tensor_args(op))) if o is not None]
        placed = self._in_code(index, op)
        if placed is not None:
            head = self.head
            if head is not None and not _inside(placed, head):  # the model's own code after its head: soft-capping
                return Origin(placed, name, role="logits" if placed == head.rpartition(".")[0] else "loss")
            return Origin(placed, name)
        if sid == REDUCE_SCATTER or not inputs:
            return None
        # the most telling of what it reads: the loss, a parameter, else the deepest module; a gradient only moved
        placed_inputs = [o for o in inputs if o.role not in ("gradient", "cotangent") and o.module is not None]
        if not placed_inputs:
            moved = bool(inputs) and inputs[0].role == "gradient" and sid in _IN_TRANSIT
            return Origin(inputs[0].module, name, own=False, role="gradient") if moved else None
        first = max(placed_inputs, key=lambda o: (o.role is not None, len((o.module or "").split("."))))
        if first.role in ("logits", "loss"):
            return Origin(first.module, name, own=False, role="loss")
        if first.role == "parameter":  # a parameter the forward cast or gathered for the backward: the module's op
            return Origin(first.module.rpartition(".")[0], name)
        return Origin(first.module, name, own=False)

    def _in_code(self, index: float, op) -> str | None:
        """The module whose code holds the op's line, of its class's instances the one read nearest to ``index``."""
        if self.scopes is None:
            return None
        line = op.source_positions.lineno if op.source_positions else None
        candidates = self.scopes.at(op.source_filename, line)
        if not candidates:
            return None
        return min(candidates, key=lambda m: (_distance(self.reads.get(m, ()), index), len(m)))


def gradients(backward, forward_args: list[str], parameters: Mapping[str, str] | None) -> dict[str, str]:
    """Names a backward trace returns (and the tensors it reduces into them on their way out: a division, a cast,
    a reduce-scatter and its wait) -> the parameter each is the gradient of. A backward returns one value per
    argument of its forward, in order."""
    ret = backward.bound_symbols[-1]
    values = ret.args[0] if len(ret.args) == 1 and isinstance(ret.args[0], (tuple, list)) else ret.args
    out: dict[str, str] = {}
    for arg, value in zip(forward_args, values):
        q = parameter_path(arg, parameters)
        if q is not None and getattr(value, "name", None):
            out[value.name] = q
    for bsym in reversed(backward.bound_symbols):
        outs = [o.name for o in bsym.flat_proxy_outs]
        if len(outs) == 1 and outs[0] in out and sym_id(bsym) in _IN_TRANSIT:
            first = tensor_args(bsym)[:1]
            if first:
                out.setdefault(first[0].name, out[outs[0]])
    return out


def cotangents(forward, backward, origins: Mapping[str, Origin]) -> dict[str, Origin]:
    """The origins of what a backward receives as ``cotangents``: the gradient of each output of its forward, in
    order (``gradient of the logits``, ``gradient of the output``)."""
    returned = forward.bound_symbols[-1].args
    value = returned[0] if len(returned) == 1 else returned
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], dict) and "output" in value[0]):
        return {}
    outputs = proxy_names(value[0]["output"])
    try:
        received = backward.args[[name for name, _ in backward.siginfo().args].index("cotangents")]
    except (ValueError, IndexError):
        return {}
    out = {}
    for output, cotangent in zip(outputs, proxy_names(received)):
        origin = origins.get(output)
        what = "logits" if origin is not None and origin.role == "logits" else "output"
        out[cotangent] = Origin(None, what, role="cotangent")
    return out


def backward_names(forward, backward, forward_origins: Mapping[str, Origin], parameters: Mapping[str, str] | None):
    """What ``analyze`` of a backward is given to name its allocations: ``origins`` (the forward's, and its
    cotangents') and ``gradients`` (``gradients``), as keyword arguments."""
    return {
        "origins": {**forward_origins, **cotangents(forward, backward, forward_origins)},
        "gradients": gradients(backward, [getattr(a, "name", "") for a in forward.args], parameters),
    }


_MOVES = frozenset({ALL_GATHER, *WAITS})
# ``broadcast_in_dim``: the prim's own name, which ``sym_id`` never gives (it names the prim ``expand``), kept from the
# first table.
_SHAPES = names(
    ltorch.unsqueeze,
    ltorch.squeeze,
    ltorch.reshape,
    ltorch.view,
    ltorch.expand,
    ltorch.transpose,
    ltorch.permute,
    ltorch.t,
    prims.convert_element_type,
    ltorch.to,
    ltorch.contiguous,
    prims.stride_order,
) | frozenset({"broadcast_in_dim"})
_NO_CODE = frozenset({prims.python_del.name, prims.python_return.name, CLEAR})  # by name (an executor op's is its id)
_IN_TRANSIT = frozenset({REDUCE_SCATTER, *WAITS}) | names(
    ltorch.true_divide, ltorch.div, prims.convert_element_type, ltorch.to, ltorch.reshape, ltorch.view, ltorch.mul
)


def _ops(index: int, bsym) -> list[tuple[float, object]]:
    """The ops of the trace's ``index``-th symbol with their positions: a fusion's, between ``index`` and the next."""
    if not bsym.sym.is_fusion:
        return [(index, bsym)]
    n = len(bsym.subsymbols)
    return [(index + (k + 1) / (n + 1), sub) for k, sub in enumerate(bsym.subsymbols)]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".") if module else []
    return ["", *(".".join(parts[: i + 1]) for i in range(len(parts)))]


def _inside(module: str, parent: str) -> bool:
    return parent == "" or module == parent or module.startswith(parent + ".")


def is_head(module: str) -> bool:
    return module == HEAD or module.endswith("." + HEAD)


def _distance(positions: list[float], index: float) -> float:
    if not positions:
        return float("inf")
    at = bisect.bisect_left(positions, index)
    near = [positions[j] for j in (at - 1, at) if 0 <= j < len(positions)]
    return min(abs(p - index) for p in near)


@lru_cache(maxsize=None)
def _span(cls: type) -> tuple[str, int, int] | None:
    try:
        lines, first = inspect.getsourcelines(cls)
        return _real(inspect.getsourcefile(cls)), first, first + len(lines) - 1
    except (OSError, TypeError):
        return None


@lru_cache(maxsize=None)
def _real(filename: str) -> str:
    return os.path.realpath(filename)


_THUNDER = os.path.dirname(_real(thunder.__file__)) + os.sep


@lru_cache(maxsize=None)
def _users(filename: str | None) -> bool:
    """Whether a recorded line is in code the user can read as theirs (their model, torch's modules), not in
    Thunder's (a decomposition's, which places nothing)."""
    return bool(filename) and not _real(filename).startswith(_THUNDER)


def user_line(bsym) -> str | None:
    """``file:line`` of the first line Thunder recorded for ``bsym`` (or, for a fusion, its ops) outside Thunder's
    own code; None where there is none."""
    return next((line for line in map(_line_of, (bsym, *bsym.subsymbols)) if line is not None), None)


def _line_of(op) -> str | None:
    """``file:line`` Thunder recorded for ``op`` itself, where it is not in Thunder's own code."""
    if not _users(op.source_filename):
        return None
    line = op.source_positions.lineno if op.source_positions else None
    return f"{op.source_filename}:{line}" if line is not None else op.source_filename
