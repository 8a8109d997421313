// Paged decode attention on the CPU: one query token per request, keys and values read in place from
// the paged cache (no gather copy), softmax over each request's own context length.
//
// Shapes (contiguous; q float32, the caches float32 or bfloat16):
//   q        [R, H, D]      one query token per request; H = KV * G (grouped-query attention)
//   k_cache  [KV, S, D]     head-major paged cache, S = num_blocks * block_size slots
//   v_cache  [KV, S, D]
//   slots    [R, L] int64   cache slot of each context position (row r valid up to lens[r])
//   lens     [R]    int64   context length of each request, 1 <= lens[r] <= L
//   sinks    [H] float32 or None: a learned logit per head that joins each softmax and gives no value
//            (gpt-oss): out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m))
//   window   0, or the keys a query reads back (its own included): the last min(lens[r], window) positions
// Returns [R, H, D]. Work is split over (request, kv head) pairs, each reading its keys and values once for
// all G query heads of the group; with AVX-512 and head_dim 64 or 128, vectorized, and at batch sizes too
// small for the threads, over chunks of the context (decode_attention.h, shared with the FP8 cache's kernel).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "decode_layer.h"
#include "gemv_kernels.h"
#include "greedy_head.h"
#include "prefill_attention.h"
#include "moe_kernels.h"
#include "fp8_attention.h"
#include "fp8_gemv.h"
#include "amx_tiles.h"
#include "tile_widen.h"
#include "decode_attention.h"

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#endif

namespace {

using decode_attention::sink_share;
using decode_attention::window_start;

// A cached element as float32: a float32 cache's as is, a bfloat16 cache's bits (uint16_t) widened exactly.
inline float cached(float x) { return x; }
inline float cached(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
void attend_one(const float* q, const T* k_head, const T* v_head, const int64_t* slots,
                int64_t n, int64_t G, int64_t D, float scale, const float* sinks, float* scores, float* out) {
  // scores [G, n], out [G, D]
  std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < n; ++l) {
    const T* k = k_head + slots[l] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * cached(k[d]);
      s *= scale;
      scores[g * n + l] = s;
      if (s > mx[g]) mx[g] = s;
    }
  }
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {
    float sum = 0.f;
    float* sg = scores + g * n;
    for (int64_t l = 0; l < n; ++l) {
      sg[l] = std::exp(sg[l] - mx[g]);
      sum += sg[l];
    }
    inv[g] = 1.f / (sum + (sinks == nullptr ? 0.f : sink_share(sinks[g], mx[g])));
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t l = 0; l < n; ++l) {
    const T* v = v_head + slots[l] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + l] * inv[g];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * cached(v[d]);
    }
  }
}

// out [R, H, D] from caches of element type T (float, or uint16_t bfloat16 bits); arguments checked.
template <typename T>
void decode_from_cache(const float* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* lp, int64_t R,
                       int64_t H, int64_t KV, int64_t S, int64_t L, int64_t D, float sc, const float* sinks,
                       int64_t window, float* op) {
#if defined(__AVX512F__)
  if (decode_attention::supports(D)) {
    decode_attention::chunked_decode_attention(qp, kp, vp, sp, lp, R, H, KV, S, L, D, sc, nullptr, nullptr, sinks,
                                               window, op);
    return;
  }
#endif
  // Portable path: one work item per (request, KV head), reading its keys and values once for all G heads.
  const int64_t G = H / KV;
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / KV, h = idx % KV;
      const int64_t offset = (r * H + h * G) * D, lo = window_start(lp[r], window);
      attend_one(qp + offset, kp + h * S * D, vp + h * S * D, sp + r * L + lo, lp[r] - lo, G, D, sc,
                 sinks == nullptr ? nullptr : sinks + h * G, scores.data(), op + offset);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor slots, torch::Tensor lens, double scale,
                                     c10::optional<torch::Tensor> sinks, int64_t window) {
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (bf16 || k_cache.scalar_type() == torch::kFloat32),
              "paged_decode_attention: float32 q, and float32 or bfloat16 caches of one dtype; got q ",
              q.scalar_type(), ", caches ", k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  slots.is_contiguous() && lens.is_contiguous(), "paged_decode_attention: contiguous inputs");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: slots and lens must be int64, got ", slots.scalar_type(), " and ",
              lens.scalar_type());
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0 (0: none), got ", window);
  decode_attention::check_decode_args("paged_decode_attention", q, k_cache, v_cache, slots, lens, window);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(0), S = k_cache.size(1), L = slots.size(1);
  const float* sp_sinks = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == H,
                "paged_decode_attention: sinks must be float32 [", H, "] (one per query head)");
    sp_sinks = sinks->data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  if (bf16)
    decode_from_cache(qp, static_cast<const uint16_t*>(k_cache.data_ptr()),
                      static_cast<const uint16_t*>(v_cache.data_ptr()), sp, lp, R, H, KV, S, L, D, sc, sp_sinks,
                      window, op);
  else
    decode_from_cache(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, lp, R, H, KV, S, L, D, sc,
                      sp_sinks, window, op);
  return out;
}

// Write new tokens' keys and values into their cache slots.
//   k, v      [T, KV, D] float32 (any row stride; last dim contiguous)
//   k_cache   [KV, S, D] float32 or bfloat16 (rounded to nearest even, as torch's .to(torch.bfloat16)),
//             contiguous;  slots [T] int64
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slots) {
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
                  k_cache.scalar_type() == v_cache.scalar_type() && (bf16 || k_cache.scalar_type() == torch::kFloat32),
              "write_kv_cache: float32 keys and values, float32 or bfloat16 caches of one dtype; got ",
              k.scalar_type(), " / ", v.scalar_type(), " into ", k_cache.scalar_type(), " / ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                  slots.scalar_type() == torch::kInt64, "write_kv_cache: contiguous caches, int64 slots");
  TORCH_CHECK(k.dim() == 3, "write_kv_cache: k must be [T, KV, D], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "write_kv_cache: v must have k's sizes ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv_cache: head_dim must be contiguous");
  TORCH_CHECK(k_cache.dim() == 3, "write_kv_cache: k_cache must be [KV, S, D], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "write_kv_cache: v_cache must have k_cache's sizes ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t T = k.size(0), KV = k.size(1), D = k.size(2), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(0) == KV && k_cache.size(2) == D, "write_kv_cache: k [T, KV, D] = ", k.sizes(),
              " must match the cache's [KV, S, D] = ", k_cache.sizes(), " in kv heads and head dim");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == T, "write_kv_cache: slots must be [", T,
              "] (one per token of k), got ", slots.sizes());
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "write_kv_cache: slot out of range: slots[", t, "] = ", sp[t],
                ", expected 0 <= slot < ", S, " (the cache's slots)");
  const auto write_rows = [&](auto* kc, auto* vc, auto store) {
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {  // no throwing inside the parallel region
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = sp[t];
        for (int64_t h = 0; h < KV; ++h) {
          store(kp + t * ks0 + h * ks1, kc + (h * S + slot) * D);
          store(vp + t * vs0 + h * vs1, vc + (h * S + slot) * D);
        }
      }
    });
  };
  if (bf16)
    write_rows(static_cast<c10::BFloat16*>(k_cache.data_ptr()), static_cast<c10::BFloat16*>(v_cache.data_ptr()),
               [D](const float* x, c10::BFloat16* dst) { for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(x[d]); });
  else
    write_rows(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
               [D](const float* x, float* dst) { std::copy_n(x, D, dst); });
}

// Rotary embedding in place, Hugging Face "rotate half" layout: for i < D/2,
//   x[i] <- x[i] cos_i - x[i + D/2] sin_i,   x[i + D/2] <- x[i + D/2] cos_i + x[i] sin_i.
//   x [T, H, D] float32 (any token/head strides; last dim contiguous); cos, sin [T, D/2] contiguous.
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 && cos.is_contiguous() &&
                  sin.is_contiguous(), "rotary_inplace: float32 with contiguous head_dim");
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == half && sin.numel() == cos.numel());
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) {
        float* a = xp + t * s0 + h * s1;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// SwiGLU activation: x [T, 2I] = [gate | up] (last dim contiguous) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "silu_and_mul: float32 [T, 2I] with contiguous rows");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * s0;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= I; i += 16) {   // g / (1 + exp(-g)) * u; exp16 saturates to inf for g < -87: -0
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                              _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// RMSNorm over the last dim, float32: out = x / sqrt(mean(x^2) + eps) * weight.
// With a residual: residual <- residual + x (in place) first, and the sum is normalized instead.
//   x [T, H] (contiguous rows), residual [T, H] contiguous or None, weight [H]. Returns out [T, H].
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                       double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
                  weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "rms_norm: float32 x [T, H] and weight [H]");
  const int64_t T = x.size(0), H = x.size(1), ldx = x.stride(0);
  float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == torch::kFloat32 && residual->is_contiguous() &&
                    residual->size(0) == T && residual->size(1) == H, "rms_norm: residual must match x");
    rp = residual->data_ptr<float>();
  }
  auto out = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = xp + t * ldx;
      if (rp != nullptr) {
        float* r = rp + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) r[i] += src[i];
        src = r;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
      float* o = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = src[i] * inv * wp[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_inplace", &rotary_inplace, "rotary embedding in place (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU, float32)");
  m.def("write_kv_cache", &write_kv_cache,
        "write new keys/values (float32) into the paged cache (float32, or bfloat16 rounded to nearest even; CPU)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention (CPU; float32 q, float32 or bfloat16 cache), optionally with a sink logit per head "
        "and a sliding window",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("lens"), py::arg("scale"),
        py::arg("sinks") = py::none(), py::arg("window") = 0);
  m.def("write_kv_cache_fp8", &write_kv_cache_fp8,
        "write new keys/values into an FP8 (E4M3) paged cache, scaled per kv head (CPU, float32 in)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("k_scale"),
        py::arg("v_scale"));
  m.def("paged_decode_attention_fp8", &paged_decode_attention_fp8,
        "paged decode attention over an FP8 (E4M3) KV cache with per-kv-head scales (CPU)");
  m.def("prefill_attention_supports", &prefill_attention_supports, "whether prefill_attention takes this head_dim");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of prefill chunks from the paged cache (float32, bfloat16, or E4M3 codes with k_scale / "
        "v_scale), "
        "into out's rows (CPU)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("seqs"),
        py::arg("slots"), py::arg("scale"), py::arg("out"), py::arg("sinks") = py::none(), py::arg("window") = 0,
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding the residual in place first (CPU, float32)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init([](torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping, torch::Tensor decode_slots,
                       torch::Tensor decode_lens) {
             return DecodeStep{cos, sin, slot_mapping, decode_slots, decode_lens};
           }),
           py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"), py::arg("decode_slots"), py::arg("decode_lens"));
  py::class_<LargeLinear>(m, "LargeLinear")
      .def(py::init([](std::string kind, torch::Tensor weight) { return LargeLinear{kind, weight}; }),
           py::arg("kind"), py::arg("weight"));
  py::class_<DecodeLinear>(m, "DecodeLinear")
      .def(py::init<std::string, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    int64_t, int64_t, LargeLinear, int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("bias"), py::arg("out_features"),
           py::arg("small_rows"), py::arg("large"), py::arg("kblock") = 0)
      .def("__call__", &DecodeLinear::operator(), "x [T, K] float32 -> [T, N], the kernel Linear.forward picks")
      .def("max_rows", &DecodeLinear::max_rows);
  py::class_<DecodeLayer>(m, "DecodeLayer")
      .def(py::init<torch::Tensor, torch::Tensor, double, DecodeLinear, DecodeLinear, DecodeLinear, DecodeLinear,
                    int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o_proj"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("scale"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale") = py::none(),
           py::arg("v_scale") = py::none())
      .def("forward", &DecodeLayer::forward, "one decoder layer for a decode step (decode_layer.cpp)")
      .def("max_rows", &DecodeLayer::max_rows, "the most rows a decode step may have");
#ifdef TOKENMILL_MOE_KERNELS   // AVX2 + FMA builds; Python checks hasattr(module, "moe_grouped_gemm")
  m.def("moe_grouped_gemm", &moe_grouped_gemm, "rows sorted by expert x each expert's [N, K] weight (CPU)",
        py::arg("x"), py::arg("run_starts"), py::arg("w"), py::arg("scale"), py::arg("kblock") = 0,
        py::arg("row_scale") = py::none());
  m.def("fp8_dequantize", &fp8_dequantize, "FP8 codes [N, K] x scales [N, K / kblock] -> float32 [N, K] (CPU)",
        py::arg("codes"), py::arg("scales"), py::arg("kblock"));
#ifdef TOKENMILL_FP8_BF16   // AVX-512 BF16 builds; Python checks hasattr(module, "fp8_linear_bf16")
  m.def("fp8_linear_bf16", &fp8_linear_bf16, "x @ (FP8 codes x scales)^T through a bfloat16 GEMM -> float32 (CPU)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("kblock"));
#endif
#endif
#ifdef TOKENMILL_FP8_GEMV_BF16   // AVX-512 BF16 builds; Python checks hasattr(module, "fp8_gemv_bf16")
  m.def("fp8_gemv_bf16", &fp8_gemv_bf16, "x @ (FP8 codes x scales)^T for a few rows: bfloat16 products, "
        "float32 sums (CPU)", py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("kblock"));
#endif
#ifdef TOKENMILL_FP8_GEMV_F16   // AVX-512 FP16 builds; Python checks hasattr(module, "fp8_gemv_f16")
  m.def("fp8_gemv_f16", &fp8_gemv_f16, "x @ (FP8 codes x scales)^T for a few rows: fp16 products and short fp16 "
        "sums, float32 totals (CPU)", py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("kblock"));
#endif
#ifdef TOKENMILL_GEMV_KERNELS   // AVX-512 VNNI builds only; Python checks hasattr(module, "gemv_q4")
    m.def("gemv_f32", &gemv_f32, "x @ w^T, float32 tiles of 16 rows (CPU)", py::arg("x"), py::arg("w"), py::arg("N"));
    m.def("gemv_q8", &gemv_q8, "x @ (q * scale)^T, int8 tiles of 16 rows x 32 inputs, a scale per row (CPU)",
          py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("N"));
    m.def("gemv_q4", &gemv_q4, "x @ (d * q4 + m)^T, q4 tiles of 16 rows x 32 inputs (CPU)", py::arg("x"),
          py::arg("q"), py::arg("N"));
    m.def("gemv_nvfp4", &gemv_nvfp4, "x @ (e2m1 * e4m3 * row_scale)^T, NVFP4 tiles of 16 rows x 32 inputs (CPU)",
          py::arg("x"), py::arg("q"), py::arg("row_scale"), py::arg("N"));
#endif
#ifdef TOKENMILL_AMX_TILES   // AMX-BF16 builds; Python checks hasattr(module, "set_amx_min_rows")
    m.def("amx_min_rows", &amx_min_rows, "q4 / q8 tile steps of at least this many rows run on AMX (0: never)");
    m.def("set_amx_min_rows", &set_amx_min_rows, "q4 / q8 tile steps of at least `rows` rows run on AMX (0: never)",
          py::arg("rows"));
    m.def("amx_tiles_take", &amx_tiles_take, "whether a q4 / q8 tile step of M rows runs on AMX", py::arg("M"));
#endif
#ifdef TOKENMILL_TILE_WIDEN   // with the tile kernels; Python checks hasattr(module, "linear_tiles_bf16")
    m.def("q4_tiles_to_bf16", &q4_tiles_to_bf16, "q4 tiles -> the weight they hold, transposed: [K, N] bfloat16",
          py::arg("q"), py::arg("N"));
    m.def("q8_tiles_to_bf16", &q8_tiles_to_bf16, "q8 tiles and row scales -> the weight, transposed: [K, N] bfloat16",
          py::arg("q"), py::arg("scale"), py::arg("N"));
    m.def("linear_tiles_bf16", &linear_tiles_bf16, "x @ w^T for q4 / q8 tiles through one bfloat16 GEMM -> float32",
          py::arg("x"), py::arg("kind"), py::arg("q"), py::arg("scale"), py::arg("N"));
#endif
#ifdef TOKENMILL_GREEDY_HEAD   // AVX-512 VNNI builds only; Python checks hasattr(module, "greedy_head")
    m.def("greedy_head", &greedy_head,
          "exact argmax_j w_j . x per row: int8 screen with the largest inputs apart, double-precision recheck of "
          "the candidates; returns (tokens [M] int64, -1 where not screened; candidates checked [M] int64)",
          py::arg("x"), py::arg("q8_tiles"), py::arg("scales"), py::arg("qsums"), py::arg("f32_tiles"), py::arg("norms"),
          py::arg("err_norms"), py::arg("norm_max"), py::arg("N"),
          py::arg("banned"), py::arg("workspace"));
    m.def("greedy_head_outliers", &greedy_head_outliers, "inputs of largest |x| per step the screen takes in float32");
#endif
}
