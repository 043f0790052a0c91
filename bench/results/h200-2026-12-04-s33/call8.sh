#!/usr/bin/env bash
# Call 8 (carries .whl; a fresh machine): build; after a review: the halo with its one-thread guard and
# contiguous buffers (values, gradients, capture at P = 2), its refusal after a mismatch with the board
# stopped (the core's own check), its bad arguments and dead peer, NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 80_faults 150 $P tests/test_faults.py -k "halo" &
step 81_halo 150 $P tests/test_gated_deltanet.py -k "halo and 2 or two_gpus" &
wait
cat $L/summary.txt
grep -hE "PASSED|FAILED|SKIPPED" $L/8*.txt
