"""Activations quantized as a pre-quantized checkpoint declares (quant/activations.py): each scheme's
rounding against the test's own encoders (E4M3 and E2M1 by nearest value, ties to the even code); W8A8 FP8
(ModelOpt static, DeepSeek per token group, compressed-tensors per token) and W4A4 NVFP4 / MXFP4 checkpoints
give transformers' results on the dequantized weights with the same activation rounding (forward hooks on
its linears) within 1e-4 relative, and the same greedy tokens; the native decode layer steps aside for
such layers; unsupported activation schemes are errors that name them; the CUDA FP8 kernel (run through
torch's CPU _scaled_mm) quantizes with the checkpoint's static scale."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.quant import fp4, fp8
from tokenmill.quant.activations import ActivationScheme, InputQuant, quantize_dequantize

PROMPT = [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# every finite non-negative E4M3 value by code (bytes 0..126; 127 is NaN), decoded by torch
E4M3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


@pytest.fixture(autouse=True)
def float32_activations(monkeypatch):
    """NVFP4, MXFP4 and FP8 in their float32 reference modes: these tests check the formats' exact arithmetic
    (FP8's fast mode rounds activations to bfloat16; with FP8 activations after it, the rounding upstream moves
    some activations across an E4M3 rounding boundary, so the logits differ by several percent)."""
    monkeypatch.setattr(fp4.NVFP4Method, "int8_activations", False)
    monkeypatch.setattr(fp4.MXFP4Method, "int8_activations", False)
    monkeypatch.setattr(fp8.FP8Method, "bf16_activations", False)


def _nearest(values: list[float], x: float) -> float:
    """The value nearest |x| (ties to the even code), saturating at the largest, with x's sign."""
    mag = min(abs(x), values[-1])
    code = min(range(len(values)), key=lambda c: (abs(values[c] - mag), c % 2))
    return -values[code] if x < 0 else values[code]


def _fp8(x: float, scale: float) -> float:
    return _nearest(E4M3, x / scale) * scale if scale > 0 else 0.0


def _by_hand(x: torch.Tensor, fmt: str, granularity: str, group: int = 0, scale: float | None = None) -> torch.Tensor:
    """The test's own rounding of x [T, K] (float64 arithmetic on Python floats)."""
    out = []
    for row in x.double().tolist():
        if fmt == "fp8" and granularity == "tensor":
            out.append([_fp8(v, scale) for v in row])
            continue
        size = {"token": len(row), "group": group, "block": group}[granularity]
        new = []
        for i in range(0, len(row), size):
            blk = row[i:i + size]
            amax = max(abs(v) for v in blk)
            if fmt == "fp8":
                s = float(torch.tensor(amax / 448.0, dtype=torch.float32))
                new += [_fp8(v, s) for v in blk]
                continue
            if fmt == "nvfp4":
                s = _nearest(E4M3, float(torch.tensor(amax / 6.0 / scale, dtype=torch.float32))) * scale
            else:
                s = 2.0 ** (torch.floor(torch.log2(torch.tensor(amax))).item() - 2) if amax > 0 else 0.0
            new += [_nearest(E2M1, v / s) * s if s > 0 else 0.0 for v in blk]
        out.append(new)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("fmt,granularity,group,scale", [
    ("fp8", "tensor", 0, 0.01), ("fp8", "token", 0, None), ("fp8", "group", 32, None),
    ("nvfp4", "block", 16, 3.0 / (6 * 448)), ("mxfp4", "block", 32, None)])
def test_each_scheme_rounds_as_the_format_defines(fmt, granularity, group, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-2, 1, 64)
    x[1] = 0.0                                    # an all-zero row: zero scales give zeros
    x[2, :16] = 0.0
    x[3, 5] = 1e4                                 # saturates the static fp8 scale (448 x 0.01)
    got = quantize_dequantize(x, ActivationScheme(fmt, granularity, group), scale)
    want = _by_hand(x, fmt, granularity, group, scale)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0.0)
    assert got[1].abs().sum() == 0


def test_schemes_and_scales_are_checked():
    with pytest.raises(ValueError, match="fp8/block is not supported"):
        ActivationScheme("fp8", "block", 16)
    with pytest.raises(ValueError, match="positive static scale"):
        InputQuant(ActivationScheme("fp8", "tensor"), None)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_dequantize(torch.ones(2, 24), ActivationScheme("nvfp4", "block", 16), 1.0)


# -- checkpoints ------------------------------------------------------------------------------------------------

def _fp8_weight(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, the checkpoint's scale, dequantized weight): per tensor [1], or 128 x 128 blocks."""
    if strategy == "tensor":
        scale = (w.abs().max() / 448).reshape(1)
        full = scale.expand_as(w)
    else:
        n, k = w.shape
        pad = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128))
        scale = pad.view(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128).abs().amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * full


def _nvfp4_weight(w: torch.Tensor):
    n, k = w.shape
    tensor_scale = w.abs().max() / (6 * 448)
    block = (w.view(n, k // 16, 16).abs().amax(2) / 6 / tensor_scale).to(torch.float8_e4m3fn)
    full = (block.float() * tensor_scale).repeat_interleave(16, 1)
    codes = fp4.to_e2m1(w / full)
    return fp4.pack(codes), block, tensor_scale.reshape(()), fp4.from_e2m1(codes) * full


def _mxfp4_weight(w: torch.Tensor):
    n, k = w.shape
    exponent = torch.floor(torch.log2(w.view(n, k // 32, 32).abs().amax(2))) - 2
    full = torch.exp2(exponent).repeat_interleave(32, 1)
    codes = fp4.to_e2m1(w / full)
    return fp4.pack(codes), (exponent + 127).to(torch.uint8), fp4.from_e2m1(codes) * full


# layout -> (activation rounding of the reference: fmt, granularity, group; the static scale each layer gets)
LAYOUTS = {
    "modelopt-fp8": ("fp8", "tensor", 0, 0.02),
    "deepseek-fp8": ("fp8", "group", 128, None),
    "ct-fp8-token": ("fp8", "token", 0, None),
    "ct-fp8-static": ("fp8", "tensor", 0, 0.015),
    "ct-nvfp4": ("nvfp4", "block", 16, 5.0 / (6 * 448)),
    "modelopt-nvfp4": ("nvfp4", "block", 16, 4.0 / (6 * 448)),
    "ct-mxfp4": ("mxfp4", "block", 32, None),
}


def _write(src: str, out: str, layout: str) -> dict[str, torch.Tensor]:
    """The tiny float model re-saved in `layout` (every proj quantized, lm_head float); returns the dequantized
    weights by name. Static activation scales differ per shard of a fused layer where the layout allows, so
    the largest must be the one used."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    fmt, granularity, group, static = LAYOUTS[layout]
    state = load_file(os.path.join(src, "model.safetensors"))
    tensors, dequantized = {}, {}
    for name, t in state.items():
        if not name.endswith("proj.weight"):
            tensors[name] = t
            continue
        module, w = name[: -len(".weight")], t.float()
        # q and gate shards get 0.75 of the static scale: the fused layer's largest is `static`
        shard_scale = static * (0.75 if module.endswith(("q_proj", "gate_proj")) else 1.0) if static else None
        if fmt == "fp8":
            codes, scale, dequantized[name] = _fp8_weight(w, "block" if layout.startswith("deepseek") else "tensor")
            tensors[name] = codes
            tensors[f"{module}.weight_scale_inv" if layout.startswith("deepseek") else f"{module}.weight_scale"] = \
                scale.reshape(()) if layout.startswith("modelopt") else scale
            if shard_scale:
                tensors[f"{module}.input_scale"] = torch.tensor(shard_scale) if layout.startswith("modelopt") \
                    else torch.tensor([shard_scale])
        elif fmt == "nvfp4":
            packed, block, tensor_scale, dequantized[name] = _nvfp4_weight(w)
            if layout == "modelopt-nvfp4":
                tensors.update({name: packed, f"{module}.weight_scale": block, f"{module}.weight_scale_2": tensor_scale,
                                f"{module}.input_scale": torch.tensor(shard_scale)})
            else:
                tensors.update({f"{module}.weight_packed": packed, f"{module}.weight_scale": block,
                                f"{module}.weight_global_scale": (1 / tensor_scale).reshape(1),
                                f"{module}.input_global_scale": torch.tensor([1 / shard_scale])})
        else:
            packed, exponents, dequantized[name] = _mxfp4_weight(w)
            tensors.update({f"{module}.weight_packed": packed, f"{module}.weight_scale": exponents})
    os.remove(os.path.join(out, "model.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    if layout.startswith("modelopt"):
        algo = {"fp8": "FP8", "nvfp4": "NVFP4"}[fmt]
        json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "group_size": 16,
                                                                       "exclude_modules": ["lm_head"]}},
                  open(os.path.join(out, "hf_quant_config.json"), "w"))
    elif layout.startswith("deepseek"):
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    else:
        weights, acts = {
            "ct-fp8-token": ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                             {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
            "ct-fp8-static": ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                              {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
            "ct-nvfp4": ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                         {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                          "dynamic": "local"}),
            "ct-mxfp4": ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
                         {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True}),
        }[layout]
        cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                      "format": {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
                                      .get(fmt, "float-quantized"),
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                    "input_activations": acts}},
                                      "ignore": ["lm_head"]}
    json.dump(cfg, open(cfg_path, "w"))
    return dequantized


def _reference(src: str, weights: dict[str, torch.Tensor], layout: str):
    """transformers on the dequantized weights, each proj's input rounded by the test's own encoder."""
    from transformers import AutoModelForCausalLM
    fmt, granularity, group, static = LAYOUTS[layout]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
    for name, module in hf.named_modules():
        if name.endswith("proj") and isinstance(module, torch.nn.Linear):
            def round_input(_, args):
                x = args[0]
                flat = _by_hand(x.reshape(-1, x.shape[-1]), fmt, granularity, group, static)
                return (flat.to(x.dtype).reshape(x.shape),)
            module.register_forward_pre_hook(round_input)
    return hf


def _engine_logits(llm) -> torch.Tensor:
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model, n = llm.engine.core.runner.model, len(PROMPT)
    slots = torch.arange(n)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))
        return model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoints_quantize_activations_as_they_declare(tiny_model_factory, tmp_path, layout):
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=384)
    out = str(tmp_path / layout)
    dequantized = _write(src, out, layout)
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    fmt, granularity, group, static = LAYOUTS[layout]
    assert qkv.input_quant.scheme == ActivationScheme(fmt, granularity, group)
    assert qkv.input_quant.scale == pytest.approx(static) if static else qkv.input_quant.scale is None
    assert model.lm_head.input_quant is None                              # kept float, as the file does
    hf = _reference(src, dequantized, layout)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    logits = _engine_logits(llm)
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4
    out_tokens = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert out_tokens[0].outputs[0].token_ids == greedy[0, len(PROMPT):].tolist()


def test_rounded_layers_leave_the_native_decode_layer(tiny_model_factory, tmp_path):
    from tokenmill.quant import tile_kernels
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=384)
    out = str(tmp_path / "nvfp4")
    _write(src, out, "ct-nvfp4")
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    qkv = llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.native_decode_linear(tile_kernels.kernels()) is None


@pytest.mark.parametrize("acts,message", [
    ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}, "input_activations of group_0"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}, "dynamic=True"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
     "fp8 weights with nvfp4 activations"),
])
def test_unsupported_activation_schemes_are_named(tiny_model_factory, tmp_path, acts, message):
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=384)
    out = str(tmp_path / "bad")
    _write(src, out, "ct-fp8-token")
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = acts
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=message):
        LLM(out, kv_cache_memory_bytes=1 << 22)


@pytest.mark.parametrize("layout,group_size,hidden", [("deepseek-fp8", None, 64), ("ct-fp8-token", 48, 256)])
def test_token_groups_that_do_not_divide_the_input_are_refused_at_load(tiny_model_factory, tmp_path, layout,
                                                                       group_size, hidden):
    """DeepSeek's dynamic groups of 128 on a 64-wide model (its weights' partial blocks load), compressed-tensors'
    groups of 48 on 256 inputs: every request would fail, so loading does, naming the layer and the scheme."""
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=hidden, intermediate_size=384)
    out = str(tmp_path / "groups")
    _write(src, out, layout)
    if group_size:
        cfg_path = os.path.join(out, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "float", "strategy": "group", "group_size": group_size, "dynamic": True}
        json.dump(cfg, open(cfg_path, "w"))
    group = group_size or 128
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.gate_up_proj: the checkpoint declares fp8 "
                                         rf"activations, dynamic per token and {group} inputs, which needs the "
                                         rf"layer's input width \(in_features {hidden}\) to be a multiple of {group}"):
        LLM(out, kv_cache_memory_bytes=1 << 22)


def test_a_missing_static_scale_is_named(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=384)
    out = str(tmp_path / "missing")
    _write(src, out, "modelopt-fp8")
    path = os.path.join(out, "model.safetensors")
    tensors = {n: t for n, t in load_file(path).items() if n != "model.layers.1.mlp.down_proj.input_scale"}
    save_file(tensors, path)
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj: the checkpoint declares fp8 activations"):
        LLM(out, kv_cache_memory_bytes=1 << 22)


def test_the_scaled_mm_kernel_quantizes_with_the_static_scale():
    from tokenmill.layers.linear import Linear
    from tokenmill.quant.scaled_mm_fp8 import FP8ScaledMMMethod
    g = torch.Generator().manual_seed(1)
    layer = Linear(64, 32)
    layer.weight.data.copy_(torch.randn(32, 64, generator=g))
    method = FP8ScaledMMMethod()
    layer.set_quant_method(method)
    iq = InputQuant(ActivationScheme("fp8", "tensor"), 0.01)
    method.take_input_quant(layer, iq)
    assert layer.input_quant is None                 # the kernel quantizes: nothing rounds the input twice
    x = torch.randn(5, 64, generator=g)
    w = layer.fp8_weight.float() * layer.fp8_scale[0, 0].reshape(-1, 1)
    want = iq(x).double() @ w.double().t()
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-5)
