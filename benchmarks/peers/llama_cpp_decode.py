"""Batch-1 decode speed of llama.cpp (through llama-cpp-python) on the default model's GGUF file, the
workload of benchmarks/decode_latency.py: the same 128 random prompt tokens, then exactly N greedy tokens
(argmax of the logits, end-of-sequence ignored). Runs in the peer's own virtual environment (made by
benchmarks/peers/llama_cpp_setup.sh); prints one JSON line: {"decode_tok_s": [...per run], ...}.

    /tmp/tokenmill-peers/llama-cpp-venv/bin/python benchmarks/peers/llama_cpp_decode.py GGUF [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)                                   # decode_latency.make_prompt's tokens
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    llm = Llama(model_path=args.gguf, n_ctx=args.prompt_len + args.output_len + 8, n_batch=args.prompt_len,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:   # the context's logits of the last evaluated token (not copied)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    rates = []
    for _ in range(args.runs + 1):                           # the first run warms up
        llm.reset()
        llm.eval(prompt)
        times = []
        for _ in range(args.output_len):
            token = int(np.argmax(last_logits()))
            times.append(time.perf_counter())
            llm.eval([token])
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    print(json.dumps({"peer": "llama.cpp (llama-cpp-python)", "threads": args.threads,
                      "decode_tok_s": rates[1:]}))


if __name__ == "__main__":
    main()
