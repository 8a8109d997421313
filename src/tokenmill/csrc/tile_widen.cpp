// Prefill-sized steps of int4 / int8 linear layers through one bfloat16 GEMM: the tile kernels'
// weights (gemv_kernels.cpp's q4 / q8 tiles) widened to bfloat16 for the call, then oneDNN's GEMM, which
// runs on AMX tiles where the CPU has them (measured on the project's Sapphire Rapids machines, the default
// model's layer shapes: 1.1x the VNNI tile kernels at 128 rows, 2.2x at 512, 3.1x at 2048, the widening
// included; slower below about 110 rows, where the tiles stay). Python picks it (quant/tile_kernels.py:
// prompt-chunk rows only).
//
//   q4_tiles_to_bf16(q [N/16, K/32, 320] uint8, N) -> wt [K, N] bfloat16,  wt[k, n] = bf16(d[n, g] q4[n, k] + m[n, g])
//   q8_tiles_to_bf16(q [N/16, K/32, 512] int8, scale [N/16*16] f32, N) -> wt [K, N] bfloat16,
//                                                                          wt[k, n] = bf16(q[n, k] * scale[n])
//   linear_tiles_bf16(x [M, K] f32, kind "q4" | "q8", q, scale or None, N) -> y [M, N] float32
//
// Each weight is computed in float32 as the tile kernels mean it (d q4 exact, one rounding for + m; q * scale
// one rounding) and rounded to the nearest bfloat16, ties to even, as torch's conversion does. Transposed
// ([K, N]): a tile's 16 rows of one input are 16 adjacent outputs, so every store is 32 contiguous bytes;
// at::linear takes wt.t() as the weight. x is rounded to bfloat16, the products summed in float32 by
// oneDNN and its output rounded to bfloat16 once more, then widened back to float32 (relative error of an
// output about 3e-3 of its norm against the float32 product of the same weights, measured; the tile
// kernels' int8 activations give about 5e-3).
#include "tile_widen.h"

#ifdef TOKENMILL_TILE_WIDEN
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "tile_loop.h"

namespace {

// 16 float32 -> 16 bfloat16 (bits), rounded to nearest, ties to even (finite inputs: the weights are).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline void store16(uint16_t* out, __mmask16 mask, __m512 w) {
  _mm256_mask_storeu_epi16(out, mask, to_bf16(w));
}

// One q4 tile (16 rows x 32 inputs of group g, row block rb) into wt's rows 32 g .. 32 g + 31, columns
// 16 rb .. 16 rb + 15. Chunk c's 64 bytes are 16 dwords, one per row: byte j of row i's dword holds inputs
// 8c + j (low nibble) and 8c + 4 + j (high nibble).
void widen_q4_tile(const uint8_t* tile, uint16_t* wt, int64_t N, int64_t g, int64_t rb, __mmask16 mask) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 288)));
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int c = 0; c < 4; ++c) {
    const __m512i rows = _mm512_loadu_si512(tile + 64 * c);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(rows, 8 * j + 4 * h), nibble);
        const __m512 w = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), m);   // d q exact, + m rounded
        store16(wt + (32 * g + 8 * c + 4 * h + j) * N + 16 * rb, mask, w);
      }
  }
}

// One q8 tile: chunk c's 64 bytes are 16 dwords, one per row: byte j of row i's dword is its input 4c + j.
void widen_q8_tile(const int8_t* tile, const __m512 scale, uint16_t* wt, int64_t N, int64_t g, int64_t rb,
                   __mmask16 mask) {
  for (int c = 0; c < 8; ++c) {
    const __m512i rows = _mm512_loadu_si512(tile + 64 * c);
    for (int j = 0; j < 4; ++j) {
      const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(rows, 24 - 8 * j), 24);     // sign-extended byte j
      store16(wt + (32 * g + 4 * c + j) * N + 16 * rb, mask, _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale));
    }
  }
}

// Checks the tiles' shape against N and returns (row blocks, groups): q [ceil(N / 16), K / 32, tile_bytes].
std::pair<int64_t, int64_t> tile_grid(const char* name, const at::Tensor& q, at::ScalarType dtype,
                                      int64_t tile_bytes, int64_t N) {
  TORCH_CHECK(q.scalar_type() == dtype && q.dim() == 3 && q.is_contiguous() && q.size(2) == tile_bytes, name,
              ": q must be contiguous ", dtype, " [N/16, K/32, ", tile_bytes, "], got ", q.scalar_type(), " ",
              q.sizes());
  TORCH_CHECK(N >= 1 && (N + 15) / 16 == q.size(0), name, ": N = ", N, " does not fit ", q.size(0),
              " row blocks of 16");
  return {q.size(0), q.size(1)};
}

// [K, N] bfloat16 in the calling thread's workspace, grown to the largest weight it has widened: a fresh
// tensor of a few MB costs its page faults on every call (measured: 0.16 ms of a 0.2 ms fill at 3.5 MB).
// Valid until the same thread widens again.
at::Tensor workspace(int64_t K, int64_t N) {
  thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < K * N) buffer = at::empty({K * N}, at::dtype(at::kBFloat16));
  return buffer.narrow(0, 0, K * N).view({K, N});
}

// Runs widen(tile index, out, g, rb, mask) for every tile, split over the threads, into wt [K, N] (into the
// calling thread's workspace where reuse is true, else a new tensor).
template <class F>
at::Tensor widen_tiles(int64_t blocks, int64_t groups, int64_t N, bool reuse, const F& widen) {
  at::Tensor wt = reuse ? workspace(groups * 32, N)
                           : at::empty({groups * 32, N}, at::dtype(at::kBFloat16));
  auto* out = reinterpret_cast<uint16_t*>(wt.data_ptr());
  // Row blocks innermost: consecutive tiles fill the two halves of the same 64-byte lines of wt's 32 rows
  // (row blocks outermost wrote each line in two far-apart halves, reading it from memory twice).
  at::parallel_for(0, blocks * groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / blocks, rb = i % blocks;
      widen(rb * groups + g, out, g, rb, tile_loop::tail_mask(N - 16 * rb));
    }
  });
  return wt;
}

// reuse: into the calling thread's workspace (linear_tiles_bf16), else a tensor of its own (the bindings).
at::Tensor widen_q4(const at::Tensor& q, int64_t N, bool reuse) {
  const auto [blocks, groups] = tile_grid("q4_tiles_to_bf16", q, at::kByte, 320, N);
  const auto* qp = q.data_ptr<uint8_t>();
  return widen_tiles(blocks, groups, N, reuse, [&](int64_t t, uint16_t* wt, int64_t g, int64_t rb, __mmask16 tail) {
    widen_q4_tile(qp + t * 320, wt, N, g, rb, tail);
  });
}

at::Tensor widen_q8(const at::Tensor& q, const at::Tensor& scale, int64_t N, bool reuse) {
  const auto [blocks, groups] = tile_grid("q8_tiles_to_bf16", q, at::kChar, 512, N);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == blocks * 16,
              "q8_tiles_to_bf16: scale must be contiguous float32 [", blocks * 16, "], got ", scale.sizes());
  const auto* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return widen_tiles(blocks, groups, N, reuse, [&](int64_t t, uint16_t* wt, int64_t g, int64_t rb, __mmask16 tail) {
    widen_q8_tile(qp + t * 512, _mm512_loadu_ps(sp + 16 * rb), wt, N, g, rb, tail);
  });
}

}  // namespace

at::Tensor q4_tiles_to_bf16(at::Tensor q, int64_t N) { return widen_q4(q, N, false); }

at::Tensor q8_tiles_to_bf16(at::Tensor q, at::Tensor scale, int64_t N) {
  return widen_q8(q, scale, N, false);
}

at::Tensor linear_tiles_bf16(at::Tensor x, const std::string& kind, at::Tensor q,
                             c10::optional<at::Tensor> scale, int64_t N) {
  TORCH_CHECK(kind == "q4" || kind == "q8", "linear_tiles_bf16: kind must be q4 or q8, got ", kind);
  TORCH_CHECK(kind == "q4" || scale.has_value(), "linear_tiles_bf16: q8 tiles need their scale");
  TORCH_CHECK(q.dim() == 3, "linear_tiles_bf16: q must be [N/16, K/32, tile bytes], got ", q.sizes());
  const int64_t K = 32 * q.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "linear_tiles_bf16: x must be float32 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor wt = kind == "q4" ? widen_q4(q, N, true) : widen_q8(q, *scale, N, true);
  return at::linear(x.to(at::kBFloat16), wt.t()).to(at::kFloat);
}
#endif  // TOKENMILL_TILE_WIDEN
