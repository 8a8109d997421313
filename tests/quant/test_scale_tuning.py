"""Scale tuning (quant/scale_tuning.py): with the codes fixed, training each scale group's scale against the
float model's next-token distributions lowers the held-out KL, changes no code and keeps the checkpoint's
scale shapes; tuning that does not lower it leaves the scales as they were; the CLI writes the tuned scales
and reports the KL before and after."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from tokenmill.quant import offline
from tokenmill.quant.fp8 import full_scale
from tokenmill.quant.scale_tuning import ScaleTuningConfig, mean_kl, tune_scales


def _sequences(n: int, length: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 900, (length,), generator=g).tolist() for _ in range(n)]


def _rounded(src: str, strategy: str):
    """(float model, its RTN-rounded copy with one scale in three off by 25%, {name: QuantizedLinear})."""
    from tokenmill.loaders import open_model_source
    teacher = offline.float_model(open_model_source(src))
    student = copy.deepcopy(teacher)
    cfg = offline.QuantizeConfig(strategy=strategy, algorithm="rtn", scale_search=1)
    quantized = {}
    for i, (name, linear) in enumerate(offline.target_linears(student).items()):
        q = offline.quantize_linear(linear.weight.data, torch.eye(linear.in_features, dtype=torch.float64), cfg)
        off = torch.ones_like(q.scale)
        off.view(-1)[::3] = 1.25                                    # scales a tuner has to bring back
        q.scale = q.scale * off
        q.full = full_scale(q.scale, strategy, *q.codes.shape).contiguous()
        linear.weight.data.copy_(q.codes.float() * q.full)
        quantized[name] = q
    return teacher, student, quantized


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block", "group"])
def test_tuning_lowers_the_heldout_kl_and_changes_only_the_scales(tiny_model_factory, strategy):
    src = tiny_model_factory("llama", hidden_size=160, intermediate_size=288)
    teacher, student, quantized = _rounded(src, strategy)
    codes = {n: q.codes.view(torch.uint8).clone() for n, q in quantized.items()}
    shapes = {n: q.scale.shape for n, q in quantized.items()}
    seqs = _sequences(10)
    heldout_before = mean_kl(student, teacher, seqs)
    result = tune_scales(student, teacher, quantized, seqs, strategy, ScaleTuningConfig(epochs=3, lr=2e-2))
    assert result.kept and result.heldout_kl_after < 0.8 * result.heldout_kl_before
    assert len(result.losses) == 3 * 9 and result.losses[-1] < result.losses[0]
    for name, q in quantized.items():
        assert torch.equal(q.codes.view(torch.uint8), codes[name]) and q.scale.shape == shapes[name]
        assert torch.equal(q.full, full_scale(q.scale, strategy, *q.codes.shape))
    linears = offline.target_linears(student)                       # the plain modules back, tuned weights
    assert all(type(m) is torch.nn.Linear for m in linears.values())
    for name, q in quantized.items():
        assert torch.equal(linears[name].weight.data, q.codes.float() * q.full)
    assert mean_kl(student, teacher, seqs) < heldout_before


def test_tuning_that_does_not_lower_the_kl_keeps_the_scales(tiny_model_factory):
    src = tiny_model_factory("llama", hidden_size=160, intermediate_size=288)
    teacher, student, quantized = _rounded(src, "channel")
    scales = {n: q.scale.clone() for n, q in quantized.items()}
    weights = {n: m.weight.data.clone() for n, m in offline.target_linears(student).items()}
    result = tune_scales(student, teacher, quantized, _sequences(4), "channel", ScaleTuningConfig(epochs=1, lr=5.0))
    assert not result.kept and result.heldout_kl_after > result.heldout_kl_before   # a step of e^5 overshoots
    assert all(torch.equal(q.scale, scales[n]) for n, q in quantized.items())
    assert all(torch.equal(m.weight.data, weights[n]) for n, m in offline.target_linears(student).items())
    assert all(p.requires_grad for p in student.parameters())        # the model's own parameters as they were


def test_bad_tuning_settings_are_named():
    with pytest.raises(ValueError, match="epochs must be an integer >= 0"):
        ScaleTuningConfig(epochs=-1)
    with pytest.raises(ValueError, match="lr > 0 and holdout in"):
        ScaleTuningConfig(lr=0.0)


def test_quantize_cli_writes_the_tuned_scales(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file
    from tokenmill import LLM, SamplingParams
    from tokenmill.cli import main
    src = tiny_model_factory("llama", hidden_size=256, intermediate_size=384, tie_word_embeddings=True)
    plain, tuned = str(tmp_path / "plain"), str(tmp_path / "tuned")
    common = ["quantize", "--model", src, "--num-calibration-sequences", "6", "--calibration-max-tokens", "24"]
    assert main(common + ["--out", plain]) == 0
    assert main(common + ["--out", tuned, "--tune-scales-epochs", "2", "--tune-scales-lr", "1e-2"]) == 0
    report = json.load(open(os.path.join(tuned, "quantize_report.json")))["scale_tuning"]
    assert report["steps"] == 2 * 5 and report["heldout_kl_before"] > 0
    assert "scale_tuning" not in json.load(open(os.path.join(plain, "quantize_report.json")))
    a, b = load_file(os.path.join(plain, "model.safetensors")), load_file(os.path.join(tuned, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))      # the same GPTQ codes
    if report["kept"]:
        assert report["heldout_kl_after"] < report["heldout_kl_before"]
        assert not torch.equal(a[name + "_scale"], b[name + "_scale"])
    else:
        assert torch.equal(a[name + "_scale"], b[name + "_scale"])
    assert LLM(tuned, kv_cache_memory_bytes=1 << 22).generate(
        [[11, 220, 4890, 17]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids


def test_rtn_with_tuning_writes_calibration_text_first_and_bad_flags_exit_2(tiny_model_factory, tmp_path, capsys):
    from tokenmill.cli import main
    src = tiny_model_factory("llama")
    out = str(tmp_path / "rtn-tuned")
    assert main(["quantize", "--model", src, "--out", out, "--algorithm", "rtn", "--tune-scales-epochs", "1",
                 "--num-calibration-sequences", "3", "--calibration-max-tokens", "16"]) == 0
    report = json.load(open(os.path.join(out, "quantize_report.json")))
    assert report["calibration_tokens"] == 0 and report["scale_tuning"]["steps"] == 2     # 3 texts, 1 held out
    assert main(["quantize", "--model", src, "--out", out, "--tune-scales-epochs", "-1"]) == 2
    assert "scale tuning epochs must be an integer >= 0, got -1" in capsys.readouterr().err
