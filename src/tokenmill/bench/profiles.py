"""Benchmark profiles: latency limits, run-length minimums and generation rules.

Built-in profiles follow MLPerf's mlperf.conf for Llama 3.1 8B. A user config file (LoadGen style,
`model.scenario.key = value`, times in ms) can override fields; lookup order is `model.scenario.key`,
`*.scenario.key`, `model.*.key`, `*.*.key`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

SUBMISSION_MIN_DURATION_S = 600.0           # MLPerf's minimum per scenario
SUBMISSION_SERVER_MIN_QUERY_COUNT = 100      # LoadGen's TestSettings default for Server
SUBMISSION_OFFLINE_MIN_QUERY_COUNT = 13368   # llama3_1-8b.Offline.min_query_count (the dataset size)


def submission_min_query_count(scenario: str) -> int:
    return SUBMISSION_OFFLINE_MIN_QUERY_COUNT if scenario == "Offline" else SUBMISSION_SERVER_MIN_QUERY_COUNT


@dataclass(frozen=True)
class Profile:
    name: str
    ttft_limit_ms: float | None           # p99 TTFT limit, ms (Server); None: no limit
    tpot_limit_ms: float | None           # p99 TPOT limit, ms (Server); None: no limit
    latency_percentile: float = 0.99
    max_output_tokens: int | None = 128   # cap on every sample's max_tokens (None: no cap)
    min_output_tokens: int = 1
    greedy: bool = True
    prefix_caching: bool = False          # MLPerf: no KV reuse across queries
    min_duration_s: float = SUBMISSION_MIN_DURATION_S
    server_min_query_count: int = SUBMISSION_SERVER_MIN_QUERY_COUNT
    offline_min_query_count: int = SUBMISSION_OFFLINE_MIN_QUERY_COUNT

    @property
    def submission_length(self) -> bool:
        """Every minimum (duration, Server and Offline query counts) at least MLPerf's."""
        return not self.length_shortfalls("Server") and not self.length_shortfalls("Offline")

    def length_shortfalls(self, scenario: str) -> list[str]:
        """Each minimum a `scenario` run is held to that is below MLPerf's (empty: of submission length)."""
        out = []
        if self.min_duration_s < SUBMISSION_MIN_DURATION_S:
            out.append(f"minimum duration {self.min_duration_s:g} s is below MLPerf's {SUBMISSION_MIN_DURATION_S:g} s")
        count, mlperf = self.min_query_count(scenario), submission_min_query_count(scenario)
        if count < mlperf:
            out.append(f"minimum query count {count} is below MLPerf's {mlperf} for {scenario}")
        return out

    def min_query_count(self, scenario: str) -> int:
        """The minimum queries a `scenario` run must issue (Concurrency runs follow Server's)."""
        return self.offline_min_query_count if scenario == "Offline" else self.server_min_query_count

    def with_dev_length(self, min_duration_s: float, min_query_count: int,
                        offline_min_query_count: int | None = None) -> "Profile":
        """A shorter development setting: `min_query_count` is the Server (and concurrency) runs' minimum;
        Offline keeps its own unless `offline_min_query_count` is given. Reports flag a profile with any
        minimum below MLPerf's as not of submission length."""
        offline = self.offline_min_query_count if offline_min_query_count is None else offline_min_query_count
        return replace(self, min_duration_s=min_duration_s, server_min_query_count=min_query_count,
                       offline_min_query_count=offline)


PROFILES: dict[str, Profile] = {
    "llama3.1-8b": Profile("llama3.1-8b", ttft_limit_ms=2000.0, tpot_limit_ms=100.0),
    "llama3.1-8b-interactive": Profile("llama3.1-8b-interactive", ttft_limit_ms=500.0, tpot_limit_ms=30.0),
}
DEFAULT_PROFILE = "llama3.1-8b"

# mlperf.conf model names for each profile (LoadGen spells Llama 3.1 "llama3_1").
CONF_MODEL_NAMES = {"llama3.1-8b": "llama3_1-8b", "llama3.1-8b-interactive": "llama3_1-8b-interactive"}


def get_profile(name: str, ttft_ms: float | None = None, tpot_ms: float | None = None) -> Profile:
    """A built-in profile by name, or "custom" with the user's limits; explicit limits override."""
    if name == "custom":
        base = Profile("custom", ttft_limit_ms=None, tpot_limit_ms=None, max_output_tokens=None)
    elif name in PROFILES:
        base = PROFILES[name]
    else:
        raise ValueError(f"unknown profile {name!r}: expected one of {sorted(PROFILES) + ['custom']}")
    if ttft_ms is not None:
        base = replace(base, ttft_limit_ms=ttft_ms)
    if tpot_ms is not None:
        base = replace(base, tpot_limit_ms=tpot_ms)
    return base


def parse_conf(text: str) -> dict[str, str]:
    """`model.scenario.key = value` lines (# comments) -> {"model.scenario.key": "value"}."""
    out = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line or line.split("=", 1)[0].strip().count(".") != 2:
            raise ValueError(f"config line {n}: expected 'model.scenario.key = value', got {raw!r}")
        key, value = (s.strip() for s in line.split("=", 1))
        out[key] = value
    return out


def conf_lookup(conf: dict[str, str], model: str, scenario: str, key: str) -> str | None:
    for candidate in (f"{model}.{scenario}.{key}", f"*.{scenario}.{key}", f"{model}.*.{key}", f"*.*.{key}"):
        if candidate in conf:
            return conf[candidate]
    return None


def apply_conf(profile: Profile, path: str | Path, scenario: str) -> Profile:
    """Override a profile's limits and minimums from a LoadGen-style config file (times in ms)."""
    conf = parse_conf(Path(path).read_text(encoding="utf-8"))
    model = CONF_MODEL_NAMES.get(profile.name, profile.name)
    changes: dict = {}
    for key, field_name, scale in (("ttft_latency", "ttft_limit_ms", 1.0), ("tpot_latency", "tpot_limit_ms", 1.0),
                                   ("min_duration", "min_duration_s", 1e-3)):
        v = conf_lookup(conf, model, scenario, key)
        if v is not None:
            changes[field_name] = float(v) * scale
    v = conf_lookup(conf, model, scenario, "min_query_count")
    if v is not None:
        changes["server_min_query_count" if scenario == "Server" else "offline_min_query_count"] = int(v)
    v = conf_lookup(conf, model, scenario, "target_latency_percentile")
    if v is not None:
        changes["latency_percentile"] = float(v) / 100.0
    return replace(profile, **changes)
