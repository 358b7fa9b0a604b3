#!/bin/bash
# Create the Python "witness" environment: gguf 0.19.0, numpy and llama-cpp-python 0.3.36
# compiled from its sdist (CPU only, -march=native), which tests/witness/llama_check.py uses.
#
# usage: setup_witness_env.sh [VENV_DIR]      (default /work/venv-witness)
# env:   LLAMA_CPP_SDIST  path to llama_cpp_python-0.3.36.tar.gz (default /work/ref/...; if the file
#                         is missing, the sdist is fetched from PyPI with --no-binary)
#        JOBS             compile parallelism (default 2)
# Takes ~10-20 min on 2 busy cores (the compile of libllama + ggml dominates).
set -euo pipefail
VENV=${1:-/work/venv-witness}
SDIST=${LLAMA_CPP_SDIST:-/work/ref/llama_cpp_python-0.3.36.tar.gz}
JOBS=${JOBS:-2}

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "gguf==0.19.0" numpy

# Build only libllama/ggml; no tests, examples or tools. GGML_NATIVE=ON targets this machine's CPU.
export CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
if [ -f "$SDIST" ]; then
    "$VENV/bin/pip" install --no-cache-dir -v "$SDIST"
else
    "$VENV/bin/pip" install --no-cache-dir -v --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
fi

"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
import gguf, numpy, llama_cpp
print("gguf", version("gguf"), "numpy", numpy.__version__, "llama_cpp", llama_cpp.__version__)
print(llama_cpp.llama_print_system_info().decode())
PY
