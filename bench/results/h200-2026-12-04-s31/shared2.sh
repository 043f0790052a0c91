#!/usr/bin/env bash
# Call A: tilelang part 1, build, fault tests and Ulysses/matrix at P = 2..4 with ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl1/*.whl > $L/00_tl1.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" | tee -a $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
ALLSCAN_TEST_RANKS_PER_GPU=2 step 20_faults 260 $P tests/test_faults.py
ALLSCAN_TEST_RANKS_PER_GPU=4 step 21_ulysses 170 $P tests/test_ulysses_gpu.py -k "not auto_times"
ALLSCAN_TEST_RANKS_PER_GPU=4 step 22_matrix 110 $P tests/test_matrix_scan_gpu.py -k "not perf and not head_fill"
cat $L/summary.txt
