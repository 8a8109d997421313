"""`tokenmill train-mtp --model M --out DIR`: train an MTP head (spec/train_mtp.py), with a progress bar,
and save it with its loss curve (loss.png)."""
from __future__ import annotations

import json
import os
import time


def add_train_mtp_parser(sub) -> None:
    from tokenmill.spec.train_mtp import SUMMARY_FORMATS, TrainConfig
    d = TrainConfig()
    p = sub.add_parser("train-mtp", help="train an MTP speculative-decoding head on text the model writes itself")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the default model)")
    p.add_argument("--out", required=True, help="directory for mtp.safetensors, mtp_config.json, loss.png")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"],
                   help="the target's quantization while making the data (its hidden states as served)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--num-summaries", type=int, default=d.num_summaries,
                   help="second-round sequences: the model summarizing its own first-round texts (0: none)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="the first round's sampling temperature (top-p 0.95)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--summary-format", default=d.summary_format, choices=SUMMARY_FORMATS,
                   help="second-round requests: in the chat template, as MLPerf's summarization prompt decoded to "
                        "--max-tokens past EOS, or alternating")
    p.add_argument("--eval-dataset", default=None,
                   help="CNN/DailyMail-layout JSONL ('article' rows), never trained on: report the head's agreement "
                        "with the target over the summaries the target writes of them under MLPerf's prompt")
    p.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size,
                   help="the reduced draft vocabulary the head drafts from by default: the most frequent tokens of "
                        "its training text (0: the whole vocabulary)")
    p.set_defaults(func=cmd_train_mtp)


def cmd_train_mtp(ns) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from tokenmill import LLM
    from tokenmill.loaders import open_model_source
    from tokenmill.spec.mtp import HEAD_CONFIG, HEAD_FILE
    from tokenmill.spec.draft_vocab import TOKEN_COUNTS
    from tokenmill.spec.train_mtp import (MTPTrainee, TrainConfig, eval_prompts, eval_sequences,
                                          generate_sequences, target_weights, token_counts, train)
    cfg = TrainConfig(num_prompts=ns.num_prompts, num_summaries=ns.num_summaries, max_tokens=ns.max_tokens,
                      temperature=ns.temperature, steps=ns.steps, lr=ns.lr, seed=ns.seed,
                      draft_vocab_size=ns.draft_vocab_size, summary_format=ns.summary_format)
    if cfg.steps < 1 or cfg.num_prompts < 1 or cfg.max_tokens < 2 or cfg.num_summaries < 0 or cfg.draft_vocab_size < 0:
        raise ValueError("train-mtp: --steps and --num-prompts must be >= 1, --max-tokens >= 2 and "
                         "--num-summaries and --draft-vocab-size >= 0")
    if not cfg.lr > 0:                     # NaN included
        raise ValueError(f"train-mtp: --lr must be > 0, got {ns.lr}")
    if not 0 < cfg.temperature <= 10:     # NaN included; 0 (greedy) would write one text per distinct prompt
        raise ValueError(f"train-mtp: --temperature must be in (0, 10], got {ns.temperature}")
    prompts = eval_prompts(ns.eval_dataset) if ns.eval_dataset else None     # bad files fail before the work
    os.makedirs(ns.out, exist_ok=True)
    console, t0 = Console(stderr=True), time.perf_counter()
    llm = LLM(ns.model, quantization=ns.quantization)
    source = open_model_source(ns.model)
    architecture = llm.engine.config.model.architecture
    last = source.hf_config.num_hidden_layers - 1
    with Progress(console=console) as progress:
        total = cfg.num_prompts + cfg.num_summaries
        task = progress.add_task(f"generating {total} sequences", total=total)
        seqs = generate_sequences(llm, cfg, lambda: progress.advance(task))
        evaluation = eval_sequences(llm, prompts) if prompts else None
        del llm
        wanted = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
        weights = target_weights(source, lambda n: n in wanted or n.startswith(f"model.layers.{last}."))
        model = MTPTrainee(source.hf_config, weights)
        task = progress.add_task("training", total=cfg.steps)
        result = train(model, seqs, cfg, lambda step, loss: progress.update(task, advance=1,
                                                                             description=f"training (loss {loss:.3f})"),
                       evaluation)
    from safetensors.torch import save_file
    save_file(model.state_for_save(), os.path.join(ns.out, HEAD_FILE))
    save_file({"token_counts": token_counts(seqs, model.head.shape[0])}, os.path.join(ns.out, TOKEN_COUNTS))
    meta = {"architecture": architecture, "target": source.path, "quantization": ns.quantization,
            "steps": cfg.steps, "temperature": cfg.temperature, "sequences": len(seqs), "tokens": result.tokens,
            "final_loss": result.losses[-1],
            "heldout_top1_agreement": result.accuracy, "draft_vocab_size": cfg.draft_vocab_size,
            "heldout_top1_agreement_draft_vocab": result.draft_vocab_accuracy, "summary_format": cfg.summary_format,
            "eval_dataset": ns.eval_dataset, "eval_top1_agreement": result.eval_accuracy,
            "eval_top1_agreement_full_vocab": result.eval_full_vocab_accuracy,
            "seconds": round(time.perf_counter() - t0, 1),
            "loss_curve": [round(x, 5) for x in result.losses]}
    with open(os.path.join(ns.out, HEAD_CONFIG), "w") as f:
        json.dump(meta, f, indent=2)
    plot_losses(result.losses, os.path.join(ns.out, "loss.png"))
    reduced = "" if result.draft_vocab_accuracy is None else \
        f" ({result.draft_vocab_accuracy:.1%} drafting among its {cfg.draft_vocab_size} most frequent tokens)"
    evaluated = "" if result.eval_accuracy is None else \
        f"; on {ns.eval_dataset}'s summaries {result.eval_accuracy:.1%} " \
        f"({result.eval_full_vocab_accuracy:.1%} among every token)"
    console.print(f"saved {ns.out}: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, held-out agreement "
                  f"with the target's next token {result.accuracy:.1%}{reduced}{evaluated}, {meta['seconds']} s")
    return 0


def plot_losses(losses: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, linewidth=0.8, label="per step")
    window = max(1, len(losses) // 20)
    if window > 1:
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(smooth, linewidth=1.6, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(target || head), nats")
    ax.set_title("MTP head training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
