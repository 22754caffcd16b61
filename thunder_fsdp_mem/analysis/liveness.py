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

Where it lives: the result types are ``timeline``'s; the reference counts are
``references.References``; this module walks the bound symbols (``_Walk``: each symbol's effect applied to the
references, which module made what) and accounts for the timeline and its peak (``_timeline``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from thunder.core.trace import TraceCtx

from thunder_fsdp_mem.analysis.timeline import Allocation, InputSpec, MemoryTimeline
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.effects import Effect, Kind, classify
from thunder_fsdp_mem.analysis.provenance import Origin, Provenance, Scopes, user_line
from thunder_fsdp_mem.analysis.references import Record, References
from thunder_fsdp_mem.analysis.symbols import (
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAITS,
    proxy_names,
    sym_id,
    tensor_args,
)

log = logging.getLogger(__name__)

_reported_unknown: set[str] = set()


def analyze(
    trace: TraceCtx,
    *,
    inputs: Mapping[str, InputSpec] | None = None,
    device_type: str | None = None,
    parameter_names: Mapping[str, str] | None = None,
    scopes: Scopes | None = None,
    origins: Mapping[str, Origin] | None = None,
    gradients: Mapping[str, str] | None = None,
) -> MemoryTimeline:
    """Live storage bytes over ``trace`` (a Thunder execution trace, forward or backward).

    Without ``inputs``, tensors passed directly as arguments are held by the caller (names starting with
    ``t_`` are taken for module parameters, others for inputs), and tensors passed inside lists (a backward's
    ``saved_for_backward`` and ``cotangents``) belong to the trace, which frees them as it clears the lists.
    ``device_type``: the device the trace would run on, for a trace made on the meta device (None: each
    tensor's own). ``parameter_names``: trace argument name -> the parameter's qualified name, where the module is
    known, to tell which module made each allocation (``Allocation.module``; ThunderFX's names tell it alone).
    ``scopes``, ``origins``, ``gradients``: what else places the allocations in the model (``provenance``: the
    model's code by line, the origins of what the trace receives, the parameters its outputs are gradients of).
    With none of these nor ``parameter_names`` (what a transform's estimates pass) nothing is named: the walk
    costs about half as much.
    """
    if not isinstance(trace, TraceCtx):
        raise TypeError(
            f"analyze() expects a Thunder execution trace (thunder.core.trace.TraceCtx), such as "
            f"thunder.last_traces(fn)[-1]; got {type(trace).__name__}"
        )
    named = scopes is not None or bool(parameter_names) or bool(origins) or bool(gradients)
    provenance = Provenance(trace, parameter_names, scopes, origins, gradients) if named else None
    walk = _Walk(trace, References(dict(inputs or {})), provenance, device_type)
    walk.run()
    _inputs_from_start(walk.refs.records, walk.after, walk.inside)
    if provenance is not None:
        _inputs_placed(walk.refs.records, provenance)
    _categorize_returned(walk.refs.records, walk.returned, _returned_categories(trace, walk))
    return _timeline(trace, walk)


class _Walk:
    """One pass over a trace's bound symbols, applying each one's effect (``effects.classify``) to the references:
    the live bytes after each symbol (``after``) and while it runs (``inside``, its workspace included), the
    storages the trace returns, and which module made each allocation."""

    def __init__(self, trace: TraceCtx, refs: References, provenance: Provenance | None, device_type: str | None):
        self.trace = trace
        self.refs = refs
        self.provenance = provenance
        self.device_type = device_type
        self.after: list[int] = []
        self.inside: list[int] = []
        self.workspaces: dict[int, int] = {}
        self.symbols: list[str] = []
        self.unknown: list[str] = []
        self.held: dict[str, int] = {}  # a reduce-scatter's future -> the input it holds until its wait
        self.returned: dict[str, int] = {}  # name the trace returns -> its storage
        self.forward_saved: list[str] = []
        self.forward_output: list[str] = []

    def run(self) -> None:
        refs = self.refs
        for i, bsym in enumerate(self.trace.bound_symbols):
            refs.index = i
            self.symbols.append(bsym.sym.name)
            effect = classify(bsym, refs.strides_of)
            if effect.kind is Kind.COMPUTE:
                self._compute(bsym, effect)
                if effect.workspace:
                    self.workspaces[i] = effect.workspace
            elif effect.kind is Kind.UNPACK:
                refs.unpack(bsym)
            self.inside.append(refs.live + effect.workspace)  # frees below happen after the symbol
            if effect.kind is Kind.DEL:
                for p in bsym.flat_proxy_args:
                    refs.drop(p.name)
            elif effect.kind is Kind.CLEAR:
                obj = refs.object_of.get(bsym.flat_proxy_args[0].name)
                if obj is not None:
                    refs.clear(obj)
            elif effect.kind is Kind.RETURN:
                self._return(bsym)
            self.after.append(refs.live)

    def _compute(self, bsym, effect: Effect) -> None:
        sid = sym_id(bsym)
        if not effect.known:
            if sid not in _reported_unknown:
                _reported_unknown.add(sid)
                log.warning("memory model: symbol %r is not known; its outputs are taken as new allocations", sid)
            self.unknown.append(sid)
        for a in tensor_args(bsym):
            if a.name not in self.refs.object_of:
                self.refs.bind(a, root=a.name)
        if sid in (REDUCE_SCATTER, ALL_REDUCE):
            self._collective(bsym, sid)
        if self.provenance is not None:
            self.provenance.visit(self.refs.index, bsym)
        self._outputs(bsym, effect)
        if sid in WAITS:
            for a in bsym.flat_proxy_args:
                held = self.held.pop(a.name, None)
                if held is not None:
                    self.refs.decref(held)

    def _collective(self, bsym, sid: str) -> None:
        """A reduction's input is a communication buffer; on CUDA a reduce-scatter's input stays alive until its wait:
        NCCL holds it until the collective is waited for, whatever the trace dels (Thunder has it stash tensors rather
        than record streams); gloo on CPU does not."""
        first = tensor_args(bsym)[0]
        record = self.refs.storage_of(first.name)
        if record is not None and self.refs.records[record].category is Category.TEMPORARY:
            self.refs.records[record].category = Category.COMM_BUFFER
        on = self.device_type or getattr(first.device, "type", None)
        if sid == REDUCE_SCATTER and bsym.flat_proxy_outs and on == "cuda":
            held = self.refs.object_of[first.name]
            self.refs.incref(held)
            self.held[bsym.flat_proxy_outs[0].name] = held

    def _outputs(self, bsym, effect: Effect) -> None:
        """Binds the outputs the trace has not seen: views on their base's storage, the rest on new storages, each
        marked with what made it (``provenance.Origin``)."""
        refs = self.refs
        for out in effect.outputs:
            name = out.proxy.name
            if name in refs.object_of:
                continue
            record = refs.storage_of(out.base) if out.base is not None else None
            if record is None:
                origin = self.provenance.of(name) if self.provenance is not None else None
                source = origin.source if origin is not None and origin.source else user_line(bsym)
                record = refs.allocate(out.proxy, out.category, bsym.sym.name, source, size=out.nbytes)
                if origin is not None:
                    _place(refs.records[record], origin)
            refs.add_tensor(name, record, out.strides)

    def _return(self, bsym) -> None:
        for name in proxy_names(bsym.args):
            record = self.refs.keep(name)
            if record is not None:
                self.returned[name] = record
        value = bsym.args[0] if len(bsym.args) == 1 else bsym.args
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], dict) and "output" in value[0]:
            self.forward_output = proxy_names(value[0]["output"])
            self.forward_saved = proxy_names(value[1])


# --- the timeline and its peak ----------------------------------------------------------------------------------------


def _inputs_from_start(records: list[Record], after: list[int], inside: list[int]) -> None:
    """The trace's inputs are alive before it starts (its caller passed them), not from where it unpacks them
    (Thunder's fsdp unpacks each shard just before its all-gather)."""
    late = [0] * (len(after) + 1)  # bytes of the inputs first named at each index
    for record in records:
        if record.symbol == "input" and record.start > 0:
            late[record.start] += record.nbytes
            record.start = 0
    missing = 0
    for i in range(len(after) - 1, -1, -1):
        missing += late[i + 1]
        after[i] += missing
        inside[i] += missing


def _inputs_placed(records: list[Record], provenance: Provenance) -> None:
    """The trace's inputs named by where they come from: a parameter by its qualified name, a tensor the forward
    saved by the origin the forward found for it."""
    for record in records:
        if record.symbol != "input":
            continue
        parameter = provenance.params.get(record.name)
        if parameter is not None:
            record.module, record.role = parameter, "parameter"
            continue
        origin = provenance.of(record.name)
        if origin is not None:
            _place(record, origin)


def _place(record: Record, origin: Origin) -> None:
    record.op, record.role = origin.op, origin.role
    if origin.own:
        record.module = origin.module
    else:
        record.after = origin.module


def _returned_categories(trace: TraceCtx, walk: _Walk) -> list[tuple[list[str], Category]]:
    """What the trace returns is what it saves for backward and its output (a forward), gradients (a backward),
    or its output."""
    if walk.forward_output or walk.forward_saved:
        return [(walk.forward_saved, Category.SAVED), (walk.forward_output, Category.OUTPUT)]
    if _is_backward(trace):
        return [(list(walk.returned), Category.GRADIENT)]
    return [(list(walk.returned), Category.OUTPUT)]


def _categorize_returned(
    records: list[Record], returned: Mapping[str, int], plan: list[tuple[list[str], Category]]
) -> None:
    """The returned storages that were temporaries (or communication buffers) take the category of ``plan``."""
    for names, category in plan:
        for name in names:
            record = returned.get(name)
            if record is not None and records[record].category in (Category.TEMPORARY, Category.COMM_BUFFER):
                records[record].category = category


def _timeline(trace: TraceCtx, walk: _Walk) -> MemoryTimeline:
    """The walk's figures as a ``MemoryTimeline``: the peak is the first bound symbol's of the highest, and what is
    alive then, its workspace included, largest first."""
    allocations = tuple(r.frozen() for r in walk.refs.records)
    inside, symbols = walk.inside, walk.symbols
    peak_index = max(range(len(inside)), key=inside.__getitem__) if inside else 0
    peak_symbol = symbols[peak_index] if symbols else ""
    live = [a for a in allocations if a.live_at(peak_index)]
    workspace = walk.workspaces.get(peak_index, 0)
    if workspace:
        live.append(
            Allocation(
                name=f"workspace of {peak_symbol}",
                nbytes=workspace,
                category=Category.TEMPORARY,
                symbol=peak_symbol,
                source=user_line(trace.bound_symbols[peak_index]),
                start=peak_index,
                end=peak_index + 1,
            )
        )
    live.sort(key=lambda a: -a.nbytes)
    return MemoryTimeline(
        peak_bytes=inside[peak_index] if inside else 0,
        peak_index=peak_index,
        peak_symbol=peak_symbol,
        timeline=tuple(walk.after),
        op_peaks=tuple(inside),
        live_at_peak=tuple(live),
        allocations=allocations,
        outputs=dict(walk.returned),
        symbols=tuple(symbols),
        unknown_symbols=tuple(dict.fromkeys(walk.unknown)),
        origins=walk.provenance.origins if walk.provenance is not None else {},
    )


def _is_backward(trace: TraceCtx) -> bool:
    try:
        names = [a[0] for a in trace.siginfo().args]
    except Exception:  # noqa: BLE001 - a trace without signature info is simply not a backward
        return False
    return "saved_for_backward" in names
