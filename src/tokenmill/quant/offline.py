"""Quantizing a float checkpoint ahead of time (`tokenmill quantize`) into a pre-quantized checkpoint the
engine loads like any vendor's: compressed-tensors `float-quantized` FP8 E4M3 (weights `weight`
float8_e4m3fn and `weight_scale` [1] / [N, 1] / [N/128, K/128] / [N, K/group]; activations float; lm_head
kept float),
the layout llm-compressor writes (quant/prequantized.py reads it).

1. Calibration text: the model writes it itself (sampled answers to a spread of instruction prompts,
   selfgen.py), so no dataset is needed and the text is in the model's own distribution.
2. Statistics: the float model (Hugging Face's class for the architecture, weights read by tokenmill's
   loaders, GGUF included) reads the calibration sequences; a hook on every nn.Linear but the head
   accumulates H = X^T X / tokens of its input [K, K] (float64).
   Sequential (the default, the paper's order): one decoder layer at a time, in order, each read on the
   outputs of the layers before it already rounded (their weights replaced by the rounded values), so a
   layer's rounding also corrects the error its inputs carry. The first layer's inputs (hidden states and
   the call's other arguments) are kept per sequence [tokens, hidden] float32; each layer runs on them
   twice (float for its H, rounded for the next layer's inputs): two forward passes' work in all. Only
   that layer's H are in memory. `sequential=False`: one pass of the float model for every layer's H.
3. Scales (`scale_search`): E4M3 is a floating-point grid, so a scale s and 2s give the same relative
   grid; scales from absmax / 448 up to twice that place the grid differently against the weights (the
   largest still within +-448). Each group (the tensor, a row, a 128 x 128 block, a row's run of `group_size`
   inputs) takes the factor in
   {1, 1 + 1/n, ..., 2 - 1/n} x absmax / 448 whose round-to-nearest output error trace((W - Q) H (W - Q)^T)
   is least (per row exactly; a block or group by the H of its own columns, H's other terms left out); n = 1:
   absmax / 448 as RTN sets it. On the default model (its weights are a dequantized Q4_1 file: 16 levels
   per block of 32, which some placements of the E4M3 grid hit far better than others) 16 factors halve
   RTN's output error; with a scale per 32 inputs (`group`, aligned with those blocks) each block gets its
   own placement, and the KL to the float model on benchmarks/quant_quality.py's documents falls from
   0.0062 to 0.0028 nats (GPTQ, calibration seeds 0-2; 9 bits a weight with the float32 scales, against
   8.06 per channel).
   Rounding: each weight rounded to the E4M3 grid either to nearest (`rtn`) or by GPTQ (quant/gptq.py: the
   layer's output error on the calibration inputs kept small), under those scales.
4. Writing: the float tensors as they are (a tied head stays tied), the codes and scales, config.json with
   its `quantization_config`, the tokenizer (and generation_config.json where the source has one), and
   quantize_report.json (settings, tokens, and per layer the output error trace((W - Q) H (W - Q)^T) of
   the rounding chosen and of RTN).
With `tuning.epochs` > 0 the scales are trained after rounding, before writing (quant/scale_tuning.py): the
report's per-layer errors are then those of the rounding under the scales before tuning, and its
`scale_tuning` entry gives the held-out KL before and after, and whether the tuned scales were kept."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from tokenmill.quant.fp8 import BLOCK, E4M3_MAX, check_group, full_scale
from tokenmill.quant.gptq import GPTQConfig, output_error, quantize_weight
from tokenmill.quant.scale_tuning import ScaleTuningConfig

STRATEGIES = ("tensor", "channel", "block", "group")
ALGORITHMS = ("gptq", "rtn")
REPORT_FILE = "quantize_report.json"


@dataclass(frozen=True)
class QuantizeConfig:
    strategy: str = "channel"              # FP8 scale per tensor, output row, 128 x 128 block, or row's group
    group_size: int = 32                   # inputs per scale of strategy "group" (16, 32 or a multiple of 64)
    algorithm: str = "gptq"                # gptq | rtn
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    num_sequences: int = 64                # calibration sequences the model writes
    max_tokens: int = 384                  # tokens generated per calibration sequence
    seed: int = 0
    sequential: bool = True                # each decoder layer calibrated on the rounded earlier layers
    scale_search: int = 16                 # scale factors tried per group in [1, 2) (1: absmax / 448 only)
    tuning: ScaleTuningConfig = field(default_factory=ScaleTuningConfig)   # scales trained end to end after

    @property
    def needs_text(self) -> bool:
        """Whether quantizing reads calibration text (GPTQ's statistics, or the scales' tuning)."""
        return self.algorithm == "gptq" or self.tuning.epochs > 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"quantize: strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"quantize: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.num_sequences < 1 or self.max_tokens < 1:
            raise ValueError("quantize: num_sequences and max_tokens must be >= 1, got "
                             f"{self.num_sequences} and {self.max_tokens}")
        if self.strategy == "group":
            check_group(self.group_size)
        if not isinstance(self.scale_search, int) or self.scale_search < 1:
            raise ValueError(f"quantize: scale_search must be an integer >= 1, got {self.scale_search!r}")
        if not 0 <= self.gptq.damp < 1 or self.gptq.block < 1:
            raise ValueError(f"quantize: GPTQ damp must be in [0, 1) and block >= 1, got {self.gptq.damp} and "
                             f"{self.gptq.block}")


def check_dense(hf_config) -> None:
    """Mixture-of-experts models keep their experts outside nn.Linear in Hugging Face's classes: refused."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(hf_config, key, None):
            raise ValueError(f"quantize: {type(hf_config).__name__} has {key}={getattr(hf_config, key)}; "
                             "mixture-of-experts models are not supported yet (dense models only)")


def check_groups_fit(hf_config, cfg: QuantizeConfig) -> None:
    """With group scales, every target linear's input width must be a multiple of the group size: checked on
    the architecture's shapes (a model on the meta device) before any work, naming the first that is not."""
    if cfg.strategy != "group":
        return
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    for name, linear in target_linears(model).items():
        if linear.in_features % cfg.group_size:
            raise ValueError(f"quantize: {name} has {linear.in_features} inputs, not a multiple of --group-size "
                             f"{cfg.group_size}; choose a group size that divides every layer's input width")


def check_out(out: str, model_path: str) -> None:
    """--out must be a directory to create or fill: neither an existing file nor the model's own directory
    (the checkpoint written there would replace the one being read). Checked before any work."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"quantize: --out {out!r} is an existing file; expected a directory (new or existing) "
                         "for the quantized checkpoint")
    if os.path.isdir(out) and os.path.samefile(out, model_path):
        raise ValueError(f"quantize: --out {out!r} is the model's own directory ({model_path!r}); writing there "
                         "would overwrite the checkpoint being quantized: choose another directory")


@torch.no_grad()
def float_model(source) -> nn.Module:
    """The checkpoint as Hugging Face's float32 model of its architecture, weights read by tokenmill's
    loaders (GGUF dequantized as the engine reads it)."""
    from transformers import AutoModelForCausalLM
    from tokenmill.loaders.lazy import read_part
    check_dense(source.hf_config)
    model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32).eval()
    state = {name: read_part(t, slice(None), slice(None)).float() for name, t in source.iter_weights()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(source.hf_config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"quantize: the checkpoint does not match {type(model).__name__}: missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if tied:
        model.tie_weights()
    return model


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear but the output head, by module name (= its checkpoint prefix)."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers in order (Hugging Face's `model.layers` of a causal LM), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


class _StopForward(Exception):
    """Raised once the first decoder layer's inputs are kept: the rest of the forward pass is not needed."""


def _accumulating(linears: dict[str, nn.Linear]):
    """(H sums {name: [K, K] float64, zero}, hook handles): each linear's inputs x add x^T x to its sum."""
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in linears.items()}

    def hook(name):
        def accumulate(_module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            sums[name].addmm_(x.T, x)
        return accumulate

    return sums, [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]


@torch.no_grad()
def collect_hessians(model: nn.Module, sequences: list[list[int]], progress=None,
                     names=None) -> tuple[dict, int]:
    """({linear name: H = X^T X / tokens [K, K] float64}, tokens) over the sequences, one at a time, for
    the target linears in `names` (default: all)."""
    linears = {n: m for n, m in target_linears(model).items() if names is None or n in names}
    sums, handles = _accumulating(linears)
    tokens = 0
    try:
        for ids in sequences:
            model(torch.tensor([ids]), use_cache=False)
            tokens += len(ids)
            if progress:
                progress()
    finally:
        for h in handles:
            h.remove()
    return {name: s / max(tokens, 1) for name, s in sums.items()}, tokens


def fp8_scales(w: torch.Tensor, strategy: str, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the checkpoint's weight_scale: [1] / [N, 1] / [ceil(N/128), ceil(K/128)] / [N, K/group], each
    weight's scale [N, K]) for w [N, K]: absmax / 448 of the tensor, row, block or a row's group of `group`
    inputs (K a multiple of it; a zero group gets scale 1)."""
    n, k = w.shape
    a = w.abs().float()
    if strategy == "tensor":
        scale = a.amax().reshape(1)
    elif strategy == "channel":
        scale = a.amax(dim=1, keepdim=True)
    elif strategy == "group":
        if group <= 0 or k % group:
            raise ValueError(f"quantize: FP8 group scales of {group} inputs need the weight's K ({k}) to be a "
                             f"multiple of {group}")
        scale = a.view(n, k // group, group).amax(dim=2)
    else:
        pad = nn.functional.pad(a, (0, -k % BLOCK, 0, -n % BLOCK))
        scale = pad.view(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK).amax(dim=(1, 3))
    scale = torch.where(scale > 0, scale / E4M3_MAX, torch.ones_like(scale)).contiguous()
    return scale, full_scale(scale, strategy, n, k).contiguous()


def round_e4m3(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of w / scales (saturating at +-448), times scales: float32, same shape."""
    return (w / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scales


@dataclass
class QuantizedLinear:
    codes: torch.Tensor                    # [N, K] float8_e4m3fn
    scale: torch.Tensor                    # the checkpoint's weight_scale (fp8_scales)
    error: float                           # output error of these codes on the calibration inputs
    rtn_error: float                       # the same of round-to-nearest (scales absmax / 448)
    full: torch.Tensor | None = None       # each weight's scale [N, K] (the codes times it: the rounded weight)


def quantize_linear(w: torch.Tensor, hessian: torch.Tensor, cfg: QuantizeConfig) -> QuantizedLinear:
    group = cfg.group_size if cfg.strategy == "group" else 0
    base_scale, base_full = fp8_scales(w, cfg.strategy, group)
    rtn_error = output_error(w, round_e4m3(w.float(), base_full), hessian)
    scale, full = searched_scales(w, hessian, cfg.strategy, cfg.scale_search, group)
    if cfg.algorithm == "rtn":
        rounded = round_e4m3(w.float(), full)
    else:
        rounded = quantize_weight(w, hessian, full, round_e4m3, cfg.gptq)
    codes = (rounded / full).to(torch.float8_e4m3fn)             # exact: rounded is on the grid
    return QuantizedLinear(codes, scale, output_error(w, rounded, hessian), rtn_error, full)


def searched_scales(w: torch.Tensor, hessian: torch.Tensor, strategy: str, candidates: int, group: int = 0):
    """fp8_scales' pair with each group's scale times the factor in {1 + i / candidates} whose round-to-
    nearest error against `hessian` is least (module docstring, step 3)."""
    scale, full = fp8_scales(w, strategy, group)
    if candidates == 1:
        return scale, full
    w64, h = w.double(), hessian.double()
    best_err, best_f = None, None
    for i in range(candidates):
        f = 1.0 + i / candidates
        err = _group_errors(w64 - round_e4m3(w.float(), full * f).double(), h, strategy, group)
        if best_err is None:
            best_err, best_f = err, torch.ones_like(err)
        else:
            better = err < best_err
            best_err, best_f = torch.where(better, err, best_err), torch.where(better, torch.full_like(err, f), best_f)
    scale = (scale * best_f.float().view(scale.shape)).contiguous()
    return scale, full_scale(scale, strategy, *w.shape).contiguous()


def _group_errors(e: torch.Tensor, h: torch.Tensor, strategy: str, group: int = 0) -> torch.Tensor:
    """Output error of the error e [N, K] per scale group: [1] (tensor), [N] (rows: exact, the error is
    the sum of e_r H e_r^T), [ceil(N/128), ceil(K/128)] (blocks: each block's columns' own H), [N, K/group]
    (a row's groups: each by its columns' own H)."""
    if strategy == "group":
        n, k = e.shape
        eg = e.view(n, k // group, group)                                             # [N, G, g]
        hg = h.view(k // group, group, k // group, group).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [G, g, g]
        return torch.einsum("ngi,gij,ngj->ng", eg, hg, eg)
    if strategy != "block":
        rows = ((e @ h) * e).sum(dim=1)
        return rows if strategy == "channel" else rows.sum().reshape(1)
    n, k = e.shape
    out = torch.zeros(-(-n // BLOCK), -(-k // BLOCK), dtype=e.dtype)
    for j in range(out.shape[1]):
        cols = slice(j * BLOCK, min((j + 1) * BLOCK, k))
        part = ((e[:, cols] @ h[cols, cols]) * e[:, cols]).sum(dim=1)             # [N]
        out[:, j] = nn.functional.pad(part, (0, -n % BLOCK)).view(-1, BLOCK).sum(dim=1)
    return out


@torch.no_grad()
def quantize_sequentially(model: nn.Module, sequences: list[list[int]], cfg: QuantizeConfig,
                          progress=None) -> tuple[dict[str, QuantizedLinear], int]:
    """Every target linear rounded, decoder layer by decoder layer: layer i's H read on the outputs of
    layers 0..i-1 holding their rounded weights (module docstring, step 2); `progress(i, layers)` after each.
    The model's target weights end rounded (the codes times their scales). Returns (quantized, tokens)."""
    linears, layers = target_linears(model), decoder_layers(model)
    if layers is None:
        raise ValueError(f"quantize: {type(model).__name__} has no model.layers; use sequential=False")
    calls = _first_layer_calls(model, layers[0], sequences)
    tokens = sum(len(ids) for ids in sequences)
    out = {}
    for i, layer in enumerate(layers):
        inside = {id(m) for m in layer.modules()}
        mine = {n: m for n, m in linears.items() if id(m) in inside}
        sums, handles = _accumulating(mine)
        try:
            for args, kwargs in calls:
                layer(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        for name, linear in mine.items():
            out[name] = _round_in_place(linear, sums[name] / tokens, cfg)
        calls = [_with_hidden(args, kwargs, _hidden(layer(*args, **kwargs))) for args, kwargs in calls]
        if progress:
            progress(i + 1, len(layers))
    rest = [n for n in linears if n not in out]                   # target linears outside the layers
    if rest:
        hessians, _ = collect_hessians(model, sequences, names=rest)
        out.update({n: _round_in_place(linears[n], hessians[n], cfg) for n in rest})
    return out, tokens


def _first_layer_calls(model: nn.Module, first: nn.Module, sequences) -> list[tuple[tuple, dict]]:
    """Per sequence, the (args, kwargs) the model calls its first decoder layer with (no KV cache)."""
    calls = []

    def keep(_module, args, kwargs):
        calls.append((args, kwargs))
        raise _StopForward

    handle = first.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                model(torch.tensor([ids]), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return calls


def _hidden(output) -> torch.Tensor:
    """A decoder layer's output hidden states (older transformers return them first in a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    """The same call with `hidden` as its hidden states (positional, or the `hidden_states` keyword)."""
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _round_in_place(linear: nn.Linear, hessian: torch.Tensor, cfg: QuantizeConfig) -> QuantizedLinear:
    """The layer quantized, and its weight replaced by the rounded values the checkpoint will hold."""
    q = quantize_linear(linear.weight.data, hessian, cfg)
    linear.weight.data.copy_(q.codes.float() * q.full)
    return q


def write_checkpoint(out: str, model: nn.Module, source, quantized: dict[str, QuantizedLinear],
                     cfg: QuantizeConfig, tokens: int, tuning=None) -> None:
    """The checkpoint at `out`: model.safetensors, config.json, the tokenizer, quantize_report.json (with
    the scale tuning's TuningResult, when the scales were tuned)."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    tied = getattr(source.hf_config, "tie_word_embeddings", False)
    tensors = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            q = quantized[module]
            tensors[name], tensors[module + ".weight_scale"] = q.codes, q.scale
        else:
            tensors[name] = t
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    config = source.hf_config
    config.quantization_config = quantization_config(cfg.strategy, cfg.group_size)
    config.save_pretrained(out)
    source.load_tokenizer().save_pretrained(out)
    generation = os.path.join(source.path, "generation_config.json")       # an HF directory's extra EOS ids
    if os.path.isdir(source.path) and os.path.isfile(generation):
        shutil.copy(generation, out)
    report = {"source": source.path, "settings": asdict(cfg), "calibration_tokens": tokens,
              "layers": {n: {"output_error": q.error, "rtn_output_error": q.rtn_error}
                         for n, q in quantized.items()}}
    if tuning is not None:
        report["scale_tuning"] = {"heldout_kl_before": tuning.heldout_kl_before,
                                  "heldout_kl_after": tuning.heldout_kl_after, "kept": tuning.kept,
                                  "steps": len(tuning.losses)}
    with open(os.path.join(out, REPORT_FILE), "w") as f:
        json.dump(report, f, indent=2)


def quantization_config(strategy: str, group_size: int = 0) -> dict:
    """compressed-tensors' description of FP8 E4M3 weights (static, symmetric), float activations."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
    if strategy == "group":
        weights["group_size"] = group_size
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}
