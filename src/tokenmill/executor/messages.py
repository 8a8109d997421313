"""The step message from the engine to worker processes: a SchedulerOutput as a delta against what each
worker already knows, so its size does not grow with context length.

A request's first message carries its tokens so far, sampling parameters and block table (NewRequest);
later ones only the tokens and blocks appended since (usually the one token sampled last step, and a block
every block_size tokens). Between admission and finishing or preemption a request's tokens and blocks
only grow (the scheduler's invariant); preempted and finished requests are dropped on both sides, and a
preempted one is sent whole again when it is scheduled again. A step sent twice (the engine core's
bisection after a failed step) sends nothing twice. Speculative decoding: a step's drafts travel with it
and are not kept; a block table that shrank (rejected drafts' blocks freed) is sent whole.

    encoder = DeltaEncoder(); msg = encoder.encode(sched_out)      # engine side
    decoder = DeltaDecoder(); sched_out = decoder.decode(msg)      # each worker
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequest:
    token_ids: list[int]              # prompt + outputs so far
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]


@dataclass
class ScheduledDelta:
    request_id: str
    start_position: int               # as ScheduledRequest
    num_new_tokens: int
    sample: bool
    appended_token_ids: list[int]     # tokens since the worker's last view of the request
    appended_block_ids: list[int]     # blocks since then
    new: NewRequest | None = None     # set on the request's first message (then the two above are empty)
    draft_token_ids: list[int] = field(default_factory=list)   # speculation: the step's drafts (not kept)
    block_table: list[int] | None = None   # the whole table, when it shrank (rejected drafts' blocks freed)


@dataclass
class StepDelta:
    scheduled: list[ScheduledDelta]                       # in the SchedulerOutput's order
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    num_lookahead_tokens: int = 0


class DeltaEncoder:
    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int]] = {}        # request id -> (tokens sent, blocks sent)
        self.stale_tables: set[str] = set()               # trimmed since last sent: send the whole table

    def encode(self, out: SchedulerOutput) -> StepDelta:
        for rid in (*out.finished_request_ids, *out.preempted_request_ids):
            self.sent.pop(rid, None)
            self.stale_tables.discard(rid)
        self.stale_tables.update(rid for rid in out.trimmed_request_ids if rid in self.sent)
        deltas = []
        for sr in out.scheduled:
            num_tokens = len(sr.prompt_token_ids) + len(sr.output_token_ids)
            drafts = list(sr.token_ids[sr.num_new_tokens - sr.num_draft_tokens:]) if sr.num_draft_tokens else []
            known = self.sent.get(sr.request_id)
            if known is None:
                tokens = [*sr.prompt_token_ids, *sr.output_token_ids]
                new = NewRequest(tokens, len(sr.prompt_token_ids), sr.params, tuple(sr.eos_token_ids))
                deltas.append(ScheduledDelta(sr.request_id, sr.start_position, sr.num_new_tokens, sr.sample, [],
                                             list(sr.block_ids), new, drafts))
            else:
                sent_tokens, sent_blocks = known
                appended = [*sr.output_token_ids[sent_tokens - len(sr.prompt_token_ids):]] \
                    if num_tokens > sent_tokens else []
                blocks = None if sr.request_id in self.stale_tables else list(sr.block_ids[sent_blocks:])
                self.stale_tables.discard(sr.request_id)
                if blocks is None:                       # trimmed after rejected drafts: the whole table
                    deltas.append(ScheduledDelta(sr.request_id, sr.start_position, sr.num_new_tokens, sr.sample,
                                                 appended, [], None, drafts, list(sr.block_ids)))
                else:
                    deltas.append(ScheduledDelta(sr.request_id, sr.start_position, sr.num_new_tokens, sr.sample,
                                                 appended, blocks, None, drafts))
            self.sent[sr.request_id] = (num_tokens, len(sr.block_ids))
        return StepDelta(deltas, list(out.finished_request_ids), list(out.preempted_request_ids),
                         out.num_lookahead_tokens)


@dataclass
class _Known:
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]


class DeltaDecoder:
    def __init__(self) -> None:
        self.known: dict[str, _Known] = {}

    def decode(self, msg: StepDelta) -> SchedulerOutput:
        for rid in (*msg.finished_request_ids, *msg.preempted_request_ids):
            self.known.pop(rid, None)
        scheduled = []
        for d in msg.scheduled:
            if d.new is not None:
                k = self.known[d.request_id] = _Known(list(d.new.token_ids), d.new.num_prompt_tokens, d.new.params,
                                                      d.new.eos_token_ids, list(d.appended_block_ids))
            else:
                k = self.known[d.request_id]
                k.tokens.extend(d.appended_token_ids)
                if d.block_table is not None:
                    k.block_ids[:] = d.block_table
                k.block_ids.extend(d.appended_block_ids)
            start, drafts = d.start_position, d.draft_token_ids
            own = k.tokens[start:start + d.num_new_tokens - len(drafts)]
            scheduled.append(ScheduledRequest(
                d.request_id, own + drafts if drafts else own, start, k.block_ids, d.sample, k.params,
                ListView(k.tokens, 0, k.num_prompt_tokens), ListView(k.tokens, k.num_prompt_tokens, None),
                k.eos_token_ids, len(drafts)))
        return SchedulerOutput(scheduled, list(msg.finished_request_ids), list(msg.preempted_request_ids),
                               num_lookahead_tokens=msg.num_lookahead_tokens)


class ListView(Sequence):
    """items[start:stop] (stop None: to the end, as the list grows) without copying: the prompt and output
    views of a worker's token list, read-only, like the scheduler's."""
    __slots__ = ("items", "start", "stop")

    def __init__(self, items: list, start: int, stop: int | None) -> None:
        self.items, self.start, self.stop = items, start, stop

    def __len__(self) -> int:
        return (len(self.items) if self.stop is None else self.stop) - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.items[self.start + j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.items[self.start + i]

    def __iter__(self):
        stop = len(self.items) if self.stop is None else self.stop
        return (self.items[j] for j in range(self.start, stop))
