"""Ctrl-C in the terminal of a `tokenmill serve -tp 2` (SIGINT to its whole process group, worker processes
included) drains the server as it does without workers: the in-flight stream finishes, the server exits 0.
The workers ignore the group's signals (executor/owned_process.py); before, they died at once and the
stream ended with the executor's failure."""
from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from .conftest import ServerProcess
from .test_load import _body, _finish_reasons, _stream_in_thread


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_ctrl_c_drains_a_tensor_parallel_server(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, str(tmp_path / "server.log"), "-tp", "2", "--shutdown-grace-s", "30",
                        new_session=True)
    try:
        results: list = []
        started = threading.Event()
        stream = _stream_in_thread(srv.url, _body(120), results, started)
        assert started.wait(30), "the stream never started"
        os.killpg(srv.proc.pid, signal.SIGINT)            # as the terminal does: to the server's whole group
        stream.join(60)
        assert len(results) == 1, "the stream never ended"
        status, events, _ = results[0]
        assert status == 200 and events[-1] == "[DONE]", (events[-3:], srv.log())
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        assert not errors, (errors, srv.log())             # before: the workers died, the executor failed
        assert _finish_reasons(events) == ["length"]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 120
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.stop()
