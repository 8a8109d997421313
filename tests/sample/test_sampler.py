"""Sampler: distributions, truncation rules, seeds, greedy, penalties, min_tokens and logprobs."""
import pytest
import torch

from tokenmill.sample import topk as topk_module
from tokenmill.sample import truncation
from tokenmill.sample.penalties import apply_penalties
from tokenmill.sample.sampler import Sampler, SamplingMeta
from tokenmill.sampling_params import SamplingParams

NUM_DRAWS = 20_000
# 4+ standard deviations of a frequency estimated from NUM_DRAWS draws (sd <= 0.5 / sqrt(20000)).
FREQ_ATOL = 0.015
BASE = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 2.5, -0.5])


def meta(params=None, prompt=(), output=(), eos=(), generator=None, **kw):
    params = params or SamplingParams(**kw)
    return SamplingMeta(params=params, generator=generator, prompt_token_ids=list(prompt),
                        output_token_ids=list(output), eos_token_ids=list(eos))


def frequencies(logits_row, params, num=NUM_DRAWS, seed=0, batch=4000):
    """Empirical token frequencies from `num` independent rows of the same logits, `batch` rows a step."""
    sampler = Sampler(seed=seed)
    tokens = []
    for start in range(0, num, batch):
        rows = min(batch, num - start)
        logits = logits_row.expand(rows, -1)               # [rows, vocab] view: must stay unmodified
        tokens += sampler(logits, [meta(params)] * rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel()).float() / num


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward per-rule reference, in the documented order top_k -> top_p -> min_p."""
    probs = torch.softmax(logits / temperature, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= logits >= torch.topk(logits, top_k).values[-1]
    if top_p < 1.0:
        p = torch.where(keep, probs, 0.0)
        p = p / p.sum()
        order = torch.argsort(p, descending=True)
        cum = torch.cumsum(p[order], 0)
        num_keep = int((cum < top_p).sum()) + 1
        nucleus = torch.zeros_like(keep)
        nucleus[order[:num_keep]] = True
        keep &= nucleus
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


# ---------------------------------------------------------------- distributions and truncation

@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 2.0},
    {"temperature": 0.9, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 1.5, "min_p": 0.2},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.8, "min_p": 0.1},
    {"temperature": 1.3, "top_k": 6, "top_p": 0.9},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_empirical_distribution_matches_reference(kwargs):
    expected = reference_probs(BASE, **kwargs)
    observed = frequencies(BASE, SamplingParams(**kwargs))
    assert torch.allclose(observed, expected, atol=FREQ_ATOL), (observed, expected)
    assert torch.all(observed[expected == 0] == 0), "a truncated token was sampled"


def test_top_k_keeps_exactly_k_tokens():
    for k in (1, 2, 5, 7):
        observed = frequencies(BASE, SamplingParams(top_k=k, temperature=3.0), num=5000)
        assert set(observed.nonzero().flatten().tolist()) == set(torch.topk(BASE, k).indices.tolist())


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    for top_p, kept in [(0.45, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (0.97, {0, 1, 2, 3})]:
        observed = frequencies(logits, SamplingParams(top_p=top_p), num=5000)
        assert set(observed.nonzero().flatten().tolist()) == kept, top_p


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    observed = frequencies(probs.log(), SamplingParams(min_p=0.3), num=5000)  # drop prob < 0.12
    assert set(observed.nonzero().flatten().tolist()) == {0, 1, 2}
    observed = frequencies(probs.log(), SamplingParams(min_p=1.0), num=1000)
    assert set(observed.nonzero().flatten().tolist()) == {0}


def test_top_p_threshold_matches_sort_reference_including_large_nucleus():
    # vocab 2000: flat rows have nuclei past every candidate stage (full sort), peaked rows stop early.
    gen = torch.Generator().manual_seed(1)
    logits = torch.cat([torch.randn(3, 2000, generator=gen) * 0.3,     # flat: large nucleus
                        torch.randn(3, 2000, generator=gen) * 6.0])    # peaked: small nucleus
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.2])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.9, 0.5, 0.8])
    probs = truncation.scaled_probs_(logits.clone(), logits.amax(-1), temperature)  # [6, 2000]
    thresholds = truncation.top_p_thresholds(probs, top_p, torch.zeros(6))
    for r in range(6):
        expected = reference_probs(logits[r], temperature=float(temperature[r]), top_p=float(top_p[r]))
        kept = probs[r] >= thresholds[r]
        assert torch.equal(kept, expected > 0), r
    sizes = (probs >= thresholds[:, None]).sum(-1).tolist()             # every search stage is used
    first, second = truncation.TOP_P_CANDIDATES
    assert min(sizes) <= first and any(first < n <= second for n in sizes) and max(sizes) > second


def test_masked_vocab_padding_is_never_sampled():
    logits = torch.full((4000, 10), float("-inf"))
    logits[:, :4] = torch.tensor([0.0, 1.0, 0.5, 2.0])
    params = [SamplingParams(), SamplingParams(top_p=0.99), SamplingParams(min_p=0.01),
              SamplingParams(top_k=20)]
    out = Sampler(seed=3)(logits, [meta(params[i % 4]) for i in range(4000)])
    assert max(out.token_ids) < 4


def test_extreme_temperatures():
    logits = torch.tensor([[5.0, 4.0, -3.0, float("-inf")]]).expand(3000, -1)
    cold = Sampler(seed=0)(logits, [meta(temperature=1e-4)] * 3000).token_ids   # exp underflows
    assert set(cold) == {0}
    hot = frequencies(logits[0], SamplingParams(temperature=1e4), num=3000)      # ~uniform, -inf kept out
    assert torch.allclose(hot[:3], torch.full((3,), 1 / 3), atol=0.04) and hot[3] == 0


def test_bfloat16_logits_are_accepted():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 300, generator=g)
    logits[torch.arange(8), torch.randint(0, 300, (8,), generator=g)] += 10   # one clear maximum per row:
    logits = logits.to(torch.bfloat16)                                         # bf16 rounding makes ties
    metas = [meta(temperature=0), meta(temperature=0, logprobs=2)] * 4
    out = Sampler()(logits, metas)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs[1].top[0].token_id == out.token_ids[1]


def test_reused_sampler_gives_same_results_across_batch_shapes():
    gen = torch.Generator().manual_seed(4)
    big, small = torch.randn(40, 3000, generator=gen), torch.randn(5, 3000, generator=gen)
    metas_big = [meta(temperature=0.8, top_k=30, top_p=0.9, logprobs=3,
                      generator=Sampler.make_generator(i), repetition_penalty=1.3, prompt=[i])
                 for i in range(40)]
    metas_small = metas_big[:5]
    shared = Sampler()
    first = shared(big, metas_big)
    second = shared(small, [meta(m.params, prompt=[i], generator=Sampler.make_generator(100 + i))
                            for i, m in enumerate(metas_small)])
    fresh = Sampler()(small, [meta(m.params, prompt=[i], generator=Sampler.make_generator(100 + i))
                              for i, m in enumerate(metas_small)])
    assert len(first.token_ids) == 40
    assert second == fresh


def test_sampler_works_inside_and_outside_inference_mode():
    sampler = Sampler(seed=0)
    logits = torch.randn(4, 300, requires_grad=True)
    metas = [meta(top_k=3, logprobs=2, repetition_penalty=1.2, prompt=[1])] * 4
    with torch.inference_mode():
        inside = sampler(logits, metas)
    outside = sampler(logits, metas)
    assert len(inside.token_ids) == len(outside.token_ids) == 4


# ---------------------------------------------------------------- seeds and reproducibility

SEEDED = SamplingParams(seed=1234, temperature=1.2, top_k=40, top_p=0.95)


def seeded_logits(step):
    return torch.randn(500, generator=torch.Generator().manual_seed(100 + step)) * 2.0


def test_same_seed_same_tokens_and_different_seeds_differ():
    def tokens_for(seed):
        gen = Sampler.make_generator(seed)
        params = SEEDED.replace(seed=seed)
        return [Sampler()(seeded_logits(s)[None], [meta(params, generator=gen)]).token_ids[0]
                for s in range(30)]
    assert tokens_for(1234) == tokens_for(1234)
    assert tokens_for(1234) != tokens_for(4321)


@pytest.mark.parametrize("position,batch_size", [(0, 1), (0, 8), (5, 8), (16, 17)])
def test_seeded_row_is_independent_of_batch(position, batch_size):
    gen_alone = Sampler.make_generator(SEEDED.seed)
    alone = [Sampler()(seeded_logits(s)[None], [meta(SEEDED, generator=gen_alone)]).token_ids[0]
             for s in range(30)]
    gen = Sampler.make_generator(SEEDED.seed)
    others = [SamplingParams(temperature=0.5), SamplingParams(top_k=300, top_p=0.5),
              SamplingParams(temperature=0), SamplingParams(seed=7, min_p=0.1, logprobs=3),
              SamplingParams(repetition_penalty=1.5, top_k=2)]
    in_batch = []
    for s in range(30):
        logits = torch.randn(batch_size, 500) * 3.0
        logits[position] = seeded_logits(s)
        metas = [meta(others[i % len(others)], prompt=[1, 2], output=[3],
                      generator=Sampler.make_generator(i)) for i in range(batch_size)]
        metas[position] = meta(SEEDED, generator=gen)
        in_batch.append(Sampler(seed=s)(logits, metas).token_ids[position])
    assert in_batch == alone


def test_shared_generator_seed_makes_unseeded_batches_reproducible():
    logits = torch.randn(16, 100)
    metas = [meta(temperature=1.0)] * 16
    assert Sampler(seed=5)(logits, metas).token_ids == Sampler(seed=5)(logits, metas).token_ids


# ---------------------------------------------------------------- greedy

def test_greedy_equals_argmax_fast_and_mixed_paths():
    logits = torch.randn(64, 1000)
    expected = logits.argmax(-1).tolist()
    assert Sampler()(logits, [meta(temperature=0)] * 64).token_ids == expected     # fast path
    mixed = [meta(temperature=0 if i % 2 else 1.0) for i in range(64)]
    got = Sampler()(logits, mixed).token_ids
    assert got[1::2] == expected[1::2]
    tiny = Sampler()(logits, [meta(temperature=1e-7, logprobs=1)] * 64).token_ids   # treated as greedy
    assert tiny == expected


def test_logits_are_not_modified():
    logits = torch.randn(6, 50)
    before = logits.clone()
    metas = [meta(repetition_penalty=2.0, prompt=[1, 2], output=[3]),
             meta(temperature=0, presence_penalty=1.0, output=[4, 4]),
             meta(min_tokens=2, eos=[0]), meta(top_k=3, top_p=0.5, min_p=0.1),
             meta(logprobs=5), meta(temperature=0)]
    Sampler()(logits, metas)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- penalties and min_tokens

def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    m = meta(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
             prompt=[0, 1], output=[1, 3, 3])
    apply_penalties(logits, [m])
    # repetition on {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {1: 1, 3: 2}:
    # token 1: -2 - 0.5*1 - 0.25; token 3: 1.5 - 0.5*2 - 0.25. Prompt-only token 0: no freq/presence.
    assert logits.tolist() == [[1.0, -2.75, 0.5, 0.25, -2.0, 1.0]]


def test_penalties_per_row_and_negative_values():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    metas = [meta(repetition_penalty=0.5, prompt=[2]),            # < 1 encourages: 3 / 0.5
             meta(presence_penalty=-1.0, output=[0, 0, 0]),       # negative presence encourages
             meta(frequency_penalty=1.0, output=[2, 2, 1])]
    apply_penalties(logits, metas)
    assert logits.tolist() == [[1.0, 2.0, 6.0], [2.0, 2.0, 3.0], [1.0, 1.0, 1.0]]


def test_penalties_change_greedy_choice_and_logprobs():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    m = meta(temperature=0, logprobs=6, repetition_penalty=2.0, frequency_penalty=0.5,
             presence_penalty=0.25, prompt=[0, 1], output=[1, 3, 3])
    out = Sampler()(logits, [m])
    processed = torch.tensor([1.0, -2.75, 0.5, 0.25, -2.0, 1.0])
    assert out.token_ids == [0]                                    # tie 0 / 5: argmax takes the first
    expected = torch.log_softmax(processed, -1)
    assert out.logprobs[0].sampled.logprob == pytest.approx(float(expected[0]), abs=1e-6)
    got = {lp.token_id: lp.logprob for lp in out.logprobs[0].top}
    assert got == pytest.approx({i: float(v) for i, v in enumerate(expected)}, abs=1e-6)


def test_min_tokens_masks_eos_and_stop_ids_then_stops_masking():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.5, 10.0]])      # eos 5 best, stop id 2 second
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2], logprobs=0)
    for num_out, expected in [(0, 3), (2, 3), (3, 5)]:
        out = Sampler()(logits, [meta(params, output=[1] * num_out, eos=[5])])
        assert out.token_ids == [expected], num_out
    masked = Sampler()(logits, [meta(params.replace(logprobs=2), output=[1], eos=[5])])
    assert masked.logprobs[0].top[0].token_id == 3
    assert all(lp.token_id not in (2, 5) for lp in masked.logprobs[0].top)
    # ignore_eos does not mask: the engine just does not stop on EOS.
    out = Sampler()(logits, [meta(temperature=0, ignore_eos=True, eos=[5])])
    assert out.token_ids == [5]


def test_min_tokens_masks_random_rows():
    logits = torch.tensor([0.0, 0.1, 0.2, 0.3]).expand(2000, -1)
    params = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[0])
    out = Sampler(seed=0)(logits, [meta(params, output=[1], eos=[3])] * 2000)
    assert set(out.token_ids) == {1, 2}


# ---------------------------------------------------------------- logprobs

def test_logprobs_equal_log_softmax_before_temperature():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen) * 3
    metas = [meta(temperature=0.5, logprobs=5), meta(temperature=0, logprobs=0), meta(temperature=1.0),
             meta(temperature=2.0, top_k=10, logprobs=20)]
    out = Sampler(seed=1)(logits, metas)
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[row]
        token = out.token_ids[row]
        assert lp.sampled.token_id == token
        assert lp.sampled.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)
        assert [t.token_id for t in lp.top] == torch.topk(expected[row], k).indices.tolist()
        values = [t.logprob for t in lp.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(torch.topk(expected[row], k).values.tolist(), abs=1e-5)


# ---------------------------------------------------------------- input checks

def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.randn(3, 10), [meta()] * 2)


def test_all_masked_row_raises_clear_error():
    logits = torch.full((1, 5), float("-inf"))
    with pytest.raises(ValueError, match="no finite best logit"):
        Sampler()(logits, [meta()])


def test_penalty_token_out_of_vocab_raises():
    with pytest.raises(ValueError, match="token ids"):
        Sampler()(torch.randn(1, 10), [meta(repetition_penalty=1.2, prompt=[10])])


def test_empty_batch():
    out = Sampler()(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []


def test_make_generator_accepts_any_int_seed():
    for seed in (0, -1, 2**70):
        assert Sampler.make_generator(seed).initial_seed() == seed % 2**64
    assert 0 <= Sampler(seed=-3)(torch.randn(1, 4), [meta()]).token_ids[0] < 4


# ---------------------------------------------------------------- two-level inverse-CDF draw

def test_inverse_cdf_draw_matches_float64_reference():
    gen = torch.Generator().manual_seed(2)
    vocab = 2 * truncation.SAMPLE_CHUNK + 300                          # two full chunks and a short one
    probs = torch.rand(3, vocab, generator=gen) ** 4
    probs[0, :1500] = 0.0                                              # whole zero chunks
    probs[1, ::2] = 0.0                                                # zeros interleaved
    probs[2, :-1] = 0.0                                                # only the very last token
    uniforms = torch.linspace(0, 1 - 2**-24, 997)
    for r in range(3):
        rows = probs[r].expand(uniforms.numel(), -1)
        tokens = truncation.sample_inverse_cdf(rows, uniforms)
        cdf = torch.cumsum(probs[r].double(), 0)
        target = uniforms.double() * cdf[-1]
        assert torch.all(probs[r][tokens] > 0)
        before = torch.where(tokens > 0, cdf[(tokens - 1).clamp(min=0)], 0.0)
        tol = 1e-5 * cdf[-1]
        assert torch.all(before <= target + tol) and torch.all(target < cdf[tokens] + tol)


def test_distribution_across_chunks_and_short_last_chunk():
    vocab = 3 * truncation.SAMPLE_CHUNK + 17
    logits = torch.full((vocab,), float("-inf"))
    hot = [3, truncation.SAMPLE_CHUNK - 1, truncation.SAMPLE_CHUNK, 2500, vocab - 1]
    logits[hot] = torch.tensor([0.5, 1.0, -0.5, 0.0, 1.5])
    observed = frequencies(logits, SamplingParams(temperature=1.0))
    expected = torch.softmax(logits, -1)
    assert torch.allclose(observed, expected, atol=FREQ_ATOL)
    assert set(observed.nonzero().flatten().tolist()) == set(hot)


# ---------------------------------------------------------------- chunked top-k

@pytest.mark.parametrize("vocab,k", [(4096, 5), (4096, 64), (4100, 20), (3000, 1), (200, 50), (64, 0)])
def test_chunked_topk_matches_torch_topk(vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(6, vocab, generator=gen)
    x[1] = torch.round(x[1])                                           # many ties
    x[2, : vocab // 2] = float("-inf")
    x[3] = -torch.arange(vocab, dtype=torch.float32)                   # best values in the first chunk
    x[4] = torch.arange(vocab, dtype=torch.float32)                    # best values in the tail
    values, indices = topk_module.topk(x, k)
    expected = torch.topk(x, k, dim=-1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(1, indices), values)
    assert all(len(set(row)) == k for row in indices.tolist())         # distinct elements
    rows = torch.tensor([4, 1, 3])
    sub_values, sub_indices = topk_module.topk(x, k, rows=rows)
    assert torch.equal(sub_values, expected[rows])
    assert torch.equal(x[rows].gather(1, sub_indices), sub_values)
