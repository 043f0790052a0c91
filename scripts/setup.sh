#!/usr/bin/env bash
# Installs what allscan needs on a fresh machine and builds it (the C++/CUDA core, the Python
# extension and the benchmark binary), editable, into the current Python environment.
#   - torch: keeps an installed torch (e.g. a CUDA build on a GPU machine); else torch 2.13.0, the CPU
#     build (PyTorch's CPU index) where there is no NVIDIA GPU, PyPI's default build where there is one
#   - NCCL: the nvidia-nccl-cu13 wheel unless torch already brings one (one NCCL in the process)
#   - nvcc: the CUDA compiler must be on PATH (or in /usr/local/cuda/bin)
# Each step prints what it does and how long it took (pip itself runs quietly).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
step() { echo "setup.sh [$(( $(date +%s) - t0 ))s] $*"; }

command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
command -v nvcc >/dev/null || { echo "setup.sh: nvcc (the CUDA compiler, CUDA 12 or 13) is needed to build the core," \
  "even without a GPU: install the CUDA toolkit, or put its bin/ on PATH" >&2; exit 1; }

pkgs=(numpy "pybind11>=2.12" "scikit-build-core>=0.10" pytest pytest-timeout matplotlib ninja "cmake>=3.24")
$PY -c "import nvidia.nccl" 2>/dev/null || pkgs+=("nvidia-nccl-cu13")
step "installing the build and test tools: ${pkgs[*]}"
$PY -m pip install -q "${pkgs[@]}"
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    step "installing torch 2.13.0 (CUDA build, a few GB)"
    $PY -m pip install -q "torch==2.13.0"
  else
    step "installing torch 2.13.0 (CPU build, about 200 MB)"
    # The CPU build from a local wheel or index when one serves it, else from PyTorch's CPU index.
    $PY -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || $PY -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# Optional: the Hugging Face integration's tests and examples/train_sp.py (they skip without it).
if ! $PY -c "import transformers" 2>/dev/null; then
  step "installing transformers (optional: the Hugging Face integration)"
  $PY -m pip install -q "transformers>=5,<6" || echo "setup.sh: transformers not installed; its integration tests will skip"
fi
# Optional: flash-linear-attention's models, for the fla integration's CPU tests (they skip without it;
# importing fla needs Triton and einops even where its kernels cannot run). No deps: torch stays as it is.
if ! $PY -c "import fla.models" 2>/dev/null; then
  step "installing flash-linear-attention 0.6.0, triton, einops (optional: the fla integration's tests)"
  { $PY -m pip install -q einops triton && $PY -m pip install -q --no-deps "flash-linear-attention==0.6.0" "fla-core==0.6.0"; } \
    || echo "setup.sh: flash-linear-attention not installed; its integration tests will skip"
fi
step "building allscan (the C++/CUDA core, the Python extension, allscan_perf): 1-3 minutes"
$PY -m pip install -q --no-build-isolation --no-deps -e .
step "done: python3 -m allscan.info shows what was built and found"
