"""One worker process per tensor-parallel rank on this machine (worker/worker.py), driven over pipes.

Each step: the SchedulerOutput is encoded once as a StepDelta (messages.py) and sent to every rank; every
rank runs the same step (the collectives need all of them); rank 0's RunnerOutput is the step's. A
rank's error fails the step (the engine core then bisects it as it does in process); a rank that dies,
or answers nothing while alive for `step_timeout_s`, is fatal: every worker is stopped and the engine core
gets ExecutorFailed, within about `poll_s` of a death.

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
from tokenmill.worker.worker import WorkerSpec, worker_main

logger = logging.getLogger("tokenmill")


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
            proc.start()
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
                self._fail(f"rank {rank} is gone (its pipe is closed)")
        return self._gather(message[0], timeout_s=self.step_timeout_s)

    def _gather(self, what: str, timeout_s: float, ok=("ok",)) -> list:
        """Every rank's answer, in rank order. A rank's ("error", message) raises RuntimeError with it after
        all have answered (the ranks stay in step); a dead or silent rank raises ExecutorFailed."""
        results, errors = [None] * len(self.conns), []
        pending = set(range(len(self.conns)))
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                try:
                    ready = conn.poll(self.poll_s / len(self.conns))
                    reply = conn.recv() if ready else None
                except (EOFError, OSError):
                    reply = None
                    ready = True
                if reply is not None:
                    kind, value = reply
                    pending.discard(rank)
                    if kind in ok:
                        results[rank] = value
                    else:
                        errors.append(value)
                elif ready or not self.procs[rank].is_alive():
                    code = self.procs[rank].exitcode
                    self._fail(f"rank {rank} (pid {self.procs[rank].pid}) died during {what!r}"
                               + (f" with exit code {code}" if code is not None else ""))
            if pending and time.monotonic() > deadline:
                self._fail(f"ranks {sorted(pending)} did not answer {what!r} within {timeout_s:.0f} s")
        if errors:
            if what == "start":
                self.shutdown()
                raise ExecutorFailed(errors[0])
            raise RuntimeError(errors[0])
        return results

    def _fail(self, why: str):
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
