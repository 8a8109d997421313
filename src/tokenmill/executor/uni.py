"""The model in this process: the engine core calls its ModelRunner directly (no messages).

On a GPU other than the first (device="cuda:N"), that GPU is made the CUDA runtime's current device before
the runner is built, and again in a step run from another thread (the AsyncEngine's engine thread): the
current device belongs to each host thread, and Triton's launches and CUDA graph capture use it."""
from __future__ import annotations

import torch

from tokenmill.executor.base import Executor
from tokenmill.worker.model_runner import ModelRunner


class UniExecutor(Executor):
    name = "uni"

    def __init__(self, config, weights, platform) -> None:
        if config.parallel.world_size != 1:
            raise ValueError(f"the uni executor runs one rank; tensor_parallel_size is "
                             f"{config.parallel.tensor_parallel_size} (use distributed_executor_backend='mp')")
        device = platform.device
        self.cuda_index = (device.index or 0) if device.type == "cuda" else None   # None: no CUDA device to set
        self._on_device()
        self.runner = ModelRunner(config, weights, platform)
        self.replicas_sharing_host = config.parallel.replicas_sharing_host

    def _on_device(self) -> None:
        """Make this engine's GPU the calling thread's current CUDA device (nothing on the CPU)."""
        if self.cuda_index is not None and torch.cuda.current_device() != self.cuda_index:
            torch.cuda.set_device(self.cuda_index)

    def num_kv_blocks(self) -> int:
        self._on_device()
        return self.runner.num_kv_blocks(self.replicas_sharing_host)

    def bind_kv_cache(self, num_blocks: int) -> None:
        self._on_device()
        self.runner.bind_kv_cache(num_blocks)

    def weight_bytes(self) -> int:
        return self.runner.weight_bytes()

    def decode_rows(self):
        return self.runner.decode_rows()

    def execute(self, sched_out):
        self._on_device()
        return self.runner.execute(sched_out)
