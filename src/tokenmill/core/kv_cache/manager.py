"""KV cache manager: which blocks each request holds. Hides the pool; answers "no room" with None.

A request's blocks cover its tokens in order: token at position p lives in block table entry
p // block_size, slot p % block_size. Full blocks are registered in the prefix cache as soon as the step
that computes their last token is scheduled (their token ids are known then).
"""
from __future__ import annotations

from tokenmill.core.kv_cache.block_pool import BlockPool, KVBlock
from tokenmill.core.kv_cache.hashing import extend_block_hashes
from tokenmill.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks of each request already in the cache
        self.prefix_queries_tokens = 0                # tokens looked up in the prefix cache, once per admission
        self.prefix_hits_tokens = 0                   # of which found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (free cached blocks do not count)."""
        return self.pool.num_used / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, as (blocks, num_tokens). At least one token is
        always left to compute, since the step that computes the last token produces the logits. A lookup
        changes nothing, counters included (record_prefix_lookup counts the one an admission used)."""
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count the lookup that admitted `request` (its tokens queried, num_hit_tokens of them found): once
        per admission, however many steps it waited at the head of the queue."""
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += request.num_tokens
            self.prefix_hits_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones (plus the
        prefix-cache hits in `computed_blocks`, for a request not yet holding blocks). Returns the newly
        allocated blocks, or None (and changes nothing) when the pool cannot provide them."""
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(held) - len(computed_blocks)
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_needed > self.pool.num_free - num_evictable_hits:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> bool:
        """Free the request's trailing blocks past those num_tokens tokens need (speculative decoding:
        blocks that only rejected drafts filled); whether any were. Such blocks were never cached: a block
        is cached only once full of the request's own tokens."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return False
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free(list(reversed(extra)))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request: Request, drop_cached: bool = False) -> None:
        """Release every block of the request (tail first, so shared prefixes outlive it in the LRU).
        drop_cached: its blocks that no other request holds leave the prefix cache (their content is not
        to be trusted, e.g. after a failed step)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)), drop_cached)
