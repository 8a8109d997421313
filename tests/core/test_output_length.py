"""The output-length estimate (core/output_length.py): Kaplan-Meier over stops and censored ends, checked
against hand-computed survival curves."""
from __future__ import annotations

import pytest

from tokenmill.core.output_length import OutputLengths


def _lengths(records, min_stops=1, window=512) -> OutputLengths:
    est = OutputLengths(window=window, min_stops=min_stops)
    for n, stopped in records:
        est.record(n, stopped)
    return est


def test_without_censoring_it_is_the_empirical_distribution():
    est = _lengths([(10, True)] * 3 + [(20, True)])
    s = est.survival()
    assert list(s[:10]) == [1.0] * 10 and list(s[10:20]) == [0.25] * 10 and s[20] == 0.0
    assert est.expected_remaining(0, 100) == pytest.approx(12.5)            # the mean length
    assert est.expected_remaining(10, 100) == pytest.approx(10.0)           # only the 20s outlive 10
    assert est.expected_remaining(0, 15) == pytest.approx(10 + 5 * 0.25)    # E[min(X, 15)]


def test_censored_ends_count_as_at_risk_not_as_stops():
    # stops at 5, 10, 12; one ended by its length limit at 8 (its natural length is > 8)
    est = _lengths([(5, True), (8, False), (10, True), (12, True)])
    s = est.survival()
    assert s[4] == 1.0
    assert s[5] == pytest.approx(3 / 4)                    # 1 of 4 at risk stops at 5
    assert s[9] == pytest.approx(3 / 4)                    # the censored end at 8 is no stop
    assert s[10] == pytest.approx(3 / 4 * 1 / 2)           # 1 of the 2 still at risk at 10
    assert s[12] == 0.0


def test_quantiles_of_a_mixture_of_short_and_long_outputs():
    est = _lengths([(12, True)] * 30 + [(100, True)] * 70)
    assert est.remaining_quantile(0, 128, 0.1) == 12       # 30% end at 12 tokens
    assert est.remaining_quantile(0, 128, 0.5) == 100
    assert est.remaining_quantile(20, 128, 0.1) == 80      # past 12, only the long ones are left
    assert est.remaining_quantile(0, 50, 0.5) == 50        # never past the ceiling
    assert est.expected_remaining(0, 128) == pytest.approx(0.3 * 12 + 0.7 * 100)


def test_the_ceiling_until_enough_stops_and_past_every_record():
    est = _lengths([(12, True)] * 3, min_stops=4)
    assert est.survival() is None
    assert est.expected_remaining(2, 128) == 126 and est.remaining_quantile(2, 128, 0.1) == 126
    est.record(12, True)
    assert est.expected_remaining(2, 128) == pytest.approx(10)
    assert est.expected_remaining(40, 128) == 88           # outlived every record: no data, the ceiling
    assert est.remaining_quantile(40, 128, 0.1) == 88


def test_survivors_of_a_censored_tail_run_to_their_ceiling():
    est = _lengths([(10, True)] * 5 + [(64, False)] * 5)   # half stop at 10, half were cut at 64
    assert est.remaining_quantile(11, 256, 0.5) == 245     # nothing past 10 ever stopped
    assert est.expected_remaining(0, 256) == pytest.approx(0.5 * 10 + 0.5 * 256)


def test_only_the_latest_window_counts():
    est = _lengths([(100, True)] * 4 + [(10, True)] * 4, window=4)
    assert est.expected_remaining(0, 128) == pytest.approx(10)


def test_at_least_one_more_token_while_running():
    est = _lengths([(10, True)] * 4)
    assert est.remaining_quantile(9, 128, 0.1) == 1
    assert est.expected_remaining(9, 128) == pytest.approx(1)
    assert est.remaining_quantile(127, 128, 0.5) == 1
