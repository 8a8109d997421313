"""`tokenmill tune`: the coordinate search (a fake measurement with a known best), the config file it writes,
and the readers of that file (LLM(config=...), the CLI's --config); one end-to-end run on a tiny model."""
from __future__ import annotations

import argparse
import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.config import EngineArgs
from tokenmill.config_file import read_engine_args, write_config
from tokenmill.tune.search import Trial, coordinate_search, parse_space


def _fake_measure(calls):
    def measure(s: dict) -> Trial:
        calls.append(dict(s))
        if s["max_num_seqs"] == 99:
            return Trial(s, None, None, False, 0.0, "ValueError: refused")
        qps = (2.0 if s["scheduling_policy"] == "slo" else 1.0) * (1.0 - abs(s["max_num_seqs"] - 16) / 64)
        qps *= 1.1 if s["long_prefill_token_threshold"] == 64 else 1.0
        return Trial(s, qps, qps * 100, True, 0.0)
    return measure


def test_coordinate_search_finds_the_best_setting_and_measures_each_once():
    space = {"scheduling_policy": ["fcfs", "slo"], "max_num_seqs": [8, 16, 99, 64],
             "long_prefill_token_threshold": [0, 64]}
    calls = []
    result = coordinate_search(space, _fake_measure(calls))
    assert result.best.settings == {"scheduling_policy": "slo", "max_num_seqs": 16, "long_prefill_token_threshold": 64}
    keys = [tuple(sorted(c.items())) for c in calls]
    assert len(keys) == len(set(keys)) == 6               # 2 + 3 new + 1 new: repeats come from the cache
    assert any(t.error for t in result.trials) and not result.stopped_early


def test_a_knob_with_dict_values_is_searched_and_measured_once_each():
    """speculative_config's values are dicts (unhashable): each is still measured once."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    calls = []

    def measure(s: dict) -> Trial:
        calls.append(s)
        qps = 1.5 if s["speculative_config"] == ngram else 1.0
        return Trial(s, qps, qps * 100, True, 0.0)
    result = coordinate_search({"scheduling_policy": ["fcfs", "slo"], "speculative_config": [None, ngram]}, measure)
    assert result.best.settings == {"scheduling_policy": "fcfs", "speculative_config": ngram}
    assert len(calls) == 3                                 # slo+None, fcfs+None, fcfs+ngram


def test_the_trial_cap_stops_the_search_with_the_best_so_far():
    result = coordinate_search({"scheduling_policy": ["fcfs", "slo"], "max_num_seqs": [8, 16, 64],
                                "long_prefill_token_threshold": [0]}, _fake_measure([]), max_trials=3)
    assert len(result.trials) == 3 and result.stopped_early
    assert result.best.settings["scheduling_policy"] == "slo"


def test_search_space_parsing_and_its_errors():
    assert parse_space(["max_num_seqs=8,16", "num-threads=none,2", "enable_prefix_caching=false"]) == {
        "max_num_seqs": [8, 16], "num_threads": [None, 2], "enable_prefix_caching": [False]}
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert parse_space(['speculative_config=none, {"method": "ngram", "num_speculative_tokens": 4}',
                        "data_parallel_size=1,2"]) == {"speculative_config": [None, ngram],
                                                       "data_parallel_size": [1, 2]}
    assert parse_space(['speculative_config={"method": "a,{b"}']) == {"speculative_config": [{"method": "a,{b"}]}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_space(["speculative_config={method: ngram}"])
    with pytest.raises(ValueError, match="unbalanced"):
        parse_space(['speculative_config={"method": "ngram"'])
    with pytest.raises(ValueError, match="not a tunable"):
        parse_space(["warp_speed=9"])
    with pytest.raises(ValueError, match="expected knob=value1,value2"):
        parse_space(["max_num_seqs"])


def test_config_files_round_trip_and_bad_ones_say_what_is_wrong(tmp_path):
    path = str(tmp_path / "c.json")
    write_config(path, {"scheduling_policy": "slo", "max_num_seqs": 12}, {"peak_qps": 1.5})
    assert read_engine_args(path) == {"scheduling_policy": "slo", "max_num_seqs": 12}
    (tmp_path / "bad.json").write_text(json.dumps({"engine_args": {"max_num_seq": 3}}))
    with pytest.raises(ValueError, match=r"unknown engine arguments \['max_num_seq'\]"):
        read_engine_args(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="engine_args"):
        read_engine_args(str(tmp_path / "list.json"))
    (tmp_path / "nested.json").write_text(json.dumps({"engine_args": {"max_num_seqs": [1]}}))
    with pytest.raises(ValueError, match="max_num_seqs must be a number"):
        read_engine_args(str(tmp_path / "nested.json"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_engine_args(str(tmp_path / "missing.json"))


def test_cli_flags_given_override_the_file_and_the_rest_comes_from_it(tmp_path):
    path = str(tmp_path / "c.json")
    write_config(path, {"scheduling_policy": "slo", "max_num_seqs": 12, "block_size": 8})
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--config", path, "--max-num-seqs", "20"]))
    assert (args.scheduling_policy, args.max_num_seqs, args.block_size) == ("slo", 20, 8)


def test_tune_end_to_end_writes_a_config_that_llm_and_serve_read(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "tuned.json"
    code = main(["tune", "--model", tiny_model_dir, "--kv-cache-memory-bytes", str(8 << 20),
                 "--space", "scheduling_policy=fcfs,slo", "--space", "max_num_seqs=4",
                 "--num-samples", "8", "--prompt-len", "8", "--output-len", "4",
                 "--min-duration-s", "0.5", "--min-query-count", "6", "--max-runs", "2", "--start-qps", "2",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["engine_args"]["model"] == tiny_model_dir
    assert data["engine_args"]["scheduling_policy"] in ("fcfs", "slo") and data["engine_args"]["max_num_seqs"] == 4
    assert len(data["tuned"]["trials"]) == 2 and data["tuned"]["peak_qps"] > 0
    llm = LLM(config=str(out), max_num_seqs=2)
    assert llm.engine.config.scheduler.max_num_seqs == 2
    assert llm.engine.config.scheduler.policy == data["engine_args"]["scheduling_policy"]
    assert llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
