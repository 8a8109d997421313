"""A benchmark session: one SUT and one dataset, started once, then any number of scenario runs.

`BenchConfig` (frozen) gathers the user's choices; `BenchSession` builds the SUT (in-process engine
or HTTP), the dataset, the energy meter and the bandwidth figure, and turns each run into an
`Outcome` (records + metrics, verdict, efficiency).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.bench import datasets as ds
from tokenmill.bench.efficiency import (Efficiency, EnergyMeter, compute_efficiency, decode_bytes_per_step,
                                        local_device_name, resolve_bandwidth)
from tokenmill.bench.metrics import Limits
from tokenmill.bench.profiles import Profile
from tokenmill.bench.records import Sample
from tokenmill.bench.runner import RunResult, run_scenario_async
from tokenmill.bench.scenarios import Scenario
from tokenmill.bench.sut.base import SUT
from tokenmill.bench.verdict import Verdict, judge


@dataclass(frozen=True)
class BenchConfig:
    profile: Profile
    url: str | None = None                  # None: the engine in-process
    engine_args: object | None = None       # tokenmill.config.EngineArgs for in-process runs
    served_model_name: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None            # local tokenizer for HTTP re-tokenization / synthetic vocab
    dataset: str = "synthetic"              # "synthetic" | "jsonl" | "cnndm"
    dataset_path: str | None = None
    num_samples: int = 64
    prompt_len: str = "128"                 # tokens (see datasets.LengthDist.parse)
    output_len: str = "128"                 # tokens
    exact_output: bool = True               # synthetic: ignore_eos + min_tokens = max_tokens
    vocab_size: int | None = None           # synthetic over HTTP without a tokenizer
    temperature: float | None = None        # None: the profile's (greedy)
    seed: int = 0
    request_timeout_s: float | None = None  # s per request; None: no limit
    progress: bool = True
    mem_bandwidth_gbs: float | None = None
    usd_per_hour: float | None = None
    weights_bytes: int | None = None        # model weight bytes for the decode roofline
    kv_bytes_per_token: int | None = None

    @property
    def limits(self) -> Limits:
        return Limits(self.profile.ttft_limit_ms, self.profile.tpot_limit_ms, self.profile.latency_percentile)

    @property
    def effective_temperature(self) -> float:
        return 0.0 if self.temperature is None else self.temperature


@dataclass
class Outcome:
    label: str
    result: RunResult
    verdict: Verdict
    efficiency: Efficiency | None = None
    extra: dict = field(default_factory=dict)


def build_sut(cfg: BenchConfig) -> SUT:
    if cfg.url:
        from tokenmill.bench.sut.http import HttpConfig, HttpSUT
        tok = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
        return HttpSUT(HttpConfig(cfg.url, cfg.served_model_name, cfg.api_key, cfg.effective_temperature), tok)
    from tokenmill.bench.sut.inprocess import InProcessSUT
    from tokenmill.config import EngineArgs
    args = cfg.engine_args or EngineArgs()
    if not cfg.profile.prefix_caching and getattr(args, "enable_prefix_caching", False):
        args = dataclasses.replace(args, enable_prefix_caching=False)    # MLPerf: no KV reuse across queries
    return InProcessSUT.from_engine_args(args, cfg.effective_temperature)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"cannot load tokenizer {path!r} from local files ({type(e).__name__}: {e})") from None


def build_dataset(cfg: BenchConfig, tokenizer) -> list[Sample]:
    cap = cfg.profile.max_output_tokens
    if cfg.dataset == "synthetic":
        vocab = cfg.vocab_size or (len(tokenizer) if tokenizer is not None else None)
        if vocab is None:
            raise ValueError("synthetic prompts need a vocabulary: pass --tokenizer or --vocab-size")
        special = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        samples = ds.synthetic_dataset(cfg.num_samples, ds.LengthDist.parse(cfg.prompt_len),
                                       ds.LengthDist.parse(cfg.output_len), vocab, cfg.seed, special,
                                       cfg.exact_output)
    elif cfg.dataset in ("jsonl", "cnndm"):
        if not cfg.dataset_path:
            raise ValueError(f"--dataset {cfg.dataset} needs --dataset-path")
        if cfg.dataset == "jsonl":
            max_out = ds.LengthDist.parse(cfg.output_len).a
            samples = ds.jsonl_dataset(cfg.dataset_path, int(max_out), tokenizer, cfg.num_samples)
        else:
            samples = ds.cnndm_dataset(cfg.dataset_path, tokenizer, cfg.num_samples)
    else:
        raise ValueError(f"unknown dataset {cfg.dataset!r}: expected synthetic, jsonl or cnndm")
    if cap is not None:
        samples = [_capped(s, cap) for s in samples]
    return samples


def _capped(s: Sample, cap: int) -> Sample:
    if s.max_output_tokens <= cap:
        return s
    return dataclasses.replace(s, max_output_tokens=cap, min_output_tokens=min(s.min_output_tokens, cap))


def engine_model_info(sut: SUT) -> tuple[int | None, int | None, str]:
    """(weight bytes as computed with, KV bytes per token, source) from the in-process engine's public
    model_info(); (None, None, "not available") for remote endpoints."""
    engine = getattr(sut, "engine", None)
    if engine is None or not hasattr(engine, "model_info"):
        return None, None, "not available"
    info = engine.model_info()
    return info["weight_bytes"], info["kv_bytes_per_token"], "engine model_info()"


def engine_step_time_model(sut: SUT) -> dict | None:
    """The engine's step-time model after a run: in-process, LLMEngine.step_time_model(); over HTTP, a
    tokenmill server's /metrics gauges (step_time_model_seconds); None where neither is there."""
    engine = getattr(sut, "engine", None)
    describe = getattr(engine, "step_time_model", None)
    if callable(describe):
        return describe()
    text = _server_metrics(sut)
    return None if text is None else step_time_model_from_metrics(text)


def _server_metrics(sut: SUT) -> str | None:
    """The /metrics text of the server an HTTP SUT talks to; None in process or when it does not answer."""
    url = getattr(getattr(sut, "config", None), "base_url", None)
    if not url:
        return None
    import httpx
    try:
        return httpx.get(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None


def step_time_model_from_metrics(text: str) -> dict | None:
    """Parse `<prefix>step_time_model_seconds{...,term="T"} v` lines (server/metrics.py) into the shape of
    LLMEngine.step_time_model()."""
    coeffs, observations, replicas, decode_yield = {}, None, 1, {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name.endswith("step_time_model_decode_yield_tokens") and 'kind="' in line:
            decode_yield[line.split('kind="', 1)[1].split('"', 1)[0] + "_tokens"] = float(line.rsplit(" ", 1)[1])
        elif name.endswith("step_time_model_seconds") and 'term="' in line:
            coeffs[line.split('term="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif name.endswith("step_time_model_observations_total"):
            observations = int(float(line.rsplit(" ", 1)[1]))
        elif name.endswith("step_time_model_replicas"):
            replicas = int(float(line.rsplit(" ", 1)[1]))
    if not {"intercept", "per_decode_row", "per_prefill_token", "per_context_read"} <= set(coeffs):
        return None
    for term in ("per_prefill_step", "per_mixed_step"):
        coeffs.setdefault(term, 0.0)                   # a server from before these terms
    return {"coefficients": coeffs, "intercept_ms": 1e3 * coeffs["intercept"],
            "per_decode_row_ms": 1e3 * coeffs["per_decode_row"], "per_prefill_token_ms": 1e3 * coeffs["per_prefill_token"],
            "per_1k_context_reads_ms": 1e6 * coeffs["per_context_read"],
            "per_prefill_step_ms": 1e3 * coeffs["per_prefill_step"],
            "per_mixed_step_ms": 1e3 * coeffs["per_mixed_step"], "observations": observations,
            "replicas": replicas, "source": "server /metrics", "policy": "server's",
            "decode_yield": decode_yield if {"new_tokens", "output_tokens"} <= set(decode_yield) else None}


def engine_spec_decode(sut: SUT) -> dict | None:
    """Speculative decoding counters since the engine started: in-process from its stats, over HTTP from a
    tokenmill server's spec_decode_* counters; None where speculation is off or unknown."""
    engine = getattr(sut, "engine", None)
    stats = getattr(engine, "stats", None)
    if callable(stats):
        spec = getattr(stats(), "spec_decode", None)
        return None if spec is None else _spec_dict(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                                                    spec.accepted_per_position)
    text = _server_metrics(sut)
    return None if text is None else spec_decode_from_metrics(text)


def spec_decode_from_metrics(text: str) -> dict | None:
    """Parse `<prefix>spec_decode_*_total` counters (server/metrics.py)."""
    totals, per = {}, {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if "spec_decode_num_accepted_tokens_per_pos_total" in name and 'position="' in line:
            per[int(line.split('position="', 1)[1].split('"', 1)[0])] = int(float(line.rsplit(" ", 1)[1]))
        elif "spec_decode_" in name and name.endswith("_total") and not line.startswith("#"):
            totals[name.split("spec_decode_", 1)[1].removesuffix("_total")] = int(float(line.rsplit(" ", 1)[1]))
    if "num_drafts" not in totals:
        return None
    return _spec_dict(totals["num_drafts"], totals.get("num_draft_tokens", 0), totals.get("num_accepted_tokens", 0),
                      [per[i] for i in sorted(per)])


def _spec_dict(drafts: int, draft_tokens: int, accepted: int, per_position: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "accepted_per_position": list(per_position),
            "mean_acceptance_length": (accepted + drafts) / drafts if drafts else None}


class BenchSession:
    def __init__(self, cfg: BenchConfig, sut: SUT | None = None):
        self.cfg = cfg
        self.sut = sut or build_sut(cfg)
        self.samples: list[Sample] = []
        self.meter: EnergyMeter | None = None

    async def __aenter__(self) -> "BenchSession":
        await self.sut.start()
        try:
            self.samples = build_dataset(self.cfg, self.sut.tokenizer)
        except Exception:
            await self.sut.close()
            raise
        self.meter = EnergyMeter()
        device = local_device_name()
        self.bandwidth = resolve_bandwidth(self.cfg.mem_bandwidth_gbs, device,
                                           measure_cpu=self.cfg.url is None and device is None)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sut.close()

    async def run(self, scenario: Scenario, label: str | None = None, prefix: str = "q") -> Outcome:
        limits = self.cfg.limits
        self.sut.latency_targets = None if scenario.name == "Offline" else (limits.ttft_ms, limits.tpot_ms)
        self.meter.start()
        result = await run_scenario_async(self.sut, self.samples, scenario, self.cfg.limits,
                                          self.cfg.request_timeout_s, self.cfg.progress, prefix)
        outcome = self.outcome(result, self.meter.stop_joules(), label or scenario.name)
        model = engine_step_time_model(self.sut)
        if model is not None:
            outcome.extra["step_time_model"] = model
        spec = engine_spec_decode(self.sut)
        if spec is not None:
            outcome.extra["spec_decode"] = spec
        return outcome

    def outcome(self, result: RunResult, joules: float | None, label: str) -> Outcome:
        """Verdict and efficiency for a finished run."""
        return Outcome(label, result, judge(result, self.cfg.profile), self._efficiency(result, joules))

    def _efficiency(self, result: RunResult, joules: float | None) -> Efficiency:
        m = result.metrics
        weights, kv, source = engine_model_info(self.sut)
        weights = self.cfg.weights_bytes or weights
        kv = self.cfg.kv_bytes_per_token or kv
        if self.cfg.weights_bytes:
            source = "user (--weights-bytes)"
        done = [r for r in result.records if r.ok]
        decode_time = sum(r.completed_s - r.first_token_s for r in done)
        mean_batch = decode_time / m.duration_s if m.duration_s > 0 else 0.0     # Little's law
        mean_ctx = (sum((r.num_prompt_tokens or 0) + r.num_output_tokens / 2 for r in done) / len(done)) if done else 0
        bytes_per_step = decode_bytes_per_step(weights, kv, mean_batch, mean_ctx)
        if bytes_per_step and not kv:
            source += " (weights only: KV bytes unknown)"
        tps = m.tokens_per_s if result.scenario == "Offline" else m.completed_tokens_per_s
        tpot_ms = m.tpot_ms.get("p50")
        return compute_efficiency(tps, tpot_ms / 1000.0 if tpot_ms else None, bytes_per_step, source,
                                  self.bandwidth, joules, self.meter.source, m.total_output_tokens,
                                  self.cfg.usd_per_hour)
