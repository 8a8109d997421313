"""The two ways the engine ends a request other than finishing it, as the exceptions its callers see.

- `RequestFailedError`: one request failed inside the engine (its step, its sampling or its output
  processing raised, or it sampled an impossible token). It alone ends; the engine and every other
  request carry on, with the tokens they would have had without it.
- `EngineDeadError`: the engine loop has stopped (shut down, or died of a bug that no single request
  explains). Every in-flight request ends with it, and so does every later one.
"""
from __future__ import annotations


class RequestFailedError(RuntimeError):
    """One request failed in the engine; the message says which request and why."""


class RequestUnavailableError(RequestFailedError):
    """The request failed by no fault of its own (the data-parallel replica serving it died); the engine
    serves on, and the same request may be sent again (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running; nothing more will be served by this engine."""
