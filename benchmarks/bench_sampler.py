"""Timing of tokenmill's Sampler on 64 x 49152 (medians of several runs). Prints figures, asserts nothing."""
import statistics, sys, time
import torch
from tokenmill.sampling_params import SamplingParams as P
from tokenmill.sample.sampler import Sampler, SamplingMeta as M

R, V = 64, 49152
threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
torch.set_num_threads(threads)
gen = torch.Generator().manual_seed(0)

def llm_like_logits():
    x = torch.randn(R, V, generator=gen) * 2.0 - 4.0
    hot = torch.randint(0, V, (R, 8), generator=gen)
    x.scatter_add_(1, hot, torch.linspace(18, 10, 8).expand(R, -1).contiguous())   # a few likely tokens
    return x

def flat_logits():
    return torch.randn(R, V, generator=gen) * 2.0

def timeit(fn, n=15):
    """Median wall ms and median CPU ms (process time: robust to other processes on shared cores)."""
    fn(); fn()
    walls, cpus = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t); cpus.append(time.process_time() - c)
    return f"{statistics.median(walls) * 1e3:7.2f} ms wall {statistics.median(cpus) * 1e3:7.2f} ms cpu"

prompt = torch.randint(0, V, (512,), generator=gen).tolist()
output = torch.randint(0, V, (128,), generator=gen).tolist()

def mixed_metas():
    kinds = [P(temperature=0), P(temperature=0.8), P(temperature=0.7, top_k=50, top_p=0.9),
             P(top_p=0.95), P(temperature=1.0, min_p=0.05),
             P(temperature=0.6, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2, seed=1),
             P(temperature=0, logprobs=5), P(temperature=0.9, top_k=20, seed=2, logprobs=1)]
    metas = []
    for i in range(R):
        p = kinds[i % len(kinds)]
        g = Sampler.make_generator(p.seed + i) if p.seed is not None else None
        metas.append(M(p, g, prompt, output, [2]))
    return metas

s = Sampler(seed=0)
greedy = [M(P(temperature=0), None, prompt, output, [2])] * R
temp_only = [M(P(temperature=0.8), None, prompt, output, [2])] * R
x_llm, x_flat = llm_like_logits(), flat_logits()
mixed = mixed_metas()
print(f"torch threads={threads}, logits {R} x {V} float32")
ref = torch.empty_like(x_llm)
print(f"  reference: torch.exp one pass       {timeit(lambda: torch.exp(x_llm, out=ref))}")
print(f"  raw argmax                          {timeit(lambda: x_llm.argmax(-1).tolist())}")
print(f"  greedy fast path                    {timeit(lambda: s(x_llm, greedy))}")
print(f"  all rows temperature only           {timeit(lambda: s(x_llm, temp_only))}")
print(f"  mixed batch, LLM-like logits        {timeit(lambda: s(x_llm, mixed))}")
print(f"  mixed batch, flat logits (top_p sort fallback) {timeit(lambda: s(x_flat, mixed))}")


def naive_peer(logits, metas):
    """Textbook vectorized sampler (sort-based top-k/top-p, softmax, exponential race) for a ratio."""
    x = logits.clone()
    t = torch.tensor([max(m.params.temperature, 1e-5) for m in metas])[:, None]
    k = torch.tensor([m.params.top_k or V for m in metas])
    p = torch.tensor([m.params.top_p for m in metas])
    x = x / t
    vals, idx = x.sort(dim=-1, descending=False)
    kth = vals.gather(1, (V - k)[:, None])
    vals.masked_fill_(vals < kth, float("-inf"))
    cum = vals.softmax(-1).cumsum(-1)
    vals.masked_fill_(cum <= 1 - p[:, None], float("-inf"))
    x = vals.scatter(1, idx, vals)
    probs = x.softmax(-1)
    q = torch.empty_like(probs).exponential_()
    return probs.div_(q).argmax(-1)

print(f"  peer: sort-based + exponential race {timeit(lambda: naive_peer(x_llm, mixed))}")
