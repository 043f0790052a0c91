#!/usr/bin/env bash
# Call 3 (the machine warm from call 2): the rest of Ulysses' GPU tests after its signature gained the packed
# sequences' fields (NCCL mismatch, graph replay, compiled, auto), and the transformers integration on it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
export PYTHONPATH=/tmp/site:/tmp/tl
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 30_ulysses_gpu 500 $P tests/test_ulysses_gpu.py -k "not layer_matches" &
step 31_transformers_gpu 500 $P tests/test_integration_transformers.py &
wait
cat $L/summary.txt
