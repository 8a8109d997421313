"""The only contract between the scheduler (policy, pure Python) and the model runner (tensors).

SchedulerOutput: what to compute this step. RunnerOutput: what came of it.
Token lists passed here are read-only views owned by the scheduler, valid until the next schedule().
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tokenmill.outputs import TokenLogprobs
from tokenmill.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: Sequence[int]          # [num_new_tokens] ids to compute now (a prefill chunk, 1 decode token, ...)
    start_position: int               # position of token_ids[0]; KV of positions < start_position is cached
    block_ids: list[int]              # the request's block table: position p lives in block_ids[p // block_size]
    sample: bool                      # True when this step reaches the request's last token: sample one
    params: SamplingParams
    prompt_token_ids: Sequence[int]   # for penalties
    output_token_ids: Sequence[int]   # generated so far, for penalties and min_tokens
    eos_token_ids: Sequence[int]
    # speculative decoding: the last num_draft_tokens of token_ids are drafts. The runner samples each of
    # the last 1 + num_draft_tokens positions and returns the accepted drafts plus one token of its own
    num_draft_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]                 # running requests first, then newly admitted ones
    finished_request_ids: list[str] = field(default_factory=list)  # done since the previous step: drop state
    preempted_request_ids: list[str] = field(default_factory=list)  # preempted this step
    # block tables that lost trailing blocks since the previous step (rejected drafts' blocks freed)
    trimmed_request_ids: list[str] = field(default_factory=list)
    # speculation with a worker-side proposer (spec/drafter.py): drafts to propose per request that samples,
    # for the next step; each such request's block table has room for that many positions past its tokens
    num_lookahead_tokens: int = 0
    # speculation: decoding requests this step granted fewer drafts than they brought (the step's budget or
    # the KV pool withheld the rest); such a step does not show what their draft length yields
    num_requests_drafts_withheld: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    # request id -> new tokens: 1 per sampled request, or (speculation) its accepted drafts and one more
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # only for requests asking for them
    # request id -> why its part of the step failed (an exception traced to it alone, or a sampled id outside
    # the vocabulary); such a request gets no tokens and the scheduler finishes it with FinishReason.ERROR
    failed: dict[str, str] = field(default_factory=dict)
    # MoE models: (token, expert) pairs routed to each expert index in this step, summed over layers
    expert_tokens: list[int] | None = None
    # a worker-side proposer's drafts for the next step: request id -> up to num_lookahead_tokens ids to
    # follow the tokens sampled now
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def merge(self, other: "RunnerOutput") -> "RunnerOutput":
        """The outputs of two disjoint parts of one step, as one."""
        a, b = self.expert_tokens, other.expert_tokens
        experts = a or b if a is None or b is None else [x + y for x, y in zip(a, b)]
        return RunnerOutput({**self.sampled_token_ids, **other.sampled_token_ids},
                            {**self.logprobs, **other.logprobs}, {**self.failed, **other.failed}, experts,
                            {**self.draft_token_ids, **other.draft_token_ids})
