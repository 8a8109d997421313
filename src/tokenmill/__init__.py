"""tokenmill: an LLM inference engine. Public API: LLM, AsyncEngine, SamplingParams, EngineArgs."""
from tokenmill.config import EngineArgs
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "EngineArgs", "RequestOutput"]


def __getattr__(name):  # lazy: importing tokenmill stays cheap (torch/transformers load on first use)
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from tokenmill.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "RequestOutput":
        from tokenmill.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
