"""What the engine hands back to callers: the one message type at the engine -> user boundary.

`RequestOutput` is cumulative: each streamed update carries all text and token ids so far, plus
`new_token_ids` / `new_text` (what this update added) for streaming consumers. All times are
`time.perf_counter()` seconds in the engine's process (monotonic; compare them only with each other).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float
    decoded: str | None = None


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-k alternatives (k = SamplingParams.logprobs)."""
    sampled: Logprob
    top: list[Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float                       # s, when add_request was called
    first_scheduled_time: float | None = None # s, first step that computed any of its tokens
    first_token_time: float | None = None     # s, when its first output token was sampled
    token_times: list[float] = field(default_factory=list)  # s, one per output token
    finished_time: float | None = None        # s
    num_preemptions: int = 0
    num_spec_steps: int = 0                   # speculative decoding: steps in which it carried drafts
    num_accepted_draft_tokens: int = 0        # drafts accepted over those steps

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per speculative step (accepted drafts + the target's own); None without any."""
        return 1 + self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else None


@dataclass
class CompletionOutput:
    index: int                                # which of the n completions
    text: str                                 # detokenized, stop string removed
    token_ids: list[int]                      # every generated token id so far
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None      # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # added since the previous update
    new_text: str = ""                                    # added since the previous update
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the sampled tokens' logprobs (as vLLM reports it); None unless logprobs were requested."""
        if self.logprobs is None:
            return None
        return float(sum(t.sampled.logprob for t in self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0                # prompt tokens served from the prefix cache
    error: str | None = None                  # set (with finished) when the engine failed this request
    # with `error`: True when no fault of the request's caused it (the replica serving it died): retryable
    error_unavailable: bool = False

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics if self.outputs else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
