// See fp8_gemv.h. Two kernels for FP8's fast mode at steps of a few rows, one driver: work items are blocks of
// 16 output rows spread over the threads; each weight row is read once per pass of rows of x, 64 codes at a
// time, widened in registers and fed to multiply-adds against every row of the pass.
//
// Weight rows are read in address order where the hardware prefetchers can follow them: on Zen 4 (fp8_gemv_bf16,
// one row of x, 2 threads, the default model's 120 decode linears, 106 MB from DRAM) reading chunk k of four
// rows in turn streamed at 14 GB/s (15-18 with a software prefetch two tiles ahead), one row at a time at 27-28
// GB/s (int8's tiles there: 24-27; a batch-1 decode step 0.66-0.68x int8's before, 1.03-1.04x after); in cache
// the two are as fast at 1-2 rows of x and one row at a time is faster at 4-10 (benchmarks/fp8_kernels.py).
//
// Where they stand (Sapphire Rapids, 2 threads, fp8_gemv_bf16 then reading four rows in turn;
// benchmarks/fp8_kernels.py, one row of x, the default model's four layer shapes, each in cache): int8's VNNI tiles
// 0.028 ms; fp8_gemv_f16 0.068; fp8_gemv_bf16 0.098; the exact float32 grouped kernel 0.157. Per 64 weights (a
// standalone loop, 4 weight rows in L1): fp8_gemv_bf16 2.8 ns, its two vdpbf16ps 1.3 of them (one per 2 cycles) and its
// table decode 1.7 (two vpermi2b at 2 cycles each and two unpacks, on the shuffle port the vdpbf16ps also use), the two
// not overlapping; fp8_gemv_f16 1.2 ns (a shift-and-mask decode of 3 ops per 32 weights, two fp16 FMAs at 2 a cycle).
#include "fp8_gemv.h"

#if defined(TOKENMILL_FP8_GEMV_BF16) || defined(TOKENMILL_FP8_GEMV_F16)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlockRows = 16;   // output rows per work item
constexpr int64_t kChunk = 64;       // codes widened together

// x prepared for a kernel: T rows of 16-bit values [Kp] (K rounded up to 64, zeros past K), every chunk of 64
// permuted as the kernels widen codes (permute_chunk), and a float32 factor per row the kernel's sums are
// multiplied by at the end.
struct PreparedX {
  std::vector<uint16_t> bits;
  std::vector<float> factor;
  int64_t Kp;
};

// A chunk of 64 16-bit inputs into the order both kernels widen codes in, in place: unpacking bytes into words
// within each 128-bit lane puts codes 0-7, 16-23, 32-39, 48-55 in the low half of the result ("even") and
// codes 8-15, 24-31, 40-47, 56-63 in the high half ("odd"). Position p < 32 takes input 16 (p / 8) + p % 8,
// position p >= 32 takes 16 ((p - 32) / 8) + 8 + p % 8.
void permute_chunk(uint16_t* chunk) {
  static const __m512i to_even = [] {
    alignas(64) uint16_t idx[32];
    for (int p = 0; p < 32; p++) idx[p] = uint16_t(16 * (p / 8) + p % 8);
    return _mm512_load_si512(idx);
  }();
  static const __m512i to_odd = _mm512_add_epi16(to_even, _mm512_set1_epi16(8));
  const __m512i a = _mm512_loadu_si512(chunk), b = _mm512_loadu_si512(chunk + 32);
  _mm512_storeu_si512(chunk, _mm512_permutex2var_epi16(a, to_even, b));
  _mm512_storeu_si512(chunk + 32, _mm512_permutex2var_epi16(a, to_odd, b));
}

// Row [K] float32 -> 16-bit values [Kp] by convert16 (16 float32 -> 16 values), zeros past K, chunks permuted.
template <class Convert16>
void convert_row(const float* x, int64_t K, int64_t Kp, uint16_t* out, Convert16 convert16) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), convert16(_mm512_loadu_ps(x + k)));
  if (k < K) {
    const __mmask16 m = __mmask16((1u << (K - k)) - 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), convert16(_mm512_maskz_loadu_ps(m, x + k)));
    k += 16;
  }
  std::fill(out + k, out + Kp, uint16_t(0));
  for (int64_t c = 0; c < Kp; c += kChunk) permute_chunk(out + c);
}

// The mask of a chunk's codes within [k, k1): all 64, or the row's (or block's) last partial chunk, whose codes
// past k1 load as 0 (decoded 0, as x is 0 there).
inline __mmask64 chunk_mask(int64_t k, int64_t k1) {
  return k1 - k >= kChunk ? ~__mmask64(0) : (__mmask64(1) << (k1 - k)) - 1;
}

// The chunk two tiles of `tile_bytes` past `chunk` into L1: a tile's rows are contiguous, and its rows
// (9-24 cache lines each on the default model) are too short for the hardware prefetchers to ramp up on.
// Measured on fp8_gemv_f16 at one row of x, one thread: 3072 x 576 (L2) 2.1 -> 1.7 ns a chunk, 8192 x 576
// (past L2) 3.0 -> 1.9, as fast as int8's tiles there.
inline void prefetch_ahead(const uint8_t* chunk, int64_t tile_bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(chunk + 2 * tile_bytes), _MM_HINT_T0);
}

// M rows of x (Kp apart) against R FP8 weight rows (K apart, scales KB apart): out[i * ldo + r] = factor[i] x
// the sum over blocks of scale[r][b] x (row r's products with x's row i). R x M accumulator chains of
// Arith::Acc, each taking a chunk's even then odd half (Arith::dot) and moved into a float32 total times its
// block's scale (Arith::flush) every Arith::kFlushChunks chunks and at each block's end. R > 1 (fp8_gemv_f16,
// measured on Sapphire Rapids) keeps chains in flight at M = 1 and overlaps the rows' final reductions, at the
// price of R interleaved address streams; R = 1 (fp8_gemv_bf16) reads the weight in address order.
template <class Arith, int R, int M>
void dot_tile(const uint16_t* x, const float* factor, int64_t Kp, int64_t K, const uint8_t* w, float* out,
              int64_t ldo, const float* scale, int64_t KB, int64_t kblock) {
  const auto& tables = Arith::tables();
  __m512 total[R][M];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < M; i++) total[r][i] = _mm512_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += kblock, b++) {
    const int64_t k1 = std::min(K, k0 + kblock);
    __m512 s[R];
    for (int r = 0; r < R; r++) s[r] = _mm512_set1_ps(scale[r * KB + b]);
    for (int64_t f = k0; f < k1; f += Arith::kFlushChunks * kChunk) {
      const int64_t f1 = std::min(k1, f + Arith::kFlushChunks * kChunk);
      typename Arith::Acc acc[R][M];
      for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = Arith::zero();
      for (int64_t k = f; k < f1; k += kChunk) {
        const __mmask64 m = chunk_mask(k, f1);
        for (int r = 0; r < R; r++) {
          __m512i even, odd;
          if constexpr (Arith::kPrefetch) prefetch_ahead(w + r * K + k, R * K);
          Arith::widen(_mm512_maskz_loadu_epi8(m, w + r * K + k), tables, even, odd);
          for (int i = 0; i < M; i++) acc[r][i] = Arith::dot(acc[r][i], even, odd, x + i * Kp + k);
        }
      }
      for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) total[r][i] = Arith::flush(acc[r][i], s[r], total[r][i]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < M; i++) out[i * ldo + r] = _mm512_reduce_add_ps(total[r][i]) * factor[i];
}

// The G scales of a chunk's blocks (s[0 .. present)), each over its 16 / G float32 lanes, by broadcasts from
// memory (load-port work: the shuffle port is the bf16 decode's). Lanes of absent blocks (past the row's end)
// keep s[0]: their sums are 0, as their codes are masked to 0.
template <int G>
inline __m512 chunk_scales(const float* s, int64_t present) {
  __m512 v = _mm512_set1_ps(s[0]);
  constexpr unsigned kLanes = (1u << (16 / G)) - 1;          // one block's lanes, block 0's place
  for (int j = 1; j < G; j++)
    if (j < present) v = _mm512_mask_broadcastss_ps(v, __mmask16(kLanes << (j * 16 / G)), _mm_load_ss(s + j));
  return v;
}

// dot_tile for blocks of 16 or 32 inputs (G = 64 / kblock = 4 or 2 blocks a chunk; Arith::kSubChunkScales):
// block j of a chunk lands in its own run of 16 / G consecutive float32 lanes of Arith::Acc (lanes 4q..4q+3
// sum codes 16q..16q+15 of the chunk: see e4m3x64_bf16), so every chunk's sums are flushed times the vector of
// its blocks' scales, each over its lanes (chunk_scales).
template <class Arith, int R, int M, int G>
void dot_tile_subchunk(const uint16_t* x, const float* factor, int64_t Kp, int64_t K, const uint8_t* w,
                       float* out, int64_t ldo, const float* scale, int64_t KB) {
  static_assert(Arith::kSubChunkScales, "the accumulator's lanes must follow the chunk's blocks");
  const auto& tables = Arith::tables();
  __m512 total[R][M];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < M; i++) total[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0, b = 0; k < K; k += kChunk, b += G) {
    const __mmask64 m = chunk_mask(k, K);
    for (int r = 0; r < R; r++) {
      const __m512 s = chunk_scales<G>(scale + r * KB + b, KB - b);
      __m512i even, odd;
      Arith::widen(_mm512_maskz_loadu_epi8(m, w + r * K + k), tables, even, odd);
      for (int i = 0; i < M; i++)
        total[r][i] = Arith::flush(Arith::dot(Arith::zero(), even, odd, x + i * Kp + k), s, total[r][i]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < M; i++) out[i * ldo + r] = _mm512_reduce_add_ps(total[r][i]) * factor[i];
}

// One tile of R weight rows by the block layout's kernel.
template <class Arith, int R, int M>
inline void any_tile(const uint16_t* x, const float* factor, int64_t Kp, int64_t K, const uint8_t* w, float* out,
                     int64_t ldo, const float* scale, int64_t KB, int64_t kblock) {
  if constexpr (Arith::kSubChunkScales) {
    if (kblock == 32) return dot_tile_subchunk<Arith, R, M, 2>(x, factor, Kp, K, w, out, ldo, scale, KB);
    if (kblock == 16) return dot_tile_subchunk<Arith, R, M, 4>(x, factor, Kp, K, w, out, ldo, scale, KB);
  }
  dot_tile<Arith, R, M>(x, factor, Kp, K, w, out, ldo, scale, KB, kblock);
}

// Weight rows [n0, n1) against m <= Arith::kMaxPass rows of x, in tiles of Arith::kTileRows<m> weight rows.
template <class Arith, int M = 1>
void dot_rows(int m, const uint16_t* x, const float* factor, int64_t Kp, int64_t K, const uint8_t* w, int64_t n0,
              int64_t n1, float* out, int64_t ldo, const float* scale, int64_t KB, int64_t kblock) {
  if constexpr (M < Arith::kMaxPass) {
    if (m > M) return dot_rows<Arith, M + 1>(m, x, factor, Kp, K, w, n0, n1, out, ldo, scale, KB, kblock);
  }
  constexpr int R = Arith::template kTileRows<M>;
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    any_tile<Arith, R, M>(x, factor, Kp, K, w + n * K, out + n, ldo, scale + n * KB, KB, kblock);
  for (; n < n1; n++)
    any_tile<Arith, 1, M>(x, factor, Kp, K, w + n * K, out + n, ldo, scale + n * KB, KB, kblock);
}

// The kernels' common contract: checks (named by `name`), x prepared by Arith::prepare, the threads over
// blocks of output rows, passes of up to Arith::kMaxPass rows of x.
template <class Arith>
at::Tensor run(const char* name, at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock) {
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) % 8 == 0,
              name, ": codes must be contiguous float8_e4m3fn [N, K], K a multiple of 8; got ",
              codes.scalar_type(), " ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  if (kblock <= 0) kblock = K;
  const bool subchunk = Arith::kSubChunkScales && (kblock == 16 || kblock == 32);
  TORCH_CHECK(kblock == K || kblock % kChunk == 0 || subchunk, name, ": kblock must be K (", K, ") or a multiple of 64",
              Arith::kSubChunkScales ? " (or 16 or 32)" : "", ", got ", kblock);
  const int64_t KB = (K + kblock - 1) / kblock;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * KB,
              name, ": scales must be contiguous float32 [N, K / kblock] = [", N, ", ", KB, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              name, ": x must be float32 [T, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t T = x.size(0);
  auto y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  PreparedX px{std::vector<uint16_t>(T * ((K + kChunk - 1) / kChunk * kChunk)), std::vector<float>(T),
               (K + kChunk - 1) / kChunk * kChunk};
  for (int64_t r = 0; r < T; r++)
    px.factor[r] = Arith::prepare(xc.data_ptr<float>() + r * K, K, px.Kp, px.bits.data() + r * px.Kp);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scales.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kBlockRows, n1 = std::min(N, b1 * kBlockRows);
    for (int64_t r = 0; r < T; r += Arith::kMaxPass)
      dot_rows<Arith>((int)std::min<int64_t>(Arith::kMaxPass, T - r), px.bits.data() + r * px.Kp,
                      px.factor.data() + r, px.Kp, K, w, n0, n1, out + r * N, N, s, KB, kblock);
  });
  return y;
}

}  // namespace
#endif

#ifdef TOKENMILL_FP8_GEMV_BF16
namespace {

// bfloat16 bits of E4M3 magnitude code c (0..126; 127, NaN, gives 0): exact, as every E4M3 value is a bfloat16.
uint16_t e4m3_bf16_bits(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const float v = c == 127 ? 0.f : e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return uint16_t(bits >> 16);
}

// The high and low bytes of e4m3_bf16_bits(c) for c = 0..127, as the two-register tables vpermi2b reads
// (bit 6 of the index picks the second register).
struct Bf16Bytes {
  __m512i hi0, hi1, lo0, lo1;
};
const Bf16Bytes& bf16_bytes() {
  static const Bf16Bytes tables = [] {
    alignas(64) uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; c++) hi[c] = uint8_t(e4m3_bf16_bits(c) >> 8), lo[c] = uint8_t(e4m3_bf16_bits(c));
    return Bf16Bytes{_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo),
                     _mm512_load_si512(lo + 64)};
  }();
  return tables;
}

// 64 E4M3 codes -> 64 bfloat16, exactly, in 5 vector ops: each byte of the result looked up by the code's 7
// magnitude bits (vpermi2b), the sign or-ed into the high byte (vpternlogd 0xF8: a | (b & c)), the bytes
// interleaved into words within each 128-bit lane (`even` and `odd` as permute_chunk orders x). NaN is not
// decoded.
inline void e4m3x64_bf16(__m512i codes, const Bf16Bytes& t, __m512i& even, __m512i& odd) {
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, codes, t.hi1), codes,
                                               _mm512_set1_epi8(char(0x80)), 0xF8);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  even = _mm512_unpacklo_epi8(lo, hi);
  odd = _mm512_unpackhi_epi8(lo, hi);
}

// bfloat16 products (vdpbf16ps) summed in float32.
struct Bf16Arith {
  static constexpr int kMaxPass = 16;                      // rows of x sharing one decoded weight vector
  template <int M>
  static constexpr int kTileRows = 1;         // a weight row at a time, in address order (see the top)
  static constexpr bool kPrefetch = false;    // the hardware prefetchers keep up with one stream a thread
  // Acc's float32 lane l sums only codes 16 (l / 4) .. 16 (l / 4) + 15 of a chunk (e4m3x64_bf16's unpacks and
  // vdpbf16ps's pairs stay within 128-bit lanes), so blocks of 16 or 32 inputs can be scaled lane by lane.
  static constexpr bool kSubChunkScales = true;

  // x's row rounded to bfloat16 (nearest even, as torch's .to(torch.bfloat16)); factor 1.
  static float prepare(const float* x, int64_t K, int64_t Kp, uint16_t* out) {
    convert_row(x, K, Kp, out, [](__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); });
    return 1.f;
  }

  // bfloat16 products with float32 sums (vdpbf16ps), scaled at each block's end only
  using Acc = __m512;
  static constexpr int64_t kFlushChunks = int64_t(1) << 24;
  static const Bf16Bytes& tables() { return bf16_bytes(); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static void widen(__m512i codes, const Bf16Bytes& t, __m512i& even, __m512i& odd) {
    e4m3x64_bf16(codes, t, even, odd);
  }
  static Acc dot(Acc acc, __m512i even, __m512i odd, const uint16_t* x) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)even, (__m512bh)_mm512_loadu_si512(x));
    return _mm512_dpbf16_ps(acc, (__m512bh)odd, (__m512bh)_mm512_loadu_si512(x + 32));
  }
  static __m512 flush(Acc acc, __m512 s, __m512 total) { return _mm512_fmadd_ps(acc, s, total); }
};

}  // namespace

at::Tensor fp8_gemv_bf16(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock) {
  return run<Bf16Arith>("fp8_gemv_bf16", x, codes, scales, kblock);
}
#endif

#ifdef TOKENMILL_FP8_GEMV_F16
namespace {

constexpr int kXExponent = 11;       // x's rows are scaled so that max |x| < 2^11
constexpr int64_t kF16SumChunks = 4;  // chunks (2 products a lane each) summed in fp16 before float32
// So a lane's fp16 sum holds at most 8 products, each under 2^11 x 1.75 (the largest E4M3 value, 448, is
// 1.75 as the decode's fp16 x 2^-8): under 28,672, inside fp16's 65,504.

// 64 E4M3 codes -> 64 fp16 of value x 2^-8, exactly, in 3 ops per 32: the code unpacked into a word's high byte
// (code << 8: sign in bit 15, exponent and mantissa in bits 8-14), shifted right arithmetically by 1 (the
// sign in bits 15 and 14, exponent bits 10-13, mantissa bits 7-9) and bit 14 cleared. fp16's exponent bias is
// 15 where E4M3's is 7, so each normal value comes out x 2^-8, and so does each subnormal (E4M3's m x 2^-9 is
// fp16's subnormal m x 2^-17). NaN (0x7F / 0xFF) is not decoded (it reads as +-480).
inline void e4m3x64_f16(__m512i codes, __m512i& even, __m512i& odd) {
  const __m512i zero = _mm512_setzero_si512(), keep = _mm512_set1_epi16(short(0xBFFF));
  even = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(zero, codes), 1), keep);
  odd = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(zero, codes), 1), keep);
}

// fp16 products summed in fp16 over at most kF16SumChunks chunks, then in float32.
struct F16Arith {
  static constexpr int kMaxPass = 8;                       // rows of x sharing one decoded weight vector
  template <int M>
  static constexpr int kTileRows = M <= 2 ? 4 : M <= 4 ? 2 : 1;    // R x M <= 8 (fp16 and float32 sums)
  static constexpr bool kPrefetch = true;     // R rows interleaved: a software prefetch two tiles ahead
  static constexpr bool kSubChunkScales = false;   // blocks of 16 or 32 inputs are not taken

  // x's row times 2^shift, shift such that max |x| 2^shift < 2^kXExponent, rounded to fp16 (nearest even:
  // relative 2^-11; values under 2^-14 of that scale's unit lose bits as fp16 subnormals); factor 2^(8 - shift)
  // undoes the shift and the decode's 2^-8. A row without a finite nonzero maximum keeps shift 0 (zeros give
  // zeros; inf and NaN propagate).
  static float prepare(const float* x, int64_t K, int64_t Kp, uint16_t* out) {
    __m512 amax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    if (k < K) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(__mmask16((1u << (K - k)) - 1), x + k)));
    const float top = _mm512_reduce_max_ps(amax);
    int exponent = 0, shift = 0;
    if (std::isfinite(top) && top > 0) {
      std::frexp(top, &exponent);                          // top < 2^exponent, exponent in [-148, 128]
      shift = std::min(kXExponent - exponent, 127);       // 2^shift and 2^(8 - shift) are normal float32
    }
    const __m512 up = _mm512_set1_ps(std::ldexp(1.f, shift));
    convert_row(x, K, Kp, out, [up](__m512 v) {
      return _mm256_castph_si256(_mm512_cvtxps_ph(_mm512_mul_ps(v, up)));
    });
    return std::ldexp(1.f, 8 - shift);
  }

  // fp16 FMAs, at most kFlushChunks chunks into a lane's sum before float32
  using Acc = __m512h;
  struct NoTables {};
  static constexpr int64_t kFlushChunks = kF16SumChunks;
  static NoTables tables() { return {}; }
  static Acc zero() { return _mm512_setzero_ph(); }
  static void widen(__m512i codes, NoTables, __m512i& even, __m512i& odd) { e4m3x64_f16(codes, even, odd); }
  static Acc dot(Acc acc, __m512i even, __m512i odd, const uint16_t* x) {
    acc = _mm512_fmadd_ph((__m512h)even, (__m512h)_mm512_loadu_si512(x), acc);
    return _mm512_fmadd_ph((__m512h)odd, (__m512h)_mm512_loadu_si512(x + 32), acc);
  }
  static __m512 flush(Acc acc, __m512 s, __m512 total) {
    const __m512i a = (__m512i)acc;
    total = _mm512_fmadd_ps(_mm512_cvtxph_ps((__m256h)_mm512_castsi512_si256(a)), s, total);
    return _mm512_fmadd_ps(_mm512_cvtxph_ps((__m256h)_mm512_extracti64x4_epi64(a, 1)), s, total);
  }
};

}  // namespace

at::Tensor fp8_gemv_f16(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock) {
  return run<F16Arith>("fp8_gemv_f16", x, codes, scales, kblock);
}
#endif
