#!/usr/bin/env bash
# Call C: the watch's address reuse fix and the own-work failure tests, ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" | tee -a $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
ALLSCAN_TEST_RANKS_PER_GPU=2 step 40_faults 170 $P tests/test_faults.py -k "stuck or own_work or dead_rank_on_nccl and scan"
cat $L/summary.txt
