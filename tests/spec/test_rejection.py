"""Draft verification (sample/rejection.py): greedy keeps the target's argmax run; rejection sampling
leaves the target distribution as it is (chi-square on a tiny vocabulary, first and second positions),
a seeded request repeats, and gives the tokens plain sampling gives whatever drafts each step carried."""
from __future__ import annotations

import torch

from tokenmill.sample.rejection import verify
from tokenmill.sample.sampler import Sampler, SamplingMeta
from tokenmill.sampling_params import SamplingParams

VOCAB = 8
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}   # critical values, p = 0.001


def _meta(params, generator=None):
    return SamplingMeta(params, generator, [1], [], [])


def test_greedy_accepts_the_matching_run_then_the_targets_token():
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([3, 5, 2, 7]):
        logits[row, best] = 1.0
    sampler, meta = Sampler(seed=0), _meta(SamplingParams(temperature=0.0))
    assert verify(sampler, logits, [3, 5, 2], meta) == [3, 5, 2, 7]      # all accepted, plus the bonus
    assert verify(sampler, logits, [3, 4, 2], meta) == [3, 5]            # stops at the first mismatch
    assert verify(sampler, logits, [0, 5, 2], meta) == [3]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom), bins expecting fewer than 5 merged into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_rejection_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5
    params = SamplingParams(temperature=0.8)
    p = torch.softmax(logits / 0.8, dim=-1)
    drafts = [int(p[0].argsort(descending=True)[1]), int(p[1].argmax())]   # the second likeliest, the likeliest
    sampler, meta = Sampler(seed=2), _meta(params)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(20000):
        out = verify(sampler, logits, drafts, meta)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:             # the second token follows the accepted first
            second[out[1]] += 1
    stat, df = _chi2(first, p[0])
    assert stat < CHI2_P001[df]
    stat, df = _chi2(second, p[1])
    assert second.sum() > 1000 and stat < CHI2_P001[df]


def test_a_seeded_request_repeats():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        meta = _meta(params, Sampler.make_generator(7))           # one generator across the request's steps
        runs.append([verify(Sampler(seed=None), logits, [1, 2], meta) for _ in range(8)])
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) > 1


def _plain_seeded_tokens(logits, params, seed):
    """Sampling token by token without drafts (row j: the target's logits for output j)."""
    sampler, generator = Sampler(seed=None), Sampler.make_generator(seed)
    return [sampler(logits[j:j + 1], [_meta(params, generator)]).token_ids[0]
            for j in range(logits.shape[0])]


def test_a_seeded_request_gives_the_plain_samplers_tokens_whatever_its_drafts():
    """One uniform number per emitted token, the one the plain sampler would use: the seeded tokens do not
    depend on how many drafts each step verified, nor on whether they were right."""
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(4)) * 1.5
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    plain = _plain_seeded_tokens(logits, params, 11)
    for k, right in [(1, True), (3, True), (4, False), (2, None)]:
        sampler, generator, out = Sampler(seed=None), Sampler.make_generator(11), []
        while len(out) < len(plain) - k:
            n = len(out)
            drafts = [plain[n + i] if right or (right is None and i % 2) else (plain[n + i] + 1) % VOCAB
                      for i in range(k)]
            out += verify(sampler, logits[n:n + k + 1], drafts, _meta(params, generator))
        assert out == plain[:len(out)], (k, right)


def test_min_tokens_ignores_stop_ids_outside_the_vocabulary():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 5.0
    meta = SamplingMeta(SamplingParams(temperature=0.0, min_tokens=4), None, [1], [], [2, VOCAB + 40])
    assert verify(Sampler(seed=0), logits, [0, 0], meta) == [0, 0, 0]       # EOS 2 banned, id 48 ignored


def test_min_tokens_bans_eos_only_at_the_positions_short_of_it():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 5.0                                             # EOS (id 2) is every row's argmax
    params = SamplingParams(temperature=0.0, min_tokens=2)
    meta = SamplingMeta(params, None, [1], [7], [2])                # one output so far: row 0 is output 2
    out = verify(Sampler(seed=0), logits, [3, 2], meta)
    assert out[0] != 2 and out[0] == 0                            # banned at row 0: the next best, id 0
    logits[0, 3] = 6.0
    assert verify(Sampler(seed=0), logits, [3, 2], meta) == [3, 2, 2]   # row 1 is output 3: EOS allowed


def test_relaxed_acceptance_takes_a_close_second_only_when_asked():
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, 4], logits[:, 5] = 2.0, 1.9                      # 5 is a close second everywhere
    meta = _meta(SamplingParams(temperature=0.0))
    assert verify(Sampler(seed=0), logits, [5, 5], meta) == [4]                    # strict: greedy
    assert verify(Sampler(seed=0), logits, [5, 5], meta, relaxed=(2, 0.1)) == [5, 5, 4]
    assert verify(Sampler(seed=0), logits, [5, 5], meta, relaxed=(1, 0.1)) == [4]  # not in the top 1
    assert verify(Sampler(seed=0), logits, [5, 5], meta, relaxed=(2, 0.01)) == [4] # not within delta
