"""Start-up calibration of the step-time model: a few seconds of synthetic steps of known shapes (decode
batches of several sizes, prefills of several lengths), whose fitted coefficients become the model's prior.

The result is cached per machine and model (a JSON file under $TOKENMILL_CACHE_DIR/step-time/, keyed by the
CPU, the thread count, the model file and every engine setting that changes a step's kernels), so only the
first start on a machine pays for it. The engine keeps refitting online from real steps afterwards.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import time

from tokenmill.core.request import Request
from tokenmill.core.step_time import FEATURE_NAMES, StepTimeModel
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

# (requests, prompt tokens, output tokens): decode batches of several sizes, then prefill-heavy shapes, then
# short prompts (8 to 48 tokens, each a prefill step of a few ms) beside the long ones (128, 512): their
# repeats tell the fixed cost of a step carrying prefill (per_prefill_step) from the per-token one, within
# the noise of the long steps
PHASES = ((1, 32, 6), (4, 32, 6), (16, 32, 6), (24, 16, 6), (1, 512, 2), (1, 128, 2)) \
    + ((1, 8, 2), (2, 8, 2), (1, 16, 2), (1, 48, 2)) * 3
# (decoding requests, a joining prompt's tokens): a prompt arriving while a batch decodes, so that one step
# carries both (what per_mixed_step, the cost of a step with prefill beside decode rows, is fit on)
MIXED_PHASES = ((4, 16), (12, 16), (24, 16), (12, 48), (24, 8)) * 4
_MIXED_DECODE = (16, 8)                                # the decoding requests' prompt and output tokens
WARMUP = (2, 16, 3)
# 2: the per-step prefill terms; 3: int4 / int8 prompt chunks run one bfloat16 GEMM on AMX CPUs
# (quant/tile_kernels.py), where version 2's coefficients priced them at the tile kernels' speed; 4: with the
# AMX tile kernels, prompt chunks under 1,280 rows stay on them (QuantMethod.prefill_rows_from)
CACHE_VERSION = 4


def cache_root() -> str:
    return os.path.join(os.environ.get("TOKENMILL_CACHE_DIR", os.path.expanduser("~/.cache/tokenmill")),
                        "step-time")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(config) -> str:
    """Machine + model + the settings that change what a step runs."""
    import torch

    from tokenmill.quant import tile_kernels
    path = config.model_path
    stat = os.stat(path) if os.path.isfile(path) else None
    facts = {"version": CACHE_VERSION, "cpu": _cpu_name(), "cores": os.cpu_count(),
             "threads": torch.get_num_threads(), "torch": torch.__version__, "model": os.path.abspath(path),
             "model_size": stat.st_size if stat else None, "model_mtime": stat.st_mtime if stat else None,
             "dtype": str(config.model.dtype), "quantization": config.quantization,
             "device": config.device, "attention": config.attention_backend, "native_decode": config.native_decode_layers,
             "greedy_screen": config.greedy_screen, "block_size": config.cache.block_size,
             "kv_cache_dtype": str(config.model.kv_cache_dtype), "amx_min_rows": tile_kernels.amx_threshold()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def load_cached(key: str) -> dict[str, float] | None:
    try:
        with open(os.path.join(cache_root(), f"{key}.json")) as f:
            coeffs = json.load(f)["coefficients"]
        return {k: float(coeffs[k]) for k in FEATURE_NAMES}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(key: str, coeffs: dict[str, float], seconds: float) -> None:
    root = cache_root()
    try:
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, f"{key}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"coefficients": coeffs, "calibration_s": seconds, "created": time.time()}, f)
        os.replace(tmp, os.path.join(root, f"{key}.json"))
    except OSError as e:
        logger.warning("tokenmill: could not cache the step-time calibration (%s)", e)


def seed_step_model(core, use_cache: bool = True) -> str:
    """Give core.step_model its prior: from the cache, or by calibrating now. Returns "cache" or "calibrated"."""
    key = cache_key(core.config)
    coeffs = load_cached(key) if use_cache else None
    if coeffs is not None:
        core.step_model.set_prior(coeffs)
        return "cache"
    t0 = time.perf_counter()
    coeffs = calibrate(core)
    seconds = time.perf_counter() - t0
    logger.info("tokenmill: step-time calibration %.1f s: %s", seconds,
                ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in coeffs.items()))
    if use_cache:
        save_cached(key, coeffs, seconds)
    return "calibrated"


def calibrate(core) -> dict[str, float]:
    """Run the phases that fit this engine's limits through core (an idle EngineCore) and fit a fresh
    model to their steps; core.step_model ends with those coefficients as its prior."""
    if core.has_unfinished():
        raise RuntimeError("calibration needs an idle engine")
    kv_counters = core.kv.prefix_queries_tokens, core.kv.prefix_hits_tokens
    rng = random.Random(0)
    fitted = StepTimeModel(decay=1.0)
    # plain steps, the shapes the model's features name; synthetic requests, no load for the policy to learn
    with core.speculation_paused(), core.scheduler.policy.learning_paused():
        _run_phase(core, *WARMUP, rng, "w")            # first steps pay one-time costs: not observed
        core.replace_step_model(fitted)
        for i, phase in enumerate(PHASES):
            if _fits(core, *phase):
                _run_phase(core, *phase, rng, str(i))
        for i, (decoders, joiner) in enumerate(MIXED_PHASES):
            if _fits(core, decoders + 1, max(joiner, _MIXED_DECODE[0]), _MIXED_DECODE[1]):
                _run_phase(core, decoders, *_MIXED_DECODE, rng, f"m{i}", joiner=joiner)
    coeffs = fitted.coefficients
    core.replace_step_model(StepTimeModel(prior=coeffs))
    core.kv.prefix_queries_tokens, core.kv.prefix_hits_tokens = kv_counters
    return coeffs


def _fits(core, num_requests: int, prompt_len: int, output_len: int) -> bool:
    sc = core.config.scheduler
    capacity = core.kv.num_blocks * core.kv.block_size
    return (num_requests <= sc.max_num_seqs and prompt_len + output_len <= sc.max_model_len
            and num_requests * (prompt_len + output_len + core.kv.block_size) <= capacity)


def _run_phase(core, num_requests: int, prompt_len: int, output_len: int, rng: random.Random, tag: str,
               joiner: int = 0) -> None:
    """num_requests prompts of prompt_len random tokens, each run to output_len tokens; joiner > 0: a
    prompt of that many tokens (2 output tokens) added once they decode, so one step carries both."""
    for j in range(num_requests):
        core.add_request(_request(core, f"{tag}-{j}", prompt_len, output_len, rng))
    if joiner:
        core.step()                                    # their prefill, then a decode-only step
        core.step()
        core.add_request(_request(core, f"{tag}-join", joiner, 2, rng))
    while core.has_unfinished():
        core.step()
    core.step()                                        # hands the finished ids to the runner


def _request(core, tag: str, prompt_len: int, output_len: int, rng: random.Random) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    prompt = [rng.randrange(core.config.model.vocab_size) for _ in range(prompt_len)]
    return Request(f"__calibration-{tag}", prompt, params)
