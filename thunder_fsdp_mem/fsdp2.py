"""One training step of a litgpt model under FSDP2 (``fully_shard``) through ThunderFX, per rank, composed from the
ThunderFX traces of its blocks and what FSDP2 holds outside them. Traced on the meta device: no GPU, no memory
for the model, no other ranks.

Entry point: ``compose_step(spec, *, world_size, shard, ...) -> StepMemory``.

The set-up is ``benchmarks/compare.py``'s (``modes._fsdp2``): ``fully_shard`` on each Block, ``lm_head``, ``wte``,
``ln_f`` and then the root, bf16 parameters, ``reshard_after_forward`` for zero3 only; the whole model under
``torch.compile(backend=ThunderCompiler(...))``; the loss is eager cross-entropy on the logits.

How such a step runs, and how it is composed here:

- Dynamo does not trace FSDP2's hooks, so it breaks the graph at every unit: each Block's forward is one ThunderFX
  graph, compiled once and run for every block; ``wte``, ``ln_f`` and ``lm_head`` are ``torch.nn`` modules and run
  eagerly. Here the blocks are compiled with ``ThunderCompiler`` on the meta device and run forward and backward
  once; the forward and backward traces of their graph are analysed by ``liveness.analyze``, the estimator of the
  whole package. The eager units run on the meta device under ``saved_tensors_hooks``, which shows what autograd
  saves; their backward allocates a gradient for each input and parameter.
- FSDP2's holdings follow its code in torch 2.11 (``_fully_shard/_fsdp_param_group.py``, ``_fsdp_collectives.py``):
  - every parameter's shard is its first dimension padded to a multiple of the world size, divided by it; AdamW
    keeps two moments of the shard's size;
  - before a unit's forward, its shards are all-gathered into one buffer of world size x shard bytes and copied
    out into the unsharded parameters; the buffer is freed when the next unit's copy-out is done (the last one
    after the root's forward): ``wait_for_unshard`` drops it before the copy-out, but its local
    ``prev_all_gather_state`` holds it until the function returns. zero3 frees the unsharded parameters after each unit's forward and gathers them
    again before its backward (buffer freed at once), prefetching the unit that runs next in the backward; zero2
    keeps them until the unit's backward is done;
  - after a unit's backward, its unsharded gradients are copied into a reduce-scatter input (world size x shard
    bytes); the reduce-scatter's output, the sharded gradient, is allocated and kept, and only then are the
    unsharded gradients freed (``foreach_reduce`` clears its list, but the parameters' ``grad`` still hold them);
    the input is freed when the next unit's reduce-scatter starts (the last at the end of the backward).
- The caller holds the logits until ``backward`` returns; the loss is ``step.loss_allocations``.

Limitations: litgpt's plain ``GPT.forward`` only (embedding, blocks, final norm, head); configurations with
``final_logit_softcapping`` or ``rope_indices`` are refused, and ``scale_embeddings``' product is not counted.
Parameters are bf16 or fp32 as given, with no mixed-precision casts. The optimizer's own step and allocator
rounding are not modelled, as in ``estimate_step``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from thunder_fsdp_mem import models, ops
from thunder_fsdp_mem.categories import Category
from thunder_fsdp_mem.liveness import Allocation, InputSpec, MemoryTimeline, analyze
from thunder_fsdp_mem.step import Phase, StepMemory, loss_allocations

SHARDS = ("zero2", "zero3")
UNSUPPORTED = ("final_logit_softcapping", "rope_indices")


def compose_step(spec: models.ModelSpec, *, world_size: int, shard: str, device_type: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, micro_batch_size: int = 1, executors: str = "default+cat",
                 memory=None) -> StepMemory:
    """The estimated memory per rank of one step of ``spec`` under FSDP2 and ThunderFX on ``world_size`` ranks of
    ``device_type``; ``shard`` zero2 or zero3; ``executors``: ``runtime.executors``' choice; ``memory``: a
    ``MemoryConfig`` to run ``FSDPMemoryTransform`` with (None: without it)."""
    from litgpt import GPT

    from thunder_fsdp_mem import runtime
    from thunder_fsdp_mem.emulate import as_on

    if shard not in SHARDS:
        raise ValueError(f"shard must be one of {', '.join(SHARDS)}; got {shard!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    config = spec.config()
    refused = unsupported(config)
    if refused:
        raise NotImplementedError(f"{spec.name}: the fsdp2 composition does not model {', '.join(refused)}")
    chosen = runtime.executors(executors)
    with as_on(device_type, chosen):
        torch.manual_seed(0)
        with torch.device("meta"):
            gpt = GPT(config)
        gpt = gpt.to(dtype)
        idx, targets = models.batch(spec, micro_batch_size=micro_batch_size, device="meta")
        blocks = _trace_blocks(gpt, idx, chosen, memory, device_type)
        composer = _Composer(gpt, world_size, shard == "zero3", blocks, idx, targets)
        return composer.run()


def unsupported(config) -> list[str]:
    """The fields of a litgpt ``Config`` that the composition does not model and that ``config`` sets."""
    return [name for name in UNSUPPORTED if getattr(config, name, None) is not None]


@dataclass(frozen=True, slots=True)
class _BlockTraces:
    """The ThunderFX graph every block runs: its traces' timelines and the block input's name in them."""

    forward: MemoryTimeline
    backward: MemoryTimeline
    activation: str  # the forward's argument that is the block's input
    output: str  # the name the forward returns as the block's output
    saved: tuple[str, ...]  # the names it saves for the backward


def _trace_blocks(gpt, idx, executors: list, memory, device_type: str) -> _BlockTraces:
    """Compile the blocks as FSDP2's graph breaks leave them (each Block's forward alone) with ThunderFX, run them
    forward and backward on the meta device, and analyse the one graph they all run."""
    import thunder
    from thunder.dynamo import ThunderCompiler

    from thunder_fsdp_mem.transform import FSDPMemoryTransform

    torch._dynamo.reset()
    transforms = [FSDPMemoryTransform(memory)] if memory is not None else []
    backend = ThunderCompiler(executors=executors, transforms=transforms)
    T = idx.size(1)
    cos, sin = gpt.cos[:T].unsqueeze(0), gpt.sin[:T].unsqueeze(0)
    x = gpt.transformer.wte(idx).detach().requires_grad_(True)
    y = x
    for block in gpt.transformer.h:
        y = torch.compile(block, backend=backend)(y, cos, sin)
    y.backward(torch.empty_like(y))
    torch._dynamo.reset()
    fns = [fn for info in backend.subgraph_infos for fn in (info.thunder_compiled_fns or [])]
    if len(backend.subgraph_infos) != 1 or len(fns) != 1 or backend.subgraph_infos[0].split_reasons:
        raise NotImplementedError(
            f"the blocks compile to {len(backend.subgraph_infos)} graphs and {len(fns)} Thunder functions; the "
            "fsdp2 composition needs one graph that every block runs")
    sources = _fx_sources(backend.subgraph_infos[0].split_graph_module)
    forward_trace = _placed_at_user_lines(thunder.last_traces(fns[0])[-1], sources)
    backward_trace = _placed_at_user_lines(thunder.last_backward_traces(fns[0])[-1], sources)
    activation = _activation_name(forward_trace, tuple(x.shape))
    output, saved = _returned(forward_trace)
    forward = analyze(forward_trace, inputs=_forward_specs(forward_trace), device_type=device_type)
    backward = analyze(backward_trace, inputs=_backward_specs(forward), device_type=device_type)
    return _BlockTraces(forward, backward, activation, output, saved)


_ASSIGNED = re.compile(r"\s*(\w+) = ")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _fx_sources(module: torch.fx.GraphModule) -> dict[tuple[str, int], str]:
    """(file, line) of the code FX generated for each graph of ``module`` -> ``path:line`` of the user's code the
    line's node was traced from (the last frame of its stack trace). A Thunder trace of a ThunderFX graph places
    its symbols in the generated code (``<eval_with_key>.4:43``), which tells a reader nothing."""
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
    from dis import Positions

    from thunder.core.trace import from_trace

    def placed(bsym):
        subsymbols = [placed(sub) for sub in bsym.subsymbols]
        line = bsym.source_positions.lineno if bsym.source_positions else None
        user = sources.get((bsym.source_filename, line))
        if user is None:
            return bsym.from_bsym(subsymbols=subsymbols)
        filename, _, lineno = user.rpartition(":")
        return bsym.from_bsym(subsymbols=subsymbols, source_filename=filename,
                              source_positions=Positions(int(lineno), int(lineno), None, None))

    out = from_trace(trace)
    out.bound_symbols = [placed(bsym) for bsym in trace.bound_symbols]
    return out


def _returned(trace) -> tuple[str, tuple[str, ...]]:
    """The output's name and the saved names of a ThunderFX forward trace (``return ({'output': y, ...}, saved)``)."""
    from thunder_fsdp_mem.ops import proxy_names

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
    return {name: InputSpec(("forward", i), forward.allocations[i].category,
                            external=forward.allocations[i].external, nbytes=forward.allocations[i].nbytes)
            for name, i in forward.outputs.items()}


@dataclass(frozen=True, slots=True)
class _Shard:
    """One parameter's shard on the rank with the most rows: its first dimension padded to a multiple of the
    world size and divided by it."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Unit:
    """One ``fully_shard`` unit: its parameters' shards, by name, and the sizes FSDP2 gathers and scatters."""

    name: str
    module: torch.nn.Module
    shards: dict[str, _Shard] = field(hash=False)
    world_size: int

    @property
    def shard_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    @property
    def gathered_bytes(self) -> int:
        return self.shard_bytes * self.world_size


def _unit(name: str, module: torch.nn.Module, world_size: int) -> _Unit:
    shards = {}
    for qualname, p in module.named_parameters():
        shape = tuple(p.shape) or (1,)
        rows = math.ceil(shape[0] / world_size)
        shards[qualname] = _Shard((rows, *shape[1:]), ops.dtype_name(p),
                                  rows * math.prod(shape[1:]) * p.element_size())
    return _Unit(name, module, shards, world_size)


class _Ledger:
    """What is alive outside the phase that runs: allocations by key, each kept while anyone holds it."""

    def __init__(self) -> None:
        self.live: dict[Hashable, Allocation] = {}
        self.holders: dict[Hashable, set[str]] = {}
        self.phases: list[Phase] = []

    def hold(self, key: Hashable, alloc: Allocation, holder: str) -> None:
        self.live.setdefault(key, alloc)
        self.holders.setdefault(key, set()).add(holder)

    def release(self, key: Hashable, holder: str) -> None:
        holders = self.holders.get(key)
        if holders is None:
            return
        holders.discard(holder)
        if not holders:
            del self.holders[key], self.live[key]

    def keys(self, prefix: tuple) -> list[Hashable]:
        return [k for k in self.live if isinstance(k, tuple) and k[:len(prefix)] == prefix]

    def phase(self, name: str, timeline: MemoryTimeline | None = None, *, inside: Iterable[Hashable] = (),
              extra: tuple[Allocation, ...] = (), symbol: str = "") -> None:
        """A phase whose timeline (or ``extra``) counts the allocations of keys ``inside``; the rest is outside."""
        skip = set(inside)
        outside = tuple(a for k, a in self.live.items() if k not in skip)
        self.phases.append(Phase(name, timeline, outside, extra, symbol))


def _record(name: str, nbytes: int, category: Category, shape=(), dtype: str = "",
            symbol: str = "FSDP2") -> Allocation:
    return Allocation(name, nbytes, category, tuple(shape), dtype, symbol, None, -1, None, True)


def _tensor_record(name: str, t: torch.Tensor, category: Category, symbol: str) -> Allocation:
    return _record(name, t.numel() * t.element_size(), category, tuple(t.shape),
                   ops.dtype_name(t), symbol)


class _Composer:
    """Walks one step in the order it runs, keeping the ledger of what FSDP2, the model and autograd hold."""

    def __init__(self, gpt, world_size: int, zero3: bool, blocks: _BlockTraces, idx, targets):
        self.gpt, self.zero3, self.blocks = gpt, zero3, blocks
        t = gpt.transformer
        self.units = [_unit("wte", t.wte, world_size),
                      *[_unit(f"block {i}", b, world_size) for i, b in enumerate(t.h)],
                      _unit("ln_f", t.ln_f, world_size), _unit("lm_head", gpt.lm_head, world_size)]
        self.idx, self.targets = idx, targets
        self.ledger = _Ledger()
        self.prefetched: set[str] = set()
        self.inputs: dict[str, Allocation] = {}  # unit -> its float input (what its backward returns a gradient for)
        self.flat: str | None = None  # the unit whose all-gather buffer the forward still holds
        self.scattering: str | None = None  # the unit whose reduce-scatter input is still held

    # the step -------------------------------------------------------------------------------------------------
    def run(self) -> StepMemory:
        self._persistent()
        wte, *blocks, ln_f, lm_head = self.units
        x, key = self._eager_forward(wte, self.idx, ("input", "token ids"))
        for unit in blocks:
            key = self._block_forward(unit, key)
        x, key = self._eager_forward(ln_f, torch.empty_like(x), key)
        _, key = self._eager_forward(lm_head, x, key)
        if self.flat is not None:  # the root's post-forward frees the last all-gather buffer
            self.ledger.release(("all-gather", self.flat), "FSDP2")
            self.flat = None
        forward_phases = len(self.ledger.phases)
        saved_bytes = sum(a.nbytes for k, a in self.ledger.live.items()
                          if k[0] != "input" and any(h.startswith("saved by") for h in self.ledger.holders[k]))
        self._loss(key)
        order = list(reversed(self.units))
        for i, unit in enumerate(order):
            following = order[i + 1] if i + 1 < len(order) else None
            self._pre_backward(unit, following)
            if unit.name.startswith("block"):
                self._block_backward(unit)
            else:
                self._eager_backward(unit)
            self._post_backward(unit)
        if self.scattering is not None:
            self.ledger.release(("reduce-scatter", self.scattering), "FSDP2")
        return self._result(forward_phases, saved_bytes)

    def _persistent(self) -> None:
        ledger = self.ledger
        for unit in self.units:
            for pname, shard in unit.shards.items():
                ledger.hold(("shard", unit.name, pname), _record(f"{unit.name}.{pname} (shard)", shard.nbytes,
                                                                  Category.PARAMETER, shard.shape, shard.dtype),
                            "model")
                for moment in ("exp_avg", "exp_avg_sq"):
                    ledger.hold(("adam", unit.name, pname, moment),
                                _record(f"AdamW {moment} of {unit.name}.{pname}", shard.nbytes,
                                        Category.OPTIMIZER_STATE, shard.shape, shard.dtype, "anticipated"), "model")
        for name, buf in self.gpt.named_buffers():
            ledger.hold(("buffer", name), _tensor_record(name, buf, Category.PARAMETER, "buffer"), "model")
        for name, t in (("token ids", self.idx), ("targets", self.targets)):
            ledger.hold(("input", name), _tensor_record(name, t, Category.INPUT, "input"), "caller")

    # FSDP2 --------------------------------------------------------------------------------------------------
    def _gathered_keys(self, unit: _Unit) -> list[Hashable]:
        return [("gathered", unit.name, p) for p in unit.shards]

    def _all_gather_buffer(self, unit: _Unit) -> Allocation:
        return _record(f"all-gather buffer of {unit.name}", unit.gathered_bytes, Category.COMM_BUFFER,
                       symbol="FSDP2 all-gather")

    def _gather(self, unit: _Unit, *, forward: bool) -> None:
        """Unshard ``unit``: its all-gather buffer, then the copy-out into its unsharded parameters."""
        ledger = self.ledger
        if not unit.shards or ledger.keys(("gathered", unit.name)):
            return
        if unit.name not in self.prefetched:
            ledger.hold(("all-gather", unit.name), self._all_gather_buffer(unit), "FSDP2")
        self.prefetched.discard(unit.name)
        for pname, shard in unit.shards.items():
            ledger.hold(("gathered", unit.name, pname),
                        _record(f"{unit.name}.{pname} (gathered)", shard.nbytes * unit.world_size,
                                Category.GATHERED_PARAMETER, (shard.shape[0] * unit.world_size, *shard.shape[1:]),
                                shard.dtype, "FSDP2 all-gather"), "FSDP2")
        ledger.phase(f"{'forward' if forward else 'backward'}: copy-out of {unit.name}", symbol="FSDP2 copy-out")
        if forward:
            if self.flat is not None:  # the previous unit's buffer, freed once this copy-out is done
                ledger.release(("all-gather", self.flat), "FSDP2")
            self.flat = unit.name
        else:
            ledger.release(("all-gather", unit.name), "FSDP2")

    def _reshard(self, unit: _Unit) -> None:
        for key in self._gathered_keys(unit):
            self.ledger.release(key, "FSDP2")

    def _pre_backward(self, unit: _Unit, following: _Unit | None) -> None:
        if not self.zero3:
            return
        self._gather(unit, forward=False)
        if following is not None and following.shards:
            self.ledger.hold(("all-gather", following.name), self._all_gather_buffer(following), "FSDP2")
            self.prefetched.add(following.name)

    def _post_backward(self, unit: _Unit) -> None:
        ledger = self.ledger
        self._reshard(unit)
        if not unit.shards:
            return
        if self.scattering is not None:
            ledger.release(("reduce-scatter", self.scattering), "FSDP2")
        ledger.hold(("reduce-scatter", unit.name),
                    _record(f"reduce-scatter input of {unit.name}", unit.gathered_bytes, Category.COMM_BUFFER,
                            symbol="FSDP2 reduce-scatter"), "FSDP2")
        self.scattering = unit.name
        ledger.hold(("gradient", unit.name), _record(f"gradients of {unit.name} (shard)", unit.shard_bytes,
                                                     Category.GRADIENT, symbol="FSDP2 reduce-scatter"), "model")
        ledger.phase(f"backward: reduce-scatter of {unit.name}", symbol="FSDP2 reduce-scatter")
        for key in ledger.keys(("unsharded gradient", unit.name)):
            ledger.release(key, "autograd")

    # the units' compute -------------------------------------------------------------------------------------
    def _eager_forward(self, unit: _Unit, x: torch.Tensor, x_key: Hashable) -> tuple[torch.Tensor, Hashable]:
        """Run an eager unit on meta and hold what autograd saves; returns its output and the output's key."""
        ledger = self.ledger
        self._gather(unit, forward=True)
        params = {p.untyped_storage()._cdata for p in unit.module.parameters()}
        saved: dict[int, torch.Tensor] = {}

        def pack(t):
            saved.setdefault(t.untyped_storage()._cdata, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = unit.module(x)
        kind = type(unit.module).__name__
        out_key = ("activation", unit.name)
        out_record = _tensor_record(f"output of {unit.name}", out, Category.TEMPORARY, f"{kind} (eager)")
        ledger.phase(f"forward: {unit.name}", extra=(out_record,), symbol=f"{kind} (eager)")
        ledger.hold(out_key, out_record, "caller")
        holder = f"saved by {unit.name}"
        for j, (storage, t) in enumerate(saved.items()):
            if storage == x.untyped_storage()._cdata:
                ledger.hold(x_key, ledger.live[x_key], holder)
            elif storage not in params and storage != out.untyped_storage()._cdata:
                ledger.hold((unit.name, "saved", j), _tensor_record(f"saved by {unit.name}", t, Category.SAVED,
                                                                     f"{kind} (eager)"), holder)
        self._forward_done(unit, x_key if x.is_floating_point() else None)
        return out, out_key

    def _block_forward(self, unit: _Unit, x_key: Hashable) -> Hashable:
        ledger, blocks = self.ledger, self.blocks
        self._gather(unit, forward=True)
        ledger.phase(f"forward: {unit.name}", blocks.forward, inside=[x_key])
        holder = f"saved by {unit.name}"
        outputs = blocks.forward.outputs
        output = outputs[blocks.output]
        out_key = (unit.name, output)
        ledger.hold(out_key, _renamed(blocks.forward.allocations[output], f"output of {unit.name}",
                                      Category.TEMPORARY), "caller")
        for name in blocks.saved:
            i = outputs[name]
            a = blocks.forward.allocations[i]
            if a.name == blocks.activation:
                ledger.hold(x_key, ledger.live[x_key], holder)
            elif not a.external:  # parameters and rope tables are held by FSDP2 and the model
                ledger.hold((unit.name, i), _renamed(a, a.name, a.category), holder)
        self._forward_done(unit, x_key)
        return out_key

    def _forward_done(self, unit: _Unit, x_key: Hashable | None) -> None:
        """After a unit's forward: the model's ``forward`` lets go of the unit's input (autograd keeps what it
        saved) and zero3 reshards the unit."""
        if x_key is not None:
            self.inputs[unit.name] = self.ledger.live[x_key]
            self.ledger.release(x_key, "caller")
        if self.zero3:
            self._reshard(unit)

    def _loss(self, logits_key: Hashable) -> None:
        ledger = self.ledger
        log_softmax, grad_nll, grad_logits = loss_allocations(ledger.live[logits_key])
        ledger.phase("loss", extra=(log_softmax, grad_nll, grad_logits), symbol=grad_logits.symbol)
        ledger.hold(("gradient of", "lm_head"), grad_logits, "autograd")

    def _block_backward(self, unit: _Unit) -> None:
        ledger, blocks = self.ledger, self.blocks
        saved = self._saved_keys(unit)
        incoming = ("gradient of", unit.name)
        ledger.phase(f"backward: {unit.name}", blocks.backward, inside=[*saved, incoming])
        self._backward_done(unit, saved)
        made = [a for a in blocks.backward.allocations if a.end is None and not a.external]
        shape = self.inputs[unit.name].shape
        self._hold_gradients(unit, [a for a in made if a.shape != shape], [a for a in made if a.shape == shape])

    def _eager_backward(self, unit: _Unit) -> None:
        """An eager unit's backward: a gradient for its float input and each parameter, made while the incoming
        gradient and what it saved are alive."""
        kind = f"{type(unit.module).__name__} backward"
        params = [_record(f"gradient of {unit.name}.{n}", p.numel() * p.element_size(), Category.GRADIENT,
                          tuple(p.shape), ops.dtype_name(p), kind)
                  for n, p in unit.module.named_parameters()]
        x = self.inputs.get(unit.name)
        inputs = [] if x is None else [_record(f"gradient of {unit.name}'s input", x.nbytes, Category.TEMPORARY,
                                               x.shape, x.dtype, kind)]
        self.ledger.phase(f"backward: {unit.name}", extra=(*params, *inputs), symbol=kind)
        self._backward_done(unit, self._saved_keys(unit))
        self._hold_gradients(unit, params, inputs)

    def _saved_keys(self, unit: _Unit) -> list[Hashable]:
        holder = f"saved by {unit.name}"
        return [k for k, h in self.ledger.holders.items() if holder in h]

    def _backward_done(self, unit: _Unit, saved: list[Hashable]) -> None:
        for key in saved:
            self.ledger.release(key, f"saved by {unit.name}")
        self.ledger.release(("gradient of", unit.name), "autograd")

    def _hold_gradients(self, unit: _Unit, params: list[Allocation], inputs: list[Allocation]) -> None:
        """The gradient of the unit's input goes to the unit before it; the parameters' wait for the
        reduce-scatter."""
        i = self.units.index(unit)
        if inputs and i > 0:
            before = self.units[i - 1].name
            self.ledger.hold(("gradient of", before), _renamed(inputs[0], f"gradient of {before}'s output",
                                                               Category.TEMPORARY), "autograd")
        for j, a in enumerate(params):
            self.ledger.hold(("unsharded gradient", unit.name, j), _renamed(a, a.name, Category.GRADIENT),
                             "autograd")

    # the result ---------------------------------------------------------------------------------------------
    def _result(self, forward_phases: int, saved_bytes: int) -> StepMemory:
        phases = self.ledger.phases
        peak = max(phases, key=lambda p: p.peak_bytes)
        forward = phases[:forward_phases]
        backward = phases[forward_phases + 1:]
        loss = phases[forward_phases]
        persistent = sum(a.nbytes for k, a in self.ledger.live.items() if k[0] in ("shard", "buffer", "input"))
        state = sum(a.nbytes for k, a in self.ledger.live.items() if k[0] == "adam")
        gradients = sum(a.nbytes for k, a in self.ledger.live.items() if k[0] == "gradient")
        return StepMemory(
            peak_bytes=peak.peak_bytes,
            peak_phase=peak.name,
            peak_index=peak.peak_index,
            peak_symbol=peak.peak_symbol,
            persistent_bytes=persistent,
            forward_peak_bytes=max(p.peak_bytes for p in forward),
            saved_bytes=saved_bytes,
            backward_peak_bytes=max(p.peak_bytes for p in backward),
            gradient_bytes=gradients,
            forward=self.blocks.forward,
            backward=self.blocks.backward,
            forward_outside_bytes=0,
            backward_outside_bytes=0,
            live_at_peak=tuple(sorted(peak.live_at_peak, key=lambda a: -a.nbytes)),
            loss_peak_bytes=loss.peak_bytes,
            optimizer_state_bytes=state,
            phases=tuple(phases),
        )


def _renamed(a: Allocation, name: str, category: Category) -> Allocation:
    return Allocation(name, a.nbytes, category, a.shape, a.dtype, a.symbol, a.source, -1, None, True)


def _shape_of(timeline: MemoryTimeline, name: str) -> tuple[int, ...]:
    return next(a.shape for a in timeline.allocations if a.name == name)
