"""EngineCall's counting rule against a scripted engine: request_success_total counts every admitted
completion exactly once, however its HTTP request ends."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tokenmill.engine.errors import RequestFailedError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import OpenAIError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.serving_engine import Admission, Serving

MODEL = "scripted"


class ScriptedEngine:
    """generate() yields the outputs `script(request_id, params)` lists (an exception in it is raised
    there) and then waits, as a request that is still running does."""

    model_name = MODEL
    max_model_len = 64
    dead = None

    def __init__(self, script) -> None:
        self.script = script
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        for item in self.script(request_id, params):
            if isinstance(item, BaseException):
                raise item
            yield item
        await asyncio.Event().wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self):
        return SimpleNamespace(num_waiting=0)


def _output(request_id: str, finish_reasons: list[str | None]) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason=reason)
               for i, reason in enumerate(finish_reasons)]
    return RequestOutput(request_id, None, [1], outputs, finished=all(r is not None for r in finish_reasons))


def _serving(script) -> Serving:
    engine = ScriptedEngine(script)
    config = ServerConfig()
    return Serving(engine, config, ServerMetrics(engine, MODEL), Admission(engine, 16, config))


def _counts(serving: Serving) -> dict[str, float]:
    """request_success_total by finished_reason (the nonzero ones)."""
    (family,) = serving.metrics.success.collect()
    return {s.labels["finished_reason"]: s.value for s in family.samples
            if s.name.endswith("_total") and s.value}


def _run(serving: Serving, num_prompts: int, n: int, outputs_read: int) -> None:
    """An HTTP request of `num_prompts` prompts that reads `outputs_read` outputs, then ends (its client
    hung up, or an error ended it), as a handler does: close() on the way out."""
    async def run():
        call = serving.start("r", [[1]] * num_prompts, [SamplingParams(n=n, max_tokens=8)] * num_prompts)
        outputs = call.outputs()
        try:
            for _ in range(outputs_read):
                await outputs.__anext__()
        except OpenAIError:
            pass
        finally:
            await outputs.aclose()
            await call.close()
        assert not serving.live_calls and serving.admission.num_in_flight == 0
    asyncio.run(run())


def test_a_completion_that_finished_is_not_counted_again_when_its_client_hangs_up():
    """n=4: completion 0 hits a stop string, the client hangs up: 1 stop + 3 aborts, not 1 + 4."""
    serving = _serving(lambda rid, params: [_output(rid, ["stop", None, None, None])])
    _run(serving, num_prompts=1, n=4, outputs_read=1)
    assert _counts(serving) == {"stop": 1, "abort": 3}
    assert serving.engine.aborted == ["r-0"]


def test_an_engine_failure_counts_only_the_completions_not_finished_before_it():
    serving = _serving(lambda rid, params: [_output(rid, [None, "length", None]), RequestFailedError("boom")])
    _run(serving, num_prompts=1, n=3, outputs_read=2)
    assert _counts(serving) == {"length": 1, "error": 2}
    assert serving.engine.aborted == []      # the failed request is over in the engine already


def test_several_prompts_each_count_their_own_unfinished_completions():
    def script(rid, params):
        return [_output(rid, ["length", "stop"])] if rid == "r-0" else [_output(rid, [None, "stop"])]
    serving = _serving(script)
    _run(serving, num_prompts=2, n=2, outputs_read=2)
    assert _counts(serving) == {"length": 1, "stop": 2, "abort": 1}
    assert serving.engine.aborted == ["r-1"]


def test_a_call_closed_before_it_reached_the_engine_counts_every_completion_aborted():
    """The server accepted it (a stream's role chunk may be out) and nobody got its output: an abort per
    completion, so the counter still adds up to the completions admitted."""
    serving = _serving(lambda rid, params: [_output(rid, ["stop", "stop"])])
    _run(serving, num_prompts=2, n=2, outputs_read=0)
    assert _counts(serving) == {"abort": 4}
