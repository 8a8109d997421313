"""The `mtp` proposer on a tiny DeepSeek-V3 with an MTP layer in its checkpoint (model.layers.{N}.*, as
DeepSeek ships it): the layer loads (sharing the target's embedding and head) and proposes exactly what a
full-sequence reference of the same layer predicts, chained drafts included; greedy outputs are those of
no speculation through chunked prefill, prefix hits, preemption and the mp executor; its cache is part of
the pool; a model without MTP layers is a clear error."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import AttentionMetadata, SeqSpan

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [[11, 220, 4890, 17, 9, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 220, 4890, 17, 9, 300, 44, 45]]


@pytest.fixture(scope="module")
def mtp_model(tiny_model_factory, tmp_path_factory):
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from conftest import add_mtp_layer
    path = str(tmp_path_factory.mktemp("dsv3-mtp") / "model")
    shutil.copytree(tiny_model_factory("deepseek_v3"), path)
    add_mtp_layer(path)
    return path


def _llm(model, spec=MTP, **kw):
    kw.setdefault("kv_cache_memory_bytes", 1 << 22)
    return LLM(model, block_size=4, speculative_config=spec, **kw)


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@torch.inference_mode()
def _reference_drafts(llm, prompt: list[int], first: int, k: int) -> list[int]:
    """The MTP layer over the whole sequence at once (slot = position), then chained: what the engine's
    first step should have proposed after sampling `first`."""
    runner = llm.engine.core.runner
    target, layer = runner.model, runner.drafter.layer
    n = len(prompt)

    def meta(start, count):
        slots = torch.arange(start + count)
        return AttentionMetadata(slots[start:], [SeqSpan(0, count, start + count, slots)])
    positions = torch.arange(n)
    hidden = target(torch.tensor(prompt), positions, meta(0, n))          # every row: keep_rows None
    h = layer.predict(target.model.embed_tokens, target.model.rotary.gather(positions),
                      torch.tensor(prompt[1:] + [first]), positions, hidden, meta(0, n))[-1:]
    drafts = []
    for j in range(k):
        drafts.append(int(target.compute_logits(layer.shared_head.norm(h)).argmax()))
        if j + 1 < k:
            pos = torch.tensor([n + j])
            h = layer.predict(target.model.embed_tokens, target.model.rotary.gather(pos), torch.tensor(drafts[-1:]),
                              pos, h, meta(n + j, 1))
    return drafts


def test_mtp_layer_loads_and_proposes_what_the_reference_predicts(mtp_model):
    llm = _llm(mtp_model)
    runner = llm.engine.core.runner
    assert runner.drafter.layer.self_attn in runner.cache_layers()        # its latent cache is in the pool
    assert runner.kv_bytes_per_token() == 4 * llm.engine.config.model.kv_bytes_per_token // 3   # 3 + 1 layers
    captured = []
    execute = runner.execute
    runner.execute = lambda so: captured.append(execute(so)) or captured[-1]
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    first = out.outputs[0].token_ids[0]
    drafts = captured[0].draft_token_ids[out.request_id]
    assert drafts == _reference_drafts(llm, prompt, first, 3)


def test_greedy_outputs_equal_no_speculation(mtp_model):
    plain = _tokens(_llm(mtp_model, None))
    llm = _llm(mtp_model, max_num_batched_tokens=7)        # chunked prefill, drafts beside prefill chunks
    assert _tokens(llm) == plain
    stats = llm.engine.stats()
    assert stats.spec_decode.num_draft_tokens > 0 and stats.num_used_blocks == 0


def test_greedy_outputs_under_preemption_and_prefix_hits(mtp_model):
    plain = _tokens(_llm(mtp_model, None))
    probe = _llm(mtp_model)
    per_token = probe.engine.core.runner.kv_bytes_per_token()
    tight = _llm(mtp_model, kv_cache_memory_bytes=11 * 4 * per_token, enable_prefix_caching=True)
    assert _tokens(tight) == plain
    stats = tight.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
def test_mtp_through_the_mp_executor_with_tensor_parallel(mtp_model):
    plain = _tokens(_llm(mtp_model, None))
    llm = _llm(mtp_model, tensor_parallel_size=2)
    try:
        assert _tokens(llm) == plain
        assert llm.engine.stats().spec_decode.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_mtp_without_mtp_layers_is_a_clear_error(tiny_model_factory):
    with pytest.raises(ValueError, match="has no MTP layers .*tokenmill train-mtp"):
        _llm(tiny_model_factory("deepseek_v3"))


def test_mtp_layers_of_an_fp8_checkpoint_are_dequantized(mtp_model, tmp_path):
    """DeepSeek ships its MTP layers in FP8 blocks like the rest: they load dequantized by their scales."""
    import json
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / "fp8")
    shutil.copytree(mtp_model, path)
    shard = os.path.join(path, "model-mtp.safetensors")
    tensors = load_file(shard)
    w = tensors["model.layers.3.eh_proj.weight"]
    scale = (w.abs().max() / 448.0).reshape(1, 1)                     # one 128x128 block covers it
    tensors["model.layers.3.eh_proj.weight"] = (w / scale).to(torch.float8_e4m3fn)
    tensors["model.layers.3.eh_proj.weight_scale_inv"] = scale
    save_file(tensors, shard)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    llm = _llm(path)
    want = tensors["model.layers.3.eh_proj.weight"].float() * scale
    x = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = llm.engine.core.runner.drafter.layer.eh_proj(x)
    torch.testing.assert_close(got, x @ want.T, rtol=1e-5, atol=1e-5)
    assert _tokens(llm) == _tokens(_llm(path, None))


def test_rows_held_while_speculation_is_off_leave_the_mtp_cache_complete(mtp_model, monkeypatch):
    """k = 0 for nine steps (as the adaptive draft length chooses when speculation loses): the layer does not
    run, its rows are held; when k is back, they run first, and the drafts are what the layer over the whole
    sequence at once proposes."""
    llm = _llm(mtp_model, {**MTP, "adaptive": True})
    schedule = iter([0] * 9 + [3] * 100)                  # k chosen in step 1, 2, ...: chained with a step later
    monkeypatch.setattr(llm.engine.core.draft_length, "choose", lambda model, positions: next(schedule))
    runner = llm.engine.core.runner
    steps, runs = [], []
    execute, predict = runner.execute, runner.drafter.layer.predict
    runner.execute = lambda so: steps.append((so, execute(so))) or steps[-1][1]
    runner.drafter.layer.predict = lambda *a: runs.append(len(steps) + 1) or predict(*a)   # the step running
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _tokens(_llm(mtp_model, None), [prompt], SamplingParams(
        temperature=0.0, max_tokens=14, ignore_eos=True))[0]
    assert not [s for s in runs if 2 <= s <= 10]           # steps 2..10: no layer run, rows held
    sampled = [t for _, ro in steps[:11] for t in ro.sampled_token_ids[out.request_id]]
    drafts = steps[10][1].draft_token_ids[out.request_id]  # step 11: held rows, then this step's, then drafts
    assert drafts == _reference_drafts(llm, prompt + sampled[:-1], sampled[-1], 3)


def test_each_adaptive_step_is_recorded_under_the_draft_length_it_carried(mtp_model, monkeypatch):
    """The worker chains a step's drafts in the step before: the k chosen there is the one they carry, and
    each step's sample is recorded under the number of drafts it carried (a trial of a larger k measures
    steps with that many drafts, not the smaller k's)."""
    llm = _llm(mtp_model, {**MTP, "adaptive": True})
    core = llm.engine.core
    schedule = iter([0, 0] + [3] * 100)

    def choose(model, positions):                         # as AdaptiveDraftLength.choose: last_k is the choice
        core.draft_length.last_k = next(schedule)
        return core.draft_length.last_k
    monkeypatch.setattr(core.draft_length, "choose", choose)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    samples = []                                          # (k recorded, [(drafts carried, room for drafts)])
    observe = core._observe_speculation

    def recording(sched_out, produced):
        sample = observe(sched_out, produced)
        if sample is not None:
            before = {req.request_id: req.num_output_tokens - len(ids) for req, ids in produced}
            samples.append((sample.k, [(sr.num_draft_tokens, params.max_tokens - before[sr.request_id] - 1)
                                       for sr in sched_out.scheduled]))
        return sample
    monkeypatch.setattr(core, "_observe_speculation", recording)
    llm.generate([PROMPTS[1]], params)
    assert [k for k, _ in samples][:4] == [3, 0, 0, 3]    # step 2 carries the drafts step 1 chained with k = 3
    for k, requests in samples:
        for drafts, room in requests:
            assert drafts == min(k, room), samples


def test_rows_held_when_a_request_finishes_reach_the_blocks_a_prefix_hit_reuses(mtp_model, monkeypatch):
    """A request that drafts nothing (k = 0) finishes with its rows held; its blocks stay in the prefix cache.
    The same sequence submitted again hits them, and its drafts are what the layer over the whole sequence
    proposes: the held rows reached the layer's cache before the blocks were reused."""
    llm = _llm(mtp_model, {**MTP, "adaptive": True}, enable_prefix_caching=True)
    k = [0]
    monkeypatch.setattr(llm.engine.core.draft_length, "choose", lambda model, positions: k[0])
    prompt = PROMPTS[1]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))[0]
    sequence = prompt + first.outputs[0].token_ids
    k[0] = 3
    runner = llm.engine.core.runner
    steps = []
    execute = runner.execute
    runner.execute = lambda so: steps.append(execute(so)) or steps[-1]
    hits_before = llm.engine.stats().prefix_cache_hits_total
    out = llm.generate([sequence], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    assert llm.engine.stats().prefix_cache_hits_total - hits_before == 20      # 5 blocks of 4
    a, b = out.outputs[0].token_ids                      # step 1 drafts nothing (k = 0 then); step 2 drafts
    assert steps[1].draft_token_ids[out.request_id] == _reference_drafts(llm, sequence + [a], b, 3)


def test_a_prefix_hit_on_rows_another_request_holds_finds_them_in_the_cache(mtp_model):
    """A request that never drafts (it asks for logprobs) holds its rows; a request admitted later hits its
    prompt's blocks and drafts at once: the held rows run before its drafts read them."""
    llm = _llm(mtp_model, enable_prefix_caching=True)
    engine, runner = llm.engine, llm.engine.core.runner
    steps = []
    execute = runner.execute
    runner.execute = lambda so: steps.append((so, execute(so))) or steps[-1][1]
    holder, hitter = PROMPTS[1], PROMPTS[1] + [77, 78]
    engine.add_request("holder", holder, SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))
    engine.step()
    assert runner.drafter.pending                         # the holder's prompt rows
    engine.add_request("hitter", hitter, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    sched_out, out = steps[1]
    [sr] = [sr for sr in sched_out.scheduled if sr.start_position == 8]     # past the holder's 2 full blocks
    first = out.sampled_token_ids[sr.request_id][0]
    assert out.draft_token_ids[sr.request_id] == _reference_drafts(llm, hitter, first, 3)


def test_an_empty_step_still_settles_the_rows_of_finished_requests(mtp_model, monkeypatch):
    """A step that schedules nothing still tells the drafter which requests finished: none of their rows
    stay held."""
    llm = _llm(mtp_model, {**MTP, "adaptive": True})
    monkeypatch.setattr(llm.engine.core.draft_length, "choose", lambda model, positions: 0)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    drafter = llm.engine.core.runner.drafter
    assert drafter.pending                                # held when it finished, reported at the next step
    assert llm.engine.core.step() == []                   # nothing to schedule: an empty step
    assert not drafter.pending
