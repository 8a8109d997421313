#!/usr/bin/env bash
# Issue 14's device check, run once on a GPU machine: under 8 minutes on one H200, nothing downloaded.
# Uses the machine's own torch, transformers and triton; tokenmill runs from src/. Pure-Python packages
# the machine may lack (pytest) travel unpacked in benchmarks/gpu/site/ (benchmarks/gpu/fetch_wheels.sh
# fills it here; carry that path with the command), added to PYTHONPATH after the machine's own.
#   1. the GPU tests (tests/gpu, marked gpu) and the Triton kernel tests, on the device;
#   2. benchmarks/gpu/offline_gpu.py: Offline tok/s of a random-weight Llama-3.1-8B-shaped model in bf16
#      (1,000 requests, ~780 input / 128 output tokens) against transformers on the same weights, batch-1
#      decode against the bandwidth bound, CUDA graphs on vs off. One table.
# Results land in $OUT (default /tmp/tokenmill-gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d benchmarks/gpu/site ] && PYTHONPATH="$PYTHONPATH:$PWD/benchmarks/gpu/site"
export TOKENMILL_CACHE_DIR="$OUT/cache" OMP_WAIT_POLICY=PASSIVE
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu \
    tests/layers/test_triton_attention.py tests/quant/test_triton_weight_only.py tests/platforms 2>&1 \
    | tail -40 | tee "$OUT/gpu_tests.txt" || true
timeout 300 $PY benchmarks/gpu/offline_gpu.py --out "$OUT/offline_gpu.json" 2>&1 | tail -40 | tee "$OUT/offline_gpu.txt"
