"""Server options: one frozen dataclass, built once from CLI flags (`tokenmill serve`)."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from tokenmill.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"                  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None               # None: no authentication
    max_waiting_requests: int = 512          # sequences queued beyond the running batch before 429
    max_n: int = 16                          # completions per prompt (the `n` field)
    max_logprobs: int = MAX_LOGPROBS         # top-k logprobs per token a request may ask for
    max_request_body_bytes: int = 8 * 1024 * 1024
    shutdown_grace_s: float = 30.0           # on SIGTERM/SIGINT: time to finish in-flight requests
    retry_after_s: int = 1                   # Retry-After header of a 429
    log_level: str = "info"
    metrics_prefix: str = "tokenmill:"      # of every /metrics name; "vllm:" serves vLLM's names as they are
    # The default SLO class: latency targets of requests that bring none (ms); a bench profile name
    # (llama3.1-8b: 2000 / 100, llama3.1-8b-interactive: 500 / 30) fills the ones not given.
    slo_profile: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", self.log_level.lower())
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"log_level must be one of critical, error, warning, info, debug; got {self.log_level!r}")
        _at_least("port", self.port, 0)
        _at_least("max_waiting_requests", self.max_waiting_requests, 0)
        _at_least("max_n", self.max_n, 1)
        _at_least("max_request_body_bytes", self.max_request_body_bytes, 1)
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        self._resolve_slo_class()
        if not _METRIC_PREFIX.fullmatch(self.metrics_prefix):
            raise ValueError(f"metrics_prefix must start a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), "
                             f"got {self.metrics_prefix!r}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

    def _resolve_slo_class(self) -> None:
        if self.slo_profile is not None:
            from tokenmill.bench.profiles import get_profile   # the limits live with the bench profiles
            profile = get_profile(self.slo_profile)
            if self.slo_ttft_ms is None:
                object.__setattr__(self, "slo_ttft_ms", profile.ttft_limit_ms)
            if self.slo_tpot_ms is None:
                object.__setattr__(self, "slo_tpot_ms", profile.tpot_limit_ms)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of milliseconds > 0, got {value}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("server")
        g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
        g.add_argument("--port", type=int, default=8000)
        g.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize")
        g.add_argument("--max-waiting-requests", type=int, default=512,
                       help="sequences allowed to wait beyond the running batch; more get 429")
        g.add_argument("--max-n", type=int, default=16, help="largest `n` a request may ask for")
        g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                       help="largest logprobs / top_logprobs a request may ask for")
        g.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                       help="larger request bodies get 413")
        g.add_argument("--metrics-prefix", default="tokenmill:",
                       help="prefix of every /metrics name (e.g. 'vllm:' for gateways that read vLLM's names)")
        g.add_argument("--slo-profile", default=None,
                       help="default latency targets from a bench profile (llama3.1-8b, llama3.1-8b-interactive)")
        g.add_argument("--slo-ttft-ms", type=float, default=None, help="default TTFT target of a request (ms)")
        g.add_argument("--slo-tpot-ms", type=float, default=None, help="default TPOT target of a request (ms)")
        g.add_argument("--shutdown-grace-s", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, time to finish in-flight requests before aborting them")
        # SUPPRESS: `tokenmill --log-level X serve` keeps the main CLI's value.
        g.add_argument("--log-level", default=argparse.SUPPRESS, type=str.lower,
                       choices=["critical", "error", "warning", "info", "debug"])

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerConfig":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


_METRIC_PREFIX = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?")   # empty: the bare names


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
