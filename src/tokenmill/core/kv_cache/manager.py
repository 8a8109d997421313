"""KV cache manager: which blocks each request holds. Hides the pool; answers "no room" with None.

A request's blocks cover its tokens in order: token at position p lives in block table entry
p // block_size, slot p % block_size.

Invariant: a block is in the prefix cache only once a step that wrote its KV has succeeded
(cache_computed_blocks, after the step; never at allocation), so no request ever takes as a prefix hit a
block whose KV a step has yet to write, or failed to write. The blocks a step will complete are noted
(note_computing) so that the scheduler holds back, for one step, a request whose next uncached block is
one of them (computes_next_block): it then hits that block instead of computing it again, as the n
completions of a request, or prompts sharing a system prompt, admitted together do.
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
        self.computing_hashes: set[bytes] = set()     # full blocks this step will complete, not yet cached
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

    def begin_step(self) -> None:
        """A new step: no block is being computed yet."""
        self.computing_hashes.clear()

    def note_computing(self, request: Request, num_tokens: int) -> None:
        """The step being scheduled computes the request's tokens up to num_tokens: the full blocks it
        completes are being computed (they join the prefix cache once it succeeds)."""
        if not self.enable_prefix_caching:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self.computing_hashes.update(request.block_hashes[self.num_cached_blocks.get(request.request_id, 0):num_full])

    def computes_next_block(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether the block after the request's num_hit_blocks prefix-cache hits is one this step computes
        for another request (admitted now, it would compute that block again)."""
        hashes = request.block_hashes
        return (num_hit_blocks < (request.num_tokens - 1) // self.block_size and num_hit_blocks < len(hashes)
                and hashes[num_hit_blocks] in self.computing_hashes)

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
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register in the prefix cache the request's full blocks among its computed tokens. Call it only
        after the step that computed them succeeded: from then on any request may read their KV."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
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

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so shared prefixes outlive it in the LRU). Its
        cached blocks keep their content: a successful step wrote it, whatever happened to the request since."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
