"""ROUGE accuracy checks and efficiency figures."""
import pytest

from tokenmill.bench.accuracy import check_accuracy, evaluate, parse_targets
from tokenmill.bench.efficiency import (Bandwidth, EnergyMeter, compute_efficiency, decode_bytes_per_step,
                                        lookup_bandwidth, resolve_bandwidth)
from tokenmill.bench.records import RequestRecord, Sample


def test_rouge_and_targets():
    samples = [Sample(0, "p", None, 8, reference="The cat sat on the mat."),
               Sample(1, "p", None, 8, reference="Dogs bark loudly at night.")]
    recs = [RequestRecord("a", 0, 0, first_token_s=0.1, completed_s=0.2, num_output_tokens=3,
                          text="The cat sat on the mat."),
            RequestRecord("b", 1, 0, first_token_s=0.1, completed_s=0.2, num_output_tokens=3, text="Cats sleep.")]
    acc = evaluate(samples, recs, {"rouge1": 50.0})
    assert acc["num_scored"] == 2 and acc["gen_len_chars"] == len("The cat sat on the mat.Cats sleep.")
    assert acc["scores"]["rouge1"] == pytest.approx(50.0) and acc["passed"]   # 100 and 0
    assert evaluate(samples, recs, {"rouge1": 90.0})["passed"] is False


def test_accuracy_thresholds():
    ok, _ = check_accuracy({"rouge1": 38.40}, 100, {"rouge1": 38.7792}, 100)   # 99.0% of target
    assert ok
    bad, reasons = check_accuracy({"rouge1": 38.30}, 80, {"rouge1": 38.7792}, 100)
    assert not bad and len(reasons) == 2
    assert parse_targets("rouge1=1,gen_len=5") == {"rouge1": 1.0, "gen_len": 5.0}
    with pytest.raises(ValueError, match="accuracy-targets"):
        parse_targets("bleu=3")


def test_bandwidth_sources():
    assert lookup_bandwidth("NVIDIA H200") == 4800.0
    assert resolve_bandwidth(123.0, "NVIDIA H200", False).source.startswith("user")
    assert resolve_bandwidth(None, "NVIDIA H200", False).gbs == 4800.0
    assert resolve_bandwidth(None, None, False).gbs is None
    measured = resolve_bandwidth(None, None, True)
    assert measured.gbs > 0 and measured.source.startswith("measured")


def test_efficiency_math():
    bps = decode_bytes_per_step(1_000_000_000, 100_000, mean_batch=10, mean_context_tokens=1000)
    assert bps == 2_000_000_000
    e = compute_efficiency(tokens_per_s=4000.0, median_tpot_s=0.02, bytes_per_step=bps, bytes_source="x",
                           bandwidth=Bandwidth(4000.0, "user"), joules=2000.0, energy_source="NVML",
                           total_tokens=10000, usd_per_hour=3.6)
    assert e.tokens_per_s_per_tbs == pytest.approx(1000.0)          # 4000 tok/s / 4 TB/s
    assert e.decode_roofline_fraction == pytest.approx(0.025)       # 2 GB / (0.02 s * 4000 GB/s)
    assert e.tokens_per_joule == pytest.approx(5.0)
    assert e.usd_per_million_tokens == pytest.approx(0.25)         # 3.6 $/h / (4000 * 3600) * 1e6


def test_no_invented_numbers():
    e = compute_efficiency(None, None, None, "n/a", Bandwidth(None, "not available"), None, "not available", 0, None)
    assert (e.tokens_per_s_per_tbs, e.decode_roofline_fraction, e.tokens_per_joule, e.usd_per_million_tokens) == \
        (None, None, None, None)
    m = EnergyMeter()
    m.start()
    j = m.stop_joules()
    assert (j is None) == (m.source == "not available")
