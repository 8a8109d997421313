"""NVFP4 and MXFP4 weights on the CPU: every E2M1 code decodes exactly in the kernel; the format's encoder
(round to nearest, ties to even, saturating) and scales; quantization="nvfp4" / "mxfp4" on a float checkpoint
and NVFP4 checkpoints written here in compressed-tensors' and ModelOpt's layouts give transformers' results on
the dequantized weights within 1e-4 relative, with the checkpoint's own codes, and the same greedy tokens;
MXFP4 checkpoints in compressed-tensors' layout likewise; the CUDA kernel
(quant/triton_fp4.py) is the dequantized matmul under Triton's interpreter."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: its kernel runs on the CPU

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.quant import fp4  # noqa: E402

PROMPT = [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000]


@pytest.fixture(autouse=True)
def float32_activations(monkeypatch):
    """Every test here checks the formats' exact arithmetic: NVFP4 in its float32-activation reference mode
    and MXFP4 in their float32-activation reference modes (their int8-activation tiles are
    tests/quant/test_fp4_tiles.py's)."""
    monkeypatch.setattr(fp4.NVFP4Method, "int8_activations", False)
    monkeypatch.setattr(fp4.MXFP4Method, "int8_activations", False)
VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]      # E2M1 magnitudes by code (the OCP MX spec's table)


def _encode(x: float) -> int:
    """The test's own E2M1 encoder: nearest value, ties to the even code, saturating at 6."""
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(VALUES[c] - mag), c % 2))
    return best | (8 if x < 0 and best else 0)


def test_encoder_rounds_to_nearest_with_ties_to_even_and_saturates():
    xs = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -5.0, -9.0, 0.0])
    assert fp4.to_e2m1(xs).tolist() == [_encode(x) for x in xs.tolist()]
    codes = torch.arange(16, dtype=torch.uint8)
    assert fp4.from_e2m1(codes).tolist() == VALUES + [-v for v in VALUES]
    assert torch.equal(fp4.unpack(fp4.pack(codes.repeat(3))), codes.repeat(3))
    assert fp4.pack(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21      # even element in the low nibble


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_the_kernel_decodes_every_code_and_scale_exactly(method):
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantize import quantize_model
    layer = Linear(64, 64)
    layer.weight.data.normal_()
    quantize_model(layer, method)
    codes = torch.arange(64, dtype=torch.uint8) % 16
    layer.fp4_weight[0, :] = fp4.pack(codes)
    if method == "nvfp4":          # E4M3 block-scale bytes (all 254 that are not NaN) x one scale per row
        assert layer.fp4_scale.dtype == torch.float8_e4m3fn and layer.fp4_row_scale is not None
        scale_bytes = torch.arange(256, dtype=torch.uint8)
        scale_bytes = scale_bytes[(scale_bytes & 0x7F) != 0x7F]
        layer.fp4_scale.view(torch.uint8).view(-1)[:] = scale_bytes.repeat(2)[:layer.fp4_scale.numel()]
        # powers of two: the kernel applies a row's scale to its sums, exact only then in any order
        layer.fp4_row_scale.copy_((2.0 ** torch.arange(-2, 2)).repeat(16).view_as(layer.fp4_row_scale))
    else:
        layer.fp4_scale.copy_(torch.linspace(0.5, 3.0, layer.fp4_scale.numel()).view_as(layer.fp4_scale))
    block = {"nvfp4": 16, "mxfp4": 32}[method]
    y = layer(torch.eye(64))                                            # row k: input k alone
    scales = fp4.FP4Method.float_scales(layer)                          # [64 rows, 64 / block]
    expected = fp4.from_e2m1(codes).unsqueeze(1) * scales.repeat_interleave(block, dim=1).t()
    assert torch.equal(y, expected)
    for k in range(64):                                                 # one row a call: the decode path
        assert torch.equal(layer(torch.eye(64)[k:k + 1]), expected[k:k + 1])


@pytest.mark.parametrize("method,k", [("nvfp4", 96), ("mxfp4", 96), ("nvfp4", 48)])   # 48: off the 32-chunk path
def test_one_row_and_many_rows_give_the_dequantized_matmul(method, k):
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantize import quantize_model
    g = torch.Generator().manual_seed(5)
    layer = Linear(k, 21)
    layer.weight.data.copy_(torch.randn(21, k, generator=g))
    quantize_model(layer, method)
    block = {"nvfp4": 16, "mxfp4": 32}[method]
    w = fp4.dequantize(layer.fp4_weight[0], fp4.FP4Method.float_scales(layer), block)
    x = torch.randn(11, k, generator=g)
    for rows in (x[:1], x[3:4], x[:2], x):                              # batch 1 reads its own code path
        ref = rows.double() @ w.double().t()
        assert ((layer(rows).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_scales_follow_each_format():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.logspace(-2, 1, 8).unsqueeze(1)
    block_scale, tensor_scale = fp4.nvfp4_scales(w)
    assert torch.allclose(tensor_scale, w.abs().max() / (6 * 448))
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (8, 4)
    e = fp4.mxfp4_exponents(w)
    amax = w.view(8, 2, 32).abs().amax(2)
    top = amax / fp4.e8m0_to_float(e)                                   # the block's largest, scaled: [4, 8)
    assert ((top >= 4) & (top < 8)).all()
    # each weight within half a step of the E2M1 grid (the widest step, 4 -> 6, is 2 x scale); MXFP4's power-of-
    # two scale leaves a block's largest values in [6, 8) x scale, saturated to 6: up to 2 x scale off
    for method, block, bound in ((fp4.NVFP4Method(), 16, 1.0), (fp4.MXFP4Method(), 32, 2.0)):
        scales = method.block_scales(w)
        back = fp4.dequantize(fp4.quantize(w, scales, block), scales, block)
        assert ((back - w).abs() <= scales.repeat_interleave(block, 1) * bound * (1 + 1e-6)).all()


def _hidden(llm) -> torch.Tensor:
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model, n = llm.engine.core.runner.model, len(PROMPT)
    slots = torch.arange(n)
    with torch.inference_mode():
        return model(torch.tensor(PROMPT), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))[-1]


def _hf_model(model_dir: str, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
    return hf


def _hf_hidden(model_dir: str, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(model_dir, weights).model(torch.tensor([PROMPT])).last_hidden_state[0, -1]


def _hf_greedy(model_dir: str, weights: dict[str, torch.Tensor], n: int) -> list[int]:
    hf = _hf_model(model_dir, weights)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_quantization_at_load_equals_the_dequantized_reference(tiny_model_factory, method):
    from safetensors.torch import load_file
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    m = {"nvfp4": fp4.NVFP4Method(), "mxfp4": fp4.MXFP4Method()}[method]
    ref = {}
    state = load_file(os.path.join(src, "model.safetensors"))
    for name, t in state.items():
        if name.endswith("proj.weight") and not name.split(".")[-2].startswith(("q_", "k_", "v_", "gate", "up")):
            scales = m.block_scales(t.float())
            ref[name] = fp4.dequantize(fp4.quantize(t.float(), scales, m.block), scales, m.block)
    llm = LLM(src, quantization=method, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    assert model.model.layers[0].mlp.down_proj.quant_method.name == method
    assert model.lm_head.quant_method.name == "int8"
    # fused layers (qkv, gate/up) quantize as one tensor: take their dequantized weights from the engine
    for i, layer in enumerate(model.model.layers):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
            lin = layer.get_submodule(fused)
            w = fp4.dequantize(lin.fp4_weight[0], fp4.FP4Method.float_scales(lin), m.block)
            sizes = [state[f"model.layers.{i}.{fused.split('.')[0]}.{p}.weight"].shape[0] for p in parts]
            for p, piece in zip(parts, w.split(sizes)):
                ref[f"model.layers.{i}.{fused.split('.')[0]}.{p}.weight"] = piece
    hidden, expected = _hidden(llm), _hf_hidden(src, ref)
    assert ((hidden - expected).norm() / expected.norm()).item() < 1e-4


def _nvfp4_by_hand(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checkpoint writer's NVFP4 (as ModelOpt computes it), with the test's own encoder: (packed codes
    [N, K/2] uint8, E4M3 block scales [N, K/16], float32 tensor scale)."""
    n, k = w.shape
    tensor_scale = w.abs().max() / (6 * 448)
    block_scale = (w.view(n, k // 16, 16).abs().amax(2) / 6 / tensor_scale).to(torch.float8_e4m3fn)
    full = (block_scale.float() * tensor_scale).repeat_interleave(16, 1)
    codes = torch.tensor([[_encode(x) for x in row] for row in (w / full).tolist()], dtype=torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), block_scale, tensor_scale.reshape(())


def _mxfp4_by_hand(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX spec's MXFP4 with the test's own encoder: (packed codes [N, K/2] uint8, E8M0 exponents
    [N, K/32] uint8: scale 2^(e - 127), e - 127 = floor(log2 of the block's amax) - 2)."""
    n, k = w.shape
    amax = w.view(n, k // 32, 32).abs().amax(2)
    exponent = torch.floor(torch.log2(amax)) - 2
    full = torch.exp2(exponent).repeat_interleave(32, 1)
    codes = torch.tensor([[_encode(x) for x in row] for row in (w / full).tolist()], dtype=torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (exponent + 127).to(torch.uint8)


def _write_fp4(src: str, out: str, layout: str, head: bool = False) -> tuple[dict, dict]:
    """layout: "modelopt" / "compressed-tensors" (NVFP4) or "compressed-tensors-mxfp4"; lm_head kept float
    unless `head`."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    state = load_file(os.path.join(src, "model.safetensors"))
    tensors, dequantized, packed_by_name = {}, {}, {}
    for name, t in state.items():
        if not name.endswith("proj.weight") and not (head and name == "lm_head.weight"):
            tensors[name] = t
            continue
        module = name[: -len(".weight")]
        if layout == "compressed-tensors-mxfp4":
            packed, exponents = _mxfp4_by_hand(t.float())
            tensors.update({f"{module}.weight_packed": packed, f"{module}.weight_scale": exponents})
            dequantized[name] = fp4.from_e2m1(fp4.unpack(packed)) * torch.exp2(exponents.float() - 127).repeat_interleave(32, 1)
            packed_by_name[name] = packed
            continue
        packed, block_scale, tensor_scale = _nvfp4_by_hand(t.float())
        if layout == "modelopt":
            tensors.update({name: packed, f"{module}.weight_scale": block_scale,
                            f"{module}.weight_scale_2": tensor_scale, f"{module}.input_scale": torch.tensor(1.0)})
        else:
            tensors.update({f"{module}.weight_packed": packed, f"{module}.weight_scale": block_scale,
                            f"{module}.weight_global_scale": (1 / tensor_scale).reshape(1),
                            f"{module}.input_global_scale": torch.ones(1)})
        scale = block_scale.float() * (tensor_scale if layout == "modelopt" else 1 / (1 / tensor_scale))
        dequantized[name] = fp4.from_e2m1(fp4.unpack(packed)) * scale.repeat_interleave(16, 1)
        packed_by_name[name] = packed
    os.remove(os.path.join(out, "model.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    if layout == "modelopt":
        json.dump({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [] if head else ["lm_head"]}},
                  open(os.path.join(out, "hf_quant_config.json"), "w"))
    else:
        mx = layout == "compressed-tensors-mxfp4"
        scheme = {"num_bits": 4, "type": "float", "strategy": "group" if mx else "tensor_group",
                  "group_size": 32 if mx else 16, "symmetric": True, "dynamic": False}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                      "format": "mxfp4-pack-quantized" if mx else "nvfp4-pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme}},
                                      "ignore": [] if head else ["lm_head"]}
    json.dump(cfg, open(cfg_path, "w"))
    return dequantized, packed_by_name


def _weight_only(model) -> None:
    """The weights' arithmetic alone: ModelOpt's NVFP4 recipe also rounds every input (its input_scale), which
    tests/quant/test_activation_quant.py checks; the compressed-tensors files here declare no activations."""
    for module in model.modules():
        if getattr(module, "input_quant", None) is not None:
            module.input_quant = None


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt", "compressed-tensors-mxfp4"])
def test_fp4_checkpoints_equal_the_dequantized_reference(tiny_model_factory, tmp_path, monkeypatch, layout):
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    out = str(tmp_path / "fp4")
    dequantized, packed = _write_fp4(src, out, layout)

    def no_float_copy(*args, **kwargs):
        raise AssertionError("a pre-quantized layer was quantized from a float copy")
    monkeypatch.setattr(fp4, "quantize", no_float_copy)                  # the codes go straight into the layers
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    monkeypatch.undo()
    model = llm.engine.core.runner.model
    _weight_only(model)
    down = model.model.layers[1].mlp.down_proj
    assert down.quant_method.name == ("mxfp4" if layout.endswith("mxfp4") else "nvfp4")
    assert torch.equal(down.fp4_weight[0], packed["model.layers.1.mlp.down_proj.weight"])   # the file's codes
    if not layout.endswith("mxfp4"):                          # and its E4M3 block scales, as bytes
        from safetensors.torch import load_file
        written = load_file(os.path.join(out, "model.safetensors"))["model.layers.1.mlp.down_proj.weight_scale"]
        assert torch.equal(down.fp4_scale[0].view(torch.uint8), written.view(torch.uint8))
    assert model.lm_head.quant_method.is_float                                         # kept float, as the file does
    hidden, expected = _hidden(llm), _hf_hidden(src, dequantized)
    assert ((hidden - expected).norm() / expected.norm()).item() < 1e-4
    out_tokens = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out_tokens[0].outputs[0].token_ids == _hf_greedy(src, dequantized, 8)


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt", "compressed-tensors-mxfp4"])
def test_an_fp4_checkpoint_that_quantizes_lm_head_keeps_its_codes_there(tiny_model_factory, tmp_path, layout):
    """"ignore": [] (ModelOpt: no exclude_modules): the head holds the file's codes in the format's method
    (not the int8 the method gives a head it quantizes itself); logits as transformers' on the dequantized
    weights. A vocabulary of 512 keeps the test's own encoder quick."""
    from transformers import AutoModelForCausalLM
    src = tiny_model_factory("llama", tie_word_embeddings=False, vocab_size=512)
    out = str(tmp_path / "fp4-head")
    dequantized, packed = _write_fp4(src, out, layout, head=True)
    llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    _weight_only(model)
    head = model.lm_head
    assert head.quant_method.name == ("mxfp4" if layout.endswith("mxfp4") else "nvfp4")
    assert torch.equal(head.fp4_weight[0], packed["lm_head.weight"])
    prompt = [p % 512 for p in PROMPT]
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    n, slots = len(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), slots, AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))
        logits = model.compute_logits(hidden[-1:])[0]
    with torch.no_grad():
        ref = _hf_model(src, dequantized)(torch.tensor([prompt])).logits[0, -1]
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("layout", ["compressed-tensors", "compressed-tensors-mxfp4"])
def test_fp4_block_scales_of_another_shape_are_named(tiny_model_factory, tmp_path, layout):
    """[N, K / group] per weight [N, K]: a scale tensor of another shape is refused naming it and both shapes."""
    from safetensors.torch import load_file, save_file
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    out = str(tmp_path / "fp4-shape")
    _write_fp4(src, out, layout)
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    state[name] = state[name][:, :2].contiguous()                     # [64, 2] of a weight [64, 128]
    save_file(state, path)
    group, fmt = (32, "mxfp4") if layout.endswith("mxfp4") else (16, "nvfp4")
    with pytest.raises(ValueError, match=rf"{name} has shape \[64, 2\], expected \[64, {128 // group}\] "
                                         rf"\(compressed-tensors {fmt} scales per {group} inputs of a weight "
                                         r"\[64, 128\]\)"):
        LLM(out, kv_cache_memory_bytes=1 << 22)


def test_mxfp4_checkpoint_errors_name_the_problem(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    out = str(tmp_path / "mxfp4")
    _write_fp4(src, out, "compressed-tensors-mxfp4")
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    state["model.layers.0.mlp.down_proj.weight_scale"][0, 0] = 255               # E8M0's NaN
    save_file(state, path)
    with pytest.raises(ValueError, match="E8M0 255"):
        LLM(out, kv_cache_memory_bytes=1 << 22)
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="gpt-oss"):
        LLM(out, kv_cache_memory_bytes=1 << 22)


def test_triton_fp4_kernel_is_the_dequantized_matmul():
    pytest.importorskip("triton")
    from tokenmill.quant.triton_fp4 import fp4_matmul
    from tokenmill.quant.triton_weight_only import pack_int4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 64, generator=g), torch.randn(5, 64, generator=g)
    for method in (fp4.NVFP4Method(), fp4.MXFP4Method()):
        scales = method.block_scales(w)
        packed = fp4.quantize(w, scales, method.block)
        ref = x @ fp4.dequantize(packed, scales, method.block).t()
        y = fp4_matmul(x.to(device), pack_int4(fp4.unpack(packed)).to(device), scales.t().contiguous().to(device),
                       method.block)
        torch.testing.assert_close(y.cpu(), ref, rtol=1e-5, atol=1e-4)
