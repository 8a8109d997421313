// The vectorized paged decode attention shared by the float32 and bfloat16 caches (cpu_kernels.cpp) and the
// FP8 (E4M3) cache (fp8_attention.cpp): one kernel, templated on the cache's element type T (float; uint16_t
// bfloat16 bits or uint8_t E4M3 codes, decoded in registers as each row is loaded, so a bfloat16 cache is
// read at two bytes a value and an FP8 one at one).
//
// Shapes: as paged_decode_attention (cpu_kernels.cpp). An FP8 cache's value is code * scale, per kv head:
// the key scale folds into the query's softmax scale, the value scale into the final normalization.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#endif

namespace decode_attention {

// First context position a query at position lens - 1 reads with a sliding window (0: none).
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

// The checks both decode wrappers (paged_decode_attention, paged_decode_attention_fp8) run on every call,
// before any cache row is read: the caches' shapes agree, each row's length lies in 1 <= lens[r] <= L (the
// slot table's columns) and every slot it reads (positions window_start .. lens[r] - 1; padding past lens[r]
// is never read) lies in [0, S). O(rows + slots read): a min / max per row, one TORCH_CHECK per row.
//   q [R, H, D], k_cache / v_cache [KV, S, D], slots [R, L], lens [R]; the caller has checked the dtypes
//   (slots and lens int64) and that all are contiguous.
inline void check_decode_args(const char* name, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& lens,
                              int64_t window) {
  TORCH_CHECK(q.dim() == 3, name, ": q must be [R, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) >= 1, name, ": k_cache must be [KV, S, D] with KV >= 1, got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), name, ": v_cache must have k_cache's sizes ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, name, ": k_cache's head dim must be q's ", D, ", got ", k_cache.size(2));
  TORCH_CHECK(H % KV == 0, name, ": q's ", H, " heads must be a multiple of the cache's ", KV, " kv heads");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == R, name, ": slots must be [", R, ", L] (a row per query), got ",
              slots.sizes());
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == R, name, ": lens must be [", R, "], got ", lens.sizes());
  const int64_t L = slots.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lp[r];
    TORCH_CHECK(n >= 1 && n <= L, name, ": lens[", r, "] = ", n, ", expected 1 <= lens <= ", L,
                " (the slot table's columns)");
    const int64_t* row = sp + r * L;
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
    for (int64_t j = window_start(n, window); j < n; ++j) {
      lo = std::min(lo, row[j]);
      hi = std::max(hi, row[j]);
    }
    if (lo < 0 || hi >= S) {                                 // name the first bad entry
      int64_t j = window_start(n, window);
      while (row[j] >= 0 && row[j] < S) ++j;
      TORCH_CHECK(false, name, ": slot out of range: slots[", r, ", ", j, "] = ", row[j], ", expected 0 <= slot < ",
                  S, " (the cache's slots)");
    }
  }
}

// A sink logit's term in a softmax denominator whose scores were exponentiated relative to m:
// exp(sink - m), 0 without a sink (sink = -inf).
inline float sink_share(float sink, float m) {
  return sink == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(sink - m);
}

#if defined(__AVX512F__)
// Positions prefetched ahead: K/V rows come from DRAM in blocks scattered over the cache. Into L2
// (prefetcht2), not L1: measured on the project's machine kind, 30 layers x 64 requests at context 192 took
// 22-25 ms where prefetches into L1 (prefetcht0, 24 ahead) took 30-32 (the L1's few outstanding misses
// were the limit); distances 8-48 within 10%, and prefetching on into the next work item's first positions
// changed nothing measurable.
constexpr int64_t kAhead = 16;

// One row of D elements: D * sizeof(T) bytes, a prefetch per 64-byte line.
template <typename T, int64_t D>
inline void prefetch_row(const T* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(bytes + i, _MM_HINT_T2);
}

// 16 consecutive cache elements as float32 (unscaled).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 bfloat16 values (their bits) as float32, exactly: bfloat16 is float32's upper half.
inline __m512 load16(const uint16_t* p) {
  const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}

// 16 E4M3 codes as float32, exactly: the 7 magnitude bits go to float32's exponent and mantissa (bits
// 20..26), which reads as the value times 2^-120 for normals and subnormals alike; times 2^120 rebiases it,
// and the sign bit moves to bit 31. (0x7F / 0xFF are NaN in E4M3; the cache writers never store them.)
inline __m512 load16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// GB query heads (of one KV head) over one chunk of a request's context, head_dim D = 16 * DV: keys, then
// values, are streamed once for all GB heads (prefetched ahead: a context's blocks need not be adjacent).
// Writes, per head, the chunk's score maximum m, its sum of exp(score - m) l, and out = sum of
// exp(score - m) * v (unnormalized, unscaled by the value scale), for the combine step. scores: [GB, n].
template <typename T, int DV, int GB>
void attend_heads(const float* q, const T* k_head, const T* v_head, const int64_t* slots, int64_t n, float scale,
                  float* scores, float* out, float* m_out, float* l_out) {
  constexpr int64_t D = 16 * DV;
  __m512 qv[GB][DV];
  for (int h = 0; h < GB; ++h)
    for (int i = 0; i < DV; ++i) qv[h][i] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + 16 * i), _mm512_set1_ps(scale));
  float mx[GB];
  for (int h = 0; h < GB; ++h) mx[h] = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < n; ++l) {
    if (l + kAhead < n) {
      prefetch_row<T, D>(k_head + slots[l + kAhead] * D);
      prefetch_row<T, D>(v_head + slots[l + kAhead] * D);
    }
    const T* k = k_head + slots[l] * D;
    __m512 kv[DV];
    for (int i = 0; i < DV; ++i) kv[i] = load16(k + 16 * i);
    for (int h = 0; h < GB; ++h) {
      __m512 acc = _mm512_mul_ps(kv[0], qv[h][0]);
      for (int i = 1; i < DV; ++i) acc = _mm512_fmadd_ps(kv[i], qv[h][i], acc);
      const float sc = _mm512_reduce_add_ps(acc);
      scores[h * n + l] = sc;
      mx[h] = std::max(mx[h], sc);
    }
  }
  for (int h = 0; h < GB; ++h) {
    float* sh = scores + h * n;
    const __m512 m = _mm512_set1_ps(mx[h]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16) {
      const __mmask16 mask = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sh + l), m));
      _mm512_mask_storeu_ps(sh + l, mask, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    }
    m_out[h] = mx[h];
    l_out[h] = _mm512_reduce_add_ps(sum);
  }
  __m512 acc[GB][DV];
  for (int h = 0; h < GB; ++h)
    for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    const T* v = v_head + slots[l] * D;
    __m512 vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = load16(v + 16 * i);
    for (int h = 0; h < GB; ++h) {
      const __m512 p = _mm512_set1_ps(scores[h * n + l]);
      for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_fmadd_ps(p, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < GB; ++h)
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(out + h * D + 16 * i, acc[h][i]);
}

// All G heads of one KV head over one chunk, in passes of up to 12 accumulator registers' worth of heads.
template <typename T, int DV>
void attend_chunk(const float* q, const T* k_head, const T* v_head, const int64_t* slots, int64_t n, int64_t G,
                  float scale, float* scores, float* out, float* m_out, float* l_out) {
  constexpr int64_t D = 16 * DV, most = DV >= 8 ? 1 : 3;
  for (int64_t h = 0; h < G;) {
    const int64_t gb = std::min(most, G - h);
    const float* qh = q + h * D;
    float* oh = out + h * D;
    float *mh = m_out + h, *lh = l_out + h;
    switch (gb) {
      case 1: attend_heads<T, DV, 1>(qh, k_head, v_head, slots, n, scale, scores, oh, mh, lh); break;
      case 2: attend_heads<T, DV, 2>(qh, k_head, v_head, slots, n, scale, scores, oh, mh, lh); break;
      default: attend_heads<T, DV, most>(qh, k_head, v_head, slots, n, scale, scores, oh, mh, lh); break;
    }
    h += gb;
  }
}

// Whether chunked_decode_attention takes this head dim.
inline bool supports(int64_t D) { return D == 64 || D == 128; }

// Work items: (request, KV head, chunk of the context). With enough (request, KV head) pairs for the
// threads each pair is one chunk; otherwise (batch 1) every context is cut into 2 * threads chunks so all
// threads read keys and values from memory at once (flash-decoding), and the chunks' partial softmaxes
// are combined: out = sum_c exp(m_c - M) out_c / sum_c exp(m_c - M) l_c, M = max_c m_c.
// k_scale / v_scale [KV]: an FP8 cache's per-kv-head scales, nullptr for a float cache. D: 64 or 128.
template <typename T>
void chunked_decode_attention(const float* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* lp,
                              int64_t R, int64_t H, int64_t KV, int64_t S, int64_t L, int64_t D, float sc,
                              const float* k_scale, const float* v_scale, const float* sinks, int64_t window,
                              float* op) {
  const int64_t G = H / KV, threads = at::get_num_threads();
  const int64_t C = R * KV >= 2 * threads ? 1 : 2 * threads;
  std::vector<float> part_out(C == 1 ? 0 : R * KV * C * G * D), part_m(R * KV * C * G), part_l(R * KV * C * G);
  at::parallel_for(0, R * KV * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(3 * L);                       // up to 3 heads per pass
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t pair = idx / C, c = idx % C, r = pair / KV, h = pair % KV;
      const int64_t lo = window_start(lp[r], window), span = lp[r] - lo;
      const int64_t first = lo + span * c / C, last = lo + span * (c + 1) / C;
      const float head_scale = k_scale == nullptr ? sc : sc * k_scale[h];
      float* out = C == 1 ? op + (r * H + h * G) * D : part_out.data() + idx * G * D;
      const float* q = qp + (r * H + h * G) * D;
      const int64_t* slots = sp + r * L + first;
      if (D == 64)
        attend_chunk<T, 4>(q, kp + h * S * D, vp + h * S * D, slots, last - first, G, head_scale, scores.data(),
                           out, part_m.data() + idx * G, part_l.data() + idx * G);
      else
        attend_chunk<T, 8>(q, kp + h * S * D, vp + h * S * D, slots, last - first, G, head_scale, scores.data(),
                           out, part_m.data() + idx * G, part_l.data() + idx * G);
    }
  });
  at::parallel_for(0, R * KV, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t r = pair / KV, h = pair % KV;
      const float value_scale = v_scale == nullptr ? 1.f : v_scale[h];
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (r * H + h * G + g) * D;
        const float sink = sinks == nullptr ? -std::numeric_limits<float>::infinity() : sinks[h * G + g];
        if (C == 1) {
          const float inv = value_scale / (part_l[pair * G + g] + sink_share(sink, part_m[pair * G + g]));
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
          continue;
        }
        float M = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t c = 0; c < C; ++c) M = std::max(M, part_m[(pair * C + c) * G + g]);
        std::fill(o, o + D, 0.f);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t i = (pair * C + c) * G + g;
          if (part_l[i] == 0.f) continue;                       // empty chunk (context shorter than C)
          const float w = std::exp(part_m[i] - M);
          total += w * part_l[i];
          const float* oc = part_out.data() + i * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * oc[d];
        }
        const float inv = value_scale / (total + sink_share(sink, M));
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}
#endif

}  // namespace decode_attention
