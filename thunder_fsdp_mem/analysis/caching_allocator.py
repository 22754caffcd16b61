"""What the CUDA caching allocator reserves for the predicted step, and whether a memory cap stops it.

``torch.cuda.max_memory_allocated`` is what the estimate predicts; ``max_memory_reserved`` is what the device gives
the process: whole segments from ``cudaMalloc``, which the caching allocator splits into blocks, keeps when they
are freed and hands out again. A cap (``torch.cuda.set_per_process_memory_fraction``, an 80 GB GPU emulated on an
H200) limits reserved memory: a step whose allocated peak fits can still run out when no cached block is large
enough and a new segment would pass the cap.

Entry points: ``replay_step(step, steps=3, cap=None) -> Reserved``: the predicted step's allocations and frees
(``snapshot.replay``, the same order the memory snapshot shows) run through a model of the allocator, ``steps``
times (the warm-up steps leave their segments cached, as in a measured run), what is alive before the step
allocated first; ``over_cap(step, cap) -> int``: by how many bytes the cap falls short of the replayed step (0:
it runs), what a memory budget with a cap adds to its estimate's excess (``passes/budget.py``).
``CachingAllocator`` is that model, after PyTorch's ``CUDACachingAllocator`` with its defaults
(no ``PYTORCH_CUDA_ALLOC_CONF``): sizes rounded up to 512 bytes; requests up to 1 MiB served from a pool of 2 MiB
segments, larger ones from a pool of segments of 20 MiB (requests under 10 MiB) or the request rounded up to
2 MiB; the smallest cached block that fits is taken and split when the rest is at least 512 bytes (small pool) or
over 1 MiB (large pool); a freed block merges with free neighbours of its segment; when a new segment would pass
the cap, every cached segment with nothing allocated in it is released and the request tried once more (an
allocation retry), and then it fails (out of memory). Not modelled: streams (one stream), the expandable segments
and other options of ``PYTORCH_CUDA_ALLOC_CONF``, and memory outside the predicted tensors (cuBLAS's workspace).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from thunder_fsdp_mem.analysis.phases import StepMemory
from thunder_fsdp_mem.analysis.snapshot import ALIGNMENT as MIN_BLOCK
from thunder_fsdp_mem.analysis.snapshot import aligned as rounded
from thunder_fsdp_mem.analysis.snapshot import replay

SMALL_REQUEST = 1 << 20  # requests up to this size use the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


class OutOfMemory(Exception):
    """A request the model cannot serve under the cap, after releasing the cached segments: ``request`` (rounded)
    and ``shortfall``, the bytes the cap lacked for the segment it needed."""

    def __init__(self, request: int, shortfall: int) -> None:
        super().__init__(request, shortfall)
        self.request, self.shortfall = request, shortfall


@dataclass(eq=False, slots=True)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reserved:
    """The allocator's figures over the replayed steps, in bytes.

    peak_reserved_bytes: the most reserved at once (``max_memory_reserved``).
    peak_allocated_bytes: the most in allocated blocks at once (``max_memory_allocated``: blocks are rounded up,
        and a large block whose rest would be 1 MiB or less is not split).
    retries: requests served only after the cached segments were released (``num_alloc_retries``).
    out_of_memory_bytes: the request that failed under the cap, None if none did.
    shortfall_bytes: what the cap lacked at that request (the reserved bytes, the new segment's and no more
        passed the cap by this much), None if none failed.
    """

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    retries: int
    out_of_memory_bytes: int | None = None
    shortfall_bytes: int | None = None


def segment_size(request: int) -> int:
    """The ``cudaMalloc`` size for a request (rounded) that no cached block serves."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-request // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """The caching allocator's bookkeeping, without memory (see the module's docstring). ``cap``: the most it may
    reserve, None for no limit."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap = cap
        self._pools: dict[bool, list[tuple[tuple[int, int, int], _Block]]] = {True: [], False: []}
        self._sizes: dict[int, int] = {}  # each cached segment's size
        self._next_segment = 0
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.retries = 0

    def malloc(self, nbytes: int) -> _Block:
        size = rounded(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._pools[small]
        at = bisect.bisect_left(pool, (size, -1, -1), key=lambda entry: entry[0])
        if at < len(pool):
            block = pool.pop(at)[1]
        else:
            block = self._new_segment(size, small)
        if self._splits(block.size - size, small):
            rest = _Block(block.segment, block.offset + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block)

    def _splits(self, rest: int, small: bool) -> bool:
        return rest >= MIN_BLOCK if small else rest > SMALL_REQUEST

    def _new_segment(self, size: int, small: bool) -> _Block:
        want = segment_size(size)
        if self.cap is not None and self.reserved + want > self.cap:
            self._release_cached()
            self.retries += 1
            if self.reserved + want > self.cap:
                raise OutOfMemory(size, self.reserved + want - self.cap)
        segment = self._next_segment
        self._next_segment += 1
        self._sizes[segment] = want
        self.reserved += want
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(segment, 0, want, small)

    def _release_cached(self) -> None:
        for small, pool in self._pools.items():
            keep = []
            for key, block in pool:
                if block.prev is None and block.next is None:  # the whole segment is free
                    self.reserved -= self._sizes.pop(block.segment)
                else:
                    keep.append((key, block))
            self._pools[small] = keep

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.key(), block), key=lambda entry: entry[0])

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        at = bisect.bisect_left(pool, block.key(), key=lambda entry: entry[0])
        assert pool[at][1] is block
        pool.pop(at)


def replay_step(step: StepMemory, *, steps: int = 3, cap: int | None = None) -> Reserved:
    """``step`` run ``steps`` times through ``CachingAllocator(cap)`` (see the module's docstring)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps!r}")
    events = replay(step)
    sizes = [block.nbytes for block in events.blocks]
    before = events.before_the_step()
    alive_before = set(before)
    allocator = CachingAllocator(cap)
    live: dict[int, _Block] = {}
    failed = None
    try:
        for _ in range(steps):
            for number in [n for n in live if n not in alive_before]:  # what the last step left, as the caller drops it
                allocator.free(live.pop(number))
            for number in before:
                if number not in live:
                    live[number] = allocator.malloc(sizes[number])
            for action, number in events.events:
                if action == "alloc":
                    live[number] = allocator.malloc(sizes[number])
                elif number in live:
                    allocator.free(live.pop(number))
    except OutOfMemory as error:
        failed = error
    return Reserved(
        peak_reserved_bytes=allocator.peak_reserved,
        peak_allocated_bytes=allocator.peak_allocated,
        retries=allocator.retries,
        out_of_memory_bytes=None if failed is None else failed.request,
        shortfall_bytes=None if failed is None else failed.shortfall,
    )


def over_cap(step: StepMemory, cap: int) -> int:
    """By how many bytes ``cap`` falls short of ``step`` replayed through the allocator (``replay_step``): 0 where
    it runs, else what the cap lacked at the request that failed."""
    return replay_step(step, cap=cap).shortfall_bytes or 0
