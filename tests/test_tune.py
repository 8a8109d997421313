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
    braces = {"method": "draft_model", "model": "a,{b", "num_speculative_tokens": 2}
    assert parse_space(['speculative_config={"method": "draft_model", "model": "a,{b", "num_speculative_tokens": 2}'
                        ]) == {"speculative_config": [braces]}
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
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer, got \[1\] \(list\)"):
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


def test_a_mistyped_space_value_names_the_knob_and_the_value():
    with pytest.raises(ValueError, match=r"'max_num_seqs=abc,4': max_num_seqs must be an integer, got 'abc'"):
        parse_space(["max_num_seqs=abc,4"])
    with pytest.raises(ValueError, match=r"enable_prefix_caching must be a boolean \(true or false\), got 1"):
        parse_space(["enable_prefix_caching=1,false"])
    with pytest.raises(ValueError, match=r"speculative_config: missing \['num_speculative_tokens'\]"):
        parse_space(['speculative_config=none,{"method": "ngram"}'])
    assert parse_space(["kv_cache_memory_fraction=0.5,1"]) == {"kv_cache_memory_fraction": [0.5, 1]}


def _tune_ns(*flags):
    from tokenmill.cli import build_parser
    return build_parser().parse_args(["tune", *flags])


def test_a_trial_whose_settings_raise_type_error_is_an_errored_trial_not_an_abort(tiny_model_dir):
    import tokenmill.tune.cli as tc
    from tokenmill.bench.cli import config_from_args
    ns = _tune_ns("--model", tiny_model_dir)
    measure = tc._measure(config_from_args(ns), ns)
    trial = measure({"warp_speed": 9})                   # dataclasses.replace: TypeError (unexpected keyword)
    assert trial.peak_qps is None and trial.error.startswith("TypeError")
    trial = measure({"max_num_seqs": "8"})               # EngineArgs' type check
    assert trial.error.startswith("ValueError: max_num_seqs must be an integer")


def _fake_trials(monkeypatch, calls):
    import tokenmill.tune.cli as tc

    def measure_factory(base, ns):
        def measure(settings: dict) -> Trial:
            calls.append(settings)
            return Trial(settings, 2.0, 100.0, True, 1.0)
        return measure
    monkeypatch.setattr(tc, "_measure", measure_factory)


def test_tune_checks_out_before_the_first_trial(tiny_model_dir, tmp_path, monkeypatch, capsys):
    calls = []
    _fake_trials(monkeypatch, calls)
    base = ["tune", "--model", tiny_model_dir, "--space", "max_num_seqs=4,8", "--no-progress", "--out"]
    missing = tmp_path / "no_such_dir"
    assert main(base + [str(missing / "tuned.json")]) == 2
    assert f"--out '{missing / 'tuned.json'}': its directory '{missing}' does not exist" in capsys.readouterr().err
    assert calls == []
    assert main(base + [str(tmp_path)]) == 2
    assert "is a directory; expected the config file's path" in capsys.readouterr().err and calls == []
    assert main(base + [str(tmp_path / "tuned.json")]) == 0 and len(calls) == 2


def test_tune_honours_no_progress_refuses_report_options_and_a_zero_trial_cap(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    calls = []
    _fake_trials(monkeypatch, calls)
    base = ["tune", "--model", tiny_model_dir, "--space", "max_num_seqs=4,8", "--out", str(tmp_path / "t.json")]
    assert main(base + ["--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "best: {'max_num_seqs': 4}" in out and "trials \u2501" not in out and "100%" not in out
    assert main(base) == 0 and "trials \u2501" in capsys.readouterr().out       # the bar without --no-progress
    for option in (["--out-dir", "x"], ["--name", "x"], ["--strict"], ["--mem-bandwidth-gbs", "1"],
                   ["--usd-per-hour", "1"], ["--weights-bytes", "1"], ["--kv-bytes-per-token", "1"]):
        with pytest.raises(SystemExit) as e:
            main(base + option)
        assert e.value.code == 2 and f"unrecognized arguments: {option[0]}" in capsys.readouterr().err
    calls.clear()
    assert main(base + ["--max-trials", "0"]) == 2
    assert "--max-trials must be >= 1 (leave it out for no cap), got 0" in capsys.readouterr().err and calls == []


def test_explicit_flags_override_the_file_even_at_their_default_values(tmp_path):
    path = str(tmp_path / "c.json")
    write_config(path, {"scheduling_policy": "slo", "max_num_seqs": 24, "enable_prefix_caching": False})
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def args(*flags):
        return EngineArgs.from_cli_args(parser.parse_args(["--config", path, *flags]))
    a = args("--scheduling-policy", "fcfs", "--max-num-seqs", "256")
    assert (a.scheduling_policy, a.max_num_seqs, a.enable_prefix_caching) == ("fcfs", 256, False)
    assert args("--enable-prefix-caching").enable_prefix_caching is True
    assert args().enable_prefix_caching is False and args().scheduling_policy == "slo"
    write_config(path, {"enable_prefix_caching": True})
    assert args("--no-prefix-caching").enable_prefix_caching is False
    assert args("--no-enable-prefix-caching").enable_prefix_caching is False
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-prefix-caching"])).enable_prefix_caching is False


def test_a_tuned_speculative_config_round_trips_through_the_file(tiny_model_dir, tmp_path):
    """tune writes speculative_config as a JSON object; read_engine_args, serve's --config and LLM(config=)
    take it and the engine speculates with it."""
    from tokenmill.config import SpeculativeConfig
    from tokenmill.server.cli import add_serve_args
    space = parse_space(['speculative_config=none,{"method": "ngram", "num_speculative_tokens": 3}'])
    path = write_config(str(tmp_path / "spec.json"), {"speculative_config": space["speculative_config"][1]},
                        {"peak_qps": 1.0})
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert read_engine_args(path) == {"speculative_config": ngram}
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--config", path])).speculative_config == ngram
    llm = LLM(config=path, model=tiny_model_dir, kv_cache_memory_bytes=1 << 22)
    assert llm.engine.config.speculative == SpeculativeConfig("ngram", 3)
    out = llm.generate("one two one two one two", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    (tmp_path / "bad.json").write_text(json.dumps({"engine_args": {"speculative_config": {"method": "ngram"}}}))
    with pytest.raises(ValueError, match=r"bad.json': speculative_config: missing \['num_speculative_tokens'\]"):
        read_engine_args(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("value, match", [
    ("false", r"enable_prefix_caching must be a boolean \(true or false\), got 'false' \(str\)"),
    ("8", r"max_num_seqs must be an integer, got '8' \(str\)"),
    (8.5, r"max_num_seqs must be an integer, got 8.5 \(float\)"),
    (True, r"max_num_seqs must be an integer, got True \(bool\)"),
    ([0.5], r"kv_cache_memory_fraction must be a number, got \[0.5\] \(list\)")])
def test_config_file_values_must_have_their_fields_types(tmp_path, value, match):
    name = match.split(" must")[0]
    path = tmp_path / "typed.json"
    path.write_text(json.dumps({"tokenmill_config": 1, "engine_args": {name: value}}))
    with pytest.raises(ValueError, match=f"typed.json': {match}"):
        read_engine_args(str(path))
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{name: value})


def test_engine_args_numbers_take_their_type():
    assert EngineArgs(kv_cache_memory_fraction=1, gpu_memory_utilization=0.5).kv_cache_memory_fraction == 1
    with pytest.raises(ValueError, match=r"num_threads must be an integer or null \(None\), got 2.0 \(float\)"):
        EngineArgs(num_threads=2.0)


def test_engine_args_take_path_objects_and_numpy_numbers_as_plain_values(tmp_path):
    import numpy as np
    args = EngineArgs(model=tmp_path, max_num_seqs=np.int64(8), gpu_memory_utilization=np.float32(0.5))
    assert args.model == str(tmp_path) and type(args.model) is str
    assert args.max_num_seqs == 8 and type(args.max_num_seqs) is int
    assert type(args.gpu_memory_utilization) is float
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer"):
        EngineArgs(max_num_seqs=np.float64(8.5))


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
