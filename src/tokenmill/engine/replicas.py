"""Data parallel: N engine-core processes, each with its own model copy, scheduler and KV cache, behind one
LLMEngine. ReplicatedCore offers the EngineCore interface the LLMEngine uses (add_request, abort, step,
has_unfinished, stats, check_fits); the router (distributed/dp_router.py) picks each request's replica.

Each replica process (replica_main) steps continuously while it has work and sends back, after every
step, the compact ReplicaUpdates of the requests that changed, with its queue lengths. The front keeps its
own copy of every Request (the LLMEngine's), applies the updates to it and hands the LLMEngine the usual
CoreUpdates. Aborts finish the front copy at once; a replica's later updates for it are dropped.

A replica that dies ends its in-flight requests with an error naming it; the others keep serving. When
none is left, step() raises ExecutorFailed (fatal to the engine). CPU threads are split between replicas.
"""
from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait

import torch

from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.distributed.dp_router import ReplicaLoad, Router
from tokenmill.engine.engine_core import CoreUpdate, EngineStats
from tokenmill.executor.base import ExecutorFailed

logger = logging.getLogger("tokenmill")


@dataclass
class ReplicaUpdate:
    """What one step did to one request, as the front needs it."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list
    error: str | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: object
    num_cached_tokens: int
    first_scheduled_time: float | None
    num_preemptions: int


@dataclass
class _Replica:
    index: int
    proc: object
    conn: object
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    requests: set = field(default_factory=set)    # ids in flight there
    stats: EngineStats | None = None
    alive: bool = True


def replica_main(index: int, config, threads: int, conn) -> None:
    """One replica: an EngineCore in this process (uni executor), stepping while it has work."""
    try:
        torch.set_num_threads(threads)
        from tokenmill.engine.calibration import seed_step_model
        from tokenmill.engine.engine_core import EngineCore
        from tokenmill.loaders import open_model_source
        core = EngineCore(config, open_model_source(config.model_path).iter_weights())
        if core.scheduler.policy.needs_step_model:
            seed_step_model(core)
    except BaseException as e:  # noqa: BLE001 - reported to the front, which fails start-up with it
        conn.send(("error", f"replica {index} could not start: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", (core.config.cache.num_blocks, core.executor.weight_bytes(), core.step_model.describe())))
    steps = 0
    while True:
        try:
            if not core.has_unfinished() or conn.poll():
                while True:                                   # every queued command, then step
                    command, *args = conn.recv()
                    if command == "shutdown":
                        return
                    _apply_command(core, command, args, conn)
                    if not conn.poll():
                        break
            if core.has_unfinished():
                updates = core.step()
                steps += 1
                model = core.step_model.describe() if steps % 64 == 1 else None     # its refit costs: now and then
                conn.send(("updates", ([_compact(u) for u in updates], _load(core), core.stats(), model)))
        except (EOFError, OSError):                           # the front is gone
            return


def _apply_command(core, command: str, args: list, conn) -> None:
    if command == "add":
        core.add_request(args[0])
    elif command == "abort":
        core.abort(*args)


def _load(core) -> ReplicaLoad:
    return ReplicaLoad(len(core.scheduler.waiting), len(core.scheduler.running))


def _compact(u: CoreUpdate) -> ReplicaUpdate:
    r = u.request
    return ReplicaUpdate(r.request_id, u.new_token_ids, u.new_logprobs, u.error, r.is_finished, r.finish_reason,
                         r.stop_reason, r.num_cached_tokens, r.first_scheduled_time, r.num_preemptions)


class _StepModelView:
    """What LLMEngine.step_time_model reads: a replica's step-time model, as it last reported it."""

    def __init__(self) -> None:
        self.description: dict = {}

    def describe(self) -> dict:
        return dict(self.description)


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

    def __init__(self, config, num_replicas: int, num_threads: int | None, enable_prefix_caching: bool) -> None:
        from tokenmill.executor.mp import check_ranks_fit
        device, tp = torch.device(config.device), config.parallel.tensor_parallel_size
        check_ranks_fit(num_replicas * tp, device, f"ranks ({num_replicas} replicas x {tp} tensor-parallel)")
        if device.type == "cuda" and tp > 1:
            raise ValueError("data parallel replicas of tensor-parallel engines on CUDA are not supported yet")
        threads = max(1, (num_threads or torch.get_num_threads()) // num_replicas)
        ctx = multiprocessing.get_context("spawn")
        one = replace(config, parallel=replace(config.parallel, data_parallel_size=1,
                                               replicas_sharing_host=1 if device.type == "cuda" else num_replicas))
        self.replicas: list[_Replica] = []
        for i in range(num_replicas):
            mine = replace(one, device=f"cuda:{i}") if device.type == "cuda" else one     # a GPU each
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=replica_main, args=(i, mine, threads, child), daemon=True,
                               name=f"tokenmill-replica{i}")
            proc.start()
            child.close()
            self.replicas.append(_Replica(i, proc, parent))
        self.router = Router(num_replicas, config.cache.block_size if enable_prefix_caching else 0)
        self.requests: dict[str, tuple[Request, _Replica]] = {}
        self.step_model = _StepModelView()                   # the first live replica's, as last reported
        self._closed = False
        try:
            blocks, weights = self._await_ready()
        except BaseException:
            self.shutdown()
            raise
        self.config = replace(config, cache=replace(config.cache, num_blocks=min(blocks)))
        self.executor = _WeightBytes(sum(weights))
        logger.info("tokenmill: %d data-parallel replicas, %d threads each", num_replicas, threads)

    def _await_ready(self) -> tuple[list[int], list[int]]:
        blocks, weights = [], []
        deadline = time.monotonic() + self.start_timeout_s
        for r in self.replicas:
            while not r.conn.poll(0.2):
                if not r.proc.is_alive() or time.monotonic() > deadline:
                    raise ExecutorFailed(f"replica {r.index} died or hung while starting")
            kind, value = r.conn.recv()
            if kind != "ready":
                raise ExecutorFailed(value)
            blocks.append(value[0])
            weights.append(value[1])
            if r.index == 0:
                self.step_model.description = value[2]
        return blocks, weights

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
            raise ExecutorFailed("every data-parallel replica has failed")
        chosen = live[self.router.choose(request.prompt_token_ids, [r.index for r in live])]
        chosen.conn.send(("add", request))
        chosen.requests.add(request.request_id)
        self.router.admitted(chosen.index, request.prompt_token_ids)
        self.requests[request.request_id] = (request, chosen)

    def abort(self, request_ids, reason: FinishReason = FinishReason.ABORT, stop_reason=None) -> list[Request]:
        done, by_replica = [], {}
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            entry = self.requests.pop(rid, None)
            if entry is None:
                continue
            request, replica = entry
            replica.requests.discard(rid)
            request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, reason, stop_reason
            by_replica.setdefault(replica.index, []).append(rid)
            done.append(request)
        for index, ids in by_replica.items():
            replica = self.replicas[index]
            if replica.alive:
                try:
                    replica.conn.send(("abort", ids, reason, stop_reason))
                except (BrokenPipeError, OSError):
                    pass                                          # its death is reported by step()
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[CoreUpdate]:
        """The updates of the replica steps finished since the last call, waiting at most step_wait_s for
        one (so a caller that also takes new requests, AsyncEngine's loop, is back soon); may be empty."""
        if not self.requests:
            return []
        live = {r.conn: r for r in self.replicas if r.alive}
        if not live:
            raise ExecutorFailed("every data-parallel replica has failed")
        updates: list[CoreUpdate] = []
        for conn in wait(list(live), self.step_wait_s):
            updates.extend(self._receive(live[conn]))
        for r in live.values():
            if r.alive and not r.proc.is_alive():
                updates.extend(self._replica_died(r))
        return updates

    def _receive(self, replica: _Replica) -> list[CoreUpdate]:
        out = []
        while replica.alive and replica.conn.poll():
            try:
                kind, value = replica.conn.recv()
            except (EOFError, OSError):
                return out + self._replica_died(replica)
            if kind == "updates":
                compact, replica.load, replica.stats, model = value
                if model is not None and replica.index == self._first_alive():
                    self.step_model.description = model
                self.router.report(replica.index, replica.load)
                out.extend(u for u in (self._apply(c) for c in compact) if u is not None)
        return out

    def _apply(self, c: ReplicaUpdate) -> CoreUpdate | None:
        entry = self.requests.get(c.request_id)
        if entry is None:                                         # aborted meanwhile
            return None
        request, replica = entry
        request.all_token_ids.extend(c.new_token_ids)
        request.num_cached_tokens, request.num_preemptions = c.num_cached_tokens, c.num_preemptions
        request.first_scheduled_time = c.first_scheduled_time
        if c.finished:
            request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, c.finish_reason, \
                c.stop_reason
            self.requests.pop(c.request_id, None)
            replica.requests.discard(c.request_id)
        return CoreUpdate(request, c.new_token_ids, c.new_logprobs, c.error)

    def _replica_died(self, replica: _Replica) -> list[CoreUpdate]:
        replica.alive = False
        self.router.remove(replica.index)
        code = replica.proc.exitcode
        why = f"data-parallel replica {replica.index} (pid {replica.proc.pid}) died" + \
            (f" with exit code {code}" if code is not None else "")
        logger.error("tokenmill: %s; %d requests on it fail, %d replicas remain", why, len(replica.requests),
                     sum(r.alive for r in self.replicas))
        out = []
        for rid in sorted(replica.requests):
            request, _ = self.requests.pop(rid)
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
            out.append(CoreUpdate(request, [], [], why))
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
        total.kv_cache_usage = total.num_used_blocks / total.num_total_blocks if total.num_total_blocks else 0.0
        return total

    def replica_stats(self) -> list[EngineStats | None]:
        return [r.stats if r.alive else None for r in self.replicas]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self.replicas:
            if r.proc.is_alive():
                try:
                    r.conn.send(("shutdown",))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 5.0
        for r in self.replicas:
            r.proc.join(max(0.0, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(1.0)
            r.conn.close()
