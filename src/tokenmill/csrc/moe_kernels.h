// Grouped expert GEMMs for MoE layers on the CPU (moe_kernels.cpp): rows sorted by expert, every
// expert's weights read from memory once per call and reused from L1/L2 by all of its rows. Needs AVX2
// and FMA (every x86 CPU the project targets); other builds leave it out and Python uses the per-expert
// Linears instead (layers/moe/kernels.py).
#pragma once
#include "aten_ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_MOE_KERNELS 1
// x [R, K] float32 (rows of expert e at run_starts[e] .. run_starts[e + 1]); w [E, N, K] float32, int8,
// float8_e4m3fn, or uint8 [E, N, K / 2] packed E2M1 pairs (NVFP4 / MXFP4 codes, the even element in the low
// nibble); all but float32 with scale [E, N, K / kblock] float32: one per output row and run of kblock inputs;
// kblock <= 0: the whole row) -> y [R, N] float32, y[r] = x[r] @ (w[e] * scale[e])^T. FP4 weights may
// instead give scale as float8_e4m3fn block scales [E, N, K / kblock] with row_scale [E, N] float32 (NVFP4:
// scale = e4m3 x the row's tensor scale; a quarter of the scale bytes). With E = 1 it is a plain linear
// layer (quant/fp8.py).
at::Tensor moe_grouped_gemm(at::Tensor x, at::Tensor run_starts, at::Tensor w,
                            c10::optional<at::Tensor> scale, int64_t kblock,
                            c10::optional<at::Tensor> row_scale);
// FP8 codes [N, K] float8_e4m3fn and scales [N, K / kblock] float32 -> the float32 weight [N, K], each value
// code x scale rounded as float32 multiplies it (bitwise what quant/fp8.py dequantize gives), for GEMMs of
// many rows that run faster as one float32 GEMM than as the grouped kernel's dot products.
at::Tensor fp8_dequantize(at::Tensor codes, at::Tensor scales, int64_t kblock);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TOKENMILL_FP8_BF16 1
// FP8's fast mode for many rows: x [T, K] float32 @ (codes x scales)^T -> [T, N] float32 through one
// bfloat16 GEMM (oneDNN; float32 sums): the codes widened to bfloat16 natively (exact; with 128-input
// block scales each code x its scale is rounded to bfloat16), x rounded to bfloat16, the output rounded to
// bfloat16 before a per-row scale is applied in float32. Twice the float32 GEMM's rate on AVX-512 BF16.
at::Tensor fp8_linear_bf16(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t kblock);
#endif
#endif
