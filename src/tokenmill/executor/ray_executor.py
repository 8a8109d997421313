"""Tensor-parallel ranks as Ray actors, placed by a Ray cluster (for ranks on several machines): an existing
one (`ray start --head`, then ParallelConfig.ray_address, e.g. "auto" or "ip:6379") or, without an
address, a local one started here.

Each actor holds one worker/worker.py RankWorker; the step's delta goes into the object store once and
every rank reads it. The ranks meet (torch.distributed) at rank 0's node address. With one rank, its
exception fails the step (the engine core bisects); with several it is fatal, as in executor/mp.py (the
others may wait in a collective it never reached, out of step with it for good): every actor is killed,
so no rank is left in the old step when another is sent. A dead actor, or one silent for step_timeout_s,
is fatal too (ExecutorFailed). Resources: one GPU per actor on CUDA; on the CPU the engine's threads split
between the ranks, each actor reserving that many CPUs."""
from __future__ import annotations

import logging

import torch

from tokenmill.core.messages import RunnerOutput, SchedulerOutput
from tokenmill.core.step_time import DecodeRows
from tokenmill.executor.base import Executor, ExecutorFailed, narrowest
from tokenmill.executor.messages import DeltaEncoder
from tokenmill.worker.worker import WorkerSpec

logger = logging.getLogger("tokenmill")


def _rank_actor():
    import ray

    @ray.remote(max_restarts=0)
    class RayRank:
        def __init__(self) -> None:
            self.worker = None

        def address(self) -> tuple[str, int]:
            """This node's IP and a free port on it (rank 0's: where the ranks meet)."""
            import socket
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            return ray.util.get_node_ip_address(), port

        def start(self, spec: WorkerSpec, config) -> None:
            from tokenmill.worker.worker import RankWorker
            self.worker = RankWorker(spec, config)

        def call(self, command: str, *args):
            return self.worker.handle(command, *args)

    return RayRank


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address`, or start a local one (num_cpus: what it may use)."""
    import ray
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)


class RayExecutor(Executor):
    name = "ray"
    start_timeout_s = 600.0
    step_timeout_s = 300.0

    def __init__(self, config, weights, platform) -> None:
        import ray
        world = config.parallel.world_size
        cuda = platform.device.type == "cuda"
        threads = max(1, (config.num_threads or torch.get_num_threads()) // world)
        connect(config.parallel.ray_address)
        need, have = ("GPU", world) if cuda else ("CPU", world * threads), ray.cluster_resources()
        if have.get(need[0], 0) < need[1]:
            raise ValueError(f"{world} tensor-parallel ranks need {need[1]} {need[0]}s in the Ray cluster; it has "
                             f"{have.get(need[0], 0):g}")
        actor = _rank_actor()
        options = dict(num_gpus=1, num_cpus=0) if cuda else dict(num_cpus=threads)
        self.actors = [actor.options(**options).remote() for _ in range(world)]
        self.encoder = DeltaEncoder()
        self._closed = False
        try:
            ip, port = ray.get(self.actors[0].address.remote(), timeout=self.start_timeout_s)
            specs = [WorkerSpec(r, world, f"tcp://{ip}:{port}", "cuda:0" if cuda else "cpu", threads,
                                1 if cuda else world) for r in range(world)]     # Ray gives each actor its GPU
            self._get([a.start.remote(s, config) for a, s in zip(self.actors, specs)], "start", self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tokenmill: %d Ray actors (tensor parallel)", world)

    def num_kv_blocks(self) -> int:
        return min(self._call("num_kv_blocks"))

    def bind_kv_cache(self, num_blocks: int) -> None:
        self._call("bind_kv_cache", num_blocks)

    def weight_bytes(self) -> int:
        return sum(self._call("weight_bytes"))

    def decode_rows(self) -> DecodeRows:
        return narrowest(self._call("decode_rows"))

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        import ray
        delta = ray.put(self.encoder.encode(sched_out))
        return self._call("step", delta)[0]

    def _call(self, command: str, *args) -> list:
        if self._closed:
            raise ExecutorFailed("the Ray actors were stopped")
        return self._get([a.call.remote(command, *args) for a in self.actors], command, self.step_timeout_s)

    def _get(self, refs: list, what: str, timeout_s: float) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        try:
            return ray.get(refs, timeout=timeout_s)
        except RayActorError as e:
            self.shutdown()
            raise ExecutorFailed(f"a Ray actor of the model died during {what!r}: {e}") from None
        except GetTimeoutError:
            self.shutdown()
            raise ExecutorFailed(f"the Ray actors did not answer {what!r} within {timeout_s:.0f} s") from None
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            error = f"{type(cause).__name__}: {cause}"
            if what == "start":
                self.shutdown()
                raise ExecutorFailed(f"a rank could not start: {error}") from None
            if len(self.actors) > 1:             # ray.get returned at the first error: others may be mid-step
                self.shutdown()
                raise ExecutorFailed(f"a tensor-parallel rank failed during {what!r}: {error}") from None
            raise RuntimeError(error) from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        import ray
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
