"""Turn a SchedulerOutput into the step's tensors: flattened tokens, positions, cache slots, attention
metadata, and which rows to sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.messages import SchedulerOutput
from tokenmill.layers.attention import AttentionMetadata, SeqSpan


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor      # [R] int64: the last new token of each request that samples
    sample_request_idx: list[int]  # [R] index into sched_out.scheduled of each sampled row


def build_step_inputs(sched_out: SchedulerOutput, block_size: int) -> StepInputs:
    ids: list[int] = []
    positions: list[int] = []
    spans: list[SeqSpan] = []
    sample_rows: list[int] = []
    sample_idx: list[int] = []
    decode_rows: list[int] = []
    decode_idx: list[int] = []
    for i, sr in enumerate(sched_out.scheduled):
        start, n = sr.start_position, sr.num_new_tokens
        row = len(ids)
        ids.extend(sr.token_ids)
        positions.extend(range(start, start + n))
        spans.append(SeqSpan(row, n, start + n, _context_slots(sr.block_ids, start + n, block_size)))
        if sr.sample:
            sample_rows.append(row + n - 1)
            sample_idx.append(i)
        if n == 1:
            decode_rows.append(row)
            decode_idx.append(i)
    pos = torch.tensor(positions, dtype=torch.long)
    slot_mapping = torch.cat([s.context_slots[s.context_len - s.query_len:] for s in spans])
    meta = AttentionMetadata(slot_mapping=slot_mapping, seqs=spans)
    if decode_rows:
        _add_decode_tables(meta, spans, decode_rows, decode_idx)
    if len(decode_rows) < len(spans):
        _add_prefill_tables(meta, [s for s in spans if s.query_len > 1])
    return StepInputs(torch.tensor(ids, dtype=torch.long), pos, meta,
                      torch.tensor(sample_rows, dtype=torch.long), sample_idx)


def _context_slots(block_ids: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """[context_len] cache slots of positions 0..context_len-1."""
    num_blocks = -(-context_len // block_size)
    blocks = torch.tensor(block_ids[:num_blocks], dtype=torch.long)
    slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    return slots[:context_len]


def _add_decode_tables(meta: AttentionMetadata, spans, decode_rows, decode_idx) -> None:
    lens = [spans[i].context_len for i in decode_idx]
    max_len = max(lens)
    slots = torch.zeros(len(decode_idx), max_len, dtype=torch.long)
    for r, i in enumerate(decode_idx):
        slots[r, :lens[r]] = spans[i].context_slots
    pad = torch.arange(max_len).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)   # [R, L] True = padding
    mask = torch.zeros(len(decode_idx), max_len).masked_fill_(pad, float("-inf"))
    meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
    meta.decode_lens = torch.tensor(lens, dtype=torch.long)
    meta.decode_slots = slots
    meta.decode_mask = mask.view(len(decode_idx), 1, max_len)


def _add_prefill_tables(meta: AttentionMetadata, prefills: list[SeqSpan]) -> None:
    slots = torch.zeros(len(prefills), max(s.context_len for s in prefills), dtype=torch.long)
    for r, s in enumerate(prefills):
        slots[r, :s.context_len] = s.context_slots
    meta.prefill_spans = torch.tensor([[s.query_start, s.query_len, s.context_len] for s in prefills],
                                      dtype=torch.long).view(len(prefills), 3)
    meta.prefill_slots = slots
