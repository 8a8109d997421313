"""The two records every part of the harness shares: a dataset `Sample` and a per-request `RequestRecord`.

Times in a `RequestRecord` are seconds relative to the run's start (`t = 0` is the moment the
scenario's schedule begins), measured with `time.perf_counter()` on the client side.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Sample:
    """One dataset entry (a QSL sample)."""
    index: int                                  # position in the dataset
    prompt: str | tuple[int, ...]               # text, or token ids sent as they are
    num_prompt_tokens: int | None               # tokens in the prompt (None: unknown until the SUT counts)
    max_output_tokens: int                      # max_tokens sent with the request
    min_output_tokens: int = 0                  # min_tokens sent with the request (0: not sent)
    ignore_eos: bool = False                    # ask the SUT to generate exactly max_output_tokens
    reference: str | None = None                # reference output for accuracy mode


@dataclass
class RequestRecord:
    """What happened to one request. The SUT fills the timing fields; it never raises."""
    request_id: str
    sample_index: int
    scheduled_s: float                          # s, when the scenario scheduled it
    sent_s: float | None = None                 # s, when the request actually left the client
    first_token_s: float | None = None          # s, when the first output token arrived
    completed_s: float | None = None            # s, when the last output token / end of stream arrived
    num_output_tokens: int | None = None        # from token ids (server usage / re-tokenization), never chunks
    num_prompt_tokens: int | None = None
    chunk_times_s: list[float] = field(default_factory=list)   # s, arrival of each streamed update
    chunk_num_tokens: list[int] | None = None   # tokens carried by each update, where known exactly
    chunk_texts: list[str] = field(default_factory=list)       # text of each update (re-tokenization)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None                    # None: success

    @property
    def ok(self) -> bool:
        return self.error is None and self.completed_s is not None and bool(self.num_output_tokens)

    @property
    def issue_delay_s(self) -> float | None:
        """Actual send time minus scheduled time: the generator's own lateness."""
        return None if self.sent_s is None else self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first token from the scheduled time (MLPerf's definition)."""
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def ttft_sent_s(self) -> float | None:
        """Time to first token from the actual send time (reported apart)."""
        if self.first_token_s is None or self.sent_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def latency_s(self) -> float | None:
        return None if self.completed_s is None else self.completed_s - self.scheduled_s

    @property
    def tpot_s(self) -> float | None:
        """MLPerf TPOT: (latency - TTFT) / (n_tokens - 1); None for failed or 1-token outputs."""
        if not self.ok or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)

    def inter_token_gaps_s(self) -> list[float] | None:
        """Token-level inter-token latencies: each update's gap spread evenly over its tokens.

        The first update's tokens after the first one arrived together with it (gap 0). None when
        tokens per update are not known exactly (then ITL is reported as not available).
        """
        counts = self.chunk_num_tokens
        if not self.ok or counts is None or len(counts) != len(self.chunk_times_s):
            return None
        gaps: list[float] = []
        prev: float | None = None
        for t, k in zip(self.chunk_times_s, counts):
            if k <= 0:
                continue
            if prev is None:
                gaps.extend([0.0] * (k - 1))
            else:
                gaps.extend([(t - prev) / k] * k)
            prev = t
        return gaps

    def to_json(self, include_chunks: bool = False) -> dict:
        d = asdict(self)
        if not include_chunks:
            d.pop("chunk_times_s")
            d.pop("chunk_texts")
            d.pop("chunk_num_tokens")
        d.update(issue_delay_s=self.issue_delay_s, ttft_s=self.ttft_s, ttft_sent_s=self.ttft_sent_s,
                 latency_s=self.latency_s, tpot_s=self.tpot_s)
        return d
