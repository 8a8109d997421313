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
    articles = tmp_path_factory.mktemp("articles") / "news.jsonl"
    articles.write_text("".join(json.dumps({"article": f"The harbor opened a new pier in {y}. Boats came."}) + "\n"
                                for y in (1901, 1957)))
    assert main(["train-mtp", "--model", model, "--out", out, "--num-prompts", "6", "--num-summaries", "4",
                 "--max-tokens", "24", "--steps", "50", "--lr", "3e-3", "--temperature", "0.9",
                 "--draft-vocab-size", "64", "--summary-format", "both", "--eval-dataset", str(articles)]) == 0
    return model, out


def test_train_mtp_writes_a_head_whose_loss_falls(head):
    """The KL to the target falls over the steps on the same data."""
    _, out = head
    assert sorted(os.listdir(out)) == ["loss.png", "mtp.safetensors", "mtp_config.json", "token_counts.safetensors"]
    meta = json.load(open(os.path.join(out, "mtp_config.json")))
    assert meta["architecture"] == "LlamaForCausalLM" and meta["sequences"] == 6 + 4 and meta["steps"] == 50
    assert meta["temperature"] == 0.9
    assert 0.0 <= meta["heldout_top1_agreement"] <= 1.0 and meta["draft_vocab_size"] == 64
    assert 0.0 <= meta["heldout_top1_agreement_draft_vocab"] <= 1.0
    assert meta["summary_format"] == "both" and meta["eval_dataset"].endswith("news.jsonl")
    assert 0.0 <= meta["eval_top1_agreement"] <= 1.0 and 0.0 <= meta["eval_top1_agreement_full_vocab"] <= 1.0
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


@pytest.mark.parametrize("lr", ["0", "-1e-3", "nan"])
def test_a_non_positive_lr_is_refused_before_any_work(tiny_model_dir, tmp_path, monkeypatch, capsys, lr):
    import tokenmill

    def no_work(*args, **kwargs):
        raise AssertionError("training data generation started")
    monkeypatch.setattr(tokenmill, "LLM", no_work)
    assert main(["train-mtp", "--model", tiny_model_dir, "--out", str(tmp_path / "o"), f"--lr={lr}"]) == 2
    assert f"train-mtp: --lr must be > 0, got {float(lr)}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("temperature", ["0", "-1", "nan", "11"])
def test_a_bad_temperature_is_refused_before_any_work(tiny_model_dir, tmp_path, monkeypatch, capsys, temperature):
    import tokenmill

    def no_work(*args, **kwargs):
        raise AssertionError("training data generation started")
    monkeypatch.setattr(tokenmill, "LLM", no_work)
    out = str(tmp_path / "o")
    assert main(["train-mtp", "--model", tiny_model_dir, "--out", out, f"--temperature={temperature}"]) == 2
    assert f"train-mtp: --temperature must be in (0, 10], got {float(temperature)}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_summary_requests_alternate_forms_and_mlperf_ones_decode_past_eos(tiny_model_dir):
    """"both" alternates the chat template's request with MLPerf's prompt; the latter decode exactly max_tokens
    (EOS ignored), as the summarization benchmarks decode."""
    from tokenmill.bench.datasets import CNNDM_PROMPT
    from tokenmill.spec.train_mtp import TrainConfig, _mlperf_params, summary_prompts
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=1 << 22)
    both = summary_prompts(llm, ["first text", " ", "second text"], 4, "both")
    assert [m for _, m in both] == [False, True, False, True]
    assert both[1][0] == CNNDM_PROMPT.format(article="second text") and "first text" in both[0][0]
    assert all(m for _, m in summary_prompts(llm, ["a"], 3, "cnndm"))
    assert not any(m for _, m in summary_prompts(llm, ["a"], 3, "chat"))
    params = _mlperf_params(20)
    assert params.ignore_eos and params.min_tokens == params.max_tokens == 20 and params.temperature == 0.0
    with pytest.raises(ValueError, match="summary_format 'news': expected one of chat, cnndm, both"):
        TrainConfig(summary_format="news")


def test_agreement_over_generated_positions_skips_the_prompt():
    """generated_only counts the positions p whose t_{p+1} the target wrote (p >= prompt_len - 1) only."""
    import torch
    from tokenmill.spec.train_mtp import Sequence, accuracy

    class EvenOracle(torch.nn.Module):        # the target's token at p + 1 here is t_{p+1}; guessed where even
        head = torch.eye(8)

        def forward(self, ids_next, hidden):
            return torch.eye(8)[torch.where(ids_next % 2 == 0, ids_next, (ids_next + 1) % 8)]

    ids = torch.tensor([1, 2, 3, 5, 4, 6, 0])
    seq = Sequence(ids, torch.eye(8)[ids] * 10, prompt_len=3)
    assert accuracy(EvenOracle(), [seq]) == pytest.approx(4 / 6)                   # t = 2, 4, 6, 0 of 2 3 5 4 6 0
    assert accuracy(EvenOracle(), [seq], generated_only=True) == pytest.approx(3 / 4)   # of 5 4 6 0


def test_a_missing_or_empty_evaluation_file_fails_before_any_work(tiny_model_dir, tmp_path, capsys):
    assert main(["train-mtp", "--model", tiny_model_dir, "--out", str(tmp_path / "o"),
                 "--eval-dataset", str(tmp_path / "none.jsonl")]) == 2
    assert "dataset file not found" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["train-mtp", "--model", tiny_model_dir, "--out", str(tmp_path / "o"),
                 "--eval-dataset", str(tmp_path / "empty.jsonl")]) == 2
    assert "no articles to evaluate on" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_training_scores_the_head_among_its_draft_vocabulary_only():
    """With draft_vocab_size N, every step's KL is over the N most frequent tokens' rows of the head (the
    ones the saved counts make it draft among), both distributions renormalized there; 0 keeps every row."""
    import torch
    import torch.nn.functional as F
    from tokenmill.spec.train_mtp import Sequence, TrainConfig, draft_vocab, train

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
            self.proj = torch.nn.Linear(4, 4)
            self.seen, self.logits = [], []

        def forward(self, ids_next, hidden, head=None):
            head = self.head if head is None else head
            self.seen.append(head.shape[0])
            logits = F.linear(self.proj(hidden), head)
            self.logits.append(logits.detach())
            return logits

    seqs = [Sequence(torch.tensor([1, 1, 2, 1, 3, 1]), torch.randn(6, 4)),
            Sequence(torch.tensor([2, 1, 2, 5]), torch.randn(4, 4))]
    vocab = draft_vocab(seqs, 8, 2)
    assert vocab.tolist() == [1, 2]                                    # 1 x 5, 2 x 3 (3 and 5 once)
    assert draft_vocab(seqs, 8, 0) is None and draft_vocab(seqs, 8, 8) is None
    model = Recorder()
    result = train(model, seqs, TrainConfig(steps=1, lr=1e-3, draft_vocab_size=2, holdout=0.0))
    assert model.seen[0] == 2                                          # the step's logits: 2 rows
    step_seq, = [s for s in seqs if len(s.ids) - 1 == model.logits[0].shape[0]]   # one is held out
    q = F.linear(step_seq.hidden[1:], model.head[vocab]).softmax(-1)
    expected = F.kl_div(model.logits[0].log_softmax(-1), q, reduction="batchmean").item()
    assert result.losses[0] == pytest.approx(expected, rel=1e-5)
    model = Recorder()
    train(model, seqs, TrainConfig(steps=1, lr=1e-3, draft_vocab_size=0, holdout=0.0))
    assert model.seen[0] == 8
