// See fp8_gemv.h. Work items are blocks of 16 output rows spread over the threads; each weight row is read
// once, 64 codes at a time, widened to 64 bfloat16 in registers by table lookups (5 vector ops), and fed
// to two vdpbf16ps per row of x (32 multiply-adds each): 0.094 ms for the default model's four layer shapes
// at one row against the float32 grouped kernel's 0.151 (benchmarks/fp8_kernels.py, Sapphire Rapids, 2
// threads). vdpbf16ps is the bound there (one per 0.54 ns on that CPU against a float32 FMA's 0.14: half
// float32's multiply-add rate; a decode without table lookups measured no faster), and oneDNN's bfloat16
// GEMM (AMX) overtakes this kernel above about 10 rows.
#include "fp8_gemv.h"

#ifdef TOKENMILL_FP8_GEMV_BF16
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlockRows = 16;   // output rows per work item
constexpr int kMaxPass = 16;         // rows of x sharing one decoded weight vector
constexpr int64_t kChunk = 64;       // codes decoded by one table lookup

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
// interleaved into words within each 128-bit lane. So `even` holds codes 0-7, 16-23, 32-39, 48-55 and `odd`
// codes 8-15, 24-31, 40-47, 56-63: x's chunk must be in that order (permute_chunk). NaN is not decoded.
inline void e4m3x64_bf16(__m512i codes, const Bf16Bytes& t, __m512i& even, __m512i& odd) {
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, codes, t.hi1), codes,
                                               _mm512_set1_epi8(char(0x80)), 0xF8);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  even = _mm512_unpacklo_epi8(lo, hi);
  odd = _mm512_unpackhi_epi8(lo, hi);
}

// A chunk of 64 bfloat16 inputs into e4m3x64_bf16's order, in place: position p < 32 takes input
// 16 (p / 8) + p % 8, position p >= 32 takes 16 ((p - 32) / 8) + 8 + p % 8.
void permute_chunk(uint16_t* chunk) {
  uint16_t in[kChunk];
  std::memcpy(in, chunk, sizeof(in));
  for (int p = 0; p < kChunk; p++) chunk[p] = in[p < 32 ? 16 * (p / 8) + p % 8 : 16 * ((p - 32) / 8) + 8 + p % 8];
}

// A row of x [K] float32 -> bfloat16 bits [Kp] (nearest even; zeros from K to Kp, K rounded up to 64), every
// chunk of 64 permuted as e4m3x64_bf16 decodes them.
void round_row(const float* x, int64_t K, int64_t Kp, uint16_t* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
  if (k < K) {
    const __mmask16 m = __mmask16((1u << (K - k)) - 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k)));    // zeros past K
    k += 16;
  }
  std::fill(out + k, out + Kp, uint16_t(0));
  for (int64_t c = 0; c < Kp; c += kChunk) permute_chunk(out + c);
}

// M rows of x (round_row's layout, Kp apart) against R FP8 weight rows (K apart, scales KB apart):
// out[i * ldo + r] = sum over blocks of scale[r][b] x (row r's bfloat16 products with x's row i, summed in
// float32). R x M accumulator chains, each taking a chunk's even then odd half; several weight rows at once
// keep enough chains in flight at M = 1 and overlap the rows' final reductions. Blocks start at multiples
// of 64, so only the row's last chunk may be partial: its codes past K load as 0 (decoded 0), as x's are.
template <int R, int M>
void dot_tile(const uint16_t* x, int64_t Kp, int64_t K, const uint8_t* w, float* out, int64_t ldo,
              const float* scale, int64_t KB, int64_t kblock, const Bf16Bytes& t) {
  __m512 total[R][M];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < M; i++) total[r][i] = _mm512_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += kblock, b++) {
    const int64_t k1 = std::min(K, k0 + kblock);
    __m512 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += kChunk) {
      const __mmask64 m = k1 - k >= kChunk ? ~__mmask64(0) : (__mmask64(1) << (k1 - k)) - 1;
      for (int r = 0; r < R; r++) {
        __m512i even, odd;
        e4m3x64_bf16(_mm512_maskz_loadu_epi8(m, w + r * K + k), t, even, odd);
        for (int i = 0; i < M; i++) {
          acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)even, (__m512bh)_mm512_loadu_si512(x + i * Kp + k));
          acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)odd, (__m512bh)_mm512_loadu_si512(x + i * Kp + k + 32));
        }
      }
    }
    for (int r = 0; r < R; r++) {
      const __m512 s = _mm512_set1_ps(scale[r * KB + b]);
      for (int i = 0; i < M; i++) total[r][i] = _mm512_fmadd_ps(acc[r][i], s, total[r][i]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < M; i++) out[i * ldo + r] = _mm512_reduce_add_ps(total[r][i]);
}

// Weight rows per tile for M rows of x: R x M <= 16 accumulators.
template <int M>
constexpr int kTileRows = M <= 4 ? 4 : M <= 8 ? 2 : 1;

// Weight rows [n0, n1) against m <= kMaxPass rows of x, in tiles of kTileRows<m> rows.
template <int M = 1>
void dot_rows(int m, const uint16_t* x, int64_t Kp, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
              float* out, int64_t ldo, const float* scale, int64_t KB, int64_t kblock, const Bf16Bytes& t) {
  if constexpr (M < kMaxPass) {
    if (m > M) return dot_rows<M + 1>(m, x, Kp, K, w, n0, n1, out, ldo, scale, KB, kblock, t);
  }
  constexpr int R = kTileRows<M>;
  int64_t n = n0;
  for (; n + R <= n1; n += R) dot_tile<R, M>(x, Kp, K, w + n * K, out + n, ldo, scale + n * KB, KB, kblock, t);
  for (; n < n1; n++) dot_tile<1, M>(x, Kp, K, w + n * K, out + n, ldo, scale + n * KB, KB, kblock, t);
}

}  // namespace

torch::Tensor fp8_gemv_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t kblock) {
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) % 8 == 0,
              "fp8_gemv_bf16: codes must be contiguous float8_e4m3fn [N, K], K a multiple of 8; got ",
              codes.scalar_type(), " ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  if (kblock <= 0) kblock = K;
  TORCH_CHECK(kblock == K || kblock % kChunk == 0, "fp8_gemv_bf16: kblock must be K (", K,
              ") or a multiple of 64, got ", kblock);
  const int64_t KB = (K + kblock - 1) / kblock;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * KB,
              "fp8_gemv_bf16: scales must be contiguous float32 [N, K / kblock] = [", N, ", ", KB, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "fp8_gemv_bf16: x must be float32 [T, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const torch::Tensor xc = x.contiguous();
  const int64_t T = x.size(0);
  auto y = torch::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const int64_t Kp = (K + kChunk - 1) / kChunk * kChunk;
  std::vector<uint16_t> xb(T * Kp);
  for (int64_t r = 0; r < T; r++) round_row(xc.data_ptr<float>() + r * K, K, Kp, xb.data() + r * Kp);
  const Bf16Bytes& tables = bf16_bytes();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scales.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kBlockRows, n1 = std::min(N, b1 * kBlockRows);
    for (int64_t r = 0; r < T; r += kMaxPass)
      dot_rows((int)std::min<int64_t>(kMaxPass, T - r), xb.data() + r * Kp, Kp, K, w, n0, n1, out + r * N, N, s,
               KB, kblock, tables);
  });
  return y;
}
#endif
