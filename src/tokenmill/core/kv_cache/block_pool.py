"""The pool of physical KV blocks: reference counts, the free list in eviction order, the prefix cache.

Invariants:
- a block is in the free queue iff its ref_count == 0;
- the free queue is ordered by eviction priority, `allocate` taking from the front: blocks holding no
  cached content come first (most recently freed at the very front, so warm memory is reused and a large
  pool is never touched more than the load needs), then cached blocks least-recently-freed first (LRU);
- `cached` maps a block hash to the block holding that content; a cached block may be free (ref 0,
  evictable) or in use. Evicting a block removes its hash from `cached`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None       # set once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the front of the free queue (evicting their cached content)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (they may be free)."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; a block reaching 0 joins the queue's end.
        Callers pass a request's blocks last-first so its tail is evicted before its shared prefix."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"KV block {block.block_id} freed more often than taken"
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:   # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that `block` holds the full content named by `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:      # same content already cached in another block: keep that one
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.num_evictions += 1
            block.block_hash = None
