// FP8's fast mode for decode steps (a few rows) on AVX-512 FP16 or BF16 CPUs (fp8_gemv.cpp).
#pragma once
#include "aten_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BF16__)
#define TOKENMILL_FP8_GEMV_BF16 1
// x [T, K] float32 @ (codes [N, K] float8_e4m3fn x scales [N, K / kblock] float32)^T -> y [T, N] float32,
// K a multiple of 8, kblock = K (a scale per row), 16, 32 or a multiple of 64. x is rounded to bfloat16 (nearest
// even, as torch's .to(torch.bfloat16)); each code is widened to bfloat16 in registers, exactly (every E4M3
// value but NaN is a bfloat16); the products are summed in float32 (vdpbf16ps) per block of kblock inputs,
// and each block's sum is multiplied by its float32 scale. So y equals x.bfloat16().float() @ dequantized^T
// up to float32 summation order: the activations' rounding (relative 2^-9 an input) is the only loss, the
// same as fp8_linear_bf16's, whose oneDNN GEMM runs the steps of many rows. Rows of x share each decoded
// weight vector (up to 16 at a time), so the decode is paid once per weight per 16 rows.
at::Tensor fp8_gemv_bf16(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock);
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512FP16__)
#define TOKENMILL_FP8_GEMV_F16 1
// The same product in fp16 arithmetic (Sapphire Rapids and later): each row of x is scaled by a power of two
// (max |x| under 2^11) and rounded to fp16 (relative 2^-11 an input, 4x finer than bfloat16); each code is
// widened to fp16 exactly (its value x 2^-8); products are summed by fp16 FMAs, at most 8 into a lane's sum
// (relative 2^-11 a step), before that sum joins a float32 total (times its block's float32 scale); the total
// is scaled back by a power of two. So |y - x @ dequantized^T| <= about 9 x 2^-11 x (|x| @ |dequantized|^T),
// the same order as fp8_gemv_bf16's 2^-9 (measured errors: tests/quant/test_fp8_gemv.py), at about twice its
// speed: the decode is 3 ops per 32 weights where bfloat16's table lookups share the shuffle port with
// vdpbf16ps, and fp16 FMAs run 2 a cycle. Rows of x share each decoded weight vector 8 at a time. The float32
// totals hold the scaled x's products (under 3,584 |scale| K), so block scales must stay under about 1e32 at
// K = 576 (checkpoint scales are amax / 448). kblock = K or a multiple of 64.
at::Tensor fp8_gemv_f16(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock);
#endif
