"""The ThunderFX graph that every litgpt block runs under FSDP2, traced on the meta device and analysed.

Entry points: ``trace_blocks(gpt, idx, executors, transform, device_type) -> BlockTraces``, and
``trace_tail(loss_model, x, targets, ...)``, the graph of a ``LossModel``'s head and loss (the loss in the step).

Dynamo does not trace FSDP2's hooks, so it breaks the graph at every ``fully_shard`` unit: each Block's forward is
one ThunderFX graph, compiled once and run for every block. Here the blocks are compiled with ``ThunderCompiler``
on the meta device (under ``meta.as_on``, so the traces are the target device's) and run forward and backward once;
the forward and backward traces of their graph are analysed by ``liveness.analyze``.

A Thunder trace of a ThunderFX graph places its symbols in the code FX generated (``<eval_with_key>.4:43``), which
tells a reader nothing: each symbol is placed again at the line of the user's code its FX node was traced from.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from dis import Positions

import torch
import thunder
from thunder.core.trace import from_trace
from thunder.dynamo import ThunderCompiler

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.liveness import analyze
from thunder_fsdp_mem.analysis.timeline import InputSpec, MemoryTimeline
from thunder_fsdp_mem.analysis.provenance import backward_names, scopes_of
from thunder_fsdp_mem.analysis.symbols import proxy_names
from thunder_fsdp_mem.passes.driver import Rewrite
from thunder_fsdp_mem.transform import FSDPMemoryTransform


@dataclass(frozen=True, slots=True)
class BlockTraces:
    """The ThunderFX graph every block runs: its traces' timelines and the block input's name in them."""

    forward: MemoryTimeline
    backward: MemoryTimeline
    activation: str  # the forward's argument that is the block's input
    output: str  # the name the forward returns as the block's output
    saved: tuple[str, ...]  # the names it saves for the backward


def trace_blocks(
    gpt, idx: torch.Tensor, executors: list, transform: FSDPMemoryTransform | None, device_type: str
) -> BlockTraces:
    """Compile the blocks as FSDP2's graph breaks leave them (each Block's forward alone) with ThunderFX, run them
    forward and backward on the meta device, and analyse the one graph they all run. ``transform``: the
    ``FSDPMemoryTransform`` to compile with, None for none."""
    backend = _backend(executors, transform)
    T = idx.size(1)
    cos, sin = gpt.cos[:T].unsqueeze(0), gpt.sin[:T].unsqueeze(0)
    x = gpt.transformer.wte(idx).detach().requires_grad_(True)
    y = x
    for block in gpt.transformer.h:
        y = torch.compile(block, backend=backend)(y, cos, sin)
    y.backward(torch.empty_like(y))
    return _analysed(backend, "blocks", x, scopes_of(gpt.transformer.h[0]), transform, device_type)


def trace_tail(
    loss_model, x: torch.Tensor, targets: torch.Tensor, executors: list, transform, device_type: str
) -> BlockTraces:
    """The ThunderFX graph that ``LossModel`` runs under FSDP2 after the final norm's unit (``head_loss``: the head,
    its soft-cap and the loss, which the transform chunks), compiled alone, run forward and backward on the meta
    device from the final norm's output ``x``, and analysed."""
    backend = _backend(executors, transform)
    x = x.detach().requires_grad_(True)

    def tail(x, targets):  # Dynamo names the arguments l_x_ and l_targets_
        return loss_model.head_loss(x, targets)

    torch.compile(tail, backend=backend)(x, targets).backward()
    return _analysed(backend, "head and loss", x, scopes_of(loss_model.gpt), transform, device_type)


def _backend(executors: list, transform: FSDPMemoryTransform | None) -> ThunderCompiler:
    torch._dynamo.reset()
    transforms = [transform] if transform is not None else []  # fresh: ThunderCompiler appends to it
    return ThunderCompiler(executors=executors, transforms=transforms)


def _analysed(backend, what: str, x: torch.Tensor, scopes, transform, device_type: str) -> BlockTraces:
    """The traces of the one Thunder function ``backend`` compiled, placed at the user's lines and analysed;
    ``x``: the graph's activation input."""
    torch._dynamo.reset()
    fns = [fn for info in backend.subgraph_infos for fn in (info.thunder_compiled_fns or [])]
    if len(backend.subgraph_infos) != 1 or len(fns) != 1 or backend.subgraph_infos[0].split_reasons:
        raise NotImplementedError(
            f"the {what} compile to {len(backend.subgraph_infos)} graphs and {len(fns)} Thunder functions; the "
            "fsdp2 composition needs one graph"
        )
    sources = _fx_sources(backend.subgraph_infos[0].split_graph_module)
    if transform is not None:  # what it recomputes, placed at the user's lines as the traces below are
        transform.rewrites[:] = [_rewrite_at_user_lines(r, sources) for r in transform.rewrites]
    forward_trace = _placed_at_user_lines(thunder.last_traces(fns[0])[-1], sources)
    backward_trace = _placed_at_user_lines(thunder.last_backward_traces(fns[0])[-1], sources)
    activation = _activation_name(forward_trace, tuple(x.shape))
    output, saved = _returned(forward_trace)
    forward = analyze(forward_trace, inputs=_forward_specs(forward_trace), device_type=device_type, scopes=scopes)
    backward = analyze(
        backward_trace,
        inputs=_backward_specs(forward),
        device_type=device_type,
        **backward_names(forward_trace, backward_trace, forward.origins, None),
    )
    return BlockTraces(forward, backward, activation, output, saved)


_ASSIGNED = re.compile(r"\s*(\w+) = ")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _fx_sources(module: torch.fx.GraphModule) -> dict[tuple[str, int], str]:
    """(file, line) of the code FX generated for each graph of ``module`` -> ``path:line`` of the user's code the
    line's node was traced from (the last frame of its stack trace)."""
    found = {}
    for _, graph_module in module.named_modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        filename = graph_module.forward.__code__.co_filename
        nodes = {node.name: node for node in graph_module.graph.nodes}
        for lineno, text in enumerate(graph_module.code.splitlines(), start=1):
            assigned = _ASSIGNED.match(text)
            node = nodes.get(assigned.group(1)) if assigned else None
            frames = _FRAME.findall(node.meta.get("stack_trace") or "") if node is not None else []
            if frames:
                found[filename, lineno] = f"{frames[-1][0]}:{frames[-1][1]}"
    return found


def _placed_at_user_lines(trace, sources: dict[tuple[str, int], str]):
    """``trace`` with its symbols (and their subsymbols) from generated code placed at the user's lines."""

    def placed(bsym):
        subsymbols = [placed(sub) for sub in bsym.subsymbols]
        line = bsym.source_positions.lineno if bsym.source_positions else None
        user = sources.get((bsym.source_filename, line))
        if user is None:
            return bsym.from_bsym(subsymbols=subsymbols)
        filename, _, lineno = user.rpartition(":")
        return bsym.from_bsym(
            subsymbols=subsymbols,
            source_filename=filename,
            source_positions=Positions(int(lineno), int(lineno), None, None),
        )

    out = from_trace(trace)
    out.bound_symbols = [placed(bsym) for bsym in trace.bound_symbols]
    return out


def _rewrite_at_user_lines(rewrite: Rewrite, sources: dict[tuple[str, int], str]) -> Rewrite:
    def placed(source: str | None) -> str | None:
        if source is None:
            return None
        filename, _, line = source.rpartition(":")
        return sources.get((filename, int(line)), source) if line.isdigit() else source

    recomputed = tuple(dataclasses.replace(g, source=placed(g.source)) for g in rewrite.recomputed)
    return dataclasses.replace(rewrite, recomputed=recomputed)


def _returned(trace) -> tuple[str, tuple[str, ...]]:
    """The output's name and the saved names of a ThunderFX forward trace (``return ({'output': y, ...}, saved)``)."""
    args = trace.bound_symbols[-1].args
    value = args[0] if len(args) == 1 else args
    outputs = proxy_names(value[0]["output"])
    if len(outputs) != 1:
        raise NotImplementedError(f"the block graph returns {len(outputs)} tensors; one was expected")
    return outputs[0], tuple(proxy_names(value[1]))


def _activation_name(trace, shape: tuple[int, ...]) -> str:
    """The forward's argument that is the block's input: Dynamo names it after the local ``x`` (``l_x_``)."""
    names = [a.name for a in trace.args if getattr(a, "name", None) == "l_x_" and tuple(a.shape) == shape]
    if len(names) != 1:
        raise NotImplementedError("the block graph has no argument l_x_ of the block input's shape")
    return names[0]


def _forward_specs(trace) -> dict[str, InputSpec]:
    """Every argument of the block's forward is held by its caller: the block's input by the model's ``forward``
    until the block returns; the gathered parameters (by FSDP2) and the rope tables (by the model) are counted
    where they are held, outside the trace (zero bytes here)."""
    specs = {}
    for a in trace.args:
        if not hasattr(a, "shape"):
            continue
        if "_parameters_" in a.name:
            specs[a.name] = InputSpec(a.name, Category.GATHERED_PARAMETER, external=True, nbytes=0)
        elif a.name == "l_x_":
            specs[a.name] = InputSpec(a.name, Category.INPUT, external=True)
        else:
            specs[a.name] = InputSpec(a.name, Category.PARAMETER, external=True, nbytes=0)
    return specs


def _backward_specs(forward: MemoryTimeline) -> dict[str, InputSpec]:
    """What the forward returns, as the backward receives it: what the forward made belongs to the backward, which
    frees it; the forward's own arguments are held elsewhere."""
    return {
        name: InputSpec(
            ("forward", i),
            forward.allocations[i].category,
            external=forward.allocations[i].external,
            nbytes=forward.allocations[i].nbytes,
        )
        for name, i in forward.outputs.items()
    }
