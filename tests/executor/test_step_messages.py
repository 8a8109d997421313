"""The compact step message (executor/messages.py): every SchedulerOutput of real runs (chunked prefill,
prefix hits, preemption, finishing) comes out of encode -> decode as it went in, and a decode step's
message does not grow with the context."""
from __future__ import annotations

import pickle

from tokenmill import LLM, SamplingParams
from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.executor.messages import DeltaDecoder, DeltaEncoder


def _as_plain(out: SchedulerOutput):
    return ([(s.request_id, list(s.token_ids), s.start_position, list(s.block_ids), s.sample, s.params,
              list(s.prompt_token_ids), list(s.output_token_ids), tuple(s.eos_token_ids)) for s in out.scheduled],
            list(out.finished_request_ids), list(out.preempted_request_ids))


def test_real_runs_round_trip(tiny_model_dir):
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * 4 * 14, block_size=4,   # 14 blocks
              max_num_batched_tokens=11)
    runner = llm.engine.core.runner
    encoder, decoder, execute, seen = DeltaEncoder(), DeltaDecoder(), runner.execute, []

    def checked(sched_out):
        expected = _as_plain(sched_out)                      # before the step: the views change after it
        assert _as_plain(decoder.decode(encoder.encode(sched_out))) == expected
        seen.append(len(sched_out.preempted_request_ids))
        return execute(sched_out)

    runner.execute = checked
    prompts = [[7 + i] * n for i, n in enumerate([9, 14, 5, 12])] + [[7] * 9 + [3, 4]]   # a prefix hit
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert llm.engine.core.scheduler.num_preemptions_total > 0 and len(seen) > 10


def _decode_step(context: int, generated: int) -> SchedulerOutput:
    prompt = list(range(context))
    output = list(range(generated))
    blocks = list(range(-(-(context + generated) // 16)))
    sr = ScheduledRequest("r", output[-1:], context + generated - 1, blocks, True, SamplingParams(), prompt, output, (2,))
    return SchedulerOutput([sr])


def test_a_decode_message_does_not_grow_with_the_context():
    sizes = []
    for context in (100, 4000):
        encoder = DeltaEncoder()
        encoder.encode(_decode_step(context, 1))                 # the request's first message: everything
        sizes.append(len(pickle.dumps(encoder.encode(_decode_step(context, 2)))))
    assert abs(sizes[0] - sizes[1]) <= 4 and max(sizes) < 400     # only the position's digits differ
