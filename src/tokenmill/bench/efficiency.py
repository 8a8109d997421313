"""Efficiency figures: tokens/s per TB/s of memory bandwidth, decode roofline fraction, tokens per
joule, and cost per million tokens.

Every figure carries its source; where a number cannot be known (no power meter readable, no
bandwidth) it is reported as not available, never invented.
"""
from __future__ import annotations

import glob
import os
import time
from dataclasses import asdict, dataclass

# Peak memory bandwidth, GB/s, from vendors' data sheets (first match of the name wins).
KNOWN_BANDWIDTH_GBS = {
    "H200": 4800.0, "B200": 8000.0, "B100": 8000.0, "GB200": 8000.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0, "A100 80GB": 1935.0, "A100": 1555.0,
    "RTX PRO 6000": 1792.0, "L40S": 864.0, "L4": 300.0, "RTX 4090": 1008.0, "MI300X": 5300.0,
}


@dataclass(frozen=True)
class Bandwidth:
    gbs: float | None          # GB/s (1e9 bytes/s)
    source: str                # "user" | "table: <name>" | "measured: ..." | "not available"


def lookup_bandwidth(device_name: str) -> float | None:
    for key, gbs in KNOWN_BANDWIDTH_GBS.items():
        if key.lower() in device_name.lower():
            return gbs
    return None


def measure_cpu_bandwidth_gbs(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-N copy bandwidth of a large numpy array (read + write bytes counted), GB/s."""
    import numpy as np
    src = np.ones(num_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def resolve_bandwidth(user_gbs: float | None, device_name: str | None, measure_cpu: bool) -> Bandwidth:
    """User value, else the known-GPU table, else a CPU copy measurement (when in-process on CPU)."""
    if user_gbs is not None:
        return Bandwidth(user_gbs, "user (--mem-bandwidth-gbs)")
    if device_name:
        gbs = lookup_bandwidth(device_name)
        if gbs is not None:
            return Bandwidth(gbs, f"table: {device_name}")
    if measure_cpu:
        return Bandwidth(measure_cpu_bandwidth_gbs(), "measured: numpy copy on this CPU")
    return Bandwidth(None, "not available (pass --mem-bandwidth-gbs)")


def local_device_name() -> str | None:
    """The CUDA device's name when one is present, else None (CPU)."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return None


class EnergyMeter:
    """Energy over an interval from NVML (NVIDIA GPUs) or RAPL (/sys/class/powercap), where readable."""

    def __init__(self):
        self.source = "not available"
        self._read = None
        self._start: float | None = None
        self._wrap_j: float | None = None
        self._setup()

    def _setup(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if handles:   # total energy since driver load, mJ
                self._read = lambda: sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1e3
                self._read()
                self.source = f"NVML ({len(handles)} GPU)"
                return
        except Exception:
            self._read = None
        zones = [z for z in glob.glob("/sys/class/powercap/*rapl*:*") if z.count(":") == 1]   # packages only
        readable = [z for z in zones if os.access(os.path.join(z, "energy_uj"), os.R_OK)]
        if readable:
            def read() -> float:   # µJ counters, summed over packages
                return sum(int(open(os.path.join(z, "energy_uj")).read()) for z in readable) / 1e6
            try:
                read()
                self._read = read
                self._wrap_j = sum(int(open(os.path.join(z, "max_energy_range_uj")).read()) for z in readable) / 1e6
                self.source = f"RAPL ({len(readable)} package(s), CPU package energy only)"
            except (OSError, ValueError):
                self._read = None

    def start(self) -> None:
        self._start = self._read() if self._read else None

    def stop_joules(self) -> float | None:
        if self._read is None or self._start is None:
            return None
        joules = self._read() - self._start
        if joules < 0 and self._wrap_j:
            joules += self._wrap_j
        return joules


@dataclass(frozen=True)
class Efficiency:
    tokens_per_s: float | None
    bandwidth_gbs: float | None
    bandwidth_source: str
    tokens_per_s_per_tbs: float | None         # tokens/s per TB/s of memory bandwidth
    decode_bytes_per_step: float | None        # bytes read per decode step (weights + KV of the batch)
    decode_bytes_source: str
    decode_roofline_fraction: float | None     # bytes per step / (TPOT * bandwidth)
    joules: float | None
    energy_source: str
    tokens_per_joule: float | None
    usd_per_hour: float | None
    usd_per_million_tokens: float | None

    def to_json(self) -> dict:
        return asdict(self)


def decode_bytes_per_step(weight_bytes: int | None, kv_bytes_per_token: int | None, mean_batch: float,
                          mean_context_tokens: float) -> float | None:
    """Bytes a decode step reads: all weights once, plus the KV cache of every sequence in the batch."""
    if weight_bytes is None:
        return None
    return weight_bytes + (kv_bytes_per_token or 0) * mean_batch * mean_context_tokens


def compute_efficiency(tokens_per_s: float | None, median_tpot_s: float | None, bytes_per_step: float | None,
                       bytes_source: str, bandwidth: Bandwidth, joules: float | None, energy_source: str,
                       total_tokens: int, usd_per_hour: float | None) -> Efficiency:
    bw = bandwidth.gbs
    per_tbs = tokens_per_s / (bw / 1000.0) if tokens_per_s and bw else None
    roofline = (bytes_per_step / (median_tpot_s * bw * 1e9)
                if bytes_per_step and median_tpot_s and bw else None)
    tpj = total_tokens / joules if joules and joules > 0 else None
    cost = usd_per_hour / (tokens_per_s * 3600.0) * 1e6 if usd_per_hour is not None and tokens_per_s else None
    return Efficiency(tokens_per_s, bw, bandwidth.source, per_tbs, bytes_per_step, bytes_source, roofline,
                      joules, energy_source, tpj, usd_per_hour, cost)
