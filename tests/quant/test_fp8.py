"""FP8 E4M3 weights: the kernel decodes every code exactly; quantization="fp8" and checkpoints written here
in compressed-tensors (tensor / channel / block scales), ModelOpt and DeepSeek (weight_scale_inv blocks)
layouts give the logits of the reference dequantized model (transformers on the same dequantized weights)
within 1e-4 relative and the same greedy tokens, keep the checkpoint's own codes, and keep the layers it
keeps in float; unsupported schemes are rejected by name. These run the exact mode; the fast mode's
bfloat16 GEMM (steps above tile_max_rows) has its own tests at the end."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.quant import fp8
from tokenmill.quant.fp8 import BLOCK, E4M3_MAX

PROMPT = [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def float32_activations(request, monkeypatch):
    """The exact mode, but for the tests of the fast mode (named test_the_fast_mode_...)."""
    if not request.node.name.startswith("test_the_fast_mode"):
        monkeypatch.setattr(fp8.FP8Method, "bf16_activations", False)


def test_the_kernel_decodes_every_e4m3_code_exactly():
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantize import quantize_model
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0                                   # NaN codes: not weights
    layer = Linear(256, 8)
    layer.weight.data.zero_()
    quantize_model(layer, "fp8")
    layer.fp8_weight[0, 0] = codes.view(torch.float8_e4m3fn)
    layer.fp8_scale.fill_(1.0)
    y = layer(torch.eye(256))                                          # row i: code i decoded
    assert torch.equal(y[:, 0], codes.view(torch.float8_e4m3fn).float())
    one_row = torch.cat([layer(row.unsqueeze(0))[:, 0] for row in torch.eye(256)])   # the batch-1 kernel
    assert torch.equal(one_row, codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("k,kblock", [(200, None), (264, None), (392, 128)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_the_kernel_matches_the_dequantized_matmul(k, kblock, rows):
    """Row counts of each kernel path (one row, a pass of 8, a remainder), K off the 16-wide vectors, per-channel
    and 128-block scales: within float32 summation error of x @ dequantized^T computed in float64."""
    from tokenmill.quant import fp8
    g = torch.Generator().manual_seed(k + rows)
    w = torch.randn(40, k, generator=g) * torch.logspace(-6, 1, k)    # subnormal codes included
    kb = kblock or k
    scales = torch.stack([w[:, b:b + kb].abs().amax(1) / E4M3_MAX for b in range(0, k, kb)], dim=1)
    codes = fp8.quantize_with(w, scales, kb)
    x = torch.randn(rows, k, generator=g)
    dequantized = fp8.dequantize(codes, scales, kb)
    y = fp8.grouped_linear(x, codes.unsqueeze(0).contiguous(), scales.unsqueeze(0).contiguous(), kb,
                           lambda: dequantized)
    ref = x.double() @ dequantized.double().t()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


def _reference_logits(model_dir: str, weights: dict[str, torch.Tensor], ids) -> torch.Tensor:
    """transformers' logits with `weights` (checkpoint names) in place of the float checkpoint's: saved as a
    float checkpoint and loaded, so transformers maps the names (Mixtral's experts are fused in its modules)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    ref_dir = model_dir.rstrip("/") + "-dequantized"
    if not os.path.isdir(ref_dir):
        shutil.copytree(model_dir, ref_dir)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    save_file({**state, **{n: w.contiguous() for n, w in weights.items()}}, os.path.join(ref_dir, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def _engine_logits(llm, ids) -> tuple[torch.Tensor, list[int]]:
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model, n = llm.engine.core.runner.model, len(ids)
    slots = torch.arange(n)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))
        logits = model.compute_logits(hidden[-1:])[0]
    return logits, llm.generate([ids], GREEDY)[0].outputs[0].token_ids


GROUP = 32                # inputs per scale of the "group" checkpoints written here


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) as the vendors lay them out: [1] per tensor, [N, 1] per channel, [N/128, K/128] blocks,
    [N, K/32] groups."""
    if strategy == "tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(1)
        full = scale.expand_as(w)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        full = scale.expand_as(w)
    elif strategy == "group":
        scale = w.abs().view(w.shape[0], -1, GROUP).amax(dim=2) / E4M3_MAX
        full = scale.repeat_interleave(GROUP, dim=1)
    else:
        n, k = w.shape
        pad = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
        blocks = pad.view(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def _write_checkpoint(src: str, out: str, layout: str, strategy: str, head: bool = False) -> dict[str, torch.Tensor]:
    """The tiny float model at `src` re-saved at `out` in a vendor's FP8 layout (lm_head kept float, as they
    usually do, unless `head`); returns the dequantized weights by HF name (the reference model's)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    state = load_file(os.path.join(src, "model.safetensors"))
    scale_name = "weight_scale_inv" if layout == "deepseek" else "weight_scale"
    tensors, dequantized = {}, {}
    for name, t in state.items():
        if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")) or \
                (head and name == "lm_head.weight"):                                   # Mixtral's experts too
            q, scale = _quantize(t.float(), strategy)
            tensors[name] = q
            tensors[name[: -len("weight")] + scale_name] = scale if layout != "modelopt" else scale.reshape(())
            tensors[name[: -len("weight")] + "input_scale"] = torch.ones(1)
            full = _quantize(t.float(), strategy)[1]
            dequantized[name] = q.float() * (full.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                                             [: t.shape[0], : t.shape[1]] if strategy == "block" else
                                             full.repeat_interleave(GROUP, 1) if strategy == "group" else full)
        else:
            tensors[name] = t
    os.remove(os.path.join(out, "model.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    if layout == "compressed-tensors":
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = [128, 128]
        if strategy == "group":
            weights["group_size"] = GROUP
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                                      "ignore": [] if head else ["lm_head"]}
    elif layout == "deepseek":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    else:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "FP8", "exclude_modules": [] if head else ["lm_head"]}},
                  open(os.path.join(out, "hf_quant_config.json"), "w"))
    json.dump(cfg, open(cfg_path, "w"))
    return dequantized


@pytest.mark.parametrize("layout,strategy", [("compressed-tensors", "tensor"), ("compressed-tensors", "channel"),
                                             ("compressed-tensors", "block"), ("compressed-tensors", "group"),
                                             ("modelopt", "tensor"), ("deepseek", "block")])
def test_prequantized_checkpoints_equal_the_dequantized_reference(tiny_model_factory, tmp_path, monkeypatch, layout,
                                                                  strategy):
    from tokenmill.quant import fp8
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=384)
    out = str(tmp_path / "fp8")
    dequantized = _write_checkpoint(src, out, layout, strategy)

    def no_float_copy(*args, **kwargs):
        raise AssertionError("a pre-quantized layer was quantized from a float copy")
    monkeypatch.setattr(fp8.FP8Method, "_quantize", no_float_copy)       # the codes go straight into the layers
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    for module in model.modules():          # the weights' arithmetic alone: ModelOpt's and DeepSeek's recipes
        if getattr(module, "input_quant", None) is not None:     # also round inputs (test_activation_quant.py)
            module.input_quant = None
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.quant_method.name == "fp8" and model.lm_head.quant_method.is_float   # kept float
    from safetensors.torch import load_file
    written = load_file(os.path.join(out, "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    k_rows = attn.qkv_proj.shard_rows("k")
    assert torch.equal(attn.qkv_proj.fp8_weight[0, k_rows].view(torch.uint8), written.view(torch.uint8))
    logits, tokens = _engine_logits(llm, PROMPT)
    ref = _reference_logits(src, dequantized, PROMPT)
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4
    assert int(logits.argmax()) == int(ref.argmax()) == tokens[0]


@pytest.mark.parametrize("layout,strategy", [("compressed-tensors", "channel"), ("modelopt", "tensor"),
                                             ("deepseek", "block")])
def test_a_checkpoint_that_quantizes_lm_head_keeps_its_codes_there(tiny_model_factory, tmp_path, layout, strategy):
    """compressed-tensors with "ignore": [] (ModelOpt, DeepSeek likewise): the head holds the file's codes in
    the format's own method, not the int8 FP8Method gives a head it quantizes itself (its float weight is
    never loaded)."""
    from safetensors.torch import load_file
    src = tiny_model_factory("llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=384)
    out = str(tmp_path / "fp8-head")
    dequantized = _write_checkpoint(src, out, layout, strategy, head=True)
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    for module in model.modules():                      # the weights' arithmetic alone, as above
        if getattr(module, "input_quant", None) is not None:
            module.input_quant = None
    head = model.lm_head
    written = load_file(os.path.join(out, "model.safetensors"))["lm_head.weight"]
    assert head.quant_method.name == "fp8" and getattr(head, "weight", None) is None
    assert torch.equal(head.fp8_weight[0].view(torch.uint8), written.view(torch.uint8))
    logits, tokens = _engine_logits(llm, PROMPT)
    ref = _reference_logits(src, dequantized, PROMPT)
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4
    assert int(logits.argmax()) == int(ref.argmax()) == tokens[0]


def test_modelopt_kv_cache_scales_on_k_proj_and_v_proj_are_the_caches(tiny_model_factory, tmp_path):
    """ModelOpt with kv_cache_quant_algo FP8 names the scales self_attn.k_proj.k_scale / v_proj.v_scale (as
    vLLM's maybe_remap_kv_scale_name reads them): an FP8 cache takes them; a float cache leaves them unused."""
    from safetensors.torch import load_file, save_file
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    out = str(tmp_path / "modelopt-kv")
    _write_checkpoint(src, out, "modelopt", "tensor")
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    for i in range(2):
        state[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.02 * (i + 1))
        state[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.03 * (i + 1))
    save_file(state, path)
    quant_path = os.path.join(out, "hf_quant_config.json")
    quant = json.load(open(quant_path))
    quant["quantization"]["kv_cache_quant_algo"] = "FP8"
    json.dump(quant, open(quant_path, "w"))
    llm = LLM(out, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    for i, layer in enumerate(llm.engine.core.runner.model.attention_layers()):
        assert layer.kv_scales.ready
        assert torch.allclose(layer.kv_scales.k, torch.tensor(0.02 * (i + 1)))
        assert torch.allclose(layer.kv_scales.v, torch.tensor(0.03 * (i + 1)))
    assert len(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == 8
    LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)          # float cache: scales unused


@pytest.mark.parametrize("declared,written,found,expected", [
    ("channel", "tensor", r"\[1\]", r"\[64, 1\] or \[64\]"),
    ("block", "channel", r"\[64, 1\]", r"\[1, 1\]"),
    ("tensor", "channel", r"\[64, 1\]", r"\[\] or \[1\] or \[1, 1\]"),
    ("group", "channel", r"\[64, 1\]", r"\[64, 4\]"),
])
@pytest.mark.parametrize("quantization", [None, "int8"])     # the checkpoint's codes, or dequantized as read
def test_scales_of_another_shape_than_the_strategy_declares_are_named(tiny_model_factory, tmp_path, declared, written,
                                                                       found, expected, quantization):
    """A per-channel scale under "block" would give row i the scale of row i // 128; a per-tensor one under
    "channel" cannot be spread over the rows: both are refused at load, naming the tensor and both shapes."""
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    out = str(tmp_path / "mismatch")
    _write_checkpoint(src, out, "compressed-tensors", written)
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = declared
    if declared == "group":
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = GROUP
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.down_proj\.weight_scale has shape {found}, "
                                         rf"expected {expected} \(compressed-tensors FP8 {declared} scales"
                                         rf"{' per 32 inputs' if declared == 'group' else ''} of a "
                                         r"weight \[64, 128\]\)"):
        LLM(out, quantization=quantization, kv_cache_memory_bytes=1 << 22)


def test_set_codes_refuses_per_channel_scales_given_as_blocks():
    """The method's own check (what attach_scales hands it, this rank's part): [N, 1] under "block"."""
    from tokenmill.layers.linear import Linear
    w = torch.randn(256, 256)
    codes, scale = _quantize(w, "channel")
    layer = Linear(256, 256)
    layer.prefix = "model.layers.3.mlp.down_proj"
    layer.checkpoint_fp8 = [(slice(0, 256), "block", scale)]
    with pytest.raises(ValueError, match=r"model.layers.3.mlp.down_proj's FP8 scale of rows 0:256 has shape "
                                         r"\[256, 1\], expected \[2, 2\]"):
        fp8.FP8Method().set_codes(layer, [(slice(0, 256), codes)], torch.device("cpu"))


def test_a_mixtral_checkpoint_keeps_its_experts_codes(tiny_model_factory, tmp_path):
    """Mixtral names its experts block_sparse_moe.experts.E.w1 / w2 / w3: their scales find the model's
    mlp.experts.E.gate_up_proj / down_proj, so the experts hold the file's own codes."""
    from safetensors.torch import load_file
    src = tiny_model_factory("mixtral", tie_word_embeddings=False, hidden_size=64)
    out = str(tmp_path / "fp8")
    dequantized = _write_checkpoint(src, out, "compressed-tensors", "channel")
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    down = llm.engine.core.runner.model.model.layers[1].mlp.experts.get_submodule("2").down_proj
    written = load_file(os.path.join(out, "model.safetensors"))["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    assert down.quant_method.name == "fp8"
    assert torch.equal(down.fp8_weight[0].view(torch.uint8), written.view(torch.uint8))
    logits, _ = _engine_logits(llm, PROMPT)
    ref = _reference_logits(src, dequantized, PROMPT)
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


def test_quantization_fp8_on_a_float_checkpoint(tiny_model_factory):
    """Every projection in FP8 (per-channel amax / 448): the final hidden states equal transformers' on the
    dequantized weights within 1e-4 relative. The head takes int8 (FP8Method.lm_head_method)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    ref_weights = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith("proj.weight"):
            q, scale = _quantize(t.float(), "channel")
            ref_weights[name] = q.float() * scale
    llm = LLM(src, quantization="fp8", kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model, n = llm.engine.core.runner.model, len(PROMPT)
    assert model.model.layers[0].mlp.down_proj.quant_method.name == "fp8"
    assert model.lm_head.quant_method.name == "int8"
    slots = torch.arange(n)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))[-1]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in ref_weights.items():
            state[name].copy_(w)
        ref = hf.model(torch.tensor([PROMPT])).last_hidden_state[0, -1]
    assert ((hidden - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 32}}}},
     r"compressed-tensors scheme of group_0 \(weights num_bits=4, type=float, strategy=tensor_group\) is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 48}}}},
     r"compressed-tensors scheme of group_0: FP8 group scales of 48 inputs are not supported; supported: groups "
     r"of 16, 32 or a multiple of 64 inputs"),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"targets": ["re:.*q_proj"], "weights": {"num_bits": 8, "type": "float", "strategy": "group",
                                                             "group_size": 32}},
        "group_1": {"targets": ["re:.*o_proj"], "weights": {"num_bits": 8, "type": "float", "strategy": "group",
                                                             "group_size": 64}}}},
     r"one weight strategy for every group is supported, got \['group'\] with group sizes \[32, 64\]"),
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 checkpoint format 'e5m2'"),
])
def test_unsupported_schemes_are_rejected_by_name(tiny_model_factory, tmp_path, config, message):
    out = str(tmp_path / "q")
    shutil.copytree(tiny_model_factory("llama"), out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    json.dump({**cfg, "quantization_config": config}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match=message):
        LLM(out, kv_cache_memory_bytes=1 << 22)


def test_modelopt_w4a8_awq_is_rejected_by_name(tiny_model_factory, tmp_path):
    out = str(tmp_path / "q")
    shutil.copytree(tiny_model_factory("llama"), out)
    json.dump({"quantization": {"quant_algo": "W4A8_AWQ"}}, open(os.path.join(out, "hf_quant_config.json"), "w"))
    with pytest.raises(ValueError, match="ModelOpt quant_algo 'W4A8_AWQ' is not supported"):
        LLM(out, kv_cache_memory_bytes=1 << 22)


def test_steps_above_the_tile_rows_run_the_dequantized_weight():
    """More than tile_max_rows rows: the weight dequantized natively (bitwise quant/fp8.py's dequantize) and
    one float32 GEMM; within float32 summation error of the float64 reference, as the kernel path."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantize import quantize_model
    from tokenmill.quant import tile_kernels
    if tile_kernels.kernels() is None:
        pytest.skip("needs the native tile kernels")
    layer = Linear(136, 48, bias=True)
    torch.nn.init.normal_(layer.weight, std=0.1, generator=torch.Generator().manual_seed(3))
    torch.nn.init.normal_(layer.bias, generator=torch.Generator().manual_seed(4))
    quantize_model(layer, "fp8")
    codes, scales = layer.fp8_weight[0], layer.fp8_scale[0]
    native = tile_kernels.kernels().fp8_dequantize(codes, scales, layer.fp8_kblock)
    assert torch.equal(native, fp8.dequantize(codes, scales, layer.fp8_kblock))
    for rows in (layer.tile_max_rows, layer.tile_max_rows + 1, 100):
        x = torch.randn(rows, 136, generator=torch.Generator().manual_seed(rows))
        ref = x.double() @ native.double().t() + layer.bias.double()
        assert ((layer(x).double() - ref).norm() / ref.norm()).item() < 1e-6


def _fast_layer(k: int, strategy: str, bias: bool = True):
    """A Linear [48, k] in FP8's fast mode, with the given checkpoint scale strategy (channel, block, group)."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantize import quantize_model
    from tokenmill.quant import tile_kernels
    if not hasattr(tile_kernels.kernels() or object(), "fp8_linear_bf16"):
        pytest.skip("needs an AVX-512 BF16 build of the native kernels")
    layer = Linear(k, 48, bias=bias)
    torch.nn.init.normal_(layer.weight, std=0.1, generator=torch.Generator().manual_seed(5))
    if bias:
        torch.nn.init.normal_(layer.bias, generator=torch.Generator().manual_seed(6))
    if strategy in ("block", "group"):
        layer.checkpoint_fp8 = [(slice(0, 48), strategy, _quantize(layer.weight.data, strategy)[1])]
    quantize_model(layer, "fp8")
    assert layer.quant_method.bf16_activations
    assert layer.fp8_kblock == {"block": BLOCK, "group": GROUP}.get(strategy, k)
    return layer


@pytest.mark.parametrize("k,strategy", [(136, "channel"), (392, "block"), (416, "group")])
def test_the_fast_mode_rounds_activations_and_output_to_bfloat16(k, strategy):
    """Above tile_max_rows: x and the output (before a per-row scale) rounded to bfloat16, the codes exact
    (times a block scale, rounded to bfloat16): each output within 2^-8 relative of the float64 product of
    the bfloat16 operands (plus float32 sums), and within 5e-3 of the exact mode's output in norm. Up to
    tile_max_rows the build's gemv (_check_small_rows_fast_mode)."""
    layer = _fast_layer(k, strategy)
    codes, scales, kblock = layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock
    exact_w = fp8.dequantize(codes, scales, kblock).double()
    per_row = kblock == k
    w_bf16 = (codes.float() if per_row else exact_w.float()).bfloat16().double()
    for rows in (layer.tile_max_rows + 1, 100):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
        y = layer(x).double() - layer.bias.double()
        product = x.bfloat16().double() @ w_bf16.t()
        if per_row:
            product = product * scales[:, 0].double()
        bound = 2.0 ** -8 * product.abs() + 1e-5 * (x.abs().double() @ exact_w.abs().t())
        assert ((y - product).abs() <= bound).all()
        exact = x.double() @ exact_w.t()
        assert 1e-4 < ((y - exact).norm() / exact.norm()).item() < 5e-3          # rounded, not exact, but close
        small = x[:layer.tile_max_rows]                     # up to tile_max_rows: the fp16 or bfloat16 gemv
        _check_small_rows_fast_mode(layer, small, exact_w, codes, scales, kblock)


def _check_small_rows_fast_mode(layer, x, exact_w, codes, scales, kblock):
    """Steps of up to tile_max_rows in the fast mode, by the kernel the layer names: fp8_gemv_f16 (AVX-512 FP16
    builds) within 9 x 2^-11 of |x| @ |w|^T of the exact product elementwise, and a quarter of bfloat16's
    error in norm; fp8_gemv_bf16 (AVX-512 BF16 + VBMI builds) rounds x to bfloat16 and nothing else (within
    1e-5 of x.bfloat16() @ the exact weight in norm); without either the exact grouped GEMM."""
    y = layer(x).double() - layer.bias.double()
    kind = layer.quant_method.tile_weights(layer)[0]
    exact = x.double() @ exact_w.t()
    error = ((y - exact).norm() / exact.norm()).item()
    if kind == "fp8_f16":
        assert ((y - exact).abs() <= 9 * 2.0 ** -11 * (x.abs().double() @ exact_w.abs().t())).all()
        rounded = x.bfloat16().double() @ exact_w.t()
        assert 1e-6 < error < 0.5 * ((rounded - exact).norm() / exact.norm()).item()
    elif kind == "fp8_bf16":
        rounded = x.bfloat16().double() @ exact_w.t()
        assert ((y - rounded).norm() / rounded.norm()).item() < 1e-5
        assert 1e-4 < error < 5e-3
    else:
        assert kind == "fp8" and error < 1e-6


def _without_fp16_gemv(monkeypatch):
    """FP8Method as on a build with AVX-512 BF16 + VBMI but not FP16 (Zen 4): fast_gemv gives fp8_gemv_bf16."""
    from tokenmill.quant import tile_kernels
    bf16_gemv = getattr(tile_kernels.kernels() or object(), "fp8_gemv_bf16", None)
    if bf16_gemv is None:
        pytest.skip("needs an AVX-512 BF16 + VBMI build of the native kernels")
    monkeypatch.setattr(fp8.FP8Method, "fast_gemv",
                        lambda self, layer=None: ("fp8_bf16", bf16_gemv) if self.bf16_activations else None)


@pytest.mark.parametrize("k,strategy", [(136, "channel"), (392, "block"), (416, "group")])
def test_the_fast_mode_without_the_fp16_gemv_rounds_x_to_bfloat16_up_to_16_rows(monkeypatch, k, strategy):
    """Without AVX-512 FP16 the fast mode's small steps run fp8_gemv_bf16 up to 16 rows (its measured limit),
    in the layer and in the native decoder layer's kind."""
    _without_fp16_gemv(monkeypatch)
    layer = _fast_layer(k, strategy)
    assert layer.tile_max_rows == fp8.FP8Method.FAST_MAX_ROWS == 16
    assert layer.quant_method.tile_weights(layer)[0] == "fp8_bf16"
    codes, scales, kblock = layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(11)) * 3
    _check_small_rows_fast_mode(layer, x, fp8.dequantize(codes, scales, kblock).double(), codes, scales, kblock)


def test_the_fast_mode_without_the_gemv_kernels_runs_float32_up_to_16_rows(monkeypatch):
    """A build with AVX-512 BF16 but neither FP16 nor VBMI has fp8_linear_bf16 and no gemv: steps of up to 16
    rows run the exact grouped kernel (its measured limit), and the native decoder layer gets kind "fp8"."""
    monkeypatch.setattr(fp8.FP8Method, "fast_gemv", lambda self, layer=None: None)
    layer = _fast_layer(136, "channel")
    assert layer.tile_max_rows == fp8.FP8Method.FAST_GROUPED_MAX_ROWS == 16
    assert layer.quant_method.tile_weights(layer)[0] == "fp8"
    exact_w = fp8.dequantize(layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock).double()
    x = torch.randn(16, 136, generator=torch.Generator().manual_seed(8))
    exact = x.double() @ exact_w.t() + layer.bias.double()
    assert ((layer(x).double() - exact).norm() / exact.norm()).item() < 1e-6


def test_the_fast_mode_runs_groups_of_16_or_32_on_the_bfloat16_gemv(monkeypatch):
    """fp8_gemv_f16 takes scales per row or per multiple of 64 inputs only: on a build with both gemvs a layer
    with groups of 16 or 32 gets fp8_gemv_bf16 (its kind in the native decoder layer too), the others f16."""
    from types import SimpleNamespace
    from tokenmill.quant import tile_kernels
    native = SimpleNamespace(fp8_gemv_f16=object(), fp8_gemv_bf16=object(), moe_grouped_gemm=object())
    monkeypatch.setattr(tile_kernels, "kernels", lambda: native)
    method = fp8.FP8Method(bf16_activations=True)
    for kblock, kind in ((16, "fp8_bf16"), (32, "fp8_bf16"), (64, "fp8_f16"), (128, "fp8_f16"), (576, "fp8_f16")):
        layer = SimpleNamespace(fp8_kblock=kblock, in_features=576, fp8_weight=None, fp8_scale=None)
        assert method.fast_gemv(layer)[0] == kind
        assert method.tile_weights(layer)[0] == kind and method.tile_scale_block(layer) == kblock


def test_the_fast_mode_is_off_with_bf16_activations_false():
    layer = _fast_layer(136, "channel", bias=False)
    exact_method = fp8.FP8Method(bf16_activations=False)
    assert exact_method.bf16_kernel() is None and layer.quant_method.bf16_kernel() is not None
    assert exact_method.large_kernel(layer)[0] == "fp8" and layer.quant_method.large_kernel(layer)[0] == "fp8_bf16"
    x = torch.randn(64, 136, generator=torch.Generator().manual_seed(9))
    exact = x.double() @ fp8.dequantize(layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock).double().t()
    assert ((exact_method.apply(layer, x).double() - exact).norm() / exact.norm()).item() < 1e-6


def test_the_fast_mode_is_chosen_when_the_engine_is_built(tiny_model_factory):
    """quant.exact_mode (the benchmarks' "fp8-exact") holds only while an engine is built: the layers keep the
    mode they were built in."""
    from tokenmill.quant import exact_mode, tile_kernels
    if not hasattr(tile_kernels.kernels() or object(), "fp8_linear_bf16"):
        pytest.skip("needs an AVX-512 BF16 build of the native kernels")
    model_dir = tiny_model_factory("llama")
    with exact_mode("fp8"):
        exact = LLM(model_dir, quantization="fp8", kv_cache_memory_bytes=1 << 22)
    assert fp8.FP8Method.bf16_activations
    with pytest.raises(ValueError, match="'int4' has no fast mode; formats with one: fp8, mxfp4, nvfp4"):
        with exact_mode("int4"):
            pass
    fast = LLM(model_dir, quantization="fp8", kv_cache_memory_bytes=1 << 22)
    for llm, mode, kind in ((exact, False, "fp8"), (fast, True, "fp8_bf16")):
        down = llm.engine.core.runner.model.model.layers[0].mlp.down_proj
        assert down.quant_method.bf16_activations is mode and down.quant_method.large_kernel(down)[0] == kind
