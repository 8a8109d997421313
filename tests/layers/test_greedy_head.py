"""The greedy head (layers/greedy_head.py, csrc/greedy_head.cpp): greedy tokens from a float32 lm_head
without its float32 logits. Checked against the argmax of float64 logits, on cases built to defeat the
int8 screen (exact ties, logits apart by far less than int8 or bfloat16 can tell, huge hidden dimensions,
banned winners), and in the engine against the logits path on the same requests."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.cpu_greedy_head import GreedyHead, Int8Screen
from tokenmill.quant.unquantized import pack_f32_tiles

class _Head:
    """The parts of a Linear that GreedyHead.build reads."""
    def __init__(self, weight: torch.Tensor) -> None:
        self.f32_tiles, self.out_features, self.bias = pack_f32_tiles(weight), weight.shape[0], None


def make_head(weight: torch.Tensor) -> GreedyHead:
    head = GreedyHead.build(_Head(weight))
    if head is None:
        pytest.skip("the greedy head needs AVX-512 VNNI and the native kernels")
    return head


def reference(x: torch.Tensor, w: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """argmax over the float64 logits with banned tokens at -inf (lowest index on ties)."""
    logits = x.double() @ w.double().T
    for row, ids in enumerate(banned):
        logits[row, ids] = float("-inf")
    return logits.argmax(dim=1)


@pytest.mark.parametrize("n,k", [(1000, 64), (49152 // 8, 576), (17, 2), (33, 130)])
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("huge", [1, 40])     # the default model's hidden states have one; 40 > the split's 24
def test_matches_float64_argmax(n, k, m, huge):
    g = torch.Generator().manual_seed(n + k + m + huge)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    dims = torch.randperm(k, generator=g)[:huge]
    x[:, dims] = 60.0 * torch.sign(torch.randn(m, len(dims), generator=g))
    head = make_head(w)
    banned = [[] for _ in range(m)]
    assert torch.equal(head(x, banned), reference(x, w, banned))
    assert head.rows_screened == m and head.candidates_checked >= m


def test_exact_ties_give_the_lowest_index():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=g)
    w[250] = w[7] = w[123]                  # three identical rows: identical logits
    x = w[123:124].clone() * 3              # ... and the largest ones
    head = make_head(w)
    assert head(x, [[]]).tolist() == [7]


def test_differences_below_bfloat16_resolution_are_resolved_exactly():
    """Rows equal in bfloat16 and apart by one float32 ulp in a single weight: the screen cannot tell them
    apart, the double-precision recheck must."""
    g = torch.Generator().manual_seed(2)
    k = 96
    w = torch.randn(500, k, generator=g) * 0.01
    x = torch.rand(4, k, generator=g) + 1.0           # positive: a larger weight gives a larger logit
    base = torch.rand(k, generator=g) + 1.0
    for row, bump in [(10, 0), (20, 1), (30, 2), (40, 0)]:
        w[row] = base
        w[row, 5] = torch.nextafter(base[5], torch.tensor(10.0)) if bump else base[5]
        if bump == 2:
            w[row, 6] = torch.nextafter(base[6], torch.tensor(10.0))
    rows = w[[10, 20, 30, 40]].bfloat16()
    assert all(torch.equal(rows[0], r) for r in rows)           # the screen sees four equal rows
    head = make_head(w)
    tokens = head(x, [[] for _ in range(4)])
    assert tokens.tolist() == [30] * 4 == reference(x, w, [[]] * 4).tolist()
    assert head.candidates_checked >= 4 * 4          # all four near-equal rows rechecked in every row


def test_banned_tokens_are_never_chosen():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(800, 64, generator=g) * 0.1
    x = torch.randn(3, 64, generator=g)
    head = make_head(w)
    winners = reference(x, w, [[], [], []]).tolist()
    banned = [[winners[0]], [], [winners[2], 799, 5000, -3]]   # out-of-vocabulary ids are ignored
    tokens = head(x, banned)
    assert tokens.tolist() == reference(x, w, [[winners[0]], [], [winners[2], 799]]).tolist()
    assert tokens[0] != winners[0] and tokens[1] == winners[1] and tokens[2] != winners[2]


def test_rows_without_a_screened_answer_get_minus_one():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 32, generator=g)
    x = torch.randn(4, 32, generator=g)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    head = make_head(w)
    tokens = head(x, [[], [], [], list(range(40))])    # row 3: every token banned
    assert tokens[1:].tolist() == [-1, -1, -1]
    assert tokens[0] == reference(x[:1], w, [[]])[0]


def test_int8_screen_layout_and_error_norms():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, 10, generator=g)
    w[4] = 0.0                                                    # a zero row: scale 1, no error
    sc = Int8Screen.from_f32_tiles(pack_f32_tiles(w), 37, rows_per_pass=8)
    assert sc.tiles.shape == (3, 3, 64) and sc.scales.shape == sc.qsums.shape == (48,)
    q = torch.round(w.double() / sc.scales[:37, None].double()).clamp(-127, 127)
    for block, quad, row in [(0, 0, 0), (1, 2, 4), (2, 1, 4), (0, 1, 15)]:
        got = sc.tiles[block, quad, 4 * row:4 * row + 4].tolist()
        want = q[16 * block + row, 4 * quad:4 * quad + 4].tolist() + [0] * 4   # inputs past K are zero
        assert got == [int(v) for v in want[:4]]
    assert torch.equal(sc.tiles[2, :, 4 * 5:].float(), torch.zeros(3, 44))    # rows past N are zero
    assert torch.equal(sc.qsums[:37], q.sum(dim=1).int()) and not sc.qsums[37:].any()
    assert sc.scales[4] == 1.0 and sc.err_norms[4] < 1e-30
    err = (w.double() - sc.scales[:37, None].double() * q).norm(dim=1)
    assert bool((sc.err_norms.double() >= err).all()) and bool((sc.norms.double() >= w.double().norm(dim=1)).all())
    assert bool((err <= sc.scales[:37].double() / 2 * 10 ** 0.5 * 1.0001).all())   # |e_jk| <= s_j / 2


def test_not_built_for_non_finite_weights():
    w = torch.randn(20, 8)
    w[3, 1] = float("inf")
    assert GreedyHead.build(_Head(w)) is None


def test_not_built_for_a_head_with_bias():
    lin = _Head(torch.randn(20, 8))
    lin.bias = torch.zeros(20)
    assert GreedyHead.build(lin) is None


PROMPTS = [[11, 220, 4890, 17, 9, 300, 5], [7, 8, 9], [1000, 2000, 3000, 4000, 5000], [42] * 20]


@pytest.mark.parametrize("tie", [True, False])
def test_engine_tokens_match_the_logits_path(tiny_model_factory, tie):
    """Greedy requests (with min_tokens masking EOS, as the benchmarks ask) give the same tokens with the
    screen as through the logits and the sampler; requests it cannot answer (logprobs, sampling) still
    take the logits path."""
    model_dir = tiny_model_factory("llama", tie_word_embeddings=tie)
    outs = {}
    for screen in (True, False):
        llm = LLM(model_dir, greedy_screen=screen, kv_cache_memory_bytes=1 << 23, block_size=4,
                  enable_prefix_caching=False)
        head = llm.engine.core.runner.greedy_head
        if screen and head is None:
            pytest.skip("the greedy head needs AVX-512 VNNI and the native kernels")
        greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True)
        outs[screen] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        if screen:
            assert head.rows_screened == 12 * len(PROMPTS)
            with_logprobs = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2)
            llm.generate(PROMPTS[:1], with_logprobs)
            assert head.rows_screened == 12 * len(PROMPTS)           # not screened: logprobs need logits
    assert outs[True] == outs[False]


def test_greedy_verification_of_drafts_reads_the_screen(tiny_model_factory):
    """Speculative verify rows (n-gram drafts) take their target tokens from the greedy head, min_tokens bans
    at each row's own position included: the same tokens as the logits path and as no speculation."""
    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    prompts = [[101, 202, 303, 404, 505] * 5, [11, 12, 13] * 6, [42] * 9]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    outs = {}
    for name, screen, speculative in (("screen", True, spec), ("logits", False, spec), ("plain", True, None)):
        llm = LLM(model_dir, greedy_screen=screen, kv_cache_memory_bytes=1 << 23, block_size=4,
                  enable_prefix_caching=False, speculative_config=speculative)
        head = llm.engine.core.runner.greedy_head
        if screen and head is None:
            pytest.skip("the greedy head needs AVX-512 VNNI and the native kernels")
        stop = llm.engine.core.runner.model.config.vocab_size - 1
        params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=14, stop_token_ids=[stop, 303, 12])
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name == "screen":
            stats = llm.engine.stats().spec_decode
            assert stats.num_drafts > 0
            # every target token came from the screen: more rows than steps where drafts were verified
            assert head.rows_screened >= sum(len(t) for t in outs[name]) + stats.num_draft_tokens - stats.num_accepted_tokens
    assert outs["screen"] == outs["logits"] == outs["plain"]
