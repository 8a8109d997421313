"""`tokenmill serve` parser wiring (the process itself is exercised by every other server test)."""
from __future__ import annotations

import pytest

from tokenmill.cli import build_parser
from tokenmill.config import EngineArgs
from tokenmill.server.cli import serve_command
from tokenmill.server.config import ServerConfig


def test_serve_parser_defaults_to_loopback():
    ns = build_parser().parse_args(["serve"])
    assert ns.func is serve_command
    cfg = ServerConfig.from_cli_args(ns)
    assert (cfg.host, cfg.port, cfg.api_key) == ("127.0.0.1", 8000, None)


def test_serve_parser_reads_server_and_engine_flags():
    ns = build_parser().parse_args(["--log-level", "DEBUG", "serve", "--port", "9001", "--api-key", "k",
                                    "--max-waiting-requests", "7", "--max-n", "3", "--max-logprobs", "4",
                                    "--shutdown-grace-s", "2.5", "--max-num-seqs", "8", "--model", "/m"])
    cfg = ServerConfig.from_cli_args(ns)
    assert (cfg.port, cfg.api_key, cfg.max_waiting_requests, cfg.max_n, cfg.max_logprobs, cfg.shutdown_grace_s,
            cfg.log_level) == (9001, "k", 7, 3, 4, 2.5, "debug")
    engine_args = EngineArgs.from_cli_args(ns)
    assert (engine_args.model, engine_args.max_num_seqs) == ("/m", 8)


@pytest.mark.parametrize("flags", [["--max-n", "0"], ["--max-logprobs", "99"], ["--shutdown-grace-s", "-1"]])
def test_bad_server_flags_exit_with_a_message(flags, capsys):
    ns = build_parser().parse_args(["serve", *flags])
    assert serve_command(ns) == 2
    assert "tokenmill serve:" in capsys.readouterr().err
