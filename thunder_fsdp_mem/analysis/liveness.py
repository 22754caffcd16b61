"""Storage liveness of a Thunder execution trace: live bytes after every bound symbol, the peak, and what is
alive at the peak.

Entry point: ``analyze(trace, inputs=None) -> MemoryTimeline``.

The model follows Python's reference counting, because that is what frees a tensor when a trace runs: names,
collections (the lists a backward receives) and tensors are objects with reference counts; a tensor holds its
storage; views and aliases are new tensors on the same storage (see ``effects.classify``); ``del`` drops a name,
``clear_mutable_collection`` drops a list's references, and a storage is freed when nothing refers to it.
Tensors held outside the trace (module parameters, the caller's inputs) are never freed by it; what the trace
returns stays alive. On CUDA a reduce-scatter's input stays alive until the wait of its future (NCCL holds it
while the collective runs; gloo on CPU does not). The memory inside an op is its inputs, its outputs and its
workspace, all at once.

Cost model: bytes are ``numel * itemsize`` of the allocation, with no allocator rounding (what ``MemTracker``
counts on CPU, and ``max_memory_allocated`` up to 512-byte rounding on CUDA). One pass over the bound symbols,
O(1) work per proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from thunder.core.proxies import CollectionProxy, FutureTensorProxy, TensorProxy
from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis import layout
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.effects import Effect, Kind, classify
from thunder_fsdp_mem.analysis.symbols import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAITS,
    dtype_name,
    nbytes,
    parameter_path,
    proxy_names,
    shape,
    sym_id,
    tensor_args,
)

log = logging.getLogger(__name__)

_reported_unknown: set[str] = set()


@dataclass(frozen=True, slots=True)
class InputSpec:
    """How a trace input's storage is held, for traces whose inputs come from elsewhere (a backward's saved
    tensors come from its forward).

    ``storage``: inputs with equal keys share one allocation. ``external``: held outside the trace (a module
    parameter, the caller's input), so the trace never frees it. ``nbytes``: the allocation's size when it is
    larger than this tensor (a view of a bigger storage); None means the tensor's own size.
    """

    storage: Hashable
    category: Category
    external: bool
    nbytes: int | None = None


OUTSIDE = -1  # the ``start`` of an allocation held outside the traces (parameters, optimizer state, FSDP2's buffers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """One storage: who made it, how big, and the bound-symbol indices where it was allocated and freed.

    ``start``: the index of the symbol that allocated it (0 for the trace's inputs, which the caller passes);
    ``OUTSIDE`` for an allocation held outside the traces. ``end``: the index where it was freed, None when it
    outlives the trace. ``external``: held by someone other than the trace, which never frees it. ``module``:
    the model's module whose parameters its symbol reads (a gathered parameter's own name); ``after``: where it
    reads none, the module whose output its input comes from, the nearest before it; None where the trace does not
    tell."""

    name: str
    nbytes: int
    category: Category
    shape: tuple[int, ...] = ()
    dtype: str = ""
    symbol: str = ""
    source: str | None = None
    start: int = OUTSIDE
    end: int | None = None
    external: bool = False
    module: str | None = None
    after: str | None = None

    @property
    def label(self) -> str:
        """What a reader can place: the module and its op (``transformer.h.3.mlp.fc: linear``), an op after a
        module (``to after transformer.h.3.mlp.fc``), a gathered parameter by its name, else the allocation's own
        name."""
        if self.module is not None:
            if self.category is Category.GATHERED_PARAMETER:
                return f"{self.module} (gathered)"
            return f"{self.module}: {self.symbol}"
        return f"{self.symbol} after {self.after}" if self.after is not None else self.name

    def live_at(self, index: int) -> bool:
        return self.start <= index and (self.end is None or index < self.end)


@dataclass(frozen=True, slots=True)
class OpMemory:
    """What one bound symbol does to memory: the allocations it ``made`` and those ``freed`` at it (indices into
    ``MemoryTimeline.allocations``), whether they were freed while it ran (``freed_first``: before its peak, as a
    wait releases the input it held) or after it (a ``del``), and its ``workspace`` bytes at its peak."""

    made: tuple[int, ...]
    freed: tuple[int, ...]
    freed_first: bool
    workspace: int


@dataclass(frozen=True, slots=True)
class MemoryTimeline:
    """Result of ``analyze``. Indices are positions in ``trace.bound_symbols``.

    ``timeline[i]``: live bytes after bound symbol i (frees of a ``del`` at i included); the trace's inputs count
    from the start, wherever the trace unpacks them.
    ``op_peaks[i]``: live bytes while bound symbol i runs: what was live, its outputs and its workspace.
    ``peak_bytes`` is ``max(op_peaks)``; ``live_at_peak`` lists the allocations alive then, its workspace
    included, so their sizes add up to ``peak_bytes``.
    ``outputs`` maps each name the trace returns to its index in ``allocations``.
    """

    peak_bytes: int
    peak_index: int
    peak_symbol: str
    timeline: tuple[int, ...]
    op_peaks: tuple[int, ...]
    live_at_peak: tuple[Allocation, ...]
    allocations: tuple[Allocation, ...]
    outputs: Mapping[str, int]
    symbols: tuple[str, ...]
    unknown_symbols: tuple[str, ...] = ()

    @property
    def final_bytes(self) -> int:
        return self.timeline[-1] if self.timeline else 0

    def live_at(self, index: int) -> tuple[Allocation, ...]:
        return tuple(a for a in self.allocations if a.live_at(index))

    def ops(self) -> tuple[OpMemory, ...]:
        """What each bound symbol does to memory, in order (the trace's inputs are alive before the first)."""
        made: dict[int, list[int]] = {}
        freed: dict[int, list[int]] = {}
        live = 0
        for j, a in enumerate(self.allocations):
            if a.symbol == "input":
                live += a.nbytes
            else:
                made.setdefault(a.start, []).append(j)
            if a.end is not None:
                freed.setdefault(a.end, []).append(j)
        out = []
        for i, peak in enumerate(self.op_peaks):
            made_i, freed_i = tuple(made.get(i, ())), tuple(freed.get(i, ()))
            new = sum(self.allocations[j].nbytes for j in made_i)
            gone = sum(self.allocations[j].nbytes for j in freed_i)
            first = live + new > peak  # released while the symbol ran (a wait's held input), not after it
            out.append(OpMemory(made_i, freed_i, first, max(0, peak - (live + new - (gone if first else 0)))))
            live += new - gone
        return tuple(out)

    def bytes_by_category(self, allocations: tuple[Allocation, ...] | None = None) -> dict[Category, int]:
        out: dict[Category, int] = {}
        for a in self.live_at_peak if allocations is None else allocations:
            out[a.category] = out.get(a.category, 0) + a.nbytes
        return out


def analyze(
    trace: TraceCtx,
    *,
    inputs: Mapping[str, InputSpec] | None = None,
    device_type: str | None = None,
    parameter_names: Mapping[str, str] | None = None,
) -> MemoryTimeline:
    """Live storage bytes over ``trace`` (a Thunder execution trace, forward or backward).

    Without ``inputs``, tensors passed directly as arguments are held by the caller (names starting with
    ``t_`` are taken for module parameters, others for inputs), and tensors passed inside lists (a backward's
    ``saved_for_backward`` and ``cotangents``) belong to the trace, which frees them as it clears the lists.
    ``device_type``: the device the trace would run on, for a trace made on the meta device (None: each
    tensor's own). ``parameter_names``: trace argument name -> the parameter's qualified name, where the module is
    known, to tell which module made each allocation (``Allocation.module``; ThunderFX's names tell it alone).
    """
    if not isinstance(trace, TraceCtx):
        raise TypeError(
            f"analyze() expects a Thunder execution trace (thunder.core.trace.TraceCtx), such as "
            f"thunder.last_traces(fn)[-1]; got {type(trace).__name__}"
        )
    return _Walk(trace, dict(inputs or {}), device_type, parameter_names).run()


@dataclass(slots=True)
class _Record:
    """An allocation while the walk runs: its category and end change as the trace goes on."""

    name: str
    nbytes: int
    category: Category
    shape: tuple[int, ...]
    dtype: str
    symbol: str
    source: str | None
    start: int
    end: int | None = None
    external: bool = False
    module: str | None = None
    after: str | None = None

    def frozen(self) -> Allocation:
        return Allocation(
            name=self.name,
            nbytes=self.nbytes,
            category=self.category,
            shape=self.shape,
            dtype=self.dtype,
            symbol=self.symbol,
            source=self.source,
            start=self.start,
            end=self.end,
            external=self.external,
            module=self.module,
            after=self.after,
        )


class _Walk:
    """One pass over a trace, holding the reference counts of names, collections and storages."""

    def __init__(
        self,
        trace: TraceCtx,
        inputs: dict[str, InputSpec],
        device_type: str | None = None,
        parameter_names: Mapping[str, str] | None = None,
    ):
        self.trace = trace
        self.inputs = inputs
        self.device_type = device_type
        self.parameter_names = parameter_names
        self.module_of: dict[str, str] = {}  # tensor -> the module that made it
        self.parameters: dict[str, str] = {}  # parameter tensor -> its qualified name
        self.obj_of: dict[str, int] = {}
        self.obj_refs: list[int] = []
        self.obj_alloc: list[int | None] = []
        self.obj_members: list[list[int] | None] = []
        self.allocs: list[_Record] = []
        self.alloc_refs: list[int] = []
        self.alloc_by_key: dict[Hashable, int] = {}
        self.strides: dict[str, layout.Strides] = {}
        self.live = 0
        self.index = 0
        self.unknown: list[str] = []
        self.held: dict[str, int] = {}  # a reduce-scatter's future -> the input it holds until its wait
        self.returned: dict[str, int] = {}
        self.forward_saved: list[str] = []
        self.forward_output: list[str] = []

    # objects -----------------------------------------------------------------------------------------------
    def _new_obj(self, name: str | None, alloc: int | None, members: list[int] | None) -> int:
        obj = len(self.obj_refs)
        self.obj_refs.append(0)
        self.obj_alloc.append(alloc)
        self.obj_members.append(members)
        if alloc is not None:
            self.alloc_refs[alloc] += 1
        if name is not None:
            self.obj_of[name] = obj
        return obj

    def _incref(self, obj: int) -> None:
        self.obj_refs[obj] += 1

    def _decref(self, obj: int) -> None:
        self.obj_refs[obj] -= 1
        if self.obj_refs[obj] > 0:
            return
        alloc = self.obj_alloc[obj]
        if alloc is not None:
            self._release(alloc)
        self._clear(obj)

    def _clear(self, obj: int) -> None:
        """A collection drops its references to its members."""
        members = self.obj_members[obj]
        if members:
            self.obj_members[obj] = []
            for m in members:
                self._decref(m)

    def _release(self, alloc: int) -> None:
        self.alloc_refs[alloc] -= 1
        if self.alloc_refs[alloc] == 0:
            record = self.allocs[alloc]
            self.live -= record.nbytes
            record.end = self.index

    def _allocate(
        self, t, category: Category, symbol: str, source: str | None, *, size: int | None = None, external: bool = False
    ) -> int:
        size = nbytes(t) if size is None else size
        alloc = len(self.allocs)
        self.allocs.append(
            _Record(t.name, size, category, shape(t), dtype_name(t), symbol, source, self.index, external=external)
        )
        self.alloc_refs.append(1 if external else 0)
        self.live += size
        return alloc

    # inputs ------------------------------------------------------------------------------------------------
    def _input_tensor(self, t, *, in_collection: bool, root: str) -> int:
        path = parameter_path(t.name, self.parameter_names)
        if path is not None:
            self.parameters[t.name] = path
        spec = self.inputs.get(t.name) or _default_spec(t.name, in_collection, root)
        alloc = self.alloc_by_key.get(spec.storage)
        if alloc is None:
            alloc = self._allocate(t, spec.category, "input", None, size=spec.nbytes, external=spec.external)
            self.alloc_by_key[spec.storage] = alloc
        self.strides[t.name] = layout.contiguous_strides(shape(t))
        return self._new_obj(t.name, alloc, None)

    def _input_collection(self, items, name: str | None, root: str) -> int:
        members = []
        for item in items:
            if isinstance(item, (TensorProxy, FutureTensorProxy)):
                obj = self.obj_of.get(item.name)
                if obj is None:
                    obj = self._input_tensor(item, in_collection=True, root=root)
            elif isinstance(item, CollectionProxy):
                obj = self._input_collection(item.coll, item.name, root)
            elif isinstance(item, (list, tuple)):
                obj = self._input_collection(item, None, root)
            else:
                continue
            self._incref(obj)
            members.append(obj)
        return self._new_obj(name, None, members)

    def _unpack(self, bsym) -> None:
        if bsym.sym.name == "unpack_sequence" and bsym.args and isinstance(bsym.args[0], CollectionProxy):
            parent = self.obj_of.get(bsym.args[0].name)
            members = self.obj_members[parent] if parent is not None else None
            for i, out in enumerate(bsym.flat_proxy_outs):
                if members is not None and i < len(members):
                    self.obj_of.setdefault(out.name, members[i])
                self._bind(out, root=bsym.args[0].name)
            return
        for out in bsym.flat_proxy_outs:
            self._bind(out, root=out.name)

    def _bind(self, proxy, *, root: str) -> None:
        obj = self.obj_of.get(proxy.name)
        if obj is None:
            if isinstance(proxy, (TensorProxy, FutureTensorProxy)):
                obj = self._input_tensor(proxy, in_collection=False, root=root)
            elif isinstance(proxy, CollectionProxy):
                obj = self._input_collection(proxy.coll, proxy.name, root)
            else:
                return
        self._incref(obj)

    # the walk ----------------------------------------------------------------------------------------------
    def run(self) -> MemoryTimeline:
        bsyms = self.trace.bound_symbols
        after = [0] * len(bsyms)
        inside = [0] * len(bsyms)
        workspaces: dict[int, int] = {}
        symbols = []
        for i, bsym in enumerate(bsyms):
            self.index = i
            symbols.append(bsym.sym.name)
            effect = classify(bsym, self._strides_of)
            if effect.kind is Kind.COMPUTE:
                self._compute(bsym, effect)
                if effect.workspace:
                    workspaces[i] = effect.workspace
                inside[i] = self.live + effect.workspace
            elif effect.kind is Kind.UNPACK:
                self._unpack(bsym)
                inside[i] = self.live
            elif effect.kind is Kind.DEL:
                inside[i] = self.live
                for p in bsym.flat_proxy_args:
                    obj = self.obj_of.pop(p.name, None)
                    if obj is not None:
                        self._decref(obj)
            elif effect.kind is Kind.CLEAR:
                inside[i] = self.live
                obj = self.obj_of.get(bsym.flat_proxy_args[0].name)
                if obj is not None:
                    self._clear(obj)
            elif effect.kind is Kind.RETURN:
                self._return(bsym)
                inside[i] = self.live
            else:
                inside[i] = self.live
            after[i] = self.live
        self._inputs_from_start(after, inside)
        return self._result(after, inside, workspaces, symbols)

    def _inputs_from_start(self, after: list[int], inside: list[int]) -> None:
        """The trace's inputs are alive before it starts (its caller passed them), not from where it unpacks them
        (Thunder's fsdp unpacks each shard just before its all-gather)."""
        late = [0] * (len(after) + 1)  # bytes of the inputs first named at each index
        for record in self.allocs:
            if record.symbol == "input" and record.start > 0:
                late[record.start] += record.nbytes
                record.start = 0
        missing = 0
        for i in range(len(after) - 1, -1, -1):
            missing += late[i + 1]
            after[i] += missing
            inside[i] += missing

    def _strides_of(self, name: str) -> layout.Strides:
        st = self.strides.get(name)
        if st is None:
            raise KeyError(name)
        return st

    def _compute(self, bsym, effect: Effect) -> None:
        sid = sym_id(bsym)
        if not effect.known and sid not in _reported_unknown:
            _reported_unknown.add(sid)
            log.warning("memory model: symbol %r is not known; its outputs are taken as new allocations", sid)
        if not effect.known:
            self.unknown.append(sid)
        for a in tensor_args(bsym):
            if a.name not in self.obj_of:
                self._bind(a, root=a.name)
        if sid in (REDUCE_SCATTER, ALL_REDUCE):
            first = tensor_args(bsym)[0]
            alloc = self.obj_alloc[self.obj_of[first.name]]
            if alloc is not None and self.allocs[alloc].category is Category.TEMPORARY:
                self.allocs[alloc].category = Category.COMM_BUFFER
            on = self.device_type or getattr(first.device, "type", None)
            if sid == REDUCE_SCATTER and bsym.flat_proxy_outs and on == "cuda":
                # NCCL holds the input until the collective is waited for, whatever the trace dels (Thunder has
                # it stash tensors rather than record streams); gloo on CPU does not.
                held = self.obj_of[first.name]
                self._incref(held)
                self.held[bsym.flat_proxy_outs[0].name] = held
        source = _source(bsym)
        module, own = self._module(bsym, sid)
        gathers = sid == ALL_GATHER or (sid in WAITS and any(a.name in self.parameters for a in bsym.flat_proxy_args))
        for out in effect.outputs:
            name = out.proxy.name
            if name in self.obj_of:
                continue
            if module is not None:
                self.module_of[name] = module
                if gathers:  # the gathered parameter (its future, then what its wait returns) is a parameter too
                    self.parameters[name] = module
            base_obj = self.obj_of.get(out.base) if out.base is not None else None
            if base_obj is not None and self.obj_alloc[base_obj] is not None:
                alloc = self.obj_alloc[base_obj]
            else:
                alloc = self._allocate(out.proxy, out.category, bsym.sym.name, source, size=out.nbytes)
                if own:
                    self.allocs[alloc].module = module
                else:
                    self.allocs[alloc].after = module
            self.strides[name] = out.strides
            obj = self._new_obj(name, alloc, None)
            self._incref(obj)
        if sid in WAITS:
            for a in bsym.flat_proxy_args:
                held = self.held.pop(a.name, None)
                if held is not None:
                    self._decref(held)

    def _module(self, bsym, sid: str) -> tuple[str | None, bool]:
        """The module ``bsym`` belongs to, and whether it is its own: the module of the parameters it reads (an
        all-gather's output is the parameter itself), else, not its own, the module of the first tensor it reads
        that has one."""
        if not self.parameters and not self.module_of:
            return None, False
        args = tensor_args(bsym)
        for a in args:
            path = self.parameters.get(a.name)
            if path is not None:
                return (path if sid == ALL_GATHER or sid in WAITS else path.rpartition(".")[0] or path), True
        return next((self.module_of[a.name] for a in args if a.name in self.module_of), None), False

    def _return(self, bsym) -> None:
        for name in proxy_names(bsym.args):
            obj = self.obj_of.get(name)
            if obj is None:
                continue
            self._incref(obj)
            alloc = self.obj_alloc[obj]
            if alloc is not None:
                self.returned[name] = alloc
        value = bsym.args[0] if len(bsym.args) == 1 else bsym.args
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], dict) and "output" in value[0]:
            self.forward_output = proxy_names(value[0]["output"])
            self.forward_saved = proxy_names(value[1])

    def _result(self, after, inside, workspaces, symbols) -> MemoryTimeline:
        self._categorize_returned()
        allocations = tuple(r.frozen() for r in self.allocs)
        peak_index = max(range(len(inside)), key=inside.__getitem__) if inside else 0
        peak = inside[peak_index] if inside else 0
        live = [a for a in allocations if a.live_at(peak_index)]
        workspace = workspaces.get(peak_index, 0)
        peak_symbol = symbols[peak_index] if symbols else ""
        if workspace:
            live.append(
                Allocation(
                    name=f"workspace of {peak_symbol}",
                    nbytes=workspace,
                    category=Category.TEMPORARY,
                    symbol=peak_symbol,
                    source=_source(self.trace.bound_symbols[peak_index]),
                    start=peak_index,
                    end=peak_index + 1,
                )
            )
        live.sort(key=lambda a: -a.nbytes)
        return MemoryTimeline(
            peak_bytes=peak,
            peak_index=peak_index,
            peak_symbol=peak_symbol,
            timeline=tuple(after),
            op_peaks=tuple(inside),
            live_at_peak=tuple(live),
            allocations=allocations,
            outputs=dict(self.returned),
            symbols=tuple(symbols),
            unknown_symbols=tuple(dict.fromkeys(self.unknown)),
        )

    def _categorize_returned(self) -> None:
        if self.forward_output or self.forward_saved:
            plan = [(self.forward_saved, Category.SAVED), (self.forward_output, Category.OUTPUT)]
        elif _is_backward(self.trace):
            plan = [(list(self.returned), Category.GRADIENT)]
        else:
            plan = [(list(self.returned), Category.OUTPUT)]
        for names, category in plan:
            for name in names:
                alloc = self.returned.get(name)
                if alloc is not None and self.allocs[alloc].category in (Category.TEMPORARY, Category.COMM_BUFFER):
                    self.allocs[alloc].category = category


_OWNED_COLLECTIONS = ("saved_for_backward", "cotangents")


def _default_spec(name: str, in_collection: bool, root: str) -> InputSpec:
    """Parameters (``t_`` names) and what the caller passes are held by the caller; what a backward receives in
    ``saved_for_backward`` and ``cotangents`` belongs to the backward, which clears those lists."""
    if name.startswith("t_"):
        return InputSpec(name, Category.PARAMETER, external=True)
    if in_collection and root in _OWNED_COLLECTIONS:
        category = Category.SAVED if root == "saved_for_backward" else Category.TEMPORARY
        return InputSpec(name, category, external=False)
    return InputSpec(name, Category.INPUT, external=True)


def _is_backward(trace: TraceCtx) -> bool:
    try:
        names = [a[0] for a in trace.siginfo().args]
    except Exception:  # noqa: BLE001 - a trace without signature info is simply not a backward
        return False
    return "saved_for_backward" in names


def _source(bsym) -> str | None:
    for candidate in (bsym, *bsym.subsymbols):
        filename = candidate.source_filename
        if filename:
            line = candidate.source_positions.lineno if candidate.source_positions else None
            return f"{filename}:{line}" if line is not None else filename
    return None
