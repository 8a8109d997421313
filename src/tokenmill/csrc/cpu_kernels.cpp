// Paged decode attention on the CPU: one query token per request, keys and values read in place from
// the paged cache (no gather copy), softmax over each request's own context length.
//
// Shapes (float32, contiguous):
//   q        [R, H, D]      one query token per request; H = KV * G (grouped-query attention)
//   k_cache  [KV, S, D]     head-major paged cache, S = num_blocks * block_size slots
//   v_cache  [KV, S, D]
//   slots    [R, L] int64   cache slot of each context position (row r valid up to lens[r])
//   lens     [R]    int64   context length of each request, 1 <= lens[r] <= L
// Returns [R, H, D]. Work is split over (request, kv head) pairs; each pair reads its keys and values once
// for all G query heads of the group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

void attend_one(const float* q, const float* k_head, const float* v_head, const int64_t* slots,
                int64_t n, int64_t G, int64_t D, float scale, float* scores, float* out) {
  // scores [G, n], out [G, D]
  std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < n; ++l) {
    const float* k = k_head + slots[l] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
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
    inv[g] = 1.f / sum;
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t l = 0; l < n; ++l) {
    const float* v = v_head + slots[l] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + l] * inv[g];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * v[d];
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor slots, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  slots.is_contiguous() && lens.is_contiguous(), "paged_decode_attention: contiguous inputs");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(0), S = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(H % KV == 0 && k_cache.size(2) == D && slots.size(0) == R && lens.size(0) == R);
  const int64_t G = H / KV;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / KV, h = idx % KV;
      const int64_t n = lp[r];
      const int64_t offset = (r * H + h * G) * D;
      attend_one(qp + offset, kp + h * S * D, vp + h * S * D, sp + r * L, n, G, D, sc, scores.data(),
                 op + offset);
    }
  });
  return out;
}

// Write new tokens' keys and values into their cache slots.
//   k, v      [T, KV, D] float32 (any row stride; last dim contiguous)
//   k_cache   [KV, S, D] float32 contiguous;  slots [T] int64
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slots) {
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
                  k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "write_kv_cache: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                  slots.scalar_type() == torch::kInt64, "write_kv_cache: contiguous caches, int64 slots");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv_cache: head_dim must be contiguous");
  const int64_t T = k.size(0), KV = k.size(1), D = k.size(2), S = k_cache.size(1);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "write_kv_cache: slot out of range");
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {  // no throwing inside the parallel region
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      for (int64_t h = 0; h < KV; ++h) {
        std::copy_n(kp + t * ks0 + h * ks1, D, kc + (h * S + slot) * D);
        std::copy_n(vp + t * vs0 + h * vs1, D, vc + (h * S + slot) * D);
      }
    }
  });
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
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_inplace", &rotary_inplace, "rotary embedding in place (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU, float32)");
  m.def("write_kv_cache", &write_kv_cache, "write new keys/values into the paged cache (CPU, float32)");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
