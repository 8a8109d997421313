// One Llama-family decoder layer for decode steps of a few rows, as one native call: the same kernels the
// per-op Python path runs (RMSNorm, linear layers, rotary, KV cache write, paged decode attention, SwiGLU),
// in the same order, without the Python between them (about 40 us per layer at batch 1, a sixth of an
// int4 decode step). Built once per layer after loading; see models/llama.py for when it runs.
//
// Linear layers (DecodeLinear), as Linear.forward picks them: up to `small_rows` rows the tile
// kernels of gemv_kernels.cpp by kind: "f32" tiles (gemv_f32), "q4" tiles (gemv_q4), "q8" tiles + scales
// (gemv_q8), "nvfp4" tiles + row scales (gemv_nvfp4), "fp8" codes [1, N, K] + scales [1, N, KB] (the grouped
// GEMM of moe_kernels.cpp with one group, as FP8Method.apply calls it; "fp8_f16" / "fp8_bf16", FP8's fast mode:
// the same codes through fp8_gemv.cpp's fp16 / bfloat16 kernel), plus an optional bias [N]; above, the
// layer's LargeLinear (oneDNN; fp8: the weight dequantized, then at::linear), when it has one. Needs the tile
// kernels (AVX-512 VNNI builds): elsewhere the per-op path runs.
#include "decode_layer.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>

#include "cpu_kernels.h"
#include "fp8_attention.h"
#include "fp8_gemv.h"
#include "gemv_kernels.h"
#include "moe_kernels.h"

#include <algorithm>

namespace {

// oneDNN's linear over a reordered weight, the op UnquantizedMethod.apply calls from Python
// (mkldnn::_linear_pointwise, registered by PyTorch: called through the dispatcher, boxed).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 std::string("none"), c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

DecodeLinear::DecodeLinear(std::string kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                           c10::optional<at::Tensor> bias, int64_t out_features, int64_t small_rows,
                           LargeLinear large, int64_t kblock)
    : kind_(std::move(kind)), weight_(weight), scales_(scales), bias_(bias), n_(out_features),
      small_rows_(small_rows), large_(std::move(large)), kblock_(kblock) {
  const bool fp8 = kind_ == "fp8" || kind_ == "fp8_bf16" || kind_ == "fp8_f16";
  TORCH_CHECK(kind_ == "f32" || kind_ == "q4" || kind_ == "q8" || kind_ == "nvfp4" || fp8,
              "DecodeLinear: unknown kind ", kind_);
  TORCH_CHECK((kind_ != "q8" && kind_ != "nvfp4" && !fp8) || scales_.has_value(), "DecodeLinear: ", kind_,
              " needs its scales");
#ifndef TOKENMILL_FP8_GEMV_BF16
  TORCH_CHECK(kind_ != "fp8_bf16", "DecodeLinear: fp8_bf16 tiles need an AVX-512 BF16 + VBMI build");
#endif
#ifndef TOKENMILL_FP8_GEMV_F16
  TORCH_CHECK(kind_ != "fp8_f16", "DecodeLinear: fp8_f16 tiles need an AVX-512 FP16 build");
#endif
  if (fp8) {
    TORCH_CHECK(weight_.dim() == 3 && weight_.size(0) == 1 && scales_->dim() == 3 &&
                    scales_->size(2) == (weight_.size(2) + fp8_kblock() - 1) / fp8_kblock(),
                "DecodeLinear: ", kind_, " needs codes [1, N, K] and scales [1, N, ceil(K / kblock)], kblock ",
                fp8_kblock());
#ifndef TOKENMILL_MOE_KERNELS
    TORCH_CHECK(false, "DecodeLinear: fp8 needs the grouped GEMM (AVX2 and FMA)");
#endif
  }
  TORCH_CHECK(large_.kind.empty() || large_.kind == "onednn" ||
                  ((large_.kind == "fp8" || large_.kind == "fp8_bf16") && fp8),
              "DecodeLinear: unknown large kind ", large_.kind);
#ifndef TOKENMILL_FP8_BF16
  TORCH_CHECK(large_.kind != "fp8_bf16", "DecodeLinear: fp8_bf16 needs an AVX-512 BF16 build");
#endif
#ifndef TOKENMILL_GEMV_KERNELS
  TORCH_CHECK(false, "DecodeLinear: needs the AVX-512 VNNI tile kernels");
#endif
}

// FP8 scales: as given (quant/fp8.py's layer.fp8_kblock: K, 128, or a checkpoint's group), else one per row
// (KB = 1: kblock = K) or per 128 inputs.
int64_t DecodeLinear::fp8_kblock() const {
  if (kblock_ > 0) return kblock_;
  return scales_->size(2) == 1 ? weight_.size(2) : 128;
}

int64_t DecodeLinear::max_rows() const {
  return large_.kind.empty() ? small_rows_ : std::numeric_limits<int64_t>::max();
}

at::Tensor DecodeLinear::large(const at::Tensor& x) const {
  TORCH_CHECK(!large_.kind.empty(), "DecodeLinear: ", x.size(0), " rows but no kernel for more than ",
              small_rows_);
#ifdef TOKENMILL_MOE_KERNELS
  if (large_.kind == "fp8")                                 // FP8Method.apply above its tile_max_rows
    return at::linear(x, fp8_dequantize(weight_.select(0, 0), scales_->select(0, 0), fp8_kblock()), bias_);
#endif
#ifdef TOKENMILL_FP8_BF16
  if (large_.kind == "fp8_bf16") {                          // the same in FP8's fast mode
    at::Tensor y = fp8_linear_bf16(x.contiguous(), weight_.select(0, 0), scales_->select(0, 0), fp8_kblock());
    return bias_.has_value() ? y.add_(*bias_) : y;
  }
#endif
  return onednn_linear(x, large_.weight, bias_);
}

at::Tensor DecodeLinear::operator()(const at::Tensor& x) const {
  if (x.size(0) > small_rows_) return large(x);
  at::Tensor y;
#ifdef TOKENMILL_GEMV_KERNELS
  if (kind_ == "f32") {
    y = gemv_f32(x, weight_, n_);
  } else if (kind_ == "q4") {
    y = gemv_q4(x, weight_, n_);
  } else if (kind_ == "nvfp4") {
    y = gemv_nvfp4(x, weight_, *scales_, n_);
  } else if (kind_ == "fp8") {
#ifdef TOKENMILL_MOE_KERNELS
    const at::Tensor one_run = at::tensor({int64_t(0), x.size(0)}, at::kLong);
    y = moe_grouped_gemm(x.contiguous(), one_run, weight_, scales_, fp8_kblock(), c10::nullopt);
#endif
  } else if (kind_ == "fp8_bf16") {
#ifdef TOKENMILL_FP8_GEMV_BF16
    y = fp8_gemv_bf16(x, weight_.select(0, 0), scales_->select(0, 0), fp8_kblock());
#endif
  } else if (kind_ == "fp8_f16") {
#ifdef TOKENMILL_FP8_GEMV_F16
    y = fp8_gemv_f16(x, weight_.select(0, 0), scales_->select(0, 0), fp8_kblock());
#endif
  } else {
    y = gemv_q8(x, weight_, *scales_, n_);
  }
#endif
  if (bias_.has_value()) y.add_(*bias_);
  return y;
}

DecodeLayer::DecodeLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, DecodeLinear qkv,
                         DecodeLinear o_proj, DecodeLinear gate_up, DecodeLinear down, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor k_cache,
                         at::Tensor v_cache, c10::optional<at::Tensor> k_scale,
                         c10::optional<at::Tensor> v_scale)
    : input_norm_(input_norm), post_norm_(post_norm), eps_(eps), qkv_(std::move(qkv)), o_proj_(std::move(o_proj)),
      gate_up_(std::move(gate_up)), down_(std::move(down)), heads_(num_heads), kv_heads_(num_kv_heads),
      head_dim_(head_dim), scale_(scale), k_cache_(k_cache), v_cache_(v_cache), k_scale_(k_scale),
      v_scale_(v_scale) {
  const bool fp8 = k_cache_.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == k_scale_.has_value() && fp8 == v_scale_.has_value() &&
                  (fp8 || k_cache_.scalar_type() == at::kFloat || k_cache_.scalar_type() == at::kBFloat16),
              "DecodeLayer: a float32 or bfloat16 cache takes no scales, an FP8 (float8_e4m3fn) cache needs k and v "
              "scales");
}

int64_t DecodeLayer::max_rows() const {
  return std::min({qkv_.max_rows(), o_proj_.max_rows(), gate_up_.max_rows(), down_.max_rows()});
}

std::tuple<at::Tensor, at::Tensor> DecodeLayer::forward(at::Tensor x, c10::optional<at::Tensor> residual,
                                                        const DecodeStep& step) const {
  at::Tensor h;
  if (residual.has_value()) {
    h = rms_norm(x, residual, input_norm_, eps_);          // residual += x, in place
  } else {
    h = rms_norm(x, c10::nullopt, input_norm_, eps_);
    residual = x;
  }
  const int64_t T = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const at::Tensor qkv = qkv_(h);                        // [T, q_size + 2 kv_size]
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
  rotary_inplace(q, step.cos, step.sin);
  rotary_inplace(k, step.cos, step.sin);
  at::Tensor attn;
  if (k_scale_.has_value()) {                               // FP8 cache: as fp8_kv.write_fp8_cache stores it
    write_kv_cache_fp8(k, v, k_cache_, v_cache_, step.slot_mapping, *k_scale_, *v_scale_);
    attn = paged_decode_attention_fp8(q.contiguous(), k_cache_.view(at::kByte), v_cache_.view(at::kByte),
                                      step.decode_slots, step.decode_lens, scale_, *k_scale_, *v_scale_);
  } else {                                                  // float32 or bfloat16 cache
    write_kv_cache(k, v, k_cache_, v_cache_, step.slot_mapping);
    attn = paged_decode_attention(q.contiguous(), k_cache_, v_cache_, step.decode_slots, step.decode_lens, scale_);
  }
  attn = attn.view({T, q_size});
  const at::Tensor h2 = rms_norm(o_proj_(attn), residual, post_norm_, eps_);
  return {down_(silu_and_mul(gate_up_(h2))), *residual};
}
