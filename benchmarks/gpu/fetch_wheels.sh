#!/usr/bin/env bash
# Unpack pytest and every package it imports (pure Python: pytest, pluggy, iniconfig, packaging, pygments, and
# for Python < 3.11 exceptiongroup, tomli) into benchmarks/gpu/site/ (git-ignored), for a device machine that
# reaches no registry and may lack them: carry that path with the command (carry: ["benchmarks/gpu/site"]).
# check.sh appends it to the END of sys.path, so the machine's own packages win and only missing ones come
# from here. Dependencies are resolved for the device's Python (DEVICE_PYTHON, default 3.12: the device
# image's python3), then the unpacked tree is checked by importing pytest from it with no site-packages.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
rm -rf site wheels.tmp && mkdir -p site wheels.tmp
$PY -m pip download --quiet --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation py \
    --abi none --platform any -d wheels.tmp pytest
for whl in wheels.tmp/*.whl; do $PY -m zipfile -e "$whl" site; done
ls wheels.tmp | sed 's/-py.*//' | tr '\n' ' '; echo
rm -rf wheels.tmp
# self-sufficient: pytest imports from site/ and the standard library alone (-S: no site-packages)
$PY -S -c "import sys; sys.path.insert(0, 'site'); import pytest, _pytest.terminal; print('site/ pytest', pytest.__version__, 'imports alone')"
du -sh site
