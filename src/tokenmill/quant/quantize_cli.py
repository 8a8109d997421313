"""`tokenmill quantize --model M --out DIR`: a float checkpoint (HF directory or GGUF) written as an FP8
E4M3 compressed-tensors checkpoint (quant/offline.py), rounded by GPTQ on text the model writes itself or
to nearest, with progress bars; `LLM(model=DIR)` and `tokenmill serve --model DIR` load it."""
from __future__ import annotations

import argparse
import time


def add_quantize_parser(sub) -> None:
    from tokenmill.quant.gptq import GPTQConfig
    from tokenmill.quant.offline import ALGORITHMS, STRATEGIES, QuantizeConfig
    d, g = QuantizeConfig(), GPTQConfig()
    p = sub.add_parser("quantize", help="write an FP8 (E4M3) checkpoint of a float model, GPTQ-rounded")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the default model)")
    p.add_argument("--out", required=True,
                   help="directory for the quantized checkpoint (created if missing; not the model's own)")
    p.add_argument("--scheme", default="fp8", choices=["fp8"], help="the number format written")
    p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES,
                   help="one FP8 scale per tensor, per output row (channel), per 128 x 128 block, or per row "
                        "and group of --group-size inputs (group)")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help="inputs per scale with --strategy group: 16, 32 or a multiple of 64")
    p.add_argument("--algorithm", default=d.algorithm, choices=ALGORITHMS,
                   help="gptq: rounding that keeps each layer's output on the calibration text; rtn: nearest")
    p.add_argument("--num-calibration-sequences", type=int, default=d.num_sequences,
                   help="sequences the model writes for calibration (gptq)")
    p.add_argument("--calibration-max-tokens", type=int, default=d.max_tokens,
                   help="tokens generated per calibration sequence")
    p.add_argument("--damp", type=float, default=g.damp, help="GPTQ damping, a fraction of H's mean diagonal")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=g.act_order,
                   help="GPTQ: the most active input columns first")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=d.sequential,
                   help="GPTQ: calibrate each decoder layer on the already-rounded layers before it (a forward "
                        "pass per layer); --no-sequential: one pass of the float model for every layer")
    p.add_argument("--scale-search", type=int, default=d.scale_search,
                   help="scale factors in [1, 2) tried per scale group, the one with the least output error kept "
                        "(1: absmax / 448 as round-to-nearest sets it)")
    p.add_argument("--tune-scales-epochs", type=int, default=d.tuning.epochs,
                   help="after rounding, train the scales (codes fixed) on the calibration text against the "
                        "float model's next-token distributions, this many passes (0: GPTQ's scales as they are)")
    p.add_argument("--tune-scales-lr", type=float, default=d.tuning.lr, help="the scale tuning's step size")
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(ns) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from tokenmill import LLM
    from tokenmill.loaders import open_model_source
    from tokenmill.quant import offline
    from tokenmill.quant.gptq import GPTQConfig
    from tokenmill.quant.scale_tuning import ScaleTuningConfig
    from tokenmill.selfgen import written_sequences
    cfg = offline.QuantizeConfig(strategy=ns.strategy, group_size=ns.group_size, algorithm=ns.algorithm,
                                 gptq=GPTQConfig(damp=ns.damp, act_order=ns.act_order),
                                 num_sequences=ns.num_calibration_sequences, max_tokens=ns.calibration_max_tokens,
                                 seed=ns.seed, sequential=ns.sequential, scale_search=ns.scale_search,
                                 tuning=ScaleTuningConfig(epochs=ns.tune_scales_epochs, lr=ns.tune_scales_lr))
    console, t0 = Console(stderr=True), time.perf_counter()
    source = open_model_source(ns.model)
    offline.check_out(ns.out, source.path)
    offline.check_dense(source.hf_config)
    offline.check_groups_fit(source.hf_config, cfg)
    with Progress(console=console) as progress:
        hessians, tokens, tuning = None, 0, None
        if cfg.needs_text:
            task = progress.add_task(f"the model writes {cfg.num_sequences} calibration texts", total=None)
            llm = LLM(ns.model, enable_prefix_caching=False)
            sequences = written_sequences(llm, cfg.num_sequences, cfg.max_tokens, cfg.seed)
            del llm
            progress.update(task, total=1, completed=1)
        model = offline.float_model(source)
        if cfg.algorithm == "gptq" and cfg.sequential:
            task = progress.add_task("calibrating and rounding layer by layer", total=None)
            quantized, tokens = offline.quantize_sequentially(
                model, sequences, cfg, lambda done, total: progress.update(task, completed=done, total=total))
        else:
            if cfg.algorithm == "gptq":
                task = progress.add_task("reading the calibration texts", total=len(sequences))
                hessians, tokens = offline.collect_hessians(model, sequences, lambda: progress.advance(task))
            quantized = quantize_all(model, hessians, cfg, progress)
        if cfg.tuning.epochs:
            tuning = tune(model, source, quantized, sequences, cfg, progress)
    offline.write_checkpoint(ns.out, model, source, quantized, cfg, tokens, tuning)
    done = f"saved {ns.out}: {len(quantized)} layers in FP8 ({cfg.strategy}, {cfg.algorithm})"
    if tokens:
        ratio = sum(q.error for q in quantized.values()) / max(sum(q.rtn_error for q in quantized.values()), 1e-30)
        done += f", output error {ratio:.1%} of round-to-nearest's on {tokens} calibration tokens"
    if tuning is not None:
        done += (f"; scales tuned: held-out KL {tuning.heldout_kl_before:.5f} -> {tuning.heldout_kl_after:.5f} nats"
                 + ("" if tuning.kept else " (not lower: GPTQ's scales kept)"))
    console.print(f"{done}, {time.perf_counter() - t0:.0f} s")
    return 0


def tune(model, source, quantized, sequences, cfg, progress):
    """The scales trained end to end against the float model (quant/scale_tuning.py); its TuningResult."""
    from tokenmill.quant import offline
    from tokenmill.quant.scale_tuning import tune_scales
    teacher = offline.float_model(source)
    task = progress.add_task(f"tuning the scales ({cfg.tuning.epochs} epochs)", total=None)

    def on_step(step, steps, loss):
        progress.update(task, completed=step, total=steps, description=f"tuning the scales: KL {loss:.5f}")
    return tune_scales(model, teacher, quantized, sequences, cfg.strategy, cfg.tuning, cfg.seed, on_step)


def quantize_all(model, hessians, cfg, progress) -> dict:
    """Every target linear quantized (quant/offline.py); without calibration (rtn) H is the identity."""
    import torch
    from tokenmill.quant import offline
    linears = offline.target_linears(model)
    task = progress.add_task(f"rounding {len(linears)} layers ({cfg.algorithm})", total=len(linears))
    out = {}
    for name, m in linears.items():
        h = hessians[name] if hessians else torch.eye(m.in_features, dtype=torch.float64)
        out[name] = offline.quantize_linear(m.weight.data, h, cfg)
        progress.advance(task)
    return out
