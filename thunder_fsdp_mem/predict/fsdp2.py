"""One training step of a litgpt model under FSDP2 (``fully_shard``) through ThunderFX, per rank, composed from the
ThunderFX traces of its blocks and what FSDP2 holds outside them. Traced on the meta device: no GPU, no memory
for the model, no other ranks.

Entry points: ``compose_step(spec, *, world_size, shard, ...) -> StepMemory``; ``fit_budget(spec, config, ...)``,
the ``MemoryConfig.saved_budget`` each block's transform needs for the step to fit a per-rank budget.

The set-up is ``benchmarks/compare.py``'s (``modes._fsdp2``): ``fully_shard`` on each Block, ``lm_head``, ``wte``,
``ln_f`` and then the root, bf16 parameters, ``reshard_after_forward`` for zero3 only; the whole model under
``torch.compile(backend=ThunderCompiler(...))``; the loss is eager cross-entropy on the logits.

How such a step runs, and how it is composed here:

- Dynamo does not trace FSDP2's hooks, so it breaks the graph at every unit: each Block's forward is one ThunderFX
  graph, compiled once and run for every block (``thunderfx.trace_blocks`` traces and analyses it); ``wte``,
  ``ln_f`` and ``lm_head`` are ``torch.nn`` modules and run eagerly. The eager units run on the meta device under
  ``saved_tensors_hooks``, which shows what autograd saves; their backward allocates a gradient for each input and
  parameter.
- FSDP2's holdings follow its code in torch 2.11 (``_fully_shard/_fsdp_param_group.py``, ``_fsdp_collectives.py``):
  - every parameter's shard is its first dimension padded to a multiple of the world size, divided by it; AdamW
    keeps two moments of the shard's size;
  - before a unit's forward, its shards are all-gathered into one buffer of world size x shard bytes and copied
    out into the unsharded parameters; the buffer is freed when the next unit's copy-out is done (the last one
    after the root's forward): ``wait_for_unshard`` drops it before the copy-out, but its local
    ``prev_all_gather_state`` holds it until the function returns. zero3 frees the unsharded parameters after each
    unit's forward and gathers them again before its backward (buffer freed at once), prefetching the unit that
    runs next in the backward; zero2 keeps them until the unit's backward is done;
  - after a unit's backward, its unsharded gradients are copied into a reduce-scatter input (world size x shard
    bytes); the reduce-scatter's output, the sharded gradient, is allocated and kept, and only then are the
    unsharded gradients freed (``foreach_reduce`` clears its list, but the parameters' ``grad`` still hold them);
    the input is freed when the next unit's reduce-scatter starts (the last at the end of the backward).
- The caller holds the logits until ``backward`` returns; the loss is ``step.loss_allocations``.

What each unit, FSDP2, autograd and the caller hold is kept in ``step.Holdings``, the same ledger ``estimate_step``
composes its step with, and the step is ``step.step_memory`` of its phases.

Limitations: litgpt's plain ``GPT.forward`` only (embedding, blocks, final norm, head); configurations with
``final_logit_softcapping`` or ``rope_indices`` are refused, and ``scale_embeddings``' product is not counted.
Parameters are bf16 or fp32 as given, with no mixed-precision casts. The optimizer's own step and allocator
rounding are not modelled, as in ``estimate_step``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

import torch
from litgpt import GPT
from litgpt.model import Block

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.liveness import OUTSIDE, Allocation
from thunder_fsdp_mem.analysis.step import (
    Holder,
    Holdings,
    Key,
    Role,
    Stage,
    StepMemory,
    adam_state,
    adam_step_allocation,
    held_allocation,
    loss_allocations,
    step_memory,
)
from thunder_fsdp_mem.analysis.symbols import dtype_name
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.predict.meta import as_on
from thunder_fsdp_mem.predict.thunderfx import BlockTraces, trace_blocks
from thunder_fsdp_mem.analysis.allocator import over_cap
from thunder_fsdp_mem.training import models, runtime
from thunder_fsdp_mem.transform import FSDPMemoryTransform

UNSUPPORTED = ("final_logit_softcapping", "rope_indices")


def compose_step(
    spec: models.ModelSpec,
    *,
    world_size: int,
    shard: str,
    device_type: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    micro_batch_size: int = 1,
    executors="default+cat",
    transform: FSDPMemoryTransform | None = None,
) -> StepMemory:
    """The estimated memory per rank of one step of ``spec`` under FSDP2 and ThunderFX on ``world_size`` ranks of
    ``device_type``; ``shard`` zero2 or zero3; ``executors``: ``runtime.executors``' choice, or Thunder's
    executors as a list; ``transform``: the ``FSDPMemoryTransform`` to compile the blocks with (None: without it)."""
    if shard not in runtime.SHARDS:
        raise ValueError(f"shard must be one of {', '.join(runtime.SHARDS)}; got {shard!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    config = spec.config()
    refused = unsupported(config)
    if refused:
        raise NotImplementedError(f"{spec.name}: the fsdp2 composition does not model {', '.join(refused)}")
    chosen = runtime.executors(executors) if isinstance(executors, str) else list(executors)
    with as_on(device_type, chosen):
        torch.manual_seed(0)
        with torch.device("meta"):
            gpt = GPT(config)
        gpt = gpt.to(dtype)
        idx, targets = models.batch(spec, micro_batch_size=micro_batch_size, device="meta")
        blocks = trace_blocks(gpt, idx, chosen, transform, device_type)
        return _Composer(gpt, world_size, shard == "zero3", blocks, idx, targets, device_type).run()


def fit_budget(
    spec: models.ModelSpec, config: MemoryConfig, *, world_size: int, shard: str, rounds: int = 3, **options
) -> tuple[StepMemory, MemoryConfig, FSDPMemoryTransform]:
    """``config.memory_budget``, a per-rank budget for the whole step, turned into what each block may save: FSDP2
    compiles every block alone, so its transform cannot see the step. The step's peak is where every block's saved
    tensors are alive (the loss, the first blocks' backward), so each block saves its share of the excess less
    (``MemoryConfig.saved_budget``), for up to ``rounds`` rounds while the composed step is over the budget (or,
    with ``config.memory_cap``, misses the cap in the caching allocator's replay: ``reserved.over_cap``). Returns
    the step, the config its blocks ran with (no step budget, no cap: a saved budget), and their transform (whose
    ``rewrites`` say what it did). ``options``: ``compose_step``'s."""
    budget, cap = config.memory_budget, config.memory_cap
    config = dataclasses.replace(config, memory_budget=None, memory_cap=None)
    blocks = spec.config().n_layer
    transform = FSDPMemoryTransform(config)
    step = compose_step(spec, world_size=world_size, shard=shard, transform=transform, **options)
    for _ in range(rounds):
        excess = step.peak_bytes - budget
        if cap is not None and excess <= 0:
            excess = over_cap(step, cap)
        saved = _block_saved(step)
        target = max(0, saved - -(-excess // blocks))
        if excess <= 0 or saved == 0 or target == config.saved_budget:
            break
        config = dataclasses.replace(config, saved_budget=target)
        transform = FSDPMemoryTransform(config)
        step = compose_step(spec, world_size=world_size, shard=shard, transform=transform, **options)
    return step, config, transform


def _block_saved(step: StepMemory) -> int:
    """What one block's forward saves for backward beyond its inputs (``step.forward`` is the block's)."""
    f = step.forward
    return sum(
        f.allocations[i].nbytes
        for i in set(f.outputs.values())
        if f.allocations[i].category is Category.SAVED and not f.allocations[i].external
    )


def unsupported(config) -> list[str]:
    """The fields of a litgpt ``Config`` that the composition does not model and that ``config`` sets."""
    return [name for name in UNSUPPORTED if getattr(config, name, None) is not None]


@dataclass(frozen=True, slots=True)
class _Shard:
    """One parameter's shard on the rank with the most rows: its first dimension padded to a multiple of the
    world size and divided by it."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Unit:
    """One ``fully_shard`` unit: its name in the step's phases, its module's qualified name in the model
    (``path``), its parameters' shards by name, and the sizes FSDP2 gathers and scatters."""

    name: str
    path: str
    module: torch.nn.Module
    shards: dict[str, _Shard] = field(hash=False)
    world_size: int

    @property
    def shard_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    @property
    def gathered_bytes(self) -> int:
        return self.shard_bytes * self.world_size

    @property
    def is_block(self) -> bool:
        return isinstance(self.module, Block)


def _unit(name: str, path: str, module: torch.nn.Module, world_size: int) -> _Unit:
    shards = {}
    for qualname, p in module.named_parameters():
        shape = tuple(p.shape) or (1,)
        rows = math.ceil(shape[0] / world_size)
        shards[qualname] = _Shard((rows, *shape[1:]), dtype_name(p), rows * math.prod(shape[1:]) * p.element_size())
    return _Unit(name, path, module, shards, world_size)


class _Held(Enum):
    """What the ledger holds."""

    SHARD = "parameter shard"
    BUFFER = "buffer"
    INPUT = "input"
    ADAM = "AdamW moment"
    GATHERED = "gathered parameter"
    ALL_GATHER = "all-gather buffer"
    REDUCE_SCATTER = "reduce-scatter input"
    GRADIENT = "gradient shard"
    UNSHARDED_GRADIENT = "unsharded gradient"
    ACTIVATION = "a unit's output"
    SAVED = "saved for backward"
    INCOMING_GRADIENT = "the gradient of a unit's output"


_MODEL, _CALLER, _FSDP2, _AUTOGRAD = (
    Holder(Role.MODEL),
    Holder(Role.CALLER),
    Holder(Role.COMMUNICATION),
    Holder(Role.AUTOGRAD),
)


def _record(name: str, nbytes: int, category: Category, shape=(), dtype: str = "", symbol: str = "FSDP2") -> Allocation:
    return held_allocation(name, nbytes, category, shape=shape, dtype=dtype, symbol=symbol)


def _tensor_record(name: str, t: torch.Tensor, category: Category, symbol: str) -> Allocation:
    return _record(name, t.numel() * t.element_size(), category, tuple(t.shape), dtype_name(t), symbol)


class _Composer:
    """Walks one step in the order it runs, keeping the ledger of what FSDP2, the model and autograd hold."""

    def __init__(self, gpt, world_size: int, zero3: bool, blocks: BlockTraces, idx, targets, device_type: str):
        self.gpt, self.zero3, self.blocks, self.device_type = gpt, zero3, blocks, device_type
        t = gpt.transformer
        self.units = [
            _unit("wte", "transformer.wte", t.wte, world_size),
            *[_unit(f"block {i}", f"transformer.h.{i}", b, world_size) for i, b in enumerate(t.h)],
            _unit("ln_f", "transformer.ln_f", t.ln_f, world_size),
            _unit("lm_head", "lm_head", gpt.lm_head, world_size),
        ]
        self.idx, self.targets = idx, targets
        self.ledger = Holdings()
        self.prefetched: set[str] = set()
        self.inputs: dict[str, Allocation] = {}  # unit -> its float input (what its backward returns a gradient for)
        self.flat: str | None = None  # the unit whose all-gather buffer the forward still holds
        self.scattering: str | None = None  # the unit whose reduce-scatter input is still held

    # the step -------------------------------------------------------------------------------------------------
    def run(self) -> StepMemory:
        self._persistent()
        wte, *blocks, ln_f, lm_head = self.units
        x, key = self._eager_forward(wte, self.idx, Key(_Held.INPUT, item="token ids"))
        for unit in blocks:
            key = self._block_forward(unit, key)
        x, key = self._eager_forward(ln_f, torch.empty_like(x), key)
        _, key = self._eager_forward(lm_head, x, key)
        if self.flat is not None:  # the root's post-forward frees the last all-gather buffer
            self.ledger.release(Key(_Held.ALL_GATHER, self.flat), _FSDP2)
            self.flat = None
        saved_bytes = sum(self.ledger[k].nbytes for k in self.ledger.held_by(Role.SAVED) if k.kind is not _Held.INPUT)
        self._loss(key)
        order = list(reversed(self.units))
        for i, unit in enumerate(order):
            following = order[i + 1] if i + 1 < len(order) else None
            self._pre_backward(unit, following)
            if unit.is_block:
                self._block_backward(unit)
            else:
                self._eager_backward(unit)
            self._post_backward(unit)
        if self.scattering is not None:
            self.ledger.release(Key(_Held.REDUCE_SCATTER, self.scattering), _FSDP2)
        self._optimizer_step()
        ledger = self.ledger
        return step_memory(
            ledger.phases,
            forward=self.blocks.forward,
            backward=self.blocks.backward,
            persistent_bytes=ledger.bytes(_Held.SHARD, _Held.BUFFER, _Held.INPUT),
            saved_bytes=saved_bytes,
            gradient_bytes=ledger.bytes(_Held.GRADIENT),
            optimizer_state_bytes=ledger.bytes(_Held.ADAM),
        )

    def _optimizer_step(self) -> None:
        """AdamW's step over the shards, in the model's order of parameters, as torch runs it on the device
        (``step.adam_step_bytes``); the caller still holds the logits."""
        kind = "foreach" if self.device_type == "cuda" else "single tensor"
        shards = {f"{unit.path}.{name}": shard for unit in self.units for name, shard in unit.shards.items()}
        sizes = [(shards[q].nbytes, shards[q].dtype) for q, _ in self.gpt.named_parameters() if q in shards]
        temporaries = adam_step_allocation("AdamW", sizes, kind)
        self.ledger.phase(Stage.OPTIMIZER, Stage.OPTIMIZER.value, extra=(temporaries,), symbol=temporaries.symbol)

    def _persistent(self) -> None:
        ledger = self.ledger
        for unit in self.units:
            for pname, shard in unit.shards.items():
                ledger.hold(
                    Key(_Held.SHARD, unit.name, pname),
                    _record(f"{unit.path}.{pname} (shard)", shard.nbytes, Category.PARAMETER, shard.shape, shard.dtype),
                    _MODEL,
                )
                for j, state in enumerate(
                    adam_state(
                        "AdamW",
                        f"{unit.path}.{pname}",
                        shard.nbytes,
                        shard.shape,
                        shard.dtype,
                        device_type=self.device_type,
                    )
                ):
                    ledger.hold(Key(_Held.ADAM, unit.name, (pname, j)), state, Holder(Role.OPTIMIZER))
        for name, buf in self.gpt.named_buffers():
            ledger.hold(Key(_Held.BUFFER, item=name), _tensor_record(name, buf, Category.PARAMETER, "buffer"), _MODEL)
        for name, t in (("token ids", self.idx), ("targets", self.targets)):
            ledger.hold(Key(_Held.INPUT, item=name), _tensor_record(name, t, Category.INPUT, "input"), _CALLER)

    # FSDP2 --------------------------------------------------------------------------------------------------
    def _all_gather_buffer(self, unit: _Unit) -> Allocation:
        return _record(
            f"all-gather buffer of {unit.name}", unit.gathered_bytes, Category.COMM_BUFFER, symbol="FSDP2 all-gather"
        )

    def _gather(self, unit: _Unit, *, forward: bool) -> None:
        """Unshard ``unit``: its all-gather buffer, then the copy-out into its unsharded parameters."""
        ledger = self.ledger
        if not unit.shards or ledger.keys(_Held.GATHERED, unit.name):
            return
        if unit.name not in self.prefetched:
            ledger.hold(Key(_Held.ALL_GATHER, unit.name), self._all_gather_buffer(unit), _FSDP2)
        self.prefetched.discard(unit.name)
        for pname, shard in unit.shards.items():
            ledger.hold(
                Key(_Held.GATHERED, unit.name, pname),
                _record(
                    f"{unit.path}.{pname} (gathered)",
                    shard.nbytes * unit.world_size,
                    Category.GATHERED_PARAMETER,
                    (shard.shape[0] * unit.world_size, *shard.shape[1:]),
                    shard.dtype,
                    "FSDP2 all-gather",
                ),
                _FSDP2,
            )
        stage = Stage.FORWARD if forward else Stage.BACKWARD
        ledger.phase(stage, f"{stage.value}: copy-out of {unit.name}", symbol="FSDP2 copy-out")
        if forward:
            if self.flat is not None:  # the previous unit's buffer, freed once this copy-out is done
                ledger.release(Key(_Held.ALL_GATHER, self.flat), _FSDP2)
            self.flat = unit.name
        else:
            ledger.release(Key(_Held.ALL_GATHER, unit.name), _FSDP2)

    def _reshard(self, unit: _Unit) -> None:
        for key in self.ledger.keys(_Held.GATHERED, unit.name):
            self.ledger.release(key, _FSDP2)

    def _pre_backward(self, unit: _Unit, following: _Unit | None) -> None:
        if not self.zero3:
            return
        self._gather(unit, forward=False)
        if following is not None and following.shards:
            self.ledger.hold(Key(_Held.ALL_GATHER, following.name), self._all_gather_buffer(following), _FSDP2)
            self.prefetched.add(following.name)

    def _post_backward(self, unit: _Unit) -> None:
        ledger = self.ledger
        self._reshard(unit)
        if not unit.shards:
            return
        if self.scattering is not None:
            ledger.release(Key(_Held.REDUCE_SCATTER, self.scattering), _FSDP2)
        ledger.hold(
            Key(_Held.REDUCE_SCATTER, unit.name),
            _record(
                f"reduce-scatter input of {unit.name}",
                unit.gathered_bytes,
                Category.COMM_BUFFER,
                symbol="FSDP2 reduce-scatter",
            ),
            _FSDP2,
        )
        self.scattering = unit.name
        ledger.hold(
            Key(_Held.GRADIENT, unit.name),
            _record(
                f"gradients of {unit.name} (shard)", unit.shard_bytes, Category.GRADIENT, symbol="FSDP2 reduce-scatter"
            ),
            _MODEL,
        )
        ledger.phase(Stage.BACKWARD, f"backward: reduce-scatter of {unit.name}", symbol="FSDP2 reduce-scatter")
        for key in ledger.keys(_Held.UNSHARDED_GRADIENT, unit.name):
            ledger.release(key, _AUTOGRAD)

    # the units' compute -------------------------------------------------------------------------------------
    def _eager_forward(self, unit: _Unit, x: torch.Tensor, x_key: Key) -> tuple[torch.Tensor, Key]:
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
        out_key = Key(_Held.ACTIVATION, unit.name)
        out_record = _tensor_record(f"output of {unit.name}", out, Category.TEMPORARY, f"{kind} (eager)")
        ledger.phase(Stage.FORWARD, f"forward: {unit.name}", extra=(out_record,), symbol=f"{kind} (eager)")
        ledger.hold(out_key, out_record, _CALLER)
        holder = Holder(Role.SAVED, unit.name)
        for j, (storage, t) in enumerate(saved.items()):
            if storage == x.untyped_storage()._cdata:
                ledger.hold(x_key, ledger[x_key], holder)
            elif storage not in params and storage != out.untyped_storage()._cdata:
                ledger.hold(
                    Key(_Held.SAVED, unit.name, j),
                    _tensor_record(f"saved by {unit.name}", t, Category.SAVED, f"{kind} (eager)"),
                    holder,
                )
        self._forward_done(unit, x_key if x.is_floating_point() else None)
        return out, out_key

    def _block_forward(self, unit: _Unit, x_key: Key) -> Key:
        ledger, blocks = self.ledger, self.blocks
        self._gather(unit, forward=True)
        ledger.phase(Stage.FORWARD, f"forward: {unit.name}", blocks.forward, inside=[x_key])
        holder = Holder(Role.SAVED, unit.name)
        outputs = blocks.forward.outputs
        output = outputs[blocks.output]
        out_key = Key(_Held.ACTIVATION, unit.name, output)
        ledger.hold(
            out_key,
            _renamed(blocks.forward.allocations[output], f"output of {unit.name}", Category.TEMPORARY, unit.path),
            _CALLER,
        )
        for name in blocks.saved:
            i = outputs[name]
            a = blocks.forward.allocations[i]
            if a.name == blocks.activation:
                ledger.hold(x_key, ledger[x_key], holder)
            elif not a.external:  # parameters and rope tables are held by FSDP2 and the model
                ledger.hold(Key(_Held.SAVED, unit.name, i), _renamed(a, a.name, a.category, unit.path), holder)
        self._forward_done(unit, x_key)
        return out_key

    def _forward_done(self, unit: _Unit, x_key: Key | None) -> None:
        """After a unit's forward: the model's ``forward`` lets go of the unit's input (autograd keeps what it
        saved) and zero3 reshards the unit."""
        if x_key is not None:
            self.inputs[unit.name] = self.ledger[x_key]
            self.ledger.release(x_key, _CALLER)
        if self.zero3:
            self._reshard(unit)

    def _loss(self, logits_key: Key) -> None:
        ledger = self.ledger
        log_softmax, grad_nll, grad_logits = loss_allocations(ledger[logits_key])
        ledger.phase(Stage.LOSS, "loss", extra=(log_softmax, grad_nll, grad_logits), symbol=grad_logits.symbol)
        ledger.hold(Key(_Held.INCOMING_GRADIENT, "lm_head"), grad_logits, _AUTOGRAD)

    def _block_backward(self, unit: _Unit) -> None:
        ledger, blocks = self.ledger, self.blocks
        saved = ledger.held_by(Role.SAVED, unit.name)
        incoming = Key(_Held.INCOMING_GRADIENT, unit.name)
        ledger.phase(Stage.BACKWARD, f"backward: {unit.name}", blocks.backward, inside=[*saved, incoming])
        self._backward_done(unit, saved)
        made = [a for a in blocks.backward.allocations if a.end is None and not a.external]
        shape = self.inputs[unit.name].shape
        self._hold_gradients(unit, [a for a in made if a.shape != shape], [a for a in made if a.shape == shape])

    def _eager_backward(self, unit: _Unit) -> None:
        """An eager unit's backward: a gradient for its float input and each parameter, made while the incoming
        gradient and what it saved are alive."""
        kind = f"{type(unit.module).__name__} backward"
        params = [
            _record(
                f"gradient of {unit.name}.{n}",
                p.numel() * p.element_size(),
                Category.GRADIENT,
                tuple(p.shape),
                dtype_name(p),
                kind,
            )
            for n, p in unit.module.named_parameters()
        ]
        x = self.inputs.get(unit.name)
        inputs = (
            []
            if x is None
            else [_record(f"gradient of {unit.name}'s input", x.nbytes, Category.TEMPORARY, x.shape, x.dtype, kind)]
        )
        self.ledger.phase(Stage.BACKWARD, f"backward: {unit.name}", extra=(*params, *inputs), symbol=kind)
        self._backward_done(unit, self.ledger.held_by(Role.SAVED, unit.name))
        self._hold_gradients(unit, params, inputs)

    def _backward_done(self, unit: _Unit, saved: list[Key]) -> None:
        for key in saved:
            self.ledger.release(key, Holder(Role.SAVED, unit.name))
        self.ledger.release(Key(_Held.INCOMING_GRADIENT, unit.name), _AUTOGRAD)

    def _hold_gradients(self, unit: _Unit, params: list[Allocation], inputs: list[Allocation]) -> None:
        """The gradient of the unit's input goes to the unit before it; the parameters' wait for the
        reduce-scatter."""
        i = self.units.index(unit)
        if inputs and i > 0:
            before = self.units[i - 1].name
            self.ledger.hold(
                Key(_Held.INCOMING_GRADIENT, before),
                _renamed(inputs[0], f"gradient of {before}'s output", Category.TEMPORARY),
                _AUTOGRAD,
            )
        for j, a in enumerate(params):
            self.ledger.hold(
                Key(_Held.UNSHARDED_GRADIENT, unit.name, j), _renamed(a, a.name, Category.GRADIENT), _AUTOGRAD
            )


def _renamed(a: Allocation, name: str, category: Category, path: str | None = None) -> Allocation:
    """A trace's allocation as the ledger holds it once its trace is done: outside the traces, never freed by one;
    its module placed in the model (``path``: the unit's, for the block graph's module names)."""

    def placed(module: str | None) -> str | None:
        return f"{path}.{module}" if path is not None and module is not None else module

    return dataclasses.replace(
        a,
        name=name,
        category=category,
        start=OUTSIDE,
        end=None,
        external=True,
        module=placed(a.module),
        after=placed(a.after),
    )
