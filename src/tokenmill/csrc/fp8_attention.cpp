// Paged decode attention reading an FP8 (E4M3) KV cache in place: each key / value row (D bytes) is decoded
// to float32 in a small buffer as it is reached, so the cache is read at one byte a value. Work is split
// over (request, kv head) pairs, each reading its rows once for all G query heads of its group. The key
// scale folds into the softmax scale; the value scale multiplies each head's output once.
#include "fp8_attention.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Every E4M3 code's value (0x7F / 0xFF: NaN, which the writer's clamp never produces).
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xF, m = c & 7;
      float v = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
      if ((c & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
      value[c] = (c & 0x80) ? -v : v;
    }
  }
};
const E4M3Table kE4M3;

}  // namespace

// row[0..D) = float32 of codes[0..D): 8 at a time by moving the 7 magnitude bits into float32's exponent and
// mantissa (times 2^120 rebiases the exponent, exactly, subnormals included) where AVX2 is there.
void decode_e4m3_row(const uint8_t* codes, int64_t D, float* row) {
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= D; d += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d)));
    const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
    _mm256_storeu_ps(row + d, _mm256_or_ps(value, _mm256_castsi256_ps(sign)));
  }
#endif
  for (; d < D; ++d) row[d] = kE4M3.value[codes[d]];
}

namespace {

// One request's G query heads against one kv head's n context rows.
//   q [G, D]; scores [G, n] and row [D] scratch; out [G, D]
void attend_fp8(const float* q, const uint8_t* k_head, const uint8_t* v_head, const int64_t* slots, int64_t n,
                int64_t G, int64_t D, float score_scale, float v_scale, float* scores, float* row, float* out) {
  std::vector<float> mx(G, -std::numeric_limits<float>::infinity()), inv(G);
  for (int64_t l = 0; l < n; ++l) {
    decode_e4m3_row(k_head + slots[l] * D, D, row);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
      s *= score_scale;
      scores[g * n + l] = s;
      if (s > mx[g]) mx[g] = s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float sum = 0.f, *sg = scores + g * n;
    for (int64_t l = 0; l < n; ++l) sum += (sg[l] = std::exp(sg[l] - mx[g]));
    inv[g] = v_scale / sum;                       // softmax normalization and the value scale at once
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t l = 0; l < n; ++l) {
    decode_e4m3_row(v_head + slots[l] * D, D, row);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + l] * inv[g];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * row[d];
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention_fp8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor slots, torch::Tensor lens, double scale,
                                         torch::Tensor k_scale, torch::Tensor v_scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kUInt8 &&
                  v_cache.scalar_type() == torch::kUInt8, "paged_decode_attention_fp8: float32 q, uint8 caches");
  TORCH_CHECK(k_scale.scalar_type() == torch::kFloat32 && v_scale.scalar_type() == torch::kFloat32,
              "paged_decode_attention_fp8: float32 scales");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                  lens.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous(),
              "paged_decode_attention_fp8: contiguous inputs");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(0), S = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(H % KV == 0 && k_cache.size(2) == D && slots.size(0) == R && lens.size(0) == R &&
              k_scale.numel() == KV && v_scale.numel() == KV);
  const int64_t G = H / KV;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* kp = k_cache.data_ptr<uint8_t>();
  const uint8_t* vp = v_cache.data_ptr<uint8_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L), row(D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / KV, h = idx % KV, offset = (r * H + h * G) * D;
      attend_fp8(qp + offset, kp + h * S * D, vp + h * S * D, sp + r * L, lp[r], G, D, sc * ks[h], vs[h],
                 scores.data(), row.data(), op + offset);
    }
  });
  return out;
}
