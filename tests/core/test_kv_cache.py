"""Block pool and KV cache manager with exact block ids: allocation order, prefix hits, LRU eviction,
reference counts, freeing."""
from __future__ import annotations

import pytest

from tokenmill.core.kv_cache.block_pool import BlockPool
from tokenmill.core.kv_cache.hashing import extend_block_hashes, hash_block
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """Prefix lookup + allocation for the whole prompt, then a successful step computing it, as the
    scheduler does; returns the block table."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    kv.record_prefix_lookup(r, n)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    return kv.block_ids(r.request_id)


def test_hashes_are_chained():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    extend_block_hashes(b, [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]                  # same tokens in block 1, different prefix
    assert a[0] == hash_block(None, [1, 2, 3, 4])


def test_allocation_takes_lowest_free_ids_in_order():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert admit(kv, req("a", range(10))) == [0, 1, 2]
    assert admit(kv, req("b", range(100, 105))) == [3, 4]
    assert kv.pool.num_free == 3


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))
    assert admit(kv, a) == [0, 1, 2]
    b = req("b", list(range(8)) + [50, 51, 52])
    hits, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and n == 8
    kv.allocate_slots(b, b.num_tokens - n, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.prefix_hits_tokens == 0                  # a lookup alone counts nothing
    kv.record_prefix_lookup(b, n)
    assert (kv.prefix_queries_tokens, kv.prefix_hits_tokens) == (10 + 11, 8)


def test_full_prompt_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, req("a", range(8)))
    hits, n = kv.get_computed_blocks(req("b", range(8)))
    assert n == 4 and [blk.block_id for blk in hits] == [0]


def test_free_then_lru_eviction_order():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])            # blocks 0, 1 (both full, cached)
    admit(kv, a)
    kv.free(a)                             # freed tail first: queue is 2, 3, 1, 0
    assert list(kv.pool.free_queue) == [2, 3, 1, 0]
    b = req("b", [9, 9, 9, 9, 9, 9])       # needs 3 blocks: takes 2, 3, then evicts 1 (a's tail)
    assert admit(kv, b) == [2, 3, 1]
    assert kv.pool.num_evictions == 1
    hits, n = kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5]))
    assert [blk.block_id for blk in hits] == [0] and n == 2   # a's first block survived, its second was evicted


def test_hit_on_free_cached_block_revives_it():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    admit(kv, a)
    kv.free(a)
    assert kv.pool.num_free == 4
    b = req("b", [1, 2, 7])
    assert admit(kv, b) == [0, 1]          # hit on block 0, then the queue front: a's uncached tail block
    assert kv.pool.blocks[0].ref_count == 1 and 0 not in kv.pool.free_queue


def test_no_room_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    admit(kv, req("a", range(8)))
    before = (kv.pool.num_free, dict(kv.req_blocks))
    assert kv.allocate_slots(req("b", range(100, 109)), 9) is None
    assert (kv.pool.num_free, dict(kv.req_blocks)) == before


def test_free_releases_every_block():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    rs = [req(str(i), range(i * 10, i * 10 + 7)) for i in range(3)]
    for r in rs:
        admit(kv, r)
    assert kv.pool.num_free == 0 and kv.usage == 1.0
    for r in rs:
        kv.free(r)
    assert kv.pool.num_free == 6 and kv.usage == 0.0
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, req("a", range(8)))
    hits, n = kv.get_computed_blocks(req("b", range(8)))
    assert hits == [] and n == 0 and kv.pool.cached == {}


def test_pool_rejects_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


def test_uncached_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = req("a", [1, 2, 3])                # block 0 full (cached), block 1 partial (nothing to keep)
    admit(kv, a)
    kv.free(a)
    assert list(kv.pool.free_queue) == [1, 2, 3, 4, 5, 0]
    kv_off = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    b = req("b", [1, 2, 3, 4])
    admit(kv_off, b)
    kv_off.free(b)                         # warm blocks first, most recently freed at the front
    assert list(kv_off.pool.free_queue) == [0, 1, 2, 3]


def test_a_block_joins_the_prefix_cache_only_once_its_tokens_are_computed():
    """Allocation caches nothing: until a step has written a block's KV, no other request may take it as a
    hit (that step may yet fail). Afterwards, only the full blocks among the computed tokens are cached."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))
    kv.allocate_slots(a, 10)
    assert kv.pool.cached == {} and kv.get_computed_blocks(req("b", range(10))) == ([], 0)
    a.num_computed_tokens = 6                  # a first chunk of 6 tokens computed: block 0 is full
    kv.cache_computed_blocks(a)
    hits, n = kv.get_computed_blocks(req("b", range(10)))
    assert [blk.block_id for blk in hits] == [0] and n == 4
