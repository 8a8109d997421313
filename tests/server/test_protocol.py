"""The request-body Unicode walk (it runs on the event loop, over every body): bounded work whatever the
body holds, and the exact path of the one string at fault."""
from __future__ import annotations

import tracemalloc

from tokenmill.server import protocol
from tokenmill.server.protocol import invalid_unicode_path

NUM_NUMBERS = 1_000_000


def test_numbers_cost_no_allocation_and_the_bad_string_behind_them_is_found(monkeypatch):
    """A million numbers ahead of the culprit: none is text-checked, and the walk's memory stays flat (a
    path kept per element came to 175 MB for this body of 8 MB as JSON, and seconds on the event loop)."""
    tail = {"y": [1.5, None, True, "fine", "café", "bad\udc00"]}
    body = {"prompt": "ok", "no_such_field": [*range(NUM_NUMBERS), tail]}
    checked: list[str] = []
    encodable = protocol._encodable
    monkeypatch.setattr(protocol, "_encodable", lambda text: checked.append(text) or encodable(text))
    tracemalloc.start()
    try:
        path = invalid_unicode_path(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path == ("no_such_field", str(NUM_NUMBERS), "y", "5")
    assert peak < 64 * 1024, peak
    assert all(isinstance(text, str) for text in checked) and len(checked) <= 8, checked


def test_paths_name_keys_indexes_and_the_root():
    assert invalid_unicode_path({"a": ["ok", {"b": "fine"}], "c": 3}) is None
    assert invalid_unicode_path([1, [2, ["x", "\ud800"]]]) == ("1", "1", "1")
    assert invalid_unicode_path({"ok": {"k\ud800": 1}}) == ("ok", "k\\ud800")    # a key, escaped
    assert invalid_unicode_path("\udfff") == ()
    assert invalid_unicode_path(7) is None and invalid_unicode_path(None) is None


def test_nesting_deeper_than_the_recursion_limit():
    body: list = ["\ud800"]
    for _ in range(20_000):
        body = [0, body]
    assert invalid_unicode_path(body) == ("1",) * 20_000 + ("0",)
