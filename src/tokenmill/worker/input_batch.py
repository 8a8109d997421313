"""Turn a SchedulerOutput into the step's tensors: flattened tokens, positions, cache slots, attention
metadata, and which rows to sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.messages import SchedulerOutput
from tokenmill.layers.attention import AttentionMetadata, SeqSpan
from tokenmill.layers.linear import PrefillRows


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor      # [R] int64: the last new token of each request that samples (its last
                                   # 1 + d tokens for one carrying d drafts)
    sample_request_idx: list[int]  # index into sched_out.scheduled of each request that samples
    sample_num_rows: list[int] | None = None   # rows of sample_rows per such request; None: 1 each
    prefill_rows: PrefillRows | None = None    # rows of prompt chunks (not decode or verify rows); host only

    def to(self, device: torch.device) -> "StepInputs":
        """The same inputs on `device` (copies queued without a host sync); itself on the CPU, where they
        are built. SeqSpan.context_slots stay on the host (one copy per request would cost more than the
        backends that read them, the reference one, save: torch moves an index tensor when it indexes)."""
        if device.type == "cpu":
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)   # noqa: E731
        m = self.meta
        meta = AttentionMetadata(move(m.slot_mapping), m.seqs, move(m.decode_rows), move(m.decode_slots),
                                 move(m.decode_mask), move(m.decode_lens), move(m.prefill_spans),
                                 move(m.prefill_slots), m.block_size, move(m.block_tables))
        return StepInputs(move(self.input_ids), move(self.positions), meta, move(self.sample_rows),
                          self.sample_request_idx, self.sample_num_rows, self.prefill_rows)


def build_step_inputs(sched_out: SchedulerOutput, block_size: int) -> StepInputs:
    ids: list[int] = []
    positions: list[int] = []
    requests: list[tuple[list[int], int, int]] = []   # (block table, start position, new tokens) per request
    sample_rows: list[int] = []
    sample_idx: list[int] = []
    num_rows: list[int] | None = None            # set once some request carries drafts
    prefill_rows: list[int] = []                 # rows of requests whose new tokens are a prompt chunk
    for i, sr in enumerate(sched_out.scheduled):
        start, n = sr.start_position, sr.num_new_tokens
        row = len(ids)
        if n > 1 and not sr.num_draft_tokens:
            prefill_rows.extend(range(row, row + n))
        ids.extend(sr.token_ids)
        positions.extend(range(start, start + n))
        requests.append((sr.block_ids, start, n))
        if sr.sample:
            d = sr.num_draft_tokens
            sample_rows.extend(range(row + n - 1 - d, row + n))
            sample_idx.append(i)
            if d:
                num_rows = num_rows or [1] * (len(sample_idx) - 1)
            if num_rows is not None:
                num_rows.append(d + 1)
    meta = build_attention_metadata(requests, block_size)
    return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta,
                      torch.tensor(sample_rows, dtype=torch.long), sample_idx, num_rows,
                      PrefillRows.of(len(ids), prefill_rows))


def build_attention_metadata(requests: list[tuple[list[int], int, int]], block_size: int) -> AttentionMetadata:
    """(block table, start position, new tokens) of each request, their rows consecutive in this order ->
    the step's attention metadata (decode and prefill tables included where there are such rows)."""
    rows, tables, decode_rows, decode_idx, row = [], [], [], [], 0
    for i, (block_ids, start, n) in enumerate(requests):
        rows.append((row, n, start + n))
        tables.append(list(block_ids[:-(-(start + n) // block_size)]))
        if n == 1:
            decode_rows.append(row)
            decode_idx.append(i)
        row += n
    blocks, slots = _slot_table(tables, block_size)   # [requests, most blocks], [requests, that * block_size]
    spans = [SeqSpan(row, n, ctx, slots[i, :ctx]) for i, (row, n, ctx) in enumerate(rows)]
    if len(decode_rows) == len(spans):           # decodes only: each request's last context slot
        lens = torch.tensor([ctx for _, _, ctx in rows], dtype=torch.long)
        slot_mapping = slots.gather(1, (lens - 1).unsqueeze(1)).view(-1)
    else:
        slot_mapping = torch.cat([s.context_slots[s.context_len - s.query_len:] for s in spans])
    meta = AttentionMetadata(slot_mapping=slot_mapping, seqs=spans, block_size=block_size, block_tables=blocks)
    if decode_rows:
        _add_decode_tables(meta, spans, slots, decode_rows, decode_idx)
    if len(decode_rows) < len(spans):
        _add_prefill_tables(meta, spans, slots, [i for i, s in enumerate(spans) if s.query_len > 1])
    return meta


def _slot_table(tables: list[list[int]], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables -> ([requests, most blocks] int64 block ids padded with block 0, [requests, most blocks *
    block_size] int64 cache slots of positions 0.. of each request; rows past a request's blocks hold block
    0's slots: valid, never attended to). One tensor op for the step, not one per request."""
    width = max(len(t) for t in tables)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    slots = (blocks.unsqueeze(2) * block_size + torch.arange(block_size)).view(len(tables), width * block_size)
    return blocks, slots


def _add_decode_tables(meta: AttentionMetadata, spans, slots: torch.Tensor, decode_rows, decode_idx) -> None:
    lens = torch.tensor([spans[i].context_len for i in decode_idx], dtype=torch.long)
    max_len = int(lens.max())
    picked = slots if len(decode_idx) == len(spans) else slots[torch.tensor(decode_idx, dtype=torch.long)]
    pad = torch.arange(max_len).unsqueeze(0) >= lens.unsqueeze(1)                   # [R, L] True = padding
    meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
    meta.decode_lens = lens
    meta.decode_slots = picked[:, :max_len].masked_fill(pad, 0).contiguous()        # padded with slot 0
    meta.decode_mask = torch.zeros(len(decode_idx), max_len).masked_fill_(pad, float("-inf")).unsqueeze(1)


def _add_prefill_tables(meta: AttentionMetadata, spans, slots: torch.Tensor, prefill_idx: list[int]) -> None:
    """The step's prefill chunks for the native kernel: [P, 3] (first row, new tokens, context length) and
    their rows of the slot table, [P, longest context] (past a chunk's context: valid slots, never read)."""
    prefills = [spans[i] for i in prefill_idx]
    width = max(s.context_len for s in prefills)
    meta.prefill_spans = torch.tensor([[s.query_start, s.query_len, s.context_len] for s in prefills],
                                      dtype=torch.long).view(len(prefills), 3)
    meta.prefill_slots = slots[torch.tensor(prefill_idx, dtype=torch.long), :width].contiguous()
