#!/usr/bin/env bash
# Installs what allscan needs on a fresh machine and builds it (the C++/CUDA core, the Python
# extension and the benchmark binary), editable, into the current Python environment.
#   - torch: keeps an installed torch (e.g. a CUDA build on a GPU machine); else the CPU build 2.13.0
#   - NCCL: the nvidia-nccl-cu13 wheel unless torch already brings one (one NCCL in the process)
#   - nvcc: the CUDA compiler must be on PATH (or in /usr/local/cuda/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
pkgs=(numpy "pybind11>=2.12" "scikit-build-core>=0.10" pytest pytest-timeout matplotlib ninja "cmake>=3.24")
$PY -c "import torch" 2>/dev/null || pkgs+=("torch==2.13.0")
$PY -c "import nvidia.nccl" 2>/dev/null || pkgs+=("nvidia-nccl-cu13")
$PY -m pip install -q "${pkgs[@]}"
# Optional: the Hugging Face integration's tests and examples/train_sp.py (they skip without it).
$PY -c "import transformers" 2>/dev/null || $PY -m pip install -q "transformers>=5,<6" \
  || echo "setup.sh: transformers not installed; its integration tests will skip"
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
$PY -m pip install -q --no-build-isolation --no-deps -e .
