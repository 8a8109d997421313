"""Live goodput: how many finished requests met their latency targets (SamplingParams.ttft_target_ms /
tpot_target_ms, from the request or the server's SLO class), as Prometheus counters and a sliding-window
attainment gauge.

Definitions are MLPerf's, per request: TTFT = first token time - arrival; TPOT = (last token time - first
token time) / (output tokens - 1), undefined for a 1-token output (then only TTFT is judged). A request is
good when it met every target it has that is defined. Requests that were aborted or failed are not judged
(they have no latency to judge): request_success counts them."""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import SamplingParams

ATTAINMENT_WINDOW_S = 60.0   # the gauge covers requests that finished this recently


class GoodputTracker:
    def __init__(self, registry: CollectorRegistry, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.targets = Counter(prefix + "slo_requests", "Requests judged against a latency target, by target "
                               "(ttft, tpot) and result (met, missed)", ["model_name", "target", "result"],
                               registry=registry)
        self.good = Counter(prefix + "slo_goodput_requests", "Requests with targets, by whether they met all "
                            "of them (good) or not (bad)", ["model_name", "result"], registry=registry)
        attainment = Gauge(prefix + "slo_attainment", f"Fraction of the requests with targets that finished in "
                           f"the last {ATTAINMENT_WINDOW_S:g} s that met all of them (NaN: none finished)",
                           ["model_name"], registry=registry)
        attainment.labels(model_name).set_function(self.attainment)
        self._window: collections.deque[tuple[float, bool]] = collections.deque()   # (finish time s, good)
        self._lock = threading.Lock()

    def observe(self, completion: CompletionOutput, params: SamplingParams) -> None:
        """Judge one finished completion against its request's targets (nothing to do without targets)."""
        m = completion.metrics
        if (params.ttft_target_ms is None and params.tpot_target_ms is None) or m is None \
                or m.first_token_time is None or completion.finish_reason not in ("stop", "length"):
            return
        results = []
        if params.ttft_target_ms is not None:
            results.append(self._judge("ttft", (m.first_token_time - m.arrival_time) * 1e3, params.ttft_target_ms))
        if params.tpot_target_ms is not None and len(m.token_times) > 1:
            tpot_ms = (m.token_times[-1] - m.first_token_time) * 1e3 / (len(m.token_times) - 1)
            results.append(self._judge("tpot", tpot_ms, params.tpot_target_ms))
        good = all(results)
        self.good.labels(self.model_name, "good" if good else "bad").inc()
        with self._lock:
            self._window.append((time.monotonic(), good))

    def _judge(self, target: str, value_ms: float, target_ms: float) -> bool:
        met = value_ms <= target_ms
        self.targets.labels(self.model_name, target, "met" if met else "missed").inc()
        return met

    def attainment(self) -> float:
        horizon = time.monotonic() - ATTAINMENT_WINDOW_S
        with self._lock:
            while self._window and self._window[0][0] < horizon:
                self._window.popleft()
            if not self._window:
                return float("nan")
            return sum(good for _, good in self._window) / len(self._window)
