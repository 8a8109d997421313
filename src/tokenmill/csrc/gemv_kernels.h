// Small-batch linear kernels (gemv_kernels.cpp), bound into the module by cpu_kernels.cpp. They need
// AVX-512 (F, BW, VL) with VNNI; other builds leave them out and Python uses torch's kernels instead.
#pragma once
#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TOKENMILL_GEMV_KERNELS 1
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, int64_t N);
torch::Tensor gemv_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t N);
torch::Tensor gemv_q4(torch::Tensor x, torch::Tensor q, int64_t N);
torch::Tensor gemv_nvfp4(torch::Tensor x, torch::Tensor q, torch::Tensor row_scale, int64_t N);
#endif
