"""A real `python -m tokenmill.server` process on loopback with the tiny random model.

`server` is one process shared by the whole server test session (API key set, small limits so the error
table can reach them); tests that stop or overload a server start their own with `start_server`.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"
MAX_N = 4
MAX_LOGPROBS = 5
MAX_BODY_BYTES = 65536
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tokenmill.server`, or `python -c python_code` with the same arguments (a script that
    patches the engine before it calls tokenmill.server.cli.main); with new_session, in a session (and
    process group) of its own, as a shell starts a job: os.killpg then reaches it, not pytest."""

    def __init__(self, model_dir: str, log_path: str, *extra: str, python_code: str | None = None,
                 new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        entry = ["-c", python_code] if python_code else ["-m", "tokenmill.server"]
        cmd = [sys.executable, *entry, "--model", model_dir, "--port", str(self.port),
               "--num-threads", "1", "--log-level", "warning", *extra]
        self._log = open(log_path, "w")
        self._terminated = False
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=new_session)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def begin_stop(self) -> None:
        """SIGTERM, once (a second one makes the server force its exit)."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.begin_stop()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def start_server(tiny_model_dir, tmp_path_factory):
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        s = ServerProcess(tiny_model_dir, str(log), *extra)
        started.append(s)
        return s
    yield start
    for s in started:                 # every server shuts down at once, then each is waited for
        s.begin_stop()
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    return start_server("--api-key", API_KEY, "--max-n", str(MAX_N), "--max-logprobs", str(MAX_LOGPROBS),
                        "--max-request-body-bytes", str(MAX_BODY_BYTES), "--max-num-seqs", "256",
                        "--max-waiting-requests", "256")


@pytest.fixture(scope="session")
def roomy_server(start_server) -> ServerProcess:
    """The API key, and otherwise the default limits (8 MiB bodies, n up to 16): for large bodies and fuzzing."""
    return start_server("--api-key", API_KEY, "--max-num-seqs", "64")


@pytest.fixture(scope="session")
def model_name(tiny_model_dir) -> str:
    return tiny_model_dir


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (labels as printed, 'name' alone when unlabelled)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in values.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def wait_idle(url: str, timeout_s: float = 20) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is in use; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(url)
        idle = (metric(values, "tokenmill:num_requests_running") == 0
                and metric(values, "tokenmill:num_requests_waiting") == 0
                and metric(values, "tokenmill:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)
