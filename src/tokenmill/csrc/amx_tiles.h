// Steps of many rows through the int4 / int8 tile kernels' weights on AMX tiles (amx_tiles.cpp); the tile
// kernels (gemv_kernels.cpp) hand such steps over. Built where the compiler targets AMX-BF16 as well as the
// tile kernels' AVX-512 VNNI (-march=native on Sapphire Rapids and later).
#pragma once
#include "aten_ops.h"

#include "gemv_kernels.h"

#if defined(TOKENMILL_GEMV_KERNELS) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENMILL_AMX_TILES 1
// y [M, N] float32 = bf16(x) . bf16(w)^T, products summed in float32; w as the tiles mean it: q4 tiles
// (scale null) or q8 tiles with their row scales. Arguments checked by the caller (gemv_q4 / gemv_q8).
at::Tensor amx_tiles_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor* scale,
                            int64_t N);
// Whether a step of M rows runs amx_tiles_linear: M >= amx_min_rows() > 0 and the OS grants this process
// AMX tile data (asked once).
bool amx_tiles_take(int64_t M);
int64_t amx_min_rows();
void set_amx_min_rows(int64_t rows);    // 0: never (the VNNI tile kernels at every size)
#endif
