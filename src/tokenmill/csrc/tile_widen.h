// The tile kernels' int4 / int8 weights widened to bfloat16 for one oneDNN GEMM (tile_widen.cpp), bound
// into the module by cpu_kernels.cpp. Built where the tile kernels are (AVX-512 VNNI builds).
#pragma once
#include <torch/extension.h>

#include <string>

#include "gemv_kernels.h"

#ifdef TOKENMILL_GEMV_KERNELS
#define TOKENMILL_TILE_WIDEN 1
torch::Tensor q4_tiles_to_bf16(torch::Tensor q, int64_t N);
torch::Tensor q8_tiles_to_bf16(torch::Tensor q, torch::Tensor scale, int64_t N);
torch::Tensor linear_tiles_bf16(torch::Tensor x, const std::string& kind, torch::Tensor q,
                                c10::optional<torch::Tensor> scale, int64_t N);
#endif
