"""PyTorch's CUDA caching allocator, as ``c10/cuda/CUDACachingAllocator.cpp`` runs it.

PyTorch never returns GPU memory to the driver during training: it reserves *segments* with
``cudaMalloc`` and carves *blocks* out of them for tensors; a freed block goes back to a free
pool of its stream and is reused by a later request that fits. ``nvidia-smi`` (and
``torch.cuda.memory_reserved``) sees the segments, not the tensors, so the reserved peak is
above the allocated peak by the rounding and the holes between live blocks (fragmentation).

The rules modelled here, with the constants of ``CUDACachingAllocator.cpp`` (PyTorch 2.x,
default ``PYTORCH_CUDA_ALLOC_CONF``):

* ``round_size``: requests are rounded up to a multiple of ``kMinBlockSize`` = 512 bytes.
* ``get_pool``: requests of at most ``kSmallSize`` = 1 MiB go to the small pool, others to
  the large pool; pools are per stream (a block freed on one stream is reused only there).
* ``get_allocation_size``: a new segment is ``kSmallBuffer`` = 2 MiB for a small request,
  ``kLargeBuffer`` = 20 MiB for a request under ``kMinLargeAlloc`` = 10 MiB, otherwise the
  request rounded up to ``kRoundLarge`` = 2 MiB.
* ``get_free_block``: best fit, the smallest free block of the pool at least as large as the
  request (ties by address, the pool's ``BlockComparatorSize``).
* ``should_split``: a block larger than the request is split when the remainder is at least
  512 bytes (small pool) or more than ``kSmallSize`` = 1 MiB (large pool); otherwise the
  request gets the whole block.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment.
* ``release_cached_blocks``: only when ``cudaMalloc`` fails (the GPU is full) are whole free
  segments returned to the driver, and the allocation is retried; if it still fails, PyTorch
  raises out-of-memory.
* ``expandable_segments:True``: one segment per stream and pool grows by mapping 2 MiB pages
  (``CUDAAllocatorConfig``; ``ExpandableSegment``) instead of a new ``cudaMalloc``; modelled as
  requests that never need a fresh segment beyond the 2 MiB page rounding of the live tail.

Every operation is O(log n) in the number of free blocks of its pool (sorted lists searched
with :mod:`bisect`), so the allocator costs little beside the engine.

Examples
--------
>>> a = CachingAllocator()
>>> h = a.malloc(3 * MIB)          # a 3 MiB request gets a 20 MiB segment
>>> a.reserved / MIB, a.allocated / MIB
(20.0, 3.0)
>>> a.free(h)
>>> a.reserved / MIB, a.allocated / MIB   # the segment stays cached
(20.0, 0.0)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIB = 1 << 20
K_MIN_BLOCK_SIZE = 512
"""Every block is a multiple of this many bytes (``kMinBlockSize``)."""
K_SMALL_SIZE = 1 * MIB
"""Largest request served from the small pool (``kSmallSize``)."""
K_SMALL_BUFFER = 2 * MIB
"""Segment size of the small pool (``kSmallBuffer``)."""
K_LARGE_BUFFER = 20 * MIB
"""Segment size for large requests under ``kMinLargeAlloc`` (``kLargeBuffer``)."""
K_MIN_LARGE_ALLOC = 10 * MIB
"""Requests from this size get a segment of their own size (``kMinLargeAlloc``)."""
K_ROUND_LARGE = 2 * MIB
"""Such segments are rounded up to this (``kRoundLarge``)."""


def round_size(size: float) -> int:
    """Bytes of the block a request of ``size`` bytes needs (``round_size``).

    Examples
    --------
    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    n = int(size)
    if n < size:
        n += 1
    if n <= K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * -(-n // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """Bytes of the segment ``cudaMalloc`` reserves for a request the pool cannot serve
    (``get_allocation_size``).

    Examples
    --------
    >>> [allocation_size(s) // MIB for s in (4096, 3 * MIB, 10 * MIB, 11 * MIB + 1)]
    [2, 20, 10, 12]
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


@dataclass(eq=False)
class Block:
    """A piece of a segment: allocated to a tensor or free in its pool."""

    addr: int
    size: int
    segment: int
    pool: tuple[bool, str]
    """(small pool?, stream)."""
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None


class CachingAllocator:
    """One GPU's caching allocator.

    Parameters
    ----------
    capacity:
        Bytes the allocator may reserve before ``cudaMalloc`` fails (the GPU's memory less
        what the CUDA context and libraries outside PyTorch hold); unlimited by default.
    expandable_segments:
        PyTorch's ``expandable_segments:True`` option.

    Attributes
    ----------
    reserved, allocated:
        Bytes in segments (what ``nvidia-smi`` counts for PyTorch) and in allocated blocks.
    peak_reserved, peak_allocated:
        Their maxima so far.
    oom:
        A request failed even after releasing the cached segments (PyTorch would raise
        ``OutOfMemoryError``; the model books the segment anyway and carries on).
    """

    def __init__(self, capacity: float = float("inf"), expandable_segments: bool = False
                 ) -> None:
        self.capacity = capacity
        self.expandable = expandable_segments
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.oom = False
        self.retries = 0
        """Times the cached segments were released to retry a failed ``cudaMalloc``."""
        self._free: dict[tuple[bool, str], list[tuple[int, int]]] = {}
        self._blocks: dict[int, Block] = {}     # by address: free blocks of every pool
        self._live: dict[int, Block] = {}       # allocated blocks by address
        self._segments: dict[int, int] = {}     # segment id -> bytes
        self._next_segment = 1
        self._tail: dict[tuple[bool, str], Block] = {}   # expandable: last block of a pool
        self._next_addr = 0

    # ------------------------------------------------------------------ public
    def malloc(self, size: float, stream: str = "compute") -> int:
        """Allocate a block for ``size`` bytes on ``stream``; returns its handle (address)."""
        rsize = round_size(size)
        pool = (rsize <= K_SMALL_SIZE, stream)
        block = self._take_free(pool, rsize)
        if block is None:
            grow = self._growth(pool, rsize)
            if self.reserved + grow > self.capacity:
                # cudaMalloc failed: free every cached whole segment and try again.
                self.retries += 1
                self._release_cached()
                grow = self._growth(pool, rsize)
                if self.reserved + grow > self.capacity:
                    self.oom = True
            block = self._new_memory(pool, rsize)
        if self._splits(pool[0], block.size - rsize):
            rest = Block(block.addr + rsize, block.size - rsize, block.segment, pool,
                         prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rsize
            self._insert_free(rest)
        block.allocated = True
        self._live[block.addr] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.addr

    def free(self, handle: int) -> None:
        """Return a block to its pool, merged with free neighbours (``free_block``)."""
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and not nb.allocated:
                self._remove_free(nb)
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        self._insert_free(block)

    def size_of(self, handle: int) -> int:
        """Bytes of the allocated block ``handle``."""
        return self._live[handle].size

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _splits(small: bool, remaining: int) -> bool:
        """``should_split`` with the default ``max_split_size``."""
        return remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE

    def _take_free(self, pool: tuple[bool, str], size: int) -> Block | None:
        """Best fit: the smallest free block of ``pool`` holding ``size`` bytes."""
        free = self._free.get(pool)
        if not free:
            return None
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        _, addr = free.pop(i)
        return self._blocks.pop(addr)

    def _insert_free(self, block: Block) -> None:
        if block.next is None and block.pool in self._tail:
            self._tail[block.pool] = block      # the end of an expandable segment
        self._blocks[block.addr] = block
        bisect.insort(self._free.setdefault(block.pool, []), (block.size, block.addr))

    def _remove_free(self, block: Block) -> None:
        free = self._free[block.pool]
        i = bisect.bisect_left(free, (block.size, block.addr))
        del free[i]
        del self._blocks[block.addr]

    def _growth(self, pool: tuple[bool, str], size: int) -> int:
        """Bytes to reserve to serve ``size`` when no free block fits."""
        if not (self.expandable and not pool[0]):
            return allocation_size(size)
        tail = self._tail.get(pool)
        have = tail.size if tail is not None and not tail.allocated else 0
        return K_ROUND_LARGE * -(-(size - have) // K_ROUND_LARGE)

    def _new_memory(self, pool: tuple[bool, str], size: int) -> Block:
        """A fresh segment (``cudaMalloc``) or, with expandable segments, more pages mapped
        at the end of the pool's one segment (merged with a free block ending it)."""
        grow = self._growth(pool, size)
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if not (self.expandable and not pool[0]):
            seg = self._next_segment
            self._next_segment += 1
            self._segments[seg] = grow
            # Addresses only order blocks (ties in best fit); segments never touch.
            addr = self._next_addr
            self._next_addr += grow + K_ROUND_LARGE
            return Block(addr, grow, seg, pool)
        tail = self._tail.get(pool)
        if tail is not None and not tail.allocated:
            self._remove_free(tail)
            tail.size += grow
            self._segments[tail.segment] += grow
            return tail
        if tail is None:
            seg = self._next_segment
            self._next_segment += 1
            self._segments[seg] = 0
            addr = self._next_addr
            self._next_addr += 1 << 50          # room to grow
        else:
            seg, addr = tail.segment, tail.addr + tail.size
        self._segments[seg] += grow
        block = Block(addr, grow, seg, pool, prev=tail)
        if tail is not None:
            tail.next = block
        self._tail[pool] = block
        return block

    def _release_cached(self) -> None:
        """``release_cached_blocks``: free segments that are one whole free block are
        returned (with expandable segments, the free pages at the segment's end)."""
        for block in [b for b in self._blocks.values() if b.next is None
                      and (b.prev is None or self._tail.get(b.pool) is b)]:
            self._remove_free(block)
            self.reserved -= block.size
            self._segments[block.segment] -= block.size
            if self._tail.get(block.pool) is block:
                if block.prev is not None:
                    block.prev.next = None
                    self._tail[block.pool] = block.prev
                else:
                    del self._tail[block.pool]
            if not self._segments[block.segment]:
                del self._segments[block.segment]


class _Entry:
    """A live allocation the engine reported: its block and the bytes not yet freed."""

    __slots__ = ("handle", "left", "op", "mb_layer", "alive")

    def __init__(self, handle: int, left: float, op: int, mb_layer: tuple[object, ...]
                 ) -> None:
        self.handle = handle
        self.left = left
        self.op = op
        self.mb_layer = mb_layer
        self.alive = True


class TensorLedger:
    """Feeds one rank class's memory events to a :class:`CachingAllocator`.

    The engine reports memory as (category, bytes) allocations and frees of ops
    (:mod:`sim.program.ir`): each allocation of an op is one request to the allocator, on the
    op's stream. A free names only a category and a size, so it is matched to what it
    releases, most specific first: the newest allocation of the same micro-batch, layer and
    size (an op's working set; the activations a forward saved for its backward), of the
    same size, and otherwise the newest allocations of the category, of the
    same micro-batch and layer first (autograd frees in reverse order of the forward); a
    partly freed allocation keeps its block until the rest goes.
    """

    def __init__(self, allocator: CachingAllocator) -> None:
        self.allocator = allocator
        self._stack: dict[str, list[_Entry]] = {}
        self._by_key: dict[tuple[object, ...], list[_Entry]] = {}

    def alloc(self, category: str, nbytes: float, stream: str = "compute", op: int = -1,
              mb_layer: tuple[object, ...] = ()) -> None:
        """``nbytes`` of ``category`` allocated by op number ``op`` (-1: before the step)."""
        if nbytes <= 0:
            return
        e = _Entry(self.allocator.malloc(nbytes, stream), nbytes, op, mb_layer)
        size = round(nbytes)
        self._stack.setdefault(category, []).append(e)
        by_key = self._by_key
        for key in ((category, mb_layer, size), (category, size), (category, mb_layer)):
            stack = by_key.get(key)
            if stack is None:
                by_key[key] = [e]
            else:
                stack.append(e)

    def free(self, category: str, nbytes: float, op: int = -1,
             mb_layer: tuple[object, ...] = ()) -> None:
        """``nbytes`` of ``category`` freed by op number ``op``."""
        size = round(nbytes)
        exact: tuple[tuple[object, ...], ...] = ((category, mb_layer, size), (category, size))
        for key in exact:
            e = self._newest(key)
            if e is not None and abs(e.left - nbytes) <= 1.0:
                self._release(e)
                return
        left = nbytes
        partial: tuple[tuple[object, ...] | None, ...] = ((category, mb_layer), None)
        for part_key in partial:
            stack = (self._stack.get(category, []) if part_key is None
                     else self._by_key.get(part_key, []))
            while stack and not stack[-1].alive:
                stack.pop()
            i = len(stack) - 1
            dead = 0
            while left > 1.0 and i >= 0:
                e = stack[i]
                i -= 1
                if not e.alive:
                    dead += 1
                    continue
                take = min(e.left, left)
                e.left -= take
                left -= take
                if e.left <= 1.0:
                    self._release(e)
            if dead > 32:       # keep scans short: drop released entries
                stack[:] = [e for e in stack if e.alive]
            if left <= 1.0:
                return

    def live_bytes(self) -> dict[str, float]:
        """Bytes not yet freed, by category (what the engine's reports add up to)."""
        return {cat: sum(e.left for e in stack if e.alive) for cat, stack in self._stack.items()}

    def _newest(self, key: tuple[object, ...]) -> _Entry | None:
        stack = self._by_key.get(key)
        while stack and not stack[-1].alive:
            stack.pop()
        return stack[-1] if stack else None

    def _release(self, e: _Entry) -> None:
        e.alive = False
        e.left = 0.0
        self.allocator.free(e.handle)
