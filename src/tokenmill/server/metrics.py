"""Prometheus metrics with vLLM's names under the `tokenmill:` prefix (`--metrics-prefix vllm:` gives gateways
that read vLLM's names exactly those), in a per-app registry.

Latency histograms are observed by the server when a completion finishes, from the engine's
`RequestMetrics` (perf_counter seconds). Gauges and engine-wide counters are read from
`engine.stats()` at scrape time by a custom collector, so they can never drift from the engine.
`kv_cache_usage_perc` is a fraction in [0, 1], as in vLLM despite the name.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.goodput import GoodputTracker

PREFIX = "tokenmill:"   # the default; ServerConfig.metrics_prefix sets another

# Buckets as in vLLM (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Owns the app's registry; `observe_finished` records one finished completion."""

    def __init__(self, engine, model_name: str, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (s)", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens (s)", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish (s)", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled (s)", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token (s)", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish (s)", REQUEST_BUCKETS)
        self.success = Counter(prefix + "request_success", "Finished completions by finish reason",
                               labels + ["finished_reason"], registry=self.registry)
        self.goodput = GoodputTracker(self.registry, model_name, prefix)
        self.registry.register(EngineStatsCollector(engine, model_name, prefix))

    def observe_finished(self, completion: CompletionOutput, params: SamplingParams | None = None) -> None:
        """One finished completion; `params` (its request's) carry the latency targets it is judged by."""
        reason = completion.finish_reason or "unknown"
        self.success.labels(self.model_name, reason).inc()
        m = completion.metrics
        if m is None:
            return
        if params is not None:
            self.goodput.observe(completion, params)
        name = self.model_name
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
        itl = self.itl.labels(name)
        for prev, cur in zip(m.token_times, m.token_times[1:]):
            itl.observe(cur - prev)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(name).observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill.labels(name).observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.finished_time is not None:
            self.decode.labels(name).observe(m.finished_time - m.first_token_time)

    def count_finished(self, num_completions: int, reason: str) -> None:
        """Completions whose final output nobody observes: "abort" (their client went away) or "error"
        (the engine failed their request)."""
        self.success.labels(self.model_name, reason).inc(num_completions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStatsCollector(Collector):
    """Gauges and engine counters, read from `engine.stats()` on every scrape."""

    GAUGES = (("num_requests_running", "num_running", "Requests in the running batch"),
              ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled"),
              ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV blocks in use by requests (0-1)"))
    COUNTERS = (("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed"),
                ("generation_tokens", "generation_tokens_total", "Output tokens generated"),
                ("num_preemptions", "num_preemptions_total", "Requests preempted"),
                ("prefix_cache_queries", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache"),
                ("request_failures", "num_failed_requests_total",
                 "Requests the engine ended with an error, each alone (the engine served on)"))

    def __init__(self, engine, model_name: str, prefix: str = PREFIX) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def describe(self):
        return []   # dynamic: never describe, so registration does not call engine.stats()

    def collect(self):
        dead = GaugeMetricFamily(self.prefix + "engine_dead", "1 once the engine loop has stopped; the server exits",
                                 labels=["model_name"])
        dead.add_metric([self.model_name], float(self.engine.dead is not None))
        yield dead
        stats = self.engine.stats()
        for name, attr, doc in self.GAUGES:
            g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, attr)))
            yield g
        for name, attr, doc in self.COUNTERS:
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, attr)))
            yield c
        yield from self._per_replica()
        yield from self._spec_decode(stats.spec_decode)
        yield from self._cache_size(stats)
        yield from self._expert_load(stats.expert_tokens)
        yield from self._step_time_model()

    def _cache_size(self, stats):
        """The KV cache's real size: bytes per token (K/V heads, or MLA's latent; summed over ranks) and
        tokens it holds (blocks x block size, all replicas)."""
        for name, value, doc in (("kv_cache_bytes_per_token", stats.kv_bytes_per_token,
                                  "Bytes the KV cache takes per token (all layers and ranks)"),
                                 ("kv_cache_capacity_tokens", stats.num_total_blocks * stats.block_size,
                                  "Tokens the KV cache holds (blocks x block size)")):
            g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g

    def _expert_load(self, counts):
        """MoE load balance: (token, expert) pairs per expert index, summed over layers, and the busiest
        expert's share relative to a perfect balance (1.0 = even; absent for dense models)."""
        if counts is None:
            return
        c = CounterMetricFamily(self.prefix + "moe_expert_tokens", "Tokens routed to each expert (all MoE layers)",
                                labels=["model_name", "expert"])
        for expert, value in enumerate(counts):
            c.add_metric([self.model_name, str(expert)], float(value))
        yield c
        g = GaugeMetricFamily(self.prefix + "moe_expert_load_imbalance",
                              "Most tokens routed to one expert over the mean per expert (1 = balanced)",
                              labels=["model_name"])
        mean = sum(counts) / len(counts) if counts else 0.0
        g.add_metric([self.model_name], max(counts) / mean if mean else 1.0)
        yield g

    def _spec_decode(self, spec):
        """Speculative decoding counters, vLLM's spec_decode_* names (absent with speculation off)."""
        if spec is None:
            return
        for name, value, doc in (("num_drafts", spec.num_drafts, "Requests that carried draft tokens into a step"),
                                 ("num_draft_tokens", spec.num_draft_tokens, "Draft tokens verified"),
                                 ("num_accepted_tokens", spec.num_accepted_tokens, "Draft tokens accepted")):
            c = CounterMetricFamily(self.prefix + "spec_decode_" + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(value))
            yield c
        per = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position", labels=["model_name", "position"])
        for i, value in enumerate(spec.accepted_per_position):
            per.add_metric([self.model_name, str(i)], float(value))
        yield per

    def _per_replica(self):
        """Data parallel: the gauges per replica (label `replica`), and whether each is up; the series
        above are the totals."""
        per_replica = getattr(self.engine, "replica_stats", None)     # engines without replicas may lack it
        replicas = per_replica() if callable(per_replica) else []
        if not replicas:
            return
        up = GaugeMetricFamily(self.prefix + "replica_up", "1 while the data-parallel replica serves",
                               labels=["model_name", "replica"])
        gauges = {name: GaugeMetricFamily(self.prefix + "replica_" + name, doc + ", per data-parallel replica",
                                          labels=["model_name", "replica"]) for name, _, doc in self.GAUGES}
        for i, s in enumerate(replicas):
            up.add_metric([self.model_name, str(i)], float(s is not None))
            for name, attr, _ in self.GAUGES:
                if s is not None:
                    gauges[name].add_metric([self.model_name, str(i)], float(getattr(s, attr)))
        yield up
        yield from gauges.values()

    def _step_time_model(self):
        describe = getattr(self.engine, "step_time_model", None)
        if not callable(describe):
            return
        model = describe()
        g = GaugeMetricFamily(self.prefix + "step_time_model_seconds",
                              "The scheduler's step-time model: seconds per unit of each term "
                              "(intercept, per_decode_row, per_prefill_token, per_context_read, per_prefill_step, "
                              "per_mixed_step)",
                              labels=["model_name", "term"])
        for term, value in model["coefficients"].items():
            g.add_metric([self.model_name, term], value)
        yield g
        n = CounterMetricFamily(self.prefix + "step_time_model_observations", "Steps the step-time model was fit on",
                                labels=["model_name"])
        n.add_metric([self.model_name], float(model["observations"]))
        yield n
        r = GaugeMetricFamily(self.prefix + "step_time_model_replicas",
                              "Live data-parallel replicas that each run steps as the step-time model describes",
                              labels=["model_name"])
        r.add_metric([self.model_name], float(model.get("replicas", 1)))
        yield r
        if model.get("decode_yield"):
            y = GaugeMetricFamily(self.prefix + "step_time_model_decode_yield_tokens",
                                  "With speculation: tokens a decoding request computes (kind=new: its token and "
                                  "its drafts) and yields (kind=output) per step, recency-weighted means",
                                  labels=["model_name", "kind"])
            y.add_metric([self.model_name, "new"], model["decode_yield"]["new_tokens"])
            y.add_metric([self.model_name, "output"], model["decode_yield"]["output_tokens"])
            yield y
