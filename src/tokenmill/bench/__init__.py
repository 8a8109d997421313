"""`tokenmill bench`: MLPerf-style benchmarking, against the in-process engine or any OpenAI-compatible URL.

Harness separation as in MLPerf: datasets.py (the QSL), scenarios.py (arrival patterns), sut/ (systems
under test: in-process engine, HTTP). runner.py drives one scenario against one SUT; metrics.py,
early_stopping.py and verdict.py turn records into LoadGen's figures and a VALID/INVALID verdict;
session.py, workflows.py, find_peak.py and sweep.py compose runs; report.py and plots.py write the
outputs; efficiency.py, accuracy.py and loadgen_driver.py add the optional extras; cli.py is the
command line and main_job.py is `make run`.
"""
