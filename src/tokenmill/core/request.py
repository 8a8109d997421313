"""A request as the scheduler sees it: token ids, progress, status. No tensors, no text."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"          # blocks freed; waits to be recomputed from scratch
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"                    # EOS, a stop token id or a stop string
    LENGTH = "length"                # max_tokens or the context window
    ABORT = "abort"                  # cancelled by the caller
    ERROR = "error"                  # failed inside the engine (RunnerOutput.failed, output processing)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30          # prompt + output tokens allowed by the context window
    arrival_time: float = field(default_factory=time.perf_counter)   # s, perf_counter clock
    first_scheduled_time: float | None = None                        # s, perf_counter clock
    first_token_time: float | None = None                            # s, when its first output token came
    # progress: invariant 0 <= num_computed_tokens <= num_tokens; KV of all_token_ids[:num_computed_tokens] is cached
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache at first scheduling
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, in order
    # draft tokens to verify in its next step (speculative decoding); not part of all_token_ids
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_steps: int = 0               # steps that verified drafts of it
    num_accepted_draft_tokens: int = 0
    last_accepted_drafts: int = 0         # of its latest verified step

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: max_tokens, capped by the context window."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int) -> bool:
        """After appending token_id: set finish_reason if it ends the request. Stop strings are the
        detokenizer's job (the engine finishes those requests through the scheduler)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
                return True
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
