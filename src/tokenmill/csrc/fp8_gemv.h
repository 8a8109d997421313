// FP8's fast mode for decode steps (a few rows) on AVX-512 BF16 CPUs (fp8_gemv.cpp).
#pragma once
#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BF16__)
#define TOKENMILL_FP8_GEMV_BF16 1
// x [T, K] float32 @ (codes [N, K] float8_e4m3fn x scales [N, K / kblock] float32)^T -> y [T, N] float32,
// K a multiple of 8, kblock = K (a scale per row) or a multiple of 64. x is rounded to bfloat16 (nearest
// even, as torch's .to(torch.bfloat16)); each code is widened to bfloat16 in registers, exactly (every E4M3
// value but NaN is a bfloat16); the products are summed in float32 (vdpbf16ps) per block of kblock inputs,
// and each block's sum is multiplied by its float32 scale. So y equals x.bfloat16().float() @ dequantized^T
// up to float32 summation order: the activations' rounding (relative 2^-9 an input) is the only loss, the
// same as fp8_linear_bf16's, whose oneDNN GEMM runs the steps of many rows. Rows of x share each decoded
// weight vector (up to 16 at a time), so the decode is paid once per weight per 16 rows.
torch::Tensor fp8_gemv_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t kblock);
#endif
