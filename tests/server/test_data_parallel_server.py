"""`tokenmill serve --data-parallel-size 2`: concurrent clients through the official openai client, the
totals and the per-replica series in /metrics, every block free afterwards; a replica killed under load
answers its requests 503 with the reason while the other replica's complete, and the server serves on."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx

import openai
import pytest

from tests.server.conftest import API_KEY, metric, wait_idle

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")


def test_two_replicas_behind_one_server(start_server, model_name):
    server = start_server("--api-key", API_KEY, "--data-parallel-size", "2", "--max-num-seqs", "32")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)

    def complete(i: int) -> int:
        out = client.completions.create(model=model_name, prompt=f"hello {i}", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(complete, range(24))) == [6] * 24
    values = wait_idle(server.url)
    assert metric(values, "tokenmill:num_requests_running") == 0
    assert metric(values, "tokenmill:kv_cache_usage_perc") == 0
    for replica in ("0", "1"):
        assert metric(values, "tokenmill:replica_up", replica=replica) == 1
    assert metric(values, "tokenmill:generation_tokens_total") >= 24 * 6


def _replica_pids(server_pid: int) -> list[int]:
    """The server's multiprocessing children that run replicas (spawn_main), not its resource tracker."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    pids = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            pids.append(pid)
    return pids


def _both_replicas_running(url: str, timeout_s: float = 20.0) -> bool:
    """Whether /metrics shows requests running on both replicas within timeout_s (polled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [l for l in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                 if l.split("{", 1)[0].endswith("replica_num_requests_running")]
        if len(lines) == 2 and all(float(l.rsplit(" ", 1)[1]) > 0 for l in lines):
            return True
        time.sleep(0.05)
    return False


def test_a_killed_replica_answers_503_and_the_server_serves_on(start_server, model_name):
    server = start_server("--api-key", API_KEY, "--data-parallel-size", "2", "--max-num-seqs", "32")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model_name, "prompt": "tell me", "max_tokens": 480, "temperature": 0, "ignore_eos": True}

    def post(_):
        return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(post, i) for i in range(16)]
        assert _both_replicas_running(server.url)            # the kill lands mid-generation, not after it
        pids = _replica_pids(server.proc.pid)
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        responses = [f.result() for f in futures]
    codes = sorted(r.status_code for r in responses)
    assert 503 in codes and codes.count(200) >= 1, codes
    unavailable = next(r for r in responses if r.status_code == 503)
    assert "replica" in unavailable.json()["error"]["message"] and unavailable.headers["retry-after"] == "1"
    after = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 4}, headers=headers, timeout=60)
    assert after.status_code == 200
