"""`make run`: the main job on the default model (see tokenmill.bench.cli.run_main_job)."""
from __future__ import annotations

import sys


def main() -> int:
    from tokenmill.bench.cli import run_main_job
    return run_main_job("results")


if __name__ == "__main__":
    sys.exit(main())
