"""The bench reads a tokenmill server's spec_decode_* counters and reports the acceptance."""
from __future__ import annotations

from tokenmill.bench.report import _spec_decode_lines
from tokenmill.bench.session import spec_decode_from_metrics

METRICS = """# HELP tokenmill:spec_decode_num_drafts_total Requests that carried draft tokens into a step
# TYPE tokenmill:spec_decode_num_drafts_total counter
tokenmill:spec_decode_num_drafts_total{model_name="m"} 10.0
tokenmill:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0
tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7.0
tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 5.0
tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 4.0
"""


def test_counters_parse_and_report():
    s = spec_decode_from_metrics(METRICS)
    assert s == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 25,
                 "accepted_per_position": [9, 7, 5, 4], "mean_acceptance_length": 3.5}
    line = _spec_decode_lines(s)[0]
    assert "mean acceptance length 3.50" in line and "25/40" in line and "90%, 70%, 50%, 40%" in line
    assert spec_decode_from_metrics("tokenmill:num_requests_running 0") is None
