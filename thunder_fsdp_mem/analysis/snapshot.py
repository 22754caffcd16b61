"""The predicted step as a memory snapshot that PyTorch's own viewer opens (``report --snapshot``).

Entry points: ``replay(step) -> Replay``, the step's allocations and frees in order (what ``caching_allocator`` runs
through its model of the caching allocator); ``predicted_snapshot(step) -> dict``, in the format of
``torch.cuda.memory._snapshot()`` (what ``torch.cuda.memory._dump_snapshot`` pickles): one segment whose blocks are what
is alive at the end of the step, and a device trace of ``alloc`` / ``free_requested`` / ``free_completed`` events in
step order. Open the pickle on pytorch.org/memory_viz, or render it with ``torch.cuda._memory_viz`` (``trace_plot``,
``segment_plot``).

The events replay the estimate: phase by phase (``StepMemory.phases``), what the phase no longer holds is freed
and what it newly holds is allocated at its start; inside a trace, each bound symbol (``MemoryTimeline.ops``)
allocates its outputs, then its workspace (freed at once), then frees what its ``del`` or last use releases (a
symbol that frees while it runs, as a wait its held input, frees first). The live bytes during each symbol are
the estimate's, and the largest is the predicted peak. What is alive before the step (``BEFORE_THE_STEP``:
parameters, optimizer state, the batch) has no ``alloc`` event: the viewer takes it for memory allocated before
recording began, as in a real snapshot. An allocation carried from one phase into the next keeps its block: it is
the same object the holdings pass on, or the next trace's input of the same name and size.

Each allocation's frames (innermost first, as torch records them) are: the op that produced it, at its source
line where the trace records one, with the trace's name for it; the module it belongs to (``Allocation.label``);
the phase of the step. Addresses come from a first-fit arena aligned to 512 bytes, as the CUDA caching allocator
aligns blocks; sizes are the estimate's bytes, unrounded. Checked beyond the tests by running PyTorch's viewer
(``torch/utils/viz/MemoryViz.js``) under Node.js on the three FSDP paths: every view builds, and its highest
point is the predicted peak.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.timeline import Allocation
from thunder_fsdp_mem.analysis.phases import Phase, StepMemory

BASE_ADDRESS = 0x7F0000000000
ALIGNMENT = 512
DEVICE = 0
# What is alive before the step begins, with no ``alloc`` event (as in a real snapshot recorded from the step on).
BEFORE_THE_STEP = (Category.PARAMETER, Category.OPTIMIZER_STATE, Category.INPUT)


@dataclass(frozen=True, slots=True)
class _Block:
    """One allocation of the replay: its size, frames and category."""

    nbytes: int
    frames: tuple[dict, ...]
    category: str


def predicted_snapshot(step: StepMemory) -> dict:
    """``step`` as a ``torch.cuda.memory._snapshot()`` dictionary for device 0 (see the module's docstring)."""
    events = replay(step)
    arena = _Arena()
    address: dict[int, int] = {}
    for number in events.before_the_step():  # placed first
        address[number] = arena.allocate(events.blocks[number].nbytes)
    trace = []
    for action, number in events.events:
        block = events.blocks[number]
        if action == "alloc":
            address[number] = arena.allocate(block.nbytes)
            trace.append(_entry("alloc", address[number], block))
        else:
            arena.free(address[number], block.nbytes)
            trace.append(_entry("free_requested", address[number], block))
            trace.append(_entry("free_completed", address[number], block))
    size = max(arena.high, ALIGNMENT)
    # "unknown" among the events' categories: the viewer colours a block of the final state by it (and stops
    # loading a snapshot whose events have categories but not that one).
    segment_alloc = {
        "action": "segment_alloc",
        "addr": BASE_ADDRESS,
        "size": size,
        "stream": 0,
        "frames": [],
        "category": "unknown",
    }
    alive = [(address[b.block], events.blocks[b.block]) for b in events.live.values()]
    return {"segments": [_segment(size, alive)], "device_traces": [[segment_alloc, *trace]]}


def _entry(action: str, address: int, block: _Block) -> dict:
    entry = {"action": action, "addr": address, "size": block.nbytes, "stream": 0, "frames": list(block.frames)}
    if block.category:
        entry["category"] = block.category
    return entry


def _segment(size: int, alive: list[tuple[int, _Block]]) -> dict:
    """The segment at the end of the step: its live blocks in address order, the gaps between them inactive."""
    blocks = []
    at = BASE_ADDRESS
    for address, block in sorted(alive, key=lambda b: b[0]):
        if address > at:
            blocks.append({"address": at, "size": address - at, "requested_size": 0, "state": "inactive", "frames": []})
        blocks.append(
            {
                "address": address,
                "size": block.nbytes,
                "requested_size": block.nbytes,
                "state": "active_allocated",
                "frames": list(block.frames),
            }
        )
        at = address + block.nbytes
    if at < BASE_ADDRESS + size:
        blocks.append(
            {"address": at, "size": BASE_ADDRESS + size - at, "requested_size": 0, "state": "inactive", "frames": []}
        )
    allocated = sum(b.nbytes for _, b in alive)
    return {
        "device": DEVICE,
        "address": BASE_ADDRESS,
        "total_size": size,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "blocks": blocks,
    }


# --- the events ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Live:
    """A block alive in the replay: the allocation's name and size as the phase that holds it names it, and the
    block it is (its number in ``Replay.blocks``)."""

    name: str
    nbytes: int
    block: int


class Replay:
    """The events so far and the blocks alive, by the token of the phase that holds them. ``blocks``: every
    allocation of the step, by number; ``events``: ``("alloc" | "free", number)`` in step order."""

    def __init__(self) -> None:
        self.live: dict[Hashable, _Live] = {}
        self.blocks: list[_Block] = []  # by number
        self.events: list[tuple[str, int]] = []  # ("alloc" | "free", block)

    def before_the_step(self) -> list[int]:
        """The blocks alive before the step begins (no ``alloc`` event), in order."""
        recorded = {number for action, number in self.events if action == "alloc"}
        return [number for number in range(len(self.blocks)) if number not in recorded]

    def allocate(
        self,
        token: Hashable,
        a: Allocation | None,
        phase: Phase,
        *,
        nbytes: int | None = None,
        frames: tuple[dict, ...] | None = None,
        recorded: bool = True,
    ) -> None:
        nbytes = a.nbytes if nbytes is None else nbytes
        self.blocks.append(
            _Block(
                nbytes,
                frames if frames is not None else _frames(a, phase),
                a.category.value if a is not None else "temporary",
            )
        )
        self.live[token] = _Live(a.name if a is not None else "", nbytes, len(self.blocks) - 1)
        if recorded:
            self.events.append(("alloc", len(self.blocks) - 1))

    def free(self, token: Hashable) -> int:
        gone = self.live.pop(token)
        self.events.append(("free", gone.block))
        return gone.nbytes


def replay(step: StepMemory) -> Replay:
    """The step's allocations and frees in order (see the module's docstring)."""
    events = Replay()
    for k, phase in enumerate(step.phases):
        held = [(("held", id(a)), a) for a in phase.outside]
        inputs = (
            []
            if phase.timeline is None
            else [(("trace", k, j), a) for j, a in enumerate(phase.timeline.allocations) if a.symbol == "input"]
        )
        counted = {("held", id(a)) for a in phase.inside}
        carried, new = _carry(events.live, [*held, *inputs], counted)
        for token in [t for t in events.live if t not in carried]:
            events.free(token)
        events.live = {carried[t]: block for t, block in events.live.items()}
        lent = {carried[t]: t for t in counted if t in carried}  # the holdings' blocks the trace counts
        for token, a in new:
            events.allocate(token, a, phase, recorded=k > 0 or a.category not in BEFORE_THE_STEP)
        for j, a in enumerate(phase.extra):
            events.allocate(("extra", k, j), a, phase)
        if phase.timeline is not None:
            _trace_events(k, phase, events)
        events.live = {lent.get(t, t): block for t, block in events.live.items()}  # back to their holders
    for token in [t for t in events.live if t[0] == "extra"]:  # the last phase's own memory ends with the step
        events.free(token)
    return events


def _carry(
    live: dict[Hashable, _Live], wanted: list[tuple[Hashable, Allocation]], counted: set[Hashable]
) -> tuple[dict[Hashable, Hashable], list[tuple[Hashable, Allocation]]]:
    """Which live blocks the phase keeps (live token -> its token in the phase) and what it newly holds. A block is
    kept under its own token; else by an allocation of the same name and size; else, where the phase's trace
    counts it (``counted``: its holdings' tokens), by an input of the same size."""
    carried: dict[Hashable, Hashable] = {}
    pending = []
    for token, a in wanted:
        if token in live and token not in carried:
            carried[token] = token
        else:
            pending.append((token, a))
    by_name: dict[tuple[str, int], list[Hashable]] = {}
    by_size: dict[int, list[Hashable]] = {}
    for token, block in live.items():
        if token not in carried:
            by_name.setdefault((block.name, block.nbytes), []).append(token)
            if token in counted:
                by_size.setdefault(block.nbytes, []).append(token)
    unmatched = []
    for token, a in pending:
        same = [t for t in by_name.get((a.name, a.nbytes), ()) if t not in carried]
        if same:
            carried[same[0]] = token
        else:
            unmatched.append((token, a))
    new = []
    for token, a in unmatched:
        same = [t for t in by_size.get(a.nbytes, ()) if t not in carried]
        if same:
            carried[same[0]] = token
        else:
            new.append((token, a))
    return carried, new


def _trace_events(k: int, phase: Phase, events: Replay) -> None:
    """A trace's symbols in order (``MemoryTimeline.ops``): outputs allocated, the workspace allocated and freed,
    releases freed (before the outputs, for a symbol that frees while it runs)."""
    timeline = phase.timeline

    def free(op) -> None:
        for j in op.freed:
            if ("trace", k, j) in events.live:
                events.free(("trace", k, j))

    for i, op in enumerate(timeline.ops()):
        if op.freed_first:
            free(op)
        for j in op.made:
            events.allocate(("trace", k, j), timeline.allocations[j], phase)
        if op.workspace:
            frames = ({"filename": "", "line": 0, "name": f"workspace of {timeline.symbols[i]}"}, _phase_frame(phase))
            events.allocate(("workspace", k, i), None, phase, nbytes=op.workspace, frames=frames)
            events.free(("workspace", k, i))
        if not op.freed_first:
            free(op)


def _frames(a: Allocation, phase: Phase) -> tuple[dict, ...]:
    """Innermost first: the op at its source line, the module, the phase."""
    filename, line = "", 0
    if a.source:
        filename, _, number = a.source.rpartition(":")
        filename, line = (filename, int(number)) if number.isdigit() else (a.source, 0)
    frames = [{"filename": filename, "line": line, "name": f"{a.symbol} -> {a.name} ({a.category.value})"}]
    if a.label != a.name:
        frames.append({"filename": "", "line": 0, "name": a.label})
    frames.append(_phase_frame(phase))
    return tuple(frames)


def _phase_frame(phase: Phase) -> dict:
    return {"filename": "predicted step", "line": 0, "name": phase.name}


class _Arena:
    """First-fit addresses in one segment from ``BASE_ADDRESS``, each block aligned to ``ALIGNMENT``."""

    def __init__(self) -> None:
        self.holes: list[tuple[int, int]] = []  # (offset, size), sorted, merged
        self.top = 0
        self.high = 0  # the highest ``top``: the segment's size

    def allocate(self, nbytes: int) -> int:
        size = aligned(nbytes)
        for n, (offset, hole) in enumerate(self.holes):
            if hole >= size:
                self.holes[n : n + 1] = [(offset + size, hole - size)] if hole > size else []
                return BASE_ADDRESS + offset
        offset, self.top = self.top, self.top + size
        self.high = max(self.high, self.top)
        return BASE_ADDRESS + offset

    def free(self, address: int, nbytes: int) -> None:
        offset, size = address - BASE_ADDRESS, aligned(nbytes)
        holes = sorted([*self.holes, (offset, size)])
        merged: list[tuple[int, int]] = []
        for start, length in holes:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        if merged and merged[-1][0] + merged[-1][1] == self.top:
            self.top = merged.pop()[0]
        self.holes = merged


def aligned(nbytes: int) -> int:
    """The bytes of the block the CUDA caching allocator gives a request: at least ``ALIGNMENT``, a multiple of it."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
