// Exact greedy tokens from a float32 lm_head without computing its float32 logits (greedy_head.cpp). Needs
// the tile kernels' AVX-512 VNNI; other builds leave it out and Python computes the logits.
#pragma once
#include "aten_ops.h"

#include <tuple>

#include "gemv_kernels.h"

#if defined(TOKENMILL_GEMV_KERNELS)
#define TOKENMILL_GREEDY_HEAD 1
int64_t greedy_head_outliers();     // inputs of largest |x| per step taken in float32 (kOutliers)
std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor q8_tiles, at::Tensor scales,
                                               at::Tensor qsums, at::Tensor f32_tiles, at::Tensor norms,
                                               at::Tensor err_norms, double norm_max, int64_t N,
                                               at::Tensor banned, at::Tensor workspace);
#endif
