// Native decoder layer for small decode steps (decode_layer.cpp).
#pragma once
#include "aten_ops.h"

#include <string>
#include <tuple>

// What one decode step gives every layer: the rows' rotary tables, new-token cache slots, and each
// request's context slots and length (all decodes: one new token per request).
struct DecodeStep {
  at::Tensor cos, sin;          // [T, head_dim / 2]
  at::Tensor slot_mapping;      // [T] int64
  at::Tensor decode_slots;      // [T, max_context] int64
  at::Tensor decode_lens;       // [T] int64
};

// The kernel a linear layer runs for steps of more than `small_rows` rows, as the per-op path's
// QuantMethod.apply runs it: "onednn" (float32 weight reordered for oneDNN, bias fused), "fp8" (the FP8
// layer's weight dequantized to float32, then at::linear), "fp8_bf16" (FP8's fast mode: fp8_linear_bf16).
// int8/int4 layers run their tiles at every step size and need none.
struct LargeLinear {
  std::string kind;                // "" (none: steps above small_rows cannot run natively), "onednn", "fp8", "fp8_bf16"
  at::Tensor weight;
};

class DecodeLinear {
 public:
  DecodeLinear(std::string kind, at::Tensor weight, c10::optional<at::Tensor> scales,
               c10::optional<at::Tensor> bias, int64_t out_features, int64_t small_rows, LargeLinear large,
               int64_t kblock = 0);
  at::Tensor operator()(const at::Tensor& x) const;   // x [T, K] float32 -> [T, N]
  int64_t max_rows() const;        // the most rows a step may have (small_rows without a large kernel)

 private:
  at::Tensor large(const at::Tensor& x) const;
  int64_t fp8_kblock() const;      // inputs per FP8 scale (kinds "fp8*"): kblock_, or K / 128 by the scales' shape
  std::string kind_;               // "f32" | "q4" | "q8" | "nvfp4": which tiles weight_ holds;
                                   // "fp8" / "fp8_bf16": codes
  at::Tensor weight_;
  c10::optional<at::Tensor> scales_, bias_;
  int64_t n_, small_rows_;
  LargeLinear large_;
  int64_t kblock_;                 // inputs per FP8 scale as the method gives it; 0: derived (fp8_kblock)
};

class DecodeLayer {
 public:
  DecodeLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, DecodeLinear qkv,
              DecodeLinear o_proj, DecodeLinear gate_up, DecodeLinear down, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor k_cache, at::Tensor v_cache,
              c10::optional<at::Tensor> k_scale = c10::nullopt,
              c10::optional<at::Tensor> v_scale = c10::nullopt);
  // x [T, hidden]; residual [T, hidden] or None (first layer) -> (mlp output, residual), as
  // LlamaDecoderLayer.forward. The residual is updated in place.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, c10::optional<at::Tensor> residual,
                                             const DecodeStep& step) const;
  int64_t max_rows() const;        // the most rows a decode step may have: the least of its linears'

 private:
  at::Tensor input_norm_, post_norm_;
  double eps_;
  DecodeLinear qkv_, o_proj_, gate_up_, down_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  at::Tensor k_cache_, v_cache_;
  // An FP8 cache (float8_e4m3fn codes): the layer's per-kv-head scales [KV] float32, held by reference (the
  // Python KVScales updates them in place when it calibrates); nullopt for a float32 cache.
  c10::optional<at::Tensor> k_scale_, v_scale_;
};
