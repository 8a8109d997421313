"""Runs the app under uvicorn with a graceful drain on SIGTERM/SIGINT, and exits non-zero when the engine
loop dies (in-flight requests have had their 503s; a supervisor restarts the process)."""
from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import contextmanager

import uvicorn

from tokenmill.server.api_server import build_app
from tokenmill.server.config import ServerConfig
from tokenmill.server.serving_engine import Serving

logger = logging.getLogger("tokenmill.server")
_ABORT_SLACK_S = 5.0   # after the grace time and the aborts, uvicorn cancels whatever is still running


class _Server(uvicorn.Server):
    """uvicorn plus a drain: the first SIGTERM/SIGINT marks the app as draining (/health 503, new work 503)
    while uvicorn stops accepting connections; in-flight requests may finish for `shutdown_grace_s`, then
    are aborted, so their responses still end properly (finish_reason "abort", `data: [DONE]`)."""

    def __init__(self, config: uvicorn.Config, serving: Serving) -> None:
        super().__init__(config)
        self.serving = serving
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if not self.serving.draining and self.loop is not None:
            grace_s = self.serving.config.shutdown_grace_s
            logger.info("signal %s: draining, %.1f s for in-flight requests", sig, grace_s)
            self.loop.call_soon_threadsafe(self.loop.call_later, grace_s, self._abort_in_flight)
        self.serving.draining = True
        super().handle_exit(sig, frame)

    def engine_died(self, error) -> None:
        """Engine thread: the loop stopped. Shut the server down (uvicorn polls should_exit)."""
        logger.error("shutting down: %s", error)
        self.should_exit = True

    def _abort_in_flight(self) -> None:
        if self.serving.live_calls:
            logger.warning("grace time over: aborting %d in-flight requests", len(self.serving.live_calls))
        asyncio.ensure_future(self.serving.abort_all())


@contextmanager
def _exit_cleanly_on_signals():
    """uvicorn re-raises the signal it caught after shutting down; make that a no-op so we exit with 0."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(engine, config: ServerConfig, max_num_seqs: int) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get `shutdown_grace_s`, then are aborted. Returns 0,
    or 1 when the server did not start or the engine loop died."""
    app = build_app(engine, config, max_num_seqs)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               access_log=False, timeout_graceful_shutdown=config.shutdown_grace_s + _ABORT_SLACK_S,
                               lifespan="off", ws="none")
    server = _Server(uv_config, app.state.serving)
    engine.on_dead(lambda error: engine.died_of_bug and server.engine_died(error))
    logger.info("serving %s on http://%s:%d", engine.model_name, config.host, config.port)
    try:
        with _exit_cleanly_on_signals():
            server.run()
    finally:
        engine.shutdown()
    return 0 if server.started and not engine.died_of_bug else 1
