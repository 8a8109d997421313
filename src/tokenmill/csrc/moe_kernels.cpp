// See moe_kernels.h. Work items are (expert, block of 16 output rows), spread over the threads: a block's
// weights (16 rows x K) stay in L1/L2 while every row of the expert's run passes over them, eight rows at
// a time, each with its own accumulator: one weight vector load (int8, FP8 or FP4: widened to float32 once)
// feeds eight FMAs. Scales: one per output row and run of `kblock` inputs (a whole row: kblock = K).
#include "moe_kernels.h"

#ifdef TOKENMILL_MOE_KERNELS
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlockRows = 16;   // output rows per work item
constexpr int kRowsPerPass = 8;      // activation rows sharing one pass over a weight row

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Fp8 { uint8_t bits; };      // an E4M3 value (float8_e4m3fn), decoded in registers
struct Fp4 { uint8_t bits; };      // two E2M1 values (NVFP4 / MXFP4), the even element in the low nibble

// Weights per element of W in memory: 2 for packed FP4, else 1.
template <class W> constexpr int64_t kPerElem = 1;
template <> constexpr int64_t kPerElem<Fp4> = 2;

inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
// E4M3 -> float32 exactly: the 7 magnitude bits shifted into float32's exponent|mantissa (exponent bias 127
// instead of 7, so times 2^120; E4M3's subnormals land on float32 subnormals, which the multiply scales
// exactly), then the sign. NaN (0x7F) is not decoded (checkpoints hold none).
inline __m256 load8(const Fp8* w) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

#ifdef __AVX512F__
// AVX-512 FP8 paths (16 weights a vector): the decode is the bound of an FP8 dot product, and one 16-wide
// decode costs the ops of one 8-wide.
//
// 16 E4M3 codes (zero-extended to 32 bits) -> float32 exactly, as load8(const Fp8*) decodes 8:
// t = code << 20 puts the 7 magnitude bits at float32's bits 26..20 (exponent bias 127 instead of 7: times
// 2^-120, undone by the multiply; E4M3's subnormals land on float32 subnormals, which the multiply scales
// exactly) and the sign at bit 27, moved to bit 31 by a second shift and or-ed in (vpternlogd 0xF8:
// a | (b & c)).
inline __m512 e4m3x16(__m512i b) {
  const __m512i t = _mm512_slli_epi32(b, 20);
  const __m512i magnitude = _mm512_and_si512(t, _mm512_set1_epi32(0x07F00000));
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(value), _mm512_slli_epi32(t, 4),
                                                       _mm512_set1_epi32(int(0x80000000u)), 0xF8));
}
inline __m512 load16(const Fp8* w) {
  return e4m3x16(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
// The last 8 codes of a row whose K is 8 past a multiple of 16 (the upper 8 lanes decode 0).
inline __m512 load16_tail8(const Fp8* w) {
  return e4m3x16(_mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// One row of x against an FP8 row (K a multiple of 8): per block, four accumulator chains of unscaled
// products, then the block's sum times its scale (one multiply a block, not one a vector).
inline void dot_one_fp8(const float* x, int64_t K, const Fp8* w, float* out, const float* scale, int64_t kblock) {
  __m512 total = _mm512_setzero_ps();
  const int64_t blocks = (K + kblock - 1) / kblock;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t k1 = std::min(K, (b + 1) * kblock);
    int64_t k = b * kblock;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 64 <= k1; k += 64) {
      a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
      a1 = _mm512_fmadd_ps(load16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
      a2 = _mm512_fmadd_ps(load16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
      a3 = _mm512_fmadd_ps(load16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k + 16 <= k1; k += 16) a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
    if (k < k1) a1 = _mm512_fmadd_ps(load16_tail8(w + k), _mm512_maskz_loadu_ps(0x00FF, x + k), a1);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    total = scale ? _mm512_fmadd_ps(sum, _mm512_set1_ps(scale[b]), total) : _mm512_add_ps(total, sum);
  }
  out[0] = _mm512_reduce_add_ps(total);
}

// M rows of x (K apart) against an FP8 row: 16 weights decoded and scaled once, shared by the M rows' FMAs.
template <int M>
inline void dot_rows_fp8(const float* x, int64_t K, const Fp8* w, float* out, int64_t ldo, const float* scale,
                         int64_t kblock) {
  __m512 acc[M];
  for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += kblock, b++) {
    const __m512 s = _mm512_set1_ps(scale ? scale[b] : 1.0f);
    const int64_t k1 = std::min(K, k0 + kblock);
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
      const __m512 wv = _mm512_mul_ps(load16(w + k), s);
      for (int i = 0; i < M; i++) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i * K + k), acc[i]);
    }
    if (k < k1) {
      const __m512 wv = _mm512_mul_ps(load16_tail8(w + k), s);
      for (int i = 0; i < M; i++) acc[i] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(0x00FF, x + i * K + k), acc[i]);
    }
  }
  for (int i = 0; i < M; i++) out[i * ldo] = _mm512_reduce_add_ps(acc[i]);
}
#endif

// E2M1 -> float32 exactly, 8 weights from 4 bytes: lane j takes bits 4j..4j+3 of the little-endian word (byte
// j / 2, the low nibble for even j), its 3 magnitude bits index the 8 values, bit 3 is the sign.
inline __m256 load8(const Fp4* w) {
  int32_t word;
  std::memcpy(&word, w, 4);
  const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(0xF));
  const __m256 magnitudes = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256 value = _mm256_permutevar8x32_ps(magnitudes, nib);       // uses the low 3 bits of each lane
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(0x8)), 28);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// 8 weights from element k on, as float32, times s when the weights are scaled.
template <class W>
inline __m256 weights8(const W* w, int64_t k, const float* scale, __m256 s) {
  return scale ? _mm256_mul_ps(load8(w + k / kPerElem<W>), s) : load8(w + k / kPerElem<W>);
}

// out[i * ldo] = sum over blocks b of dot(x + i * K, w * scale[b])[block b], for M rows of x (K and kblock
// multiples of 8). The scale multiplies the decoded weight vector once for all M rows.
template <int M, class W>
inline void dot_rows(const float* x, int64_t K, const W* w, float* out, int64_t ldo, const float* scale,
                     int64_t kblock) {
  __m256 acc[M];
  for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += kblock, b++) {
    const __m256 s = _mm256_set1_ps(scale ? scale[b] : 1.0f);
    const int64_t k1 = std::min(K, k0 + kblock);
    for (int64_t k = k0; k < k1; k += 8) {
      const __m256 wv = weights8(w, k, scale, s);
      for (int i = 0; i < M; i++) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * K + k), acc[i]);
    }
  }
  for (int i = 0; i < M; i++) out[i * ldo] = hsum(acc[i]);
}

// One row of x (a batch-1 decode): four accumulators (two per block, alternating blocks) so consecutive
// FMAs do not wait on each other; the same sum as dot_rows<1> up to float rounding.
template <class W>
inline void dot_one(const float* x, int64_t K, const W* w, float* out, const float* scale, int64_t kblock) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const auto block = [&](int64_t b, __m256& even, __m256& odd) {   // block b into two accumulators
    const __m256 s = _mm256_set1_ps(scale ? scale[b] : 1.0f);
    const int64_t k1 = std::min(K, (b + 1) * kblock);
    int64_t k = b * kblock;
    for (; k + 16 <= k1; k += 16) {
      even = _mm256_fmadd_ps(weights8(w, k, scale, s), _mm256_loadu_ps(x + k), even);
      odd = _mm256_fmadd_ps(weights8(w, k + 8, scale, s), _mm256_loadu_ps(x + k + 8), odd);
    }
    if (k < k1) even = _mm256_fmadd_ps(weights8(w, k, scale, s), _mm256_loadu_ps(x + k), even);
  };
  const int64_t blocks = (K + kblock - 1) / kblock;
  for (int64_t b = 0; b < blocks; b += 2) {                        // alternate blocks: four chains in flight
    block(b, a0, a1);
    if (b + 1 < blocks) block(b + 1, a2, a3);
  }
  out[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// One row of x against FP4 weights in blocks of 16 or 32 (K a multiple of 32): 32 weights a chunk, decoded
// from 16 bytes by two byte shuffles (a 16-entry table of 2 x E2M1 as int8: exact small integers), one for
// the low nibbles (the chunk's even elements) and one for the high (the odd). xp is the row with each chunk
// of 32 reordered to match: [x0 x2 .. x14 | x16 x18 .. x30 | x1 x3 .. x15 | x17 .. x31] (fp4_chunk_order).
// Each block's products are summed before its scale multiplies them; the table's factor 2 is undone once.
inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// E4M3 byte -> float32 (as load8(const Fp8*) decodes it; 0x7F / 0xFF, NaN, are not decoded).
float e4m3_value(uint8_t b) {
  uint32_t bits = uint32_t(b & 0x7F) << 20;
  float magnitude;
  std::memcpy(&magnitude, &bits, 4);
  magnitude *= 0x1p120f;
  return (b & 0x80) ? -magnitude : magnitude;
}

const float* e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; b++) t[b] = e4m3_value(uint8_t(b));
    return t;
  }();
  return table.data();
}

// A row's block scales as the FP4 dot products read them: float32, or E4M3 bytes (decoded by a table lookup
// as read; the row's tensor scale is applied to the finished sums).
struct F32Scales {
  const float* s;
  float operator[](int64_t b) const { return s[b]; }
};
struct E4M3Scales {
  const uint8_t* s;
  const float* table;
  float operator[](int64_t b) const { return table[s[b]]; }
};

template <class S>
inline void dot_one_fp4(const float* xp, int64_t K, const Fp4* w, float* out, S scale, int64_t kblock) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  for (int64_t c = 0; c < K / 32; c++) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * c));
    const __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(b, nibble));
    const __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    const float* x = xp + 32 * c;
    __m256 first = _mm256_mul_ps(i8x8_to_ps(even), _mm256_loadu_ps(x));                 // elements 0..15
    first = _mm256_fmadd_ps(i8x8_to_ps(odd), _mm256_loadu_ps(x + 16), first);
    __m256 second = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(even, 8)), _mm256_loadu_ps(x + 8));   // 16..31
    second = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(odd, 8)), _mm256_loadu_ps(x + 24), second);
    if (kblock == 16) {
      acc0 = _mm256_fmadd_ps(first, _mm256_set1_ps(scale[2 * c]), acc0);
      acc1 = _mm256_fmadd_ps(second, _mm256_set1_ps(scale[2 * c + 1]), acc1);
    } else {
      acc0 = _mm256_fmadd_ps(_mm256_add_ps(first, second), _mm256_set1_ps(scale[c]), acc0);
    }
  }
  out[0] = 0.5f * hsum(_mm256_add_ps(acc0, acc1));
}

// Several rows of x (ldx apart, in xp's order) against FP4 weights in blocks of 16 or 32: each chunk's 32
// weights decoded once (as dot_one_fp4 does) and scaled, then shared by the M rows' FMAs.
template <int M, class S>
inline void dot_rows_fp4(const float* xp, int64_t K, const Fp4* w, float* out, int64_t ldo, S scale,
                         int64_t kblock) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
  __m256 acc[M];
  for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; c++) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * c));
    const __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(b, nibble));
    const __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    const __m256 s0 = _mm256_set1_ps(kblock == 16 ? scale[2 * c] : scale[c]);        // elements 0..15
    const __m256 s1 = _mm256_set1_ps(kblock == 16 ? scale[2 * c + 1] : scale[c]);    // elements 16..31
    const __m256 v[4] = {_mm256_mul_ps(i8x8_to_ps(even), s0), _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(even, 8)), s1),
                         _mm256_mul_ps(i8x8_to_ps(odd), s0), _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(odd, 8)), s1)};
    for (int i = 0; i < M; i++) {
      const float* x = xp + i * K + 32 * c;
      for (int j = 0; j < 4; j++) acc[i] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + 8 * j), acc[i]);
    }
  }
  for (int i = 0; i < M; i++) out[i * ldo] = 0.5f * hsum(acc[i]);
}

// f(std::integral_constant<int, m>{}) for m = 1..8 (m > 8 as 8): a row count made a template argument.
template <class F>
inline void with_rows(int m, F&& f) {
  switch (m) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

template <class S>
inline void dot_any_fp4(int m, const float* xp, int64_t K, const Fp4* w, float* out, int64_t ldo, S scale,
                        int64_t kblock) {
  with_rows(m, [&](auto rows) {
    if constexpr (rows() == 1) dot_one_fp4(xp, K, w, out, scale, kblock);
    else dot_rows_fp4<rows()>(xp, K, w, out, ldo, scale, kblock);
  });
}

// x [K] -> the order dot_one_fp4 and dot_rows_fp4 read (K a multiple of 32).
void fp4_chunk_order(const float* x, int64_t K, float* xp) {
  for (int64_t c = 0; c < K; c += 32)
    for (int j = 0; j < 16; j++) {
      xp[c + j] = x[c + 2 * j];
      xp[c + 16 + j] = x[c + 2 * j + 1];
    }
}

template <class W>
inline void dot_any(int m, const float* x, int64_t K, const W* w, float* out, int64_t ldo, const float* scale,
                    int64_t kblock) {
  with_rows(m, [&](auto rows) {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<W, Fp8>) {
      if constexpr (rows() == 1) dot_one_fp8(x, K, w, out, scale, kblock);
      else dot_rows_fp8<rows()>(x, K, w, out, ldo, scale, kblock);
      return;
    }
#endif
    // FP4 comes here only off dot_any_fp4's shapes: its decode is the bound, the split chains measured slower
    if constexpr (rows() == 1 && !std::is_same_v<W, Fp4>) dot_one(x, K, w, out, scale, kblock);
    else dot_rows<rows()>(x, K, w, out, ldo, scale, kblock);
  });
}

// FP4 in blocks of 16 or 32 with K a multiple of 32 takes dot_any_fp4, reading xp: x's R rows in its order.
bool fp4_reordered_rows(const float* x, int64_t R, int64_t K, int64_t kblock, std::vector<float>& xp) {
  if (K % 32 != 0 || (kblock != 16 && kblock != 32)) return false;
  xp.resize(R * K);
  for (int64_t r = 0; r < R; r++) fp4_chunk_order(x + r * K, K, xp.data() + r * K);
  return true;
}

// The scales of one output row: float32 as given, or (NVFP4's own form) E4M3 block-scale bytes times the
// row's float32 tensor scale, decoded into the caller's buffer of KB floats.
struct RowScales {
  const float* f32 = nullptr;        // [E, N, KB]
  const uint8_t* e4m3 = nullptr;     // [E, N, KB], with row [E, N]
  const float* row = nullptr;
  int64_t KB = 0;

  const float* of(int64_t en, float* buffer) const {
    if (f32 || !e4m3) return f32 ? f32 + en * KB : nullptr;
    const float* table = e4m3_table();
    const uint8_t* codes = e4m3 + en * KB;
    for (int64_t b = 0; b < KB; b++) buffer[b] = table[codes[b]] * row[en];
    return buffer;
  }
};

template <class W>
void grouped(const float* x, const int64_t* starts, const W* w, const RowScales& scales, float* y, int64_t E,
             int64_t N, int64_t K, int64_t kblock) {
  std::vector<float> xp;
  bool fp4_fast = false;
  if constexpr (std::is_same_v<W, Fp4>) fp4_fast = fp4_reordered_rows(x, starts[E], K, kblock, xp);
  const int64_t KB = (K + kblock - 1) / kblock;   // scales per output row
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  std::vector<int64_t> items;                 // e * blocks + b for experts with rows
  for (int64_t e = 0; e < E; e++)
    if (starts[e + 1] > starts[e])
      for (int64_t b = 0; b < blocks; b++) items.push_back(e * blocks + b);
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> row_scales(KB);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t e = items[i] / blocks, n0 = items[i] % blocks * kBlockRows;
      const int64_t n1 = std::min(N, n0 + kBlockRows), r0 = starts[e], r1 = starts[e + 1];
      for (int64_t n = n0; n < n1; n++) {
        const W* wrow = w + (e * N + n) * K / kPerElem<W>;
        if constexpr (std::is_same_v<W, Fp4>) {
          if (fp4_fast) {
            const int64_t en = e * N + n;
            for (int64_t r = r0; r < r1; r += kRowsPerPass) {
              const int m = (int)std::min<int64_t>(kRowsPerPass, r1 - r);
              float* out = y + r * N + n;
              if (!scales.e4m3) {
                dot_any_fp4(m, xp.data() + r * K, K, wrow, out, N, F32Scales{scales.f32 + en * KB}, kblock);
                continue;
              }
              dot_any_fp4(m, xp.data() + r * K, K, wrow, out, N, E4M3Scales{scales.e4m3 + en * KB, e4m3_table()},
                          kblock);
              for (int i = 0; i < m; i++) out[i * N] *= scales.row[en];
            }
            continue;
          }
        }
        const float* s = scales.of(e * N + n, row_scales.data());
        for (int64_t r = r0; r < r1; r += kRowsPerPass)
          dot_any((int)std::min<int64_t>(kRowsPerPass, r1 - r), x + r * K, K, wrow, y + r * N + n, N, s, kblock);
      }
    }
  });
}

}  // namespace

at::Tensor moe_grouped_gemm(at::Tensor x, at::Tensor run_starts, at::Tensor w,
                            c10::optional<at::Tensor> scale, int64_t kblock,
                            c10::optional<at::Tensor> row_scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "moe_grouped_gemm: x must be contiguous float32 [R, K], got ", x.sizes());
  const bool fp4 = w.scalar_type() == at::kByte;          // packed E2M1 pairs: [E, N, K / 2]
  const int64_t per = fp4 ? 2 : 1;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) * per == x.size(1) && x.size(1) % 8 == 0,
              "moe_grouped_gemm: w must be contiguous [E, N, K] (uint8 FP4 pairs: [E, N, K / 2]) with K = x's "
              "columns, a multiple of 8; got ", w.sizes(), " for x ", x.sizes());
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2) * per, R = x.size(0);
  if (kblock <= 0) kblock = K;
  TORCH_CHECK(kblock % 8 == 0 || kblock == K, "moe_grouped_gemm: kblock must be a multiple of 8");
  const int64_t KB = (K + kblock - 1) / kblock;
  TORCH_CHECK(run_starts.scalar_type() == at::kLong && run_starts.numel() == E + 1 &&
                  run_starts.is_contiguous(),
              "moe_grouped_gemm: run_starts must be int64 [E + 1]");
  const int64_t* starts = run_starts.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[E] == R, "moe_grouped_gemm: run_starts must go from 0 to the rows of x (",
              R, "), got run_starts[0] = ", starts[0], " and run_starts[", E, "] = ", starts[E]);
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(starts[e] <= starts[e + 1], "moe_grouped_gemm: run_starts must be non-decreasing, got run_starts[", e,
                "] = ", starts[e], " > run_starts[", e + 1, "] = ", starts[e + 1]);
  auto y = at::empty({R, N}, x.options());
  RowScales scales;
  scales.KB = KB;
  TORCH_CHECK(w.scalar_type() != at::kFloat || (!scale.has_value() && !row_scale.has_value()),
              "moe_grouped_gemm: float32 weights take no scale or row_scale (they would be ignored), got a ",
              scale.has_value() ? "scale" : "row_scale");
  if (w.scalar_type() != at::kFloat) {
    TORCH_CHECK(scale.has_value() && scale->is_contiguous() && scale->numel() == E * N * KB,
                "moe_grouped_gemm: int8 / FP8 / FP4 weights need scales [E, N, K / kblock]");
    if (scale->scalar_type() == at::kFloat8_e4m3fn) {          // NVFP4's E4M3 block scales x a row scale
      TORCH_CHECK(fp4 && row_scale.has_value() && row_scale->scalar_type() == at::kFloat &&
                      row_scale->is_contiguous() && row_scale->numel() == E * N,
                  "moe_grouped_gemm: E4M3 block scales (FP4 weights only) need float32 row_scale [E, N]");
      scales.e4m3 = reinterpret_cast<const uint8_t*>(scale->data_ptr());
      scales.row = row_scale->data_ptr<float>();
    } else {
      TORCH_CHECK(scale->scalar_type() == at::kFloat, "moe_grouped_gemm: scales must be float32, or E4M3 "
                  "(float8_e4m3fn) with a row_scale for FP4 weights");
      scales.f32 = scale->data_ptr<float>();
    }
  }
  if (w.scalar_type() == at::kChar) {
    grouped(x.data_ptr<float>(), starts, w.data_ptr<int8_t>(), scales, y.data_ptr<float>(), E, N, K, kblock);
  } else if (fp4) {
    grouped(x.data_ptr<float>(), starts, reinterpret_cast<const Fp4*>(w.data_ptr()), scales, y.data_ptr<float>(), E,
            N, K, kblock);
  } else if (w.scalar_type() == at::kFloat8_e4m3fn) {
    grouped(x.data_ptr<float>(), starts, reinterpret_cast<const Fp8*>(w.data_ptr()), scales, y.data_ptr<float>(), E,
            N, K, kblock);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "moe_grouped_gemm: weights must be float32, int8, float8_e4m3fn or uint8 (FP4 pairs)");
    grouped(x.data_ptr<float>(), starts, w.data_ptr<float>(), RowScales{}, y.data_ptr<float>(), E, N, K, kblock);
  }
  return y;
}

at::Tensor fp8_dequantize(at::Tensor codes, at::Tensor scales, int64_t kblock) {
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) % 8 == 0,
              "fp8_dequantize: codes must be contiguous float8_e4m3fn [N, K], K a multiple of 8; got ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  if (kblock <= 0) kblock = K;
  TORCH_CHECK(kblock == K || kblock % 8 == 0, "fp8_dequantize: kblock must be K or a multiple of 8");
  const int64_t KB = (K + kblock - 1) / kblock;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * KB,
              "fp8_dequantize: scales must be contiguous float32 [N, K / kblock]");
  auto out = at::empty({N, K}, scales.options());
  const Fp8* w = reinterpret_cast<const Fp8*>(codes.data_ptr());
  const float* s = scales.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(y + n * K + k, _mm256_mul_ps(load8(w + n * K + k), _mm256_set1_ps(s[n * KB + k / kblock])));
  });
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

// codes [N, K] (K a multiple of 8) -> bfloat16 [N, K]: code x scale (scale per row and kblock inputs, or 1
// without scales) rounded to nearest even bfloat16; exact without scales (E4M3's 3 mantissa bits and
// exponent range fit bfloat16).
at::Tensor fp8_to_bf16(const at::Tensor& codes, const float* s, int64_t kblock) {
  const int64_t N = codes.size(0), K = codes.size(1), KB = (K + kblock - 1) / kblock;
  auto out = at::empty({N, K}, codes.options().dtype(at::kBFloat16));
  const Fp8* w = reinterpret_cast<const Fp8*>(codes.data_ptr());
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const Fp8* row = w + n * K;
      uint16_t* dst = y + n * K;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512 v = s ? _mm512_mul_ps(load16(row + k), _mm512_set1_ps(s[n * KB + k / kblock])) : load16(row + k);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)_mm512_cvtneps_pbh(v));
      }
      if (k < K) {                                         // the last 8 (K is a multiple of 8)
        const __m512 v = s ? _mm512_mul_ps(load16_tail8(row + k), _mm512_set1_ps(s[n * KB + k / kblock]))
                           : load16_tail8(row + k);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm256_castsi256_si128((__m256i)_mm512_cvtneps_pbh(v)));
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor fp8_linear_bf16(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock) {
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) % 8 == 0,
              "fp8_linear_bf16: codes must be contiguous float8_e4m3fn [N, K], K a multiple of 8; got ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  if (kblock <= 0) kblock = K;
  // fp8_to_bf16 applies one scale per 16 codes: a block of 8 (24, 40, ...) inputs would get its neighbour's
  TORCH_CHECK(kblock == K || kblock % 16 == 0, "fp8_linear_bf16: kblock must be K (", K,
              ") or a multiple of 16, got ", kblock);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == N * ((K + kblock - 1) / kblock),
              "fp8_linear_bf16: scales must be contiguous float32 [N, K / kblock]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "fp8_linear_bf16: x must be [T, ", K, "], got ", x.sizes());
  const bool per_row = kblock == K;                        // the scale factors out of the dot product
  const at::Tensor w = fp8_to_bf16(codes, per_row ? nullptr : scales.data_ptr<float>(), kblock);
  const at::Tensor y = at::linear(x.to(at::kBFloat16), w);           // [T, N] bfloat16, float32 sums
  return per_row ? at::mul(y, scales.reshape({1, N})) : y.to(at::kFloat);   // float32 [T, N]
}
#endif
#endif
