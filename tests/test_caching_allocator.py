"""caching_allocator: the model of PyTorch's CUDA caching allocator, against figures worked out by hand from the
allocator's rules (sizes, pools, splitting, merging, releasing under a cap), and over a predicted step."""

import pytest

from thunder_fsdp_mem.analysis.caching_allocator import (
    CachingAllocator,
    OutOfMemory,
    over_cap,
    replay_step,
    segment_size,
)
from thunder_fsdp_mem.analysis.snapshot import aligned as rounded

MiB = 1 << 20


def test_sizes_round_to_512_bytes_and_segments_by_pool():
    assert (rounded(1), rounded(512), rounded(513)) == (512, 512, 1024)
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # the small pool's segments
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # under 10 MiB: 20 MiB segments
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB  # rounded up to 2 MiB


def test_small_requests_share_a_2_mib_segment():
    allocator = CachingAllocator()
    a, b = allocator.malloc(100), allocator.malloc(1000)
    assert (a.segment, b.segment) == (0, 0) and (a.size, b.size) == (512, 1024)
    assert (allocator.reserved, allocator.allocated) == (2 * MiB, 1536)


def test_a_large_block_splits_only_when_more_than_1_mib_is_left():
    allocator = CachingAllocator()
    five = allocator.malloc(5 * MiB)  # a 20 MiB segment: 15 MiB left, split off and cached
    again = allocator.malloc(5 * MiB)
    assert (five.segment, again.segment, allocator.reserved) == (0, 0, 20 * MiB)
    eleven = allocator.malloc(11 * MiB)  # a 12 MiB segment: 1 MiB left is not split, the block is 12 MiB
    assert (eleven.size, allocator.reserved, allocator.allocated) == (12 * MiB, 32 * MiB, 22 * MiB)


def test_freed_neighbours_merge_and_serve_a_larger_request():
    allocator = CachingAllocator()
    a, b = allocator.malloc(5 * MiB), allocator.malloc(5 * MiB)
    allocator.free(a)
    allocator.free(b)  # a, b and the 10 MiB rest are one free 20 MiB block again
    whole = allocator.malloc(18 * MiB)
    assert (whole.segment, allocator.reserved) == (0, 20 * MiB)


def test_under_a_cap_cached_segments_are_released_once_then_the_request_fails():
    allocator = CachingAllocator(cap=24 * MiB)
    x = allocator.malloc(10 * MiB)
    allocator.malloc(10 * MiB)  # two 10 MiB segments, the second kept
    allocator.free(x)
    allocator.malloc(12 * MiB)  # no cached block fits; 32 MiB would pass the cap: x's segment goes, 22 MiB
    assert (allocator.retries, allocator.reserved, allocator.peak_reserved) == (1, 22 * MiB, 22 * MiB)
    with pytest.raises(OutOfMemory) as failed:
        allocator.malloc(4 * MiB)  # a new 20 MiB segment: 42 MiB, and nothing cached to release
    assert (failed.value.request, failed.value.shortfall) == (4 * MiB, 42 * MiB - 24 * MiB)


def test_fragmentation_runs_out_where_the_allocated_bytes_fit():
    # Four 5 MiB blocks fill one 20 MiB segment; the first and third are freed: 10 MiB free, 5 MiB at most in one
    # piece. An 8 MiB request needs a new 20 MiB segment, past a 20 MiB cap, though 10 + 8 MiB would fit.
    allocator = CachingAllocator(cap=20 * MiB)
    blocks = [allocator.malloc(5 * MiB) for _ in range(4)]
    allocator.free(blocks[0])
    allocator.free(blocks[2])
    assert allocator.allocated + 8 * MiB <= 20 * MiB
    with pytest.raises(OutOfMemory) as failed:
        allocator.malloc(8 * MiB)
    assert allocator.retries == 1 and failed.value.shortfall == 20 * MiB  # 20 reserved + 20 new - 20 cap


def test_a_replayed_step_allocates_its_estimate_rounded_up(predicted_step):
    _, step = predicted_step
    free = replay_step(step)
    assert free.out_of_memory_bytes is None and free.retries == 0
    # each block rounds up to 512 bytes, and a large block may keep up to 1 MiB it does not split off
    assert step.peak_bytes <= free.peak_allocated_bytes <= free.peak_reserved_bytes
    assert free.peak_allocated_bytes <= step.peak_bytes * 1.05
    assert replay_step(step, steps=3, cap=free.peak_reserved_bytes).out_of_memory_bytes is None
    short = replay_step(step, cap=step.peak_bytes // 2)
    assert short.out_of_memory_bytes is not None and short.peak_reserved_bytes <= step.peak_bytes // 2
    assert 0 < short.shortfall_bytes <= short.peak_reserved_bytes + segment_size(short.out_of_memory_bytes)
    assert over_cap(step, step.peak_bytes // 2) == short.shortfall_bytes
    assert over_cap(step, free.peak_reserved_bytes) == 0 and free.shortfall_bytes is None
    with pytest.raises(ValueError, match="steps must be at least 1"):
        replay_step(step, steps=0)
