"""Data parallel: N engine-core processes, each with its own model copy, scheduler and KV cache, behind one
LLMEngine. ReplicatedCore offers the EngineCore interface the LLMEngine uses (add_request, abort, step,
has_unfinished, stats, check_fits); the router (distributed/dp_router.py) picks each request's replica.

Each replica (engine/replica_links.py: a process of its own, or a Ray actor with
distributed_executor_backend="ray") steps continuously while it has work and sends back, after every step,
the compact ReplicaUpdates of the requests that changed, with its queue lengths. The front keeps its own
copy of every Request (the LLMEngine's), applies the updates to it and hands the LLMEngine the usual
CoreUpdates. Aborts finish the front copy at once; a replica's later updates for it are dropped. Every add
carries a serial number the replica echoes in its updates, so an update sent before an abort reached the
replica never lands on a later request that reuses the id (on that replica or another).

An engine dropped without shutdown() stops its replicas when it is garbage-collected (or at interpreter
exit): a weakref finalizer that holds the replicas, not the engine.

A replica that dies, or whose core raises (it says why, then stops), ends its in-flight requests with an
error naming it and why; the others keep serving. A replica alive but hung (commands to it never block
the front: engine/replica_links.py) is dead too once it has requests in flight and has sent nothing for
replica_timeout_s: it is killed and its requests fail the same way. When none is left, step() raises
ExecutorFailed (fatal to the engine), even while idle: has_unfinished() is True while a replica's message
(its death) is unread. CPU threads are split between replicas.
"""
from __future__ import annotations

import itertools
import logging
import queue
import time
import weakref
from dataclasses import dataclass, field, replace

import torch

from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.core.spec_stats import SpecDecodeStats
from tokenmill.distributed.dp_router import ReplicaLoad, Router
from tokenmill.engine.engine_core import CoreUpdate, EngineStats, add_counts
from tokenmill.engine.replica_links import DEAD, PipeLink, RayLink
from tokenmill.executor.base import ExecutorFailed

logger = logging.getLogger("tokenmill")


@dataclass
class ReplicaUpdate:
    """What one step did to one request, as the front needs it."""
    request_id: str
    serial: int                      # the serial of the add it belongs to (ReplicatedCore.add_request), echoed
    new_token_ids: list[int]
    new_logprobs: list
    error: str | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: object
    num_cached_tokens: int
    first_scheduled_time: float | None
    num_preemptions: int
    num_spec_steps: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass
class _Replica:
    index: int
    link: object                                  # engine/replica_links.py PipeLink or RayLink
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    requests: set = field(default_factory=set)    # ids in flight there
    stats: EngineStats | None = None
    alive: bool = True
    why: str = ""                                 # once dead: how it died
    # when the front last read a message of it, or gave it a request while it had none, if later
    last_heard: float = field(default_factory=time.monotonic)


def replica_load(core) -> ReplicaLoad:
    return ReplicaLoad(len(core.scheduler.waiting), len(core.scheduler.running))


@dataclass
class _InFlight:
    """A request the front has given a replica and not yet seen finish."""
    request: Request
    replica: _Replica
    serial: int                      # its add's number: only updates that echo it are its own


def compact_update(u: CoreUpdate, serial: int) -> ReplicaUpdate:
    r = u.request
    return ReplicaUpdate(r.request_id, serial, u.new_token_ids, u.new_logprobs, u.error, r.is_finished, r.finish_reason,
                         r.stop_reason, r.num_cached_tokens, r.first_scheduled_time, r.num_preemptions,
                         r.num_spec_steps, r.num_accepted_draft_tokens)


class _StepModelView:
    """What LLMEngine.step_time_model reads: a replica's step-time model, as it last reported it, and how
    many live replicas run steps like it (each its own, side by side: a bound of one times that many)."""

    def __init__(self, replicas: list[_Replica]) -> None:
        self.description: dict = {}
        self.replicas = replicas         # the core's list, not the core: no cycle, so a dropped engine is freed at once

    def describe(self) -> dict:
        return {**self.description, "replicas": sum(r.alive for r in self.replicas)}


class _WeightBytes:
    """The `executor` the LLMEngine asks for weight bytes: the replicas' sum."""

    def __init__(self, total: int) -> None:
        self.total = total

    def weight_bytes(self) -> int:
        return self.total


class ReplicatedCore:
    runner = None
    start_timeout_s = 600.0
    step_wait_s = 0.005
    replica_timeout_s = 300.0        # a replica with requests in flight that sends nothing this long is dead

    def __init__(self, config, num_replicas: int, num_threads: int | None, enable_prefix_caching: bool) -> None:
        from tokenmill.executor.mp import check_ranks_fit
        device, tp = torch.device(config.device), config.parallel.tensor_parallel_size
        on_ray = config.parallel.distributed_executor_backend == "ray"
        if on_ray and tp > 1:
            raise ValueError("data-parallel replicas on Ray run one rank each (tensor_parallel_size 1) for now")
        if not on_ray:
            check_ranks_fit(num_replicas * tp, device, f"ranks ({num_replicas} replicas x {tp} tensor-parallel)")
        if device.type == "cuda" and tp > 1:
            raise ValueError("data parallel replicas of tensor-parallel engines on CUDA are not supported yet")
        threads = max(1, (num_threads or torch.get_num_threads()) // num_replicas)
        shared = 1 if device.type == "cuda" or on_ray else num_replicas      # Ray may place them apart
        one = replace(config, parallel=replace(config.parallel, data_parallel_size=1, replicas_sharing_host=shared,
                                               distributed_executor_backend="uni" if on_ray else
                                               config.parallel.distributed_executor_backend))
        self.inbox: queue.Queue = queue.Queue()             # (replica index, message) from every replica
        if on_ray:
            from tokenmill.executor.ray_executor import connect
            connect(config.parallel.ray_address)
        self.replicas: list[_Replica] = []
        # stops every replica started, once: at shutdown(), or when this core is garbage-collected or the
        # interpreter exits; it holds the list of replicas (no link refers back to the core)
        self._stop_replicas = weakref.finalize(self, _stop_links, self.replicas)
        for i in range(num_replicas):
            mine = replace(one, device=f"cuda:{i}") if device.type == "cuda" and not on_ray else \
                replace(one, device="cuda:0") if device.type == "cuda" else one     # a GPU each
            link = RayLink(i, mine, threads, self.inbox, device.type == "cuda") if on_ray else \
                PipeLink(i, mine, threads, self.inbox)
            self.replicas.append(_Replica(i, link))
        self.router = Router(num_replicas, config.cache.block_size if enable_prefix_caching else 0)
        self.requests: dict[str, _InFlight] = {}
        self._serials = itertools.count()                    # one per add, across replicas
        self.step_model = _StepModelView(self.replicas)      # the first live replica's, as last reported
        try:
            ready = [r.link.wait_ready(self.start_timeout_s) for r in self.replicas]
        except RuntimeError as e:
            self.shutdown()
            raise ExecutorFailed(str(e)) from None
        except BaseException:
            self.shutdown()
            raise
        self.step_model.description = ready[0][2]
        self.config = replace(config, cache=replace(config.cache, num_blocks=min(b for b, _, _ in ready)))
        self.executor = _WeightBytes(sum(w for _, w, _ in ready))
        logger.info("tokenmill: %d data-parallel replicas (%s), %d threads each", num_replicas,
                    "Ray actors" if on_ray else "processes", threads)

    def _all_failed(self) -> ExecutorFailed:
        return ExecutorFailed("every data-parallel replica has failed: " + "; ".join(r.why for r in self.replicas))

    def _first_alive(self) -> int:
        return next((r.index for r in self.replicas if r.alive), -1)

    # ---- the EngineCore interface -----------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, what: str = "prompt") -> None:
        from tokenmill.core.scheduler import check_prompt_fits
        check_prompt_fits(num_prompt_tokens, self.config.scheduler.max_model_len,
                          self.config.cache.num_blocks * self.config.cache.block_size, what)

    def add_request(self, request: Request) -> None:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise self._all_failed()
        chosen = live[self.router.choose(request.prompt_token_ids, [r.index for r in live])]
        if not chosen.requests:                   # idle until now: its silence so far was no fault
            chosen.last_heard = time.monotonic()
        serial = next(self._serials)
        chosen.link.send(("add", request, serial))
        chosen.requests.add(request.request_id)
        self.router.admitted(chosen.index, request.prompt_token_ids)
        self.requests[request.request_id] = _InFlight(request, chosen, serial)

    def abort(self, request_ids, reason: FinishReason = FinishReason.ABORT, stop_reason=None) -> list[Request]:
        done, by_replica = [], {}
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            entry = self.requests.pop(rid, None)
            if entry is None:
                continue
            request, replica = entry.request, entry.replica
            replica.requests.discard(rid)
            request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, reason, stop_reason
            by_replica.setdefault(replica.index, []).append(rid)
            done.append(request)
        for index, ids in by_replica.items():
            replica = self.replicas[index]
            if replica.alive:
                replica.link.send(("abort", ids, reason, stop_reason))     # a death is reported by step()
        return done

    def has_unfinished(self) -> bool:
        """Requests in flight, or a replica's message not yet read (a death among them: an idle engine
        must learn it too); also True once every replica is dead, so the engine loop steps and learns it
        (step() raises ExecutorFailed) instead of waiting for requests that can never run."""
        return bool(self.requests) or not self.inbox.empty() or not any(r.alive for r in self.replicas)

    def step(self) -> list[CoreUpdate]:
        """The updates of the replica steps finished since the last call, waiting at most step_wait_s for
        one while requests are in flight (so a caller that also takes new requests, AsyncEngine's loop,
        is back soon); may be empty. Raises ExecutorFailed once no replica is left."""
        messages = []
        try:
            if self.requests:
                messages.append(self.inbox.get(timeout=self.step_wait_s))
            while True:
                messages.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        updates: list[CoreUpdate] = []
        now = time.monotonic()
        for index, (kind, value) in messages:
            replica = self.replicas[index]
            if not replica.alive:
                continue
            replica.last_heard = now
            if kind == DEAD:
                updates.extend(self._replica_died(replica, value))
            elif kind == "updates":
                compact, replica.load, replica.stats, model = value
                self.router.report(index, replica.load)
                if model is not None and index == self._first_alive():
                    self.step_model.description = model
                updates.extend(u for u in (self._apply(c) for c in compact) if u is not None)
        updates.extend(self._kill_silent_replicas(now))
        if not updates and not any(r.alive for r in self.replicas):
            raise self._all_failed()
        return updates

    def _apply(self, c: ReplicaUpdate) -> CoreUpdate | None:
        """The update applied to the front's request it belongs to; None (dropped) when that request is no
        longer in flight: aborted meanwhile, or aborted and its id since reused by a new add (another serial)."""
        entry = self.requests.get(c.request_id)
        if entry is None or entry.serial != c.serial:
            return None
        request, replica = entry.request, entry.replica
        request.all_token_ids.extend(c.new_token_ids)
        request.num_cached_tokens, request.num_preemptions = c.num_cached_tokens, c.num_preemptions
        request.num_spec_steps, request.num_accepted_draft_tokens = c.num_spec_steps, c.num_accepted_draft_tokens
        request.first_scheduled_time = c.first_scheduled_time
        if c.finished:
            request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, c.finish_reason, \
                c.stop_reason
            self.requests.pop(c.request_id, None)
            replica.requests.discard(c.request_id)
        return CoreUpdate(request, c.new_token_ids, c.new_logprobs, c.error)

    def _kill_silent_replicas(self, now: float) -> list[CoreUpdate]:
        """A live replica with requests in flight that has sent nothing for replica_timeout_s (hung: a
        kernel, a deadlock, a stopped process) is killed, and dies like one that died by itself."""
        out = []
        for replica in self.replicas:
            if replica.alive and replica.requests and now - replica.last_heard > self.replica_timeout_s:
                replica.link.kill()
                out.extend(self._replica_died(replica, f"answered nothing for {self.replica_timeout_s:g} s "
                                                       f"with {len(replica.requests)} requests in flight; "
                                                       "it was killed"))
        return out

    def _replica_died(self, replica: _Replica, how: str) -> list[CoreUpdate]:
        replica.alive = False
        self.router.remove(replica.index)
        why = replica.why = f"data-parallel replica {replica.index} {how}"
        logger.error("tokenmill: %s; %d requests on it fail, %d replicas remain", why, len(replica.requests),
                     sum(r.alive for r in self.replicas))
        out = []
        for rid in sorted(replica.requests):
            request = self.requests.pop(rid).request
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
            out.append(CoreUpdate(request, [], [], why, unavailable=True))
        replica.requests.clear()
        return out

    def stats(self) -> EngineStats:
        """The replicas' last reported stats, summed (usage: blocks used over blocks in all)."""
        parts = [r.stats for r in self.replicas if r.alive and r.stats is not None]
        total = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        for s in parts:
            for name in ("num_running", "num_waiting", "num_total_blocks", "num_used_blocks",
                         "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.expert_tokens = add_counts(total.expert_tokens, s.expert_tokens)
            total.kv_bytes_per_token, total.block_size = s.kv_bytes_per_token, s.block_size     # the same model
            if s.spec_decode is not None:
                total.spec_decode = total.spec_decode or SpecDecodeStats()
                d = s.spec_decode
                total.spec_decode.num_drafts += d.num_drafts
                total.spec_decode.num_draft_tokens += d.num_draft_tokens
                total.spec_decode.num_accepted_tokens += d.num_accepted_tokens
                per = total.spec_decode.accepted_per_position
                per.extend([0] * (len(d.accepted_per_position) - len(per)))
                for i, v in enumerate(d.accepted_per_position):
                    per[i] += v
        total.kv_cache_usage = total.num_used_blocks / total.num_total_blocks if total.num_total_blocks else 0.0
        return total

    def replica_stats(self) -> list[EngineStats | None]:
        return [r.stats if r.alive else None for r in self.replicas]

    def shutdown(self) -> None:
        """Stop the replicas (idempotent; afterwards garbage collection has nothing left to stop)."""
        self._stop_replicas()


def _stop_links(replicas: list[_Replica]) -> None:
    """ReplicatedCore's finalizer: must not refer to the core, or the core could never be collected."""
    for r in replicas:
        r.link.stop()
