"""The step loop's body: schedule -> execute -> update. Token ids in, token ids out; no text."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.policy import make_policy
from tokenmill.core.request import FinishReason, Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.outputs import TokenLogprobs
from tokenmill.worker.model_runner import ModelRunner


@dataclass
class CoreUpdate:
    """What one step did to one request."""
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float             # fraction of blocks referenced by requests, 0..1
    num_total_blocks: int
    num_used_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int   # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int      # prompt tokens found there
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, weights, policy: str = "fcfs") -> None:
        self.config = config
        self.kv = KVCacheManager(config.cache.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, make_policy(policy))
        self.runner = ModelRunner(config, weights)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids, reason: FinishReason = FinishReason.ABORT, stop_reason=None) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[CoreUpdate]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out)
        if sched_out.is_empty:
            return []
        produced = self.scheduler.update(sched_out, runner_out)
        return [CoreUpdate(req, ids, runner_out.logprobs.get(req.request_id, [])) for req, ids in produced]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_total_blocks=self.kv.num_blocks,
            num_used_blocks=self.kv.pool.num_used,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=self.kv.prefix_queries_tokens,
            prefix_cache_hits_total=self.kv.prefix_hits_tokens,
        )
