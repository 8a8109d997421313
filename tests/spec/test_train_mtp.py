"""`tokenmill train-mtp` on a tiny model: data from the model itself, a head whose loss falls, files that
`mtp` loads (greedy outputs unchanged, drafts proposed), the loss curve, clear errors for bad options and
a head trained for another architecture."""
from __future__ import annotations

import json
import os

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def head(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama", tie_word_embeddings=False)
    out = str(tmp_path_factory.mktemp("mtp-head"))
    assert main(["train-mtp", "--model", model, "--out", out, "--num-prompts", "6", "--num-summaries", "4",
                 "--max-tokens", "24", "--steps", "50", "--lr", "3e-3", "--draft-vocab-size", "64"]) == 0
    return model, out


def test_train_mtp_writes_a_head_whose_loss_falls(head):
    """The KL to the target falls over the steps on the same data."""
    _, out = head
    assert sorted(os.listdir(out)) == ["loss.png", "mtp.safetensors", "mtp_config.json", "token_counts.safetensors"]
    meta = json.load(open(os.path.join(out, "mtp_config.json")))
    assert meta["architecture"] == "LlamaForCausalLM" and meta["sequences"] == 6 + 4 and meta["steps"] == 50
    assert 0.0 <= meta["heldout_top1_agreement"] <= 1.0 and meta["draft_vocab_size"] == 64
    assert 0.0 <= meta["heldout_top1_agreement_draft_vocab"] <= 1.0
    curve = meta["loss_curve"]                      # the head learns the target's habits
    assert len(curve) == 50 and sum(curve[-8:]) / 8 < 0.9 * sum(curve[:8]) / 8
    from tokenmill.spec.train_mtp import TrainResult  # noqa: F401 - the module imports without a GPU
    from safetensors import safe_open
    with safe_open(os.path.join(out, "mtp.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"} <= names


def test_mtp_loads_the_trained_head_and_keeps_greedy_outputs(head):
    model, out = head
    prompts = [[11, 220, 4890, 17, 9, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    plain = [o.outputs[0].token_ids for o in LLM(model, kv_cache_memory_bytes=1 << 22).generate(prompts, GREEDY)]
    llm = LLM(model, kv_cache_memory_bytes=1 << 22,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": out})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0


def test_the_head_drafts_among_its_most_frequent_tokens_and_keeps_greedy_outputs(head):
    """The head's default reduced vocabulary (64 tokens here): drafts only from it, outputs unchanged (a draft
    is a guess); draft_vocab_size 0 drafts from the whole vocabulary; a size without counts is refused."""
    from tokenmill.spec.draft_vocab import read_token_counts, top_tokens
    model, out = head
    counts = read_token_counts(out)
    vocab = set(top_tokens(counts, 64).tolist())
    assert len(vocab) == 64
    assert min(counts[t] for t in vocab) >= max(c for t, c in enumerate(counts.tolist()) if t not in vocab)
    prompts = [[11, 220, 4890, 17, 9, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42] * 4]
    plain = [o.outputs[0].token_ids for o in LLM(model, kv_cache_memory_bytes=1 << 22).generate(prompts, GREEDY)]
    for size, reduced in ((None, True), (0, False), (32, True)):
        spec = {"method": "mtp", "num_speculative_tokens": 2, "model": out, "adaptive": False}
        if size is not None:
            spec["draft_vocab_size"] = size
        llm = LLM(model, kv_cache_memory_bytes=1 << 22, speculative_config=spec)
        drafter = llm.engine.core.runner.drafter
        assert (drafter.draft_head is not None) == reduced
        if reduced:
            assert len(drafter.draft_head.vocab) == (size or 64)
            drafted = []
            real = drafter._draft
            drafter._draft = lambda h: drafted.extend(real(h)) or drafted[-len(h):]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain
        if reduced:
            assert drafted and set(drafted) <= set(drafter.draft_head.vocab.tolist())
    # an int4 target keeps no float head: the reduced head's rows are read again from the checkpoint
    quantized = LLM(model, quantization="int4", kv_cache_memory_bytes=1 << 22,
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": out})
    head_rows = quantized.engine.core.runner.drafter.draft_head.head
    assert head_rows.out_features == 64 and getattr(head_rows, "weight", None) is None    # packed (int8)
    plain4 = [o.outputs[0].token_ids for o in LLM(model, quantization="int4", kv_cache_memory_bytes=1 << 22)
              .generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in quantized.generate(prompts, GREEDY)] == plain4


def test_a_reduced_draft_vocabulary_without_counts_is_a_clear_error(head, tmp_path):
    import shutil
    model, out = head
    bare = str(tmp_path / "bare")
    shutil.copytree(out, bare)
    os.remove(os.path.join(bare, "token_counts.safetensors"))
    with pytest.raises(ValueError, match="draft_vocab_size 64: the drafter has no token counts"):
        LLM(model, kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": bare})
    with pytest.raises(ValueError, match="draft_vocab_size must be an integer >= 0"):
        LLM(model, kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": out, "draft_vocab_size": -1})
    with pytest.raises(ValueError, match="draft_vocab_size applies to method 'mtp' only, not 'ngram'"):
        LLM(model, kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 64})


def test_a_head_for_another_architecture_or_none_is_a_clear_error(head, tiny_model_factory, tmp_path):
    _, out = head
    with pytest.raises(ValueError, match="trained for LlamaForCausalLM, the model is Qwen2ForCausalLM"):
        LLM(tiny_model_factory("qwen2"), kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": out})
    with pytest.raises(ValueError, match="no mtp.safetensors there"):
        LLM(tiny_model_factory("llama", tie_word_embeddings=False), kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": str(tmp_path)})


def test_bad_training_options_are_clear_errors(tiny_model_dir, tmp_path, capsys):
    assert main(["train-mtp", "--model", tiny_model_dir, "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps and --num-prompts must be >= 1" in capsys.readouterr().err
