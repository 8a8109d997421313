#!/usr/bin/env bash
# A virtual environment with llama-cpp-python built for this CPU (GGML_NATIVE: AVX-512 where present),
# for benchmarks/peers/llama_cpp_decode.py. Building llama.cpp takes several minutes on 2 cores; later
# runs reuse it. Prints the environment's python.
set -euo pipefail
venv=${PEERS_DIR:-/tmp/tokenmill-peers}/llama-cpp-venv
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$venv"
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/pip" install -q llama-cpp-python numpy
fi
echo "$venv/bin/python"
