"""SUT for the tokenmill engine in this process, through its public `AsyncEngine` API only.

Token counts and per-update token counts are exact: they come from the engine's token ids.
"""
from __future__ import annotations

from tokenmill.bench.records import RequestRecord, Sample
from tokenmill.bench.sut.base import SUT, Clock, FirstTokenHook


class InProcessSUT(SUT):
    """`engine_factory()` builds an object with the AsyncEngine API (generate / abort / shutdown /
    tokenizer); it is called in `start()`, so constructing the SUT does no I/O."""
    name = "in-process"

    def __init__(self, engine_factory, temperature: float = 0.0, description: dict | None = None):
        self._factory = engine_factory
        self.temperature = temperature
        self.engine = None
        self._description = description or {}

    @classmethod
    def from_engine_args(cls, engine_args, temperature: float = 0.0) -> "InProcessSUT":
        def factory():
            from tokenmill.engine.async_engine import AsyncEngine
            return AsyncEngine(engine_args)
        return cls(factory, temperature, {"engine_args": repr(engine_args)})

    async def start(self) -> None:
        if self.engine is None:
            self.engine = self._factory()
            self.tokenizer = getattr(self.engine, "tokenizer", None)

    def sampling_params(self, sample: Sample):
        from tokenmill.sampling_params import SamplingParams
        ttft, tpot = self.latency_targets or (None, None)
        return SamplingParams(temperature=self.temperature, max_tokens=sample.max_output_tokens,
                              min_tokens=sample.min_output_tokens, ignore_eos=sample.ignore_eos,
                              ttft_target_ms=ttft, tpot_target_ms=tpot)

    async def process(self, sample: Sample, record: RequestRecord, clock: Clock,
                      on_first_token: FirstTokenHook = None) -> None:
        prompt = list(sample.prompt) if isinstance(sample.prompt, tuple) else sample.prompt
        counts: list[int] = []
        record.chunk_num_tokens = counts
        try:
            params = self.sampling_params(sample)
            record.sent_s = clock()
            async for out in self.engine.generate(prompt, params, record.request_id):
                now = clock()
                comp = out.outputs[0]
                if comp.new_token_ids:
                    if record.first_token_s is None:
                        record.first_token_s = now
                        if on_first_token is not None:
                            on_first_token(record)
                    record.chunk_times_s.append(now)
                    counts.append(len(comp.new_token_ids))
                    record.completed_s = now
                if out.finished:
                    record.num_output_tokens = len(comp.token_ids)
                    record.num_prompt_tokens = len(out.prompt_token_ids)
                    record.text = comp.text
                    record.finish_reason = comp.finish_reason
                    record.completed_s = record.completed_s if record.completed_s is not None else now
            if record.num_output_tokens is None:
                record.error = "engine stream ended without a finished output"
            elif sum(counts) != record.num_output_tokens:
                record.chunk_num_tokens = None     # updates did not carry every token: ITL unknown
        except Exception as e:   # the SUT must never raise into the runner
            record.error = f"engine error: {type(e).__name__}: {e}"

    async def abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:
            pass

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def describe(self) -> dict:
        return {"name": self.name, **self._description}
