"""Tuning a rounded FP8 checkpoint's scales end to end (`tokenmill quantize --tune-scales-epochs N`).

GPTQ (quant/gptq.py) keeps each layer's own output close on the calibration text, one layer at a time; what
a user measures is the model's next-token distribution. After rounding, the codes stay as they are and only
each scale group's scale (a row, a 128 x 128 block or the tensor: exactly the checkpoint's `weight_scale`)
is trained, by gradient descent on the mean KL(float model || rounded model) of the next-token distributions
over the calibration sequences, the float model as teacher. Every weight stays `code x weight_scale` with
its code unchanged, so the checkpoint's meaning and layout are those of any FP8 checkpoint.

Parameters: one log-factor per scale group, s = s0 * exp(f), f starting at 0 (so a scale stays positive and
a step moves it by a relative amount). A tenth of the sequences (at least one; with a single sequence, that
one is both trained on and checked) is held out; the tuned scales are kept only if their held-out KL is below
the rounded model's (otherwise the scales are left as GPTQ set them, and the report says so)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant.fp8 import full_scale


@dataclass(frozen=True)
class ScaleTuningConfig:
    epochs: int = 0                   # passes over the training sequences (0: no tuning)
    lr: float = 3e-4                  # Adam's step on the log-factors (cosine decay to 0)
    holdout: float = 0.1              # share of the sequences kept out of training, for the KL check

    def __post_init__(self) -> None:
        if not isinstance(self.epochs, int) or self.epochs < 0:
            raise ValueError(f"quantize: scale tuning epochs must be an integer >= 0, got {self.epochs!r}")
        if not self.lr > 0 or not 0 < self.holdout < 1:
            raise ValueError(f"quantize: scale tuning needs lr > 0 and holdout in (0, 1), got {self.lr} and "
                             f"{self.holdout}")


@dataclass
class TuningResult:
    heldout_kl_before: float          # nats per token, held-out sequences, GPTQ's scales
    heldout_kl_after: float           # the same with the tuned scales
    kept: bool                        # the tuned scales replaced GPTQ's (held-out KL fell)
    losses: list[float] = field(default_factory=list)   # training KL per step


class _TunedLinear(nn.Module):
    """codes [N, K] x (scale * exp(log_factor)) expanded to each weight: the linear under training."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, strategy: str, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("codes", codes.float())
        self.register_buffer("scale", scale.float())
        self.log_factor = nn.Parameter(torch.zeros_like(self.scale))
        self.strategy, self.bias = strategy, bias

    def scales(self) -> torch.Tensor:
        return self.scale * self.log_factor.exp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.codes.shape
        return F.linear(x, self.codes * full_scale(self.scales(), self.strategy, n, k), self.bias)


def tune_scales(student: nn.Module, teacher: nn.Module, quantized: dict, sequences: list[list[int]],
                strategy: str, cfg: ScaleTuningConfig, seed: int = 0, on_step=None) -> TuningResult:
    """Trains the scales of `quantized` ({linear name: QuantizedLinear}, whose rounded weights `student`
    holds) against `teacher` (the float model) on the sequences; updates each QuantizedLinear's scale and
    full scales, and the student's weights, when kept. on_step(step, steps, loss) after each step."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    n_hold = max(1, round(len(sequences) * cfg.holdout)) if len(sequences) > 1 else 0
    held = [sequences[i] for i in order[:n_hold]]
    train = [sequences[i] for i in order[n_hold:]] or held
    tuned = _swap_in(student, quantized, strategy)
    try:
        before = mean_kl(student, teacher, held or train)
        losses = _train(student, teacher, tuned, train, cfg, on_step)
        after = mean_kl(student, teacher, held or train)
        kept = after < before
        if kept:
            for name, m in tuned.items():
                _update(quantized[name], m.scales().detach(), strategy)
    finally:
        _swap_out(student, quantized, tuned)
    return TuningResult(before, after, kept, losses)


def _train(student, teacher, tuned: dict, train: list[list[int]], cfg: ScaleTuningConfig, on_step) -> list[float]:
    params = [m.log_factor for m in tuned.values()]
    frozen = [p for p in student.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    steps, losses = cfg.epochs * len(train), []
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            loss = _kl(student, teacher, train[step % len(train)])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if on_step:
                on_step(step + 1, steps, loss.item())
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return losses


def _kl(student: nn.Module, teacher: nn.Module, ids: list[int]) -> torch.Tensor:
    """Mean over the sequence's positions of KL(teacher || student) of the next-token distributions, nats."""
    x = torch.tensor([ids])
    with torch.no_grad():
        t = teacher(x, use_cache=False).logits[0].float().log_softmax(dim=-1)
    s = student(x, use_cache=False).logits[0].float().log_softmax(dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


@torch.no_grad()
def mean_kl(student: nn.Module, teacher: nn.Module, sequences: list[list[int]]) -> float:
    """KL(teacher || student) per token over the sequences, nats."""
    total = tokens = 0.0
    for ids in sequences:
        total += _kl(student, teacher, ids).item() * len(ids)
        tokens += len(ids)
    return total / max(tokens, 1)


def _modules_by_name(model: nn.Module, names) -> dict[str, tuple[nn.Module, str]]:
    """{linear name: (its parent module, its attribute name)}."""
    out = {}
    for name in names:
        parent, _, attr = name.rpartition(".")
        out[name] = (model.get_submodule(parent) if parent else model, attr)
    return out


def _swap_in(model: nn.Module, quantized: dict, strategy: str) -> dict[str, _TunedLinear]:
    tuned = {}
    for name, (parent, attr) in _modules_by_name(model, quantized).items():
        linear = getattr(parent, attr)
        q = quantized[name]
        tuned[name] = _TunedLinear(q.codes, q.scale, strategy, linear.bias)
        tuned[name].original = [linear]              # a list: kept out of the module tree
        setattr(parent, attr, tuned[name])
    return tuned


def _swap_out(model: nn.Module, quantized: dict, tuned: dict) -> None:
    """The original nn.Linear modules back, holding each layer's rounded weight (codes x its full scales)."""
    for name, (parent, attr) in _modules_by_name(model, quantized).items():
        linear = tuned[name].original[0]
        q = quantized[name]
        with torch.no_grad():
            linear.weight.copy_(q.codes.float() * q.full)
        setattr(parent, attr, linear)


def _update(q, scale: torch.Tensor, strategy: str) -> None:
    n, k = q.codes.shape
    q.scale = scale.float().contiguous()
    q.full = full_scale(q.scale, strategy, n, k).contiguous()
