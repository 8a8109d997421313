"""MLPerf early stopping: binomial test at 99% confidence with LoadGen's known answers."""
import pytest

from tokenmill.bench.early_stopping import min_queries, overlatency_odds, server_early_stopping


def test_smallest_runs_that_certify_a_percentile_estimate():
    # t = 1: the worst query sits at the estimate (MLPerf's 662 for p99, 64 for p90).
    assert min_queries(1, 0.99) == 662
    assert min_queries(1, 0.90) == 64


def test_zero_overlatency_server_rule():
    # LoadGen Server with no query over the limit: ceil(log(0.01) / log(p)).
    assert min_queries(0, 0.99) == 459
    assert min_queries(0, 0.90) == 44


def test_min_queries_is_the_boundary():
    for t in (0, 1, 5, 20):
        n = min_queries(t, 0.99)
        assert overlatency_odds(n - t, t, 0.99) < 0.01 <= overlatency_odds(n - t - 1, t, 0.99)


def test_more_overlatency_needs_more_queries():
    counts = [min_queries(t, 0.99) for t in range(0, 30, 3)]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)


def test_server_check():
    ok = server_early_stopping("TTFT", [0.1] * 662, 662, 2.0, 0.99)
    assert ok.passed and ok.num_overlatency == 0
    short = server_early_stopping("TTFT", [0.1] * 400, 400, 2.0, 0.99)
    assert not short.passed and "59 more" in short.message()
    one_over = server_early_stopping("TPOT", [0.05] * 600 + [0.2], 601, 0.1, 0.99)
    assert one_over.num_overlatency == 1 and not one_over.passed   # needs 662


def test_bad_percentile():
    with pytest.raises(ValueError, match="percentile"):
        min_queries(0, 1.0)
