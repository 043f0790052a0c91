#!/usr/bin/env bash
# Call 1 (carries .whl, .tl1): build; the fault tests (alone: they time); then, side by side, the
# matrix scan at P = 3, 4, GLA in fp32 against fla, and Ulysses (the all-to-all's check_comm status),
# NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl1/*.whl >> $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
ALLSCAN_TEST_RANKS_PER_GPU=2 step 10_faults 170 $P tests/test_faults.py -k "stuck or signature_switch or bad_argument"
ALLSCAN_TEST_RANKS_PER_GPU=4 step 11_matrix 320 $P tests/test_matrix_scan_gpu.py -k "exact_data_bitwise and 4 or graph_capture and 3 or gradients_and_async and 3" &
ALLSCAN_TEST_RANKS_PER_GPU=2 step 12_gla_fp32 320 $P tests/test_gla_gpu.py -k "whole_sequence and float32" &
ALLSCAN_TEST_RANKS_PER_GPU=4 step 13_ulysses 320 $P tests/test_ulysses_gpu.py -k "not auto_times" &
wait
cat $L/summary.txt
