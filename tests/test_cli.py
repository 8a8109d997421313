"""End-to-end: `tokenmill generate` and `tokenmill chat` as a user runs them."""
from __future__ import annotations

import subprocess
import sys

import pytest

import tokenmill.cli as cli


def run_cli(args, stdin: str | None = None, timeout: int = 180):
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_streams_text_and_reports(tiny_model_dir):
    r = run_cli(["generate", "Hello there", "--model", tiny_model_dir, "--max-tokens", "5", "--ignore-eos",
                 "--kv-cache-memory-bytes", str(1 << 22)])
    assert r.returncode == 0, r.stderr
    assert "5 generated (finish: length)" in r.stderr
    assert r.stdout.strip() != ""


def test_generate_with_speculation_reports_its_acceptance(tiny_model_dir):
    r = run_cli(["generate", "one two three one two three one two three one two", "--model", tiny_model_dir,
                 "--max-tokens", "12", "--ignore-eos", "--temperature", "0", "--stats", "--kv-cache-memory-bytes",
                 str(1 << 22), "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert r.returncode == 0, r.stderr
    assert "12 generated" in r.stderr and "draft tokens accepted; by position" in r.stderr


def test_generate_bad_option_is_a_clear_error(tiny_model_dir):
    r = run_cli(["generate", "x", "--model", tiny_model_dir, "--temperature", "-1"])
    assert r.returncode == 2
    assert "temperature" in r.stderr and "Traceback" not in r.stderr


def test_chat_keeps_the_conversation(tiny_model_dir):
    import re
    r = run_cli(["chat", "--model", tiny_model_dir, "--max-tokens", "4", "--ignore-eos", "--stats",
                 "--kv-cache-memory-bytes", str(1 << 22)], stdin="hello\nand again\n/reset\nhello\n/exit\n")
    assert r.returncode == 0, r.stderr
    prompts = [int(n) for n in re.findall(r"\[(\d+) prompt tokens, 4 generated\]", r.stderr)]
    assert len(prompts) == 3
    assert prompts[1] > prompts[0] + 4          # the second turn carries the first exchange
    assert prompts[2] == prompts[0]             # /reset starts over


def test_a_bad_log_level_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--log-level", "verbose", "generate", "x"])
    assert e.value.code == 2
    assert "argument --log-level: invalid choice: 'VERBOSE' (choose from" in capsys.readouterr().err


def test_bad_engine_numbers_and_paths_are_clear_errors(tiny_model_dir, capsys):
    """--num-threads and --max-model-len must be >= 1 when given; a tokenizer path that does not exist is
    named like a missing model path: exit 2, one line, no traceback."""
    base = ["generate", "x", "--model", tiny_model_dir]
    for flags, message in [(["--num-threads", "-1"], "num_threads must be an integer >= 1 (or None: torch's "
                                                      "thread count), got -1"),
                           (["--num-threads", "0"], "num_threads must be an integer >= 1"),
                           (["--max-model-len", "-5"], "max_model_len must be an integer >= 1 (or None: the "
                                                       "model's max_position_embeddings), got -5"),
                           (["--max-model-len", "0"], "max_model_len must be an integer >= 1"),
                           (["--tokenizer", "/nonexistent/tok"], "tokenizer path '/nonexistent/tok' does not exist")]:
        assert cli.main(base + flags) == 2, flags
        err = capsys.readouterr().err
        assert f"tokenmill: error: {message}" in err and "Traceback" not in err


def test_os_and_runtime_errors_are_one_line_errors(monkeypatch, capsys):
    """An OSError is the user's (a path): one line. A RuntimeError may be an internal one: one line and how to
    see where it was raised; --log-level debug prints the traceback."""
    hint = "tokenmill: (--log-level debug prints where it was raised)\n"
    for error, extra in ((OSError("cannot read the tokenizer"), ""), (RuntimeError("set_num_threads failed"), hint)):
        def failing(ns, error=error):
            raise error
        monkeypatch.setattr(cli, "cmd_generate", failing)
        assert cli.main(["generate", "x"]) == 2
        assert capsys.readouterr().err == f"tokenmill: error: {error}\n{extra}"
    assert cli.main(["--log-level", "debug", "generate", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: error: set_num_threads failed\nTraceback") and "in failing" in err


def test_scheduler_config_needs_a_positive_max_model_len():
    from tokenmill.config import SchedulerConfig
    with pytest.raises(ValueError, match="max_model_len must be >= 1, got -1"):
        SchedulerConfig(max_model_len=-1)
