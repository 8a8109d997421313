"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF): greedy tokens identical to transformers' greedy
generate on the same dequantized weights, alone and in a batch of 16 with mixed prompt lengths."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.loaders.default_model import DEFAULT_MODEL_FILE, default_model_path

MAX_NEW = 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colors:",
    "Water boils at",
    "The theory of relativity was proposed by",
    "In 1492,",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Question: What is 2 + 2?\nAnswer:",
    "Paris is to France as Rome is to",
    "A haiku about autumn:\n",
    "My favourite food is",
    "The mitochondria is",
    "Translate to French: Good morning ->",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def hf_greedy(llm):
    """transformers' greedy continuation of each prompt, one at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM
    import os
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE,
                                                 dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = llm.tokenizer.encode(p)
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 min_new_tokens=MAX_NEW)
            out[p] = gen[0, len(ids):].tolist()
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_alone_matches_transformers(llm, hf_greedy):
    for p in PROMPTS[:4]:
        got = llm.generate(p, GREEDY)[0].outputs[0].token_ids
        assert got == hf_greedy[p], p


def test_batch_of_16_mixed_lengths_matches_transformers(llm, hf_greedy):
    outs = llm.generate(PROMPTS, GREEDY)
    assert len({len(o.prompt_token_ids) for o in outs}) > 8
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy[p], p


def test_chat_template_and_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in llm.engine.eos_token_ids
