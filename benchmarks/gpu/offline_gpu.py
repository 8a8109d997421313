"""GPU figures of issue 14 in one run, on random weights of a real model's shape (nothing to download):

0. Correctness first (cheap): greedy tokens of --check-prompts prompts (16 to 1,500 tokens, --check-tokens
   each; the later half added after the first step, so a step mixes decodes and prefill chunks) from
   tokenmill against transformers' `generate` on the same bf16 weights. Up to the first token where they
   differ, the logprob tokenmill reports for each token against transformers' (max |difference|); at
   that token, transformers' logit gap between its choice and tokenmill's. Verdict: "match", "near tie"
   (the gap within the noise the logprobs show: bf16 kernels may break a near tie either way), or
   "MISMATCH" (a larger gap, or logprobs apart by more than 0.25; printed as such, and the script exits
   with status 2 after the other figures).
1. Offline throughput: N requests, input lengths drawn around CNN/DailyMail's mean (~780 tokens,
   log-normal, clipped to [64, 1900]), exactly 128 output tokens each (greedy, EOS ignored), all submitted
   at once to tokenmill's engine core (token ids in and out); output tok/s = output tokens / wall time.
2. The peer in the same run on the same weights: transformers' static batching (`generate`, left-padded
   batches of --hf-batch, greedy) over the first --hf-requests requests; its output tok/s and the ratio.
3. Batch-1 decode: one 128-token prompt, 256 output tokens; decode tok/s = 255 / (last token - first
   token); the bandwidth bound = device bandwidth (a device-to-device copy of 2 GiB: read + write bytes
   / time) / bytes a decode step reads (every linear weight and the lm_head; the embedding reads one row);
   and the fraction of it achieved. With CUDA graphs and with --enforce-eager.
4. Offline again with --enforce-eager (graphs on vs off): --eager full; --eager batch1 measures only
   the eager batch-1 decode, --eager skip neither.

Run order: transformers' reference tokens, the bandwidth, the CUDA-graphs engine (check, batch-1, offline),
transformers' batches (between the engines: each engine's KV pool takes most of the device), the eager
engine. Every figure is printed and written to --out (JSON, rewritten whole after each) as soon as it is
measured, so a run cut short keeps what it measured. A phase that raises is recorded as error_<phase> and
the rest still run. --time-budget-s: a phase that could not end inside it (by rough 8B-on-H100 estimates;
the eager offline pass: 1.3x the graphs pass) is recorded as skipped_<phase>. Run it with python -u.

    python -u benchmarks/gpu/offline_gpu.py [--shape llama-3.1-8b] [--requests 1000] [--device cuda]
    python -u benchmarks/gpu/offline_gpu.py --shape tiny --device cpu --requests 8 --hf-requests 4   # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import sys
import time
import traceback

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
MAX_MODEL_LEN = 2048
CHECK_LENGTHS = (16, 100, 780, 1500)     # the correctness prompts' lengths, cycled
LOGPROB_TOLERANCE = 0.25                 # |tokenmill's logprob - transformers'| past this: not bf16 rounding


class Results:
    """The run's figures, in order; each one printed and the whole JSON rewritten as it comes."""

    def __init__(self, path: str) -> None:
        self.path, self.rows = path, {}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def set(self, **rows) -> None:
        for k, v in rows.items():
            self.rows[k] = v
            print(f"{k:<28}  {v:.4g}" if isinstance(v, float) else f"{k:<28}  {v}", flush=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.rows, f, indent=1)
        os.replace(tmp, self.path)


def input_lengths(n: int, seed: int = 0, mean: float = 780.0, sigma: float = 0.45) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2                  # log-normal with this mean
    return [min(1900, max(64, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def hf_model(shape: str, dtype: torch.dtype, device: str):
    """transformers' Llama of `shape`, random weights, built directly in `dtype` on `device` (an 8B model
    built in float32 first would take 32 GB before its cast)."""
    import transformers
    cfg = transformers.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
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


def _params(output_len: int, logprobs: int | None = None):
    from tokenmill.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                          logprobs=logprobs)


def run_core(core, prompts: list[list[int]], output_len: int) -> tuple[float, int, list[list[float]]]:
    """All prompts at once; returns (seconds, output tokens, per request the time of each token)."""
    from tokenmill.core.request import Request
    params = _params(output_len)
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


def core_greedy(core, prompts: list[list[int]], output_len: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs per prompt; the second half of the prompts is added after the first
    step, so the next steps mix the first half's decodes with the second half's prefill chunks."""
    from tokenmill.core.request import Request
    params = _params(output_len, logprobs=0)
    out = {f"c{i}": ([], []) for i in range(len(prompts))}
    half = max(1, len(prompts) // 2)

    def take(updates):
        for u in updates:
            tokens, logprobs = out[u.request.request_id]
            if u.error:
                raise RuntimeError(f"request {u.request.request_id} failed: {u.error}")
            tokens.extend(u.new_token_ids)
            logprobs.extend(lp.sampled.logprob for lp in u.new_logprobs)
    for i in range(half):
        core.add_request(Request(f"c{i}", prompts[i], params))
    take(core.step())
    for i in range(half, len(prompts)):
        core.add_request(Request(f"c{i}", prompts[i], params))
    while core.has_unfinished():
        take(core.step())
    core.step()
    return [out[f"c{i}"] for i in range(len(prompts))]


def hf_greedy(model, prompts: list[list[int]], output_len: int, device: str) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens (EOS banned for output_len tokens, as tokenmill's min_tokens) and the
    raw logits of each step ([output_len, vocab] float32, on the host), one prompt at a time."""
    results = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p], device=device), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(p):].tolist()
        results.append((tokens, torch.stack([s[0].float().cpu() for s in out.logits])))
    return results


def compare(reference, ours) -> dict:
    """Per prompt: tokens equal up to the first difference; there, transformers' logit gap between its token and
    tokenmill's; before it (and at it), |tokenmill's logprob - transformers' log_softmax| of tokenmill's tokens."""
    agree = total = 0
    worst_logprob, gaps, diverged = 0.0, [], []
    for i, ((hf_tokens, logits), (tm_tokens, tm_logprobs)) in enumerate(zip(reference, ours)):
        total += len(hf_tokens)
        logprobs = torch.log_softmax(logits, dim=-1)
        for j, (a, b) in enumerate(zip(hf_tokens, tm_tokens)):
            if j < len(tm_logprobs):
                worst_logprob = max(worst_logprob, abs(tm_logprobs[j] - logprobs[j, b].item()))
            if a != b:
                gaps.append(logits[j, a].item() - logits[j, b].item())
                diverged.append(f"prompt {i} at token {j}")
                break
            agree += 1
        if len(tm_tokens) != len(hf_tokens):
            diverged.append(f"prompt {i}: {len(tm_tokens)} tokens, transformers {len(hf_tokens)}")
            gaps.append(float("inf"))
    noise = max(0.1, 4 * worst_logprob)     # a gap within the logprobs' own disagreement is a near tie
    if worst_logprob > LOGPROB_TOLERANCE:    # ... unless they disagree beyond bf16's rounding: wrong numbers
        verdict = "MISMATCH"
    else:
        verdict = "match" if not diverged else "near tie" if max(gaps) <= noise else "MISMATCH"
    return {"check_verdict": verdict, "check_tokens_agreeing": f"{agree}/{total}",
            "check_max_logprob_diff": worst_logprob, "check_max_gap_at_divergence": max(gaps, default=0.0),
            "check_divergences": "; ".join(diverged) or "none"}


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
    run_core(core, [prompt[:32]], 8)                                  # warm-up: batch-1 steps compiled, captured
    _, _, times = run_core(core, [prompt], 256)
    t = times[0]
    return (len(t) - 1) / (t[-1] - t[0])


def free_device(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def estimates(args) -> dict[str, float]:
    """Rough seconds of each phase on one H100 at the 8B shape (other shapes: none), so that a phase that could
    not end inside --time-budget-s is skipped rather than cut off."""
    if args.shape != "llama-3.1-8b":
        return {}
    return {"check_reference": 10, "bandwidth": 3, "startup_graphs": 45, "check": 10, "batch1_graphs": 10,
            "offline_graphs": 15 + 0.1 * args.requests, "transformers": 5 + 10 * math.ceil(args.hf_requests / args.hf_batch),
            "startup_eager": 20, "batch1_eager": 20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=1000, help="offline requests (default 1000)")
    ap.add_argument("--hf-requests", type=int, default=256, help="of them, run through transformers (default 256)")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--eager", choices=("full", "batch1", "skip"), default="full",
                    help="the --enforce-eager passes: offline and batch-1 (full), batch-1 only, or none")
    ap.add_argument("--check-prompts", type=int, default=4, help="correctness prompts (0: no check)")
    ap.add_argument("--check-tokens", type=int, default=16, help="greedy tokens per correctness prompt")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="end within about this many seconds: a phase that could not end inside it is skipped "
                         "(default: no limit)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/offline_gpu.json")
    args = ap.parse_args()
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    results = Results(args.out)
    expected = estimates(args)
    mismatch = False

    def left() -> float:
        return math.inf if args.time_budget_s is None else args.time_budget_s - (time.perf_counter() - start)

    @contextlib.contextmanager
    def phase(name: str, needs_s: float | None = None):
        """Run the block unless the budget cannot hold it (then skipped_<name>); an error is error_<name>."""
        needs = expected.get(name, 0.0) if needs_s is None else needs_s
        if left() < needs or left() <= 0:
            results.set(**{f"skipped_{name}": f"time budget ({left():.0f} s left, needs ~{needs:.0f} s)"})
            yield False
            return
        t0 = time.perf_counter()
        try:
            yield True
        except Exception as e:  # noqa: BLE001 - one phase's failure must not lose the others' figures
            traceback.print_exc()
            results.set(**{f"error_{name}": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        finally:
            print(f"# phase {name}: {time.perf_counter() - t0:.1f} s (at {time.perf_counter() - start:.0f} s)",
                  flush=True)

    t0 = time.perf_counter()
    cfg, hf = hf_model(args.shape, dtype, args.device)
    vocab = cfg.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in input_lengths(args.requests)]
    check_prompts = [[rng.randrange(vocab) for _ in range(CHECK_LENGTHS[i % len(CHECK_LENGTHS)])]
                     for i in range(args.check_prompts)]
    results.set(shape=args.shape, dtype=args.dtype, device=args.device, requests=args.requests,
                mean_input_len=sum(map(len, prompts)) / max(1, len(prompts)), hf_build_s=time.perf_counter() - t0)
    if args.device.startswith("cuda"):
        results.set(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=str(torch.version.cuda))

    # order: correctness, then tokenmill's figures, then the peer and the eager pass (each engine's KV pool takes
    # most of the device, so transformers' own batches run between the two engines)
    reference = None
    if args.check_prompts:
        with phase("check_reference") as go:
            if go:
                reference = hf_greedy(hf, check_prompts, args.check_tokens, args.device)
    bound = None
    with phase("bandwidth") as go:
        if go:
            bandwidth = device_bandwidth_gbs(args.device)
            bound = bandwidth * 1e9 / decode_step_bytes(cfg, dtype.itemsize)
            results.set(bandwidth_gbs=bandwidth, batch1_bound_tok_s=bound)
    free_device(args.device)

    def engine(tag: str, eager: bool, steps) -> None:
        core = None
        with phase(f"startup_{tag}") as go:
            if go:
                t0 = time.perf_counter()
                core = tokenmill_core(cfg, hf, dtype, args.device, eager, max_model_len=MAX_MODEL_LEN)
                results.set(**{f"startup_s_{tag}": time.perf_counter() - t0})
        if core is not None:
            for step in steps:
                step(core)
        del core
        free_device(args.device)

    def check(core) -> None:
        nonlocal mismatch
        if reference is None:
            return
        with phase("check") as go:
            if go:
                verdict = compare(reference, core_greedy(core, check_prompts, args.check_tokens))
                results.set(**verdict)
                if verdict["check_verdict"] == "MISMATCH":
                    mismatch = True
                    print("CORRECTNESS MISMATCH: tokenmill's greedy tokens differ from transformers' beyond a near "
                          f"tie ({verdict['check_divergences']})", flush=True)

    def batch1_decode(tag: str):
        def step(core) -> None:
            with phase(f"batch1_{tag}") as go:
                if go:
                    b1 = batch1(core, vocab)
                    results.set(**{f"batch1_tok_s_{tag}": b1})
                    if bound:
                        results.set(**{f"batch1_of_bound_{tag}": b1 / bound})
        return step

    def offline(tag: str):
        def step(core) -> None:
            graphs_s = results.rows.get("offline_s_graphs")
            needs = 1.3 * graphs_s if tag == "eager" and graphs_s else None   # eager: about the graphs pass, or longer
            with phase(f"offline_{tag}", needs) as go:
                if go:
                    run_core(core, prompts[:4], 8)                                   # warm-up
                    seconds, tokens, _ = run_core(core, prompts, OUTPUT_LEN)
                    results.set(**{f"offline_tok_s_{tag}": tokens / seconds, f"offline_s_{tag}": seconds})
        return step

    engine("graphs", False, [check, batch1_decode("graphs"), offline("graphs")])
    with phase("transformers") as go:
        if go:
            hf_s, hf_tokens = run_hf(hf, prompts[:args.hf_requests], args.hf_batch, args.device)
            results.set(transformers_tok_s=hf_tokens / hf_s, transformers_requests=min(args.hf_requests, len(prompts)))
    free_device(args.device)
    if args.eager == "skip":
        results.set(skipped_eager="--eager skip")
    else:
        engine("eager", True, [batch1_decode("eager")] + ([offline("eager")] if args.eager == "full" else []))
    rows = results.rows
    if "offline_tok_s_graphs" in rows and "transformers_tok_s" in rows:
        results.set(offline_vs_transformers=rows["offline_tok_s_graphs"] / rows["transformers_tok_s"])
    if "offline_tok_s_graphs" in rows and "offline_tok_s_eager" in rows:
        results.set(offline_graphs_vs_eager=rows["offline_tok_s_graphs"] / rows["offline_tok_s_eager"])
    results.set(total_s=time.perf_counter() - start)
    if mismatch:
        print("CORRECTNESS MISMATCH (see check_* above)", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
