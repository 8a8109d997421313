// Causal attention for prefill chunks on the CPU (float32, head_dim 64 or 128), keys and values read from
// the paged cache (the step wrote its new ones first), several requests per call.
//
//   q        [T, H, D]  the step's query rows (contiguous), H = KV * G (grouped-query attention)
//   k_cache  [KV, S, D] head-major paged cache; v_cache the same
//   seqs     [B, 3] int64, per request: its first query row t0, its query count n, its context length c.
//            Query i (row t0 + i) is position c - n + i and attends to positions 0 .. c - n + i.
//   slots    [B, L] int64: cache slot of each context position (row b valid up to c_b)
//   out      [T, H, D]  the listed requests' rows are written, other rows are left as they are
//   sinks    [H] float32 or None: a logit per head that joins every softmax and gives no value (gpt-oss)
//   window   0, or the keys a query reads back, its own included: positions p - window + 1 .. p
//   An FP8 cache: k_cache / v_cache uint8 E4M3 codes with k_scale, v_scale [KV] float32 (a cached value is
//   code x scale). Keys are decoded as they are gathered (the key scale folds into the score scale), values
//   into a per-item buffer (the value scale into the softmax's normalizer), so the cache is read at a byte
//   a value and the arithmetic is float32's. A bfloat16 cache: k_cache / v_cache bfloat16, no scales, read
//   the same way (each value widened to float32 exactly).
//
// Why not torch's scaled_dot_product_attention: for one 128-token prompt of the default model (9 heads of
// 64) it takes 330 us (about 30 GFLOP/s), 7% of an offline prefill step. Here work items are (request, KV
// head, block of kQueryBlock queries): each gathers the keys its block can see once, transposed in steps of
// 32 keys (so 16 keys' scores are one FMA per input), then for each of the G heads sharing them, in tiles of kRows
// queries: scores (kRows x 32 keys per pass), the causal softmax (exp16), and out = P V with the value rows
// read in place from the cache.
#include "prefill_attention.h"

#if defined(__AVX512F__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "fp8_attention.h"
#include "simd_math.h"

namespace {

constexpr int64_t kQueryBlock = 32, kKeyStep = 32, kRows = 8;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// row[0..D) = float32 of bfloat16 bits[0..D), exactly (the decode kernel's load16); D a multiple of 16.
void widen_bf16_row(const uint16_t* bits, int64_t D, float* row) {
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(row + d, decode_attention::load16(bits + d));
}

// s[r, 0 .. nk) = scale * q_r . k_j for QR query rows, nk a multiple of kKeyStep; kt [keys / kKeyStep, D,
// kKeyStep]: each step's keys transposed, side by side (one contiguous block per step).
template <int DV, int QR>
void scores(const float* const* q, const float* kt, int64_t nk, float scale, float* s, int64_t lds) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < nk; j += kKeyStep) {
    __m512 acc[QR][2];
    for (int r = 0; r < QR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* block = kt + j * 16 * DV;
    for (int64_t d = 0; d < 16 * DV; ++d) {
      const __m512 k0 = _mm512_loadu_ps(block + d * kKeyStep), k1 = _mm512_loadu_ps(block + d * kKeyStep + 16);
      for (int r = 0; r < QR; ++r) {
        const __m512 qd = _mm512_set1_ps(q[r][d]);
        acc[r][0] = _mm512_fmadd_ps(k0, qd, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(k1, qd, acc[r][1]);
      }
    }
    for (int r = 0; r < QR; ++r) {
      _mm512_storeu_ps(s + r * lds + j, _mm512_mul_ps(acc[r][0], sc));
      _mm512_storeu_ps(s + r * lds + j + 16, _mm512_mul_ps(acc[r][1], sc));
    }
  }
}

// The lanes j .. j + 15 of a row that lie in [lo, valid).
inline __mmask16 lanes_in(int64_t j, int64_t lo, int64_t valid) {
  const int64_t below = std::clamp<int64_t>(lo - j, 0, 16), upto = std::clamp<int64_t>(valid - j, 0, 16);
  const uint32_t keep = (upto == 16 ? 0xFFFFu : (1u << upto) - 1) & ~((below == 16 ? 0xFFFFu : (1u << below) - 1));
  return static_cast<__mmask16>(keep);
}

// Row s[0 .. nk) -> exp(s_j - m) for lo <= j < valid, 0 elsewhere, m = max(those scores, sink); returns the
// sum plus exp(sink - m) (sink = -inf: none).
float softmax_row(float* s, int64_t lo, int64_t valid, int64_t nk, float sink) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = lo / 16 * 16; j < valid; j += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lanes_in(j, lo, valid), s + j));
  const float top = std::max(_mm512_reduce_max_ps(mx), sink);
  const __m512 m = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(lanes_in(j, lo, valid), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum);
  return sink == -std::numeric_limits<float>::infinity() ? total : total + std::exp(sink - top);
}

// out_r = sum_j p[r, j] v_j / l_r for QR rows, j < nk (p zero past each row's own keys).
template <int DV, int QR>
void weighted_values(const float* p, int64_t ldp, int64_t nk, const float* v_head, const int64_t* slots,
                     const float* l, float* const* out) {
  __m512 acc[QR][DV];
  for (int r = 0; r < QR; ++r)
    for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    const float* v = v_head + slots[j] * 16 * DV;
    __m512 vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = _mm512_loadu_ps(v + 16 * i);
    for (int r = 0; r < QR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * ldp + j]);
      for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_fmadd_ps(pj, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < QR; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(out[r] + 16 * i, _mm512_mul_ps(acc[r][i], inv));
  }
}

struct Item {
  int64_t b, h, i0, i1;            // request, KV head, its queries i0 .. i1
};

struct Problem {
  const float *q, *k, *v;          // k, v: a float32 cache (nullptr for an FP8 or bfloat16 one)
  const uint8_t *k8, *v8;          // an FP8 cache's codes (else nullptr)
  const uint16_t *k16, *v16;       // a bfloat16 cache's bits (else nullptr)
  const float *k_scale, *v_scale;  // [KV]: an FP8 cache's scales
  float* out;
  const int64_t *seqs, *slots;
  int64_t H, KV, S, L, G;
  float scale;
  const float* sinks;              // [H] or nullptr
  int64_t window;                  // 0: none
};

// One item, head dim 16 DV. kt: scratch for the transposed keys, s: [kRows, ...] scratch for scores.
// Scratch of one thread: transposed keys, score rows, and (FP8 cache) decoded values with their row indices.
struct Scratch {
  std::vector<float> kt, s, v, row;
  std::vector<int64_t> v_rows;
};

template <int DV>
void run_item(const Problem& pb, const Item& it, Scratch& sc) {
  std::vector<float>& kt = sc.kt;
  std::vector<float>& s = sc.s;
  constexpr int64_t D = 16 * DV;
  constexpr int QV = DV >= 8 ? 2 : kRows;       // value accumulators: QV x DV of the 32 registers
  const int64_t t0 = pb.seqs[3 * it.b], n = pb.seqs[3 * it.b + 1], c = pb.seqs[3 * it.b + 2];
  const int64_t first = c - n;                  // position of query 0
  // Keys k0 .. first + i1 - 1 are the ones the block's queries read (k0 > 0 only with a window); kt and the
  // score rows index them from k0.
  const int64_t k0 = pb.window > 0 ? std::max<int64_t>(0, first + it.i0 - pb.window + 1) : 0;
  const int64_t keys = first + it.i1 - k0, ldk = round_up(keys, kKeyStep);
  const int64_t* slots = pb.slots + it.b * pb.L + k0;
  const bool fp8 = pb.k8 != nullptr, decoded = fp8 || pb.k16 != nullptr;   // decoded: rows widened to float32
  // row `slot` of kv head it.h of an FP8 / bfloat16 cache (the key cache, else the value cache) -> dst [D]
  const auto decode_row = [&](bool key_cache, int64_t slot, float* dst) {
    const int64_t at = (it.h * pb.S + slot) * D;
    if (fp8) decode_e4m3_row((key_cache ? pb.k8 : pb.v8) + at, D, dst);
    else widen_bf16_row((key_cache ? pb.k16 : pb.v16) + at, D, dst);
  };
  const float* v_head = decoded ? nullptr : pb.v + it.h * pb.S * D;
  const int64_t* v_slots = slots;
  float score_scale = pb.scale, value_scale = 1.f;
  kt.assign(D * ldk, 0.f);                      // [ldk / kKeyStep, D, kKeyStep], keys past `keys` zero
  if (decoded) sc.row.resize(D);
  for (int64_t j = 0; j < keys; ++j) {
    const float* kr = decoded ? sc.row.data() : pb.k + (it.h * pb.S + slots[j]) * D;
    if (decoded) decode_row(true, slots[j], sc.row.data());
    float* col = kt.data() + (j / kKeyStep) * D * kKeyStep + j % kKeyStep;
    for (int64_t d = 0; d < D; ++d) col[d * kKeyStep] = kr[d];
  }
  if (decoded) {                                // values decoded once for the G heads; row j = key k0 + j
    sc.v.resize(keys * D);
    sc.v_rows.resize(keys);
    for (int64_t j = 0; j < keys; ++j) {
      decode_row(false, slots[j], sc.v.data() + j * D);
      sc.v_rows[j] = j;
    }
    v_head = sc.v.data();
    v_slots = sc.v_rows.data();
  }
  if (fp8) {
    score_scale *= pb.k_scale[it.h];
    value_scale = pb.v_scale[it.h];
  }
  s.resize(kRows * ldk);
  for (int64_t g = 0; g < pb.G; ++g) {
    const int64_t head = it.h * pb.G + g;
    const float sink = pb.sinks == nullptr ? -std::numeric_limits<float>::infinity() : pb.sinks[head];
    for (int64_t r0 = it.i0; r0 < it.i1; r0 += kRows) {
      const int64_t rows = std::min(kRows, it.i1 - r0);
      const int64_t nk = round_up(first + r0 + rows - k0, kKeyStep);     // keys of the tile's last query
      const float* q[kRows];
      float* o[kRows];
      float l[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = t0 + r0 + std::min(r, rows - 1);             // padding rows repeat the last
        q[r] = pb.q + (row * pb.H + head) * D;
        o[r] = pb.out + (row * pb.H + head) * D;
      }
      scores<DV, kRows>(q, kt.data(), nk, score_scale, s.data(), ldk);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t upto = first + r0 + r + 1;                         // past the row's own position
        const int64_t from = pb.window > 0 ? std::max<int64_t>(0, upto - pb.window) : 0;
        l[r] = softmax_row(s.data() + r * ldk, from - k0, upto - k0, nk, sink) / value_scale;
      }
      const int64_t used = first + r0 + rows - k0;                       // keys any row of the tile sees
      for (int64_t r = 0; r < rows; r += QV) {
        if (rows - r >= QV) {
          weighted_values<DV, QV>(s.data() + r * ldk, ldk, used, v_head, v_slots, l + r, o + r);
        } else {
          for (int64_t e = r; e < rows; ++e)
            weighted_values<DV, 1>(s.data() + e * ldk, ldk, used, v_head, v_slots, l + e, o + e);
        }
      }
    }
  }
}

}  // namespace

bool prefill_attention_supports(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

void prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor seqs,
                       at::Tensor slots, double scale, at::Tensor out, c10::optional<at::Tensor> sinks,
                       int64_t window, c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  const bool fp8 = k_cache.scalar_type() == at::kByte, bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || fp8 || bf16),
              "prefill_attention: float32 q and out, caches float32, bfloat16 or uint8 (E4M3 codes)");
  TORCH_CHECK(fp8 == k_scale.has_value() && fp8 == v_scale.has_value(),
              "prefill_attention: an FP8 (uint8) cache needs k_scale and v_scale, a float32 or bfloat16 one none");
  if (fp8)
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->is_contiguous() && v_scale->is_contiguous() && k_scale->numel() == k_cache.size(0) &&
                    v_scale->numel() == k_cache.size(0),
                "prefill_attention: k_scale and v_scale must be float32 [", k_cache.size(0), "] (one per kv head)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  seqs.is_contiguous() && slots.is_contiguous(), "prefill_attention: contiguous inputs");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && seqs.dim() == 2 &&
                  seqs.size(1) == 3 && slots.dim() == 2 && slots.size(0) == seqs.size(0),
              "prefill_attention: seqs [B, 3] and slots [B, L] int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(prefill_attention_supports(D) && H % KV == 0 && k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes() &&
                  out.sizes() == q.sizes(), "prefill_attention: q [T, H, D] (D 64 or 128), caches [KV, S, D], out as q");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == H),
              "prefill_attention: sinks must be float32 [", H, "] (one per query head)");
  const bool f32 = !fp8 && !bf16;
  const Problem pb{q.data_ptr<float>(), f32 ? k_cache.data_ptr<float>() : nullptr,
                   f32 ? v_cache.data_ptr<float>() : nullptr, fp8 ? k_cache.data_ptr<uint8_t>() : nullptr,
                   fp8 ? v_cache.data_ptr<uint8_t>() : nullptr,
                   bf16 ? static_cast<const uint16_t*>(k_cache.data_ptr()) : nullptr,
                   bf16 ? static_cast<const uint16_t*>(v_cache.data_ptr()) : nullptr,
                   fp8 ? k_scale->data_ptr<float>() : nullptr,
                   fp8 ? v_scale->data_ptr<float>() : nullptr, out.data_ptr<float>(), seqs.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), H, KV, S, slots.size(1), H / KV,
                   static_cast<float>(scale), sinks.has_value() ? sinks->data_ptr<float>() : nullptr, window};
  std::vector<Item> items;
  for (int64_t b = 0; b < seqs.size(0); ++b) {
    const int64_t t0 = pb.seqs[3 * b], n = pb.seqs[3 * b + 1], c = pb.seqs[3 * b + 2];
    TORCH_CHECK(n >= 1 && t0 >= 0 && t0 + n <= T && c >= n && c <= pb.L,
                "prefill_attention: request ", b, " has rows ", t0, "+", n, " and context ", c, " (", T,
                " rows, ", pb.L, " slots per request)");
    for (int64_t j = 0; j < c; ++j) {
      const int64_t slot = pb.slots[b * pb.L + j];
      TORCH_CHECK(slot >= 0 && slot < S, "prefill_attention: slot ", slot, " out of range [0, ", S, ")");
    }
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t i0 = 0; i0 < n; i0 += kQueryBlock) items.push_back({b, h, i0, std::min(n, i0 + kQueryBlock)});
  }
  // at::parallel_for gives each thread a contiguous range, and an item's cost grows with its queries'
  // positions: order the items by cost and interleave cheapest and dearest, so every range costs about
  // the same (one long prompt otherwise left one thread the late blocks of two KV heads).
  const auto cost = [&](const Item& it) {
    return (pb.seqs[3 * it.b + 2] - pb.seqs[3 * it.b + 1] + it.i1) * (it.i1 - it.i0);
  };
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) < cost(b); });
  std::vector<Item> order;
  order.reserve(items.size());
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    order.push_back(items[lo++]);
    if (lo < hi) order.push_back(items[--hi]);
  }
  items.swap(order);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      if (D == 64) run_item<4>(pb, items[i], scratch);
      else run_item<8>(pb, items[i], scratch);
    }
  });
}

#else
bool prefill_attention_supports(int64_t) { return false; }

void prefill_attention(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                       at::Tensor, c10::optional<at::Tensor>, int64_t, c10::optional<at::Tensor>,
                       c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "prefill_attention: needs AVX-512");
}
#endif
