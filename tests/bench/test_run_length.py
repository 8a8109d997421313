"""Run-length minimums: which scenario each length option sets, and reports that say when a run is not of
submission length (MLPerf: 600 s; llama3_1-8b.Offline.min_query_count 13,368; Server 100 queries)."""
import argparse

import pytest

from tokenmill.bench.cli import add_bench_parser, config_from_args
from tokenmill.bench.metrics import compute_metrics
from tokenmill.bench.profiles import get_profile
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import RunResult
from tokenmill.bench.verdict import judge


def _profile(*argv):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["bench", *argv, "--url", "http://127.0.0.1:9"])).profile


def _offline_run(queries: int, duration_s: float) -> RunResult:
    recs = [RequestRecord(f"q{i}", i, 0.0, sent_s=0.0, first_token_s=0.1, completed_s=duration_s * (i + 1) / queries,
                          num_output_tokens=4) for i in range(queries)]
    return RunResult("Offline", recs, compute_metrics(recs))


@pytest.mark.parametrize("argv", [["server", "--target-qps", "1", "--with-offline", "--min-duration-s", "600"],
                                  ["server", "--target-qps", "1", "--with-offline", "--min-query-count", "50"],
                                  ["find-peak", "--min-duration-s", "600", "--min-query-count", "50"]])
def test_server_length_options_keep_offlines_own_minimum(argv):
    profile = _profile(*argv)
    assert profile.offline_min_query_count == 13368
    verdict = judge(_offline_run(2000, 600.0), profile)           # 2,000 queries over 600 s
    assert not verdict.valid and "too few queries: 2000 < minimum 13368" in verdict.reasons


def test_min_query_count_sets_the_commands_own_scenario():
    assert _profile("server", "--target-qps", "1", "--min-query-count", "50").server_min_query_count == 50
    offline = _profile("offline", "--min-query-count", "500")
    assert (offline.offline_min_query_count, offline.server_min_query_count) == (500, 100)
    shortened = _profile("server", "--target-qps", "1", "--with-offline", "--offline-min-query-count", "2000")
    assert (shortened.offline_min_query_count, shortened.server_min_query_count) == (2000, 100)


def test_a_run_held_to_fewer_queries_than_mlperf_says_it_is_not_of_submission_length():
    profile = _profile("offline", "--min-duration-s", "600", "--min-query-count", "2000")
    assert not profile.submission_length
    verdict = judge(_offline_run(2000, 600.0), profile)
    assert verdict.valid
    assert any("NOT of submission length" in n and "minimum query count 2000 is below MLPerf's 13368" in n
               for n in verdict.notes)


def test_a_run_short_of_mlperfs_minimums_says_so_even_under_mlperfs_profile():
    verdict = judge(_offline_run(20000, 300.0), get_profile("llama3.1-8b"))
    assert not verdict.valid
    assert any("NOT of submission length" in n and "lasted 300.0 s" in n for n in verdict.notes)


def test_a_full_length_run_has_no_length_note():
    verdict = judge(_offline_run(13368, 600.0), get_profile("llama3.1-8b"))
    assert verdict.valid and not any("submission length" in n for n in verdict.notes)
