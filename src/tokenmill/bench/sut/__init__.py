"""Systems under test: the in-process engine and any OpenAI-compatible HTTP endpoint."""
from tokenmill.bench.sut.base import SUT, Clock

__all__ = ["SUT", "Clock"]
