"""Training an MTP head (models/mtp.py's layout) for a model that has none, on text the model writes itself.

1. Data: the engine generates from a spread of instruction prompts (sampled, so the text varies), then
   summarizes texts it wrote in the first round (greedy, as a summarization benchmark decodes: an answer
   that copies from its context, which a head trained on free writing alone rarely predicts). The summary
   requests come in the chat template ("chat"), as MLPerf's summarization prompt without one, decoded to
   max_tokens past EOS as the benchmark's runs decode ("cnndm"), or alternating ("both"). Each sequence's
   final hidden states h_p come from the same engine's model (the quantization it will serve with), with
   the target's next-token distributions q_{p+1} = softmax(lm_head(h_{p+1})).
2. Model: enorm, hnorm, eh_proj and one decoder block of the target's own Hugging Face class (initialized
   from the target's last layer), shared_head.norm (from the final norm); the embedding and head are the
   target's, frozen. All plain torch modules, so autograd applies.
3. Loss: KL(q_{p+1} || the head's prediction at p), in nats (distillation: the head learns to guess what
   the target will say after t_{p+1}, which is what greedy verification accepts; 0 = a perfect copy), both
   distributions over the reduced draft vocabulary the head will draft among (draft_vocab_size: the most
   frequent tokens of every sequence, as the saved counts choose them; the whole vocabulary where 0): the
   head's rows of the other tokens never score a draft, and leaving them out makes a step about 3.5x cheaper
   for the default model (the head's GEMMs and the softmaxes over 49,152 tokens were 80% of it). Held-out
   accuracy: how often its argmax is the target's argmax, the first draft's acceptance rate. With evaluation
   articles (a CNN/DailyMail-layout JSONL, never trained on), the same agreement over the positions of the
   summaries the target writes of them under MLPerf's prompt: the acceptance a summarization run will see.

The saved head (mtp.safetensors, names relative to the layer as DeepSeek's, mtp_config.json) loads with
speculative_config {"method": "mtp", "model": DIR}."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.selfgen import chat_prompt, instruction_prompts


@dataclass(frozen=True)
class TrainConfig:
    # the defaults take about 13 minutes on 2 cores for the default model; more text carries over to articles
    # the head never saw better than more steps on less text (benchmarks/spec_decode.py measures the head)
    num_prompts: int = 288            # first round: every (kind, topic) pair of selfgen's once
    num_summaries: int = 384          # second round: summaries of first-round texts (0: none)
    max_tokens: int = 200             # generated per prompt
    temperature: float = 1.0          # the first round's sampling temperature (top-p 0.95)
    steps: int = 4000
    lr: float = 2e-3
    holdout: float = 0.1              # share of sequences kept for the accuracy check
    draft_vocab_size: int = 8192      # the default reduced draft vocabulary saved with the head (0: whole)
    summary_format: str = "both"      # "chat" | "cnndm" | "both": the summary requests' form (docstring)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.summary_format not in SUMMARY_FORMATS:
            raise ValueError(f"summary_format {self.summary_format!r}: expected one of {', '.join(SUMMARY_FORMATS)}")


SUMMARY_FORMATS = ("chat", "cnndm", "both")


@dataclass
class Sequence:
    ids: torch.Tensor                 # [n] int64: prompt and generated tokens
    hidden: torch.Tensor              # [n, hidden] the target's final hidden states
    prompt_len: int = 0               # ids[:prompt_len] is the prompt


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    accuracy: float = 0.0             # held out: the head's argmax == the target's argmax
    draft_vocab_accuracy: float | None = None   # the same, the head's argmax taken among the draft vocabulary
    eval_accuracy: float | None = None          # on the evaluation articles' summary positions (draft vocabulary
    eval_full_vocab_accuracy: float | None = None   # where there is one), and among every token
    tokens: int = 0


def summary_prompts(llm, texts: list[str], n: int, form: str = "chat") -> list[tuple[str, bool]]:
    """(prompt, MLPerf's form) summarization requests over the model's own first-round texts (cycled to n):
    all in the chat template, all in MLPerf's prompt ("cnndm"), or alternating ("both")."""
    from tokenmill.bench.datasets import CNNDM_PROMPT
    texts = [t.strip() for t in texts if t.strip()]
    out = []
    for i in range(n if texts else 0):
        mlperf = form == "cnndm" or (form == "both" and i % 2 == 1)
        text = texts[i % len(texts)]
        out.append((CNNDM_PROMPT.format(article=text), True) if mlperf else
                   (chat_prompt(llm, f"Summarize the following text in a few sentences.\n\n{text}"), False))
    return out


def _mlperf_params(max_tokens: int):
    """Greedy, exactly max_tokens (EOS ignored), as the summarization benchmarks here decode."""
    from tokenmill import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)


@torch.inference_mode()
def _with_hidden(llm, outs) -> list[Sequence]:
    """Each request's prompt + output and the target's final hidden states over them."""
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model = llm.engine.core.runner.model
    seqs = []
    for out in outs:
        ids = torch.tensor(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
        slots = torch.arange(len(ids))
        hidden = model(ids, slots, AttentionMetadata(slots, [SeqSpan(0, len(ids), len(ids), slots)]))
        seqs.append(Sequence(ids, hidden.float().clone(), len(out.prompt_token_ids)))
    return seqs


def eval_prompts(path: str) -> list[str]:
    """MLPerf's summarization prompt over a CNN/DailyMail-layout JSONL's articles (ValueError naming a bad row)."""
    from tokenmill.bench.datasets import cnndm_dataset
    prompts = [s.prompt for s in cnndm_dataset(path)]
    if not prompts:
        raise ValueError(f"{path}: no articles to evaluate on")
    return prompts


def eval_sequences(llm, prompts: list[str], max_tokens: int | None = None) -> list[Sequence]:
    """The target's greedy answers to the prompts (max_tokens each, MLPerf's summary length by default, as
    the benchmarks decode them)."""
    from tokenmill.bench.datasets import CNNDM_MAX_OUTPUT_TOKENS
    return _with_hidden(llm, llm.generate(prompts, _mlperf_params(max_tokens or CNNDM_MAX_OUTPUT_TOKENS)))


@torch.inference_mode()
def generate_sequences(llm, cfg: TrainConfig, progress=None) -> list[Sequence]:
    from tokenmill import SamplingParams
    prompts = instruction_prompts(llm, cfg.num_prompts, cfg.seed)
    params = [SamplingParams(temperature=cfg.temperature, top_p=0.95, max_tokens=cfg.max_tokens, seed=cfg.seed + i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    summaries = summary_prompts(llm, [o.outputs[0].text for o in outs], cfg.num_summaries, cfg.summary_format)
    if summaries:
        chat = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
        outs += llm.generate([p for p, _ in summaries],
                             [_mlperf_params(cfg.max_tokens) if mlperf else chat for _, mlperf in summaries])
    seqs = []
    for out in outs:
        seqs += _with_hidden(llm, [out])
        if progress:
            progress()
    return seqs


class MTPTrainee(nn.Module):
    """The head being trained: names as models/mtp.py's MTPLayer (the block's under `block.` until saved)."""

    def __init__(self, hf_config, target_weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        import transformers
        one = transformers.AutoModelForCausalLM.from_config(_one_layer(hf_config), dtype=torch.float32)
        self.block, self.rotary = one.model.layers[0], one.model.rotary_emb
        h, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        last = hf_config.num_hidden_layers - 1
        self.block.load_state_dict({k[len(f"model.layers.{last}."):]: v for k, v in target_weights.items()
                                    if k.startswith(f"model.layers.{last}.")}, strict=True)
        self.enorm, self.hnorm = nn.RMSNorm(h, eps), nn.RMSNorm(h, eps)
        self.head_norm = nn.RMSNorm(h, eps)
        with torch.no_grad():
            self.head_norm.weight.copy_(target_weights["model.norm.weight"])
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():                              # start as the mean of the two inputs
            eye = torch.eye(h)
            self.eh_proj.weight.copy_(torch.cat([eye, eye], dim=1) * 0.5)
        self.embed = target_weights["model.embed_tokens.weight"]           # frozen, shared with the target
        self.head = target_weights.get("lm_head.weight", self.embed)

    def forward(self, ids_next: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """ids_next [n] (t_{p+1}), hidden [n, H] (h_p), positions 0..n-1 -> logits [n, rows of head] (the
        whole head by default; training passes the draft vocabulary's rows)."""
        n = ids_next.shape[0]
        positions = torch.arange(n).unsqueeze(0)
        e = F.embedding(ids_next, self.embed)
        e[0] = 0                                            # position 0, as MTPLayer.predict
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1)).unsqueeze(0)
        out = self.block(x, position_embeddings=self.rotary(x, positions), attention_mask=None,
                         position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return F.linear(self.head_norm(out[0]), self.head if head is None else head)

    def state_for_save(self) -> dict[str, torch.Tensor]:
        """models/mtp.py's names: the block's at the top, then the head's own."""
        out = {k: v.detach().contiguous() for k, v in self.block.state_dict().items() if "rotary" not in k}
        out.update({"enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight,
                    "eh_proj.weight": self.eh_proj.weight, "shared_head.norm.weight": self.head_norm.weight})
        return {k: v.detach().float().contiguous() for k, v in out.items()}


def _one_layer(hf_config):
    import copy
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers = 1
    cfg.tie_word_embeddings = False
    return cfg


def _targets(model: MTPTrainee, seq: Sequence, head: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t_{p+1}, h_p, the target's distribution at p+1 over the rows of head, the whole head by default)
    for p = 0 .. n-2."""
    with torch.no_grad():
        q = F.linear(seq.hidden[1:], model.head if head is None else head).softmax(dim=-1)
    return seq.ids[1:], seq.hidden[:-1], q


def train(model: MTPTrainee, seqs: list[Sequence], cfg: TrainConfig, on_step=None,
          evaluation: list[Sequence] | None = None) -> TrainResult:
    rng = random.Random(cfg.seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_hold = max(1, int(len(seqs) * cfg.holdout)) if len(seqs) > 1 else 0
    held, used = [seqs[i] for i in order[:n_hold]], [seqs[i] for i in order[n_hold:]] or seqs
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    result = TrainResult(tokens=sum(len(s.ids) for s in used))
    vocab = draft_vocab(seqs, model.head.shape[0], cfg.draft_vocab_size)   # from every sequence, as saved
    rows = model.head if vocab is None else model.head.index_select(0, vocab)   # [V', H] what the head drafts among
    for step in range(cfg.steps):
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))        # cosine decay
        for g in opt.param_groups:
            g["lr"] = lr
        ids_next, hidden, q = _targets(model, used[step % len(used)], rows)
        logits = model(ids_next, hidden, rows)
        loss = F.kl_div(logits.log_softmax(dim=-1), q, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        result.losses.append(loss.item())
        if on_step:
            on_step(step, loss.item())
    result.accuracy = accuracy(model, held or used)
    if vocab is not None:
        result.draft_vocab_accuracy = accuracy(model, held or used, vocab)
    if evaluation:
        result.eval_full_vocab_accuracy = accuracy(model, evaluation, generated_only=True)
        result.eval_accuracy = accuracy(model, evaluation, vocab, generated_only=True)
    return result


def draft_vocab(seqs: list[Sequence], vocab_size: int, size: int) -> torch.Tensor | None:
    """[size] the ids of the sequences' `size` most frequent tokens (spec/draft_vocab.py's choice, from the
    counts saved with the head); None where size is 0 or covers the whole vocabulary."""
    if not 0 < size < vocab_size:
        return None
    from tokenmill.spec.draft_vocab import top_tokens
    return top_tokens(token_counts(seqs, vocab_size), size)


def token_counts(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """[vocab] int64: how often each token occurs in the sequences (prompts and what the model wrote), the
    counts spec/draft_vocab.py chooses a reduced draft vocabulary by."""
    return torch.bincount(torch.cat([s.ids for s in seqs]), minlength=vocab_size)[:vocab_size]


@torch.no_grad()
def accuracy(model: MTPTrainee, seqs: list[Sequence], vocab: torch.Tensor | None = None,
             generated_only: bool = False) -> float:
    """How often the head's argmax (among `vocab` when given) is the target's argmax; with generated_only,
    over the positions p whose t_{p+1} the target generated (where drafts are made), not the prompt's."""
    hits = total = 0
    for seq in seqs:
        ids_next, hidden, q = _targets(model, seq)
        logits = model(ids_next, hidden)
        guess = logits.argmax(dim=-1) if vocab is None else vocab[logits.index_select(1, vocab).argmax(dim=-1)]
        first = max(seq.prompt_len - 1, 0) if generated_only else 0
        hits += int((guess == q.argmax(dim=-1))[first:].sum())
        total += max(len(ids_next) - first, 0)
    return hits / max(total, 1)


def target_weights(source, names_wanted) -> dict[str, torch.Tensor]:
    """The float tensors of the checkpoint the head needs: embedding, head, final norm, the last layer."""
    from tokenmill.loaders.lazy import read_part
    out = {}
    for name, t in source.iter_weights():
        if names_wanted(name):
            out[name] = read_part(t, slice(None), slice(None)).float()
    return out
