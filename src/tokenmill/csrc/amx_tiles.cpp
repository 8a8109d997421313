// int4 / int8 tile weights on AMX: one TDPBF16PS multiplies 16 activation rows by 16 weight rows over 32
// inputs (16 x 16 x 32 multiply-adds, bfloat16 products, float32 sums) where the VNNI kernels need 128
// instructions. The weights stay in the tile kernels' layout (gemv_kernels.cpp) and are widened on every
// call, per block of 16 weight rows, into AMX's B layout in an L1/L2 buffer: w = d q + m (q4) or q * scale
// (q8) in float32, rounded to the nearest bfloat16, ties to even, the same values as tile_widen.cpp's
// q4_tiles_to_bf16 / q8_tiles_to_bf16. Activations are rounded to bfloat16 once per call.
//
// Measured on the project's Sapphire Rapids machine (benchmarks/amx_tiles.py: 2 threads, the default model's
// shapes, medians of 5 rounds alternated with the VNNI kernels; one TDPBF16PS issues about every 17 ns there):
// widening costs about 0.3 ms a decoder layer whatever the rows, so AMX is 0.5x the VNNI kernels at 8 rows,
// even at 16-24, 1.34x at 32, 1.57x at 64, 1.70x at 128, 2.15x at 256 (the four linears of a layer); the
// int8 lm_head (49152 x 576) 1.04x at 32, 1.18x at 64, 1.31x at 256. Hence the default threshold of 32 rows.
//
// Layouts:
//   A (activations): bf16 rows [Mp, K] (Mp: M rounded up to 16, extra rows zero); a tile is 16 rows x 32
//                    inputs (64 bytes) at stride 2K bytes.
//   B (weights):     per 16-row block and group g of 32 inputs, 16 rows of 64 bytes: row r holds, for each
//                    weight row n, the bf16 pair (w[n, 32g + 2r], w[n, 32g + 2r + 1]) (TDPBF16PS's pairs).
//   C:               float32 16 x 16, up to four accumulators (tmm0-3), each its own dependency chain.
// Every thread configures its tiles (tile state is per thread) and releases them before it returns.
#include "amx_tiles.h"

#ifdef TOKENMILL_AMX_TILES
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

namespace {

std::atomic<int64_t> g_min_rows{32};   // measured crossover: 24 rows 0.9-1.0x, 32 rows 1.1-1.4x

bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;     // linux/arch/x86 prctl.h
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {                 // all eight tiles 16 rows x 64 bytes
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Byte shuffles that build a B row: dword t of the result takes byte idx[4t] of the source (others zero).
struct WidenIndex {
  __m512i pair[4][2];   // [which pair p of a 4-byte lane group][half h: weight rows 8h .. 8h + 7]
  __m512i lanes[2];     // float32 lanes [r r+1 ...]: [0 0 1 1 ... 7 7], [8 8 ... 15 15]
  WidenIndex() {
    alignas(64) int8_t b[64];
    alignas(64) int32_t w[16];
    for (int p = 0; p < 4; ++p)
      for (int h = 0; h < 2; ++h) {
        std::memset(b, 0, sizeof b);
        for (int t = 0; t < 16; ++t) b[4 * t] = (int8_t)(4 * (8 * h + t / 2) + 2 * (p & 1) + t % 2);
        pair[p][h] = _mm512_load_si512(b);
      }
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 16; ++t) w[t] = 8 * h + t / 2;
      lanes[h] = _mm512_load_si512(w);
    }
  }
};

constexpr __mmask64 kDwordLowBytes = 0x1111111111111111ULL;

// One B row from a 64-byte lane group `src` (16 weight rows x 4 bytes of codes), pair p, as
// w = code * mul + add per weight row (mul, add: float32 per lane, rows 8h .. 8h + 7 doubled).
inline void b_row(const __m512i& src, int p, const __m512 mul[2], const __m512 add[2], const WidenIndex& ix,
                  uint16_t* out) {
  __m512 w[2];
  for (int h = 0; h < 2; ++h) {
    const __m512i code = _mm512_maskz_permutexvar_epi8(kDwordLowBytes, ix.pair[p][h], src);
    w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), mul[h], add[h]);
  }
  _mm512_store_si512(reinterpret_cast<__m512i*>(out), (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
}

// q4 tile (320 bytes: bytes [64c, 64c + 64) hold row i's inputs 8c + j (low nibble) and 8c + 4 + j (high) at
// 4i + j; d and m float16 at 256 and 288) -> 16 B rows; row 4c + p holds inputs 8c + 2p, 8c + 2p + 1.
inline void widen_q4(const uint8_t* tile, uint16_t* out, const WidenIndex& ix) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 288)));
  const __m512 mul[2] = {_mm512_permutexvar_ps(ix.lanes[0], d), _mm512_permutexvar_ps(ix.lanes[1], d)};
  const __m512 add[2] = {_mm512_permutexvar_ps(ix.lanes[0], m), _mm512_permutexvar_ps(ix.lanes[1], m)};
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = _mm512_loadu_si512(tile + 64 * c);
    const __m512i lo = _mm512_and_si512(raw, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    b_row(lo, 0, mul, add, ix, out + 32 * (4 * c + 0));
    b_row(lo, 1, mul, add, ix, out + 32 * (4 * c + 1));
    b_row(hi, 2, mul, add, ix, out + 32 * (4 * c + 2));
    b_row(hi, 3, mul, add, ix, out + 32 * (4 * c + 3));
  }
}

// q8 tile (512 bytes of int8 q: byte 64c + 4i + j is row i's input 4c + j) and its 16 rows' scales -> 16 B
// rows; row 2c + p holds inputs 4c + 2p, 4c + 2p + 1. Codes as unsigned q + 128, taken back in `add`.
inline void widen_q8(const int8_t* tile, const float* scale, uint16_t* out, const WidenIndex& ix) {
  const __m512 s = _mm512_loadu_ps(scale), minus128 = _mm512_set1_ps(-128.f);
  const __m512 mul[2] = {_mm512_permutexvar_ps(ix.lanes[0], s), _mm512_permutexvar_ps(ix.lanes[1], s)};
  const __m512 add[2] = {_mm512_mul_ps(mul[0], minus128), _mm512_mul_ps(mul[1], minus128)};
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int c = 0; c < 8; ++c) {
    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * c), flip);
    b_row(u, 0, mul, add, ix, out + 32 * (2 * c + 0));
    b_row(u, 1, mul, add, ix, out + 32 * (2 * c + 1));
  }
}

// x rows as bfloat16 A rows (rows M .. Mp - 1 zero).
void to_bf16_rows(const float* x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, uint16_t* xb) {
  for (int64_t m = 0; m < Mp; ++m) {
    uint16_t* o = xb + m * K;
    if (m >= M) {
      std::memset(o, 0, K * sizeof(uint16_t));
      continue;
    }
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + k + 16), _mm512_loadu_ps(x + m * ldx + k));
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(o + k), (__m512i)b);
    }
  }
}

uint16_t* aligned64(std::vector<uint16_t>& v, size_t elems) {
  if (v.size() < elems + 32) v.resize(elems + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// C tiles c[i][j] = tmm(i * NT + j) = A rows [m0 + 16 i, + 16) x B of block j, summed over the G groups, stored
// at c + 16 i ldc + 16 j. MT x NT in {1 x 1..4, 2 x 1, 2 x 2}: A in tmm4 (and tmm5 for MT = 2), B in tmm5-7
// (tmm6-7 for MT = 2; the fourth block of 1 x 4 reuses tmm5). Tile numbers are immediates (the intrinsics
// paste them into the instruction), hence the spelled-out cases.
#define AMX_LOAD_A(t, i) _tile_loadd(t, a + (i) * 16 * K, lda)
#define AMX_LOAD_B(t, j) _tile_loadd(t, b[j] + 512 * g, 64)
template <int MT, int NT>
void multiply_block(const uint16_t* xb, int64_t K, int64_t m0, uint16_t* const* b, int64_t G, float* c,
                    int64_t ldc) {
  static_assert((MT == 1 && NT >= 1 && NT <= 4) || (MT == 2 && NT <= 2), "unsupported block");
  _tile_zero(0);
  if constexpr (MT * NT >= 2) _tile_zero(1);
  if constexpr (MT * NT >= 3) _tile_zero(2);
  if constexpr (MT * NT >= 4) _tile_zero(3);
  const int64_t lda = K * 2;
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* a = xb + m0 * K + 32 * g;
    if constexpr (MT == 2 && NT == 2) {
      AMX_LOAD_A(4, 0); AMX_LOAD_A(5, 1); AMX_LOAD_B(6, 0); AMX_LOAD_B(7, 1);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    } else if constexpr (MT == 2) {
      AMX_LOAD_B(5, 0);
      AMX_LOAD_A(4, 0); _tile_dpbf16ps(0, 4, 5);
      AMX_LOAD_A(4, 1); _tile_dpbf16ps(1, 4, 5);
    } else {
      AMX_LOAD_A(4, 0);
      AMX_LOAD_B(5, 0); _tile_dpbf16ps(0, 4, 5);
      if constexpr (NT >= 2) { AMX_LOAD_B(6, 1); _tile_dpbf16ps(1, 4, 6); }
      if constexpr (NT >= 3) { AMX_LOAD_B(7, 2); _tile_dpbf16ps(2, 4, 7); }
      if constexpr (NT >= 4) { AMX_LOAD_B(5, 3); _tile_dpbf16ps(3, 4, 5); }
    }
  }
  const int64_t stride = ldc * 4;
  if constexpr (MT == 2 && NT == 2) {
    _tile_stored(0, c, stride); _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + 16 * ldc, stride); _tile_stored(3, c + 16 * ldc + 16, stride);
  } else if constexpr (MT == 2) {
    _tile_stored(0, c, stride); _tile_stored(1, c + 16 * ldc, stride);
  } else {
    _tile_stored(0, c, stride);
    if constexpr (NT >= 2) _tile_stored(1, c + 16, stride);
    if constexpr (NT >= 3) _tile_stored(2, c + 32, stride);
    if constexpr (NT >= 4) _tile_stored(3, c + 48, stride);
  }
}
#undef AMX_LOAD_A
#undef AMX_LOAD_B

void multiply(int mt, int nt, const uint16_t* xb, int64_t K, int64_t m0, uint16_t* const* b, int64_t G, float* c,
              int64_t ldc) {
  if (mt == 2) {
    if (nt == 2) multiply_block<2, 2>(xb, K, m0, b, G, c, ldc);
    else multiply_block<2, 1>(xb, K, m0, b, G, c, ldc);
    return;
  }
  switch (nt) {
    case 1: multiply_block<1, 1>(xb, K, m0, b, G, c, ldc); break;
    case 2: multiply_block<1, 2>(xb, K, m0, b, G, c, ldc); break;
    case 3: multiply_block<1, 3>(xb, K, m0, b, G, c, ldc); break;
    default: multiply_block<1, 4>(xb, K, m0, b, G, c, ldc); break;
  }
}

}  // namespace

int64_t amx_min_rows() { return g_min_rows.load(); }

void set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_amx_min_rows: rows must be >= 0 (0: never), got ", rows);
  g_min_rows.store(rows);
}

bool amx_tiles_take(int64_t M) {
  const int64_t least = g_min_rows.load();
  return least > 0 && M >= least && amx_permitted();
}

at::Tensor amx_tiles_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor* scale,
                            int64_t N) {
  const bool q8 = scale != nullptr;
  const int64_t tile_bytes = q8 ? 512 : 320;
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, blocks = q.size(0), Mp = (M + 15) / 16 * 16;
  static thread_local std::vector<uint16_t> a_store;
  uint16_t* xb = aligned64(a_store, Mp * K);
  to_bf16_rows(x.data_ptr<float>(), x.stride(0), M, Mp, K, xb);
  auto y = at::empty({M, N}, x.options());
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = q8 ? scale->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  static const WidenIndex ix;
  // one row tile: four weight blocks a pass (four chains); more: 2 x 2 blocks (each load serves two products)
  const int nt_most = Mp == 16 ? 4 : 2;
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, blocks, (blocks + threads - 1) / threads, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    static thread_local std::vector<uint16_t> b_store;
    uint16_t* bbuf = aligned64(b_store, 4 * 512 * G);
    alignas(64) float scratch[32 * 64];      // C of a block whose rows or columns run past y's
    for (int64_t rb0 = b0; rb0 < b1; rb0 += nt_most) {
      const int nt = static_cast<int>(std::min<int64_t>(nt_most, b1 - rb0));
      uint16_t* b[4];
      for (int j = 0; j < nt; ++j) {
        b[j] = bbuf + j * 512 * G;
        const uint8_t* tiles = qp + (rb0 + j) * G * tile_bytes;
        for (int64_t g = 0; g < G; ++g) {
          if (q8) widen_q8(reinterpret_cast<const int8_t*>(tiles) + 512 * g, sp + 16 * (rb0 + j), b[j] + 512 * g, ix);
          else widen_q4(tiles + 320 * g, b[j] + 512 * g, ix);
        }
      }
      const int64_t n0 = 16 * rb0, cols = std::min<int64_t>(16 * nt, N - n0);
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const int mt = static_cast<int>(std::min<int64_t>(2, (Mp - m0) / 16));
        const bool direct = cols == 16 * nt && m0 + 16 * mt <= M;
        multiply(mt, nt, xb, K, m0, b, G, direct ? yp + m0 * N + n0 : scratch, direct ? N : 16 * nt);
        if (!direct)
          for (int64_t m = m0; m < std::min(M, m0 + 16 * mt); ++m)
            std::memcpy(yp + m * N + n0, scratch + (m - m0) * 16 * nt, cols * sizeof(float));
      }
    }
    _tile_release();
  });
  return y;
}
#endif
