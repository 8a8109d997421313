"""GPU figures of issue 14 in one run, on random weights of a real model's shape (nothing to download):

1. Offline throughput: N requests, input lengths drawn around CNN/DailyMail's mean (~780 tokens,
   log-normal, clipped to [64, 1900]), exactly 128 output tokens each (greedy, EOS ignored), all submitted
   at once to tokenmill's engine core (token ids in and out); output tok/s = output tokens / wall time.
2. The peer in the same run on the same weights: transformers' static batching (`generate`, left-padded
   batches of --hf-batch, greedy) over the first --hf-requests requests; its output tok/s and the ratio.
3. Batch-1 decode: one 128-token prompt, 256 output tokens; decode tok/s = 255 / (last token - first
   token); the bandwidth bound = device bandwidth (a device-to-device copy of 2 GiB: read + write bytes
   / time) / bytes a decode step reads (every linear weight and the lm_head; the embedding reads one row);
   and the fraction of it achieved. With CUDA graphs and with --enforce-eager.
4. Offline again with --enforce-eager (graphs on vs off).

Prints one table and writes it as JSON to --out.

    python benchmarks/gpu/offline_gpu.py [--shape llama-3.1-8b] [--requests 1000] [--device cuda]
    python benchmarks/gpu/offline_gpu.py --shape tiny --device cpu --requests 8 --hf-requests 4   # smoke test
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

SHAPES = {   # transformers LlamaConfig kwargs
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False),
}
OUTPUT_LEN = 128


def input_lengths(n: int, seed: int = 0, mean: float = 780.0, sigma: float = 0.45) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2                  # log-normal with this mean
    return [min(1900, max(64, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def hf_model(shape: str, dtype: torch.dtype, device: str):
    import transformers
    cfg = transformers.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    return cfg, model


def tokenmill_core(cfg, model, dtype, device: str, enforce_eager: bool, max_model_len: int):
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.platforms import resolve_platform
    platform = resolve_platform(device)
    config = EngineConfig(
        model_path="(random weights)", model=ModelConfig.from_hf(cfg, dtype),
        cache=CacheConfig(block_size=16, enable_prefix_caching=False, memory_fraction=0.25,
                          gpu_memory_utilization=0.9),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_model_len),
        device=str(platform.device), attention_backend=platform.attention_backend_name("auto"),
        enforce_eager=enforce_eager, cuda_graph_max_batch=256)
    weights = ((name, p.detach()) for name, p in model.state_dict().items())
    return EngineCore(config, weights, platform)


def run_core(core, prompts: list[list[int]], output_len: int) -> tuple[float, int, list[list[float]]]:
    """All prompts at once; returns (seconds, output tokens, per request the time of each token)."""
    from tokenmill.core.request import Request
    from tokenmill.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))
        times[f"r{i}"] = []
    while core.has_unfinished():
        for update in core.step():
            times[update.request.request_id].extend([time.perf_counter()] * len(update.new_token_ids))
    core.step()
    core.platform.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, sum(len(t) for t in times.values()), list(times.values())


def run_hf(model, prompts: list[list[int]], batch: int, device: str) -> tuple[float, int]:
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):                     # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(chunk)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


def device_bandwidth_gbs(device: str, num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy: (read + write) bytes / time, best of 5."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best / 1e9


def decode_step_bytes(cfg, itemsize: int) -> int:
    """Bytes of weights a decode step reads: every projection of every layer and the lm_head."""
    h, i, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
    return (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h) * itemsize


def batch1(core, vocab: int) -> float:
    prompt = [random.Random(1).randrange(vocab) for _ in range(128)]
    _, _, times = run_core(core, [prompt], 256)
    t = times[0]
    return (len(t) - 1) / (t[-1] - t[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--hf-requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/offline_gpu.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg, hf = hf_model(args.shape, dtype, args.device)
    vocab = cfg.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in input_lengths(args.requests)]
    rows: dict[str, float | str] = {"shape": args.shape, "dtype": args.dtype, "device": args.device,
                                    "requests": args.requests, "mean_input_len": sum(map(len, prompts)) / len(prompts)}
    if args.device.startswith("cuda"):
        rows["gpu"] = torch.cuda.get_device_name()

    hf_s, hf_tokens = run_hf(hf, prompts[:args.hf_requests], args.hf_batch, args.device)
    rows["transformers_tok_s"] = hf_tokens / hf_s
    bandwidth = device_bandwidth_gbs(args.device)
    bound = bandwidth * 1e9 / decode_step_bytes(cfg, dtype.itemsize)
    rows.update(bandwidth_gbs=bandwidth, batch1_bound_tok_s=bound)
    for eager in (False, True):
        tag = "eager" if eager else "graphs"
        t0 = time.perf_counter()
        core = tokenmill_core(cfg, hf, dtype, args.device, eager, max_model_len=2048)
        rows[f"startup_s_{tag}"] = time.perf_counter() - t0
        run_core(core, prompts[:4], 8)                                   # warm-up
        seconds, tokens, _ = run_core(core, prompts, OUTPUT_LEN)
        rows[f"offline_tok_s_{tag}"] = tokens / seconds
        rows[f"batch1_tok_s_{tag}"] = b1 = batch1(core, vocab)
        rows[f"batch1_of_bound_{tag}"] = b1 / bound
        del core
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    rows["offline_vs_transformers"] = rows["offline_tok_s_graphs"] / rows["transformers_tok_s"]
    width = max(map(len, rows))
    for k, v in rows.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
