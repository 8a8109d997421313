"""Which data-parallel replica takes a request: the least loaded one (load = waiting x 4 + running, as
vLLM's balancer weighs them), or, with prefix caching, the replica that last took a request with the
same leading blocks, unless that would overload it (its load above 1.5 x the least load + 4).

Loads come from the replicas' reports after each of their steps; requests sent since a replica's last
report count as waiting there."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PREFIX_BLOCKS = 4          # leading full blocks a prompt is known by
MAX_PREFIXES = 1 << 16     # remembered prefixes (least recently used ones are forgotten)


@dataclass
class ReplicaLoad:
    waiting: int = 0
    running: int = 0


class Router:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        """block_size 0: no prefix affinity (prefix caching off)."""
        self.loads = {i: ReplicaLoad() for i in range(num_replicas)}
        self.pending = {i: 0 for i in range(num_replicas)}
        self.block_size = block_size
        self.prefixes: OrderedDict[int, int] = OrderedDict()      # prefix key -> replica
        self.admitted_total = {i: 0 for i in range(num_replicas)}  # requests sent to each (observability)

    def load(self, replica: int) -> int:
        lo = self.loads[replica]
        return 4 * (lo.waiting + self.pending[replica]) + lo.running

    def choose(self, prompt, candidates: list[int]) -> int:
        """The position in `candidates` (replica indices) of the replica for a request with `prompt`."""
        loads = [self.load(c) for c in candidates]
        best = min(range(len(candidates)), key=lambda i: (loads[i], candidates[i]))
        for key in reversed(self._keys(prompt)):                  # the longest known prefix first
            holder = self.prefixes.get(key)
            if holder in candidates:
                i = candidates.index(holder)
                return i if loads[i] <= 1.5 * loads[best] + 4 else best
        return best

    def admitted(self, replica: int, prompt) -> None:
        self.pending[replica] += 1
        self.admitted_total[replica] += 1
        for key in self._keys(prompt):
            self.prefixes[key] = replica
            self.prefixes.move_to_end(key)
        while len(self.prefixes) > MAX_PREFIXES:
            self.prefixes.popitem(last=False)

    def report(self, replica: int, load: ReplicaLoad) -> None:
        self.loads[replica], self.pending[replica] = load, 0

    def remove(self, replica: int) -> None:
        self.prefixes = OrderedDict((k, r) for k, r in self.prefixes.items() if r != replica)

    def _keys(self, prompt) -> list[int]:
        """Keys of the prompt's first 1..PREFIX_BLOCKS full blocks (shortest first)."""
        if not self.block_size:
            return []
        full = min(PREFIX_BLOCKS, len(prompt) // self.block_size)
        return [hash(tuple(prompt[:k * self.block_size])) for k in range(1, full + 1)]
