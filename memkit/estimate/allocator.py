"""A model of PyTorch's CUDA caching allocator, replayed over the estimate's own alloc/free events.

Rules from pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator):
- round_size(): every request is rounded up to a multiple of kMinBlockSize = 512 bytes;
- get_pool(): requests <= kSmallSize (1 MiB) go to the small pool, larger ones to the large pool;
- get_allocation_size(): a new segment (cudaMalloc) is kSmallBuffer = 2 MiB for small requests,
  kLargeBuffer = 20 MiB for requests under kMinLargeAlloc = 10 MiB, else the request rounded up
  to kRoundLarge = 2 MiB;
- get_free_block(): best fit -- the smallest cached free block of the pool that is large enough
  (std::set ordered by (size, address), lower_bound); with max_split_size set, a request below it
  never takes an oversize block (>= max_split_size), and an oversize request takes a cached block
  only if it is less than kLargeBuffer (max_non_split_rounding_size) larger than the request;
- should_split(): the remainder of a found block becomes a free block if it is >= 512 bytes
  (small pool, or any pool with expandable_segments) or > 1 MiB (large pool, only for requests
  below max_split_size); otherwise the whole block is handed out and counted as allocated
  (alloc_found_block increases allocated_bytes by block->size);
- free_block() / try_merge_blocks(): a freed block merges with free neighbours of its segment;
- alloc_block() failing (over the device): release_available_cached_blocks() then
  release_cached_blocks() return whole free segments to the driver and the cudaMalloc is retried;
- garbage_collection_threshold: once reserved memory passes that fraction of the allowed memory,
  garbage_collect_cached_blocks() frees cached whole segments before a new cudaMalloc (torch frees
  the least recently reused ones first; this model frees all whole free segments -- a bound);
- expandable_segments (Note [Expandable Segments]): one segment per pool that grows by pages,
  2 MiB for the small pool and 20 MiB for the large pool, mapped at the end; the tail is unmapped
  when memory runs out. get_free_block() ranks the free tail by its expandable size (its own plus
  the unmapped address space behind it), so any other fitting block goes first; the max_split_size
  rules still apply, and a tail they refuse is handed out whole by try_allocate_expandable_block().

max_memory_allocated() is the peak of allocated block sizes; max_memory_reserved() the peak of
segment sizes. `caching=False` models the CPU allocator (c10/core/impl/alloc_cpu.cpp: each
tensor is its own malloc, freed at once), where reserved == allocated == requested bytes.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from memkit.units import MIB

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 * MIB
K_SMALL_BUFFER = 2 * MIB
K_LARGE_BUFFER = 20 * MIB
K_MIN_LARGE_ALLOC = 10 * MIB
K_ROUND_LARGE = 2 * MIB


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings memkit models (c10/cuda/CUDAAllocatorConfig.cpp)."""

    caching: bool = True
    """False: the CPU allocator (no cache: reserved == allocated == requested)."""
    max_split_size: int | None = None
    """max_split_size_mb in bytes; None = unlimited (the default, SIZE_MAX)."""
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    capacity: int | None = None
    """Bytes the allocator can obtain from the driver (device total minus what lives outside it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayStats:
    allocated_peak_bytes: int
    """max_memory_allocated(): peak of allocated block sizes (rounded, unsplit remainders)."""
    reserved_peak_bytes: int
    """max_memory_reserved(): peak of segment bytes held from the driver."""
    requested_peak_bytes: int
    """Peak of the requested (unrounded) bytes: what the phase walk sums."""
    num_segments: int
    ran_out: bool = False
    """A cudaMalloc would have failed even after releasing the cache (CUDA OOM)."""


def round_size(size: int) -> int:
    """round_size(): at least 512 bytes, a multiple of 512 (roundup_power2_divisions unset)."""
    return K_MIN_BLOCK if size < K_MIN_BLOCK else -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size: int) -> int:
    """get_allocation_size(): the segment a cudaMalloc for a rounded request of `size` gets."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "small", "prev", "next", "free")

    def __init__(self, addr: int, size: int, small: tuple[int, bool]):
        self.addr, self.size, self.small = addr, size, small
        self.prev = self.next = None
        self.free = True


_ADDR_BITS = 64
"""A pool holds its free blocks as the ints size << _ADDR_BITS | addr, sorted: the order of
(size, addr) pairs (std::set's BlockComparatorSize, size then address) with int compares.
Addresses stay below 2**64: segments are laid out from 0 with 20 MiB gaps (_new_memory), and each
new expandable mapping moves the next address on by 2**40 (_expand), so a replay would need 2**24
of those to get there."""
_ADDR_MASK = (1 << _ADDR_BITS) - 1


class CachingAllocator:
    """One device's allocator state; `malloc` / `free` by caller-chosen keys."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig()):
        self.cfg = config
        # (stream, small) -> free blocks, sorted (_ADDR_BITS): blocks are reused only on the
        # stream that allocated them ("Allocations are associated with a stream", file header).
        self.pools: dict[tuple[int, bool], list[int]] = {}
        self.blocks: dict[int, _Block] = {}  # addr -> free block in a pool
        self.live: dict[object, tuple[_Block | None, int]] = {}
        self.expandable: dict[tuple[int, bool], _Block] = {}  # pool -> last block of its expandable segment
        self.next_addr = 0
        self.allocated = self.reserved = self.requested = 0
        self.allocated_peak = self.reserved_peak = self.requested_peak = 0
        self.segments = 0
        self.ran_out = False

    # -- public -------------------------------------------------------------------------
    def malloc(self, key: object, size: int, stream: int = 0) -> None:
        live = self.live
        if key in live:
            raise ValueError(f"allocation key {key!r} is already live")
        self.requested += size
        if self.requested > self.requested_peak:
            self.requested_peak = self.requested
        cfg = self.cfg
        if not cfg.caching:
            live[key] = (None, size)
            self.allocated = self.reserved = self.requested
            self.allocated_peak = self.reserved_peak = self.requested_peak
            return
        rounded = K_MIN_BLOCK if size < K_MIN_BLOCK else -(-size // K_MIN_BLOCK) * K_MIN_BLOCK  # round_size()
        small = (stream, rounded <= K_SMALL_SIZE)
        block = self._find_free(rounded, small)
        if block is None:
            block = self._new_memory(rounded, small)
        remaining = block.size - rounded
        # should_split(): the remainder is cached when >= 512 B (small pool or expandable
        # segments), or > 1 MiB (large pool, a request below max_split_size)
        if remaining >= K_MIN_BLOCK and (remaining > K_SMALL_SIZE or small[1] or cfg.expandable_segments) and (
                small[1] or cfg.expandable_segments or cfg.max_split_size is None or rounded < cfg.max_split_size):
            self._split(block, rounded)
        block.free = False  # alloc_found_block()
        live[key] = (block, size)
        self.allocated += block.size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated

    def free(self, key: object) -> None:
        block, size = self.live.pop(key)
        self.requested -= size
        if block is None:
            self.allocated = self.reserved = self.requested
            return
        self.allocated -= block.size
        block.free = True
        other = block.prev
        if other is not None and other.free:  # try_merge_blocks(), the block before
            self._pool_remove(other)
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
            block.size += other.size
        other = block.next
        if other is not None and other.free:  # and the block after
            self._pool_remove(other)
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
            if self.expandable and self.expandable.get(block.small) is other:
                self.expandable[block.small] = block
            block.size += other.size
        self._pool_insert(block)

    def stats(self) -> ReplayStats:
        return ReplayStats(allocated_peak_bytes=self.allocated_peak, reserved_peak_bytes=self.reserved_peak,
                           requested_peak_bytes=self.requested_peak, num_segments=self.segments,
                           ran_out=self.ran_out)

    def free_blocks(self, stream: int = 0, small: bool = False) -> list[tuple[int, int]]:
        """The pool's cached free blocks as (size, addr), in best-fit order."""
        return [(entry >> _ADDR_BITS, entry & _ADDR_MASK) for entry in self.pools.get((stream, small), ())]

    # -- pools ----------------------------------------------------------------------------
    def _pool_insert(self, block: _Block) -> None:
        pool = self.pools.get(block.small)
        if pool is None:
            pool = self.pools[block.small] = []
        insort(pool, block.size << _ADDR_BITS | block.addr)
        self.blocks[block.addr] = block

    def _pool_remove(self, block: _Block) -> None:
        pool = self.pools[block.small]
        del pool[bisect_left(pool, block.size << _ADDR_BITS | block.addr)]
        del self.blocks[block.addr]

    def _find_free(self, size: int, small: tuple[int, bool]) -> _Block | None:
        """get_free_block(): best fit, with the max_split_size rules for oversize blocks."""
        pool = self.pools.get(small)
        if not pool:
            return None
        i = bisect_left(pool, size << _ADDR_BITS)
        if i == len(pool):
            return None
        if self.expandable:
            tail = self.expandable.get(small)
            if tail is not None and pool[i] & _ADDR_MASK == tail.addr and i + 1 < len(pool):
                # get_free_block() with expandable segments: best fit by the size a block can expand
                # to, its own plus the unmapped rest of the segment behind it, so the free tail is passed
                # over for the next block in size order (any other block's expandable size is its size)
                i += 1
        addr = pool[i] & _ADDR_MASK
        block = self.blocks[addr]
        limit = self.cfg.max_split_size
        if limit is not None:  # get_free_block(): the oversize rules hold with expandable segments too
            if size < limit <= block.size:
                return None
            if size >= limit and block.size >= size + K_LARGE_BUFFER:
                return None
        del pool[i]  # _pool_remove(block): it is pool[i]
        del self.blocks[addr]
        return block

    def _split(self, block: _Block, size: int) -> None:
        rest = _Block(block.addr + size, block.size - size, block.small)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        if self.expandable and self.expandable.get(block.small) is block:
            self.expandable[block.small] = rest
        self._pool_insert(rest)

    # -- segments -------------------------------------------------------------------------
    def _grow(self, nbytes: int) -> None:
        cap = self.cfg.capacity
        if cap is None:  # no device limit: nothing to release (the planner's first replay)
            self.reserved += nbytes
            if self.reserved > self.reserved_peak:
                self.reserved_peak = self.reserved
            return
        threshold = self.cfg.garbage_collection_threshold
        if cap is not None and threshold > 0 and self.reserved + nbytes > threshold * cap:
            self._release_cached()  # garbage_collect_cached_blocks()
        if cap is not None and not self.ran_out and self.reserved + nbytes > cap:
            self._release_cached()  # release_cached_blocks(), then the cudaMalloc is retried
            # Still over: CUDA OOM. The replay goes on (caching, no more releases) to report
            # how much the sequence would have needed.
            self.ran_out = self.reserved + nbytes > cap
        self.reserved += nbytes
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def _new_memory(self, size: int, small: bool) -> _Block:
        if self.cfg.expandable_segments:
            return self._expand(size, small)
        seg = allocation_size(size)
        self._grow(seg)
        self.segments += 1
        block = _Block(self.next_addr, seg, small)
        self.next_addr += seg + K_LARGE_BUFFER  # segments are never adjacent
        return block

    def _expand(self, size: int, small: bool) -> _Block:
        """Map pages at the end of the pool's one segment until the free tail holds `size`."""
        page = K_SMALL_BUFFER if small[1] else K_LARGE_BUFFER
        tail = self.expandable.get(small)
        have = tail.size if (tail is not None and tail.free) else 0
        # try_allocate_expandable_block(): a free tail already as large as the request is taken as it is
        # (get_free_block() refused it as oversize, max_split_size); else map the missing pages
        add = max(0, -(-(size - have) // page) * page)
        self._grow(add)
        if tail is not None and tail.free:
            self._pool_remove(tail)
            tail.size += add
            return tail
        block = _Block(self.next_addr, add, small)
        if tail is not None:
            block.addr = tail.addr + tail.size
            tail.next, block.prev = block, tail
        else:
            self.segments += 1
        self.next_addr = max(self.next_addr, block.addr + add) + (1 << 40)
        self.expandable[small] = block
        return block

    def _release_cached(self) -> None:
        """release_cached_blocks(): return every whole free segment (or free expandable tail)."""
        for small in list(self.pools):
            for entry in list(self.pools[small]):
                block = self.blocks[entry & _ADDR_MASK]
                if block.prev is None and block.next is None:
                    self._pool_remove(block)
                    self.reserved -= block.size
                    self.segments -= 1
                    if self.expandable.get(small) is block:
                        del self.expandable[small]
                elif self.cfg.expandable_segments and self.expandable.get(small) is block:
                    page = K_SMALL_BUFFER if small[1] else K_LARGE_BUFFER
                    unmap = block.size // page * page
                    if unmap:
                        self._pool_remove(block)
                        block.size -= unmap
                        self.reserved -= unmap
                        if block.size:
                            self._pool_insert(block)
                        else:
                            block.prev.next = None
                            self.expandable[small] = block.prev


def replay(events, config: AllocatorConfig = AllocatorConfig()) -> ReplayStats:
    """Run `events` -- (key, size[, stream]) to allocate, (key, None) to free -- through the allocator."""
    alloc = CachingAllocator(config)
    malloc, free = alloc.malloc, alloc.free
    for event in events:
        if event[1] is None:
            free(event[0])
        else:
            malloc(*event)
    return alloc.stats()


def replay_on_device(events, *, caching: bool, expandable_segments: bool, capacity: int) -> ReplayStats:
    """`replay` on a device of `capacity` bytes for the allocator (device total minus what lives
    outside it). Over the capacity only through the cache, torch frees its cached segments and
    retries the failing cudaMalloc (CUDACachingAllocator.cpp malloc: release_cached_blocks, then
    alloc_block again): if that rescues the run, reserved is what it holds then; else the stats say
    what it needed (allocated over the capacity runs out whatever the cache does)."""
    stats = replay(events, AllocatorConfig(caching=caching, expandable_segments=expandable_segments))
    if capacity_binds(stats, caching=caching, capacity=capacity):
        capped = replay(events, AllocatorConfig(caching=True, capacity=capacity,
                                                expandable_segments=expandable_segments))
        if not capped.ran_out:
            return capped
    return stats


def capacity_binds(stats: ReplayStats, *, caching: bool, capacity: int) -> bool:
    """Whether replay_on_device's answer differs from the uncapped replay's `stats`: the cache alone
    takes it over the capacity, so torch's release-and-retry is replayed."""
    return caching and stats.allocated_peak_bytes <= capacity < stats.reserved_peak_bytes
