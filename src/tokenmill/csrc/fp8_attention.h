#pragma once
#include "aten_ops.h"

// Paged decode attention over an FP8 (E4M3) KV cache: as paged_decode_attention (cpu_kernels.cpp), with
// k_cache / v_cache [KV, S, D] uint8 codes (float8_e4m3fn bytes) and per-kv-head scales k_scale, v_scale [KV]
// float32: a cached value is code * scale. Returns [R, H, D] float32.
at::Tensor paged_decode_attention_fp8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor slots, at::Tensor lens, double scale,
                                      at::Tensor k_scale, at::Tensor v_scale);

// row[0 .. D) = the float32 values of E4M3 codes[0 .. D) (exact; unscaled).
void decode_e4m3_row(const uint8_t* codes, int64_t D, float* row);

// k, v [T, KV, D] float32 (last dim contiguous) -> E4M3 codes at their slots of the caches [KV, S, D] (uint8 or
// float8_e4m3fn, contiguous): x / scale[h] in float32, clamped to +-448, rounded to nearest even as torch's
// float8_e4m3fn conversion rounds -- bitwise layers/attention/fp8_kv.py's quantize. k_scale, v_scale [KV].
void write_kv_cache_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& k_scale, const at::Tensor& v_scale);
