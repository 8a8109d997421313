// Tiled linear layers. Built first for decode at batch 1-16, where a step is bound by reading every weight
// once (hence the gemv_ names); with the chunked order of for_tiles they also run many rows near the
// CPU's peak (int8/int4: 430-600 GOP/s with VNNI, float32: 215-231 GFLOP/s at 32-64 rows). The weights are
// split evenly over the threads and each read from memory once; activations are reused from L1/L2.
//
//   gemv_f32(x [M, K] f32, w [N/16, K, 16] f32, N)                            exact float32 weights
//   gemv_q8(x [M, K] f32, q [N/16, K/32, 512] int8, scale [N/16*16] f32, N)   w[n, k] = q[n, k] * scale[n]
//   gemv_q4(x [M, K] f32, q [N/16, K/32, 320] uint8, N)                       w[n, k] = d[n, g] q4[n, k] + m[n, g]
//   gemv_nvfp4(x [M, K] f32, q [N/16, K/32, 288] uint8, row_scale [N/16*16] f32, N)
//                                                    w[n, k] = e2m1[n, k] * e4m3[n, k / 16] * tensor_scale[n]
// (N/16 rounded up.)
// All return y [M, N] float32; x rows may be strided (last dim contiguous), the weights are contiguous.
// f32 tiles hold 16 rows' weights of one input side by side (one FMA per 16 weights, no horizontal sums).
//
// q8/q4: integer dot products (AVX-512 VNNI `vpdpbusd`: 64 multiply-adds of unsigned by signed bytes per
// instruction): each group of 32 activations is quantized to int8 with its own scale, x[k] ~= s[g] xi[k],
// s[g] = max |x| over the group / 127 (llama.cpp's Q8_0 recipe). q4's offsets m multiply the same quantized
// activations (s[g] * sum xi), so the result is exactly w . x_quantized: with the exact sum of x instead,
// the rounding error would meet d * q (q = 0..15, offset by about 8 d that m cancels) rather than the
// weight itself, and the error of a centered weight would double (measured: perplexity +3% vs +0.3%).
//
// Both lay 16 output rows side by side too, so each VNNI lane accumulates one row and no horizontal sums are
// needed; tiles of 16 rows x 32 inputs (one group) follow in (row block, group) order, rows past N zero.
// q8 tile = 512 bytes: byte 64c + 4i + j holds row i's input 4c + j (c = 0..7, j = 0..3).
// q4 tile = 320 bytes:
//   bytes [64c, 64c + 64), c = 0..3: byte 4i + j holds row i's input 8c + j (low nibble) and 8c + 4 + j
//                                    (high nibble), j = 0..3;
//   bytes [256, 288): d of the 16 rows (float16);  bytes [288, 320): m of the 16 rows (float16).
// GGUF Q4_1's d and m are float16 too: 20 bytes per 32 weights, as in the file.
// nvfp4 tile = 288 bytes (18 bytes per 32 weights, NVFP4's own 4.5 bits a weight):
//   bytes [0, 256): E2M1 codes in q4's nibble order;
//   bytes [256 + 16h, 256 + 16h + 16), h = 0, 1: the E4M3 block scale (its byte, sign bit clear) of the 16
//                                                rows for inputs [16h, 16h + 16) of the group.
// NVFP4 is an int8 format in disguise: 2 x E2M1 is an integer in [-12, 12], so a code becomes the unsigned
// byte 2 v + 12 in [0, 24] by one byte shuffle and the VNNI dot product over a block of 16 is exact; the
// +12 is taken back with the activations' integer sum over the block (QuantizedRows::hoffset). An E4M3 byte
// of a positive scale becomes float16 bits exactly by one shift (b << 7 is the value times 2^-8, subnormals
// included); row_scale carries the tensor scale times 2^8 / 2 (the factor 2 above). Six activation rows a
// pass over the weights (four for q8 / q4): the code shuffles and scale conversions are shared by more rows.
// Every kernel reads its quantized activations regrouped per tile of its rows (QuantizedRows).
#include "gemv_kernels.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#ifdef TOKENMILL_GEMV_KERNELS   // AVX-512 VNNI builds only (gemv_kernels.h)
#include "amx_tiles.h"
#include "tile_loop.h"

namespace {

using tile_loop::check_x;
using tile_loop::for_tiles;
using tile_loop::parallel_over_rows;
using tile_loop::tail_mask;

// x [M, K] quantized per group of 32 (K a multiple of 32): x[m, k] ~= s[m, g] * xi[m, k]. Kept regrouped in
// tiles of T = min(R, M) rows (R: the rows a kernel's pass takes): row m's group g is entry
// i = ((m / T) G + g) T + m % T, so a pass over one tile's rows walks a single pointer per array. (Row-major
// arrays need a pointer per row and array, more than the general registers hold at 4-6 rows: measured, the
// spills cost the nvfp4 kernel a quarter of its time at 512 rows.) Entries of rows past M are zero.
struct QuantizedRows {
  int64_t M, K, G, T;            // rows, inputs, groups of 32, rows a tile (>= 1, also for M = 0)
  std::vector<int8_t> xi;        // [ceil(M / T), G, T, 32]
  std::vector<float> s;          // [ceil(M / T), G, T]
  std::vector<float> xsum;       // [ceil(M / T), G, T] s[g] * sum_{k in g} xi[k]: what q4's offsets m multiply
  std::vector<float> shift;      // [M] 128 * sum_g s[g] * sum_{k in g} xi[k] (q8's +128 weight offset)
  std::vector<int32_t> hoffset;  // [ceil(M / T), G, T, 2] -12 x the sum of xi over each half group of 16
                                 // (nvfp4's blocks; filled only when asked for: int8 / int4 skip the extra sums)

  QuantizedRows(const float* x, int64_t ldx, int64_t M_, int64_t K_, int64_t R, bool half_sums)
      : M(M_), K(K_), G(K_ / 32), T(std::max<int64_t>(1, std::min(R, M_))), xi((M_ + T - 1) / T * T * K_),
        s(xi.size() / 32),
        xsum(s.size()), shift(M_), hoffset(half_sums ? 2 * s.size() : 0) {
    for (int64_t m = 0; m < M; ++m) {
      double sh = 0.0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = ((m / T) * G + g) * T + m % T;
        const float* xg = x + m * ldx + 32 * g;
        const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
        int8_t* out = xi.data() + 32 * i;
        // A NaN or an infinity in the group (|x| not below inf, unordered included): no int8 stands for it
        // (cvtps_epi32 gives INT_MIN). The group's scale and sums become NaN, so every output of the row is
        // NaN, as torch's float32 product gives for a NaN input (an infinite one: inf or NaN per output).
        const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
        if (_mm512_cmp_ps_mask(abs_a, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(abs_b, inf, _CMP_NLT_UQ)) {
          const float nan = std::numeric_limits<float>::quiet_NaN();
          std::memset(out, 0, 32);
          s[i] = nan;
          xsum[i] = nan;
          if (half_sums) hoffset[2 * i] = hoffset[2 * i + 1] = 0;
          sh = nan;
          continue;
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
        float scale = amax > 0.f ? amax / 127.f : 1.f;
        // magnitudes all below about 3.7e-37: 1 / scale overflows to inf (x * inf and 0 * inf convert to
        // INT_MIN): quantized as zeros instead, as an all-zero group (their share of an output is ~1e-35 |w|)
        if (1.f / scale == std::numeric_limits<float>::infinity()) scale = 1.f;
        const __m512 inv = _mm512_set1_ps(1.f / scale);
        // round to nearest even (the default MXCSR mode); |x * inv| <= 127 up to rounding. Saturated to int8's
        // range here, so the sums below are those of the stored bytes
        const __m512i lo8 = _mm512_set1_epi32(-128), hi8 = _mm512_set1_epi32(127);
        const __m512i ia = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), lo8), hi8);
        const __m512i ib = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), lo8), hi8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(ia));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(ib));
        s[i] = scale;
        int isum;
        if (half_sums) {
          const int isum_a = _mm512_reduce_add_epi32(ia), isum_b = _mm512_reduce_add_epi32(ib);
          isum = isum_a + isum_b;
          hoffset[2 * i] = -12 * isum_a;
          hoffset[2 * i + 1] = -12 * isum_b;
        } else {
          isum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
        }
        xsum[i] = scale * static_cast<float>(isum);
        sh += 128.0 * scale * isum;
      }
      shift[m] = static_cast<float>(sh);
    }
  }

  // Entry of row m0's group 0, for m0 a multiple of T (for_tiles<R> starts its tiles there).
  int64_t first(int64_t m0) const { return (m0 / T) * G * T; }
};

constexpr int kNVFP4Rows = 6;     // activation rows per pass over nvfp4 tiles (registers: 2 x 6 dots + 6 sums)

// q8: y[m0 + m, 16 rb .. 16 rb + 16). Weights as unsigned (q + 128, flipping the sign bit) times int8
// activations; the +128 is taken back once per row of x (QuantizedRows::shift).
template <int MB>
void q8_row_block(const QuantizedRows& a, int64_t m0, const int8_t* tiles, const float* scale, float* y,
                  int64_t ldy, int64_t rb, int64_t N) {
  const int64_t G = a.G;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* tile = tiles + rb * G * 512;
  const int8_t* xg = a.xi.data() + 32 * a.first(m0);      // this tile of rows' group g: xg [T, 32], sg [T]
  const float* sg = a.s.data() + a.first(m0);
  for (int64_t g = 0; g < G; ++g, tile += 512, xg += 32 * a.T, sg += a.T) {
    __m512i dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 512 + 64 * c), _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * c), flip);
      for (int m = 0; m < MB; ++m) {
        int32_t x4;
        std::memcpy(&x4, xg + 32 * m + 4 * c, 4);
        dot[m] = _mm512_dpbusd_epi32(dot[m], w, _mm512_set1_epi32(x4));
      }
    }
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(sg[m]), acc[m]);
  }
  const __m512 sc = _mm512_loadu_ps(scale + 16 * rb);
  const __mmask16 mask = tail_mask(N - 16 * rb);
  for (int m = 0; m < MB; ++m)
    _mm512_mask_storeu_ps(y + m * ldy + 16 * rb, mask,
                          _mm512_mul_ps(sc, _mm512_sub_ps(acc[m], _mm512_set1_ps(a.shift[m0 + m]))));
}

// y[m0 + m, 16 rb .. 16 rb + 16) for MB rows of x: one block of 16 weight rows, group by group.
template <int MB>
void q4_row_block(const QuantizedRows& a, int64_t m0, const uint8_t* tiles, float* y, int64_t ldy, int64_t rb,
                  int64_t N) {
  const int64_t G = a.G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* tile = tiles + rb * G * 320;
  const int8_t* xg = a.xi.data() + 32 * a.first(m0);      // this tile of rows' group g: xg [T, 32], sg, zg [T]
  const float* sg = a.s.data() + a.first(m0);
  const float* zg = a.xsum.data() + a.first(m0);
  for (int64_t g = 0; g < G; ++g, tile += 320, xg += 32 * a.T, sg += a.T, zg += a.T) {
    _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 320), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 320 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 320 + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 320 + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 320 + 256), _MM_HINT_T0);
    __m512i dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(tile + 64 * c);
      const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      for (int m = 0; m < MB; ++m) {
        const int8_t* x8 = xg + 32 * m + 8 * c;
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, x8, 4);
        std::memcpy(&x_hi, x8 + 4, 4);
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x_lo));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x_hi));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 288)));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(sg[m])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(zg[m]), acc[m]);
    }
  }
  const __mmask16 mask = tail_mask(N - 16 * rb);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * rb, mask, acc[m]);
}

// The E4M3 scale bytes of one tile (32: half 0's 16 rows, then half 1's), all positive (pack_nvfp4_tiles moves
// a negative scale's sign into its codes), as float32 times 2^-8: byte << 7 is the float16 of that.
inline void e4m3_scales(const uint8_t* p, __m512* half0, __m512* half1) {
  const __m512i bits = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 7);
  *half0 = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
  *half1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
}

// 2 v + 12 for the E2M1 code in the low nibble of every byte of w (the high nibble is ignored). With VBMI
// one vpermb (it reads 6 index bits, and the table repeats every 16 bytes); else a mask and a byte shuffle.
inline __m512i e2m1_bytes(const __m512i& lut, const __m512i& w) {
#ifdef __AVX512VBMI__
  return _mm512_permutexvar_epi8(w, lut);
#else
  return _mm512_shuffle_epi8(lut, _mm512_and_si512(w, _mm512_set1_epi8(0x0F)));
#endif
}

// nvfp4: y[m0 + m, 16 rb .. 16 rb + 16) for MB rows of x; each group's two blocks of 16 are summed apart
// (chunks 0-1 hold inputs 0-15, chunks 2-3 inputs 16-31) and scaled by their own E4M3 scales.
template <int MB>
void nvfp4_row_block(const QuantizedRows& a, int64_t m0, const uint8_t* tiles, const float* row_scale, float* y,
                     int64_t ldy, int64_t rb, int64_t N) {
  const int64_t G = a.G, T = a.T, first = a.first(m0);
  // 2 x E2M1 + 12 for codes 0..15 (bit 3 the sign), repeated: every 16 bytes of the register
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                           12, 11, 10, 9, 8, 6, 4, 0));
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* tile = tiles + rb * G * 288;
  const int8_t* xg = a.xi.data() + 32 * first;           // this tile of rows' group g: xg [T, 32]
  const float* sg = a.s.data() + first;                   // sg [T]
  const int32_t* hg = a.hoffset.data() + 2 * first;       // hg [T, 2]
  for (int64_t g = 0; g < G; ++g, tile += 288, xg += 32 * T, sg += T, hg += 2 * T) {
    for (int p = 0; p < 288; p += 64) _mm_prefetch(reinterpret_cast<const char*>(tile + 4 * 288 + p), _MM_HINT_T0);
    // each block's dot product starts at -12 x its activations' sum: it ends at sum (2 v) xi, exactly
    __m512i dot[2][MB];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MB; ++m) dot[h][m] = _mm512_set1_epi32(hg[2 * m + h]);
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(tile + 64 * c);
      const __m512i lo = e2m1_bytes(lut, w), hi = e2m1_bytes(lut, _mm512_srli_epi16(w, 4));
      for (int m = 0; m < MB; ++m) {
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xg + 32 * m + 8 * c, 4);
        std::memcpy(&x_hi, xg + 32 * m + 8 * c + 4, 4);
        dot[c / 2][m] = _mm512_dpbusd_epi32(dot[c / 2][m], lo, _mm512_set1_epi32(x_lo));
        dot[c / 2][m] = _mm512_dpbusd_epi32(dot[c / 2][m], hi, _mm512_set1_epi32(x_hi));
      }
    }
    __m512 sc[2];
    e4m3_scales(tile + 256, &sc[0], &sc[1]);
    for (int m = 0; m < MB; ++m) {        // (sc_a dot_a + sc_b dot_b) s: 2 conversions, 1 mul, 2 fma a row
      const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[1][m]), sc[1],
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(dot[0][m]), sc[0]));
      acc[m] = _mm512_fmadd_ps(both, _mm512_set1_ps(sg[m]), acc[m]);
    }
  }
  const __m512 rs = _mm512_loadu_ps(row_scale + 16 * rb);
  const __mmask16 mask = tail_mask(N - 16 * rb);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * rb, mask, _mm512_mul_ps(acc[m], rs));
}

// f32: y[m0 + m, 16 rb .. 16 (rb + NB)) for MB rows of x, from NB blocks' tiles [K, 16] (input k of a
// block's 16 rows side by side). An MB x NB grid of accumulators (up to 8 x 3 = 24 of the 32 vector
// registers): each weight load feeds MB FMAs and each broadcast of x feeds NB. Each output sums its
// inputs in blocks of kSumBlock, in order, then adds the blocks' sums: relative error about 2e-7, below
// oneDNN's 3-5e-7 (a single running sum over K = 1536 inputs had 3x oneDNN's). Measured on the project's
// machine kind at 64 rows over the default model's 30 layers, weights from DRAM, alternating processes:
// 68.5-70.2 ms against 71.6-72.1 for the 4 x 1 grid it replaced; with the weights in L2, 225-232 GFLOP/s on
// every layer shape (the 4 x 1 grid: 119-230).
constexpr int kF32Rows = 8, kF32Blocks = 3, kSumBlock = 64;

template <int MB, int NB>
void f32_tile(const float* x, int64_t ldx, int64_t m0, const float* tiles, int64_t K, float* y, int64_t ldy,
              int64_t rb, int64_t N) {
  const float* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = tiles + (rb + j) * K * 16;
  __m512 acc[MB][NB];                     // the current block's sums
  __m512 total[MB][NB];                   // the blocks' sums (kept in memory: the registers hold acc)
  const float* xm = x + m0 * ldx;
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k = k0, k1 = std::min(K, k0 + kSumBlock); k < k1; ++k) {
      __m512 wk[NB];
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + (k + 16) * 16), _MM_HINT_T0);
        wk[j] = _mm512_loadu_ps(w[j] + k * 16);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512 xk = _mm512_set1_ps(xm[m * ldx + k]);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(wk[j], xk, acc[m][j]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) total[m][j] = k0 == 0 ? acc[m][j] : _mm512_add_ps(total[m][j], acc[m][j]);
  }
  for (int j = 0; j < NB; ++j) {
    const __mmask16 mask = tail_mask(N - 16 * (rb + j));
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * (rb + j), mask, total[m][j]);
  }
}

}  // namespace

at::Tensor gemv_f32(at::Tensor x, at::Tensor w, int64_t N) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 3 && w.is_contiguous() && w.size(2) == 16 &&
                  w.size(0) == (N + 15) / 16, "gemv_f32: weight must be contiguous float32 [", (N + 15) / 16,
              ", K, 16] tiles, got ", w.sizes());
  const int64_t K = w.size(1), M = x.size(0), blocks = w.size(0);
  check_x(x, K, "gemv_f32");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t groups = (blocks + kF32Blocks - 1) / kF32Blocks;        // of kF32Blocks row blocks
  parallel_over_rows(groups, w.numel() * 4, [&](int64_t g0, int64_t g1) {
    for_tiles<kF32Rows>(M, g0, g1, kF32Blocks * K * 16 * 4, [&](auto rows, int64_t m0, int64_t group) {
      const int64_t rb = group * kF32Blocks;
      tile_loop::dispatch_count<kF32Blocks>(std::min<int64_t>(kF32Blocks, blocks - rb), [&](auto nb) {
        f32_tile<decltype(rows)::value, decltype(nb)::value>(xp, ldx, m0, wp, K, yp + m0 * N, N, rb, N);
      });
    });
  });
  return y;
}

namespace {

// The shared body of the integer tile kernels: checks, x quantized per group of 32, then y [M, N] filled by
// row_block(rows, a, m0, rb, y + m0 * N) for every tile of activation rows and block of 16 weight rows.
// Amx: q4 / q8 tiles, which a step of amx_min_rows() rows or more multiplies on AMX instead (amx_tiles.cpp:
// bfloat16 activations and weights where the CPU has AMX-BF16).
template <int TileRows, bool HalfSums = false, bool Amx = false, class RowBlock>
at::Tensor int_tiles(const char* name, const at::Tensor& x, const at::Tensor& q, c10::ScalarType dtype,
                     const char* dtype_name, int64_t tile_bytes, const at::Tensor* scale, int64_t N,
                     const RowBlock& row_block) {
  TORCH_CHECK(q.scalar_type() == dtype && q.dim() == 3 && q.is_contiguous() && q.size(2) == tile_bytes &&
                  q.size(0) == (N + 15) / 16, name, ": weight must be contiguous ", dtype_name, " [",
              (N + 15) / 16, ", K/32, ", tile_bytes, "] tiles, got ", q.sizes());
  const int64_t K = 32 * q.size(1), M = x.size(0), blocks = q.size(0);
  check_x(x, K, name);
  TORCH_CHECK(scale == nullptr || (scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                                   scale->numel() == 16 * blocks),
              name, ": scale must be contiguous float32 [", 16 * blocks, "] (zero-padded to 16 rows)");
#ifdef TOKENMILL_AMX_TILES
  if (Amx && amx_tiles_take(M)) return amx_tiles_linear(x, q, scale, N);
#endif
  const QuantizedRows a(x.data_ptr<float>(), x.stride(0), M, K, TileRows, HalfSums);
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  parallel_over_rows(blocks, q.numel(), [&](int64_t b0, int64_t b1) {
    for_tiles<TileRows>(M, b0, b1, q.size(1) * tile_bytes, [&](auto rows, int64_t m0, int64_t rb) {
      row_block(rows, a, m0, rb, yp + m0 * N);
    });
  });
  return y;
}

}  // namespace

at::Tensor gemv_q8(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t N) {
  const auto* qp = static_cast<const int8_t*>(q.data_ptr());
  const auto* sp = static_cast<const float*>(scale.data_ptr());
  return int_tiles<tile_loop::kTileRows, false, true>("gemv_q8", x, q, at::kChar, "int8", 512, &scale, N,
                   [&](auto rows, const QuantizedRows& a, int64_t m0, int64_t rb, float* y) {
                     q8_row_block<decltype(rows)::value>(a, m0, qp, sp, y, N, rb, N);
                   });
}

at::Tensor gemv_q4(at::Tensor x, at::Tensor q, int64_t N) {
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  return int_tiles<tile_loop::kTileRows, false, true>("gemv_q4", x, q, at::kByte, "uint8", 320, nullptr, N,
                   [&](auto rows, const QuantizedRows& a, int64_t m0, int64_t rb, float* y) {
                     q4_row_block<decltype(rows)::value>(a, m0, qp, y, N, rb, N);
                   });
}

at::Tensor gemv_nvfp4(at::Tensor x, at::Tensor q, at::Tensor row_scale, int64_t N) {
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  const auto* rp = static_cast<const float*>(row_scale.data_ptr());
  return int_tiles<kNVFP4Rows, true>("gemv_nvfp4", x, q, at::kByte, "uint8", 288, &row_scale, N,
                   [&](auto rows, const QuantizedRows& a, int64_t m0, int64_t rb, float* y) {
                     nvfp4_row_block<decltype(rows)::value>(a, m0, qp, rp, y, N, rb, N);
                   });
}

#endif  // TOKENMILL_GEMV_KERNELS
