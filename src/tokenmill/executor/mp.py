"""One worker process per tensor-parallel rank on this machine (worker/worker.py), driven over pipes.

Each step: the SchedulerOutput is encoded once as a StepDelta (messages.py) and sent to every rank; every
rank runs the same step (the collectives need all of them); rank 0's RunnerOutput is the step's. With one
rank, its error fails the step (the engine core then bisects it as it does in process). With several, a
rank's error is fatal: the others may be waiting in a collective it never reached, and once that times
out their collectives no longer line up, so the step cannot be rerun. A rank's error, a rank that dies,
or one that answers nothing while alive for `step_timeout_s` is fatal: every worker is stopped and the
engine core gets ExecutorFailed within about `poll_s` of it, naming what happened and any error or death
of another rank seen by then (often the cause: a rank out of memory, then another torn down).

A worker ignores the SIGINT/SIGTERM meant for the server (a terminal's Ctrl-C, a group's stop), so the
server's drain can finish its steps; it ends on ("shutdown",), SIGKILL, or its parent's death
(owned_process.py).

CPU threads are split between the ranks (the engine's num_threads, or torch's count, divided by the
world size); on CUDA rank r runs on cuda:r."""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time

import torch

from tokenmill.core.messages import RunnerOutput, SchedulerOutput
from tokenmill.core.step_time import DecodeRows
from tokenmill.executor.base import Executor, ExecutorFailed, narrowest
from tokenmill.executor.messages import DeltaEncoder
from tokenmill.executor.owned_process import start_owned
from tokenmill.worker.worker import WorkerSpec, worker_main

logger = logging.getLogger("tokenmill")
_DIED = "died"                   # _receive's answer for a rank whose process or pipe is gone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ranks_fit(world_size: int, device: torch.device, what: str = "tensor-parallel ranks") -> None:
    """More ranks than this machine has devices (CUDA) or cores (CPU): a clear error before starting any."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if world_size > count:
            raise ValueError(f"{world_size} {what} need {world_size} CUDA GPUs; this machine has {count}")
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if world_size > cores:
            raise ValueError(f"{world_size} {what} need a CPU core each; this process may use {cores}")


class MultiprocExecutor(Executor):
    name = "mp"
    poll_s = 0.2
    start_timeout_s = 600.0
    step_timeout_s = 300.0

    def __init__(self, config, weights, platform) -> None:
        world = config.parallel.world_size
        check_ranks_fit(world, platform.device)
        threads = max(1, (config.num_threads or torch.get_num_threads()) // world)
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.encoder = DeltaEncoder()
        self.procs, self.conns = [], []
        self._closed = False
        for rank in range(world):
            device = f"cuda:{rank}" if platform.device.type == "cuda" else "cpu"
            sharing = world * config.parallel.replicas_sharing_host if device == "cpu" else 1
            spec = WorkerSpec(rank, world, init_method, device, threads, sharing)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, config, child), daemon=True,
                               name=f"tokenmill-rank{rank}")
            start_owned(proc)                     # it ignores SIGTERM: killed at our exit if left running
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._gather("start", timeout_s=self.start_timeout_s, ok=("ready",))
        except BaseException:
            self.shutdown()
            raise
        logger.info("tokenmill: %d worker processes (tensor parallel), %d threads each", world, threads)

    # ---- commands ---------------------------------------------------------------------------------
    def num_kv_blocks(self) -> int:
        return min(self._command(("num_kv_blocks",)))

    def bind_kv_cache(self, num_blocks: int) -> None:
        self._command(("bind_kv_cache", num_blocks))

    def weight_bytes(self) -> int:
        return sum(self._command(("weight_bytes",)))

    def decode_rows(self) -> DecodeRows:
        return narrowest(self._command(("decode_rows",)))

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        results = self._command(("step", self.encoder.encode(sched_out)))
        return results[0]

    def _command(self, message) -> list:
        if self._closed:
            raise ExecutorFailed("the workers were stopped")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except (BrokenPipeError, OSError):
                others = set(range(len(self.conns))) - {rank}
                self._fail(f"rank {rank} is gone (its pipe is closed)", message[0], others)
        return self._gather(message[0], timeout_s=self.step_timeout_s)

    def _gather(self, what: str, timeout_s: float, ok=("ok",)) -> list:
        """Every rank's answer, in rank order. A lone rank's ("error", message) raises RuntimeError with it
        (ExecutorFailed at start-up); with several ranks any error, and a dead or silent rank, raises
        ExecutorFailed."""
        results = [None] * len(self.conns)
        pending = set(range(len(self.conns)))
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank in sorted(pending):
                reply = self._receive(rank, self.poll_s / len(self.conns))
                if reply is None:
                    continue
                pending.discard(rank)
                kind, value = reply
                if kind in ok:
                    results[rank] = value
                elif kind == _DIED:
                    self._fail(self._death(rank, what, value), what, pending)
                else:
                    self._rank_failed(rank, what, value, others=pending)
            if pending and time.monotonic() > deadline:
                self._fail(f"ranks {sorted(pending)} did not answer {what!r} within {timeout_s:.0f} s", what,
                           pending)
        return results

    def _receive(self, rank: int, wait_s: float) -> tuple | None:
        """The rank's reply; (_DIED, exit code) when it is gone; None while it is still at work."""
        proc = self.procs[rank]
        try:
            if self.conns[rank].poll(wait_s):
                return self.conns[rank].recv()
            if proc.is_alive():
                return None
        except (EOFError, OSError):
            pass
        return _DIED, proc.exitcode

    def _death(self, rank: int, what: str, exitcode: int | None) -> str:
        return f"rank {rank} (pid {self.procs[rank].pid}) died during {what!r}" + \
            (f" with exit code {exitcode}" if exitcode is not None else "")

    def _rank_failed(self, rank: int, what: str, error: str, others):
        """A rank answered ("error", error); `others`: the ranks yet to answer."""
        if what == "start":
            self.shutdown()
            raise ExecutorFailed(error)
        if len(self.conns) > 1:                  # the others' collectives are out of step with its
            self._fail(f"rank {rank} failed during {what!r}: {error}", what, others)
        raise RuntimeError(error)

    def _others_news(self, ranks, what: str) -> list[str]:
        """An error these ranks already sent (read without waiting), or their death: often the cause of
        what failed (a rank killed, then its peers' collectives broken)."""
        news = []
        for rank in sorted(ranks):
            reply = self._receive(rank, 0.0)
            if reply is not None and reply[0] == "error":
                news.append(f"rank {rank}: {reply[1]}")
            elif reply is not None and reply[0] == _DIED:
                news.append(self._death(rank, what, reply[1]))
        return news

    def _fail(self, why: str, what: str, others=()):
        """Stop every worker and raise ExecutorFailed: `why`, then what befell the `others` ranks."""
        why = "; ".join([why, *self._others_news(others, what)])
        self.shutdown()
        raise ExecutorFailed(f"the model's worker processes failed: {why}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("shutdown",))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            conn.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
