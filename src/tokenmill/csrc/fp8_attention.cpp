// Paged decode attention reading an FP8 (E4M3) KV cache in place, so the cache is read at one byte a value:
// with AVX-512 and head dim 64 or 128, the float32 cache's vectorized kernel (decode_attention.h) with the
// codes decoded in registers as each row is loaded; otherwise each key / value row is decoded to float32 in
// a small buffer as it is reached, work split over (request, kv head) pairs. Either way the key scale folds
// into the softmax scale and the value scale multiplies each head's output once.
#include "fp8_attention.h"
#include "decode_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
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

at::Tensor paged_decode_attention_fp8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor slots, at::Tensor lens, double scale,
                                      at::Tensor k_scale, at::Tensor v_scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kByte &&
                  v_cache.scalar_type() == at::kByte, "paged_decode_attention_fp8: float32 q, uint8 caches");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat,
              "paged_decode_attention_fp8: float32 scales");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                  lens.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous(),
              "paged_decode_attention_fp8: contiguous inputs");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "paged_decode_attention_fp8: slots and lens must be int64, got ", slots.scalar_type(), " and ",
              lens.scalar_type());
  decode_attention::check_decode_args("paged_decode_attention_fp8", q, k_cache, v_cache, slots, lens, 0);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(0), S = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(k_scale.numel() == KV && v_scale.numel() == KV, "paged_decode_attention_fp8: k_scale and v_scale "
              "must be float32 [", KV, "] (one per kv head), got ", k_scale.sizes(), " and ", v_scale.sizes());
  const int64_t G = H / KV;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* kp = k_cache.data_ptr<uint8_t>();
  const uint8_t* vp = v_cache.data_ptr<uint8_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
  if (decode_attention::supports(D)) {
    decode_attention::chunked_decode_attention(qp, kp, vp, sp, lp, R, H, KV, S, L, D, sc, ks, vs, nullptr, 0, op);
    return out;
  }
#endif
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

namespace {

// One value's code: clamp(x / scale, +-448) as c10::Float8_e4m3fn rounds it (a NaN x clamps to -448, as
// std::max(-448, NaN) gives).
inline uint8_t encode_e4m3(float x, float scale) {
  return c10::Float8_e4m3fn(std::min(448.0f, std::max(-448.0f, x / scale))).x;
}

#if defined(__AVX512F__)
// 16 values' codes, bitwise encode_e4m3's: c10's rounding (fp8e4m3fn_from_fp32_value) on 16 lanes. Clamped to
// +-448, no input reaches its overflow and NaN branches; magnitudes below 2^-6 (E4M3's subnormals) round by
// one float32 addition of 2^(141 - 127), the rest by adding the rebiased exponent and half an E4M3 unit in the
// last place (ties to even) and taking bits 20..27.
inline __m128i encode16_e4m3(const float* x, __m512 scale) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x), scale),
                                                     _mm512_set1_ps(-448.f)), _mm512_set1_ps(448.f));
  const __m512i bits = _mm512_castps_si512(clamped);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i magnitude = _mm512_xor_si512(bits, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), _mm512_set1_epi32(1));
  const __m512i rebias = _mm512_set1_epi32(static_cast<int>((uint32_t(7 - 127) << 23) + 0x7FFFFu));
  const __m512i rebiased = _mm512_add_epi32(magnitude, rebias);
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(rebiased, odd), 20);
  const __m512i denorm = _mm512_set1_epi32(141 << 23);
  const __m512i subnormal = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(magnitude), _mm512_castsi512_ps(denorm))), denorm);
  const __mmask16 small = _mm512_cmplt_epu32_mask(magnitude, _mm512_set1_epi32(121 << 23));
  const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(small, normal, subnormal), _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(code);                        // the low byte of each lane
}
#endif

// D values of one row -> D codes.
inline void encode_row(const float* x, int64_t D, float scale, uint8_t* dst) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  for (; d + 16 <= D; d += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), encode16_e4m3(x + d, s));
#endif
  for (; d < D; ++d) dst[d] = encode_e4m3(x[d], scale);
}

void check_fp8_write_args(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scale,
                          const at::Tensor& slots) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "write_kv_cache_fp8: keys and values must be float32 [T, KV, D] with D contiguous");
  TORCH_CHECK(cache.element_size() == 1 && cache.dim() == 3 && cache.is_contiguous() &&
                  cache.size(0) == x.size(1) && cache.size(2) == x.size(2),
              "write_kv_cache_fp8: caches must be contiguous one-byte [KV, S, D] matching the keys");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == x.size(1),
              "write_kv_cache_fp8: scales must be float32 [KV]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
              "write_kv_cache_fp8: slots must be int64 [T]");
}

}  // namespace

void write_kv_cache_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                        const at::Tensor& v_scale) {
  check_fp8_write_args(k, k_cache, k_scale, slot_mapping);
  check_fp8_write_args(v, v_cache, v_scale, slot_mapping);
  TORCH_CHECK(v.sizes() == k.sizes(), "write_kv_cache_fp8: v must have k's sizes ", k.sizes(), ", got ", v.sizes());
  const int64_t T = k.size(0), KV = k.size(1), D = k.size(2), S = k_cache.size(1);
  TORCH_CHECK(v_cache.size(1) == S, "write_kv_cache_fp8: the key and value caches must hold as many slots");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "write_kv_cache_fp8: slot out of range: slots[", t, "] = ", slots[t],
                ", expected 0 <= slot < ", S, " (the cache's slots)");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *ks = k_scale.data_ptr<float>(), *vs = v_scale.data_ptr<float>();
  uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {  // no throwing inside the parallel region
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < KV; ++h) {
        encode_row(kp + t * k0 + h * k1, D, ks[h], kc + (h * S + slots[t]) * D);
        encode_row(vp + t * v0 + h * v1, D, vs[h], vc + (h * S + slots[t]) * D);
      }
  });
}
