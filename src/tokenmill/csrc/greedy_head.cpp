// Exact greedy tokens without the float32 logits.
//
// A greedy row needs only argmax_j l_j, l_j = w_j . x over the vocabulary (w_j: the lm_head's float32 row j,
// x: the row's final hidden state, K inputs). Computing every l_j in float32 is a decode step's largest GEMM
// after the layers' (default model, 64 rows: 64 x 49152 x 576, 18 ms of a 110 ms step). Instead:
//   1. screen: a_j = bf16(w_j) . bf16(x), AVX-512 BF16 `vdpbf16ps` (twice the float32 FMA rate, half the
//      weight bytes), bfloat16 products exact in float32 and accumulated in float32;
//   2. bound: |a_j - l_j| <= b_j = c ||w_j|| ||x|| + an underflow term, c = 1.01 (2u + u^2 + g (1 + u)^2):
//      u = 2^-8 the unit roundoff of round-to-nearest-even bfloat16 (both factors), g = K 2^-24 / (1 - K 2^-24)
//      the float32 summation bound in any order (Higham, gamma_K), sum |w_i x_i| <= ||w_j|| ||x||
//      (Cauchy-Schwarz); the factor 1.01 covers the float32 rounding of the comparisons in step 3. The
//      underflow term covers bfloat16 conversion and products flushed to zero (DAZ/FTZ): 2^-120 (K + sqrt(K)
//      (||w_j|| + ||x||)), far below any real logit difference;
//   3. candidates: every j with a_j + b_j >= max_i (a_i - b_i). The true argmax t is always one, since
//      a_t + b_t >= l_t >= l_i >= a_i - b_i for every i;
//   4. exact: l_j of the candidates in double precision; the largest wins, the lowest index on ties (as
//      numpy's and torch's argmax). So the token is the argmax of the exact logits whatever the screen's
//      rounding; a float32 GEMM can differ from it only where two logits tie to float32 rounding.
// Default model: ||x|| is about 56 (one outlier dimension), ||w_j|| about 3, so b_j is about 1.4 logits. A row
// has 3 candidates on average over the offline workload's 128 tokens (more for the first tokens after a
// random prompt, about 20; benchmarks/profile_step.py reports the count). 64 rows: 10.5 ms, against 18 ms for
// the float32 logits (gemv_f32).
//
// Banned tokens (min_tokens masking of EOS and stop ids: the sampler's -inf) never become candidates. A row
// gets -1 (the caller computes its logits instead) when its x is not finite, when ||w|| ||x|| could overflow
// the screen, or when every token is banned.
//
// bf16_tiles [ceil(N/16), K/2, 16, 2] bfloat16: input pair (2p, 2p+1) of 16 rows side by side, so one
// `vdpbf16ps` against a broadcast pair of x adds two products to each of 16 rows. f32_tiles: gemv_f32's
// tiles of the same weight (the exact values of the candidates). norms [N] float32: upper bounds of ||w_j||;
// norm_max: their maximum.
#include "greedy_head.h"

#ifdef TOKENMILL_GREEDY_HEAD
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tile_loop.h"

namespace {

using tile_loop::tail_mask;

// x [M, K] float32 -> [M, K] bfloat16 bits, round to nearest even (`vcvtneps2bf16`).
std::vector<uint16_t> to_bf16(const float* x, int64_t ldx, int64_t M, int64_t K) {
  std::vector<uint16_t> out(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = tail_mask(K - k);
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + m * ldx + k));
      _mm256_mask_storeu_epi16(out.data() + m * K + k, mask, reinterpret_cast<const __m256i&>(b));
    }
  return out;
}

// y[m0 + m, 16 rb .. 16 rb + 16) = screen of rows m0 .. m0 + MB; xb: bf16 pairs [M, P], tiles [NB, P, 16].
template <int MB>
void bf16_row_block(const uint32_t* xb, int64_t P, int64_t m0, const uint32_t* tiles, float* y, int64_t ldy,
                    int64_t rb, int64_t N) {
  const uint32_t* w = tiles + rb * P * 16;
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= P; p += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (p + 16) * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (p + 17) * 16), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 16), w1 = (__m512bh)_mm512_loadu_si512(w + (p + 1) * 16);
    for (int m = 0; m < MB; ++m) {
      const uint32_t* xm = xb + (m0 + m) * P;
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xm[p])));
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_set1_epi32(static_cast<int>(xm[p + 1])));
    }
  }
  for (; p < P; ++p)
    for (int m = 0; m < MB; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(w + p * 16),
                                   (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[(m0 + m) * P + p])));
  const __mmask16 mask = tail_mask(N - 16 * rb);
  for (int m = 0; m < MB; ++m)
    _mm512_mask_storeu_ps(y + m * ldy + 16 * rb, mask, _mm512_add_ps(acc[m][0], acc[m][1]));
}

// x . w_j in double precision, w_j read from the float32 tiles [NB, K, 16].
double exact_logit(const float* x, const float* f32_tiles, int64_t K, int64_t j) {
  const float* w = f32_tiles + (j / 16) * K * 16 + j % 16;
  double sum = 0.0;
  for (int64_t k = 0; k < K; ++k) sum += static_cast<double>(w[k * 16]) * static_cast<double>(x[k]);
  return sum;
}

struct RowResult {
  int64_t token;        // -1: no screened answer
  int64_t candidates;
};

// Steps 2-4 for one row: y [N] its screen (banned entries already -inf), x [K] its hidden state.
RowResult pick(const float* y, const float* x, const float* norms, double norm_max, const float* f32_tiles,
               int64_t K, int64_t N) {
  double sq = 0.0;
  for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(x[k]) * x[k];
  const double xn = std::sqrt(sq);
  if (!std::isfinite(xn) || norm_max * xn > 1e37) return {-1, 0};
  const double u = std::ldexp(1.0, -8), g = K * std::ldexp(1.0, -24) / (1.0 - K * std::ldexp(1.0, -24));
  const double c = 1.01 * (2 * u + u * u + g * (1 + u) * (1 + u));
  const double tiny = std::ldexp(1.0, -120), root_k = std::sqrt(static_cast<double>(K));
  // b_j = A ||w_j|| + B
  const __m512 A = _mm512_set1_ps(static_cast<float>(c * xn + tiny * root_k));
  const __m512 B = _mm512_set1_ps(static_cast<float>(tiny * (K + root_k * xn)));
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 low = minus_inf;
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 mask = tail_mask(N - j);
    const __m512 a = _mm512_mask_loadu_ps(minus_inf, mask, y + j);
    const __m512 b = _mm512_fmadd_ps(A, _mm512_maskz_loadu_ps(mask, norms + j), B);
    low = _mm512_max_ps(low, _mm512_sub_ps(a, b));
  }
  const float lower = _mm512_reduce_max_ps(low);
  if (!std::isfinite(lower)) return {-1, 0};        // every token banned
  const __m512 lower_v = _mm512_set1_ps(lower);
  int64_t best = -1, count = 0;
  double best_value = 0.0;
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 mask = tail_mask(N - j);
    const __m512 a = _mm512_mask_loadu_ps(minus_inf, mask, y + j);
    const __m512 b = _mm512_fmadd_ps(A, _mm512_maskz_loadu_ps(mask, norms + j), B);
    uint32_t hits = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(a, minus_inf, _CMP_NEQ_OQ),
                                            _mm512_add_ps(a, b), lower_v, _CMP_GE_OQ);
    for (; hits; hits &= hits - 1) {
      const int64_t cand = j + __builtin_ctz(hits);
      const double value = exact_logit(x, f32_tiles, K, cand);
      ++count;
      if (best < 0 || value > best_value) best = cand, best_value = value;   // ascending j: lowest on ties
    }
  }
  return {best, count};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor bf16_tiles,
                                                     torch::Tensor f32_tiles, torch::Tensor norms, double norm_max,
                                                     int64_t N, torch::Tensor banned, torch::Tensor workspace) {
  const int64_t blocks = (N + 15) / 16;
  TORCH_CHECK(f32_tiles.scalar_type() == torch::kFloat32 && f32_tiles.dim() == 3 && f32_tiles.is_contiguous() &&
                  f32_tiles.size(0) == blocks && f32_tiles.size(2) == 16,
              "greedy_head: f32_tiles must be contiguous float32 [", blocks, ", K, 16], got ", f32_tiles.sizes());
  const int64_t K = f32_tiles.size(1), P = K / 2, M = x.size(0);
  TORCH_CHECK(K % 2 == 0, "greedy_head: K must be even, got ", K);
  TORCH_CHECK(bf16_tiles.scalar_type() == torch::kBFloat16 && bf16_tiles.is_contiguous() &&
                  bf16_tiles.sizes() == torch::IntArrayRef({blocks, P, 16, 2}),
              "greedy_head: bf16_tiles must be contiguous bfloat16 [", blocks, ", ", P, ", 16, 2], got ",
              bf16_tiles.sizes());
  tile_loop::check_x(x, K, "greedy_head");
  TORCH_CHECK(norms.scalar_type() == torch::kFloat32 && norms.is_contiguous() && norms.numel() == N,
              "greedy_head: norms must be contiguous float32 [", N, "]");
  TORCH_CHECK(banned.scalar_type() == torch::kInt64 && banned.dim() == 2 && banned.size(0) == M &&
                  banned.is_contiguous(), "greedy_head: banned must be contiguous int64 [", M, ", B], got ",
              banned.sizes());
  TORCH_CHECK(workspace.scalar_type() == torch::kFloat32 && workspace.is_contiguous() && workspace.numel() >= M * N,
              "greedy_head: workspace must be contiguous float32 with at least ", M * N, " elements");
  const std::vector<uint16_t> xb = to_bf16(x.data_ptr<float>(), x.stride(0), M, K);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(bf16_tiles.data_ptr());
  float* y = workspace.data_ptr<float>();
  tile_loop::parallel_over_rows(blocks, bf16_tiles.numel() * 2, [&](int64_t b0, int64_t b1) {
    tile_loop::for_tiles(M, b0, b1, P * 64, [&](auto rows, int64_t m0, int64_t rb) {
      bf16_row_block<decltype(rows)::value>(xp, P, m0, wp, y + m0 * N, N, rb, N);
    });
  });
  auto tokens = torch::empty({M}, torch::kInt64), counts = torch::empty({M}, torch::kInt64);
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t* bp = banned.data_ptr<int64_t>();
  const float* np_ = norms.data_ptr<float>();
  const float* xf = x.data_ptr<float>();
  const float* ft = f32_tiles.data_ptr<float>();
  const int64_t B = banned.size(1), ldx = x.stride(0);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      float* ym = y + m * N;
      for (int64_t i = 0; i < B; ++i) {
        const int64_t t = bp[m * B + i];
        if (t >= 0 && t < N) ym[t] = -std::numeric_limits<float>::infinity();
      }
      const RowResult r = pick(ym, xf + m * ldx, np_, norm_max, ft, K, N);
      tp[m] = r.token;
      cp[m] = r.candidates;
    }
  });
  return {tokens, counts};
}

#endif  // TOKENMILL_GREEDY_HEAD
