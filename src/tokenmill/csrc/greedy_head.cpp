// Exact greedy tokens without the float32 logits.
//
// A greedy row needs only argmax_j l_j, l_j = w_j . x over the vocabulary (w_j: the lm_head's float32 row j,
// x: the row's final hidden state, K inputs). Computing every l_j in float32 is a decode step's largest GEMM
// after the layers' (default model, 64 rows: 64 x 49152 x 576, 18 ms of a 110 ms step). Instead:
//   1. split: the step's kOutliers inputs of largest |x| (over its rows; the default model's hidden states
//      have a few dimensions tens of times larger than the rest) form x_o, the others x_r = x - x_o;
//   2. screen: a_j = s_j t q_j . p + w_j . x_o, with w_j = s_j q_j + e_j (q_j int8, s_j = max |w_j| / 127, made
//      at build) and x_r = t p + f (p int8, t = max |x_r| / 127, per row and step): the integer dot product
//      by AVX-512 VNNI `vpdpbusd` (64 multiply-adds per instruction, four times the float32 FMA rate, a
//      quarter of the weight bytes), exact in int32; the x_o part in float32 from the float32 tiles;
//   3. bound: l_j - a_j = w_j . f + e_j . x_r - e_j . f (exactly, in real arithmetic), so
//      |l_j - a_j| <= b_j = 1.01 (||w_j|| ||f|| + ||e_j|| (||x_r|| + ||f||)) + 2^-18 (||w_j|| + ||e_j||) (||x|| + ||f||)
//      + 2^-100: ||f||, ||x_r||, ||x|| in double per row; ||w_j||, ||e_j|| rounded up at build. The 2^-18 term
//      (kRoundingSlack) covers float32 rounding: the int32 -> float conversion and two products (3 u), the
//      kOutliers FMAs adding x_o (at most kOutliers u of the partial sums), the comparisons of step 4 (2 u),
//      u = 2^-24, each of a value at most sqrt(2) (||w_j|| + ||e_j||) (||x|| + ||f||); in all under
//      2 (kOutliers + 8) u times that bound. The 1.01 covers the rounding of b_j itself, 2^-100 the
//      products' underflow;
//   4. candidates: every j with a_j + b_j >= max_i (a_i - b_i). The true argmax t is always one, since
//      a_t + b_t >= l_t >= l_i >= a_i - b_i for every i;
//   5. exact: l_j of the candidates in double precision; the largest wins, the lowest index on ties (as
//      numpy's and torch's argmax). So the token is the argmax of the exact logits whatever the screen's
//      rounding; a float32 GEMM can differ from it only where two logits tie to float32 rounding.
// Default model, offline workload (64 rows, hidden states captured from the engine): b_j about 1.5 logits;
// candidates per row about 20 at the first token after a random prompt, 4 at the tenth, 1 at the sixtieth
// (without the split, int8 quantization of x would leave most of the vocabulary in: one dimension is about
// 40 and the rest of x about 2; with 16 outliers instead of 24, about twice the candidates). 7.7 ms per step,
// against 9.7 for the bfloat16 screen this replaced and 17.8 for the float32 logits (gemv_f32).
//
// Banned tokens (min_tokens masking of EOS and stop ids: the sampler's -inf) never become candidates. A row
// gets -1 (the caller computes its logits instead) when its x is not finite, when ||w|| ||x|| could overflow
// the screen, or when every token is banned.
//
// q8_tiles [ceil(N/16), ceil(K/4), 64] int8: byte 4i + c of quad g is row i's input 4g + c (rows past N and
// inputs past K zero), so one `vpdpbusd` against a broadcast quad of p adds four products to each of 16
// rows. scales, qsums [ceil(N/16) * 16]: s_j and sum_k q_jk (zero past N). f32_tiles: gemv_f32's tiles of the
// same weight (the x_o part and the exact values of the candidates). norms, err_norms [N] float32: upper
// bounds of ||w_j|| and ||e_j||; norm_max: the largest norm.
#include "greedy_head.h"

#ifdef TOKENMILL_GREEDY_HEAD
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "tile_loop.h"

namespace {

using tile_loop::tail_mask;

constexpr int64_t kOutliers = 24;
constexpr double kRoundingSlack = 2.0 * (kOutliers + 8) / (1 << 24);   // 2^-18 with 24 outliers (step 3)
constexpr int kScreenRows = 8, kScreenBlocks = 3;   // an 8 x 3 grid of accumulators, as gemv_f32's tiles

// The step's rows prepared for the screen (steps 1-2): the outlier inputs and each row's quantized rest.
struct ScreenRows {
  std::vector<int64_t> outliers;   // [O] input indices
  std::vector<float> xo;           // [M, O] their values per row
  std::vector<uint32_t> quads;     // [M, K4] p + 128 as unsigned bytes, four inputs per word
  std::vector<float> t;            // [M] quantization scale of the rest
  std::vector<double> x_norm, rest_norm, err_norm;   // [M] ||x||, ||x_r||, ||f||
  std::vector<bool> finite;        // [M]

  ScreenRows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t K4)
      : quads(M * K4, 0x80808080u), t(M, 1.f), x_norm(M), rest_norm(M), err_norm(M), finite(M) {
    std::vector<float> peak(K, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) peak[k] = std::max(peak[k], std::fabs(x[m * ldx + k]));   // NaN: kept 0
    outliers.resize(K);
    std::iota(outliers.begin(), outliers.end(), 0);
    const int64_t O = std::min(kOutliers, K);
    std::partial_sort(outliers.begin(), outliers.begin() + O, outliers.end(),
                      [&](int64_t a, int64_t b) { return peak[a] > peak[b] || (peak[a] == peak[b] && a < b); });
    outliers.resize(O);
    std::vector<bool> is_outlier(K, false);
    for (int64_t k : outliers) is_outlier[k] = true;
    xo.resize(M * O);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * ldx;
      double xx = 0.0, rr = 0.0, ff = 0.0;
      float rest_max = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        xx += static_cast<double>(xm[k]) * xm[k];
        if (!is_outlier[k]) rest_max = std::max(rest_max, std::fabs(xm[k]));
      }
      finite[m] = std::isfinite(xx);
      for (int64_t i = 0; i < O; ++i) xo[m * O + i] = xm[outliers[i]];
      if (!finite[m]) continue;
      const float tm = rest_max > 0.f ? rest_max / 127.f : 1.f;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(quads.data() + m * K4);
      for (int64_t k = 0; k < K; ++k) {
        if (is_outlier[k]) continue;
        const float p = std::min(127.f, std::max(-127.f, std::nearbyint(xm[k] / tm)));
        bytes[k] = static_cast<uint8_t>(static_cast<int>(p) + 128);
        const double f = static_cast<double>(xm[k]) - static_cast<double>(tm) * p;   // exact in double
        rr += static_cast<double>(xm[k]) * xm[k];
        ff += f * f;
      }
      t[m] = tm;
      x_norm[m] = std::sqrt(xx), rest_norm[m] = std::sqrt(rr), err_norm[m] = std::sqrt(ff);
    }
  }
};

// acc += u8 a . s8 b per 32-bit lane (`vpdpbusd`). As asm: with the intrinsic GCC copied every accumulator
// through another register or the stack on each use (an 8 x 3 grid: all 24 spilled, 9.2 ms for the default
// model's 64-row head; 7.0 with a 4 x 3 grid), this form updates it in place.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// y[m0 + m, 16 rb .. 16 (rb + NB)) = screen (step 2) of rows m0 .. m0 + MB.
template <int MB, int NB>
void screen_tile(const ScreenRows& rows, int64_t K4, int64_t m0, const int8_t* q8, const float* scales,
                 const int32_t* qsums, const float* f32_tiles, int64_t K, float* y, int64_t ldy, int64_t rb, int64_t N,
                 int64_t blocks) {
  const int8_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = q8 + (rb + j) * K4 * 64;
  __m512i dot[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) dot[m][j] = _mm512_setzero_si512();
  const uint32_t* xq = rows.quads.data() + m0 * K4;
  const int64_t O = rows.outliers.size(), ahead = std::min(O * NB, K4), next = rb + NB;
  for (int64_t g = 0; g < K4; ++g) {
    __m512i wg[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + (g + 16) * 64), _MM_HINT_T0);
      wg[j] = _mm512_loadu_si512(w[j] + g * 64);
    }
    if (g < ahead && next + g % NB < blocks)     // the next blocks' outlier lines: scattered, one per (block, input)
      _mm_prefetch(reinterpret_cast<const char*>(f32_tiles + ((next + g % NB) * K + rows.outliers[g / NB]) * 16),
                   _MM_HINT_T0);
    for (int m = 0; m < MB; ++m) {
      const __m512i xg = _mm512_set1_epi32(static_cast<int>(xq[m * K4 + g]));
      for (int j = 0; j < NB; ++j) dot[m][j] = dpbusd(dot[m][j], xg, wg[j]);
    }
  }
  __m512 a[MB][NB];
  for (int j = 0; j < NB; ++j) {                 // sum (p + 128) q - 128 sum q = p . q, exact in int32
    const __m512i shift = _mm512_slli_epi32(_mm512_loadu_si512(qsums + 16 * (rb + j)), 7);
    const __m512 s = _mm512_loadu_ps(scales + 16 * (rb + j));
    for (int m = 0; m < MB; ++m)
      a[m][j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m][j], shift)),
                              _mm512_mul_ps(s, _mm512_set1_ps(rows.t[m0 + m])));
  }
  for (int64_t i = 0; i < O; ++i) {              // + w_j . x_o in float32
    const int64_t k = rows.outliers[i];
    __m512 wk[NB];
    for (int j = 0; j < NB; ++j) wk[j] = _mm512_loadu_ps(f32_tiles + ((rb + j) * K + k) * 16);
    for (int m = 0; m < MB; ++m) {
      const __m512 xk = _mm512_set1_ps(rows.xo[(m0 + m) * O + i]);
      for (int j = 0; j < NB; ++j) a[m][j] = _mm512_fmadd_ps(wk[j], xk, a[m][j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __mmask16 mask = tail_mask(N - 16 * (rb + j));
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * (rb + j), mask, a[m][j]);
  }
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

// Steps 3-5 for row m: y [N] its screen (banned entries already -inf), x [K] its hidden state.
RowResult pick(const float* y, const float* x, const ScreenRows& rows, int64_t m, const float* norms,
               const float* err_norms, double norm_max, const float* f32_tiles, int64_t K, int64_t N) {
  const double xn = rows.x_norm[m], fn = rows.err_norm[m], rn = rows.rest_norm[m];
  if (!rows.finite[m] || norm_max * (xn + fn) > 1e30) return {-1, 0};
  const double slack = kRoundingSlack * (xn + fn);
  // b_j = A ||w_j|| + C ||e_j|| + B, rounded up a little (float32 of each coefficient: the 1.01)
  const __m512 A = _mm512_set1_ps(static_cast<float>(1.01 * fn + slack));
  const __m512 C = _mm512_set1_ps(static_cast<float>(1.01 * (rn + fn) + slack));
  const __m512 B = _mm512_set1_ps(static_cast<float>(std::ldexp(1.0, -100)));
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 low = minus_inf;
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 mask = tail_mask(N - j);
    const __m512 a = _mm512_mask_loadu_ps(minus_inf, mask, y + j);
    const __m512 b = _mm512_fmadd_ps(C, _mm512_maskz_loadu_ps(mask, err_norms + j),
                                     _mm512_fmadd_ps(A, _mm512_maskz_loadu_ps(mask, norms + j), B));
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
    const __m512 b = _mm512_fmadd_ps(C, _mm512_maskz_loadu_ps(mask, err_norms + j),
                                     _mm512_fmadd_ps(A, _mm512_maskz_loadu_ps(mask, norms + j), B));
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

int64_t greedy_head_outliers() { return kOutliers; }

std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor q8_tiles, at::Tensor scales,
                                               at::Tensor qsums, at::Tensor f32_tiles, at::Tensor norms,
                                               at::Tensor err_norms, double norm_max, int64_t N,
                                               at::Tensor banned, at::Tensor workspace) {
  const int64_t blocks = (N + 15) / 16;
  TORCH_CHECK(f32_tiles.scalar_type() == at::kFloat && f32_tiles.dim() == 3 && f32_tiles.is_contiguous() &&
                  f32_tiles.size(0) == blocks && f32_tiles.size(2) == 16,
              "greedy_head: f32_tiles must be contiguous float32 [", blocks, ", K, 16], got ", f32_tiles.sizes());
  const int64_t K = f32_tiles.size(1), K4 = (K + 3) / 4, M = x.size(0);
  TORCH_CHECK(K <= 65536, "greedy_head: at most 65536 inputs (int32 dot products), got ", K);
  TORCH_CHECK(q8_tiles.scalar_type() == at::kChar && q8_tiles.is_contiguous() &&
                  q8_tiles.sizes() == at::IntArrayRef({blocks, K4, 64}),
              "greedy_head: q8_tiles must be contiguous int8 [", blocks, ", ", K4, ", 64], got ", q8_tiles.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == 16 * blocks &&
                  qsums.scalar_type() == at::kInt && qsums.is_contiguous() && qsums.numel() == 16 * blocks,
              "greedy_head: scales float32 and qsums int32, contiguous [", 16 * blocks, "]");
  tile_loop::check_x(x, K, "greedy_head");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == N &&
                  err_norms.scalar_type() == at::kFloat && err_norms.is_contiguous() && err_norms.numel() == N,
              "greedy_head: norms and err_norms must be contiguous float32 [", N, "]");
  TORCH_CHECK(banned.scalar_type() == at::kLong && banned.dim() == 2 && banned.size(0) == M &&
                  banned.is_contiguous(), "greedy_head: banned must be contiguous int64 [", M, ", B], got ",
              banned.sizes());
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() && workspace.numel() >= M * N,
              "greedy_head: workspace must be contiguous float32 with at least ", M * N, " elements");
  const float* xf = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const ScreenRows rows(xf, ldx, M, K, K4);
  const int8_t* qp = q8_tiles.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int32_t* qs = qsums.data_ptr<int32_t>();
  const float* ft = f32_tiles.data_ptr<float>();
  float* y = workspace.data_ptr<float>();
  const int64_t groups = (blocks + kScreenBlocks - 1) / kScreenBlocks;       // of kScreenBlocks row blocks
  tile_loop::parallel_over_rows(groups, q8_tiles.numel(), [&](int64_t g0, int64_t g1) {
    tile_loop::for_tiles<kScreenRows>(M, g0, g1, kScreenBlocks * K4 * 64, [&](auto rows_c, int64_t m0, int64_t group) {
      const int64_t rb = group * kScreenBlocks;
      tile_loop::dispatch_count<kScreenBlocks>(std::min<int64_t>(kScreenBlocks, blocks - rb), [&](auto nb) {
        screen_tile<decltype(rows_c)::value, decltype(nb)::value>(rows, K4, m0, qp, sp, qs, ft, K, y + m0 * N, N, rb, N,
                                                                  blocks);
      });
    });
  });
  auto tokens = at::empty({M}, at::kLong), counts = at::empty({M}, at::kLong);
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t* bp = banned.data_ptr<int64_t>();
  const float* np_ = norms.data_ptr<float>();
  const float* ep = err_norms.data_ptr<float>();
  const int64_t B = banned.size(1);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      float* ym = y + m * N;
      for (int64_t i = 0; i < B; ++i) {
        const int64_t t = bp[m * B + i];
        if (t >= 0 && t < N) ym[t] = -std::numeric_limits<float>::infinity();
      }
      const RowResult r = pick(ym, xf + m * ldx, rows, m, np_, ep, norm_max, ft, K, N);
      tp[m] = r.token;
      cp[m] = r.candidates;
    }
  });
  return {tokens, counts};
}

#endif  // TOKENMILL_GREEDY_HEAD
