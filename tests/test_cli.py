"""End-to-end: `tokenmill generate` and `tokenmill chat` as a user runs them."""
from __future__ import annotations

import subprocess
import sys


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
