// Causal attention for prefill chunks, keys and values read from the paged cache (prefill_attention.cpp).
#pragma once
#include "aten_ops.h"

bool prefill_attention_supports(int64_t head_dim);     // AVX-512 builds, head_dim 64 or 128
void prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor seqs,
                       at::Tensor slots, double scale, at::Tensor out,
                       c10::optional<at::Tensor> sinks = c10::nullopt, int64_t window = 0,
                       c10::optional<at::Tensor> k_scale = c10::nullopt,
                       c10::optional<at::Tensor> v_scale = c10::nullopt);   // FP8 (uint8) caches
