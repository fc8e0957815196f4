"""The caching-allocator model against traces worked by hand from c10/cuda/CUDACachingAllocator.cpp."""
from memkit.estimate.allocator import AllocatorConfig, CachingAllocator, allocation_size, replay, round_size
from memkit.units import MIB


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(1 * MIB) == 2 * MIB          # small pool: 2 MiB segments
    assert allocation_size(1 * MIB + 512) == 20 * MIB   # 1-10 MiB: a 20 MiB segment
    assert allocation_size(10 * MIB) == 10 * MIB        # >= 10 MiB: rounded to 2 MiB
    assert allocation_size(11 * MIB) == 12 * MIB


def test_small_requests_share_one_2mib_segment():
    # 4 x 100 KB: each rounded to 100352 B (196 x 512), all packed into one 2 MiB block
    stats = replay([(i, 100_000) for i in range(4)])
    assert stats.allocated_peak_bytes == 4 * 100_352
    assert stats.reserved_peak_bytes == 2 * MIB and stats.num_segments == 1
    assert stats.requested_peak_bytes == 400_000


def test_medium_request_splits_a_20mib_segment_and_reuses_it():
    # 3 MiB takes a 20 MiB segment, the 17 MiB remainder (> 1 MiB) is split off and cached;
    # a second 5 MiB request is served from it: still one segment.
    stats = replay([("a", 3 * MIB), ("b", 5 * MIB)])
    assert stats.reserved_peak_bytes == 20 * MIB and stats.num_segments == 1
    assert stats.allocated_peak_bytes == 8 * MIB


def test_large_remainder_below_1mib_is_not_split():
    # a 12 MiB segment freed, then 11.5 MiB requested: remainder 0.5 MiB <= 1 MiB, so the
    # whole 12 MiB block is handed out and counted as allocated (should_split, large pool).
    alloc = CachingAllocator()
    alloc.malloc("a", 12 * MIB)
    alloc.free("a")
    alloc.malloc("b", 11 * MIB + MIB // 2)
    assert alloc.allocated == 12 * MIB and alloc.reserved == 12 * MIB


def test_best_fit_and_fragmentation():
    # two 40 MiB segments; free the first, ask 50 MiB: no cached block fits -> new segment.
    alloc = CachingAllocator()
    alloc.malloc("a", 40 * MIB)
    alloc.malloc("b", 40 * MIB)
    alloc.free("a")
    alloc.malloc("c", 50 * MIB)
    assert alloc.reserved == 130 * MIB and alloc.allocated == 90 * MIB
    # best fit: with free blocks of 40 and 30 MiB, a 30 MiB request takes the 30 MiB one
    alloc2 = CachingAllocator()
    for k, s in (("x", 40), ("y", 30), ("z", 8)):
        alloc2.malloc(k, s * MIB)
    alloc2.free("x")
    alloc2.free("y")
    alloc2.malloc("w", 30 * MIB)
    assert alloc2.reserved == 40 * MIB + 30 * MIB + 20 * MIB
    assert sorted(s for s, _ in alloc2.free_blocks(0, False)) == [12 * MIB, 40 * MIB]  # 20-8 MiB and 40 MiB left


def test_freed_neighbours_merge():
    # 60 MiB segment split into 20 + 20 + 20; freeing all three merges them back to one block
    alloc = CachingAllocator()
    alloc.malloc("seg", 60 * MIB)
    alloc.free("seg")
    for k in "abc":
        alloc.malloc(k, 20 * MIB)
    for k in "acb":
        alloc.free(k)
    assert alloc.free_blocks(0, False) == [(60 * MIB, 0)]


def test_max_split_size_keeps_oversize_blocks_whole():
    cfg = AllocatorConfig(max_split_size=64 * MIB)
    alloc = CachingAllocator(cfg)
    alloc.malloc("big", 100 * MIB)
    alloc.free("big")
    alloc.malloc("small", 30 * MIB)   # below max_split: may not take an oversize block
    assert alloc.reserved == 130 * MIB
    alloc.malloc("near", 90 * MIB)    # oversize and within 20 MiB of the cached 100 MiB: reuse, unsplit
    assert alloc.reserved == 130 * MIB and alloc.allocated == 130 * MIB


def test_expandable_segments_grow_in_pages_and_do_not_fragment():
    # the trace that fragments with plain segments (test_best_fit_and_fragmentation) fits in one
    # growing segment: 40 + 40 (4 pages of 20 MiB); free a, ask 50: the tail grows by 60 MiB
    # to 140 MiB and... the freed 40 MiB at the front stays cached: expandable avoids slivers,
    # not holes. A request that fits the hole takes it.
    cfg = AllocatorConfig(expandable_segments=True)
    alloc = CachingAllocator(cfg)
    alloc.malloc("a", 40 * MIB)
    alloc.malloc("b", 40 * MIB)
    assert alloc.reserved == 80 * MIB and alloc.segments == 1
    alloc.free("a")
    alloc.malloc("c", 30 * MIB)       # fits the freed 40 MiB at the front, split at 512 B granularity
    assert alloc.reserved == 80 * MIB and alloc.allocated == 70 * MIB
    alloc.malloc("d", 3 * MIB)        # a 1-10 MiB request: from the 10 MiB left in the hole
    assert alloc.reserved == 80 * MIB
    alloc.malloc("e", 25 * MIB)       # no hole fits: map 2 pages (40 MiB) at the end
    assert alloc.reserved == 120 * MIB and alloc.segments == 1


def test_capacity_releases_cache_before_running_out():
    cfg = AllocatorConfig(capacity=100 * MIB)
    alloc = CachingAllocator(cfg)
    alloc.malloc("a", 60 * MIB)
    alloc.free("a")                    # cached, whole segment
    alloc.malloc("b", 70 * MIB)        # 60 cached + 70 > 100: release the cache, then cudaMalloc
    assert alloc.reserved == 70 * MIB and not alloc.ran_out
    alloc.malloc("c", 40 * MIB)
    assert alloc.ran_out


def test_cpu_allocator_is_exact():
    stats = replay([("a", 1000), ("b", 3 * MIB), ("a", None), ("c", 7)], AllocatorConfig(caching=False))
    assert stats.allocated_peak_bytes == stats.reserved_peak_bytes == 1000 + 3 * MIB


def test_blocks_are_reused_only_on_their_stream():
    alloc = CachingAllocator()
    alloc.malloc("a", 40 * MIB, 0)
    alloc.free("a")
    alloc.malloc("b", 40 * MIB, 1)     # a side stream (e.g. an all-gather stream) cannot take it
    assert alloc.reserved == 80 * MIB
    alloc.malloc("c", 40 * MIB, 0)     # the compute stream can
    assert alloc.reserved == 80 * MIB


def test_expandable_best_fit_passes_over_the_free_tail():
    # c10/cuda/CUDACachingAllocator.cpp get_free_block(): with expandable segments a block is ranked by
    # its expandable size (its size + the unmapped space behind it), so the free tail goes last.
    # Hand-worked (large pool, 20 MiB pages): a 40 -> 2 pages, a=[0,40); b 10 -> 1 page, b=[40,50),
    # tail [50,60) free; free a -> hole [0,40). c 8: by size the tail (10) fits best, but its
    # expandable size is unbounded, so c takes the hole: c=[0,8), hole [8,40). d 10: the tail again
    # loses to the hole: d=[8,18), hole [18,40) of 22 MiB. e 30: nothing mapped fits; the tail maps one
    # more page (10 + 20 = 30): reserved 80 MiB. (Plain best fit would have put c and d in the tail
    # and e in the 30 MiB hole: 60 MiB.)
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    alloc.malloc("a", 40 * MIB)
    alloc.malloc("b", 10 * MIB)
    assert alloc.reserved == 60 * MIB
    alloc.free("a")
    alloc.malloc("c", 8 * MIB)
    assert alloc.live["c"][0].addr == 0
    alloc.malloc("d", 10 * MIB)
    assert alloc.live["d"][0].addr == 8 * MIB and alloc.reserved == 60 * MIB
    alloc.malloc("e", 30 * MIB)
    assert alloc.live["e"][0].addr == 50 * MIB and alloc.reserved == 80 * MIB and alloc.segments == 1


def test_expandable_segments_keep_the_max_split_rules():
    # get_free_block(): "Do not return an oversized block" holds with expandable segments as well;
    # try_allocate_expandable_block() then maps pages at the segment's end -- or, when the refused
    # block is the free tail (followed by unmapped space), hands that same block out.
    cfg = AllocatorConfig(expandable_segments=True, max_split_size=64 * MIB)
    alloc = CachingAllocator(cfg)
    alloc.malloc("x", 100 * MIB)      # 5 pages, x=[0,100)
    alloc.malloc("y", 20 * MIB)       # 1 page, y=[100,120): no free tail
    alloc.free("x")                   # an interior 100 MiB hole, oversize (>= 64 MiB)
    alloc.malloc("s", 30 * MIB)       # below max_split: the hole is refused; 2 pages mapped at 120
    assert alloc.live["s"][0].addr == 120 * MIB and alloc.reserved == 160 * MIB
    tail = CachingAllocator(cfg)
    tail.malloc("big", 100 * MIB)
    tail.free("big")                  # the whole segment is the free tail
    tail.malloc("small", 30 * MIB)    # refused as oversize by best fit, taken by the expandable path
    assert tail.reserved == 100 * MIB and tail.live["small"][0].addr == 0


def _loss_steps(lengths):
    """A step's vocab-sized loss tensors, in units of one row of bf16 logits (L MiB at length L): the
    saved fp32 log-probs S (4L), then the bf16 logits A (2L), the fp32 cast C (4L) and the bf16 shift
    copy B (2L); A, C, B freed at the forward's end; backward's two fp32 gradients E, F (4L each)
    while S lives; then all freed (memory.py's loss events; the step ends with nothing of it live)."""
    events = []
    for k, n in enumerate(lengths):
        fwd = [(f"S{k}", 4 * n), (f"A{k}", 2 * n), (f"C{k}", 4 * n), (f"B{k}", 2 * n)]
        events += [(key, size * MIB) for key, size in fwd]
        events += [(f"A{k}", None), (f"C{k}", None), (f"B{k}", None)]
        events += [(f"E{k}", 4 * n * MIB), (f"F{k}", 4 * n * MIB), (f"E{k}", None), (f"F{k}", None), (f"S{k}", None)]
    return events


def test_growing_and_shrinking_steps_worked_by_hand():
    """Steps at 10, 12, 11, 14 through get_free_block (best fit), should_split (large pool: remainder
    > 1 MiB), free_block's merging and get_allocation_size (>= 10 MiB: the request rounded to 2 MiB;
    every size here is a multiple of 2 MiB):
    10: S 40, A 20, C 40, B 20 are new segments; E takes C's freed 40; F is new: 40+20+40+20+40 = 160.
    12: S 48 new; A 24 splits the lowest free 40 (S's old one); C 48 new; B 24 splits the other free
        40; A, C, B freed (each merges back whole); E 48 takes C's; F 48 new: 160 + 3 x 48 = 304.
    11 (not the longest so far): S 44, C 44, E 44, F 44 split the three 48s; A, B 22 split 40s;
        no cudaMalloc: 304.
    14: three more new segments of 56 (S, C/E, F): 304 + 168 = 472.
    The same steps longest first: only the first step's 56+28+56+28+56 = 224; every later tensor
    fits a cached block."""
    reserved = [replay(_loss_steps([10, 12, 11, 14][:i])).reserved_peak_bytes // MIB for i in range(1, 5)]
    assert reserved == [160, 304, 304, 472]
    assert replay(_loss_steps([14, 12, 11, 10])).reserved_peak_bytes // MIB == 224
    assert replay(_loss_steps([14, 12, 11, 10])).num_segments == 5
