#!/usr/bin/env bash
# Issue 14's device check, run once on a lent GPU machine (H100 or H200), nothing downloaded.
# EXPECTED DURATION: about 4-5 minutes on one H100 (GPU tests ~2 min, capped at 200 s; benchmark ~2-3 min,
# given what is left); every step is capped so that the whole script ends within 6 minutes (TARGET_S=360)
# whatever happens, leaving room in a 15-minute device budget for the machine's start and one rerun.
# Run it as one command, e.g.
#     run(command="bash benchmarks/gpu/check.sh", carry=["benchmarks/gpu/site"], timeout_s=420)
# after benchmarks/gpu/fetch_wheels.sh here (it fills benchmarks/gpu/site/ with pytest and its imports, in
# case the machine lacks them; the machine's own packages are preferred: site/ is appended to sys.path).
# Uses the machine's own torch, transformers and triton; tokenmill runs from src/.
#   0. machine.txt: GPU, driver, versions; pytest must import (else the tests are reported FAILED at once
#      and the benchmark still runs);
#   1. gpu_tests.txt: the full pytest -rA -v output of the tests that exercise the GPU paths (tests/gpu,
#      marked gpu, and the Triton / _scaled_mm kernel tests; tests/layers/test_large_offsets.py last: it
#      allocates ~12 GiB, and an illegal address there would spoil the CUDA context of later tests);
#   2. offline_gpu.json / offline_gpu.txt: benchmarks/gpu/offline_gpu.py on a random-weight
#      Llama-3.1-8B-shaped model in bf16: greedy tokens against transformers (correctness, first), Offline
#      tok/s (BENCH_REQUESTS requests, default 400, ~780 input / 128 output tokens) against transformers on the
#      same weights, batch-1 decode against the bandwidth bound with CUDA graphs and eager. The JSON is
#      rewritten as each figure is measured, so a cut-short run keeps what it measured.
# Results land in $OUT (default /tmp/tokenmill-gpu); exit status 0 only if every step passed.
set -uo pipefail
START=$SECONDS
TARGET_S=${TARGET_S:-360}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-200}
BENCH_REQUESTS=${BENCH_REQUESTS:-400}
BENCH_EXTRA=${BENCH_EXTRA:-}        # more offline_gpu.py arguments (a CPU smoke run of this script: --shape tiny --device cpu)
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# caches outside $OUT: only a few files come back from there (machine.txt, gpu_tests.txt, offline_gpu.{json,txt})
export TOKENMILL_CACHE_DIR="${TMPDIR:-/tmp}/tokenmill-gpu-cache" OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
# The CPU native kernels (csrc/, built on first use: tens of seconds) are not what this run checks: the GPU
# path never loads them, and the CPU engines the GPU tests compare with run the same arithmetic in torch.
export TOKENMILL_NO_NATIVE=1
PY=${PYTHON:-python3}
SITE="$PWD/benchmarks/gpu/site"
status=0

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, transformers, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } 2>&1 \
  | tee "$OUT/machine.txt"

# pytest from the machine, else from site/ (appended: never shadows the machine's own packages)
PYTEST_BOOT='import sys; sys.path.append(sys.argv.pop(1)); import pytest; sys.exit(pytest.main(sys.argv[1:]))'
if $PY -c 'import sys; sys.path.append(sys.argv[1]); import pytest; print("pytest", pytest.__version__, "from", pytest.__file__)' \
        "$SITE" 2>&1 | tee -a "$OUT/machine.txt"; then
  TESTS=(tests/gpu tests/layers/test_triton_attention.py tests/quant/test_triton_weight_only.py
         tests/quant/test_scaled_mm_fp8.py "tests/layers/test_moe_layers.py::test_triton_grouped_gemm_equals_the_grouped_linears"
         tests/quant/test_fp4.py::test_triton_fp4_kernel_is_the_dequantized_matmul tests/layers/test_large_offsets.py)
  timeout -k 10 "$TESTS_TIMEOUT_S" $PY -c "$PYTEST_BOOT" "$SITE" -rA -v -p no:cacheprovider -o addopts="" \
      --durations=15 "${TESTS[@]}" > "$OUT/gpu_tests.txt" 2>&1
  rc=$?
  tail -n 30 "$OUT/gpu_tests.txt"
  [ $rc -eq 124 ] && echo "GPU TESTS TIMED OUT after ${TESTS_TIMEOUT_S} s (partial output in gpu_tests.txt)" | tee -a "$OUT/gpu_tests.txt"
  [ $rc -ne 0 ] && { echo "GPU TESTS FAILED (pytest exit $rc)"; status=1; }
else
  echo "GPU TESTS FAILED: pytest does not import with $PY, from the machine or from $SITE. Run" \
       "benchmarks/gpu/fetch_wheels.sh where pip works and carry benchmarks/gpu/site with the command." \
       | tee "$OUT/gpu_tests.txt"
  status=1
fi

# the benchmark gets what is left of TARGET_S: it skips a phase its estimates say could not end 15 s before
# that (so a slow phase rarely meets the hard stop), and is stopped at the end
left=$(( TARGET_S - (SECONDS - START) - 5 ))
if [ $left -lt 90 ]; then
  echo "BENCHMARK SKIPPED: only ${left} s left of ${TARGET_S} s" | tee "$OUT/offline_gpu.txt"
  status=1
else
  timeout -k 10 "$left" $PY -u benchmarks/gpu/offline_gpu.py --out "$OUT/offline_gpu.json" \
      --requests "$BENCH_REQUESTS" --hf-requests 128 --eager batch1 --time-budget-s $(( left - 15 )) \
      $BENCH_EXTRA > "$OUT/offline_gpu.txt" 2>&1
  rc=$?
  tail -n 45 "$OUT/offline_gpu.txt"
  [ $rc -eq 124 ] && echo "BENCHMARK TIMED OUT after ${left} s (figures so far in offline_gpu.json)" | tee -a "$OUT/offline_gpu.txt"
  [ $rc -ne 0 ] && { echo "BENCHMARK FAILED (exit $rc; 2 = correctness mismatch)"; status=1; }
fi
echo "check.sh: ${SECONDS}s in all (target ${TARGET_S} s), status $status"
exit $status
