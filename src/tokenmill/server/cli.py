"""`tokenmill serve`: parser wiring for the main CLI, and the `python -m tokenmill.server` entry point."""
from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.config import EngineArgs
from tokenmill.server.config import ServerConfig


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def add_serve_parser(subparsers) -> None:
    """Adds `serve` to the main CLI's subparsers; its handler returns the exit code."""
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics",
                                   description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_args(parser)
    parser.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    try:
        server_config = ServerConfig.from_cli_args(args)
    except ValueError as e:
        print(f"tokenmill serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args)
    from tokenmill.engine.async_engine import AsyncEngine   # heavy import: only when serving
    from tokenmill.server.launcher import run_server
    try:
        engine = AsyncEngine(engine_args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"tokenmill serve: could not start the engine: {e}", file=sys.stderr)
        return 1
    return run_server(engine, server_config, max_num_seqs=engine_args.max_num_seqs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.server",
                                     description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_args(parser)
    return serve_command(parser.parse_args(argv))
