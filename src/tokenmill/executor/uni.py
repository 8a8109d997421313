"""The model in this process: the engine core calls its ModelRunner directly (no messages)."""
from __future__ import annotations

from tokenmill.executor.base import Executor
from tokenmill.worker.model_runner import ModelRunner


class UniExecutor(Executor):
    name = "uni"

    def __init__(self, config, weights, platform) -> None:
        if config.parallel.world_size != 1:
            raise ValueError(f"the uni executor runs one rank; tensor_parallel_size is "
                             f"{config.parallel.tensor_parallel_size} (use distributed_executor_backend='mp')")
        self.runner = ModelRunner(config, weights, platform)
        self.replicas_sharing_host = config.parallel.replicas_sharing_host

    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks(self.replicas_sharing_host)

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.runner.bind_kv_cache(num_blocks)

    def weight_bytes(self) -> int:
        return self.runner.weight_bytes()

    def decode_rows(self):
        return self.runner.decode_rows()

    def execute(self, sched_out):
        return self.runner.execute(sched_out)
