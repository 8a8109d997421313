// Causal attention for prefill chunks, keys and values read from the paged cache (prefill_attention.cpp).
#pragma once
#include <torch/extension.h>

bool prefill_attention_supports(int64_t head_dim);     // AVX-512 builds, head_dim 64 or 128
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor seqs,
                       torch::Tensor slots, double scale, torch::Tensor out,
                       c10::optional<torch::Tensor> sinks = c10::nullopt, int64_t window = 0,
                       c10::optional<torch::Tensor> k_scale = c10::nullopt,
                       c10::optional<torch::Tensor> v_scale = c10::nullopt);   // FP8 (uint8) caches
