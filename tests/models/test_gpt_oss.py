"""gpt-oss beyond the logits parity of test_moe_models.py: attention with sinks and a sliding window against a
naive softmax over [scores, sink] (decode and prefill paths, a padded batch); gpt-oss's own MXFP4 checkpoint
(experts as *_blocks / *_scales, written here with the test's own encoder) loads with the file's codes kept
byte for byte and gives transformers' logits on the dequantized weights within 1e-4 and its greedy tokens
(MXFP4's float32-activation reference; its int8-activation fast mode runs the experts' tiles, within 2%),
and the same across two tensor-parallel ranks."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import AttentionMetadata, SeqSpan
from tokenmill.layers.attention.sinks import sink_attention
from tokenmill.quant import fp4

PROMPT = [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000, 7, 8]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _naive(q, keys, values, q_pos, scale, sinks, window):
    """One query row at a time: softmax over [its allowed keys' scores, the sink], the sink's share dropped.
    q [n, H, D]; keys/values [L, KV, D]."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros_like(q)
    for i in range(n):
        for h in range(heads):
            allowed = [j for j in range(keys.shape[0]) if j <= q_pos[i] and (window is None or q_pos[i] - j < window)]
            s = torch.stack([q[i, h] @ keys[j, h // group] * scale for j in allowed] + [sinks[h]])
            p = s.softmax(0)[:-1]
            out[i, h] = sum(pj * values[j, h // group] for pj, j in zip(p, allowed))
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_sink_attention_is_the_softmax_with_a_sink(window):
    g = torch.Generator().manual_seed(0)
    heads, kv, d, slots = 4, 2, 8, 32
    k_cache, v_cache = torch.randn(kv, slots, d, generator=g), torch.randn(kv, slots, d, generator=g)
    sinks = torch.randn(heads, generator=g)
    # request A: a 5-token chunk at positions 2..6 (slots 10..16); B and C: one decode each
    a_slots, b_slots, c_slots = torch.arange(10, 17), torch.tensor([3, 4, 5, 6]), torch.tensor([20, 21])
    q = torch.randn(7, heads, d, generator=g)
    seqs = [SeqSpan(0, 5, 7, a_slots), SeqSpan(5, 1, 4, b_slots), SeqSpan(6, 1, 2, c_slots)]
    decode_slots = torch.tensor([[3, 4, 5, 6], [20, 21, 0, 0]])
    meta = AttentionMetadata(torch.arange(7), seqs, decode_rows=torch.tensor([5, 6]), decode_slots=decode_slots,
                             decode_mask=None, decode_lens=torch.tensor([4, 2]))
    out = sink_attention(q, k_cache, v_cache, meta, 0.3, sinks, window).view(7, heads, d)
    for s, q_pos in ((seqs[0], torch.arange(2, 7)), (seqs[1], torch.tensor([3])), (seqs[2], torch.tensor([1]))):
        keys, values = k_cache[:, s.context_slots].transpose(0, 1), v_cache[:, s.context_slots].transpose(0, 1)
        rows = slice(s.query_start, s.query_start + s.query_len)
        want = _naive(q[rows], keys, values, q_pos, 0.3, sinks, window)
        assert torch.allclose(out[rows], want, atol=1e-5)


def _encode(x: float) -> int:
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - mag), c % 2))
    return best | (8 if x < 0 and best else 0)


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (blocks [out, in/32, 16] uint8, scales [out, in/32] uint8 E8M0, dequantized [out, in])."""
    n, k = w.shape
    exponent = torch.floor(torch.log2(w.view(n, k // 32, 32).abs().amax(2))) - 2
    full = torch.exp2(exponent).repeat_interleave(32, 1)
    codes = torch.tensor([[_encode(x) for x in row] for row in (w / full).tolist()], dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(n, k // 32, 16), (exponent + 127).to(torch.uint8), fp4.from_e2m1(codes) * full


def _write_mxfp4(src: str, out: str) -> tuple[dict, dict]:
    """gpt-oss's MXFP4 layout: each layer's experts as *_blocks / *_scales [E, out, ...] (gate_up rows
    interleaved), biases and everything else float. Returns (the HF float tensors of the dequantized experts,
    the blocks by name)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    state = load_file(os.path.join(src, "model.safetensors"))
    tensors, dequantized, blocks = {}, {}, {}
    for name, t in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t
            continue
        per_expert = [_mxfp4(t[e].t().float()) for e in range(t.shape[0])]      # HF's [E, in, out] -> [out, in]
        tensors[name + "_blocks"] = blocks[name] = torch.stack([b for b, _, _ in per_expert])
        tensors[name + "_scales"] = torch.stack([s for _, s, _ in per_expert])
        dequantized[name] = torch.stack([d.t() for _, _, d in per_expert])
    os.remove(os.path.join(out, "model.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(cfg_path, "w"))
    return dequantized, blocks


def test_the_mxfp4_checkpoint_keeps_its_codes_and_matches_transformers(tiny_model_factory, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    src = tiny_model_factory("gpt_oss")
    out = str(tmp_path / "gpt-oss-mxfp4")
    dequantized, blocks = _write_mxfp4(src, out)
    fast = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    monkeypatch.setattr(fp4.MXFP4Method, "int8_activations", False)      # the float32-activation reference
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    gate_up = model.model.layers[1].mlp.experts.get_submodule("2").gate_up_proj
    assert gate_up.quant_method.name == "mxfp4"
    rows = blocks["model.layers.1.mlp.experts.gate_up_proj"][2].reshape(128, -1)      # [2I, hidden / 2] bytes
    assert torch.equal(gate_up.fp4_weight[0], torch.cat([rows[0::2], rows[1::2]]))   # gate rows, then up rows
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.is_float             # kept float, as the file
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in dequantized.items():
            hf.get_parameter(name).copy_(w)
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    n = len(PROMPT)
    slots = torch.arange(n)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))
        logits = model.compute_logits(hidden[-1:])[0]
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4
    got = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert got[0].outputs[0].token_ids == greedy[0, n:].tolist()
    # the fast mode: the experts run gemv_nvfp4 over tiles of the same codes, activations rounded to int8
    fast_gate_up = fast.engine.core.runner.model.model.layers[1].mlp.experts.get_submodule("2").gate_up_proj
    assert hasattr(fast_gate_up, "fp4_tiles") and not hasattr(fast_gate_up, "fp4_weight")
    with torch.inference_mode():
        hidden = fast.engine.core.runner.model(torch.tensor(PROMPT), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))
        fast_logits = fast.engine.core.runner.model.compute_logits(hidden[-1:])[0]
    assert 0 < ((fast_logits - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
def test_the_mxfp4_checkpoint_across_two_ranks_matches_one_rank(tiny_model_factory, tmp_path):
    """Each rank reads its run of the experts' intermediate columns from the file's blocks (32 of 64 each)."""
    out = str(tmp_path / "gpt-oss-mxfp4")
    _write_mxfp4(tiny_model_factory("gpt_oss"), out)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = []
    for tp in (1, 2):
        llm = LLM(out, tensor_parallel_size=tp, kv_cache_memory_bytes=1 << 22, block_size=4)
        try:
            runs.append([o.outputs[0] for o in llm.generate([PROMPT, PROMPT[:5]], params)])
        finally:
            llm.shutdown()
    for one, two in zip(*runs):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.logprobs, two.logprobs):
            assert abs(a.sampled.logprob - b.sampled.logprob) <= 1e-5
