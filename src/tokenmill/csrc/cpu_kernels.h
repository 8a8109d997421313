// The per-op native kernels of cpu_kernels.cpp, for decode_layer.cpp, which chains them.
#pragma once
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor slots, torch::Tensor lens, double scale,
                                     c10::optional<torch::Tensor> sinks = c10::nullopt, int64_t window = 0);
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slots);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
