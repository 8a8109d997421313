"""`tokenmill quantize`: GPTQ onto the FP8 E4M3 grid (quant/gptq.py) lowers a layer's output error on its
calibration inputs below round-to-nearest's while every value stays on the grid RTN would write to, and
equals RTN where the inputs are uncorrelated; the written compressed-tensors checkpoint loads with the
checkpoint's own codes, and the engine's logits equal transformers' on the dequantized weights."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.quant.gptq import GPTQConfig, output_error, quantize_weight
from tokenmill.quant.offline import fp8_scales, round_e4m3

PROMPT = [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000]


def _correlated_inputs(k: int, tokens: int = 2048, seed: int = 0) -> torch.Tensor:
    """Inputs whose features are correlated and of unequal size, as a layer's activations are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    return (torch.randn(tokens, k, generator=g) @ mix) * torch.linspace(0.2, 3.0, k)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block", "group"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_and_stays_on_the_grid(strategy, act_order):
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * 0.05
    x = _correlated_inputs(160)
    h = (x.T @ x).double() / len(x)
    _, full = fp8_scales(w, strategy, 32)
    rtn = round_e4m3(w, full)
    gptq = quantize_weight(w, h, full, round_e4m3, GPTQConfig(block=32, act_order=act_order))
    assert torch.equal(round_e4m3(gptq, full), gptq)              # every value a code x its scale
    assert output_error(w, gptq, h) < 0.8 * output_error(w, rtn, h)
    y, y_rtn, y_gptq = x @ w.T, x @ rtn.T, x @ gptq.T             # the same seen on the inputs themselves
    assert (y - y_gptq).norm() < (y - y_rtn).norm()


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    _, full = fp8_scales(w, "channel")
    same = quantize_weight(w, torch.eye(64, dtype=torch.float64) * 3.0, full, round_e4m3)
    assert torch.equal(same, round_e4m3(w, full))


def test_gptq_dead_inputs_and_shape_errors():
    w = torch.randn(8, 16)
    h = torch.eye(16, dtype=torch.float64)
    h[3, 3] = 0                                                       # an input that is always zero
    _, full = fp8_scales(w, "channel")
    assert quantize_weight(w, h, full, round_e4m3)[:, 3].eq(0).all()
    with pytest.raises(ValueError, match=r"hessian \[16, 16\] and scales \[8, 16\]"):
        quantize_weight(w, h[:8, :8], full, round_e4m3)


def test_scales_follow_compressed_tensors_shapes():
    w = torch.randn(200, 300)
    w[:, :128] = 0                                                    # a zero block gets scale 1, not 0
    assert fp8_scales(w, "tensor")[0].shape == (1,)
    assert fp8_scales(w, "channel")[0].shape == (200, 1)
    block = fp8_scales(w, "block")[0]
    assert block.shape == (2, 3) and block[0, 0] == 1.0
    assert torch.allclose(block[1, 2], w[128:, 256:].abs().max() / 448)
    group, full = fp8_scales(w[:, :288], "group", 32)
    assert group.shape == (200, 9) and (group[:, :4] == 1.0).all()
    assert torch.allclose(group[7, 5], w[7, 160:192].abs().max() / 448)
    assert torch.equal(full, group.repeat_interleave(32, dim=1))
    with pytest.raises(ValueError, match=r"FP8 group scales of 64 inputs need the weight's K \(300\) to be a "
                                         r"multiple of 64"):
        fp8_scales(w, "group", 64)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block", "group"])
def test_searched_scales_never_raise_the_error_and_keep_the_checkpoints_shapes(strategy):
    """Each group's factor is in [1, 2) and its round-to-nearest output error is at most absmax / 448's; on
    rows on a coarse grid of their own (as a dequantized Q4_1 file's), per channel and per group of a row far
    less. Per row the group errors add up to the layer's output error exactly; a row's groups' errors (each
    by its own columns' H) to the sum of those blocks' terms."""
    from tokenmill.quant.offline import _group_errors, searched_scales
    g = torch.Generator().manual_seed(3)
    levels = torch.randint(0, 16, (160, 256), generator=g).float()
    w = (levels - 7.3) * torch.rand(160, 1, generator=g) * 0.01          # 16 levels per row, any step
    x = _correlated_inputs(256)
    h = (x.T @ x).double() / len(x)
    base_scale, base_full = fp8_scales(w, strategy, 32)
    scale, full = searched_scales(w, h, strategy, 16, 32)
    assert scale.shape == base_scale.shape and full.shape == w.shape
    factor = scale / base_scale
    assert (factor >= 1).all() and (factor < 2).all()
    assert torch.equal(searched_scales(w, h, strategy, 1, 32)[1], base_full)
    rtn, searched = round_e4m3(w, base_full), round_e4m3(w, full)
    # a row's own step can be matched by its own scale only (per tensor / block the rows' steps differ)
    bound = 0.9 if strategy in ("channel", "group") else 1.0
    assert output_error(w, searched, h) <= bound * output_error(w, rtn, h)
    e = (w - searched).double()
    groups = _group_errors(e, h, "channel")
    assert torch.allclose(groups.sum(), torch.tensor(output_error(w, searched, h), dtype=torch.float64), rtol=1e-9)
    per_group = _group_errors(e, h, "group", 32)
    assert per_group.shape == (160, 8)
    own = ((e[:, 64:96] @ h[64:96, 64:96]) * e[:, 64:96]).sum(dim=1)
    assert torch.allclose(per_group[:, 2], own, rtol=1e-9)


def _reference_logits(src: str, tensors: dict[str, torch.Tensor], ids) -> torch.Tensor:
    """transformers' logits of the float model at src with `tensors` (dequantized weights) in place."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=False)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("strategy", ["channel", "block", "group"])
def test_the_written_checkpoint_loads_with_its_codes(tiny_model_factory, tmp_path, strategy):
    from safetensors.torch import load_file
    from tokenmill.cli import main
    from tokenmill.quant import fp8
    src = tiny_model_factory("llama", hidden_size=256, intermediate_size=384, tie_word_embeddings=True)
    out = str(tmp_path / "fp8")
    assert main(["quantize", "--model", src, "--out", out, "--strategy", strategy,
                 "--num-calibration-sequences", "4", "--calibration-max-tokens", "24"]) == 0
    weights = json.load(open(os.path.join(out, "config.json")))["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["strategy"] == strategy
    assert weights["weights"].get("group_size") == (32 if strategy == "group" else None)
    written = load_file(os.path.join(out, "model.safetensors"))
    report = json.load(open(os.path.join(out, "quantize_report.json")))
    assert report["calibration_tokens"] > 4 * 24 and len(report["layers"]) == 2 * 7     # 2 layers x 7 projections
    assert all(r["output_error"] <= r["rtn_output_error"] for r in report["layers"].values())
    assert "lm_head.weight" not in written and written["model.embed_tokens.weight"].dtype == torch.float32
    codes = written["model.layers.1.mlp.down_proj.weight"]
    assert codes.dtype == torch.float8_e4m3fn
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"]["format"] == "float-quantized"
    for kept in ("generation_config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(out, kept)) == os.path.isfile(os.path.join(src, kept)), kept

    from tokenmill.quant import exact_mode
    with exact_mode("fp8"):                  # float32 activations: the logits below are checked against 1e-4
        llm = LLM(out, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    down = llm.engine.core.runner.model.model.layers[1].mlp.down_proj
    assert down.quant_method.name == "fp8"
    assert torch.equal(down.fp8_weight[0].view(torch.uint8), codes.view(torch.uint8))       # the file's own codes
    dequantized = {}
    for name, t in written.items():
        if t.dtype == torch.float8_e4m3fn:
            scale = written[name.removesuffix("weight") + "weight_scale"]
            kblock = {"block": fp8.BLOCK, "group": 32}.get(strategy, t.shape[1])
            dequantized[name] = fp8.dequantize(t, fp8.expand_scale(t, strategy, scale, kblock), kblock)
    from tests.quant.test_fp8 import _engine_logits
    logits, tokens = _engine_logits(llm, PROMPT)
    ref = _reference_logits(src, dequantized, PROMPT)
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4
    assert int(logits.argmax()) == int(ref.argmax()) == tokens[0]


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_any_work(tiny_model_factory, tmp_path,
                                                                              monkeypatch, capsys):
    """--group-size 64 on a model whose down_proj reads 96 inputs: refused, naming the layer, before the model
    writes any calibration text; a group size the kernels do not take (48) likewise."""
    from tokenmill import selfgen
    from tokenmill.cli import main
    src = tiny_model_factory("llama", hidden_size=128, intermediate_size=96)

    def no_text(*args, **kwargs):
        raise AssertionError("calibration text was written before the group size was checked")
    monkeypatch.setattr(selfgen, "written_sequences", no_text)
    assert main(["quantize", "--model", src, "--out", str(tmp_path / "g"), "--strategy", "group",
                 "--group-size", "64"]) != 0
    assert "model.layers.0.mlp.down_proj has 96 inputs, not a multiple of --group-size 64" in capsys.readouterr().err
    assert main(["quantize", "--model", src, "--out", str(tmp_path / "g"), "--strategy", "group",
                 "--group-size", "48"]) != 0
    assert "FP8 group scales of 48 inputs are not supported" in capsys.readouterr().err


def test_rtn_needs_no_calibration_and_moe_is_refused(tiny_model_factory, tmp_path, capsys):
    from tokenmill.cli import main
    src = tiny_model_factory("llama")
    out = str(tmp_path / "rtn")
    assert main(["quantize", "--model", src, "--out", out, "--algorithm", "rtn", "--strategy", "tensor"]) == 0
    assert json.load(open(os.path.join(out, "quantize_report.json")))["calibration_tokens"] == 0
    assert LLM(out, kv_cache_memory_bytes=1 << 22).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    moe = tiny_model_factory("mixtral")
    assert main(["quantize", "--model", moe, "--out", str(tmp_path / "moe")]) == 2
    assert "mixture-of-experts models are not supported yet" in capsys.readouterr().err
    assert main(["quantize", "--model", src, "--out", str(tmp_path / "x"), "--damp", "1.5"]) == 2
    assert "damp must be in [0, 1)" in capsys.readouterr().err


def test_an_out_that_is_the_model_or_a_file_is_refused_before_any_work(tiny_model_factory, tmp_path, monkeypatch,
                                                                       capsys):
    """--out naming the model's own directory (or a link to it) would overwrite the checkpoint being read, an
    existing file cannot hold one: both refused before the model writes its calibration text."""
    import tokenmill
    from tokenmill.cli import main
    src = tiny_model_factory("llama")
    before = {name: os.path.getmtime(os.path.join(src, name)) for name in os.listdir(src)}

    def no_work(*args, **kwargs):
        raise AssertionError("calibration started")
    monkeypatch.setattr(tokenmill, "LLM", no_work)
    link = tmp_path / "link"
    link.symlink_to(src)
    for out in (src, src + "/", str(link)):
        assert main(["quantize", "--model", src, "--out", out]) == 2
        assert f"--out {out!r} is the model's own directory" in capsys.readouterr().err
    assert {name: os.path.getmtime(os.path.join(src, name)) for name in os.listdir(src)} == before
    (tmp_path / "afile").write_text("")
    assert main(["quantize", "--model", src, "--out", str(tmp_path / "afile")]) == 2
    assert "is an existing file; expected a directory" in capsys.readouterr().err


def test_sequential_calibration_reads_each_layer_after_the_rounded_ones(tiny_model_factory):
    """Layer 0 sees the float model's inputs (nothing before it is rounded), so sequential and one-pass GPTQ
    agree there; layer 1 is calibrated on layer 0's rounded output, as H read from that model gives it
    (layer by layer on kept inputs: the same arithmetic as the whole model's forward pass)."""
    import copy
    from tokenmill.loaders import open_model_source
    from tokenmill.quant import offline
    src = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    model = offline.float_model(open_model_source(src))
    sequences = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(3)]
    cfg = offline.QuantizeConfig(gptq=GPTQConfig(block=32))
    float_h, _ = offline.collect_hessians(model, sequences)
    partial, tokens = offline.collect_hessians(model, sequences, names=["model.layers.0.mlp.down_proj"])
    assert tokens == 120 and list(partial) == ["model.layers.0.mlp.down_proj"]
    assert torch.equal(partial["model.layers.0.mlp.down_proj"], float_h["model.layers.0.mlp.down_proj"])

    rounded_model = copy.deepcopy(model)
    quantized, _ = offline.quantize_sequentially(rounded_model, sequences, cfg)
    assert len(quantized) == 14
    first, second = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"
    first_float = offline.quantize_linear(offline.target_linears(model)[first].weight.data, float_h[first], cfg)
    assert torch.equal(quantized[first].codes.view(torch.uint8), first_float.codes.view(torch.uint8))

    layer0_rounded = copy.deepcopy(model)
    for name, linear in offline.target_linears(layer0_rounded).items():
        if name.startswith("model.layers.0."):
            linear.weight.data.copy_(offline.target_linears(rounded_model)[name].weight.data)
    seen, _ = offline.collect_hessians(layer0_rounded, sequences, names=[second])
    assert not torch.allclose(seen[second], float_h[second])
    expect = offline.quantize_linear(offline.target_linears(model)[second].weight.data, seen[second], cfg)
    assert torch.equal(quantized[second].codes.view(torch.uint8), expect.codes.view(torch.uint8))
    weight = offline.target_linears(rounded_model)[second].weight.data                 # left on the grid
    assert torch.equal(weight, offline.round_e4m3(weight, quantized[second].full))
    assert torch.equal(weight, quantized[second].codes.float() * quantized[second].full)
