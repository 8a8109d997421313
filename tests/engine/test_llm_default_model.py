"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF): greedy tokens identical to transformers' greedy
decoding on its own dequantization of the file, alone and in a batch of 16 with mixed prompt lengths."""
from __future__ import annotations

import functools
import os

import gguf
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
def hf_model():
    """transformers' own model of the GGUF file (its own dequantization), float32."""
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    with pytest.MonkeyPatch.context() as patch:
        # transformers rebuilds gguf's tensor name map once per submodule (~400 times); build it once
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE,
                                                    dtype=torch.float32).eval()


def assert_transformers_greedy(hf_model, prompt_ids: list[int], tokens: list[int]) -> None:
    """tokens are transformers' greedy continuation of prompt_ids: its argmax after the prompt and after each
    prefix of tokens is the next token (one forward pass over prompt + tokens; by induction this is exactly
    its greedy generation, without a pass per token)."""
    ids = list(prompt_ids) + list(tokens)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1: len(ids) - 1]
    assert logits.argmax(-1).tolist() == list(tokens)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_alone_matches_transformers(llm, hf_model):
    for p in PROMPTS[:4]:
        out = llm.generate(p, GREEDY)[0]
        assert len(out.outputs[0].token_ids) == MAX_NEW
        assert_transformers_greedy(hf_model, out.prompt_token_ids, out.outputs[0].token_ids)


def test_batch_of_16_mixed_lengths_matches_transformers(llm, hf_model):
    outs = llm.generate(PROMPTS, GREEDY)
    assert len({len(o.prompt_token_ids) for o in outs}) > 8
    for o in outs:
        assert len(o.outputs[0].token_ids) == MAX_NEW
        assert_transformers_greedy(hf_model, o.prompt_token_ids, o.outputs[0].token_ids)
