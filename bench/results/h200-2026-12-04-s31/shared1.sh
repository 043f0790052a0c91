#!/usr/bin/env bash
# Session 31: NCCL ranks sharing one GPU (socket transport, distinct NCCL_HOSTID), correctness only.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
export PYTHONPATH=/tmp/site
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export ALLSCAN_TEST_RANKS_PER_GPU=${RPG:-2}
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" | tee -a $L/summary.txt; }
step 10_scan_sizes 150 python3 -m pytest -x -v -p no:cacheprovider -m gpu tests/test_scan_gpu.py -k "sizes"
step 11_scan_rest 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_scan_gpu.py -k "not sizes and not async_result and not async_overlap"
step 12_matrix 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_matrix_scan_gpu.py
cat $L/summary.txt
