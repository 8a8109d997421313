"""One rank in a worker process (executor/mp.py starts it): its device and threads, its place in the
tensor-parallel group, its ModelRunner over its shard of the weights, and the loop that runs the steps
the engine sends.

Protocol over one duplex pipe: the worker sends ("ready", None) or ("error", message) once started; then
answers each command with ("ok", result) or ("error", message):
    ("num_kv_blocks",) -> int       ("bind_kv_cache", n) -> None       ("weight_bytes",) -> int
    ("decode_rows",) -> DecodeRows (after bind_kv_cache)
    ("step", StepDelta) -> RunnerOutput on rank 0, None elsewhere       ("shutdown",) -> exits
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    init_method: str          # where the ranks meet, e.g. tcp://127.0.0.1:PORT
    device: str               # this rank's, e.g. "cpu" or "cuda:1"
    num_threads: int          # CPU threads of this rank
    processes_per_host: int   # ranks sharing this machine's memory (the CPU's KV budget is split)


class RankWorker:
    """A rank's commands, whatever carries them (a pipe here, a Ray actor in executor/ray_executor.py)."""

    def __init__(self, spec: WorkerSpec, config) -> None:
        from tokenmill.executor.messages import DeltaDecoder
        self.spec, self.runner, self.decoder = spec, _start(spec, config), DeltaDecoder()

    def handle(self, command: str, *args):
        if command == "step":
            out = self.runner.execute(self.decoder.decode(args[0]))
            return out if self.spec.rank == 0 else None
        if command == "num_kv_blocks":
            return self.runner.num_kv_blocks(self.spec.processes_per_host)
        if command == "bind_kv_cache":
            return self.runner.bind_kv_cache(args[0])
        if command == "weight_bytes":
            return self.runner.weight_bytes()
        if command == "decode_rows":
            return self.runner.decode_rows()
        raise ValueError(f"unknown worker command {command!r}")


def worker_main(spec: WorkerSpec, config, conn) -> None:
    from tokenmill.executor.owned_process import become_owned_child
    become_owned_child()                        # its parent alone stops it: no terminal/group signal
    try:
        worker = RankWorker(spec, config)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which fails start-up with it
        conn.send(("error", f"rank {spec.rank} could not start: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            command, *args = conn.recv()
        except (EOFError, OSError):             # the engine is gone
            return
        if command == "shutdown":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", worker.handle(command, *args)))
        except Exception as e:  # noqa: BLE001 - a step's error goes back to the engine core, which bisects
            logger.debug("rank %d: %s", spec.rank, traceback.format_exc())
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _start(spec: WorkerSpec, config):
    import torch
    from tokenmill.distributed.parallel_state import backend_for, init_tensor_parallel, set_expert_parallel
    from tokenmill.loaders import open_model_source
    from tokenmill.platforms import resolve_platform
    from tokenmill.worker.model_runner import ModelRunner
    torch.set_num_threads(spec.num_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.num_threads))
    platform = resolve_platform(spec.device)
    if platform.device.type == "cuda":
        torch.cuda.set_device(platform.device)
    init_tensor_parallel(spec.rank, spec.world_size, spec.init_method, backend_for(platform.device))
    set_expert_parallel(config.parallel.enable_expert_parallel)
    source = open_model_source(config.model_path)
    return ModelRunner(config, source.iter_weights(), platform)
