#!/usr/bin/env bash
# Unpack the pure-Python packages check.sh may need on a device machine (which reaches no registry) into
# benchmarks/gpu/site/ (git-ignored): carry it with the command.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf site wheels.tmp && mkdir -p site wheels.tmp
python3 -m pip download --quiet --no-deps --only-binary=:all: -d wheels.tmp pytest pluggy iniconfig
for whl in wheels.tmp/*.whl; do python3 -m zipfile -e "$whl" site; done
rm -rf wheels.tmp
du -sh site
