// The tile kernels' int4 / int8 weights widened to bfloat16 for one oneDNN GEMM (tile_widen.cpp), bound
// into the module by cpu_kernels.cpp. Built where the tile kernels are (AVX-512 VNNI builds).
#pragma once
#include "aten_ops.h"

#include <string>

#include "gemv_kernels.h"

#ifdef TOKENMILL_GEMV_KERNELS
#define TOKENMILL_TILE_WIDEN 1
at::Tensor q4_tiles_to_bf16(at::Tensor q, int64_t N);
at::Tensor q8_tiles_to_bf16(at::Tensor q, at::Tensor scale, int64_t N);
at::Tensor linear_tiles_bf16(at::Tensor x, const std::string& kind, at::Tensor q,
                             c10::optional<at::Tensor> scale, int64_t N);
#endif
