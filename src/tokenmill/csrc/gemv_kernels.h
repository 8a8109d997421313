// Small-batch linear kernels (gemv_kernels.cpp), bound into the module by cpu_kernels.cpp. They need
// AVX-512 (F, BW, VL) with VNNI; other builds leave them out and Python uses torch's kernels instead.
#pragma once
#include "aten_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TOKENMILL_GEMV_KERNELS 1
at::Tensor gemv_f32(at::Tensor x, at::Tensor w, int64_t N);
at::Tensor gemv_q8(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t N);
at::Tensor gemv_q4(at::Tensor x, at::Tensor q, int64_t N);
at::Tensor gemv_nvfp4(at::Tensor x, at::Tensor q, at::Tensor row_scale, int64_t N);
#endif
