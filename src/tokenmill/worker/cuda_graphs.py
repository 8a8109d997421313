"""Decode steps as CUDA graphs: the whole model forward of a decode-only step, captured once per batch
bucket and replayed, so a step costs one graph launch instead of a few hundred kernel launches.

Buckets: 1, 2, 4, 8, then every 8 up to the largest (min(max_num_seqs, cuda_graph_max_batch)), captured
largest first into one memory pool. A step of B decodes replays the smallest bucket >= B on static input
buffers; rows B.. of the bucket are padding: token 0 at position 0, one context token in the scratch block
(the pool's last block, which the KV manager never hands out), so they write nowhere that is read. Steps
with a prefill chunk, or more decodes than the largest bucket, run eagerly.

Inputs reach the static buffers from pinned host staging buffers by non-blocking copies; the step's only
host sync is the sampled ids coming back (in the sampler)."""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.layers.attention.base import AttentionMetadata, SeqSpan

logger = logging.getLogger("tokenmill")


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch (which is included)."""
    if max_batch < 1:
        return []
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 8))
    return buckets if buckets[-1] == max_batch else buckets + [max_batch]


class CUDAGraphDecode:
    """takes(meta) / __call__(input_ids, positions, meta, keep_rows): the interface of a fused decode
    program (worker/model_runner.py), for decode-only steps of up to `max_batch` rows."""

    max_query_len = 1                 # a graph's rows are single-token decodes (a verify step runs eagerly)

    def __init__(self, model, device: torch.device, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, max_batch: int) -> None:
        self.model, self.device, self.block_size = model, device, block_size
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.max_rows = self.buckets[-1]
        self.max_blocks = max_blocks_per_seq
        self.scratch_block = scratch_block
        n, w = self.max_batch, max_blocks_per_seq
        long = dict(dtype=torch.long, device=device)
        self.ids, self.positions, self.slots = (torch.zeros(n, **long) for _ in range(3))
        self.lens = torch.ones(n, **long)
        self.tables = torch.full((n, w), scratch_block, **long)
        pinned = dict(dtype=torch.long, pin_memory=True)
        self.host = torch.zeros(4, n, **pinned)                 # ids, positions, slots, lens
        self.host_tables = torch.zeros(n, w, **pinned)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0                                       # steps replayed (observability, tests)

    def _meta(self, bucket: int) -> AttentionMetadata:
        """The static metadata of a bucket: views of the static buffers (what the graph reads)."""
        spans = [SeqSpan(i, 1, 0, self.slots[i:i + 1]) for i in range(bucket)]   # sizes only; unread
        return AttentionMetadata(slot_mapping=self.slots[:bucket], seqs=spans,
                                 decode_rows=torch.arange(bucket, device=self.device),
                                 decode_lens=self.lens[:bucket], block_size=self.block_size,
                                 block_tables=self.tables[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket)
            args = (self.ids[:bucket], self.positions[:bucket], meta)
            self.model(*args)                                  # warm-up: compiles Triton kernels, lazy init
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model(*args)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("tokenmill: captured %d decode graphs (batch %d..%d) in %.1f s", len(self.buckets),
                    self.buckets[0], self.max_batch, time.perf_counter() - t0)

    def takes(self, meta: AttentionMetadata) -> bool:
        rows = meta.slot_mapping.numel()
        return meta.decode_rows is not None and meta.decode_rows.numel() == rows <= self.max_batch \
            and meta.block_tables is not None and meta.block_tables.shape[1] <= self.max_blocks

    def __call__(self, input_ids, positions, meta: AttentionMetadata, keep_rows=None) -> torch.Tensor:
        rows = input_ids.numel()
        bucket = next(b for b in self.buckets if b >= rows)
        self._stage(input_ids, positions, meta, rows, bucket)
        self.graphs[bucket].replay()
        self.replays += 1
        out = self.outputs[bucket][:rows]
        return out if keep_rows is None else out[keep_rows]

    def _stage(self, input_ids, positions, meta: AttentionMetadata, rows: int, bucket: int) -> None:
        """Host inputs -> pinned staging -> the static buffers (non-blocking); padding rows reset."""
        host, width = self.host, meta.block_tables.shape[1]
        for i, t in enumerate((input_ids, positions, meta.slot_mapping, meta.decode_lens)):
            host[i, :rows].copy_(t)
        host[:3, rows:bucket] = 0
        host[2, rows:bucket] = self.scratch_block * self.block_size
        host[3, rows:bucket] = 1
        self.host_tables[:rows, :width].copy_(meta.block_tables)
        self.host_tables[rows:bucket, 0] = self.scratch_block
        for static, i in ((self.ids, 0), (self.positions, 1), (self.slots, 2), (self.lens, 3)):
            static[:bucket].copy_(host[i, :bucket], non_blocking=True)
        self.tables[:bucket, :width].copy_(self.host_tables[:bucket, :width], non_blocking=True)
