// The per-op native kernels of cpu_kernels.cpp, for decode_layer.cpp, which chains them.
#pragma once
#include "aten_ops.h"

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor slots, at::Tensor lens, double scale,
                                  c10::optional<at::Tensor> sinks = c10::nullopt, int64_t window = 0);
void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slots);
void rotary_inplace(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
