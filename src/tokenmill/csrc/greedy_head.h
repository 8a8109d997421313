// Exact greedy tokens from a float32 lm_head without computing its float32 logits (greedy_head.cpp). Needs
// the tile kernels' AVX-512 VNNI; other builds leave it out and Python computes the logits.
#pragma once
#include <torch/extension.h>

#include <tuple>

#include "gemv_kernels.h"

#if defined(TOKENMILL_GEMV_KERNELS)
#define TOKENMILL_GREEDY_HEAD 1
int64_t greedy_head_outliers();     // inputs of largest |x| per step taken in float32 (kOutliers)
std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor q8_tiles, torch::Tensor scales,
                                                     torch::Tensor qsums, torch::Tensor f32_tiles, torch::Tensor norms,
                                                     torch::Tensor err_norms, double norm_max, int64_t N,
                                                     torch::Tensor banned, torch::Tensor workspace);
#endif
