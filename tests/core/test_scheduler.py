"""The token-budget scheduler driven by a fake model (next token = a function of the whole context), with
exact budgets, block ids, preemption and abort."""
from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.core.decode_yield import DecodeYieldMeter
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.messages import RunnerOutput
from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


def fake_next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 1000 + 1


def make(num_blocks=32, block_size=4, budget=16, max_seqs=8, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_model_len=1024), kv)


def request(rid: str, n_prompt: int, max_tokens: int, start: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start, start + n_prompt)), params)


def step(s: Scheduler):
    out = s.schedule()
    sampled = {}
    for sr in out.scheduled:
        if sr.sample:
            ctx = list(s.requests[sr.request_id].all_token_ids)
            sampled[sr.request_id] = [fake_next_token(ctx)]
    s.update(out, RunnerOutput(sampled))
    return out


def run_all(s: Scheduler, reqs: list[Request], max_steps=1000) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    for _ in range(max_steps):
        if s.num_unfinished == 0:
            break
        step(s)
    return {r.request_id: r.output_token_ids for r in reqs}


def test_step_mixes_decodes_and_prefill_chunks_within_budget():
    s = make(budget=10)
    s.add_request(request("a", 3, 5))
    out = step(s)
    assert [(sr.request_id, sr.num_new_tokens, sr.start_position) for sr in out.scheduled] == [("a", 3, 0)]
    s.add_request(request("b", 20, 5, start=100))
    out = step(s)                          # a decodes 1 token, b gets a 9-token chunk
    assert [(sr.request_id, sr.num_new_tokens, sr.sample) for sr in out.scheduled] == [("a", 1, True), ("b", 9, False)]
    out = step(s)
    assert [(sr.request_id, sr.num_new_tokens, sr.start_position) for sr in out.scheduled] == [("a", 1, 4), ("b", 9, 9)]
    out = step(s)                          # b's last 2 prompt tokens: it samples its first token
    assert [(sr.request_id, sr.num_new_tokens, sr.sample) for sr in out.scheduled] == [("a", 1, True), ("b", 2, True)]
    assert s.requests["b"].num_output_tokens == 1


def test_block_tables_are_exact():
    s = make(block_size=4, budget=64)
    s.add_request(request("a", 6, 4))
    s.add_request(request("b", 3, 4, start=50))
    out = step(s)
    assert [sr.block_ids for sr in out.scheduled] == [[0, 1], [2]]
    step(s)                                 # a: 7 tokens (2 blocks), b: 4 tokens (1 block)
    out = step(s)                           # a: position 7 fits block 1; b: position 4 needs block 3
    assert [sr.block_ids for sr in out.scheduled] == [[0, 1], [2, 3]]


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2, budget=100)
    for i in range(3):
        s.add_request(request(str(i), 4, 3, start=10 * i + 1))
    out = step(s)
    assert [sr.request_id for sr in out.scheduled] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preemption_then_resumption_gives_same_tokens():
    reqs = lambda: [request(str(i), 6, 12, start=7 * i + 1) for i in range(4)]
    roomy = run_all(make(num_blocks=64), reqs())
    tight = make(num_blocks=9)             # 4 requests x up to 5 blocks each cannot all fit
    got = run_all(tight, reqs())
    assert tight.num_preemptions_total > 0
    assert got == roomy
    assert tight.kv.pool.num_free == 9


def test_preempted_request_is_the_latest_and_resumes_first():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(request("old", 7, 20))
    s.add_request(request("new", 7, 20, start=100))
    step(s)                                # both admitted: 2 blocks each, pool full; 8 tokens each
    step(s)                                # position 7 still fits in block 1
    out = step(s)                          # old needs a 3rd block: the latest arrival is preempted
    assert out.preempted_request_ids == ["new"]
    assert [sr.request_id for sr in out.scheduled] == ["old"]
    assert s.requests["new"].status == RequestStatus.PREEMPTED and s.requests["new"].num_computed_tokens == 0
    assert s.waiting[0].request_id == "new"
    assert s.requests["old"].status == RequestStatus.RUNNING


def test_abort_frees_every_block_at_any_time():
    s = make(num_blocks=16, budget=6)
    s.add_request(request("a", 10, 50))
    s.add_request(request("b", 10, 50, start=40))
    step(s)                                 # a mid-prefill, b waiting
    s.finish_requests(["a"], FinishReason.ABORT)
    s.finish_requests("b", FinishReason.ABORT)
    assert s.num_unfinished == 0
    assert s.kv.pool.num_free == 16 and s.kv.usage == 0.0
    out = s.schedule()
    assert out.is_empty and sorted(out.finished_request_ids) == ["a", "b"]


def test_prompt_that_never_fits_is_a_clear_error():
    s = make(num_blocks=2, block_size=4)
    try:
        s.add_request(request("big", 8, 4))
    except ValueError as e:
        assert "8 prompt tokens" in str(e) and "8 tokens" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_request_never_outgrows_the_pool():
    s = make(num_blocks=3, block_size=4)
    got = run_all(s, [request("a", 4, 100)])
    assert len(got["a"]) == 8               # capped at the 12-token pool
    assert s.kv.pool.num_free == 3


def _decoding_with_drafts(s: Scheduler, rid: str, drafts: list[int]) -> Request:
    r = request(rid, 3, 20, start=10 * len(s.requests) + 1)
    s.add_request(r)
    step(s)                                        # its prefill; it now decodes
    r.spec_token_ids = list(drafts)
    return r


def test_drafts_take_only_the_budget_that_prefill_leaves():
    s = make(budget=8)
    a = _decoding_with_drafts(s, "a", [7, 7, 7, 7])
    s.add_request(request("b", 6, 4, start=100))   # waiting: its prefill comes before a's drafts
    out = s.schedule()
    by_id = {sr.request_id: sr for sr in out.scheduled}
    assert by_id["b"].num_new_tokens == 6
    assert by_id["a"].num_new_tokens == 2 and by_id["a"].num_draft_tokens == 1    # 8 - 1 - 6 left
    assert list(by_id["a"].token_ids) == [a.all_token_ids[-1], 7]
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]                   # running first still


def test_drafts_get_every_token_left_without_prefill_and_never_preempt():
    s = make(budget=16)
    _decoding_with_drafts(s, "a", [5, 6, 7])
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 3 and out.scheduled[0].num_new_tokens == 4
    # a pool with no block to spare: the drafts are dropped, no one is preempted
    s = make(num_blocks=3, budget=16)
    a = _decoding_with_drafts(s, "a", [5, 6, 7, 8, 9])       # decodes position 4 (then 5): blocks 0, 1
    b = _decoding_with_drafts(s, "b", [1, 2])                # decodes position 3: block 2, the last one
    out = s.schedule()
    assert not out.preempted_request_ids and {sr.request_id for sr in out.scheduled} == {"a", "b"}
    assert all(sr.num_draft_tokens == 0 for sr in out.scheduled)
    assert a.status == b.status == RequestStatus.RUNNING


def test_a_prompt_granted_a_chunk_but_no_blocks_leaves_the_budget_to_the_drafts():
    """b's 13-token prompt is granted its chunk, then finds 3 free blocks of the 4 it needs: it waits, and
    the grant goes back whole, so a's drafts get the tokens b did not use and a counts as fully drafted."""
    s = make(num_blocks=4, block_size=4, budget=16)
    _decoding_with_drafts(s, "a", [5, 6, 7, 8])
    s.add_request(request("b", 13, 2, start=100))
    out = s.schedule()
    assert [(sr.request_id, sr.num_draft_tokens) for sr in out.scheduled] == [("a", 4)]
    assert out.num_requests_drafts_withheld == 0
    assert [r.request_id for r in s.waiting] == ["b"]


def test_a_prefix_lookup_counts_once_per_admission_however_long_the_request_waited():
    """b shares a's first 2 blocks but waits 3 steps for a block of its own, until a finishes: its lookup
    counts once, when it is admitted."""
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(request("a", 12, 4))                 # 3 blocks, then the 4th for its output
    step(s)
    b = Request("b", list(range(1, 9)) + [100, 101, 102, 103], SamplingParams(max_tokens=2, ignore_eos=True))
    s.add_request(b)
    steps = 0
    while b.status == RequestStatus.WAITING:
        step(s)
        steps += 1
    assert steps == 4 and b.num_cached_tokens == 8
    assert (s.kv.prefix_queries_tokens, s.kv.prefix_hits_tokens) == (12 + 12, 0 + 8)


def test_drafts_accepted_past_a_stop_token_are_not_counted():
    """n-gram drafts that repeat a stop token, all accepted: the request ends at the first one, and the
    counters, the request's own and the decode yield count only the tokens it kept."""
    s = make()
    s.decode_yield = DecodeYieldMeter(decay=1.0)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[9]))
    s.add_request(r)
    step(s)                                            # its prefill and first token
    r.spec_token_ids = [9, 9, 9]
    out = s.schedule()
    s.update(out, RunnerOutput({"a": [9, 9, 9, 4]}))  # the stop token, then 2 more accepted, then a bonus
    assert r.is_finished and r.output_token_ids[1:] == [9]
    assert r.num_accepted_draft_tokens == 0 <= len(r.output_token_ids) - 1
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (3, 0)
    assert s.decode_yield.current.output_tokens == 1.0


def test_drafts_accepted_past_max_tokens_are_not_counted():
    s = make()
    r = request("a", 3, 3)
    s.add_request(r)
    step(s)                                            # its first token
    r.spec_token_ids = [5, 5, 5]
    out = s.schedule()
    s.update(out, RunnerOutput({"a": [5, 5, 5, 5]}))
    assert r.is_finished and len(r.output_token_ids) == 3
    assert r.num_accepted_draft_tokens == s.spec_stats.num_accepted_tokens == 1


def _blocks_written(sr, block_size: int) -> set[int]:
    """The blocks whose KV a step writes for one scheduled request: those of its new positions."""
    last = sr.start_position + sr.num_new_tokens - 1
    return set(sr.block_ids[sr.start_position // block_size:last // block_size + 1])


def test_the_prefix_cache_holds_only_blocks_that_a_step_which_succeeded_wrote():
    """a and b share a 9-token prompt (2 full blocks of 4). b waits while a's step computes those blocks
    (it would compute them again), and that step fails for a: its blocks never enter the prefix cache, so
    b computes the prompt itself next step, and every cached block is one a successful step wrote."""
    s = make(block_size=4, budget=64)
    a, b = request("a", 9, 4), request("b", 9, 4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [sr.request_id for sr in out.scheduled] == ["a"]
    s.update(out, RunnerOutput({}, failed={"a": "kernel fault"}))
    assert a.finish_reason == FinishReason.ERROR and not s.kv.pool.cached
    out = s.schedule()
    assert [(sr.request_id, sr.start_position, sr.num_new_tokens) for sr in out.scheduled] == [("b", 0, 9)]
    written = _blocks_written(out.scheduled[0], 4)
    s.update(out, RunnerOutput({"b": [fake_next_token(b.all_token_ids)]}))
    assert [s.kv.pool.lookup(h) for h in b.block_hashes[:2]] == s.kv.req_blocks["b"][:2]
    assert {blk.block_id for blk in s.kv.pool.cached.values()} <= written


def test_requests_sharing_a_prompt_admitted_together_compute_it_once():
    """b waits one step while a computes the blocks they share, then hits them: only its last, partial
    block is computed again."""
    s = make(block_size=4, budget=64)
    a, b, c = request("a", 9, 4), request("b", 9, 4), request("c", 6, 4, start=500)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    assert [sr.request_id for sr in out.scheduled] == ["a"]      # b (and c behind it, in order) wait a step
    out = step(s)
    assert [(sr.request_id, sr.start_position, sr.num_new_tokens) for sr in out.scheduled] == \
        [("a", 9, 1), ("b", 8, 1), ("c", 0, 6)]
    assert s.kv.req_blocks["b"][:2] == s.kv.req_blocks["a"][:2]
    assert s.kv.prefix_hits_tokens == 8
