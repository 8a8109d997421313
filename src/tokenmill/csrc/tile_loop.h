// The loop shared by the tile kernels (gemv_kernels.cpp, greedy_head.cpp): weights in blocks of 16 output
// rows, split evenly over the threads, each block's weights read from memory once per step and reused
// from L2 by every activation row. AVX-512 builds only (included under TOKENMILL_GEMV_KERNELS).
#pragma once
#include "aten_ops.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

namespace tile_loop {

constexpr int kTileRows = 4;       // activation rows per pass over the weights (default)

// Evenly split [0, N) over the threads; small weights run on one thread (a fork costs a few us).
template <class F>
void parallel_over_rows(int64_t N, int64_t weight_bytes, const F& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = weight_bytes < (64 << 10) ? N : (N + threads - 1) / threads;
  at::parallel_for(0, N, grain, f);
}

inline void check_x(const at::Tensor& x, int64_t K, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == K,
              name, ": x must be float32 [M, ", K, "] with contiguous rows, got ", x.sizes());
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

// call(std::integral_constant<int, n>()) for 1 <= n <= Most: the instantiation for a runtime count.
template <int Most, class F>
inline void dispatch_count(int64_t n, const F& call) {
  if constexpr (Most > 1) {
    if (n < Most) return dispatch_count<Most - 1>(n, call);
  }
  call(std::integral_constant<int, Most>());
}

// Calls block(rows, m0, rb) for every tile of up to TileRows activation rows starting at m0 and every
// row block rb in [b0, b1); rows is std::integral_constant<int, 1..TileRows>, selecting the instantiation.
// Order: the row blocks in chunks of about kChunkBytes of weights, every activation tile over one chunk
// before the next, so each weight comes from memory once and is then reused from L2 by all M rows (at
// batch 64 this made the lm_head 3x faster than tiles-outer, which streamed it M / 4 times).
constexpr int64_t kChunkBytes = 256 << 10;

template <int TileRows = kTileRows, class F>
void for_tiles(int64_t M, int64_t b0, int64_t b1, int64_t block_bytes, const F& block) {
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, block_bytes));
  for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
    const int64_t c1 = std::min(b1, c0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += TileRows)
      for (int64_t rb = c0; rb < c1; ++rb)
        dispatch_count<TileRows>(std::min<int64_t>(TileRows, M - m0), [&](auto rows) { block(rows, m0, rb); });
  }
}

}  // namespace tile_loop
