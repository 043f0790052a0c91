#!/usr/bin/env bash
# Call 6 (a fresh machine; carries .whl): the packed KDA and hybrid KDA models' fp32 logits, fla's and
# allscan's sequence-parallel ones, each against the fp64 answer (probes/packed_error.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2 TRITON_F32_DEFAULT=ieee
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/tests
cd tests && timeout -k 5 300 python3 ../bench/results/h200-2026-12-04-s35/probes/packed_error.py 2>&1 | grep -v Warn > $L/60_packed_error.txt
tail -4 $L/60_packed_error.txt
