"""`tokenmill generate | chat | serve | bench`."""
from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback

from tokenmill.config import EngineArgs
from tokenmill.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, temperature=ns.temperature, top_p=ns.top_p,
        top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        seed=ns.sampling_seed, stop=tuple(ns.stop), ignore_eos=ns.ignore_eos)


def cmd_generate(ns: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    t0 = time.perf_counter()
    params = sampling_params_from(ns)
    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    first_token_s = None
    for out in llm.stream(ns.prompt, params):
        if first_token_s is None and out.outputs[0].token_ids:
            first_token_s = time.perf_counter() - t0
        sys.stdout.write(out.outputs[0].new_text)
        sys.stdout.flush()
    wall = time.perf_counter() - t0
    c = out.outputs[0]
    m = c.metrics
    decode_s = (m.finished_time - m.first_token_time) if len(c.token_ids) > 1 else 0.0
    rate = (len(c.token_ids) - 1) / decode_s if decode_s > 0 else float("nan")
    print(f"\n--- {len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated "
          f"(finish: {c.finish_reason}); start-up to first token {first_token_s:.2f} s; "
          f"decode {rate:.1f} tok/s; total {wall:.2f} s", file=sys.stderr)
    if ns.stats:
        print(f"--- {speculation_summary(m, llm.engine.stats().spec_decode)}", file=sys.stderr)
    return 0


def speculation_summary(metrics, spec) -> str:
    """One line on speculative decoding for --stats."""
    if spec is None:
        return "speculative decoding off"
    per = ", ".join(f"{a / spec.num_drafts:.0%}" for a in spec.accepted_per_position) if spec.num_drafts else "-"
    length = metrics.mean_acceptance_length
    return (f"speculation: {metrics.num_spec_steps} steps with drafts, mean acceptance length "
            f"{length:.2f}" if length else "speculation: no drafts were proposed") + \
        f"; {spec.num_accepted_tokens}/{spec.num_draft_tokens} draft tokens accepted; by position {per}"


def cmd_chat(ns: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    params = sampling_params_from(ns)
    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    print("tokenmill chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for out in llm.stream(llm.apply_chat_template(messages), params):
            sys.stdout.write(out.outputs[0].new_text)
            sys.stdout.flush()
            reply = out.outputs[0].text
        print()
        if ns.stats:
            print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.outputs[0].token_ids)} generated]",
                  file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="level of tokenmill's own log (start-up report, ...), any case")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--stats", action="store_true", help="also print speculative decoding's acceptance")
    add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--stats", action="store_true", help="print token counts after each reply")
    add_sampling_args(chat, max_tokens=512)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)
    _add_optional(sub, "tokenmill.server.cli", "add_serve_parser")
    _add_optional(sub, "tokenmill.bench.cli", "add_bench_parser")
    _add_optional(sub, "tokenmill.tune.cli", "add_tune_parser")
    _add_optional(sub, "tokenmill.spec.train_mtp_cli", "add_train_mtp_parser")
    _add_optional(sub, "tokenmill.quant.quantize_cli", "add_quantize_parser")
    return parser


def _add_optional(sub, module: str, fn: str) -> None:
    import importlib
    try:
        getattr(importlib.import_module(module), fn)(sub)
    except (ImportError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("tokenmill").setLevel(ns.log_level)
    try:
        return ns.func(ns)
    except (ValueError, TypeError, OSError, RuntimeError) as e:     # OSError: FileNotFoundError, a bad tokenizer
        print(f"tokenmill: error: {e}", file=sys.stderr)
        if ns.log_level == "DEBUG":            # an internal error's place stays findable
            traceback.print_exc()
        elif isinstance(e, RuntimeError):
            print("tokenmill: (--log-level debug prints where it was raised)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
