"""Python's reference counting over a trace's names: the model ``liveness.analyze`` walks a trace with.

Entry point: ``References(inputs)``, which the walk drives: ``bind`` and ``unpack`` (a name the
trace receives), ``allocate`` and ``add_tensor`` (what an op makes), ``incref`` / ``decref`` / ``drop`` (a name
bound, released or deleted), ``clear`` (a collection emptied), ``keep`` (a name the trace returns).

Names, collections (the lists a backward receives) and tensors are objects with reference counts; a tensor holds
its storage (a ``Record`` while the walk runs); views and aliases are new tensors on the same storage; a storage is
freed, at the walk's ``index``, when nothing refers to it. What the trace receives is bound on first sight, by its
``InputSpec`` (or ``default_spec``): inputs with one storage key share one allocation, and an external one starts
with a reference the trace never drops.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, fields

from thunder.core.prims import PrimIDs
from thunder.core.proxies import CollectionProxy, FutureTensorProxy, TensorProxy

from thunder_fsdp_mem.analysis import layout
from thunder_fsdp_mem.analysis.timeline import Allocation, InputSpec
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.symbols import dtype_name, nbytes, shape

_OWNED_COLLECTIONS = ("saved_for_backward", "cotangents")


@dataclass(slots=True)
class Record:
    """An allocation while the walk runs: its category, start, end and module change as the trace goes on."""

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
    op: str = ""
    role: str | None = None

    def frozen(self) -> Allocation:
        return Allocation(**{f.name: getattr(self, f.name) for f in fields(self)})


class References:
    """The objects of one trace (tensors and collections, by index) with their reference counts, the names bound
    to them, and the storages (``records``) the tensors hold, with theirs; ``live``: the bytes of the storages
    alive; ``strides``: the layout of each tensor, by name."""

    def __init__(self, inputs: Mapping[str, InputSpec]):
        self.inputs = inputs
        self.object_of: dict[str, int] = {}
        self.records: list[Record] = []
        self.strides: dict[str, layout.Strides] = {}
        self.live = 0
        self.index = 0  # the bound symbol the walk is at: where what is allocated starts and what is freed ends
        self._refs: list[int] = []  # per object
        self._storage: list[int | None] = []  # per object: its record (None for a collection)
        self._members: list[list[int] | None] = []  # per object: a collection's members
        self._record_refs: list[int] = []
        self._record_of_key: dict[Hashable, int] = {}

    # objects and storages -------------------------------------------------------------------------------------
    def new_object(self, name: str | None, record: int | None, members: list[int] | None) -> int:
        obj = len(self._refs)
        self._refs.append(0)
        self._storage.append(record)
        self._members.append(members)
        if record is not None:
            self._record_refs[record] += 1
        if name is not None:
            self.object_of[name] = obj
        return obj

    def incref(self, obj: int) -> None:
        self._refs[obj] += 1

    def decref(self, obj: int) -> None:
        self._refs[obj] -= 1
        if self._refs[obj] > 0:
            return
        record = self._storage[obj]
        if record is not None:
            self._release(record)
        self.clear(obj)

    def clear(self, obj: int) -> None:
        """A collection drops its references to its members."""
        members = self._members[obj]
        if members:
            self._members[obj] = []
            for m in members:
                self.decref(m)

    def _release(self, record: int) -> None:
        self._record_refs[record] -= 1
        if self._record_refs[record] == 0:
            self.live -= self.records[record].nbytes
            self.records[record].end = self.index

    def allocate(
        self, t, category: Category, symbol: str, source: str | None, *, size: int | None = None, external: bool = False
    ) -> int:
        """A new storage for tensor ``t`` (``size`` bytes, else the tensor's own), made by ``symbol`` at ``index``."""
        size = nbytes(t) if size is None else size
        self.records.append(
            Record(t.name, size, category, shape(t), dtype_name(t), symbol, source, self.index, external=external)
        )
        self._record_refs.append(1 if external else 0)
        self.live += size
        return len(self.records) - 1

    def add_tensor(self, name: str, record: int, strides: layout.Strides) -> None:
        """A tensor on storage ``record``, bound to ``name``."""
        self.strides[name] = strides
        self.incref(self.new_object(name, record, None))

    def storage_of(self, name: str) -> int | None:
        """The storage of the tensor bound to ``name``; None for a name unbound or bound to a collection."""
        obj = self.object_of.get(name)
        return self._storage[obj] if obj is not None else None

    def drop(self, name: str) -> None:
        """``del name``."""
        obj = self.object_of.pop(name, None)
        if obj is not None:
            self.decref(obj)

    def keep(self, name: str) -> int | None:
        """One more reference to what ``name`` is bound to, which the trace returns; its storage, if a tensor's."""
        obj = self.object_of.get(name)
        if obj is None:
            return None
        self.incref(obj)
        return self._storage[obj]

    def strides_of(self, name: str) -> layout.Strides:
        return self.strides[name]

    # what the trace receives ----------------------------------------------------------------------------------
    def bind(self, proxy, *, root: str) -> None:
        """One more reference to what ``proxy`` names, bound as an input (within ``root``) if it is new."""
        obj = self.object_of.get(proxy.name)
        if obj is None:
            if isinstance(proxy, (TensorProxy, FutureTensorProxy)):
                obj = self._input_tensor(proxy, in_collection=False, root=root)
            elif isinstance(proxy, CollectionProxy):
                obj = self._input_collection(proxy.coll, proxy.name, root)
            else:
                return
        self.incref(obj)

    def unpack(self, bsym) -> None:
        """The names an unpacking symbol binds; an ``unpack_sequence`` binds its collection's members."""
        if bsym.sym.id == PrimIDs.UNPACK_SEQUENCE and bsym.args and isinstance(bsym.args[0], CollectionProxy):
            parent = self.object_of.get(bsym.args[0].name)
            members = self._members[parent] if parent is not None else None
            for i, out in enumerate(bsym.flat_proxy_outs):
                if members is not None and i < len(members):
                    self.object_of.setdefault(out.name, members[i])
                self.bind(out, root=bsym.args[0].name)
            return
        for out in bsym.flat_proxy_outs:
            self.bind(out, root=out.name)

    def _input_tensor(self, t, *, in_collection: bool, root: str) -> int:
        spec = self.inputs.get(t.name) or default_spec(t.name, in_collection, root)
        record = self._record_of_key.get(spec.storage)
        if record is None:
            record = self.allocate(t, spec.category, "input", None, size=spec.nbytes, external=spec.external)
            self._record_of_key[spec.storage] = record
        self.strides[t.name] = layout.contiguous_strides(shape(t))
        return self.new_object(t.name, record, None)

    def _input_collection(self, items, name: str | None, root: str) -> int:
        members = []
        for item in items:
            if isinstance(item, (TensorProxy, FutureTensorProxy)):
                obj = self.object_of.get(item.name)
                if obj is None:
                    obj = self._input_tensor(item, in_collection=True, root=root)
            elif isinstance(item, CollectionProxy):
                obj = self._input_collection(item.coll, item.name, root)
            elif isinstance(item, (list, tuple)):
                obj = self._input_collection(item, None, root)
            else:
                continue
            self.incref(obj)
            members.append(obj)
        return self.new_object(name, None, members)


def default_spec(name: str, in_collection: bool, root: str) -> InputSpec:
    """Parameters (``t_`` names) and what the caller passes are held by the caller; what a backward receives in
    ``saved_for_backward`` and ``cotangents`` belongs to the backward, which clears those lists."""
    if name.startswith("t_"):
        return InputSpec(name, Category.PARAMETER, external=True)
    if in_collection and root in _OWNED_COLLECTIONS:
        category = Category.SAVED if root == "saved_for_backward" else Category.TEMPORARY
        return InputSpec(name, category, external=False)
    return InputSpec(name, Category.INPUT, external=True)
